"""``save_model_secs="auto"``: the checkpoint interval from the run's measurements.

Young and Daly's first-order optimum ``sqrt(2 * save_cost * MTBI)``
(`report.young_daly`): the save cost is what the ledger measured (the loop held
by a save, plus its commit's slowdown of the steps beside it), the mean time
between interruptions the ledger's (until there is one, the run's wall time so far,
at least an hour); never below the
time a commit takes, never above an hour. The interval in force is logged, and
written to TensorBoard (``loopkit/save_model_secs``), whenever it changes.
"""

from __future__ import annotations

import logging
from typing import Any

from loopkit.plugins.goodput.ledger import LEDGER
from loopkit.plugins.goodput.report import GoodputReport, goodput, summarise

__all__ = ["AutoInterval", "TAG"]

log = logging.getLogger("loopkit")

TAG = "loopkit/save_model_secs"
#: a new interval is taken (and logged) only when it differs by more than this share
CHANGE = 0.05


class AutoInterval:
    """The checkpoint plugin's interval under ``save_model_secs="auto"``."""

    def __init__(self, session: Any) -> None:
        self.interval = 0.0
        self.update(session)

    def report(self, session: Any) -> GoodputReport:
        ledger = session.stash.get(LEDGER)
        if ledger is not None:  # the chief's, with this session's records so far
            return ledger.report()
        return goodput(session.logdir) if session.logdir is not None else summarise([])

    def update(self, session: Any) -> float:
        """The interval to use from now on (changed only by more than `CHANGE`)."""
        report = self.report(session)
        new = report.suggested_save_secs
        if self.interval and abs(new - self.interval) <= CHANGE * self.interval:
            return self.interval
        self.interval = new
        log.info('loopkit: save_model_secs="auto": saving every %.0f s (save cost %s, '
                 "mean time between interruptions %s)", new,
                 "not measured yet" if report.save_cost_secs is None
                 else f"{report.save_cost_secs:.3g} s",
                 "none yet: the run's time so far, at least 1 h, assumed"
                 if report.mtbi_secs is None
                 else f"{report.mtbi_secs:.0f} s")
        if session.summary_writer is not None:
            session.summary_writer.add_scalar(TAG, new, session.step)
        return new
