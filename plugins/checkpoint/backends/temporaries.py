"""Temporaries of dead saves and stages: the locks their owners hold, and their clean-up.

A backend that writes under temporary names in a checkpoint directory holds
`saving_lock` while it writes; `remove_stale` removes temporaries only when no save
holds it, so an evaluator never removes a running trainer's work in progress. A
staging directory (`own_directory`: the staged backend's) holds its own lock, on a
file inside it, for as long as it lives; `remove_stale(..., owned=True)` removes one
only when that lock can be taken. Either way the judge is a lock, which dies with
its process, never a process id: containers sharing ``/tmp`` see different ones.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import tempfile
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


#: the file a staging directory's owner holds locked for as long as the directory lives
OWNER_LOCK = ".loopkit-owner"


def remove_stale(directory: Path, pattern: re.Pattern[str], owned: bool = False) -> list[str]:
    """Remove the names in ``directory`` matching ``pattern`` whose owner is gone.

    ``owned=False``: savers hold a shared `flock` on ``directory`` while they write;
    if an exclusive lock can be had, every temporary left is from a save that died
    (an evaluator's backend beside a running trainer never removes its work in
    progress). ``owned=True``: each match is a directory of its own owner, who holds
    the lock of its `OWNER_LOCK` file (`own_directory`); one whose lock can be had is
    removed.
    """
    if owned:
        removed = [e.name for e in _matches(directory, pattern) if _remove_unowned(Path(e.path))]
    else:
        fd = _try_lock(directory)
        if fd is None:
            return []  # gone, or a save is in progress somewhere: leave its files alone
        try:
            removed = [e.name for e in _matches(directory, pattern)]
            for name in removed:
                _remove(directory / name)
        finally:
            os.close(fd)
    if removed:
        with contextlib.suppress(OSError):
            fsync_dir(directory)
        log.info("removed temporaries of interrupted checkpoint saves in %s: %s",
                 directory, ", ".join(sorted(removed)))
    return removed


def own_directory(root: Path, prefix: str) -> tuple[Path, int]:
    """A new directory ``root/<prefix>...`` and the descriptor of its held `OWNER_LOCK`.

    The lock is held until the descriptor is closed (or the process ends), after the
    directory is removed. A cleaner may take a new directory's lock file before its
    owner does, and then removes the directory: the owner tries a fresh one.
    """
    for _ in range(100):
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
        try:
            fd = os.open(path / OWNER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            continue  # removed by a cleaner already
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(path / OWNER_LOCK).st_ino == os.fstat(fd).st_ino:
                return path, fd
        except (BlockingIOError, FileNotFoundError):
            pass  # a cleaner holds it, or removed it: not ours
        os.close(fd)
    raise RuntimeError(f"could not create a staging directory in {root} (a cleaner removed "
                       "100 in a row)")


def _remove_unowned(path: Path) -> bool:
    """Remove the directory ``path`` if its owner's lock can be taken; whether it was."""
    if not path.is_dir() or path.is_symlink():
        return False
    try:
        fd = os.open(path / OWNER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return False  # gone meanwhile, or another user's
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False  # its owner lives
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)
    return True


def _try_lock(directory: Path) -> int | None:
    """A descriptor of ``directory`` holding its exclusive lock; None when it is held or gone."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _matches(directory: Path, pattern: re.Pattern[str]) -> list[os.DirEntry[str]]:
    try:
        return [e for e in os.scandir(directory) if pattern.fullmatch(e.name)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
