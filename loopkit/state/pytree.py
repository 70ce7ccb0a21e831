"""Pytree helpers: leaf paths as users write them, abstract states, the ready check.

`init`'s abstract state for a restore (traced, not run) is `loopkit.state.init_trace`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

__all__ = [
    "leaf_path", "leaves_with_paths", "abstract", "check_matches", "check_storable",
    "conform", "is_key", "sharding_of",
]

PyTree = Any
_PY_SCALARS = (bool, int, float, complex, str)


def _key_str(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_path(keypath: tuple) -> str:
    """``params/encoder/kernel``: keys joined by ``/``, sequence indices as numbers."""
    return "/".join(_key_str(k) for k in keypath)


def leaves_with_paths(tree: PyTree) -> list[tuple[str, Any]]:
    return [(leaf_path(kp), leaf) for kp, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def is_key(dtype: Any) -> bool:
    """True for a typed PRNG key dtype (``key<fry>``, from `jax.random.key`)."""
    try:
        return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    except TypeError:
        return False


def shape_dtype(x: Any) -> tuple[tuple[int, ...], Any]:
    """(shape, dtype) of a leaf as jax will hold it; dtype ``object`` for what jax cannot hold."""
    if isinstance(x, (jax.ShapeDtypeStruct, jax.Array, np.ndarray, np.generic)):
        # as jax will hold it: a float64 numpy init becomes float32 without x64
        return tuple(x.shape), x.dtype if is_key(x.dtype) else _canonical(x.dtype)
    try:
        arr = np.asarray(x)
    except Exception:  # noqa: BLE001 - an object numpy cannot even wrap
        return (), np.dtype(object)
    # Python scalars become weakly-typed JAX values of the default dtype.
    return tuple(arr.shape), _canonical(arr.dtype)


def sharding_of(x: Any) -> Any:
    """`x.sharding` as it applies to `x`'s own shape.

    A typed key's sharding under an explicit-axis mesh (`jax.set_mesh`) describes
    its underlying data, one dimension more (``P(None,)`` for a scalar key): its
    spec is cut to the key's rank, so that an abstract value can carry it.
    """
    sharding = x.sharding
    spec = getattr(sharding, "spec", None)
    if spec is not None and len(spec) > len(x.shape):
        sharding = sharding.update(spec=jax.sharding.PartitionSpec(*spec[:len(x.shape)]))
    return sharding


def _unholdable(dtype: np.dtype) -> bool:
    """Objects, strings and raw bytes (not the ml_dtypes, whose numpy kind is also "V")."""
    return dtype.kind in "OSU" or dtype.type is np.void


def _canonical(dtype: Any) -> np.dtype:
    dtype = np.dtype(dtype)
    return dtype if _unholdable(dtype) else np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def abstract(tree: PyTree) -> PyTree:
    """The tree with every array-like leaf a `jax.ShapeDtypeStruct` (keeping shardings and weak types).

    A leaf jax cannot hold (a function, an object array) is kept as it is, for the
    checks to name.
    """

    def one(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        shape, dtype = shape_dtype(x)
        if not is_key(dtype) and _unholdable(dtype):
            return x
        if isinstance(x, jax.Array):
            # an uncommitted array (left on the default device) has no sharding to
            # keep: a restore leaves it uncommitted too, placed as the fresh one was
            sharding = sharding_of(x) if x.committed else None
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding,
                                        weak_type=bool(getattr(x, "weak_type", False)))
        return jax.ShapeDtypeStruct(shape, dtype, weak_type=type(x) in (int, float, complex))

    return jax.tree.map(one, tree)


# -- the ready check -----------------------------------------------------------------


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _children(node: Any) -> tuple[list[tuple[str, Any]], Any]:
    """The node's direct children by key, and its one-level structure."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda y: y is not node)
    return [(leaf_path(kp), child) for kp, child in flat], treedef


def _static_difference(a: Any, b: Any, keys: set[str]) -> str:
    """Which static field differs between two nodes of the same type, with short reprs."""
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
        for f in dataclasses.fields(a):
            if f.name in keys:
                continue
            va, vb = getattr(a, f.name, None), getattr(b, f.name, None)
            try:
                same = bool(va is vb or va == vb)
            except Exception:  # noqa: BLE001 - values without a boolean equality
                same = False
            if not same:
                return f"static field {f.name!r} differs: {_short(va)} vs {_short(vb)}"
    aux_a, aux_b = _children(a)[1].node_data(), _children(b)[1].node_data()
    return (f"the node's static data differs: {_short(aux_a[1] if aux_a else None)} vs "
            f"{_short(aux_b[1] if aux_b else None)}")


def _first_difference(a: Any, b: Any, path: str = "") -> tuple[str, str] | None:
    """(path, what differs) at the first node where the structures of `a` and `b` differ."""
    if jax.tree.structure(a) == jax.tree.structure(b):
        return None
    ca, da = _children(a)
    cb, db = _children(b)
    where = path or "<root>"
    if da.num_leaves == 1 and not ca[0][0] or db.num_leaves == 1 and not cb[0][0]:
        # one side is a leaf here, the other a container
        return where, f"{type(a).__name__} vs {type(b).__name__}"
    if type(a) is not type(b):
        return where, f"a {type(a).__name__} vs a {type(b).__name__}"
    ka, kb = [k for k, _ in ca], [k for k, _ in cb]
    if ka != kb:
        return where, f"keys {ka} vs {kb}"
    if da != db:
        return where, _static_difference(a, b, set(ka))
    for (k, x), (_, y) in zip(ca, cb):
        found = _first_difference(x, y, f"{path}/{k}" if path else k)
        if found is not None:
            return found
    return where, "the tree structure differs"


def check_matches(state: PyTree, like: PyTree, what: str = "the restored state",
                  against: str = "the init state") -> None:
    """Raise `ValueError` naming every leaf where `state` (`what`) differs from `like`
    (`against`: `init`'s state in a run, the caller's `like` in `load_checkpoint`).

    Compares the leaf paths, then each leaf's shape and dtype (a key's
    implementation included; not its weak type, which training may change),
    then the structure, naming the first differing node (for a static field,
    the field and both values), never a whole PyTreeDef.
    """
    got = dict(leaves_with_paths(state))
    want = dict(leaves_with_paths(like))
    problems = [f"  {path or '<root>'}: missing from {what}"
                for path in sorted(want.keys() - got.keys())]
    problems += [f"  {path or '<root>'}: in {what} but not in {against}"
                 for path in sorted(got.keys() - want.keys())]
    for path in sorted(want.keys() & got.keys()):
        gs, gd = shape_dtype(got[path])
        ws, wd = shape_dtype(want[path])
        if gs != ws or gd != wd:
            problems.append(
                f"  {path or '<root>'}: {what} has shape {gs} dtype {gd}, "
                f"{against} has shape {ws} dtype {wd}"
            )
    if not problems:
        found = _first_difference(state, like)
        if found is not None:
            problems.append(f"  {found[0]}: {what} differs from {against}: {found[1]}")
    if problems:
        raise ValueError(f"{what} does not match {against}:\n" + "\n".join(problems[:20])
                         + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""))


def check_storable(state: PyTree) -> None:
    """Raise `TypeError` naming the first leaf no checkpoint can store.

    Storable: arrays of any non-object dtype (typed keys included), Python
    scalars and strings, None. Not: object arrays, functions or other objects
    as leaves (make them static fields of a registered node instead).
    """
    for path, leaf in leaves_with_paths(state):
        if type(leaf) in _PY_SCALARS:
            continue
        if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) and is_key(leaf.dtype):
            continue
        arrays = (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)
        dtype = leaf.dtype if isinstance(leaf, arrays) else None
        if dtype is None or np.dtype(dtype).kind == "O" or np.dtype(dtype).type is np.void:
            kind = f"an array of dtype {dtype}" if dtype is not None else type(leaf).__name__
            raise TypeError(
                f"state leaf {path or '<root>'!r} is {kind} ({_short(leaf)}), which no checkpoint "
                "can store: a state's leaves are arrays, typed keys, Python scalars or None "
                "(a function or other object belongs in a static field of a registered node)"
            )


def conform(state: PyTree, like: PyTree) -> PyTree:
    """`state` rebuilt with `like`'s tree structure when both hold the same leaf paths.

    A backend returns what is stored; a namedtuple saved by one library may come
    back as a dict of its fields. Same paths, same leaves: take the caller's
    containers (and their static fields). Anything else is left for
    `check_matches` to report.
    """
    like_def = jax.tree.structure(like)
    if jax.tree.structure(state) == like_def:
        return state
    got = dict(leaves_with_paths(state))
    want = [p for p, _ in leaves_with_paths(like)]
    if len(got) != len(want) or set(got) != set(want):
        return state
    return jax.tree.unflatten(like_def, [got[p] for p in want])
