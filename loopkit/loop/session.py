"""`Session`: one training session. It opens, runs the per-step path, and closes.

Opening follows the Supervisor's `prepare_or_wait_for_session`: recover from a
checkpoint, else `init` then `init_fn`; then `local_init_fn`; then the ready
check; then the services start (`session_create`). Closing stops every thread,
runs every `on_stop`, and re-raises the error that stopped the session.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import jax
import numpy as np

from loopkit.process.background_compile import when_idle
from loopkit.process.compile_cache import use_compilation_cache
from loopkit.loop.coordinator import (
    Coordinator, LooperThread, SignalHandlers, add_note, raise_stop_errors,
)
from loopkit.loop.data import Lookahead, make_input
from loopkit.process.logdir_claim import claim_logdir, stop_asked
from loopkit.process.logdir_lock import LogdirLock
from loopkit.process.import_ahead import import_ahead, modules_ahead
from loopkit.state.opening import recover_or_init
from loopkit.process.run_status import error_fields, update_status, write_status
from loopkit.loop.scheduler import RunningAction, Scheduler, Timer, agree_across_processes, noted
from loopkit.loop.stash import Stash, StashKey
from loopkit.state.staging import Staged
from loopkit.loop.step import CompiledStep
from loopkit.loop.writer import write_values
from loopkit.plugin.view import SessionStats

if TYPE_CHECKING:
    import threading

    from loopkit.plugin.backend import Restored
    from loopkit.config import Config
    from loopkit.loop.data import Input
    from loopkit.plugin.manager import PluginManager

__all__ = ["Session", "SessionStats", "Stash", "StashKey"]

log = logging.getLogger("loopkit")

PyTree = Any
_STALE = object()  # Session._state: assemble it from the compiled step when read


class Session:
    """One training session: the state, the global step, and the services around it.

    Hooks receive it; `Supervisor.managed_session` yields it. `run(batch)` is the
    per-step path: ``before_step`` (only if implemented) -> jitted step ->
    ``step += 1`` -> ``after_step`` (only if implemented) -> one timer check.
    """

    def __init__(self, config: Config, pm: PluginManager, step_fn: Callable[..., Any],
                 coord: Coordinator | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.config = config
        self.logdir = config.logdir_path
        self.is_chief: bool = (
            config.is_chief if config.is_chief is not None else jax.process_index() == 0
        )
        self._state: PyTree = None
        self.step: int = 0
        # what each public attribute means: `loopkit.plugin.view.SessionView`
        self.metrics: Mapping[str, Any] = {}
        self.summary_writer: Any = None
        self.restored: Restored | None = None
        self.input: Input | None = None
        self.stash = Stash()
        self.phase: str = "opening the session"
        self.plugin_manager = pm
        self.hook = pm.hook
        self.coord = coord if coord is not None else Coordinator()
        self._clock = clock or time.monotonic
        self._sched = Scheduler(self._clock)
        self.stats = SessionStats(timer_secs=self._sched.spent)  # the scheduler times actions
        self._step_fn = step_fn
        self._compiled: Any = None
        self._before: Any = None
        self._after: Any = None
        self._signals = SignalHandlers(self.coord)
        self._host: dict[str, Any] = {}
        self._host_step = -1
        self._host_of: Any = None
        self._lock: LogdirLock | None = None  # the chief's claim on the logdir
        self._uncache: Callable[[], None] | None = None  # gives JAX's cache settings back

    # -- the per-step path -----------------------------------------------------------

    def run(self, *batch: Any) -> Mapping[str, Any]:
        """Run one step on `batch` (or on no batch); return its metrics.

        The metrics stay where the step left them (device arrays, possibly not
        yet computed): nothing here waits for the device.
        """
        try:
            if self._before is not None:
                self._before(session=self, step=self.step)
            c = self._compiled
            c.live, metrics = c.call(c.live, *batch)
            self._state = _STALE
            self.step = step = self.step + 1
            # a carry may hold the metrics instead (`StepCarry.metrics_of`)
            self.metrics = metrics = metrics or c.no_metrics
            if self._after is not None:
                self._after(session=self, step=step, metrics=metrics)
                step = self.step  # the guard may have rolled the session back
            sched = self._sched
            if step >= sched.next_step or self._clock() >= sched.next_time:
                sched.run_due(self, step)
            return metrics
        except BaseException as ex:
            self.plugin_manager.note_origin(ex, self.step)
            raise

    # -- what hooks and users call ---------------------------------------------------

    @property
    def state(self) -> PyTree:
        """The training state (the user's pytree) after the latest step."""
        if self._state is _STALE:
            self._state = self._compiled.state()
        return self._state

    @state.setter
    def state(self, new: PyTree) -> None:
        self._state = new
        if self._compiled is not None:
            self._compiled.set_state(new)

    def rewind(self, step: int, state: PyTree, again: bool = False) -> None:
        """Go back to `state` at `step` (a rollback; `again`: the undone steps' batches are
        trained again, else skipped); step timers re-armed from there."""
        back, self.state, self.step = self.step - step, state, step
        self._sched.rewind(step, 0 if again else back)

    @property
    def clock(self) -> Callable[[], float]:
        """The session's clock (`time.monotonic` unless a test injected one).

        Timers and `stats` use it, so rates and shares computed with it agree.
        """
        return self._clock

    def stage_state(self) -> Staged:
        """The current state, safe to read from another thread while the loop goes on.

        The next steps donate (reuse) the buffers of the leaves they rewrite. A
        saver that reads the state in the background calls this at the step
        boundary, keeps the result referenced until it is done, then calls its
        `release()`. Off CPU the leaves the next step rewrites are copied to host
        memory here and donation goes on; on CPU the saver reads the buffers
        themselves and the step after the save writes into those a finished save
        released. Leaves the step returns unchanged are neither copied nor donated.
        """
        return self._compiled.stage(self.state, ahead=not self.should_stop())

    def skip_donation_once(self) -> None:
        """Run the next step without donating any buffer the current state holds."""
        self._compiled.skip_donation_once()

    def host_metrics(self) -> dict[str, Any]:
        """The latest metrics as host values: floats for scalars, numpy arrays otherwise.

        Waits for the step that made them. Converted once per step and cached,
        so the summaries, progress display and NaN guard share one transfer.
        Call it from a timer (`every`), never on every step.
        """
        if self._host_step != self.step or self._host_of is not self.metrics:
            fetched = jax.device_get(dict(self.metrics or {}))
            self._host = {
                k: (float(v) if np.ndim(v) == 0 and np.asarray(v).dtype.kind in "biuf" else v)
                for k, v in fetched.items()
            }
            self._host_step, self._host_of = self.step, self.metrics
            self.stats.host_conversions += 1
        return self._host

    @property
    def stop_reason(self) -> str | None:
        """None while running; then "max_steps", "data_exhausted", "requested" or "signal"."""
        return self.coord.reason if self.coord.stopped else None

    def should_stop(self) -> bool:
        """True once a stop was requested (max_steps, a signal, an error, ...)."""
        return self.coord.stopped

    def request_stop(self, ex: BaseException | None = None, *, agreed: bool = False) -> None:
        """Stop after the current step; `ex` (first one wins) is re-raised at the end.

        `agreed=True`, from a background thread: in a multi-process run every
        process stops with `ex` at the step of the next agreement instead.
        """
        self.coord.request_stop(ex, agreed=agreed)

    def batches(self) -> Iterator[Any]:
        """The iterator `train`'s loop reads: `input.iterator`, read ahead with several
        processes so that all stop after the last step each has a batch for (the
        first agreement round runs now)."""
        inp = self.input
        assert inp is not None
        if self._sched.agreement is not None and not self.coord.stopped:
            ahead = Lookahead(inp)
            inp.read_with(ahead.reader(inp))
            self._sched.read_ahead(ahead.supply, self, self.step)
        if inp.replay is not None:  # a plugin asked to train batches again in front
            inp.replay.main = inp.iterator
            return inp.replay
        return inp.iterator

    def every(self, action: Callable[[Session], Any], secs: float | None = None,
              steps: int | None = None, name: str | None = None) -> Timer:
        """Run `action(session)` every `secs` seconds and/or every `steps` steps.

        Actions run at a step boundary in the main thread, in registration order,
        and are re-armed when they return. They do not fire at the stop: do final
        work in `on_stop`. Returns a handle with `cancel()`.
        """
        run, name, owner = noted(action, name, self.plugin_manager.get_name)
        return self._sched.add(run, secs, steps, name, self.step, owner)

    @property
    def timer_running(self) -> RunningAction | None:
        """The timer action running now (name, start by `time.monotonic`), or None:
        with `timer_returned`, what a watchdog reads from its own thread."""
        return self._sched.running

    @property
    def timer_returned(self) -> float:
        """When the last timer action returned (`time.monotonic`; 0.0 before any)."""
        return self._sched.last_returned

    @property
    def timers(self) -> tuple[Timer, ...]:
        """The live timers of this session (name, secs, steps), in registration order."""
        return tuple(t for t in self._sched.timers if not t.cancelled)

    def at_step(self, step: int, action: Callable[[Session], Any],
                name: str | None = None) -> Timer:
        """Run `action(session)` once, at the boundary after global step `step`."""
        run, name, owner = noted(action, name, self.plugin_manager.get_name)
        return self._sched.once(run, step, name, owner)

    def loop(self, interval_secs: float | None, target: Callable[..., Any],
             args: tuple | None = None, kwargs: dict | None = None) -> LooperThread:
        """Start a thread calling `target(*args, **kwargs)` every `interval_secs`.

        The Supervisor's LooperThread: it stops with the session, is joined within
        `stop_grace_secs`, and an exception in it stops the run and is re-raised.
        """
        thread = LooperThread(self.coord, interval_secs, target, args or (), kwargs)
        self.register_thread(thread)
        thread.start()
        return thread

    def register_thread(self, thread: threading.Thread) -> None:
        """Join `thread` within `stop_grace_secs` when the session stops.

        A service thread should poll `should_stop()` and hand its exception to
        `request_stop(ex)`, which stops the run and re-raises it at the end.
        """
        self.coord.register_thread(thread)

    def summary_computed(self, values: Mapping[str, Any], step: int | None = None) -> None:
        """Write `values` (tag -> scalar, array or text) to the event file at `step`
        (None: the current step): scalars as scalars, arrays as histograms, anything else
        as text. Does nothing on a non-chief; a chief without a summary writer raises."""
        if not self.is_chief:
            return
        if self.summary_writer is None:
            raise RuntimeError(
                "summary_computed needs a summary writer: a chief with Config.logdir set and "
                "the 'summaries' plugin enabled, called while the session runs"
            )
        write_values(self.summary_writer, values, self.step if step is None else int(step))

    # -- opening ---------------------------------------------------------------------

    def open(self, init: Any, data: Any = None) -> None:
        """Recover or initialise the state, check it, then start every service."""
        self._signals.install()
        try:
            self._prepare(init, data)
        except BaseException as ex:
            self.close(ex)  # runs on_stop, re-raises
            raise

    def _prepare(self, init: Any, data: Any) -> None:
        hook = self.hook
        hook.session_open(session=self)  # before anything that can block (the watchdog)
        ahead = modules_ahead(self)  # the plugins' heavy imports, checked now, run later
        if self.logdir is not None:  # one run per logdir; a URL's store reached
            coord = self.coord
            if self.is_chief:
                self.phase = "taking the logdir lock"
            self._lock = claim_logdir(
                self.logdir, chief=self.is_chief,
                together=self.config.is_chief is None and jax.process_count() > 1,
                # a lease lost mid-run stops every process at one agreed step
                on_lost=lambda ex: coord.request_stop(ex, agreed=True),
                interrupted=lambda: stop_asked(coord))
        # `loopkit run` learns whose child this is (only the chief's records restarts)
        write_status(stop_reason=None, logdir=self.logdir, process_index=jax.process_index(),
                     is_chief=self.is_chief)
        self._uncache = use_compilation_cache(self.config.compilation_cache, self.logdir)
        restored = recover_or_init(self, init)  # the state, restored or fresh, checked
        self.phase = "starting the services"
        if data is not None:
            t0 = time.perf_counter()  # the goodput ledger books it as input, not startup
            self.input = make_input(data, self.step, restored, self.config.data_sharding)
            self.stats.input_open_secs = time.perf_counter() - t0
        carries = [c for c in hook.step_carry(session=self) if c is not None]
        self._before = hook.before_step if hook.before_step.get_hookimpls() else None
        self._after = hook.after_step if hook.after_step.get_hookimpls() else None
        # The first call never donates: the caller may still hold init's arrays
        # (passed, or captured by an init callable), or a restore's.
        self._compiled = CompiledStep(self._step_fn, self.config, carries,
                                      metrics_needed=self._after is not None)
        self._compiled.set_state(self._state)
        self._arm_stops()
        # Built-in services' session_create are `tryfirst`: they start before every
        # other plugin's, so the summary writer and the checkpoint backend are ready.
        hook.session_create(session=self)
        if self.input is not None:  # read ahead by a plugin (`prefetch`), or as it is
            reader = hook.input_reader(session=self, input=self.input)
            if reader is not None:
                self.input.read_with(reader)
        # the plugins' imports (orbax, tensorboardX) from the first step's end: not beside
        # `init` and the first compile, whose cores they would share
        self.at_step(self.step + 1, lambda s: import_ahead(s, ahead), name="import ahead")
        update_status(step=self.step, start_step=self.step)
        self.phase = "waiting for the first batch" if data is not None else "before the first step"

    def _arm_stops(self) -> None:
        coord, max_steps = self.coord, self.config.max_steps
        if max_steps is not None:
            if self.step >= max_steps:
                coord.request_stop(reason="max_steps")
            self._sched.set_stop_step(max_steps, lambda: coord.request_stop(reason="max_steps"))
        if jax.process_count() > 1:
            agree_across_processes(self, coord, self._sched, self._clock)

    # -- closing ---------------------------------------------------------------------

    def close(self, error: BaseException | None = None) -> None:
        """Stop: join the threads, run every `on_stop`, re-raise what stopped the session
        (`error`: what ended the session's block, or None). Every `on_stop` runs even if
        one raises; its error is raised after a clean run, a note after a failed one."""
        coord = self.coord
        if error is not None and not isinstance(error, StopIteration):  # run() names the step
            self.plugin_manager.note_origin(error, self.step, step_fn=False)
        coord.request_stop(error)
        try:
            coord.join(self.config.stop_grace_secs)
        except BaseException as ex:  # noqa: BLE001 - a second Ctrl-C: still run on_stop
            coord.request_stop(ex)
        error = coord.exception
        try:
            try:
                stop_errors = self.plugin_manager.call_on_stop(self, error)
            finally:
                self.summary_writer = None  # closed by now
                self._signals.restore()
                if self._lock is not None:
                    self._lock.release()
                    self._lock = None
            failed = error is not None or bool(stop_errors)
            update_status(stop_reason="error" if failed else coord.reason, step=self.step,
                          **error_fields(error or (stop_errors or [None])[0]))
        finally:
            # the step ends (its save variant's compile not waited for), JAX's cache unset
            try:
                self._end()
            finally:
                if self._uncache is not None:  # once a save variant's compile is cached
                    when_idle(self._uncache)
                    self._uncache = None
        raise_stop_errors(  # a thread that failed during shutdown counts too
            error if error is not None else coord.exception, stop_errors)

    def _end(self) -> None:
        """The session is over: `run` now raises instead of stepping a closed session."""

        def ended(*args: Any) -> Any:
            err = RuntimeError("this session has ended: Session.run() works only inside "
                               "its managed_session block")
            add_note(err, "raised in loopkit's Session.run after the session ended")
            raise err

        if self._compiled is None:
            self._compiled = CompiledStep(ended, self.config.replace(jit=False))
            self._compiled.set_state(self._state)
        self._compiled.end(ended)
        self._before = self._after = None
