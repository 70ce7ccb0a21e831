"""The built-in checkpoint backends, and what they share.

- `orbax` (``"orbax"``, the default, a subpackage): a standard orbax PyTree
  checkpoint per step, written asynchronously (`orbax.write`: the arrays in one
  batch), read by `orbax.read`; `orbax.layout` is what loopkit keeps beside orbax's
  tree; `orbax.parts` a database per process on a bucket, merged at the commit.
- `npz` (``"npz"``): one ``.npz`` file per step, numpy only, synchronous.
- `staged`: any local-file backend under a URL, staged on local disk and uploaded.
- `records` (how a leaf is described in JSON), `placement` (restored leaves placed
  like ``like``), `temporaries` (the save lock and the clean-up of dead saves).

Heavy imports (orbax, tensorstore) happen when a backend is built, not here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loopkit import storage

__all__ = ["BUILTIN_BACKENDS", "builtin_backend"]

#: the names `Config.checkpoint_backend` takes without a plugin
BUILTIN_BACKENDS = ("orbax", "npz")


def builtin_backend(name: str, directory: Path | str, config: Any) -> Any:
    """The built-in backend called `name` writing to `directory` (None: not a built-in).

    Under a URL it is staged on local disk, each process uploading its own part of
    each checkpoint (orbax: ``own_files``), and committed once all are there.
    """
    basename = config.checkpoint_basename
    if name == "orbax":
        from loopkit.plugins.checkpoint.backends.orbax import OrbaxBackend as make
    elif name == "npz":
        from loopkit.plugins.checkpoint.backends.npz import NpzBackend as make
    else:
        return None
    from loopkit.plugins.checkpoint.backends.staged import local_or_staged

    extra = {"own_files": True} if name == "orbax" and storage.is_url(directory) else {}
    return local_or_staged(directory, basename, lambda d: make(d, basename, config, **extra))
