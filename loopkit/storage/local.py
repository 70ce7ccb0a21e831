"""Durable file operations: what "committed" means on disk (DESIGN.md, Checkpoints).

A file is durable once its data is fsynced, it is published under its final
name by an atomic rename, and the directory holding that name is fsynced.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

__all__ = ["atomic_write_bytes", "atomic_write_text", "fsync_dir", "fsync_file", "fsync_tree",
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


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` so that a crash leaves the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def read_json_object(read: Callable[[], bytes]) -> dict[str, Any] | None:
    """The JSON object `read()` returns, or None (missing, empty, unreadable or not an object)."""
    try:
        value = json.loads(read().decode() or "null")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
