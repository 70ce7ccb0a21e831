"""The plugins' heavy imports, run in one background thread from a session's first step.

A plugin names, in its `import_ahead` hook, the modules it will import later in the
session (orbax at the first save or the restore, tensorboardX when the summary writer
opens). The hooks are asked at the session's opening; one thread imports the modules in
the hooks' call order from the first step's end, beside the training, instead of one
import after the other on the main thread, or beside `init` and the first compile
(whose cores an import shares: measured, a fresh start then took 1.4-1.5x a
hand-written loop's on two cores, against 0.96x without the imports). A restore, or a
save before then, imports what it needs itself. The plugin itself still
imports the module where it uses it: a plain ``import`` waits for the thread's import
of the same module (Python's per-module import lock), or finds it done.

A failed import stops the session (`request_stop`, as a service thread's error) with
the error, a note naming the module and the plugin: a plugin names only modules it
cannot run without, so a missing one fails the run within moments of its start, not at
the first save.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from typing import TYPE_CHECKING

from loopkit.loop.coordinator import add_note

if TYPE_CHECKING:
    from loopkit.plugin.view import SessionView

__all__ = ["import_ahead", "modules_ahead"]

log = logging.getLogger("loopkit")


def modules_ahead(session: SessionView) -> list[tuple[str, str]]:
    """(module, plugin name) for each module the plugins' `import_ahead` hooks name and
    that is not imported yet, in the hooks' call order, each module once."""
    wanted: dict[str, str] = {}
    # implementation by implementation, to know which plugin named which module
    for impl in reversed(session.hook.import_ahead.get_hookimpls()):
        names = impl.function(*(session if a == "session" else None for a in impl.argnames))
        if isinstance(names, str):
            raise TypeError(f"plugin {impl.plugin_name!r}: import_ahead returned the string "
                            f"{names!r}; it must return a list of module names (or None)")
        for name in names or ():
            if not isinstance(name, str) or not name:
                raise TypeError(f"plugin {impl.plugin_name!r}: import_ahead named {name!r}; "
                                "each entry must be a module name such as 'orbax.checkpoint'")
            # imported, or being imported by another thread (a later import waits
            # for it on the import lock): nothing to do ahead
            if sys.modules.get(name) is None:  # absent, or blocked (None: import raises)
                wanted.setdefault(name, impl.plugin_name)
    return list(wanted.items())


def import_ahead(session: SessionView,
                 wanted: list[tuple[str, str]] | None = None) -> threading.Thread | None:
    """Start importing `wanted` (by default what the plugins name: `modules_ahead`) in
    a daemon thread; None when there is nothing left to import. The session does not
    wait for it: each module's first user does, by importing it."""
    wanted = [(name, plugin) for name, plugin in
              (modules_ahead(session) if wanted is None else wanted)
              if sys.modules.get(name) is None]
    if not wanted:
        return None
    # a daemon: a session that ends before the thread does must not keep the process up
    thread = threading.Thread(target=_run, args=(session, wanted), daemon=True,
                              name="loopkit-import-ahead")
    thread.start()
    return thread


def _run(session: SessionView, wanted: list[tuple[str, str]]) -> None:
    for name, plugin in wanted:
        try:
            _import(name)
        except BaseException as ex:  # noqa: BLE001 - handed to the session
            add_note(ex, f"raised in loopkit importing {name!r} ahead, a module plugin "
                         f"{plugin!r} needs (its import_ahead hook named it)")
            log.error("loopkit: importing %r for plugin %r failed: %r", name, plugin, ex)
            session.request_stop(ex, agreed=True)
            return


def _import(name: str) -> None:
    try:
        importlib.import_module(name)
    except ImportError:
        raise
    except Exception as ex:
        # Two threads importing modules that import each other can meet in Python's
        # import locks ("deadlock detected", raised in one of them): the other thread
        # finishes its import, so this one's second try succeeds (or fails for real).
        if type(ex).__name__ != "_DeadlockError":
            raise
        importlib.import_module(name)
