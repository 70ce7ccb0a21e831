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
from pathlib import Path
from typing import Any

from loopkit import storage
from loopkit.plugins.checkpoint.locate import Backends, basename_of
from loopkit.plugins.checkpoint.recovery import durable_best
from loopkit.plugins.checkpoint.tf_file import read_state

__all__ = ["CheckpointRow", "checkpoint_rows", "recorded_local_dir", "row_json"]


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
    from loopkit.plugins.checkpoint.helpers import _stored_at

    base = basename_of(directory, basename)
    state = read_state(directory, base)
    rows = []
    with contextlib.closing(Backends(directory, base)) as group:
        found = group.steps()
        best = durable_best(found, state)
        listed = {s for s, _ in state.listed} if state is not None else set(found)
        for step in sorted(found):
            path = _stored_at(found[step], directory, base, step)
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
    """The local tier the run's last session used on this host, from its ledger's start
    record (None: none recorded, or recorded on another host, whose disk this is not)."""
    import socket

    from loopkit.plugins.goodput.records import Start, read_records

    try:
        starts = [r for r in read_records(storage.normalise(logdir, "logdir"))
                  if isinstance(r, Start)]
    except (OSError, ValueError):
        return None
    if not starts or starts[-1].host != socket.gethostname():
        return None
    return starts[-1].local_dir


def row_json(row: CheckpointRow) -> dict[str, Any]:
    return dataclasses.asdict(row)
