"""`Session`: what every hook receives, and the per-step path."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import jax
import numpy as np

from loopkit.coordinator import Coordinator, LooperThread, add_note, has_origin
from loopkit.scheduler import Scheduler, Timer

if TYPE_CHECKING:
    import threading

    from loopkit.checkpoint import Restored
    from loopkit.config import Config
    from loopkit.data import Input
    from loopkit.manager import PluginManager

__all__ = ["Session", "SessionStats"]

PyTree = Any


@dataclasses.dataclass
class SessionStats:
    """Where loopkit's own time goes; the summaries plugin reports it."""

    #: wall time when the session's first step was about to run
    start_time: float = 0.0
    #: seconds spent in timer actions (checkpoints, summaries, ...), by timer name
    timer_secs: dict[str, float] = dataclasses.field(default_factory=dict)
    #: seconds the loop waited for input (prefetch queue empty)
    input_wait_secs: float = 0.0
    #: how long the last checkpoint save held the loop
    checkpoint_blocking_secs: float | None = None
    #: how many times the metrics were fetched to the host (`Session.host_metrics`)
    host_conversions: int = 0

    def overhead_secs(self) -> float:
        return sum(self.timer_secs.values()) + self.input_wait_secs


def _copy(x: Any) -> Any:
    return x.copy() if isinstance(x, jax.Array) else x


def _is_jitted(fn: Any) -> bool:
    return callable(getattr(fn, "lower", None)) and callable(getattr(fn, "eval_shape", None))


class Session:
    """One training session: the state, the global step, and the services around it.

    Hooks receive it; `Supervisor.managed_session` yields it. `run(batch)` is the
    per-step path: ``before_step`` (only if implemented) -> jitted step ->
    ``step += 1`` -> ``after_step`` (only if implemented) -> one timer check.
    """

    def __init__(self, config: Config, pm: PluginManager, coord: Coordinator,
                 step_fn: Callable[..., Any], clock: Callable[[], float] | None = None) -> None:
        self.config = config
        self.logdir: Path | None = config.logdir_path
        self.is_chief: bool = (
            config.is_chief if config.is_chief is not None else jax.process_index() == 0
        )
        self.state: PyTree = None
        self.step: int = 0
        self.metrics: Mapping[str, Any] = {}
        self.summary_writer: Any = None
        #: what `restore_state` recovered, or None for a fresh start
        self.restored: Restored | None = None
        #: the input the loop reads (None when `train` got ``data=None`` or in the
        #: Supervisor idiom, where the user feeds `run(batch)`)
        self.input: Input | None = None
        self.stats = SessionStats()
        self.plugin_manager = pm
        self.hook = pm.hook
        self._coord = coord
        self._clock = clock or time.monotonic
        self._sched = Scheduler(self._clock)
        self.stats.timer_secs = self._sched.spent  # the scheduler times each action
        self._step_fn = step_fn
        self._donating: Callable[..., Any] = step_fn
        self._plain: Callable[..., Any] = step_fn
        self._call: Callable[..., Any] = step_fn
        self._before: Any = None
        self._after: Any = None
        self._host: dict[str, Any] = {}
        self._host_step = -1
        self._host_src: Any = None

    # -- the per-step path -----------------------------------------------------------

    def run(self, *batch: Any) -> Mapping[str, Any]:
        """Run one step on `batch` (or on no batch); return its metrics.

        The metrics stay where the step left them (device arrays, possibly not
        yet computed): nothing here waits for the device.
        """
        try:
            if self._before is not None:
                self._before(session=self, step=self.step)
            self.state, metrics = self._call(self.state, *batch)
            self.step = step = self.step + 1
            self.metrics = metrics
            if self._after is not None:
                self._after(session=self, step=step, metrics=metrics)
            sched = self._sched
            if step >= sched.next_step or self._clock() >= sched.next_time:
                sched.run_due(self, step)
            return metrics
        except BaseException as ex:
            self._annotate(ex)
            raise

    def skip_donation_once(self) -> None:
        """Run the next step without donating the state (a second compiled variant).

        A saver that still reads the current state's buffers in the background
        calls this: the next step then writes fresh buffers instead of reusing
        the ones being saved. It costs one extra state in memory while the write
        runs, and no copy on the loop.
        """
        if self._plain is self._donating:
            return
        donating, plain = self._donating, self._plain

        def once(*args: Any) -> Any:
            self._call = donating
            return plain(*args)

        self._call = once

    # -- what hooks and users call ---------------------------------------------------

    @property
    def clock(self) -> Callable[[], float]:
        """The session's clock (`time.monotonic` unless a test injected one).

        Timers and `stats` use it, so rates and shares computed with it agree.
        """
        return self._clock

    def host_metrics(self) -> dict[str, Any]:
        """The latest metrics as host values: floats for scalars, numpy arrays otherwise.

        Waits for the step that made them. Converted once per step and cached,
        so the summaries, progress display and NaN guard share one transfer.
        Call it from a timer (`every`), never on every step.
        """
        if self._host_step != self.step or self._host_src is not self.metrics:
            fetched = jax.device_get(dict(self.metrics or {}))
            self._host = {
                k: (float(v) if np.ndim(v) == 0 and np.asarray(v).dtype.kind in "biuf" else v)
                for k, v in fetched.items()
            }
            self._host_step, self._host_src = self.step, self.metrics
            self.stats.host_conversions += 1
        return self._host

    def should_stop(self) -> bool:
        """True once a stop was requested (max_steps, a signal, an error, ...)."""
        return self._coord.stopped

    def request_stop(self, ex: BaseException | None = None) -> None:
        """Stop after the current step; `ex` (first one wins) is re-raised at the end."""
        self._coord.request_stop(ex)

    def every(self, action: Callable[[Session], Any], secs: float | None = None,
              steps: int | None = None, name: str | None = None) -> Timer:
        """Run `action(session)` every `secs` seconds and/or every `steps` steps.

        Actions run at a step boundary in the main thread, in registration order,
        and are re-armed when they return. They do not fire at the stop: do final
        work in `on_stop`. Returns a handle with `cancel()`.
        """
        owner = getattr(action, "__self__", None)
        owner_name = self.plugin_manager.get_name(owner) if owner is not None else None
        name = name or owner_name or getattr(action, "__name__", "action")

        def run(session: Session, _action=action, _name=name, _owner=owner_name) -> None:
            try:
                _action(session)
            except BaseException as ex:
                where = f"timer {_name!r}" + (f" of plugin {_owner!r}" if _owner else "")
                add_note(ex, f"raised in loopkit {where} at step {session.step}")
                raise

        return self._sched.add(run, secs, steps, name, self.step, owner_name)

    def loop(self, interval_secs: float | None, target: Callable[..., Any],
             args: tuple | None = None, kwargs: dict | None = None) -> LooperThread:
        """Start a thread calling `target(*args, **kwargs)` every `interval_secs`.

        The Supervisor's LooperThread: it stops with the session, is joined within
        `stop_grace_secs`, and an exception in it stops the run and is re-raised.
        """
        thread = LooperThread(self._coord, interval_secs, target, args or (), kwargs)
        self._coord.register_thread(thread)
        thread.start()
        return thread

    def register_thread(self, thread: threading.Thread) -> None:
        """Join `thread` within `stop_grace_secs` when the session stops (a straggler is named)."""
        self._coord.register_thread(thread)

    def summary_computed(self, values: Mapping[str, Any], step: int | None = None) -> None:
        """Write `values` (tag -> scalar or array) to the event file at `step`.

        `step=None` means the current global step. Scalars become scalar
        summaries, arrays histograms. Does nothing on a non-chief; a chief
        without a summary writer (no logdir) raises `RuntimeError`.
        """
        if not self.is_chief:
            return
        writer = self.summary_writer
        if writer is None:
            raise RuntimeError(
                "summary_computed needs a summary writer: a chief with Config.logdir set and "
                "the 'summaries' plugin enabled, called while the session runs"
            )
        step = self.step if step is None else int(step)
        for tag, value in values.items():
            arr = np.asarray(value)
            if arr.ndim == 0 and arr.dtype.kind in "biuf":
                writer.add_scalar(tag, float(arr), step)
            elif arr.dtype.kind in "biuf":
                writer.add_histogram(tag, arr, step)
            else:
                writer.add_text(tag, str(value), step)

    # -- internals -------------------------------------------------------------------

    def _compile(self, protect_first_step: bool) -> None:
        fn, cfg = self._step_fn, self.config
        if _is_jitted(fn):
            # Already jitted, maybe with donate_argnums=0 that we cannot undo: the
            # "plain" variant feeds it a copy, so the buffers a saver (or the
            # caller's init) still holds are never donated.
            def plain(state: Any, *batch: Any) -> Any:
                return fn(jax.tree.map(_copy, state), *batch)

            donating = fn
        elif not cfg.jit:
            donating = plain = fn
        else:
            plain = jax.jit(fn)
            donating = jax.jit(fn, donate_argnums=0) if cfg.donate else plain
        self._donating, self._plain, self._call = donating, plain, donating
        if protect_first_step:
            # The caller's own init arrays must stay valid after `train` returns.
            self.skip_donation_once()
        hook = self.hook
        self._before = hook.before_step if hook.before_step.get_hookimpls() else None
        self._after = hook.after_step if hook.after_step.get_hookimpls() else None

    def _end(self) -> None:
        """The session is over: `run` now raises instead of stepping a closed session."""

        def ended(*args: Any) -> Any:
            err = RuntimeError("this session has ended: Session.run() works only inside "
                               "its managed_session block")
            add_note(err, "raised in loopkit's Session.run after the session ended")
            raise err

        self._call = self._donating = self._plain = ended
        self._before = self._after = None

    def _annotate(self, ex: BaseException, fallback: bool = True) -> None:
        """Add a note saying which hook and plugin (or the step function) raised."""
        if has_origin(ex):
            return
        origin = find_hook_origin(ex, self.plugin_manager)
        if origin is not None:
            hook_name, plugin_name = origin
            add_note(ex, f"raised in loopkit hook {hook_name!r} of plugin {plugin_name!r} "
                         f"at step {self.step}")
        elif fallback and not isinstance(ex, (KeyboardInterrupt, SystemExit)):
            add_note(ex, f"raised in loopkit's step function at step {self.step + 1}")


def find_hook_origin(ex: BaseException, pm: PluginManager) -> tuple[str, str] | None:
    """(hook name, plugin name) of the hook implementation in `ex`'s traceback."""
    codes: dict[Any, tuple[str, str]] = {}
    for name, caller in vars(pm.hook).items():
        if not hasattr(caller, "get_hookimpls"):
            continue
        for impl in caller.get_hookimpls():
            code = getattr(getattr(impl.function, "__func__", impl.function), "__code__", None)
            if code is not None:
                codes[code] = (name, impl.plugin_name)
    tb = ex.__traceback__
    found = None
    while tb is not None:
        hit = codes.get(tb.tb_frame.f_code)
        if hit is not None:
            found = hit  # keep the innermost implementation
        tb = tb.tb_next
    return found
