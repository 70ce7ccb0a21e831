"""Helpers for scripts around a run: find, load, follow, list and initialise from checkpoints.

Re-exported as `loopkit.latest_checkpoint`, `loopkit.load_checkpoint`,
`loopkit.checkpoints_iterator` and `loopkit.from_pretrained`; `describe_checkpoints` (in `listing`)
backs `loopkit checkpoints`. Each finds its checkpoint and backend through `locate`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np

from loopkit import storage
from loopkit.plugins.checkpoint.helpers.locate import Backends, basename_of, locate, recoverable
from loopkit.plugins.checkpoint.tf_file import checkpoint_path
from loopkit.state.pytree import check_matches, conform, leaf_path, leaves_with_paths, shape_dtype

__all__ = [
    "checkpoints_iterator",
    "from_pretrained",
    "latest_checkpoint",
    "load_checkpoint",
    "place_like",
]

PyTree = Any


def _default_device() -> Any:
    device = jax.config.jax_default_device
    return device if device is not None and not isinstance(device, str) else jax.local_devices()[0]


def place_like(like: PyTree) -> PyTree:
    """`like` with a placement on every abstract leaf that has none.

    `jax.eval_shape` gives leaves without a sharding; they get the default
    device's `SingleDeviceSharding`. A sharding that is there, and concrete
    leaves, are kept.
    """
    if like is None:
        return None
    sharding = None

    def one(x: Any) -> Any:
        nonlocal sharding
        if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
            if sharding is None:
                sharding = jax.sharding.SingleDeviceSharding(_default_device())
            return x.update(sharding=sharding)
        return x

    return jax.tree.map(one, like)


def latest_checkpoint(logdir: str | os.PathLike[str], *,
                      basename: str | None = None) -> tuple[int, str] | None:
    """``(step, path)`` of the checkpoint a restart would recover, or None.

    Honours ``logdir/checkpoint`` (a hand edit picks the checkpoint); without
    it, the newest checkpoint on disk. The checkpoints are the steps the
    backends list (the built-ins' and those plugins name). The path is absolute
    and has no backend extension: `load_checkpoint` accepts it. (It does not
    read the data: a corrupt checkpoint is found out only when loaded.)
    """
    logdir = storage.normalise(logdir, "logdir")
    base = basename_of(logdir, basename)
    with contextlib.closing(Backends(logdir, base)) as group:
        return _latest(logdir, base, group)


def _latest(logdir: Path | str, base: str, group: Any) -> tuple[int, str] | None:
    step = recoverable(logdir, group.steps(), base)
    return None if step is None else (step, checkpoint_path(logdir, base, step))


def load_checkpoint(logdir_or_path: str | os.PathLike[str], like: PyTree = None) -> PyTree:
    """Load a checkpoint's state, for evaluation scripts.

    `logdir_or_path` is a logdir (its latest checkpoint, as a restart would
    pick), a checkpoint path such as ``runs/a/model.ckpt-1000``, or what another
    library wrote: an orbax PyTree checkpoint under any name, an orbax
    `CheckpointManager` directory (its latest step) or ``<dir>/<step>/<item>``,
    a ``*.safetensors`` file (or a directory of them). With `like` (a pytree of
    arrays or `jax.ShapeDtypeStruct`), the state comes back in its structure and
    placement and must match its shapes and dtypes (a `ValueError` names the
    leaves that differ); without, as nested dicts keyed by the path components
    (``state["params"]["w"]``, sequence indices as ``"0"``, ``"1"``...). A path
    holding none of these raises `FileNotFoundError` saying what is there.
    """
    found = locate(storage.normalise(logdir_or_path, "logdir_or_path"))
    with contextlib.closing(found.backend):
        state, _ = found.backend.restore(found.step, place_like(like))
    if like is not None:
        state = conform(state, like)
        check_matches(state, like, f"checkpoint {found.where}", "the like argument")
    return state


def checkpoints_iterator(logdir: str | os.PathLike[str], min_interval_secs: float = 0,
                         timeout: float | None = None, *,
                         poll_secs: float = 1.0) -> Iterator[tuple[int, str]]:
    """Yield ``(step, path)`` for each new latest checkpoint of `logdir` as it appears.

    As `tf.train.checkpoints_iterator`: polls every `poll_secs` (about once a
    second); yields at most once per `min_interval_secs`; ends after `timeout`
    seconds without a new checkpoint (None: never). A checkpoint that is
    replaced by a newer one before a poll sees it is skipped.
    """
    logdir = storage.normalise(logdir, "logdir")
    base = basename_of(logdir, None)
    last: tuple[int, str] | None = None
    with contextlib.closing(Backends(logdir, base)) as group:
        while True:
            deadline = None if timeout is None else time.monotonic() + timeout
            while (found := _latest(logdir, base, group)) is None or found == last:
                if deadline is not None and time.monotonic() + poll_secs > deadline:
                    return
                time.sleep(poll_secs)
            start = time.monotonic()
            last = found
            yield found
            wait = start + min_interval_secs - time.monotonic()
            if wait > 0:
                time.sleep(wait)


def _leaves_of(backend: Any, step: int) -> tuple[dict[str, Any], Callable[[list[str]], dict]]:
    """(leaf path -> shape and dtype, a reader of chosen leaves) of a checkpoint.

    From `structure` and `restore_leaves` when the backend has them (only the
    chosen leaves are read); else, for a backend with only the six protocol
    methods, from one whole `restore`.
    """
    if hasattr(backend, "structure") and hasattr(backend, "restore_leaves"):
        return backend.structure(step), lambda paths: backend.restore_leaves(step, paths)
    state, _ = backend.restore(step, None)
    flat = dict(leaves_with_paths(state))
    return ({p: jax.ShapeDtypeStruct(*shape_dtype(x)) for p, x in flat.items()},
            lambda paths: {p: flat[p] for p in paths})


def _renamed(path: str, rename: Mapping[str, str]) -> str:
    # the longest matching prefix wins; a prefix matches whole path components only
    for old in sorted(rename, key=len, reverse=True):
        if path == old or path.startswith(old.rstrip("/") + "/"):
            return rename[old].rstrip("/") + path[len(old.rstrip("/")):]
    return path


def from_pretrained(
    logdir_or_path: str | os.PathLike[str],
    *,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    rename: Mapping[str, str] | None = None,
) -> Callable[[PyTree], PyTree]:
    """An `init_fn` that loads chosen leaves of a pretrained checkpoint into the fresh state.

    A leaf's path is its keys joined by ``/`` (``params/encoder/kernel``; sequence
    indices as numbers). `include`/`exclude` are `fnmatch` patterns over checkpoint
    paths (a list, or one pattern as a string; default: everything); `rename` maps a
    checkpoint path prefix to a prefix in the fresh state (``{"params/encoder":
    "params/backbone"}``). Leaves not chosen keep
    their fresh values. Only the chosen arrays are read. A chosen leaf with no
    counterpart in the fresh state, or with another shape or dtype, raises
    `ValueError` naming its checkpoint path and its path in the fresh state.

    Like the Supervisor's ``init_fn``, it runs only when the run has no checkpoint of
    its own: ``loopkit.train(..., init_fn=loopkit.from_pretrained("runs/pretrain",
    include=["params/encoder/*"]))``.
    """
    # a bare string is one pattern (as Config.summary_metrics takes it): list() of it
    # would make each character a pattern, and its "*" would choose every leaf
    include = [include] if isinstance(include, str) else include
    exclude = [exclude] if isinstance(exclude, str) else exclude
    include = list(include) if include is not None else None
    exclude = list(exclude or ())
    rename = dict(rename or {})
    for name, value in (("include", include), ("exclude", exclude)):
        if value is not None and not all(isinstance(p, str) for p in value):
            raise ValueError(f"from_pretrained: {name}={value!r} must be a list of patterns")

    def init_fn(state: PyTree) -> PyTree:
        found = locate(storage.normalise(logdir_or_path, "logdir_or_path"))
        with contextlib.closing(found.backend):
            stored, read_leaves = _leaves_of(found.backend, found.step)
            chosen = _chosen(stored, include, exclude, found.where)
            keypaths, treedef = jax.tree_util.tree_flatten_with_path(state)
            fresh = {leaf_path(kp): (i, leaf) for i, (kp, leaf) in enumerate(keypaths)}
            targets = _targets(chosen, stored, fresh, rename, found.where)
            values = read_leaves(chosen)
        leaves = [leaf for _, leaf in keypaths]
        for q, p in targets.items():
            i, leaf = fresh[q]
            sharding = getattr(leaf, "sharding", None)
            leaves[i] = jax.device_put(values[p], sharding) if sharding is not None else values[p]
        return jax.tree_util.tree_unflatten(treedef, leaves)

    return init_fn


def _chosen(stored: Mapping[str, Any], include: list[str] | None, exclude: list[str],
            where: str) -> list[str]:
    """The checkpoint paths `include` and `exclude` choose; none is an error."""
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
    return chosen


def _targets(chosen: list[str], stored: Mapping[str, Any], fresh: Mapping[str, Any],
             rename: Mapping[str, str], where: str) -> dict[str, str]:
    """Each chosen leaf's path in the fresh state (after `rename`) -> its checkpoint
    path; a leaf with no counterpart, or of another shape or dtype, is named in one error."""
    targets: dict[str, str] = {}
    problems = []
    for p in chosen:
        q = _renamed(p, rename)
        if q not in fresh:
            problems.append(f"  {p} (in the fresh state: {q}): no such leaf")
            continue
        want = stored[p]
        shape, dtype = shape_dtype(fresh[q][1])
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
    return targets
