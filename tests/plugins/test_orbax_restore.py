"""The orbax backend's restore: every layout orbax writes, read back exactly, and damage reported."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from loopkit.errors import CheckpointError
from loopkit.plugins.checkpoint.backends.orbax import OrbaxBackend
from loopkit.state.pytree import abstract


def many_leaves():
    rng = np.random.default_rng(1)
    return {"layers": [{"w": jnp.asarray(rng.standard_normal((3, 5), np.float32)),
                        "b": jnp.full((5,), i, jnp.bfloat16)} for i in range(40)],
            "big": jnp.asarray(rng.standard_normal(300_000, np.float32)),
            "mask": jnp.asarray([True, False, True]),
            "count": jnp.asarray(7, jnp.int32),
            "host": np.arange(12, dtype=np.int64).reshape(3, 4)}


@pytest.mark.parametrize("ocdbt,zarr3", [(True, True), (True, False), (False, True), (False, False)])
def test_every_orbax_layout_restores_exactly_and_orbax_alone_reads_it(tmp_path, ocdbt, zarr3):
    state = many_leaves()
    backend = OrbaxBackend(tmp_path, use_ocdbt=ocdbt, use_zarr3=zarr3)
    backend.save(3, state, {"step": 3})
    backend.wait()
    got, meta = backend.restore(3, abstract(state))
    assert meta == {"step": 3}
    assert jax.tree.structure(got) == jax.tree.structure(state)
    for want, have in zip(jax.tree.leaves(state), jax.tree.leaves(got)):
        assert type(have) is type(want) and have.dtype == want.dtype and have.shape == want.shape
        np.testing.assert_array_equal(np.asarray(have), np.asarray(want))
    part = backend.restore_leaves(3, ["layers/7/b", "big"])
    np.testing.assert_array_equal(part["layers/7/b"], np.full(5, 7, jnp.bfloat16))
    np.testing.assert_array_equal(part["big"], state["big"])
    backend.close()
    with ocp.StandardCheckpointer() as ck:  # no lock-in
        plain = ck.restore(backend.path(3), jax.eval_shape(lambda: state))
    np.testing.assert_array_equal(plain["layers"][39]["w"], state["layers"][39]["w"])


def test_restored_arrays_are_independent_of_each_other_and_of_later_restores(tmp_path):
    state = many_leaves()
    backend = OrbaxBackend(tmp_path)
    backend.save(1, state, {})
    backend.wait()
    first, _ = backend.restore(1, abstract(state))
    second, _ = backend.restore(1, abstract(state))
    second["host"][0, 0] = 100  # host leaves come back writable and not shared
    assert first["host"][0, 0] == 0
    np.testing.assert_array_equal(first["big"] + 1, np.asarray(state["big"]) + 1)
    backend.close()


def test_missing_array_data_is_a_checkpoint_error_naming_the_checkpoint(tmp_path):
    state = many_leaves()
    backend = OrbaxBackend(tmp_path)
    backend.save(2, state, {})
    backend.wait()
    shutil.rmtree(backend.path(2) / "d")  # the OCDBT data files: the arrays' bytes
    with pytest.raises(CheckpointError, match=str(backend.path(2))):
        backend.restore(2, abstract(state))
    backend.close()
