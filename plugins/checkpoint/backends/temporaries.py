"""Temporaries of dead saves: the lock a save holds on its directory, and their clean-up.

A backend that writes under temporary names in a checkpoint directory holds
`saving_lock` while it writes; `remove_stale` removes temporaries only when no save
holds it (the lock dies with its process), so an evaluator never removes a running
trainer's work in progress.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

from loopkit.storage.local import fsync_dir

log = logging.getLogger("loopkit")


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
