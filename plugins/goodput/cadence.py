"""``save_model_secs="auto"`` and ``save_local_secs="auto"``: the checkpoint intervals
from the run's measurements.

Young and Daly's first-order optimum ``sqrt(2 * save_cost * MTBI)``
(`report.young_daly`) for each tier, from the ledger (this session's saves
included before a window records them). Each tier is picked from the
interruptions it restores from: with a local tier, a process death (the machine
lived, its local checkpoints with it) is the local tier's job, and so is a lost
machine whose part a peer held (`Config.local_replicas`); the durable tier's
interval follows only the others, the lost machines. Without a local tier every
interruption is the durable tier's. Until a tier has had an interruption, the
run's wall time so far (at least an hour) stands for its MTBI. Until the durable
save's cost is measured, its first save comes within a minute, or at the local
tier's interval when that is sooner. Each interval stays within the time a
commit takes and an hour; the ones in force are logged, and written to
TensorBoard (``loopkit/save_model_secs``, ``loopkit/save_local_secs``), whenever
they change.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from loopkit.plugins.goodput.ledger import LEDGER
from loopkit.plugins.goodput.records import Record
from loopkit.plugins.goodput.report import GoodputReport, goodput, summarise

__all__ = ["AutoInterval", "LOCAL_TAG", "TAG"]

log = logging.getLogger("loopkit")

TAG = "loopkit/save_model_secs"
LOCAL_TAG = "loopkit/save_local_secs"
#: a new interval is taken (and logged) only when it differs by more than this share
CHANGE = 0.05


class AutoInterval:
    """The checkpoint plugin's intervals under ``"auto"`` (`shared.IntervalPolicy`).

    `live`: this session's window not yet recorded (the goodput plugin's), so that a
    save measured since the last window counts at once. `record`: write that window
    now (the goodput plugin's window), done once, when the ledger has no measured save
    yet: a session killed before its next window would take the measurement with it,
    and every restart would start from the unmeasured guess again.
    """

    def __init__(self, session: Any, live: Callable[[Any], Record | None] | None = None,
                 record: Callable[[Any], None] | None = None) -> None:
        config = session.config
        self._live, self._record = live, record
        self._local = config.local_checkpoint_dir is not None
        self._local_auto = self._local and config.save_local_secs == "auto"
        #: the user's local interval: the durable tier saves no more often
        self._local_fixed = None if self._local_auto or not self._local \
            else config.save_local_secs or None
        self.interval = 0.0
        self.local_interval: float | None = None
        self.update(session)

    def report(self, session: Any) -> GoodputReport:
        ledger = session.stash.get(LEDGER)
        if ledger is None:  # not the chief: the ledger as written
            return goodput(session.logdir) if session.logdir is not None else summarise([])
        live = self._live(session) if self._live is not None else None
        if live is not None and getattr(live, "saves", 0) and self._record is not None:
            record, self._record = self._record, None  # asked once a session
            if ledger.report().save_cost_secs is None:
                record(session)  # the first measured save, into the ledger now
                live = self._live(session)
        return ledger.report(extra=[] if live is None else [live])

    def update(self, session: Any) -> float:
        """Recompute both intervals (each changed only by more than `CHANGE`); the
        durable one to use from the next re-arm on."""
        report = self.report(session)
        local = report.suggested_local_secs if self._local_auto else self._local_fixed
        if self._local_auto and local is not None and _changed(self.local_interval, local):
            self.local_interval = local
            log.info('loopkit: save_local_secs="auto": saving the local tier every %.0f s '
                     "(save cost %s, mean time between the interruptions it restores "
                     "(process deaths %d) %s)", local, _secs(report.local_save_cost_secs),
                     report.process_deaths, _mtbi(report.local_mtbi_secs))
            _scalar(session, LOCAL_TAG, local)
        durable = report.suggested_save_secs
        if self._local and local and report.save_cost_secs is None:
            # the first durable save measures the cost: as soon as a local save when
            # that is sooner than a minute in
            durable = min(durable, local)
        if _changed(self.interval, durable):
            self.interval = durable
            log.info('loopkit: save_model_secs="auto": saving every %.0f s (save cost %s, '
                     "mean time between interruptions %s%s)", durable,
                     _secs(report.save_cost_secs), _mtbi(report.durable_mtbi_secs),
                     "" if not self._local else
                     f"; counting lost machines only ({report.lost_machines}), "
                     f"not process deaths ({report.process_deaths}): the local tier's")
            _scalar(session, TAG, durable)
        return self.interval


def _changed(old: float | None, new: float) -> bool:
    return not old or abs(new - old) > CHANGE * old


def _secs(value: float | None) -> str:
    return "not measured yet" if value is None else f"{value:.3g} s"


def _mtbi(value: float | None) -> str:
    return "none yet: the run's time so far, at least 1 h, assumed" if value is None \
        else f"{value:.0f} s"


def _scalar(session: Any, tag: str, value: float) -> None:
    if session.summary_writer is not None:
        session.summary_writer.add_scalar(tag, value, session.step)
