"""Built-in `init`: the Supervisor's `init_fn` and `local_init_fn`, and `from_pretrained`."""

from __future__ import annotations

import fnmatch
import os
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from loopkit import storage
from loopkit.config import Config
from loopkit.hookspec import hookimpl
from loopkit.plugins.io_settings import checkpoint_io
from loopkit.pytree import leaf_path, shape_dtype

PyTree = Any


class InitPlugin:
    """Applies `Config.init_fn` on a fresh start and `Config.local_init_fn` every session."""

    def __init__(self, config: Config) -> None:
        self.config = config

    @hookimpl(trylast=True)
    def init_state(self, session: Any, state: PyTree) -> PyTree | None:
        fn = self.config.init_fn
        if fn is None:
            return None
        new = fn(state)
        if new is None:
            raise ValueError(
                f"Config.init_fn={fn!r} returned None: it must return the new state "
                "(init_fn(state) -> state)"
            )
        return new

    @hookimpl(trylast=True)
    def local_init(self, session: Any) -> None:
        fn = self.config.local_init_fn
        if fn is not None:
            fn(session)


def plugin(config: Config) -> InitPlugin:
    return InitPlugin(config)


# -- loading a pretrained checkpoint ---------------------------------------------------

def _resolve(logdir_or_path: str | os.PathLike[str]) -> tuple[Any, int, str]:
    """(backend, step, path) for a logdir (its latest checkpoint) or a checkpoint path."""
    from loopkit.plugins.checkpoint_locate import locate

    found = locate(storage.normalise(logdir_or_path, "logdir_or_path"))
    return found.backend, found.step, found.where


def _renamed(path: str, rename: Mapping[str, str]) -> str:
    # the longest matching prefix wins; a prefix matches whole path components only
    for old in sorted(rename, key=len, reverse=True):
        if path == old or path.startswith(old.rstrip("/") + "/"):
            return rename[old].rstrip("/") + path[len(old.rstrip("/")):]
    return path


def from_pretrained(
    logdir_or_path: str | os.PathLike[str],
    *,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    rename: Mapping[str, str] | None = None,
) -> Callable[[PyTree], PyTree]:
    """An `init_fn` that loads chosen leaves of a pretrained checkpoint into the fresh state.

    A leaf's path is its keys joined by ``/`` (``params/encoder/kernel``; sequence
    indices as numbers). `include`/`exclude` are `fnmatch` patterns over checkpoint
    paths (default: everything); `rename` maps a checkpoint path prefix to a prefix in
    the fresh state (``{"params/encoder": "params/backbone"}``). Leaves not chosen keep
    their fresh values. Only the chosen arrays are read. A chosen leaf with no
    counterpart in the fresh state, or with another shape or dtype, raises
    `ValueError` naming its checkpoint path and its path in the fresh state.

    Like the Supervisor's ``init_fn``, it runs only when the run has no checkpoint of
    its own: ``loopkit.train(..., init_fn=loopkit.from_pretrained("runs/pretrain",
    include=["params/encoder/*"]))``.
    """
    include = list(include) if include is not None else None
    exclude = list(exclude or ())
    rename = dict(rename or {})
    for name, value in (("include", include), ("exclude", exclude)):
        if value is not None and not all(isinstance(p, str) for p in value):
            raise ValueError(f"from_pretrained: {name}={value!r} must be a list of patterns")

    @checkpoint_io()
    def init_fn(state: PyTree) -> PyTree:
        backend, step, where = _resolve(logdir_or_path)
        try:
            stored = backend.structure(step)
            chosen = [
                p for p in stored
                if (include is None or any(fnmatch.fnmatchcase(p, pat) for pat in include))
                and not any(fnmatch.fnmatchcase(p, pat) for pat in exclude)
            ]
            if not chosen:
                raise ValueError(
                    f"from_pretrained: include={include!r} exclude={exclude!r} choose no leaf "
                    f"of {where}; its leaves are: {', '.join(sorted(stored)) or 'none'}"
                )
            keypaths, treedef = jax.tree_util.tree_flatten_with_path(state)
            fresh = {leaf_path(kp): (i, leaf) for i, (kp, leaf) in enumerate(keypaths)}
            targets: dict[str, str] = {}
            problems = []
            for p in chosen:
                q = _renamed(p, rename)
                if q not in fresh:
                    problems.append(f"  {p} (in the fresh state: {q}): no such leaf")
                    continue
                want = stored[p]
                leaf = fresh[q][1]
                shape, dtype = shape_dtype(leaf)
                if tuple(want.shape) != shape or np.dtype(want.dtype) != dtype:
                    problems.append(
                        f"  {p} (in the fresh state: {q}): checkpoint has shape "
                        f"{tuple(want.shape)} dtype {np.dtype(want.dtype)}, the fresh state "
                        f"shape {shape} dtype {dtype}"
                    )
                targets[q] = p
            if problems:
                raise ValueError(
                    f"from_pretrained({where!r}) cannot load these leaves:\n" + "\n".join(problems)
                )
            values = backend.restore_leaves(step, chosen)
        finally:
            backend.close()
        leaves = [leaf for _, leaf in keypaths]
        for q, p in targets.items():
            i, leaf = fresh[q]
            sharding = getattr(leaf, "sharding", None)
            leaves[i] = jax.device_put(values[p], sharding) if sharding is not None else values[p]
        return jax.tree_util.tree_unflatten(treedef, leaves)

    return init_fn
