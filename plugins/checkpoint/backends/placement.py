"""Placing restored leaves like a ``like`` tree: which become jax arrays, with which sharding.

Shared by the built-in backends and the readers of others' formats. A restored leaf
becomes a jax array only where ``like`` has an array of its shape there (never cast),
and every array is placed in one batch (`put_all`): a `jax.device_put` per leaf costs
tens of µs of Python, which thousands of leaves add up.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np

from loopkit.pytree import is_key, leaf_path


def like_leaves(like: Any) -> dict[str, Any]:
    """``like``'s leaves by leaf path (empty for None)."""
    if like is None:
        return {}
    flat, _ = jax.tree_util.tree_flatten_with_path(like)
    return {leaf_path(kp): leaf for kp, leaf in flat}


def placement(like_leaf: Any, shape: tuple[int, ...], dtype: np.dtype) -> tuple[bool, Any]:
    """(as a jax array?, sharding or None) for a stored leaf next to ``like_leaf``.

    A leaf becomes a jax array when ``like`` has a jax array or abstract leaf of
    the same shape there, and jax can hold its dtype as is (not float64 without
    x64: never cast); it takes that leaf's sharding (None: the default device).
    Anything else comes back as stored, on the host. A typed key in ``like`` places
    its stored key data (the key's shape and trailing implementation dims).
    """
    if (isinstance(like_leaf, (jax.Array, jax.ShapeDtypeStruct)) and is_key(like_leaf.dtype)
            and tuple(like_leaf.shape) == tuple(shape)[:len(like_leaf.shape)]
            and np.dtype(dtype) == np.uint32):
        return True, getattr(like_leaf, "sharding", None)
    if (isinstance(like_leaf, (jax.Array, jax.ShapeDtypeStruct))
            and not is_key(like_leaf.dtype)
            and tuple(like_leaf.shape) == tuple(shape)
            and jax.dtypes.canonicalize_dtype(dtype) == dtype):
        return True, getattr(like_leaf, "sharding", None)
    return False, None


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary.

    jax's CPU backend places such an array without copying it (numpy's own start
    16 bytes into a page): a restore then touches its memory once, not twice.
    """
    size = math.prod(shape) * dtype.itemsize
    buf = np.empty(size + 64, np.uint8)
    start = -buf.__array_interface__["data"][0] % 64
    return np.ndarray(shape, dtype, buf, start)


def put_into(values: list[Any], at: Sequence[int], shardings: Sequence[Any]) -> None:
    """Replace ``values[i]``, for each ``i`` in ``at``, by it placed with its sharding (one batch)."""
    for i, x in zip(at, put_all([np.asarray(values[i]) for i in at], shardings)):
        values[i] = x


def put_all(arrays: Sequence[np.ndarray], shardings: Sequence[Any]) -> list[jax.Array]:
    """Each array as a jax array with its sharding (None: the default device).

    Batched: one `jax.device_put` for all that this process holds whole (a call
    per leaf costs tens of µs of Python, which thousands of leaves add up).
    """
    out: list[Any] = [None] * len(arrays)
    default = [i for i, s in enumerate(shardings) if s is None]
    given = [i for i, s in enumerate(shardings) if s is not None and s.is_fully_addressable]
    if default:
        for i, x in zip(default, jax.device_put([arrays[i] for i in default])):
            out[i] = x
    if given:
        for i, x in zip(given, jax.device_put([arrays[i] for i in given],
                                              [shardings[i] for i in given])):
            out[i] = x
    for i, s in enumerate(shardings):
        if out[i] is None:
            arr = arrays[i]
            out[i] = jax.make_array_from_callback(arr.shape, s, lambda index, a=arr: a[index])
    return out
