"""The npz backend's own member reader: headers read in one piece or in several, alike."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import loopkit.plugins.npz_backend as npz_backend
from loopkit.plugins.npz_backend import NpzBackend


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
