"""One process of a two-process job for tests/plugins/test_replica_check.py: the copies
of a replicated leaf live on two processes with two CPU devices each.

    python replica_procs_worker.py LOGDIR PROCESS_ID PORT CASE

CASE ``raise``: the copy of "w" on the mesh's last device (process 1's second) is
perturbed at step `BAD` (a `shard_map` with the replication check off; no callback,
which a step over several processes could not hold); ``clean``: no fault. Checks every
`EVERY` steps, under ``on_guard="raise"``. Prints one JSON line: the outcome.
"""

import json
import logging
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

N, BAD, EVERY = 30, 13, 5


def main():
    logdir, me, port, case = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, me, initialization_timeout=60)
    import jax.numpy as jnp
    import numpy as np
    from jax import shard_map
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import loopkit

    mesh = Mesh(np.array(jax.devices()), ("d",))
    fault = 1e-3 if case == "raise" else 0.0

    def perturb(w, n):
        def on_each(w, n):  # the last device's copy only
            return jnp.where((jax.lax.axis_index("d") == 3) & (n == BAD - 1), w + fault, w)

        return shard_map(on_each, mesh=mesh, in_specs=(P(), P()), out_specs=P(),
                         check_vma=False)(w, n)

    def step_fn(state, x):
        w = perturb(state["w"] * 0.9 + jnp.sin(state["w"]) * 0.1 + x, state["n"])
        return {"w": w, "shard": state["shard"] + x, "n": state["n"] + 1}, {"loss": jnp.mean(w)}

    def init():
        rep = NamedSharding(mesh, P())
        return {"w": jax.device_put(jnp.linspace(0.0, 1.0, 64, dtype=jnp.float32), rep),
                "shard": jax.device_put(jnp.zeros(8, jnp.float32), NamedSharding(mesh, P("d"))),
                "n": jax.device_put(jnp.zeros((), jnp.int32), rep)}

    def data(start):
        i = start
        while True:
            yield np.float32((i * 37 % 11 + 1) / 11)
            i += 1

    errors = []

    class Errors(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.ERROR:
                errors.append(record.getMessage())

    logging.getLogger("loopkit").addHandler(Errors())
    out = {"process": me, "devices": [[d.process_index, d.id] for d in mesh.devices.flat]}
    try:
        r = loopkit.train(step_fn, init=init, data=data, logdir=logdir, max_steps=N,
                          replica_check_steps=EVERY, on_guard="raise", save_model_steps=10,
                          save_model_secs=None, save_summaries_secs=None, progress=False)
        out["step"] = r.step
    except loopkit.ReplicaMismatchError as e:
        out["error"] = [str(e), e.leaf, e.step, e.process, e.device]
    out["errors"] = errors
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
