"""Builds the plugin manager of one session: built-ins, entry points, arguments."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
from typing import TYPE_CHECKING, Any, Iterable

import pluggy

from loopkit.errors import PluginError

if TYPE_CHECKING:
    from loopkit.config import Config

__all__ = ["BUILTINS", "AUTOLOAD_ENV", "PluginManager", "make_plugin_manager"]

#: Built-in plugins, in start order: `session_create` runs in this order (before
#: any other plugin's), and `on_stop` in the reverse order (after every other's).
BUILTINS = (
    "init",
    "summaries",
    "checkpoint",
    "step_counter",
    "progress",
    "prefetch",
    "nan_guard",
    "profiler",
)

#: Set to a non-empty value to skip third-party plugins from entry points.
AUTOLOAD_ENV = "LOOPKIT_DISABLE_PLUGIN_AUTOLOAD"

ENTRY_POINT_GROUP = "loopkit"


class PluginManager(pluggy.PluginManager):
    """A `pluggy.PluginManager` that remembers where each plugin came from."""

    def __init__(self) -> None:
        super().__init__("loopkit")
        # the module, not the `loopkit.hookspec` marker re-exported by the package
        self.add_hookspecs(importlib.import_module("loopkit.hookspec"))
        #: plugin name -> "built-in" | "entry point (dist)" | "argument"
        self.origins: dict[str, str] = {}
        #: built-ins that this config leaves inactive (e.g. nan_guard without a metric)
        self.inactive: dict[str, str] = {}

    def builtin_names(self) -> list[str]:
        return [n for n in BUILTINS if self.origins.get(n) == "built-in"]

    def describe(self) -> list[tuple[str, str, list[str]]]:
        """(name, origin, hooks) for every plugin, registered or inactive."""
        rows = []
        for name, origin in self.origins.items():
            plugin = self.get_plugin(name)
            hooks = sorted(
                caller.name for caller in (self.get_hookcallers(plugin) or [])
            ) if plugin is not None else []
            rows.append((name, origin, hooks))
        for name, why in self.inactive.items():
            rows.append((name, f"built-in, inactive: {why}", []))
        return rows


def _plugin_name(obj: Any) -> str:
    if inspect.ismodule(obj):
        return obj.__name__
    return type(obj).__name__


def _load_builtin(name: str, config: Config) -> Any:
    module = importlib.import_module(f"loopkit.plugins.{name}")
    return module.plugin(config)


def make_plugin_manager(config: Config, plugins: Iterable[Any] = ()) -> PluginManager:
    """One fresh manager for one session; no module-level state is touched."""
    pm = PluginManager()
    disabled = set(config.disable)
    known = set(BUILTINS)
    # Register in reverse so pluggy's LIFO call order runs them in BUILTINS order.
    loaded = []
    for name in BUILTINS:
        if name in disabled:
            pm.set_blocked(name)
            continue
        plugin = _load_builtin(name, config)
        if plugin is None:
            pm.inactive[name] = getattr(
                importlib.import_module(f"loopkit.plugins.{name}"), "INACTIVE", "off"
            )
            continue
        loaded.append((name, plugin))
    for name, plugin in reversed(loaded):
        pm.register(plugin, name=name)
        pm.origins[name] = "built-in"
    # keep `origins` in start order for listings
    pm.origins = {n: pm.origins[n] for n, _ in loaded}

    autoload = config.autoload and not os.environ.get(AUTOLOAD_ENV)
    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            if ep.group != ENTRY_POINT_GROUP:
                continue
            known.add(ep.name)  # a name in `disable` stays valid with autoload off
            if not autoload or ep.name in disabled or pm.has_plugin(ep.name):
                continue
            try:
                obj = ep.load()
                if inspect.isclass(obj):
                    obj = obj()
            except Exception as ex:
                raise PluginError(
                    f'Error importing plugin "{ep.name}" (entry point {ep.value!r} '
                    f"of {dist.metadata['Name']}): {type(ex).__name__}: {ex}"
                ) from ex
            _register(pm, obj, ep.name, f"entry point ({dist.metadata['Name']})")

    for obj in plugins:
        name = _plugin_name(obj)
        if pm.has_plugin(name) or pm.is_blocked(name):
            name = f"{name}-{id(obj):x}"
        _register(pm, obj, name, "argument")

    unknown = disabled - known
    if unknown:
        raise ValueError(
            f"Config.disable={tuple(config.disable)!r} names unknown plugins "
            f"{sorted(unknown)}; known: {sorted(known)}"
        )
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as ex:
        name = pm.get_name(ex.plugin) or _plugin_name(ex.plugin)
        raise PluginError(f"plugin {name!r} ({pm.origins.get(name, '?')}): {ex}") from ex
    return pm


def _register(pm: PluginManager, obj: Any, name: str, origin: str) -> None:
    try:
        pm.register(obj, name=name)
    except pluggy.PluginValidationError as ex:
        raise PluginError(f"plugin {name!r} ({origin}): {ex}") from ex
    except ValueError as ex:
        raise PluginError(f"plugin {name!r} ({origin}): {ex}") from ex
    pm.origins[name] = origin
