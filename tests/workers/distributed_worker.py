"""One process of a data-parallel loopkit job, for tests/test_distributed.py.

    python distributed_worker.py LOGDIR OUT NUM_PROCESSES PROCESS_ID PORT MAX_STEPS
        [--step-sleep S] [--save-secs S] [--save-steps N]
"""

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("logdir")
    p.add_argument("out")
    p.add_argument("num_processes", type=int)
    p.add_argument("process_id", type=int)
    p.add_argument("port", type=int)
    p.add_argument("max_steps", type=int)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--save-secs", type=float, default=None)
    p.add_argument("--save-steps", type=int, default=None)
    args = p.parse_args()
    if args.num_processes > 1:
        jax.distributed.initialize(f"127.0.0.1:{args.port}", args.num_processes,
                                   args.process_id, initialization_timeout=60)

    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import loopkit

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P("data"))
    true_w = np.linspace(-1.0, 1.0, 8).astype(np.float32)

    def init():
        return jax.device_put({"w": jnp.zeros(8), "b": jnp.zeros(())}, replicated)

    def data(start_step):
        n, i = jax.process_count(), jax.process_index()
        rows = slice(i * 16 // n, (i + 1) * 16 // n)
        step = start_step
        while True:
            x = np.random.default_rng(step).normal(size=(16, 8)).astype(np.float32)
            yield x[rows], (x @ true_w + 0.5)[rows]
            step += 1

    def step_fn(state, batch):
        x, y = batch
        loss, g = jax.value_and_grad(lambda s: jnp.mean((x @ s["w"] + s["b"] - y) ** 2))(state)
        return jax.tree.map(lambda a, b: a - 0.05 * b, state, g), {"loss": loss}

    class Pace:
        """Makes this process slower than the others, and says when it is running."""

        @loopkit.hookimpl
        def session_create(self, session):
            print(f"READY {session.step}", flush=True)

        @loopkit.hookimpl
        def after_step(self, step):
            if args.step_sleep:
                time.sleep(args.step_sleep)

    r = loopkit.train(step_fn, init=init, data=data, data_sharding=batch_sharding,
                      logdir=args.logdir, max_steps=args.max_steps, plugins=[Pace()],
                      save_model_secs=args.save_secs, save_model_steps=args.save_steps,
                      save_summaries_steps=5, progress=False)
    state = jax.device_get(r.state)
    np.savez(args.out, w=state["w"], b=state["b"], step=r.step)
    print(f"RESULT {r.step} {r.stop_reason}", flush=True)
    if args.num_processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    sys.exit(main())
