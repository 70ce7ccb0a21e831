"""Pytree helpers: leaf paths as users write them, and the ready check."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["leaf_path", "leaves_with_paths", "abstract", "check_matches", "conform"]

PyTree = Any


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


def shape_dtype(x: Any) -> tuple[tuple[int, ...], np.dtype]:
    if isinstance(x, (jax.ShapeDtypeStruct, jax.Array, np.ndarray, np.generic)):
        # as jax will hold it: a float64 numpy init becomes float32 without x64
        return tuple(x.shape), np.dtype(jax.dtypes.canonicalize_dtype(x.dtype))
    arr = np.asarray(x)
    # Python scalars become weakly-typed JAX values of the default dtype.
    return tuple(arr.shape), np.dtype(jax.dtypes.canonicalize_dtype(arr.dtype))


def abstract(tree: PyTree) -> PyTree:
    """The tree with every leaf replaced by a `jax.ShapeDtypeStruct` (keeping shardings)."""

    def one(x: Any) -> jax.ShapeDtypeStruct:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        shape, dtype = shape_dtype(x)
        sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    return jax.tree.map(one, tree)


def check_matches(state: PyTree, like: PyTree, what: str = "the restored state") -> None:
    """Raise `ValueError` naming every leaf where `state` differs from `like`.

    Compares tree structure, then each leaf's shape and dtype.
    """
    got = dict(leaves_with_paths(state))
    want = dict(leaves_with_paths(like))
    problems = []
    for path in sorted(want.keys() - got.keys()):
        problems.append(f"  {path or '<root>'}: missing from {what}")
    for path in sorted(got.keys() - want.keys()):
        problems.append(f"  {path or '<root>'}: in {what} but not in the init state")
    for path in sorted(want.keys() & got.keys()):
        gs, gd = shape_dtype(got[path])
        ws, wd = shape_dtype(want[path])
        if gs != ws or gd != wd:
            problems.append(
                f"  {path or '<root>'}: {what} has shape {gs} dtype {gd}, "
                f"the init state has shape {ws} dtype {wd}"
            )
    if not problems and jax.tree.structure(state) != jax.tree.structure(like):
        problems.append(
            f"  tree structure differs: {what} is {jax.tree.structure(state)}, "
            f"the init state is {jax.tree.structure(like)}"
        )
    if problems:
        raise ValueError(f"{what} does not match the init state:\n" + "\n".join(problems))


def conform(state: PyTree, like: PyTree) -> PyTree:
    """`state` rebuilt with `like`'s tree structure when both hold the same leaf paths.

    A backend returns what is stored; a namedtuple saved by one library may come
    back as a dict of its fields. Same paths, same leaves: take the caller's
    containers. Anything else is left for `check_matches` to report.
    """
    like_def = jax.tree.structure(like)
    if jax.tree.structure(state) == like_def:
        return state
    got = dict(leaves_with_paths(state))
    want = [p for p, _ in leaves_with_paths(like)]
    if len(got) != len(want) or set(got) != set(want):
        return state
    return jax.tree.unflatten(like_def, [got[p] for p in want])


def _abstract_mesh(x: Any) -> bool:
    mesh = getattr(getattr(x, "sharding", None), "mesh", None)
    return mesh is not None and type(mesh).__name__ == "AbstractMesh"


def concrete_like(init: Any, like: PyTree) -> PyTree:
    """`like` (from `jax.eval_shape(init)`) with concrete shardings where it has abstract ones.

    `eval_shape` knows a leaf's `NamedSharding` only over an `AbstractMesh`; a
    backend restoring the leaf needs the real devices. Lowering and compiling
    `init` (nothing is materialised) gives them.
    """
    if not any(_abstract_mesh(x) for x in jax.tree.leaves(like)):
        return like
    compiled = jax.jit(init).lower().compile().output_shardings

    def fix(x: Any, sharding: Any) -> Any:
        if not _abstract_mesh(x):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(fix, like, compiled)
