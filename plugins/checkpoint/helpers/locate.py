"""Finding a checkpoint and the backend that reads it, for the helpers and the CLI.

Everything goes through the backend protocol: a logdir's checkpoints are the steps
its backends list, each built by the `checkpoint_backend` hook: first the backend
whose name the logdir records (``checkpoint_backend.json``, written by the
`checkpoint` plugin), then every backend a plugin names in the optional
`checkpoint_backend_names`. A checkpoint that is not in a logdir (an orbax save
under any name, an orbax `CheckpointManager` directory, safetensors files) is read
by a read-only backend over that path (`readers`).

A directory is a logdir first: one named like a checkpoint (``trial-0``,
``seed-42``) is read as the checkpoint ``<basename>-<step>`` of its parent only
when it holds no checkpoint of its own.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from loopkit import storage
from loopkit.plugins.checkpoint.recovery import durable_best
from loopkit.plugins.checkpoint.tf_file import (
    DEFAULT_BASENAME, checkpoint_path, read_backend_name, read_state,
)

__all__ = ["Backends", "FORMATS", "Located", "locate", "stored_at"]

FORMATS = (
    "a logdir holding checkpoints (the one a restart recovers), or a checkpoint path "
    "such as runs/a/model.ckpt-1000, written by any checkpoint backend ({backends}); "
    "an orbax PyTree checkpoint directory under any name (StandardCheckpointer, "
    "PyTreeCheckpointer); an orbax CheckpointManager directory (its latest step) or "
    "<dir>/<step>/<item>; a *.safetensors file, or a directory of them"
)


class Backends:
    """Every backend that may have written one directory, built for it and a basename.

    The backend whose name the directory records comes first, then those plugins
    name (plugins' before the built-ins: a plugin may override a built-in name); a
    step belongs to the first backend that lists it.
    """

    def __init__(self, directory: Path | str, basename: str) -> None:
        from loopkit.config import Config
        from loopkit.plugin.manager import make_plugin_manager

        config = Config(logdir=str(directory), checkpoint_basename=basename)
        pm = make_plugin_manager(config)
        recorded = read_backend_name(directory)
        self.names: list[str] = [recorded] if recorded is not None else []
        for names in pm.hook.checkpoint_backend_names():
            self.names += [n for n in names if n not in self.names]
        built = [pm.hook.checkpoint_backend(name=name, directory=directory, config=config)
                 for name in self.names]
        self.backends: list[Any] = [b for b in built if b is not None]

    def steps(self) -> dict[int, Any]:
        """Step -> the backend that holds it, over every backend."""
        found: dict[int, Any] = {}
        for backend in self.backends:
            for step in backend.steps():
                found.setdefault(int(step), backend)
        return found

    def close(self, keep: Any = None) -> None:
        for backend in self.backends:
            if backend is not keep:
                backend.close()


def basename_of(logdir: Path | str, basename: str | None) -> str:
    if basename is not None:
        return basename
    state = read_state(logdir)
    return state.basename if state is not None else DEFAULT_BASENAME


def recoverable(logdir: Path | str, found: dict[int, Any], basename: str) -> int | None:
    """The step a restart would try first among ``found``."""
    return durable_best(found, read_state(logdir, basename))


class Located:
    """A checkpoint found: its backend (to close after use), step and path."""

    def __init__(self, backend: Any, step: int, where: str) -> None:
        self.backend, self.step, self.where = backend, step, where


def _in_logdir(directory: Path | str, basename: str, step: int | None) -> Located | None:
    """The checkpoint ``step`` (None: the one a restart recovers) of a backend in ``directory``."""
    group = Backends(directory, basename)
    found = group.steps()
    if step is None:
        step = recoverable(directory, found, basename)
    backend = found.get(step)  # (None for a step None)
    group.close(keep=backend)
    if backend is None:
        return None
    return Located(backend, step, checkpoint_path(directory, basename, step))


def _manager_item(step_dir: Path) -> Path | None:
    """The one orbax PyTree item of a `CheckpointManager` step directory."""
    from loopkit.plugins.checkpoint.backends.orbax.layout import is_orbax_tree

    if is_orbax_tree(step_dir):
        return step_dir
    items = sorted(p for p in step_dir.iterdir() if is_orbax_tree(p)) if step_dir.is_dir() else []
    if len(items) > 1:
        raise FileNotFoundError(
            f"{step_dir} holds several orbax items ({', '.join(p.name for p in items)}): "
            f"name one, e.g. {items[0]}")
    return items[0] if items else None


def _foreign(target: Path) -> Located | None:
    """A read-only backend for what another library wrote at ``target``."""
    from loopkit.plugins.checkpoint.helpers.readers.orbax import OrbaxCheckpoint
    from loopkit.plugins.checkpoint.helpers.readers.safetensors import SafetensorsCheckpoint

    if target.is_file() and target.name.endswith(".safetensors"):
        return Located(SafetensorsCheckpoint([target]), 0, str(target))
    if not target.is_dir():
        return None
    item = _manager_item(target)
    if item is not None:  # a PyTree save, or <manager>/<step>
        step = int(target.name) if target.name.isdigit() else (
            int(target.parent.name) if target.parent.name.isdigit() else 0)
        return Located(OrbaxCheckpoint(item, step), step, str(item))
    steps = sorted(int(p.name) for p in target.iterdir() if p.name.isdigit() and p.is_dir())
    for step in reversed(steps):  # a CheckpointManager directory: its latest step
        item = _manager_item(target / str(step))
        if item is not None:
            return Located(OrbaxCheckpoint(item, step), step, str(item))
    files = sorted(target.glob("*.safetensors"))
    if files:
        return Located(SafetensorsCheckpoint(files, target), 0, str(target))
    return None


def _what_is(target: Path | str, url: bool) -> str:
    if not url and not target.exists():
        return "nothing there"
    if not url and target.is_file():
        return f"a file of {target.stat().st_size} bytes in no format loopkit reads"
    names = sorted(storage.list_names(target) if url else os.listdir(target))
    if not names:
        return "nothing" if url else "an empty directory"
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    holding = "" if url else "a directory holding "
    return f"{holding}{shown}, none of them a checkpoint loopkit reads"


def locate(target: Path | str) -> Located:
    """The checkpoint at ``target`` (a checkpoint path, a logdir, or another library's files).

    A URL is read through the backends only: another library's files under a URL
    are not (download them first).
    """
    name, url = storage.name_of(target), storage.is_url(target)
    if url or target.is_dir():  # a logdir first, even one named like a checkpoint (trial-0)
        found = _in_logdir(target, basename_of(target, None), None)
        if found is not None:
            return found
    m = re.fullmatch(r"(.+)-(0|[1-9][0-9]*)(\.[A-Za-z0-9]+)?", name)
    if m is not None and not name.endswith(".safetensors"):
        found = _in_logdir(storage.parent(target), m.group(1), int(m.group(2)))
        if found is not None:
            return found
    found = None if url else _foreign(target)
    if found is not None:
        return found
    names = Backends(storage.parent(target), DEFAULT_BASENAME)
    names.close()
    what = _what_is(target, url) + ("; under a URL loopkit reads only what its checkpoint "
                                    "backends wrote" if url else "")
    raise FileNotFoundError(
        f"no checkpoint at {target}: found {what}. loopkit reads "
        + FORMATS.format(backends=", ".join(names.names)))


def stored_at(backend: Any, logdir: Path | str, base: str, step: int) -> Path | str:
    """Where ``backend`` stores ``step``: its `path`, or for a backend with only the six
    protocol methods, the name ``<base>-<step>`` (with one extension, if so) in `logdir`."""
    if hasattr(backend, "path"):
        return backend.path(step)
    name = f"{base}-{step}"
    pattern = re.compile(re.escape(name) + r"(\.[A-Za-z0-9]+)?")  # a final name (docs)
    on_disk = sorted(n for n in storage.list_names(logdir) if pattern.fullmatch(n))
    return storage.join(logdir, on_disk[0] if on_disk else name)
