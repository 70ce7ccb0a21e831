"""Built-in `step_counter`: `global_step/sec` on the summary timer, as the Supervisor's.

The rate is the step delta over the wall-time delta (the session's clock) since
the previous count; the first one includes compilation. It is written through
`session.summary_writer` (the chief's) and logged on the ``"loopkit"`` logger at
INFO (at DEBUG while the progress bar, which shows the rate, is on a terminal);
a process without a writer only logs. A normal stop counts the last
stretch unless the timer just counted it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from loopkit.config import Config
from loopkit.plugin.hookspec import hookimpl
from loopkit.plugins.progress import RATE_SHOWN

if TYPE_CHECKING:
    from loopkit.loop.session import Session

__all__ = ["TAG", "StepCounterPlugin", "plugin"]

INACTIVE = "needs Config.logdir"

TAG = "global_step/sec"

log = logging.getLogger("loopkit")


class StepCounterPlugin:
    """Writes and logs `global_step/sec` every summary interval."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._step = 0
        self._time = 0.0
        self._counted_step: int | None = None

    @hookimpl(tryfirst=True)  # built-in services start before other plugins'
    def session_create(self, session: Session) -> None:
        self._step, self._time = session.step, session.clock()
        self._counted_step = session.step
        secs, steps = self.config.save_summaries_secs, self.config.save_summaries_steps
        if secs or steps:
            session.every(self._count, secs=secs, steps=steps, name="step_counter")

    def _count(self, session: Session) -> None:
        step, now = session.step, session.clock()
        elapsed = now - self._time
        if step <= self._step or elapsed <= 0:
            return
        rate = (step - self._step) / elapsed
        self._step, self._time, self._counted_step = step, now, step
        writer = session.summary_writer
        if writer is not None:
            writer.add_scalar(TAG, rate, step)
        # on a terminal the progress bar shows the rate: no line through it
        log.log(logging.DEBUG if session.stash.get(RATE_SHOWN, False) else logging.INFO,
                "loopkit: %s: %.4g (step %d)", TAG, rate, step)

    @hookimpl
    def on_stop(self, session: Session, error: BaseException | None) -> None:
        if error is None and session.step != self._counted_step:
            self._count(session)


def plugin(config: Config) -> StepCounterPlugin | None:
    if config.logdir is None:
        return None
    return StepCounterPlugin(config)
