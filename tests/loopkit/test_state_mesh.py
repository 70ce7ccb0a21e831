"""States built under `jax.set_mesh` (explicit axes, as flax NNX's `Rngs` under a mesh)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import loopkit


def _step(s):
    key, sub = jax.random.split(s["key"])
    return {"key": key, "w": s["w"] + jax.random.uniform(sub)}, {}


def _init():
    return {"key": jax.random.key(0), "w": jnp.zeros(())}


def test_a_typed_key_made_under_a_mesh_trains():
    # gemma port: a scalar key's sharding describes its uint32[2] data, spec P(None,)
    mesh = jax.make_mesh((1,), ("data",))
    with jax.set_mesh(mesh):
        r = loopkit.train(_step, init={"key": jax.random.key(0), "w": jnp.zeros(())},
                          max_steps=2, progress=False, autoload=False)
    assert r.step == 2 and jax.dtypes.issubdtype(r.state["key"].dtype, jax.dtypes.prng_key)


@pytest.mark.parametrize("backend", ["orbax", "npz"])
def test_a_typed_key_under_a_mesh_resumes_bitwise(tmp_path, backend):
    mesh = jax.make_mesh((1,), ("data",))
    kw = dict(checkpoint_backend=backend, progress=False, autoload=False)
    with jax.set_mesh(mesh):
        loopkit.train(_step, init=_init, max_steps=2, logdir=tmp_path, **kw)
        resumed = loopkit.train(_step, init=_init, max_steps=4, logdir=tmp_path, **kw)
        straight = loopkit.train(_step, init=_init, max_steps=4, **kw)
    assert resumed.step == 4
    assert jnp.array_equal(resumed.state["w"], straight.state["w"])
    assert jnp.array_equal(jax.random.key_data(resumed.state["key"]),
                           jax.random.key_data(straight.state["key"]))
    assert resumed.state["key"].sharding == straight.state["key"].sharding
