"""Durable file operations: what "committed" means on disk (DESIGN.md, Checkpoints).

A file is durable once its data is fsynced, it is published under its final
name by an atomic rename, and the directory holding that name is fsynced.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

__all__ = ["atomic_write_bytes", "fsync_dir", "fsync_file", "fsync_tree",
           "read_json_object"]


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush one file's data and metadata to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the names in directory `path` (new, renamed, removed) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """fsync every file, then every directory (deepest first), under `root`."""
    dirs = []
    for dirpath, _dirnames, filenames in os.walk(root):
        dirs.append(dirpath)
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
    for d in reversed(dirs):
        fsync_dir(d)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str],
                tmp: str | os.PathLike[str] | None = None) -> Iterator[BinaryIO]:
    """A file to write that becomes `path` durably when the block ends, or never.

    The data goes to a temporary in the same directory (`tmp`, by default
    ``.<name>.<random>.tmp``: a name no other writer shares, two threads of one process
    included), is fsynced, renamed over `path`, and the directory fsynced; an error in
    the block (or in any of that) removes the temporary and is raised.
    """
    path = Path(path)
    tmp = Path(tmp) if tmp is not None else path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    # O_EXCL: never another writer's file; the mode as `open` gives (umask applied)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with open(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` so that a crash leaves the old file or the new one.

    Every small file loopkit writes locally comes here (through `storage.write_atomic`
    or directly), through `atomic_file`.
    """
    with atomic_file(path) as f:
        f.write(data)


def read_json_object(read: Callable[[], bytes]) -> dict[str, Any] | None:
    """The JSON object `read()` returns, or None (missing, empty, unreadable or not an object)."""
    try:
        value = json.loads(read().decode() or "null")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
