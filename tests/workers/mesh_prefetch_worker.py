"""A 2x2 FSDP/tensor-parallel step over 4 forced CPU devices, batches placed by loopkit.

Run as a script (XLA_FLAGS must be set before jax starts):
    mesh_prefetch_worker.py LOGDIR REDUCE STEPS
Prints "OK <step>" after a normal stop. With batches placed by a prefetch thread
XLA:CPU's all-reduce rendezvous starved and the process aborted (SIGABRT).
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import loopkit  # noqa: E402

logdir, reduce, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def init():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.device_put(jax.random.normal(k1, (64, 128)) * .05,
                                 NamedSharding(mesh, P("fsdp", "tensor"))),
            "w2": jax.device_put(jax.random.normal(k2, (128, 64)) * .05,
                                 NamedSharding(mesh, P("tensor", "fsdp")))}


def step(s, b):
    def loss(p):
        return jnp.mean((jnp.tanh(b @ p["w1"]) @ p["w2"] - b) ** 2)

    value, g = jax.value_and_grad(loss)(s)
    gnorm = jnp.sqrt(sum(jnp.sum(d * d) for d in jax.tree.leaves(g)))
    return jax.tree.map(lambda w, d: w - .1 * d, s, g), {"loss": value, "gnorm": gnorm}


def data(start):
    for i in range(start, 10**9):
        yield np.random.default_rng(i).normal(size=(16, 64)).astype(np.float32)


r = loopkit.train(step, init=init, data=data, data_sharding=NamedSharding(mesh, P()),
                  max_steps=steps, logdir=logdir, checkpoint_backend=None,
                  save_summaries_steps=100, save_summaries_secs=None, summary_reduce=reduce,
                  progress=False, autoload=False)
assert r.state["w1"].sharding == NamedSharding(mesh, P("fsdp", "tensor")), r.state["w1"].sharding
print("OK", r.step, flush=True)
