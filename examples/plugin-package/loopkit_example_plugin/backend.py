"""A checkpoint backend added by a plugin: `checkpoint_backend="npz-compressed"`.

It reuses loopkit's npz format (atomic, durable, never unpickled), stores the zip
members deflate-compressed, and names its files ``<basename>-<step>.npzc``.
A run's logdir records the name, so `loopkit.load_checkpoint`, the other
checkpoint helpers and ``loopkit checkpoints`` build it through the hook and read
them; naming itself in the optional `checkpoint_backend_names` also finds them
where no name is recorded.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import loopkit
from loopkit.plugins.checkpoint.backends.npz import NpzBackend
from loopkit.plugins.checkpoint.backends.staged import local_or_staged

NAME = "npz-compressed"


class CompressedNpzBackend(NpzBackend):
    """The npz backend with deflate-compressed members: smaller files, slower saves."""

    compression = zipfile.ZIP_DEFLATED
    extension = ".npzc"


@loopkit.hookimpl
def checkpoint_backend_names() -> list[str]:
    return [NAME]


@loopkit.hookimpl
def checkpoint_backend(name: str, directory: Path | str, config: loopkit.Config):
    if name != NAME:
        return None
    basename = config.checkpoint_basename
    # local files; under an s3:// or gs:// logdir, staged locally and uploaded
    return local_or_staged(directory, basename,
                           lambda d: CompressedNpzBackend(d, basename, config))
