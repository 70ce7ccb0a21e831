"""Leaf records: how the built-in backends describe a pytree's leaves in JSON.

Shared by the `npz` and `orbax` backends (and usable by a plugin's): one record per
leaf (its path, kind, dtype name and shape; Python scalars and strings inline), nesting
stored leaves back into dicts, placing them like a ``like`` tree, and the lock and
clean-up of temporaries in a checkpoint directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator, Sequence

import jax
import ml_dtypes
import numpy as np

from loopkit.errors import CheckpointError
from loopkit.fs import fsync_dir
from loopkit.pytree import is_key, leaf_path

log = logging.getLogger("loopkit")

_PY_TYPES = (bool, int, float, str)


# -- leaf records, shared with the orbax backend -----------------------------------


def dtype_name(dtype: np.dtype) -> str:
    """A name `dtype_from_name` turns back into ``dtype`` (numpy's own, or an ml_dtypes name)."""
    dtype = np.dtype(dtype)
    if dtype.name in ml_dtypes.__all__:  # bfloat16, float8_e4m3fn, int4, ...
        return dtype.name
    if dtype.kind in "OV":
        raise TypeError(f"dtype {dtype} is not supported (objects would need pickling)")
    return dtype.str


def dtype_from_name(name: str) -> np.dtype:
    """The dtype ``name`` stands for; only numpy's and ml_dtypes' names are accepted."""
    if not isinstance(name, str):
        raise TypeError(f"a dtype name must be a string, not {name!r}")
    if name in ml_dtypes.__all__:
        return np.dtype(getattr(ml_dtypes, name))
    dtype = np.dtype(name)  # raises TypeError for anything it does not know
    if dtype.kind in "OV":
        raise TypeError(f"dtype {name!r} is not a plain array dtype")
    return dtype


def leaf_records(state: Any) -> tuple[list[dict], list[Any]]:
    """One JSON-able record per leaf of ``state`` (None leaves included), and the leaves.

    A record holds ``path`` (the keys, as strings), ``kind`` (``"array"`` for numpy,
    ``"jax"``, ``"key"`` for a typed PRNG key, ``"npscalar"``, ``"py"`` for a Python
    scalar or string stored inline, ``"none"``), and for arrays ``dtype`` and
    ``shape`` of what is stored; a key stores its key data (uint32) and its
    implementation's name as ``impl``; a weakly-typed jax array has ``weak: true``.
    The leaf list holds, for array kinds, the array to store (not yet copied to the
    host), else None.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: x is None)
    records, leaves, seen = [], [], {}
    for keypath, leaf in flat:
        path = [leaf_path((k,)) for k in keypath]
        name = "/".join(path)
        if name in seen:
            raise ValueError(f"checkpoint leaf path {name!r} occurs twice in the state "
                             "(keys that differ only in type, such as 1 and '1')")
        seen[name] = True
        if leaf is None:
            records.append({"path": path, "kind": "none"})
            leaves.append(None)
        elif type(leaf) in _PY_TYPES:  # exactly: np.float64 is a float subclass
            records.append({"path": path, "kind": "py", "value": leaf})
            leaves.append(None)
        else:
            extra: dict = {}
            if isinstance(leaf, jax.Array) and is_key(leaf.dtype):
                kind, extra["impl"] = "key", str(jax.random.key_impl(leaf))
                leaf = jax.random.key_data(leaf)
            elif isinstance(leaf, jax.Array):
                kind = "jax"
                if getattr(leaf, "weak_type", False):
                    extra["weak"] = True
            elif isinstance(leaf, np.generic):
                kind = "npscalar"
            elif isinstance(leaf, np.ndarray):
                kind = "array"
            else:
                leaf = np.asarray(leaf)  # complex and other array-likes
                kind = "array"
            try:
                dtype = dtype_name(leaf.dtype)
            except TypeError as e:
                raise TypeError(f"checkpoint leaf {name!r}: {e}") from None
            records.append({"path": path, "kind": kind, "dtype": dtype,
                            "shape": list(leaf.shape), **extra})
            leaves.append(leaf)
    return records, leaves


def record_struct(rec: dict) -> jax.ShapeDtypeStruct | None:
    """The shape and dtype a record's leaf restores as (None for None leaves and strings)."""
    if rec["kind"] == "none":
        return None
    if rec["kind"] == "py":
        if isinstance(rec["value"], str):
            return None
        # what jax makes of a Python scalar: the default dtype of its kind
        dtype = jax.dtypes.canonicalize_dtype(np.asarray(rec["value"]).dtype)
        return jax.ShapeDtypeStruct((), dtype)
    return jax.ShapeDtypeStruct(tuple(rec["shape"]), dtype_from_name(rec["dtype"]))


def check_records(records: Any, where: str) -> list[dict]:
    """``records`` read from a file, checked: they are data, not trusted."""

    def ok(rec: Any) -> bool:
        if not (isinstance(rec, dict) and isinstance(rec.get("path"), list)
                and all(isinstance(p, str) for p in rec["path"])):
            return False
        if rec.get("kind") == "none":
            return True
        if rec.get("kind") == "py":
            return type(rec.get("value")) in _PY_TYPES
        shape = rec.get("shape")
        try:
            dtype_from_name(rec.get("dtype"))
        except TypeError:
            return False
        if rec.get("kind") == "key" and not isinstance(rec.get("impl"), str):
            return False
        return (rec.get("kind") in ("jax", "key", "array", "npscalar")
                and type(rec.get("weak", False)) is bool and isinstance(shape, list)
                and all(type(n) is int and n >= 0 for n in shape))

    if not (isinstance(records, list) and all(map(ok, records))):
        raise CheckpointError(f"checkpoint {where} has a malformed leaf index")
    return records


def nest(records: Sequence[dict], values: Sequence[Any]) -> Any:
    """Nested dicts keyed by the path components, holding ``values`` (None leaves as None)."""
    if len(records) == 1 and not records[0]["path"]:
        return values[0]  # the state was a single leaf
    root: dict = {}
    for rec, value in zip(records, values):
        node = root
        *parents, last = rec["path"] or [""]
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return root


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


def host_value(rec: dict, arr: np.ndarray | None) -> Any:
    """A record's leaf as stored, on the host."""
    kind = rec["kind"]
    if kind == "none":
        return None
    if kind == "py":
        return rec["value"]
    return arr[()] if kind == "npscalar" else arr


def finish(rec: dict, value: Any) -> Any:
    """A restored leaf as it was saved: a typed key rewrapped, a weak type given back.

    ``value`` is what the backend read and placed (a jax array, or on the host).
    """
    if rec["kind"] == "key":
        return jax.random.wrap_key_data(value, impl=rec["impl"])
    if rec.get("weak") and isinstance(value, jax.Array) and not getattr(value, "weak_type", True):
        return _weak(value)
    return value


def _weak(x: jax.Array) -> jax.Array:
    """``x`` weakly typed (as a Python scalar that went through jit is), placed as ``x``."""
    if x.ndim == 0 and x.is_fully_addressable:
        scalar = jax.numpy.asarray(x.item())  # a Python scalar: weak, default dtype
        if scalar.dtype == x.dtype and scalar.weak_type:
            return jax.device_put(scalar, x.sharding)
    # no public API makes a weak array of any dtype and shape
    from jax._src.lax.lax import _convert_element_type

    return jax.jit(lambda y: _convert_element_type(y, y.dtype, weak_type=True))(x)


def put(arr: np.ndarray, sharding: Any) -> jax.Array:
    """``arr`` as a jax array with ``sharding`` (None: the default device)."""
    if sharding is None:
        return jax.device_put(arr)
    return jax.make_array_from_callback(arr.shape, sharding, lambda index: arr[index])


# -- temporaries of dead saves --------------------------------------------------------


@contextlib.contextmanager
def saving_lock(directory: Path) -> Iterator[None]:
    """Hold a shared lock on ``directory`` while a save writes temporaries in it."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing drops the lock; so does the process dying


def remove_stale(directory: Path, pattern: re.Pattern[str]) -> list[str]:
    """Remove names matching ``pattern`` when no save holds the directory's lock.

    Savers hold a shared `flock` on the directory while they write, and the lock
    dies with its process: if an exclusive lock can be had, every temporary left
    is from a save that died. An evaluator's backend in the same directory as a
    running trainer therefore never removes the trainer's work in progress.
    """
    removed: list[str] = []
    try:
        fd = os.open(directory, os.O_RDONLY)
    except FileNotFoundError:
        return removed
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return removed  # a save is in progress somewhere: leave its files alone
        for entry in os.scandir(directory):
            if pattern.fullmatch(entry.name):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                removed.append(entry.name)
        if removed:
            fsync_dir(directory)
            log.info("removed temporaries of interrupted checkpoint saves in %s: %s",
                     directory, ", ".join(sorted(removed)))
    finally:
        os.close(fd)
    return removed


# -- the backend ----------------------------------------------------------------------


