"""One process of a two-process data-parallel job whose processes each read their own
shard through a stateful iterator (get_state/set_state), for tests/test_distributed.py.

    python position_worker.py LOGDIR PROCESS_ID PORT MAX_STEPS [LOCAL_DIR]

Process i reads records i, i + 2, i + 4, ... (its state: which shard, which record
next); the two halves form each step's global batch (`Config.data_sharding`). Prints
``POS <shard> <next>`` where the session opened (the restored position),
``TIER <tier>`` (which tier it restored from) and ``W <state hex> <step>`` at the end.
With LOCAL_DIR, a local tier saved every 3 steps beside the durable one (every 5).
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")


class Shard:
    """Records ``shard``, ``shard + count``, ...: one process's part of the data."""

    def __init__(self, shard, count, make):
        self.state = {"shard": shard, "next": 0}
        self.count, self.make = count, make

    def __iter__(self):
        return self

    def __next__(self):
        record = self.state["shard"] + self.count * self.state["next"]
        self.state = {**self.state, "next": self.state["next"] + 1}
        return self.make(record)

    def get_state(self):
        return dict(self.state)

    def set_state(self, state):
        self.state = dict(state)


def main():
    logdir, me, port, max_steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    local = sys.argv[5] if len(sys.argv) > 5 else None
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, me, initialization_timeout=60)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import loopkit
    from loopkit.plugins.checkpoint import RESTORED_TIER

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    true_w = np.linspace(-1.0, 1.0, 8).astype(np.float32)

    def make(record):
        x = np.random.default_rng(record).normal(size=(4, 8)).astype(np.float32)
        return x, x @ true_w + 0.5

    def init():
        return {"w": jax.device_put(jnp.zeros(8), NamedSharding(mesh, P()))}

    def step_fn(state, batch):
        x, y = batch
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(state["w"])
        return {"w": state["w"] - 0.05 * g}, {"loss": loss}

    class Show:
        @loopkit.hookimpl
        def session_create(self, session):
            pos = session.input.source.get_state()
            print(f"POS {pos['shard']} {pos['next']}", flush=True)
            print(f"TIER {session.stash.get(RESTORED_TIER)}", flush=True)

    tiers = {} if local is None else dict(local_checkpoint_dir=local, save_local_steps=3,
                                          save_local_secs=None)
    r = loopkit.train(step_fn, init=init, data=Shard(me, 2, make),
                      data_sharding=NamedSharding(mesh, P("data")), logdir=logdir,
                      max_steps=max_steps, save_model_steps=5, save_model_secs=None,
                      progress=False, plugins=[Show()], **tiers)
    print("W", np.asarray(jax.device_get(r.state["w"])).tobytes().hex(), r.step, flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
