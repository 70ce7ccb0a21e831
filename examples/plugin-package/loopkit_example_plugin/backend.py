"""A checkpoint backend added by a plugin: `checkpoint_backend="npz-compressed"`.

It reuses loopkit's npz format (atomic, durable, never unpickled) and only
changes how the zip members are stored, so checkpoints stay readable by the
built-in npz backend and by `loopkit.load_checkpoint`.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import loopkit
from loopkit.plugins.npz_backend import NpzBackend

NAME = "npz-compressed"


class CompressedNpzBackend(NpzBackend):
    """The npz backend with deflate-compressed members: smaller files, slower saves."""

    compression = zipfile.ZIP_DEFLATED


@loopkit.hookimpl
def checkpoint_backend(name: str, directory: Path, config: loopkit.Config):
    if name != NAME:
        return None
    return CompressedNpzBackend(directory, config.checkpoint_basename, config)
