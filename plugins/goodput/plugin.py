"""The built-in `goodput`: the chief's ledger records, and the `goodput/` summaries.

Records (`records`): `Start` at the boundary after the session's first step
(host, pid, the process's start time, the restored step and tier, the restore
and first-step times), a `Window` on the summary timer (registered with
`session.every`: nothing runs per step), and `Stop` at the end, after the final
save. Other plugins add lines through the stash's `LEDGER`. The report of the
ledger so far goes to TensorBoard under ``goodput/`` with each window.

Its timer is registered before every other built-in's, and each window starts
by waiting for the steps dispatched so far: a timer that waits for the device
(the summaries' metrics) would otherwise absorb the queued steps' time, and a
save's hold would include it.
"""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Any

import jax

from loopkit import storage
from loopkit.config import Config
from loopkit.plugin.hookspec import hookimpl
from loopkit.plugins.goodput.cadence import AutoInterval
from loopkit.plugins.goodput.ledger import LEDGER, Ledger
from loopkit.plugins.shared import (
    AUTO_INTERVAL, MACHINE, RESTORED_TIER, SAVE_TIMES, SaveTimes,
)
from loopkit.plugins.goodput.records import Rollback, Start, Stop, Window
from loopkit.plugins.goodput.report import CAUSES, GoodputReport

if TYPE_CHECKING:
    from loopkit.loop.session import Session

__all__ = ["GoodputPlugin", "process_start_time", "write_report"]

_IMPORTED = time.time()  # the process start time's fallback


def process_start_time() -> float:
    """When this process started (wall clock), from ``/proc``; else when loopkit's
    goodput plugin was imported (psutil's figure when it is installed)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22, starttime, in clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        # the process's age, from the clock since boot, taken from the wall clock now:
        # not /proc/stat's btime, a whole second that goes stale when the wall clock
        # is stepped (seen here: 0.7 s off on a VM resumed from a snapshot)
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - no psutil, or no permission
        return _IMPORTED


def write_report(writer: Any, report: GoodputReport, step: int) -> None:
    """The report's figures as TensorBoard scalars under ``goodput/``."""
    scalars = {"goodput/fraction": report.fraction, "goodput/wall_secs": report.wall_secs,
               "goodput/productive_secs": report.productive_secs,
               "goodput/sessions": report.sessions,
               "goodput/interruptions": report.interruptions,
               "goodput/rollbacks": report.rollbacks,
               "goodput/suggested_save_secs": report.suggested_save_secs,
               "goodput/process_deaths": report.process_deaths,
               "goodput/lost_machines": report.lost_machines}
    if report.suggested_local_secs is not None:
        scalars["goodput/suggested_local_secs"] = report.suggested_local_secs
    if report.mtbi_secs is not None:
        scalars["goodput/mtbi_secs"] = report.mtbi_secs
    if report.save_cost_secs is not None:
        scalars["goodput/save_cost_secs"] = report.save_cost_secs
    for cause in CAUSES:
        value = report.badput[cause]
        if isinstance(value, dict):
            for name, secs in value.items():
                scalars[f"goodput/badput/timers/{name}"] = secs
        else:
            scalars[f"goodput/badput/{cause}"] = value
    for tag, value in scalars.items():
        writer.add_scalar(tag, float(value), step)


class GoodputPlugin:
    """Appends the chief's records to ``logdir/goodput.jsonl``."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.ledger: Ledger | None = None
        self.restore_secs = 0.0
        self._opened = 0.0  # session_create's wall time
        self._start: Start | None = None
        self._last = 0.0  # the previous record's wall time
        self._input = self._held = 0.0
        self._timers: dict[str, float] = {}
        self._saves = SaveTimes()

    @hookimpl(wrapper=True)
    def restore_state(self, session: Session) -> Any:
        t0 = time.time()
        try:
            return (yield)
        finally:
            self.restore_secs = time.time() - t0

    @hookimpl(tryfirst=True)  # first of the built-ins: its timer runs first at a boundary
    def session_create(self, session: Session) -> None:
        self._saves = session.stash.setdefault(SAVE_TIMES, SaveTimes())
        # save_model_secs="auto", every process (the chief counts its saves before a
        # window records them)
        session.stash[AUTO_INTERVAL] = lambda s: AutoInterval(s, self.live, self._window)
        if not session.is_chief:
            return
        self._opened = time.time()
        self.ledger = Ledger(session.logdir)
        session.stash[LEDGER] = self.ledger
        # this session, for reports made before its start record is written ("auto")
        self.ledger.pending = self._start_record(session, self._opened, first_step=False)
        session.at_step(session.step + 1, self._started, name="goodput_start")
        secs, steps = self.config.save_summaries_secs, self.config.save_summaries_steps
        if secs or steps:
            session.every(self._window, secs=secs, steps=steps, name="goodput")

    def _started(self, session: Session, first_step: bool = True) -> None:
        now = time.time()
        start = self._start_record(session, now, first_step)
        self._start = start
        assert self.ledger is not None
        self.ledger.write(start)
        self.ledger.pending = None
        self._mark(session, now)

    def _start_record(self, session: Session, now: float, first_step: bool) -> Start:

        restored = session.restored
        stats = session.stats
        waited = stats.first_batch_secs or 0.0  # inside the first step's time: input
        return Start(
            time=now, step=session.step - 1 if first_step else session.step,
            host=socket.gethostname(), pid=os.getpid(), process_start=process_start_time(),
            tier=None if restored is None else session.stash.get(RESTORED_TIER, "durable"),
            restore_secs=self.restore_secs,
            first_step_secs=max(0.0, now - self._opened - waited) if first_step else None,
            input_secs=stats.input_open_secs + waited,
            summary_secs=self.config.save_summaries_secs or None,
            local_dir=None if self.config.local_checkpoint_dir is None
            else str(storage.normalise(self.config.local_checkpoint_dir, "local_checkpoint_dir")),
            machine=session.stash.get(MACHINE))

    def _mark(self, session: Session, now: float) -> None:
        stats = session.stats
        self._last, self._input, self._held = now, stats.input_wait_secs, self._saves.held_secs
        self._timers = dict(stats.timer_secs)

    def _measure(self, session: Session, now: float, peek: bool = False) -> dict[str, Any]:
        """The window since the last record: what `Window` and `Stop` hold. `peek`: leave
        the saves to the next record ("auto" counts them before a window does)."""
        stats = session.stats
        timers = {name: secs - self._timers.get(name, 0.0)
                  for name, secs in stats.timer_secs.items()
                  # saves are `save_secs`; this plugin's own (the wait for the device
                  # ends the previous window, its write is a few ms) counts as steps
                  if name not in ("checkpoint", "goodput", "goodput_start")}
        saves = list(self._saves.committed.copy()) if peek else self._saves.take()
        saved = list(self._saves.saved.copy()) if peek else self._saves.take_saved()
        fields = dict(
            time=now, step=session.step, secs=now - self._last,
            input_secs=stats.input_wait_secs - self._input,
            save_secs=self._saves.held_secs - self._held,
            timers={k: v for k, v in timers.items() if v > 0},
            saves=len(saves), hold_secs=sum(s.hold_secs for s in saves),
            commit_secs=sum(s.commit_secs for s in saves),
            overlap_secs=sum(s.overlap_secs for s in saves),
            overlap_steps=sum(s.overlap_steps for s in saves),
            saved=[list(x) for x in saved])
        if not peek:
            self._mark(session, now)
        return fields

    def live(self, session: Session) -> Window | None:
        """This session's window so far, not recorded (None before its start record)."""
        if self._start is None:
            return None
        return Window(**self._measure(session, time.time(), peek=True))

    def _window(self, session: Session) -> None:
        if self._start is None or self.ledger is None:
            return
        jax.block_until_ready(session.metrics)  # the steps dispatched so far are steps
        self.ledger.write(Window(**self._measure(session, time.time())))
        self._summarise(session)

    def _summarise(self, session: Session) -> None:
        writer = session.summary_writer
        if writer is not None and self.ledger is not None:
            write_report(writer, self.ledger.report(), session.step)

    @hookimpl
    def on_rollback(self, session: Session, record: Any) -> None:
        """A rollback line: the bad step, the step trained on from, what was skipped."""
        if self.ledger is not None:
            first, end = record.skipped
            self.ledger.write(Rollback(
                time=time.time(), step=record.step, to_step=record.restored_step,
                reason=f"{record.metric}={record.value!r}; batches [{first}, {end}) skipped"))

    @hookimpl
    def on_stop(self, session: Session, error: BaseException | None) -> None:
        # after the checkpoint plugin's: the final save is in the last window (and
        # after the summaries plugin's, which closed the writer: TensorBoard has the
        # report of each window)
        ledger = self.ledger
        if ledger is None:
            return
        try:
            if self._start is None:
                self._started(session, first_step=False)
            reason = "error" if error is not None else session.stop_reason
            ledger.write(Stop(**self._measure(session, time.time()), reason=reason,
                              error=None if error is None else _one_line(error)))
        finally:
            ledger.close()


def _one_line(error: BaseException) -> str:
    """The error as the ledger keeps it: its type and its message's first line."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__


INACTIVE = "needs Config.logdir"


def plugin(config: Config) -> GoodputPlugin | None:
    return GoodputPlugin(config) if config.logdir is not None else None
