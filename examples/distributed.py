"""Data-parallel training on `jax.distributed`: every process runs this same program.

Two processes on one machine (CPU, gloo collectives over localhost):

    python examples/distributed.py --num-processes 2 --process-id 0 &
    python examples/distributed.py --num-processes 2 --process-id 1

On a cluster, drop the flags: `jax.distributed.initialize()` reads the
scheduler's environment (SLURM: SLURM_JOB_NODELIST, SLURM_NTASKS, SLURM_PROCID...;
also Open MPI and Cloud TPU). Process 0 is the chief: it writes the summaries
and the `checkpoint` file; every process takes part in each orbax save. Kill
both and start them again: they agree on the checkpoint to resume from. A
SIGTERM to any one process stops all of them at the same step, with one final
checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

GLOBAL_BATCH = 64


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", default="127.0.0.1:12355")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--logdir", default="runs/distributed")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--backend", default="orbax")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(message)s")
    logging.getLogger("loopkit").setLevel(logging.INFO)

    # CPU collectives across processes go through gloo (GPU/TPU have their own)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.num_processes is not None:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    else:
        jax.distributed.initialize()  # from the cluster scheduler's environment

    import loopkit  # after initialize: loopkit asks jax for the process index

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    replicated = NamedSharding(mesh, P())        # the state: the same on every device
    batch_sharding = NamedSharding(mesh, P("data"))  # a batch: split along the data axis
    true_w = np.linspace(-1.0, 1.0, 8).astype(np.float32)

    def init():
        # same seed in every process: the replicated state is the same everywhere
        return jax.device_put({"w": jnp.zeros(8), "b": jnp.zeros(())}, replicated)

    def data(start_step):
        # this process's rows of each global batch, a pure function of the step
        n = jax.process_count()
        rows = slice(jax.process_index() * GLOBAL_BATCH // n,
                     (jax.process_index() + 1) * GLOBAL_BATCH // n)
        step = start_step
        while True:
            x = np.random.default_rng(step).normal(size=(GLOBAL_BATCH, 8)).astype(np.float32)
            y = x @ true_w + 0.5
            yield x[rows], y[rows]
            step += 1

    def step_fn(state, batch):
        x, y = batch

        def loss_fn(s):
            return jnp.mean((x @ s["w"] + s["b"] - y) ** 2)  # a mean over the global batch

        loss, grads = jax.value_and_grad(loss_fn)(state)
        return jax.tree.map(lambda p, g: p - 0.05 * g, state, grads), {"loss": loss}

    result = loopkit.train(
        step_fn, init=init, data=data, data_sharding=batch_sharding, logdir=args.logdir,
        max_steps=args.steps, save_model_secs=20, save_summaries_secs=10,
        checkpoint_backend=args.backend,
    )
    w = np.asarray(jax.device_get(result.state["w"]))
    print(f"process {jax.process_index()}: stopped at step {result.step} "
          f"({result.stop_reason}); |w - true_w| = {np.abs(w - true_w).max():.4f}", flush=True)
    jax.distributed.shutdown()
    return result


if __name__ == "__main__":
    main()
