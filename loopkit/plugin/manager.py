"""Builds the plugin manager of one session: built-ins, entry points, arguments."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import os
from typing import TYPE_CHECKING, Any, Iterable

import pluggy

from loopkit.loop.coordinator import add_note, has_origin
from loopkit.errors import PluginError

if TYPE_CHECKING:
    from loopkit.config import Config
    from loopkit.plugin.view import SessionView

log = logging.getLogger("loopkit")

__all__ = ["BUILTINS", "AUTOLOAD_ENV", "PluginManager", "make_command_manager",
           "make_plugin_manager"]

#: Built-in plugins, in start order: `session_create` runs in this order (before
#: any other plugin's), and `on_stop` in the reverse order (after every other's).
BUILTINS = (
    "init",
    "goodput",
    "replica_check",
    "straggler",
    "summaries",
    "checkpoint",
    "step_counter",
    "progress",
    "prefetch",
    "nan_guard",
    "profiler",
    "watchdog",
)

#: Set to a non-empty value to skip third-party plugins from entry points.
AUTOLOAD_ENV = "LOOPKIT_DISABLE_PLUGIN_AUTOLOAD"

ENTRY_POINT_GROUP = "loopkit"


class PluginManager(pluggy.PluginManager):
    """A `pluggy.PluginManager` that remembers where each plugin came from."""

    def __init__(self) -> None:
        super().__init__("loopkit")
        # the module, not the `loopkit.hookspec` marker re-exported by the package
        self.add_hookspecs(importlib.import_module("loopkit.plugin.hookspec"))
        #: plugin name -> "built-in" | "entry point (dist)" | "argument"
        self.origins: dict[str, str] = {}
        #: built-ins that this config leaves inactive (e.g. nan_guard without a metric)
        self.inactive: dict[str, str] = {}

    def register(self, plugin: Any, name: str | None = None) -> str | None:
        """Register `plugin`; a wrapper on `on_stop` is refused, naming the plugin.

        `on_stop` must reach every implementation even when one raises, so it is
        called implementation by implementation (`call_on_stop`), which a
        wrapper's ``yield`` around the others cannot take part in.
        """
        opts = self.parse_hookimpl_opts(plugin, "on_stop") if hasattr(plugin, "on_stop") else None
        if opts and (opts.get("wrapper") or opts.get("hookwrapper")):
            raise PluginError(
                f"plugin {name or _plugin_name(plugin)!r}: on_stop may not be a hook wrapper "
                "(every on_stop implementation runs, even after one raises); implement it "
                "as a plain @loopkit.hookimpl"
            )
        registered = super().register(plugin, name)
        self.hook.plugin_registered.call_historic(kwargs={"plugin": plugin, "manager": self})
        return registered

    def builtin_names(self) -> list[str]:
        """The registered built-ins, in start order."""
        return [n for n in BUILTINS if self.origins.get(n) == "built-in"]

    def call_on_stop(self, session: SessionView, error: BaseException | None) -> list[BaseException]:
        """Call every `on_stop` implementation, even when one raises; return their errors.

        Other plugins first (in pluggy's order), then the built-ins in the reverse
        of their start order. Once one raises after a clean run, the later ones
        see that error: they must not, e.g., save a final checkpoint of a state a
        NaN guard just rejected.
        """
        rank = {name: i for i, name in enumerate(self.builtin_names())}
        # a stable sort: the others keep pluggy's order, the built-ins come last, reversed
        impls = sorted(reversed(self.hook.on_stop.get_hookimpls()),
                       key=lambda i: (i.plugin_name in rank, -rank.get(i.plugin_name, 0)))
        errors: list[BaseException] = []
        kwargs: dict[str, Any] = {"session": session, "error": error}
        for impl in impls:
            try:
                impl.function(*(kwargs[a] for a in impl.argnames))
            except BaseException as ex:  # noqa: BLE001 - every on_stop must run
                add_note(ex, f"raised in loopkit hook 'on_stop' of plugin {impl.plugin_name!r}")
                log.error("loopkit: on_stop of plugin %r raised %r", impl.plugin_name, ex)
                ex._loopkit_plugin = impl.plugin_name  # type: ignore[attr-defined]
                errors.append(ex)
                if kwargs["error"] is None:
                    kwargs["error"] = ex
        return errors

    def find_hook_origin(self, ex: BaseException) -> tuple[str, str] | None:
        """(hook name, plugin name) of the innermost hook implementation in `ex`'s traceback.

        pluggy stops at the first exception without saying which implementation
        raised; the traceback does.
        """
        codes: dict[Any, tuple[str, str]] = {}
        for name, caller in vars(self.hook).items():
            if not hasattr(caller, "get_hookimpls"):
                continue
            for impl in caller.get_hookimpls():
                fn = getattr(impl.function, "__func__", impl.function)
                code = getattr(fn, "__code__", None)
                if code is not None:
                    codes[code] = (name, impl.plugin_name)
        tb, found = ex.__traceback__, None
        while tb is not None:
            found = codes.get(tb.tb_frame.f_code, found)
            tb = tb.tb_next
        return found

    def note_origin(self, ex: BaseException, step: int, step_fn: bool = True) -> None:
        """Add a note to `ex` saying which hook of which plugin raised it at `step`, or
        (`step_fn`) else the step function; nothing when a note says so already."""
        if has_origin(ex):
            return
        origin = self.find_hook_origin(ex)
        if origin is not None:
            hook_name, plugin_name = origin
            add_note(ex, f"raised in loopkit hook {hook_name!r} of plugin {plugin_name!r} "
                         f"at step {step}")
        elif step_fn and not isinstance(ex, (KeyboardInterrupt, SystemExit)):
            add_note(ex, f"raised in loopkit's step function at step {step + 1}")

    def describe(self) -> list[tuple[str, str, list[str]]]:
        """(name, origin, hooks) for every plugin, registered or inactive."""
        rows = []
        for name, origin in self.origins.items():  # registered: each has its hook callers
            callers = self.get_hookcallers(self.get_plugin(name)) or []
            rows.append((name, origin, sorted(caller.name for caller in callers)))
        for name, why in self.inactive.items():
            module = importlib.import_module(f"loopkit.plugins.{name}")
            rows.append((name, f"built-in, inactive: {why}", _module_hooks(module)))
        return rows


def _module_hooks(module: Any) -> list[str]:
    """The hooks implemented by the plugin classes defined in `module` (or its package)."""
    hooks = set()
    for obj in vars(module).values():
        if inspect.isclass(obj) and (obj.__module__ == module.__name__
                                     or obj.__module__.startswith(module.__name__ + ".")):
            hooks.update(n for n, v in vars(obj).items() if hasattr(v, "loopkit_impl"))
    return sorted(hooks)


def _plugin_name(obj: Any) -> str:
    return obj.__name__ if inspect.ismodule(obj) else type(obj).__name__


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
        module = importlib.import_module(f"loopkit.plugins.{name}")
        plugin = module.plugin(config)
        if plugin is None:
            pm.inactive[name] = getattr(module, "INACTIVE", "off")
            continue
        loaded.append((name, plugin))
    for name, plugin in reversed(loaded):
        pm.register(plugin, name=name)
    pm.origins = {name: "built-in" for name, _ in loaded}  # in start order, for listings

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


def make_command_manager() -> PluginManager:
    """The plugins the ``loopkit`` command asks for its verbs (`command_line`) and for
    its restart records (`run_restarted`): those a run with a logdir and an otherwise
    default Config uses, and each built-in's ``commands`` module where it has one."""
    from loopkit.config import Config

    pm = make_plugin_manager(Config(logdir="LOGDIR"))
    for name in BUILTINS:
        try:
            module = importlib.import_module(f"loopkit.plugins.{name}.commands")
        except ModuleNotFoundError as ex:  # a built-in with no verbs of its own
            if ex.name not in (f"loopkit.plugins.{name}", f"loopkit.plugins.{name}.commands"):
                raise
            continue
        _register(pm, module, f"{name}.commands", "built-in")
    return pm


def _register(pm: PluginManager, obj: Any, name: str, origin: str) -> None:
    try:
        pm.register(obj, name=name)
    except (pluggy.PluginValidationError, ValueError) as ex:
        raise PluginError(f"plugin {name!r} ({origin}): {ex}") from ex
    pm.origins[name] = origin
