"""Leaf records: how the built-in backends describe a pytree's leaves in JSON.

Shared by the `npz` and `orbax` backends (and usable by a plugin's): one `LeafRecord`
per leaf (its path, kind, dtype name and shape; Python scalars and strings inline),
JSON only at the file boundary (`LeafRecord.to_json`, `read_records`, `head_json`);
the records a partial restore reads (`chosen`), read errors as `CheckpointError`
(`reading`); nesting stored leaves back into dicts (`nest`) and giving a restored leaf
back its typed key or weak type (`finish`). Placing restored leaves is `placement`; the lock and clean-up of
temporaries in a checkpoint directory, `temporaries`.
"""

from __future__ import annotations

import contextlib
import functools
import json
from typing import Any, Iterator, NamedTuple, Sequence

import jax
import ml_dtypes
import numpy as np

from loopkit.errors import CheckpointError
from loopkit.plugins.checkpoint.backends.placement import layout_of, valid_layout
from loopkit.state.pytree import is_key, leaf_path


def dtype_name(dtype: np.dtype) -> str:
    """A name `dtype_from_name` turns back into ``dtype`` (numpy's own, or an ml_dtypes name)."""
    return _dtype_name(np.dtype(dtype))


@functools.lru_cache(maxsize=256)
def _dtype_name(dtype: np.dtype) -> str:  # 8 us a leaf uncached: thousands of leaves add up
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


_ARRAY_KINDS = ("jax", "key", "array", "npscalar")
_PY_VALUE = (bool, int, float, str)  # Python leaves stored inline; exactly these types


class LeafRecord(NamedTuple):
    """One leaf of a stored state, as the built-in backends describe it.

    ``kind`` is ``"array"`` for numpy, ``"jax"``, ``"key"`` for a typed PRNG key,
    ``"npscalar"``, ``"py"`` for a Python scalar or string stored inline in
    ``value``, or ``"none"``. Array kinds have ``dtype`` (a `dtype_name`) and
    ``shape`` of what is stored: a key stores its key data (uint32) and its
    implementation's name as ``impl``; ``weak`` marks a weakly-typed jax array.
    ``member`` is where a backend keeps the data (the npz member's name).
    ``layout`` is how a jax leaf was placed when saved (`placement.layout_of`), which a
    restore follows for a leaf whose sharding `init` left to XLA (`loopkit.state.init_trace.Guessed`).
    """

    path: tuple[str, ...]
    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    value: bool | int | float | str | None = None
    impl: str | None = None
    weak: bool = False
    member: str | None = None
    layout: Any = None

    @property
    def name(self) -> str:
        """The leaf path: the keys joined by ``/``."""
        return "/".join(self.path)

    @property
    def has_array(self) -> bool:
        """Whether the leaf is array data (not None, nor a Python value stored inline)."""
        return self.kind in _ARRAY_KINDS

    def struct(self) -> jax.ShapeDtypeStruct | None:
        """The shape and dtype the leaf restores as (None for None leaves and strings)."""
        if self.kind == "none":
            return None
        if self.kind == "py":
            if isinstance(self.value, str):
                return None
            # what jax makes of a Python scalar: the default dtype of its kind
            dtype = jax.dtypes.canonicalize_dtype(np.asarray(self.value).dtype)
            return jax.ShapeDtypeStruct((), dtype)
        return jax.ShapeDtypeStruct(self.shape, dtype_from_name(self.dtype))

    def to_json(self) -> dict:
        """The record as JSON (the keys of the checkpoints written so far)."""
        out: dict = {"path": list(self.path), "kind": self.kind}
        if self.kind == "py":
            out["value"] = self.value
        elif self.kind != "none":
            out["dtype"], out["shape"] = self.dtype, list(self.shape)
            if self.impl is not None:
                out["impl"] = self.impl
            if self.weak:
                out["weak"] = True
            if self.member is not None:
                out["member"] = self.member
            if self.layout is not None:
                out["layout"] = self.layout
        return out

    @classmethod
    def from_json(cls, obj: Any) -> LeafRecord:
        """A record read from a file, checked (it is data, not trusted); ValueError if malformed."""
        if not (isinstance(obj, dict) and isinstance(obj.get("path"), list)
                and all(isinstance(p, str) for p in obj["path"])):
            raise ValueError(f"malformed leaf record {obj!r}")
        path, kind = tuple(obj["path"]), obj.get("kind")
        if kind == "none":
            return cls(path, kind)
        if kind == "py":
            if type(obj.get("value")) not in _PY_VALUE:
                raise ValueError(f"leaf {'/'.join(path)!r}: malformed inline value")
            return cls(path, kind, value=obj["value"])
        shape, impl, weak, member = (obj.get("shape"), obj.get("impl"), obj.get("weak", False),
                                     obj.get("member"))
        layout = obj.get("layout")
        if not valid_layout(layout):
            layout = None  # a hint only: one this version cannot read is left out
        try:
            dtype_from_name(obj.get("dtype"))
        except TypeError as e:
            raise ValueError(f"leaf {'/'.join(path)!r}: {e}") from None
        if not (kind in _ARRAY_KINDS and type(weak) is bool and isinstance(shape, list)
                and all(type(n) is int and n >= 0 for n in shape)
                and (impl is None if kind != "key" else isinstance(impl, str))
                and (member is None or isinstance(member, str))):
            raise ValueError(f"leaf {'/'.join(path)!r}: malformed record")
        return cls(path, kind, obj["dtype"], tuple(shape), None, impl, weak, member, layout)


def leaf_records(state: Any) -> tuple[list[LeafRecord], list[Any]]:
    """One `LeafRecord` per leaf of ``state`` (None leaves included), and the leaves.

    The leaf list holds, for array kinds, the array to store (not yet copied to
    the host; a typed key's key data), else None.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: x is None)
    records, leaves, seen = [], [], set()
    for keypath, leaf in flat:
        path = tuple(leaf_path((k,)) for k in keypath)
        if path in seen:
            raise ValueError(f"checkpoint leaf path {'/'.join(path)!r} occurs twice in the state "
                             "(keys that differ only in type, such as 1 and '1')")
        seen.add(path)
        if leaf is None:
            records.append(LeafRecord(path, "none"))
            leaves.append(None)
        elif type(leaf) in _PY_VALUE:  # exactly: np.float64 is a float subclass
            records.append(LeafRecord(path, "py", value=leaf))
            leaves.append(None)
        else:
            impl, weak, layout = None, False, None
            if isinstance(leaf, jax.Array) and is_key(leaf.dtype):
                kind, impl, layout = "key", str(jax.random.key_impl(leaf)), layout_of(leaf)
                leaf = jax.random.key_data(leaf)
            elif isinstance(leaf, jax.Array):
                kind, weak = "jax", bool(getattr(leaf, "weak_type", False))
                layout = layout_of(leaf)
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
                raise TypeError(f"checkpoint leaf {'/'.join(path)!r}: {e}") from None
            records.append(LeafRecord(path, kind, dtype, tuple(leaf.shape), None, impl, weak,
                                      None, layout))
            leaves.append(leaf)
    return records, leaves


def head_json(head: dict) -> str:
    """A checkpoint's head as JSON; `TypeError` when the caller's metadata is not JSON-able."""
    try:
        return json.dumps(head)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint metadata must be JSON-able: {e}") from None


@contextlib.contextmanager
def reading(what: str) -> Iterator[None]:
    """Raise what fails inside as `CheckpointError`: ``<what> cannot be read: <error>``."""
    try:
        yield
    except Exception as e:
        raise CheckpointError(f"{what} cannot be read: {e}") from e


def read_records(obj: Any, where: str) -> list[LeafRecord]:
    """The leaf records ``obj`` (JSON read from ``where``) describes; CheckpointError if malformed."""
    if not isinstance(obj, list):
        raise CheckpointError(f"checkpoint {where} has a malformed leaf index")
    try:
        return [LeafRecord.from_json(r) for r in obj]
    except ValueError as e:
        raise CheckpointError(f"checkpoint {where} has a malformed leaf index: {e}") from None


def chosen(records: Sequence[LeafRecord], paths: Sequence[str], where: Any) -> list[LeafRecord]:
    """The records of the leaves at ``paths`` (not None leaves); a missing one is a KeyError."""
    wanted = set(paths)
    found = [r for r in records if r.name in wanted and r.kind != "none"]
    missing = wanted - {r.name for r in found}
    if missing:
        raise KeyError(f"checkpoint {where} has no leaves {sorted(missing)}")
    return found


def nest(paths: Sequence[Sequence[str]], values: Sequence[Any]) -> Any:
    """Nested dicts keyed by the path components, holding ``values`` (None leaves as None)."""
    if len(paths) == 1 and not paths[0]:
        return values[0]  # the state was a single leaf
    root: dict = {}
    for path, value in zip(paths, values):
        node = root
        *parents, last = path or [""]
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return root


def host_value(rec: LeafRecord, arr: np.ndarray | None) -> Any:
    """A record's leaf as stored, on the host."""
    if rec.kind in ("none", "py"):
        return rec.value  # (None for a None leaf)
    return arr[()] if rec.kind == "npscalar" else arr


def finish(rec: LeafRecord, value: Any) -> Any:
    """A restored leaf as it was saved: a typed key rewrapped, a weak type given back.

    ``value`` is what the backend read and placed (a jax array, or on the host).
    """
    if rec.kind == "key":
        return jax.random.wrap_key_data(value, impl=rec.impl)
    if rec.weak and isinstance(value, jax.Array) and not getattr(value, "weak_type", True):
        return weakly_typed(value)
    return value


def weakly_typed(x: jax.Array) -> jax.Array:
    """``x`` weakly typed (as a Python scalar that went through jit is), placed as ``x``."""
    if x.ndim == 0 and x.is_fully_addressable:
        scalar = jax.numpy.asarray(x.item())  # a Python scalar: weak, default dtype
        if scalar.dtype == x.dtype and scalar.weak_type:
            return jax.device_put(scalar, x.sharding)
    # an identity compiled for a weakly-typed input of x's kind returns x weakly typed
    weak = jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=True, sharding=x.sharding)
    return jax.jit(lambda y: y).lower(weak).compile()(x)
