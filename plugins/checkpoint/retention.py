"""Retention: which committed checkpoints a logdir keeps, and the list its `checkpoint` file holds.

`CheckpointList` keeps tf.train.Saver's rules in one place: the ``checkpoint`` file lists
checkpoints in save order; past `max_to_keep`, the oldest leave the list and the
disk, except one every `keep_checkpoint_every_n_hours`, which leaves the list
but stays on disk. Only the chief writes the file; the first time it does in a
session, it records the backend's name beside it (`tf_file.write_backend_name`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterable

from loopkit.plugins.checkpoint.tf_file import (
    CheckpointState, read_state, write_backend_name, write_state,
)

if TYPE_CHECKING:
    import os

    from loopkit.config import Config

__all__ = ["CheckpointList"]


class CheckpointList:
    """The committed steps of a logdir and the list its `checkpoint` file holds."""

    def __init__(self, logdir: str | os.PathLike[str], config: Config,
                 backend_name: str | None = None, local_dir: str | None = None) -> None:
        self.logdir = logdir
        #: the name the backend was built by (None: an instance), recorded at the first
        #: write with the run's local tier (`local_dir`, the durable tier's list only)
        self.backend_name = backend_name
        self.local_dir = local_dir
        self._recorded = False
        self.basename = config.checkpoint_basename
        self.keep = config.max_to_keep or None  # as tf.train.Saver: 0 or None keeps all
        self.hours = config.keep_checkpoint_every_n_hours
        #: committed checkpoints on disk (listed or not)
        self.on_disk: set[int] = set()
        #: the `checkpoint` file's list: (step, wall time of the save), in save order
        self.listed: list[tuple[int, float | None]] = []
        self.last_preserved = time.time()

    def load(self, committed: Iterable[int]) -> CheckpointState | None:
        """Take the committed steps and the `checkpoint` file as they are now."""
        self.on_disk = set(committed)
        state = read_state(self.logdir, self.basename)
        if state is not None:
            self.listed = list(state.listed)
            if state.last_preserved_timestamp is not None:
                self.last_preserved = state.last_preserved_timestamp
        return state

    def adopt(self, step: int | None, state: CheckpointState | None) -> None:
        """Keep the list up to the restored `step` (None: a fresh start, an empty list).

        Checkpoints newer than the restored one (a hand-picked older restart)
        leave the list; they stay on disk until this run overwrites them.
        """
        if step is None:
            self.listed = []
            return
        listed = ([(s, None) for s in sorted(self.on_disk)] if state is None
                  else list(state.listed))
        listed = [(s, t) for s, t in listed if s <= step]
        if step not in {s for s, _ in listed}:
            listed.append((step, None))
        self.listed = listed

    def make_room(self, step: int) -> None:
        """Before `step` is saved over: the file names an earlier step, and `step` leaves it."""
        self.listed = [(s, t) for s, t in self.listed if s != step]
        earlier = [s for s, _ in self.listed if s < step]
        self.write(max(earlier) if earlier else None)
        self.on_disk.discard(step)

    def publish(self, step: int, timestamp: float) -> list[int]:
        """Name the committed `step` as the latest; return the steps retention drops."""
        listed = [(s, t) for s, t in self.listed if s != step] + [(step, timestamp)]
        doomed = []
        while self.keep is not None and len(listed) > self.keep:
            old, t = listed.pop(0)
            if self.hours and t is not None and t - self.hours * 3600 >= self.last_preserved:
                self.last_preserved = t  # leaves the list, stays on disk
                continue
            doomed.append(old)
        self.listed = listed
        self.write(step)
        self.on_disk.difference_update(doomed)
        return doomed

    def write(self, latest: int | None) -> None:
        if not self._recorded and (self.backend_name or self.local_dir):
            # before the file names a checkpoint it wrote; once a session
            write_backend_name(self.logdir, self.backend_name, self.local_dir)
            self._recorded = True
        write_state(self.logdir, CheckpointState(
            basename=self.basename, latest=latest, listed=list(self.listed),
            last_preserved_timestamp=self.last_preserved if self.hours else None,
        ))
