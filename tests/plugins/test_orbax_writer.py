"""The orbax backend's batched writer: orbax's own bytes, thousands of leaves, errors surfaced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

from loopkit.errors import CheckpointError
from loopkit.plugins.checkpoint.backends.orbax import OrbaxBackend


def mixed_state(n: int) -> dict:
    """``n`` leaves of assorted shapes and dtypes, as a deep model's optimiser state has."""
    rng = np.random.default_rng(0)
    dtypes = [np.float32, jnp.bfloat16, np.int8, np.bool_, np.float16, np.uint32]
    shapes = [(), (7,), (3, 5), (2, 1, 4), (64,)]
    return {"layers": [{"p": jnp.asarray(rng.standard_normal(shapes[i % 5]) * 3,
                                         dtypes[i % len(dtypes)])} for i in range(n)],
            "host": np.arange(6, dtype=np.int64).reshape(2, 3)}


def database(path) -> dict[bytes, bytes]:
    """Every key and value of the checkpoint's OCDBT database (orbax's merged root)."""
    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
    return {k: store.read(k).result().value for k in store.list().result()}


def test_the_batched_writer_stores_byte_for_byte_what_orbax_itself_stores(tmp_path):
    state = mixed_state(1500)
    backend = OrbaxBackend(tmp_path / "loopkit")
    backend.save(1, state, {})
    backend.wait()
    backend.close()
    # orbax's own NumpyHandler, given the same numpy arrays, with the backend's options
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False, use_zarr3=True)) as ck:
        ck.save(tmp_path / "orbax", args=ocp.args.PyTreeSave(jax.tree.map(np.asarray, state)))
    ours, theirs = database(backend.path(1)), database(tmp_path / "orbax")
    assert len(ours) == 2 * 1501  # a zarr.json and a chunk per array
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if ours[k] != theirs[k]] == []
    # and orbax alone restores it into the state's own structure
    with ocp.StandardCheckpointer() as ck:
        plain = ck.restore(backend.path(1), jax.eval_shape(lambda: state))
    # (the int64 host leaf is left out: jax.eval_shape makes it int32 without x64)
    for want, got in zip(jax.tree.leaves(state["layers"]), jax.tree.leaves(plain["layers"])):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_dtypes_numpy_names_alike_are_stored_each_as_itself(tmp_path):
    # int4 and float8_e4m3fn both have the dtype string '<V1' (tensorstore has no uint4)
    state = {"a": jnp.asarray([1, 2, -3, 0], jnp.int4),
             "b": jnp.asarray([1.5, 2.5, -3, 0.25], jnp.float8_e4m3fn)}
    backend = OrbaxBackend(tmp_path)
    backend.save(1, state, {})
    backend.wait()
    got, _ = backend.restore(1, state)
    backend.close()
    with ocp.StandardCheckpointer() as ck:
        plain = ck.restore(backend.path(1), jax.eval_shape(lambda: state))
    for restored in (got, plain):
        for key, want in state.items():
            assert restored[key].dtype == want.dtype, key
            np.testing.assert_array_equal(np.asarray(restored[key], np.float32),
                                          np.asarray(want, np.float32))


def test_thousands_of_leaves_restore_exactly_through_loopkit(tmp_path):
    state = mixed_state(4096)
    backend = OrbaxBackend(tmp_path)
    backend.save(5, state, {"n": 4096})
    backend.wait()
    got, meta = backend.restore(5, state)
    assert meta == {"n": 4096}
    for want, have in zip(jax.tree.leaves(state), jax.tree.leaves(got)):
        assert type(have) is type(want) and have.dtype == want.dtype and have.shape == want.shape
        np.testing.assert_array_equal(np.asarray(have), np.asarray(want))
    backend.close()


def test_an_array_orbax_cannot_store_fails_the_save_and_the_next_one_commits(tmp_path):
    backend = OrbaxBackend(tmp_path)
    bad = {"w": jnp.ones(3), "when": np.array(["2026-11-22"], "M8[D]"),
           "stack": [np.ones(4, np.float32) * i for i in range(50)]}
    backend.save(1, bad, {})
    with pytest.raises(CheckpointError, match=r"model\.ckpt-1.*datetime64"):
        backend.wait()
    assert backend.steps() == []
    good = {"w": jnp.ones(3), "stack": [np.ones(4, np.float32) * i for i in range(50)]}
    backend.save(2, good, {})
    backend.wait()
    assert backend.steps() == [2]
    got, _ = backend.restore(2, good)
    np.testing.assert_array_equal(got["stack"][49], good["stack"][49])
    backend.close()


def test_jax_arrays_spread_over_devices_are_stored_as_orbax_s_array_handler_stores_them(
        tmp_path):
    """The writer's batched handler for jax arrays (what a process holds of a leaf spread
    over processes) against orbax's own `ArrayHandler`, on 4 devices: the same keys and
    bytes (shards, replica-parallel cuts, bf16, int4, a typed key's data), the same
    ``_sharding`` entries, and plain orbax restores it into the shardings."""
    worker = Path(__file__).with_name("sharded_writer_worker.py")
    done = subprocess.run([sys.executable, str(worker), str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["same_keys"] and result["differing"] == [], result
    assert "rows/c/3/0" in result["keys"]  # a replicated leaf written in 4 cuts, one a replica
    assert result["same_shardings"] and result["sharded"] == 7, result
    assert result["restored"], result
