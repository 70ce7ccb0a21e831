"""Built-in `straggler` (`Config.straggler_threshold`): the slow process, named.

A collective makes every process as slow as the slowest, and nothing says which
one it is. Each process measures its own host time per step: the work of reading
its input (`SessionStats.input_read_secs`: the prefetch threads' time reading,
transforming and placing batches, two clock reads a batch in those threads, made
only while this plugin is on) and its own timer actions (`SessionStats.timer_secs`,
timed already). Nothing runs in the loop per step. Not the loop's wait for input:
with a collective in the step, a process a hair slower than the others waits for
its input while they wait in the step, so waits name whoever is slowest by 1%.
Not the step's dispatch nor a wait for the device, where the fast processes wait
for the slow one; not loopkit's own timers that wait for the device or meet the
other processes (summaries, saves, the ledger, the checks). Input read in the
loop's own thread (`Config.prefetch=0`, small in-memory batches) is not measured.

At each summary window (a timer with the summaries' cadence: every process fires it
at the same step, the time trigger agreed) the processes exchange their own time
per step in one small gather. A process whose time exceeds `straggler_threshold`
times the median of the others', by at least `MIN_SHARE` of the window's time per
step (below that no one waits measurably), for `straggler_windows` windows in a
row is named: a WARNING naming the process, its host, the factor and where its
time goes; ``loopkit/straggler`` (the factor) in TensorBoard; and a ledger `Fault`
(cause ``"straggler"``) per window while it stays named, whose `secs` (the time the
others waited for it: its excess times the window's steps, the streak's windows
included once) the goodput report counts as badput ``straggler``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from loopkit.config import Config
from loopkit.plugin.hookspec import hookimpl
from loopkit.plugins.rewind import hosts

if TYPE_CHECKING:
    from loopkit.loop.session import Session

__all__ = ["INACTIVE", "MIN_SHARE", "STRAGGLER_TAG", "StragglerWatch", "plugin"]

log = logging.getLogger("loopkit")

INACTIVE = "Config.straggler_threshold is None"
#: the TensorBoard scalar: the named process's time per step over the others' median
STRAGGLER_TAG = "loopkit/straggler"
#: an excess below this share of the time per step is noise, whatever the factor
MIN_SHARE = 0.02
#: loopkit's timers that wait for the device or for the other processes: their time
#: is the others' (or the device's), not the process's own
WAITING_TIMERS = frozenset({"goodput", "goodput_start", "straggler", "replica_check",
                            "rollback", "checkpoint", "checkpoint_local", "summaries",
                            "progress", "profiler"})


class StragglerWatch:
    """Compares the processes' own time per step at each summary window."""

    def __init__(self, config: Config) -> None:
        self.threshold: float = config.straggler_threshold  # type: ignore[assignment]
        self.windows = config.straggler_windows
        self.secs = config.save_summaries_secs
        self.steps = config.save_summaries_steps
        self.streak: list[int] = []
        self.owed: list[float] = []  # the streak's excess seconds, booked once named
        self.mark: tuple[int, float, float, int, dict[str, float]] = (0, 0.0, 0.0, 0, {})

    @hookimpl
    def session_create(self, session: Session) -> None:
        n = jax.process_count()
        if n == 1:
            log.info("loopkit: Config.straggler_threshold is ignored: one process")
            return
        hosts(session)  # every process is here: the names, gathered once
        self.streak, self.owed = [0] * n, [0.0] * n
        self._mark(session)
        session.every(self._window, secs=self.secs, steps=self.steps, name="straggler")

    @hookimpl
    def on_rollback(self, session: Session, record: Any) -> None:
        self._mark(session)  # every process goes back at the same step: windows stay aligned

    def _mark(self, session: Session) -> None:
        stats = session.stats
        self.mark = (session.step, session.clock(), stats.input_read_secs,
                     stats.input_read_batches, dict(stats.timer_secs))

    def _own(self, session: Session) -> tuple[int, list[float]]:
        """Steps since the mark, and [own, input, timers, wall] seconds per step."""
        step0, t0, input0, read0, timers0 = self.mark
        stats, steps = session.stats, session.step - step0
        wall = session.clock() - t0
        read = stats.input_read_batches - read0  # read ahead: not the window's steps
        inputs = (stats.input_read_secs - input0) / read if read > 0 else 0.0  # one a step
        timers = sum(secs - timers0.get(name, 0.0) for name, secs in stats.timer_secs.items()
                     if name not in WAITING_TIMERS) / max(steps, 1)
        return steps, [inputs + timers, inputs, timers, wall / max(steps, 1)]

    def _window(self, session: Session) -> None:
        from jax.experimental import multihost_utils

        steps, mine = self._own(session)
        self._mark(session)
        table = np.asarray(multihost_utils.process_allgather(
            np.asarray([*mine, steps], np.float64))).reshape(-1, 5)
        if int(table[:, 4].min()) <= 0:
            return  # no step in this window (on any process)
        own, wall = table[:, 0], float(np.median(table[:, 3]))
        worst: tuple[float, int] | None = None
        for p in range(len(own)):
            others = float(np.median(np.delete(own, p)))
            excess = own[p] - others
            slow = own[p] > self.threshold * others and excess >= MIN_SHARE * wall
            if not slow:
                if self.streak[p] >= self.windows:
                    log.info("loopkit: process %d is no longer a straggler", p)
                self.streak[p], self.owed[p] = 0, 0.0
                continue
            self.streak[p] += 1
            self.owed[p] += float(excess) * steps
            if self.streak[p] < self.windows:
                continue
            factor = float(own[p]) / others if others > 0 else float("inf")
            self._name(session, p, factor, table[p], self.streak[p] == self.windows)
            if worst is None or factor > worst[0]:
                worst = (factor, p)
        if worst is not None and session.summary_writer is not None:
            session.summary_writer.add_scalar(STRAGGLER_TAG, min(worst[0], 1e6), session.step)

    def _name(self, session: Session, p: int, factor: float, row: np.ndarray,
              first: bool) -> None:
        from loopkit.plugins.goodput.ledger import LEDGER
        from loopkit.plugins.goodput.records import Fault

        host = hosts(session)[p]
        where = "in input" if row[1] >= row[2] else "in its timer actions"
        what = f"{factor:.1f}x the others' time per step, {where}"
        if first:
            log.warning("loopkit: process %d on %s spends %s (%.1f ms a step against the "
                        "others' %.1f ms, %d windows in a row): a straggler; the others "
                        "wait for it", p, host, what, 1e3 * row[0], 1e3 * row[0] / factor,
                        self.windows)
        ledger = session.stash.get(LEDGER)
        if ledger is not None:
            ledger.write(Fault(time=time.time(), step=session.step, cause="straggler",
                               process=p, host=host, detail=what, secs=self.owed[p]))
        self.owed[p] = 0.0


def plugin(config: Config) -> StragglerWatch | None:
    return None if config.straggler_threshold is None else StragglerWatch(config)
