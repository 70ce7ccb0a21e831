"""`Supervisor`: the tf.train.Supervisor idiom, and the start-up/stop order `train` uses."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any, Callable, Iterable, Mapping

import jax
import pluggy

from loopkit.config import Config
from loopkit.coordinator import Coordinator, LooperThread, add_note
from loopkit.data import make_input
from loopkit.manager import BUILTINS, make_plugin_manager
from loopkit.pytree import abstract, check_matches, concrete_like, conform
from loopkit.scheduler import agree_across_processes
from loopkit.session import Session

__all__ = ["Supervisor", "make_config"]

log = logging.getLogger("loopkit")

PyTree = Any


def make_config(config: Config | None, fields: Mapping[str, Any]) -> Config:
    """`config` with `fields` applied; unknown field names are a `TypeError`."""
    unknown = set(fields) - set(Config.field_names())
    if unknown:
        raise TypeError(
            f"unknown Config field(s) {sorted(unknown)}; known: {', '.join(Config.field_names())}"
        )
    if config is None:
        return Config(**fields)
    if not isinstance(config, Config):
        raise TypeError(f"config={config!r} must be a loopkit.Config or None")
    return config.replace(**fields) if fields else config


class Supervisor:
    """Checkpoints, summaries, recovery and clean stopping around a loop you write.

    >>> import jax.numpy as jnp
    >>> sv = Supervisor(save_model_secs=0, save_summaries_secs=0, progress=False)
    >>> with sv.managed_session(lambda s: (s + 1, {}), init=jnp.zeros(())) as sess:
    ...     for _ in range(3):
    ...         _ = sess.run()
    >>> int(sess.state), sess.step
    (3, 3)
    """

    def __init__(self, config: Config | None = None, *, plugins: Iterable[Any] = (),
                 clock: Callable[[], float] | None = None, **fields: Any) -> None:
        self.config = make_config(config, fields)
        self._plugins = list(plugins)
        self._clock = clock
        self._coord = Coordinator()
        self._session: Session | None = None
        self._active = False

    # -- properties of the Supervisor --------------------------------------------------

    @property
    def coord(self) -> Coordinator:
        """The Coordinator of the current (or last) session."""
        return self._coord

    @property
    def is_chief(self) -> bool:
        if self.config.is_chief is not None:
            return self.config.is_chief
        return jax.process_index() == 0

    @property
    def save_path(self) -> str | None:
        """``logdir/<checkpoint_basename>``: the prefix of checkpoint names."""
        logdir = self.config.logdir_path
        return None if logdir is None else os.path.join(logdir, self.config.checkpoint_basename)

    @property
    def summary_writer(self) -> Any:
        return self._session.summary_writer if self._session is not None else None

    @property
    def save_model_secs(self) -> float | None:
        return self.config.save_model_secs

    @property
    def save_summaries_secs(self) -> float | None:
        return self.config.save_summaries_secs

    @property
    def session(self) -> Session | None:
        """The current (or last) `Session`."""
        return self._session

    # -- the Coordinator's methods -----------------------------------------------------

    def should_stop(self) -> bool:
        return self._coord.should_stop()

    def request_stop(self, ex: BaseException | None = None) -> None:
        self._coord.request_stop(ex)

    def stop(self, threads: Any = None, close_summary_writer: bool = True) -> None:
        """Request a stop. The session's services finish when its `with` block exits."""
        self._coord.request_stop()

    def stop_on_exception(self):
        """Context manager: an exception in the block is recorded and stops the session."""
        return self._coord.stop_on_exception()

    def wait_for_stop(self, timeout: float | None = None) -> bool:
        return self._coord.wait_for_stop(timeout)

    def loop(self, interval_secs: float | None, target: Callable[..., Any],
             args: tuple | None = None, kwargs: dict | None = None) -> LooperThread:
        """Start a thread calling `target` every `interval_secs` until the stop."""
        thread = LooperThread(self._coord, interval_secs, target, args or (), kwargs)
        self._coord.register_thread(thread)
        thread.start()
        return thread

    def summary_computed(self, values: Mapping[str, Any], step: int | None = None) -> None:
        """Write user-computed summaries (tag -> value) to the session's event file."""
        if self._session is not None:
            self._session.summary_computed(values, step)
        elif self.is_chief:
            raise RuntimeError(
                "summary_computed needs a summary writer: call it inside managed_session "
                "with Config.logdir set"
            )

    # -- the session -------------------------------------------------------------------

    def managed_session(self, step_fn: Callable[..., Any], init: Any, *,
                        data: Any = None) -> _ManagedSession:
        """A context manager that starts a session and yields its `Session`.

        Start-up follows `prepare_or_wait_for_session`: recover from the latest
        checkpoint, else `init` then `init_fn`; then `local_init_fn`; then the
        ready check. Leaving the block stops the session: a final checkpoint on a
        normal exit, none after an error, which is re-raised.

        `data` is how `train` hands over its input (`session.input`, which the
        prefetch plugin fills ahead and whose position checkpoints record). In
        your own loop, leave it None and pass each batch to `sess.run(batch)`;
        with `data` set, read batches from `session.input.iterator`, or the
        saved input position will not match what the steps consumed.
        """
        return _ManagedSession(self, step_fn, init, data)


def _also(ex: BaseException) -> str:
    plugin = getattr(ex, "_loopkit_plugin", None)
    where = f"on_stop of plugin {plugin!r} raised " if plugin else ""
    return f"while stopping, also: {where}{type(ex).__name__}: {ex}"


class _ManagedSession:
    def __init__(self, sv: Supervisor, step_fn: Callable[..., Any], init: Any, data: Any) -> None:
        self.sv, self.step_fn, self.init, self.data = sv, step_fn, init, data
        self.session: Session | None = None
        self._signals: dict[int, Any] = {}

    def __enter__(self) -> Session:
        sv = self.sv
        if sv._active:
            raise RuntimeError("this Supervisor already runs a session: leave its `with` "
                               "block first (or use another Supervisor)")
        if sv._coord.stopped:  # a used coordinator; a fresh one keeps threads from sv.loop()
            sv._coord = Coordinator()
        coord = sv._coord
        sv._active = True
        cfg = sv.config
        pm = make_plugin_manager(cfg, sv._plugins)
        session = Session(cfg, pm, coord, self.step_fn, sv._clock)
        sv._session = self.session = session
        self._install_signal_handlers(coord)
        try:
            self._prepare(session)
        except BaseException as ex:
            self._finish(ex)  # runs on_stop, re-raises
            raise
        return session

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and isinstance(exc, StopIteration):
            # the user's input ran out: a normal stop, as OutOfRangeError was
            self.session._coord.request_stop(reason="data_exhausted")
            exc = None
        self._finish(exc)
        return True  # _finish raised whatever must be raised

    # -- start-up: prepare_or_wait_for_session ------------------------------------------

    def _prepare(self, session: Session) -> None:
        init, hook = self.init, session.hook
        built = None  # init() run for real because it could not be traced
        if callable(init):
            try:
                like = concrete_like(init, jax.eval_shape(init))
            except jax.errors.JAXTypeError as ex:
                # e.g. numpy or float() on a traced value: build it once, for real
                log.info("loopkit: init could not be traced (%s); calling it", type(ex).__name__)
                built = init()
                like = abstract(built)
        else:
            like = abstract(init)
        restored = hook.restore_state(session=session, like=like)
        if restored is not None:
            session.restored = restored
            session.state = conform(restored.state, like)
            session.step = int(restored.step)
            protect = False
        else:
            state = built if built is not None else init() if callable(init) else init
            new = hook.init_state(session=session, state=state)
            session.state = state if new is None else new
            protect = not callable(init)
        hook.local_init(session=session)
        check_matches(
            session.state, like,
            "the restored state" if restored is not None else "the state after init_fn",
        )
        if self.data is not None:
            session.input = make_input(
                self.data, session.step,
                restored.data_position if restored is not None else None,
                restored is not None, session.config.data_sharding,
            )
        session._compile(protect_first_step=protect)
        max_steps = session.config.max_steps
        if max_steps is not None:
            if session.step >= max_steps:
                session._coord.request_stop(reason="max_steps")
            session._sched.set_stop_step(
                max_steps, lambda: session._coord.request_stop(reason="max_steps")
            )
        if jax.process_count() > 1:
            agree_across_processes(session)
        session.stats.start_time = session._clock()
        # Built-in services first, in BUILTINS order (pluggy alone would call the
        # plugins registered after them first), so the summary writer and the
        # checkpoint backend are ready in every other plugin's session_create.
        pm = session.plugin_manager
        builtins = [pm.get_plugin(n) for n in pm.builtin_names()]
        others = [p for p in pm.get_plugins() if p not in builtins]
        pm.subset_hook_caller("session_create", others)(session=session)
        pm.subset_hook_caller("session_create", builtins)(session=session)

    # -- stopping ------------------------------------------------------------------------

    def _finish(self, error: BaseException | None) -> None:
        session = self.session
        assert session is not None
        coord, cfg = session._coord, session.config
        if error is not None and not isinstance(error, StopIteration):
            session._annotate(error, fallback=False)  # run() annotates the step's own
        coord.request_stop(error)
        try:
            coord.join(cfg.stop_grace_secs)
        except BaseException as ex:  # noqa: BLE001 - a second Ctrl-C: still run on_stop
            coord.request_stop(ex)
        error = coord.exception
        try:
            stop_errors = self._run_on_stop(session, error)
        finally:
            session.summary_writer = None  # closed by now
            session._end()
            self.sv._active = False
        self._restore_signal_handlers()
        if error is None and coord.exception is not None:
            error = coord.exception  # a thread failed during shutdown
        if error is not None:
            for ex in stop_errors:
                add_note(error, _also(ex))
            raise error
        if stop_errors:
            first = stop_errors[0]
            for ex in stop_errors[1:]:
                add_note(first, _also(ex))
            raise first

    def _run_on_stop(self, session: Session, error: BaseException | None) -> list[BaseException]:
        """Call every `on_stop` implementation, even when one raises.

        Other plugins first (in pluggy's order), then the built-ins in the reverse
        of their start order.
        """
        impls = list(reversed(session.hook.on_stop.get_hookimpls()))
        rank = {name: i for i, name in enumerate(BUILTINS)}
        builtin = session.plugin_manager.origins
        others = [i for i in impls if builtin.get(i.plugin_name) != "built-in"]
        mine = sorted(
            (i for i in impls if builtin.get(i.plugin_name) == "built-in"),
            key=lambda i: -rank.get(i.plugin_name, 0),
        )
        errors: list[BaseException] = []
        kwargs = {"session": session, "error": error}

        def call(impl: Any) -> Any:
            try:
                return impl.function(*(kwargs[a] for a in impl.argnames))
            except BaseException as ex:  # noqa: BLE001 - every on_stop must run
                failed(ex, impl.plugin_name)
                return None

        def failed(ex: BaseException, plugin_name: str) -> None:
            add_note(ex, f"raised in loopkit hook 'on_stop' of plugin {plugin_name!r}")
            log.error("loopkit: on_stop of plugin %r raised %r", plugin_name, ex)
            ex._loopkit_plugin = plugin_name  # type: ignore[attr-defined]
            errors.append(ex)
            if kwargs["error"] is None:
                # the stop is a failed one now: later plugins must not, e.g., save
                # a final checkpoint of a state a NaN guard just rejected
                kwargs["error"] = ex

        # wrapper implementations: the part before `yield` runs first, the rest last
        wrappers = [i for i in others if i.wrapper or i.hookwrapper]
        started = []
        for impl in wrappers:
            gen = call(impl)
            if gen is None:
                continue
            try:
                next(gen)
                started.append((impl, gen))
            except StopIteration:
                pass
            except BaseException as ex:  # noqa: BLE001
                failed(ex, impl.plugin_name)
        for impl in [i for i in others if i not in wrappers] + mine:
            call(impl)
        for impl, gen in reversed(started):
            try:
                # old-style hookwrappers receive a pluggy Result, new-style None
                gen.send(pluggy.Result(None, None) if impl.hookwrapper else None)
            except StopIteration:
                pass
            except BaseException as ex:  # noqa: BLE001
                failed(ex, impl.plugin_name)
        return errors

    # -- signals ---------------------------------------------------------------------------

    def _install_signal_handlers(self, coord: Coordinator) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        seen = {"count": 0}

        def handler(signum: int, frame: Any) -> None:
            seen["count"] += 1
            if seen["count"] > 1:  # a second signal (Ctrl-C or SIGTERM) aborts
                self._restore_signal_handlers()
                raise KeyboardInterrupt
            log.warning(
                "loopkit: got %s, stopping after the current step%s",
                signal.Signals(signum).name,
                " (press Ctrl-C again to abort)" if signum == signal.SIGINT else
                " (a second signal aborts)",
            )
            if jax.process_count() > 1:
                # Many processes: stop at a step every process agrees on, so that
                # none is left waiting in a collective the others skipped.
                coord.signal_pending = True
            else:
                coord.request_stop(reason="signal")

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._signals[sig] = signal.signal(sig, handler)
            except (ValueError, OSError):  # pragma: no cover - not the main interpreter
                pass

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._signals.items():
            signal.signal(sig, old)
        self._signals.clear()

