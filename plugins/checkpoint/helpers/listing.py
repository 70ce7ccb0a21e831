"""The checkpoints of a run, both tiers, and the one a restart restores
(``loopkit checkpoints LOGDIR [--local-dir DIR] [--json]``).

Nothing is read but the `checkpoint` files and each checkpoint's size and time: the
choice shown is the one a restart makes before it reads (a checkpoint found corrupt
then is passed over for an older one). A restart restores the local tier's best step
when it is at least the durable tier's best (as `recovery.find_local`), else the
durable tier's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from loopkit import storage
from loopkit.plugins.checkpoint.helpers.locate import Backends, basename_of, stored_at
from loopkit.plugins.checkpoint.recovery import durable_best
from loopkit.plugins.checkpoint.tf_file import read_local_dir, read_state

__all__ = ["CheckpointRow", "checkpoint_rows", "describe_checkpoints", "recorded_local_dir",
           "row_json"]


@dataclasses.dataclass(frozen=True)
class CheckpointRow:
    """One checkpoint: its `name` and `path`, `step`, `tier` ("durable" or "local"),
    `size` in bytes, `time` (its newest file's modification, wall-clock seconds),
    `listed` (named in its tier's `checkpoint` file) and `restore` (a restart restores
    this one)."""

    name: str
    path: str
    step: int
    tier: str
    size: int
    time: float
    listed: bool
    restore: bool = False


def _tier_rows(directory: Path | str, tier: str, basename: str | None
               ) -> tuple[list[CheckpointRow], int | None]:
    """The checkpoints of one tier's directory, and the step a restart would take there."""

    base = basename_of(directory, basename)
    state = read_state(directory, base)
    rows = []
    with contextlib.closing(Backends(directory, base)) as group:
        found = group.steps()
        best = durable_best(found, state)
        listed = {s for s, _ in state.listed} if state is not None else set(found)
        for step in sorted(found):
            path = stored_at(found[step], directory, base, step)
            try:
                size, mtime = storage.size_and_mtime(path)
            except FileNotFoundError:  # deleted by retention while we look
                continue
            rows.append(CheckpointRow(storage.name_of(path), str(path), step, tier, int(size),
                                      float(mtime), step in listed))
    return rows, best


def checkpoint_rows(logdir: str | os.PathLike[str], *, basename: str | None = None,
                    local_dir: str | os.PathLike[str] | None = None) -> list[CheckpointRow]:
    """Every checkpoint of the run in `logdir` (and of its local tier in `local_dir`,
    the run's `Config.local_checkpoint_dir`), by step then tier, the one a restart
    restores marked `restore`."""
    logdir = storage.normalise(logdir, "logdir")
    if not storage.is_dir(logdir):
        raise FileNotFoundError(f"{logdir} does not exist" if not storage.exists(logdir)
                                else f"{logdir} is not a directory")
    rows, best = _tier_rows(logdir, "durable", basename)
    chosen = ("durable", best)
    if local_dir is not None:
        local = storage.normalise(local_dir, "local_checkpoint_dir")
        if storage.is_dir(local):
            local_rows, local_best = _tier_rows(local, "local", basename)
            rows += local_rows
            if local_best is not None and (best is None or local_best >= best):
                chosen = ("local", local_best)
    rows.sort(key=lambda r: (r.step, r.tier != "durable"))
    return [dataclasses.replace(r, restore=(r.tier, r.step) == chosen) for r in rows]


def recorded_local_dir(logdir: str | os.PathLike[str]) -> str | None:
    """The local tier the run keeps beside `logdir` on this host, as the checkpoint plugin
    recorded it (None: none recorded, or recorded on another host, whose disk this is not)."""
    try:
        return read_local_dir(logdir)
    except (OSError, ValueError):
        return None


def row_json(row: CheckpointRow) -> dict[str, Any]:
    return dataclasses.asdict(row)


def describe_checkpoints(logdir: str | os.PathLike[str], *, basename: str | None = None,
                         local_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """One line per checkpoint in `logdir`, oldest first: name, step, size, age.

    The one a restart would recover is marked ``<- latest``; one not named in
    the `checkpoint` file's list (kept by ``keep_checkpoint_every_n_hours``, or
    left behind by a restart from an older checkpoint) is marked ``(unlisted)``.
    With `local_dir` (the run's ``Config.local_checkpoint_dir``) the local tier's
    checkpoints are listed too, marked ``local``.
    """
    now = time.time()
    rows = []
    for r in checkpoint_rows(logdir, basename=basename, local_dir=local_dir):
        mark = ("<- latest (a restart recovers this one)" if r.restore
                else "(unlisted)" if not r.listed else "")
        rows.append((r.name, f"step {r.step}", "local" if r.tier == "local" else "",
                     _human_size(r.size), _human_age(now - r.time), mark))
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return ["  ".join(f"{c:<{w}}" if i != 3 else f"{c:>{w}}"
                      for i, (c, w) in enumerate(zip(r[:5], widths)) if w).rstrip()
            + (f"  {r[5]}" if r[5] else "") for r in rows]


# -- initialising from a pretrained checkpoint ------------------------------------------


def _human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _human_age(secs: float) -> str:
    secs = max(0.0, secs)
    if secs < 90:
        return f"{secs:.0f} s ago"
    if secs < 90 * 60:
        return f"{secs / 60:.0f} min ago"
    if secs < 36 * 3600:
        return f"{secs / 3600:.1f} h ago"
    return f"{secs / 86400:.1f} days ago"
