"""`Config.compilation_cache`: JAX's persistent compilation cache beside the run.

A restarted process then loads its step's executable instead of compiling it
again. Short compiles are cached too (JAX keeps only those over a second by
default, and a small step compiles in less). A cache the user configured
(``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``) is left alone, and so is
everything with ``compilation_cache=False``; the settings loopkit changed are
given back when the session closes, or, when the step's save variant still compiles
in the background then, once that compile (which writes to this cache) is done.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable

import jax

from loopkit import storage

__all__ = ["CACHE_NAME", "cache_directory", "use_compilation_cache"]

#: the cache's directory inside a local logdir
CACHE_NAME = ".jax_cache"
_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")


def cache_directory(logdir: Path | str) -> Path:
    """``logdir/.jax_cache`` for a local logdir; a local directory named after a URL's."""
    if not storage.is_url(logdir):
        return Path(logdir) / CACHE_NAME
    digest = hashlib.sha256(str(logdir).encode()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "loopkit" / "jax" / digest


def use_compilation_cache(enabled: bool, logdir: Path | str | None) -> Callable[[], None] | None:
    """Point JAX's persistent cache at `cache_directory(logdir)`; return what undoes it.

    None (nothing changed) when `enabled` is False, without a logdir, or when the
    user has set a cache directory of their own.
    """
    if not enabled or logdir is None or jax.config.jax_compilation_cache_dir:
        return None
    saved: dict[str, Any] = {name: getattr(jax.config, name) for name in _SETTINGS}
    directory = cache_directory(logdir)
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    def undo() -> None:
        for name, value in saved.items():
            jax.config.update(name, value)

    return undo
