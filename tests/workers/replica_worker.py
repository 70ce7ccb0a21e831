"""One case of tests/plugins/test_replica_check.py on 4 CPU devices (XLA_FLAGS must be set
before jax starts, so each case is a fresh process).

    python replica_worker.py LOGDIR CASE

CASE ``raise`` / ``rollback`` / ``replay``: a replicated leaf's copy on device 2 is
perturbed once, the first time step `BAD` runs (a host counter behind an
`io_callback`: the same batch, the step's output differs), and the run goes on
under that `on_guard`; ``clean``: the same run with no fault; ``many``: `MANY`
clean steps checked at every step. Prints one JSON line: the outcome.
"""

import json
import logging
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import shard_map  # noqa: E402
from jax.experimental import io_callback  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import loopkit  # noqa: E402

N = 40  # steps
BAD = 23  # the step whose first run corrupts device 2's copy of "w"
EVERY = 5  # replica_check_steps; saves every 10 steps
MANY = 1000

mesh = Mesh(np.array(jax.devices()), ("d",))
runs: dict[int, int] = {}


def corrupt_once(i):
    """1.0 the first time the batch of step BAD is trained, else 0.0 (host side)."""
    i = int(i)
    runs[i] = runs.get(i, 0) + 1
    return np.float32(1.0 if i == BAD - 1 and runs[i] == 1 and FAULT else 0.0)


def perturb(w, flag):
    def on_each(w, flag):  # device 2's copy only; the check of replication is off
        return jnp.where((jax.lax.axis_index("d") == 2) & (flag > 0), w + 1e-3, w)

    return shard_map(on_each, mesh=mesh, in_specs=(P(), P()), out_specs=P(),
                     check_vma=False)(w, flag)


def step_fn(state, batch):
    flag = io_callback(corrupt_once, jax.ShapeDtypeStruct((), jnp.float32), batch["i"])
    w = perturb(state["w"] * 0.9 + jnp.sin(state["w"]) * 0.1 + batch["x"], flag)
    shard = state["shard"] + batch["x"]  # sharded: its parts differ, no copies to compare
    return {"w": w, "shard": shard, "n": state["n"] + 1}, {"loss": jnp.mean(w)}


def init():
    rep = NamedSharding(mesh, P())
    return {"w": jax.device_put(jnp.linspace(0.0, 1.0, 64, dtype=jnp.float32), rep),
            "shard": jax.device_put(jnp.zeros(8, jnp.float32), NamedSharding(mesh, P("d"))),
            "n": jax.device_put(jnp.zeros((), jnp.int32), rep)}


def data(start):
    i = start
    while True:
        yield {"x": np.float32((i * 37 % 11 + 1) / 11), "i": np.int32(i)}
        i += 1


class Rollbacks:
    def __init__(self):
        self.seen = []

    @loopkit.hookimpl
    def on_rollback(self, session, record):
        self.seen.append([record.step, record.restored_step, list(record.skipped),
                          record.metric])


class Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main():
    global FAULT
    logdir, case = sys.argv[1], sys.argv[2]
    FAULT = case in ("raise", "rollback", "replay")
    errors = Errors()
    logging.getLogger("loopkit").addHandler(errors)
    rec = Rollbacks()
    steps = MANY if case == "many" else N
    fields = dict(max_steps=steps, replica_check_steps=1 if case == "many" else EVERY,
                  save_model_steps=None if case == "many" else 10, save_model_secs=None, save_summaries_secs=None,
                  progress=False, logdir=logdir, plugins=[rec],
                  on_guard=case if case in ("raise", "rollback", "replay") else "raise")
    out = {"case": case}
    t0 = time.perf_counter()
    try:
        r = loopkit.train(step_fn, init=init, data=data, **fields)
        out["w"] = np.asarray(r.state["w"]).tobytes().hex()
        out["shard"] = np.asarray(r.state["shard"]).tobytes().hex()
        out["n"], out["step"] = int(r.state["n"]), r.step
        out["copies_equal"] = len({np.asarray(s.data).tobytes()
                                   for s in r.state["w"].addressable_shards}) == 1
    except loopkit.ReplicaMismatchError as e:
        out["error"] = [str(e), e.leaf, e.step, e.process, e.device]
    out["secs"] = time.perf_counter() - t0
    out["errors"], out["rollbacks"] = errors.lines, rec.seen
    from loopkit.plugins.goodput.records import Fault, read_records

    out["faults"] = [[f.cause, f.step, f.process, f.device, f.detail, f.host]
                     for f in read_records(logdir) if isinstance(f, Fault)]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
