"""Built-in `goodput`: where a run's days went, and how often a save pays.

- `plugin`: the plugin registered as ``"goodput"``: the chief's ledger records
  (session start, a window on the summary timer, the stop) and the ``goodput/``
  summaries.
- `records`: the ledger's typed records (``logdir/goodput.jsonl``), shared with
  `loopkit run` (restarts), the watchdog (hangs) and rollbacks.
- `sessions`: the records grouped by session, how each ended, and whether the last
  one still runs.
- `ledger`: `Ledger`, the writer other plugins reach through the stash (`LEDGER`).
  What the checkpoint plugin reports of each save (`SaveTimes`) is in
  `loopkit.plugins.shared`, which neither plugin imports the other for.
- `report`: `goodput(logdir) -> GoodputReport` (``loopkit goodput LOGDIR``) and
  Young and Daly's interval behind ``save_model_secs="auto"``.
"""

from __future__ import annotations

from loopkit.plugins.goodput.ledger import LEDGER, Ledger
from loopkit.plugins.goodput.plugin import INACTIVE, GoodputPlugin, plugin
from loopkit.plugins.goodput.records import Hang, Restart, Rollback
from loopkit.plugins.shared import SAVE_TIMES, SaveTimes, SaveTiming
from loopkit.plugins.goodput.report import GoodputReport, format_report, goodput, young_daly

__all__ = ["INACTIVE", "LEDGER", "SAVE_TIMES", "GoodputPlugin", "GoodputReport", "Hang",
           "Ledger", "Restart", "Rollback", "SaveTimes", "SaveTiming", "format_report",
           "goodput", "plugin", "young_daly"]
