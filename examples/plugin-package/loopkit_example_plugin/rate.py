"""`StepRate`: the built-in step counter, re-implemented from the public plugin surface.

What a third-party plugin can use is all the built-ins use: `session.every` for
the timer, `session.clock` for time, `session.stash` for per-session figures,
`session.summary_writer` for events, `on_stop` for the last stretch. Pass it in
``plugins=[StepRate()]`` (and ``disable=("step_counter",)`` to replace the built-in).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import loopkit

log = logging.getLogger("loopkit")


class _Mark(NamedTuple):
    step: int
    time: float


#: where this plugin keeps the last count of a session
LAST = loopkit.StashKey[_Mark]()


class StepRate:
    """Writes `tag` (steps per second of the session's clock) every `secs` or `steps`."""

    def __init__(self, tag: str = "global_step/sec", secs: float | None = None,
                 steps: int | None = 100) -> None:
        self.tag, self.secs, self.steps = tag, secs, steps

    @loopkit.hookimpl
    def session_create(self, session: loopkit.Session) -> None:
        session.stash[LAST] = _Mark(session.step, session.clock())
        session.every(self._count, secs=self.secs, steps=self.steps, name="step_rate")

    def _count(self, session: loopkit.Session) -> None:
        last, now = session.stash[LAST], session.clock()
        if session.step <= last.step or now <= last.time:
            return
        rate = (session.step - last.step) / (now - last.time)
        session.stash[LAST] = _Mark(session.step, now)
        if session.summary_writer is not None:
            session.summary_writer.add_scalar(self.tag, rate, session.step)
        log.info("loopkit: %s: %.4g (step %d)", self.tag, rate, session.step)

    @loopkit.hookimpl
    def on_stop(self, session: loopkit.Session, error: BaseException | None) -> None:
        if error is None and session.stop_reason != "signal":  # preempted: no extra work
            self._count(session)
