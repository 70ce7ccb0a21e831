"""The npz backend's own member reader: headers read in one piece or in several, alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopkit.plugins.checkpoint.backends.npz as npz_backend
from loopkit.plugins.checkpoint.backends.npz import NpzBackend


def state():
    return {"w": jnp.arange(12.0).reshape(3, 4), "deep": np.ones((1,) * 60 + (2,), np.int16),
            "h": jnp.ones(5, jnp.bfloat16), "s": np.float32(2.5), "many": [np.full(3, i) for i in range(20)]}


# 512: headers read at once; the others end inside the zip header, the .npy magic,
# its length field or the .npy header, so the rest is read separately
@pytest.mark.parametrize("head", [512, 20, 40, 64, 66])
def test_restore_reads_every_member_whatever_part_of_its_headers_the_first_read_holds(
        tmp_path, monkeypatch, head):
    want = state()
    backend = NpzBackend(tmp_path)
    backend.save(1, want, {"step": 1})
    monkeypatch.setattr(npz_backend, "_HEAD", head)
    got, meta = backend.restore(1, want)
    assert meta == {"step": 1}
    assert got["deep"].shape == want["deep"].shape
    for key in ("w", "deep", "h", "s"):
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]))
        assert np.asarray(got[key]).dtype == np.asarray(want[key]).dtype
    for i, leaf in enumerate(got["many"]):
        np.testing.assert_array_equal(leaf, np.full(3, i))


def test_what_the_writer_stores_numpy_reads_back_as_it_was(tmp_path):
    """Each distinct .npy header is made once; numpy's own reader agrees with every member."""
    want = {"f": np.asfortranarray(np.arange(12.0).reshape(3, 4)), "b": np.array([True, False]),
            "s": np.float32(2.5), "e": np.zeros((0, 3)), "i": np.arange(10, dtype=np.int64),
            "same": [np.full((2, 3), i, np.float32) for i in range(5)]}
    backend = NpzBackend(tmp_path)
    backend.save(1, want, {})
    got, _ = backend.restore(1)
    leaves_want, leaves_got = jax.tree.leaves(want), jax.tree.leaves(got)
    assert len(leaves_got) == len(leaves_want)
    for w, g in zip(leaves_want, leaves_got):
        assert np.asarray(g).dtype == np.asarray(w).dtype and np.asarray(g).shape == np.shape(w)
        np.testing.assert_array_equal(np.asarray(g), w)
    with np.load(backend.path(1), allow_pickle=False) as z:  # numpy's reader, every member
        members = {name: z[name] for name in z.files}
    assert any(a.shape == (3, 4) and np.array_equal(a, want["f"]) for a in members.values())
    assert sum(a.shape == (2, 3) for a in members.values()) == 5
