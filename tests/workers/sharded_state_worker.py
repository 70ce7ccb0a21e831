"""Trains a state sharded by a callable init over 4 CPU devices; stopped, resumed, compared.

argv: directory mesh_kind ("auto" or "explicit"); both backends run. Prints OK on success.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import loopkit  # noqa: E402
from loopkit.testing import assert_same_state  # noqa: E402

directory, kind = sys.argv[1:3]
axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
mesh = jax.make_mesh((4,), ("d",), axis_types=(axis_type,))
rows, replicated = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())


def init():
    w = jax.device_put(jnp.arange(32.0).reshape(8, 4), rows)
    return {"w": w, "lr": 0.5, "key": jax.random.key(0), "b": jax.device_put(jnp.zeros(4), replicated)}


def step(s):
    key, sub = jax.random.split(s["key"])
    w = s["w"] * 0.9 + s["lr"] * jax.random.normal(sub, s["w"].shape)
    return {"w": w, "lr": s["lr"], "key": key, "b": s["b"] + w.sum(0)}, {"loss": w.sum()}


kw = dict(progress=False, disable=("summaries",), save_model_secs=None, autoload=False,
          data_sharding=None)
for backend in ("orbax", "npz"):
    logdir = os.path.join(directory, backend)
    with jax.set_mesh(mesh):
        want = loopkit.train(step, init=init, max_steps=6, **kw).state
        for n in (2, 4, 6):  # stopped, resumed, resumed again
            got = loopkit.train(step, init=init, logdir=logdir, checkpoint_backend=backend,
                                max_steps=n, **kw).state
    assert_same_state(got, want)
    assert got["w"].sharding.is_equivalent_to(rows, 2), got["w"].sharding
    assert len(got["w"].sharding.device_set) == 4
print("OK", flush=True)
