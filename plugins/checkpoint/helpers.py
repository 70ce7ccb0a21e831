"""Helpers for scripts around a run: find, load, follow and list checkpoints.

Re-exported as `loopkit.latest_checkpoint`, `loopkit.load_checkpoint` and
`loopkit.checkpoints_iterator`; `describe_checkpoints` backs `loopkit checkpoints`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterator

import jax

from loopkit import storage
from loopkit.plugins.checkpoint_locate import backends, basename_of, locate, recoverable
from loopkit.plugins.checkpoint_state import checkpoint_path, read_state
from loopkit.pytree import check_matches, conform

__all__ = [
    "checkpoints_iterator",
    "describe_checkpoints",
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
    with backends(logdir, base) as group:
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
    try:
        state, _ = found.backend.restore(found.step, place_like(like))
    finally:
        found.backend.close()
    if like is not None:
        state = conform(state, like)
        check_matches(state, like, f"checkpoint {found.where}")
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
    with backends(logdir, base) as group:
        yield from _follow(logdir, base, group, min_interval_secs, timeout, poll_secs)


def _follow(logdir: Path | str, base: str, group: Any, min_interval_secs: float,
            timeout: float | None, poll_secs: float) -> Iterator[tuple[int, str]]:
    last: tuple[int, str] | None = None
    while True:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            found = _latest(logdir, base, group)
            if found is not None and found != last:
                break
            if deadline is not None and time.monotonic() + poll_secs > deadline:
                return
            time.sleep(poll_secs)
        start = time.monotonic()
        last = found
        yield found
        wait = start + min_interval_secs - time.monotonic()
        if wait > 0:
            time.sleep(wait)


def _human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _human_age(secs: float) -> str:
    secs = max(0.0, secs)
    if secs < 90:
        return f"{secs:.0f} s ago"
    if secs < 90 * 60:
        return f"{secs / 60:.0f} min ago"
    if secs < 36 * 3600:
        return f"{secs / 3600:.1f} h ago"
    return f"{secs / 86400:.1f} days ago"


def describe_checkpoints(logdir: str | os.PathLike[str], *,
                         basename: str | None = None) -> list[str]:
    """One line per checkpoint in `logdir`, oldest first: name, step, size, age.

    The one a restart would recover is marked ``<- latest``; one not named in
    the `checkpoint` file's list (kept by ``keep_checkpoint_every_n_hours``, or
    left behind by a restart from an older checkpoint) is marked ``(unlisted)``.
    """
    logdir = storage.normalise(logdir, "logdir")
    if not storage.is_dir(logdir):
        raise FileNotFoundError(f"{logdir} does not exist" if not storage.exists(logdir)
                                else f"{logdir} is not a directory")
    base = basename_of(logdir, basename)
    state = read_state(logdir, base)
    now = time.time()
    rows = []
    with backends(logdir, base) as group:
        found = group.steps()
        first = recoverable(logdir, found, base)
        listed = {s for s, _ in state.listed} if state is not None else set(found)
        for step in sorted(found):
            path = found[step].path(step)
            try:
                size, mtime = storage.size_and_mtime(path)
            except FileNotFoundError:  # deleted by retention while we look
                continue
            age = now - mtime
            marks = []
            if step == first:
                marks.append("<- latest (a restart recovers this one)")
            elif step not in listed:
                marks.append("(unlisted)")
            rows.append((storage.name_of(path), f"step {step}", _human_size(size), _human_age(age), marks))
    if not rows:
        return []
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    w2 = max(len(r[2]) for r in rows)
    w3 = max(len(r[3]) for r in rows)
    return [
        f"{a:<{w0}}  {b:<{w1}}  {c:>{w2}}  {d:<{w3}}  {' '.join(m)}".rstrip()
        for a, b, c, d, m in rows
    ]
