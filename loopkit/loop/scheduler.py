"""One scheduler for every periodic action of a session (`session.every`).

Per step the session compares the new step with `next_step` and one clock read
with `next_time`; only when one of them is due does the scheduler look at its
timers. The cost per step is the same for one timer or fifty.
"""

from __future__ import annotations

import dataclasses
import math
import time
import zlib
from typing import Any, Callable, NamedTuple

from loopkit.loop.coordinator import add_note

__all__ = ["Agreement", "RunningAction", "Scheduler", "Timer", "agree_across_processes"]

NEVER = math.inf


class RunningAction(NamedTuple):
    """The timer action running now: its name and its start (`time.monotonic`)."""

    name: str
    since: float


class Timer:
    """A registered periodic action: every `secs` seconds and/or every `steps` steps.

    A step trigger fires when ``step % steps == 0``; a time trigger `secs` after
    the action last returned. When either fires, both are re-armed.
    """

    __slots__ = ("action", "secs", "steps", "name", "next_step", "next_time", "cancelled", "once")

    def __init__(
        self, action: Callable[[Any], Any], secs: float | None, steps: int | None, name: str
    ) -> None:
        self.action = action
        self.secs = secs or None
        self.steps = steps or None
        self.name = name
        self.next_step: float = NEVER
        self.next_time: float = NEVER
        self.cancelled = False
        #: a one-shot timer (`Scheduler.once`) fires at `next_step` and is then cancelled
        self.once = False

    def arm(self, step: int, now: float) -> None:
        self.next_step = (step // self.steps + 1) * self.steps if self.steps else NEVER
        self.next_time = now + self.secs if self.secs else NEVER

    def due(self, step: int, now: float) -> bool:
        return step >= self.next_step or now >= self.next_time

    def cancel(self) -> None:
        """Stop this timer; it will not fire again."""
        self.cancelled = True
        self.next_step = self.next_time = NEVER

    def __repr__(self) -> str:
        return f"Timer({self.name!r}, secs={self.secs}, steps={self.steps})"


def noted(action: Callable[[Any], Any], name: str | None,
          plugin_name: Callable[[Any], str | None]) -> tuple[Callable[[Any], Any], str, str | None]:
    """`action`, with a note naming the timer (and its plugin) on any exception it
    raises; the timer's name (`name`, else its plugin's, else the function's), and
    its plugin's name (`plugin_name(owner)` of a bound method's object)."""
    owner = getattr(action, "__self__", None)
    owner_name = plugin_name(owner) if owner is not None else None
    name = name or owner_name or getattr(action, "__name__", "action")
    where = f"timer {name!r}" + (f" of plugin {owner_name!r}" if owner_name else "")

    def run(session: Any) -> None:
        try:
            action(session)
        except BaseException as ex:
            add_note(ex, f"raised in loopkit {where} at step {session.step}")
            raise

    return run, name, owner_name


class Scheduler:
    """Keeps every `Timer` of a session and the earliest step and time one is due.

    `clock` is injectable (`loopkit.testing.FakeClock`) so tests need no real time.
    `stop_step` (max_steps) is folded into `next_step`: reaching it calls
    `on_stop_step` instead of running timers, since timers do not fire at the stop.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.timers: list[Timer] = []
        self.next_step: float = NEVER
        self.next_time: float = NEVER
        self.stop_step: float = NEVER
        self.on_stop_step: Callable[[], "bool | None"] | None = None
        self._stop_at_data_end = False  # stop_step is where some process's data ends
        #: the multi-process `Agreement`, or None in a single process
        self.agreement: Agreement | None = None
        #: seconds spent in each timer's action, by timer name
        self.spent: dict[str, float] = {}
        #: the timer action running now (its name, and when it started by
        #: `time.monotonic`), else None; and when the last one returned
        self.running: RunningAction | None = None
        self.last_returned: float = 0.0

    def add(self, action: Callable[[Any], Any], secs: float | None = None,
            steps: int | None = None, name: str = "action", step: int = 0,
            owner: str | None = None) -> Timer:
        where = f"session.every(name={name!r}" + (f", plugin {owner!r}" if owner else "") + ")"
        if not secs and not steps:
            raise ValueError(f"{where} needs secs= or steps= > 0; "
                             f"got secs={secs!r}, steps={steps!r}")
        if secs is not None and (isinstance(secs, bool) or not isinstance(secs, (int, float)) or secs < 0):
            raise ValueError(f"{where}: secs={secs!r} must be a number >= 0")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise ValueError(f"{where}: steps={steps!r} must be an int >= 0")
        timer = Timer(action, secs, steps, name)
        timer.arm(step, self.clock())
        self.timers.append(timer)
        self._recompute()
        return timer

    def once(self, action: Callable[[Any], Any], step: int, name: str = "action",
             owner: str | None = None) -> Timer:
        """A timer that fires once, at the boundary after global step `step`."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            where = f"session.at_step(name={name!r}" + (f", plugin {owner!r}" if owner else "")
            raise ValueError(f"{where}): step={step!r} must be an int >= 1")
        timer = Timer(action, None, None, name)
        timer.once = True
        timer.next_step = step
        self.timers.append(timer)
        self._recompute()
        return timer

    def set_stop_step(self, step: float, callback: Callable[[], "bool | None"]) -> None:
        self.stop_step = step
        self.on_stop_step = callback
        self._stop_at_data_end = False
        self._recompute()

    def stop_by(self, step: int, callback: Callable[[], "bool | None"]) -> None:
        """Stop at `step` if that comes before the stop already set (data that runs out)."""
        if step < self.stop_step:
            self.set_stop_step(step, callback)
            self._stop_at_data_end = True

    def read_ahead(self, supply: Callable[[int], int], session: Any, step: int) -> None:
        """Give the agreement the input's `supply` and hold a first round at `step`."""
        assert self.agreement is not None
        self.agreement.supply = supply
        self.agreement.next_step = step
        self._recompute()
        self.run_due(session, step)

    def agree_with(self, agreement: Agreement, step: int) -> None:
        """Decide time triggers collectively (many processes), every few steps.

        Time is never compared locally on the per-step path any more: at each
        agreement step every process contributes its local view (which time
        triggers are due, whether it got a stop signal) to one small all-reduce,
        and every process then runs the same actions at the same step.
        """
        self.agreement = agreement
        agreement.next_step = step + agreement.interval
        self._recompute()

    def rewind(self, step: int, back: int) -> None:
        """The session went `back` steps, to `step` (a rollback; many processes do it at
        the same step): step triggers fire at their multiples from there again; the
        next agreement comes an interval from there (the read-ahead covers no more),
        and a stop where the data ends comes `back` steps sooner (0 when the undone
        steps' batches are trained again)."""
        for t in self.timers:
            if t.steps and not t.once and not t.cancelled:
                t.next_step = (step // t.steps + 1) * t.steps
        if self.agreement is not None:
            self.agreement.next_step = step + self.agreement.interval
        if self._stop_at_data_end and self.stop_step < NEVER:
            self.stop_step = max(step, self.stop_step - back)
        self._recompute()

    def _recompute(self) -> None:
        self.timers = [t for t in self.timers if not t.cancelled]
        bounds = [t.next_step for t in self.timers] + [self.stop_step]
        if self.agreement is not None:
            self.next_step = min(bounds + [self.agreement.next_step])
            self.next_time = NEVER
        else:
            self.next_step = min(bounds)
            self.next_time = min([t.next_time for t in self.timers], default=NEVER)

    def run_due(self, session: Any, step: int) -> None:
        """Run the actions due at `step`, in registration order, then re-arm them."""
        if step >= self.stop_step:
            if self.on_stop_step is not None and self.on_stop_step():
                return  # the session went back (`end_of_data`) and trains on
            self.next_step = self.next_time = NEVER
            return
        now = self.clock()
        timers = list(self.timers)
        if self.agreement is None:
            time_due = [now >= t.next_time for t in timers]
        elif step >= self.agreement.next_step:
            time_due = self.agreement.decide(step, now, timers)
            if step >= self.stop_step:  # the agreement stops the run at this very step
                self.run_due(session, step)
                return
        else:
            time_due = [False] * len(timers)
        for timer, due in zip(timers, time_due):
            if timer.cancelled:
                continue
            if step >= timer.next_step or due:
                t0 = self.clock()
                self.running = RunningAction(timer.name, time.monotonic())
                try:
                    timer.action(session)
                finally:
                    self.running = None
                    self.last_returned = time.monotonic()
                    now = self.clock()
                    self.spent[timer.name] = self.spent.get(timer.name, 0.0) + now - t0
                at = getattr(session, "step", step)  # below `step` after a rollback
                if timer.once:
                    timer.cancel()
                elif not timer.cancelled:
                    timer.arm(min(step, at), now)
                if at < step:  # the action rolled the session back (`Session.rewind`):
                    break      # the timers after it were armed from there
        self._recompute()


@dataclasses.dataclass(eq=False)
class Agreement:
    """Collective decisions for a multi-process session, taken every `interval` steps.

    `allreduce_max(vector) -> vector` is a collective over all processes (the
    session passes one built on `jax.experimental.multihost_utils`). The vector
    holds one flag per timer (time trigger due), the stop-signal flag, which
    process (plus one) has an error waiting to stop the run, how many of the
    next steps some process has no batch for, and the milliseconds since the
    last agreement, so every process computes the same next interval from the
    same numbers: about `target_secs` apart.

    Input (`supply`, set by `train`'s loop): before each round a process reads
    ahead the batches of the longest next interval (`supply(n)` returns how many
    it holds, at least `n` unless its data ends). A shortfall anywhere makes
    every process stop after the last step all of them have a batch for
    (`on_exhausted(step)`), so no process waits alone in a collective.
    """

    allreduce_max: Callable[[list[int]], list[int]]
    signal_pending: Callable[[], bool]
    on_signal: Callable[[], None]
    clock: Callable[[], float]
    interval: int = 10
    target_secs: float = 0.5
    max_interval: int = 1000
    _: dataclasses.KW_ONLY
    error_pending: Callable[[], int | None] = lambda: None
    on_error: Callable[[int], None] = lambda process: None
    on_exhausted: Callable[[int], None] = lambda step: None  # (`end_of_data`)
    supply: Callable[[int], int] | None = dataclasses.field(default=None, init=False)
    next_step: float = dataclasses.field(default=NEVER, init=False)

    SLOTS = 64

    def __post_init__(self) -> None:
        self._last = self.clock()

    def _slot(self, timers: list[Timer], timer: Timer) -> int:
        """The vote slot of `timer`: a stable hash of its name, the same on every process.

        Two names that share a slot would fire together unnoticed: refused, naming both.
        """
        slot = zlib.crc32(timer.name.encode()) % self.SLOTS
        for other in timers:
            if (other.secs and other.name != timer.name
                    and zlib.crc32(other.name.encode()) % self.SLOTS == slot):
                raise ValueError(
                    f"timers {timer.name!r} and {other.name!r} share agreement slot {slot} "
                    "in a multi-process run: rename one (session.every(..., name=...))"
                )
        return slot

    def decide(self, step: int, now: float, timers: list[Timer]) -> list[bool]:
        # Processes may register different timers (a chief-only service): a timer's
        # vote goes to a slot named by a stable hash of its name, not its position.
        slots = [0] * self.SLOTS
        timed = [t for t in timers if t.secs]
        where = {id(t): self._slot(timed, t) for t in timed}
        for t in timed:
            if now >= t.next_time:
                slots[where[id(t)]] = 1
        longest = min(self.max_interval, self.interval * 2)  # the next interval's bound
        have = longest if self.supply is None else min(longest, self.supply(longest))
        erred = self.error_pending()
        elapsed_ms = int(max(0.0, now - self._last) * 1000)
        agreed = self.allreduce_max(slots + [int(self.signal_pending()),
                                             0 if erred is None else erred + 1,
                                             longest - have, elapsed_ms])
        self._last = now
        signal, erred_process, short, slowest_ms = agreed[self.SLOTS:self.SLOTS + 4]
        due = [id(t) in where and bool(agreed[where[id(t)]]) for t in timers]
        # same inputs on every process -> same next interval everywhere
        per_step = max(slowest_ms / 1000.0, 1e-6) / self.interval
        self.interval = int(min(self.max_interval, max(1, min(self.interval * 2,
                                                              self.target_secs / per_step))))
        if short > 0:
            left = longest - short  # steps every process has a batch for
            self.interval = max(1, min(self.interval, left))
            self.on_exhausted(step + left)
        self.next_step = step + self.interval
        if erred_process:
            self.on_error(erred_process - 1)
        if signal:
            self.on_signal()
        return due


def _allreduce_max(vector: list[int]) -> list[int]:
    """Element-wise max of `vector` over all processes (one small collective)."""
    import numpy as np
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray(vector, np.int32))
    return [int(x) for x in np.asarray(gathered).reshape(-1, len(vector)).max(axis=0)]


def agree_across_processes(session: Any, coord: Any, sched: Scheduler,
                           clock: Callable[[], float]) -> None:
    """Many processes: time triggers, signals, background errors and the end of the
    data are decided together (`Agreement`), so every process stops at one step."""
    import jax

    coord.agreed = True

    def on_error(process: int) -> None:
        ex = coord.error_pending
        if ex is None:
            ex = RuntimeError(f"process {process} failed in a background thread (its own "
                              f"output has the error); every process stops at step "
                              f"{session.step}")
        coord.request_stop(ex)
        sched.stop_by(session.step, lambda: None)

    sched.agree_with(Agreement(
        _allreduce_max, lambda: coord.signal_pending,
        lambda: coord.request_stop(reason="signal"), clock,
        error_pending=lambda: jax.process_index() if coord.error_pending is not None else None,
        on_error=on_error,
        on_exhausted=lambda at: sched.stop_by(at, lambda: end_of_data(
            session, lambda: sched.stop_step <= session.step)),
    ), session.step)


def end_of_data(session: Any, at_end: Callable[[], bool] = lambda: False) -> bool:
    """The data ran out after `session.step` (with several processes: every process,
    at this step). The `on_data_end` hook may go back (a rollback of the last step's
    bad value): True when one did and batches remain (`at_end()` is False: a replay,
    or one process, whose reader tells), and the loop trains on; else the stop."""
    step = session.step
    session.hook.on_data_end(session=session)
    if session.step < step and not at_end():
        return True
    session.coord.request_stop(reason="data_exhausted")
    return False
