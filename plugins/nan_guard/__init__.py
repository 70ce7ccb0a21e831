"""Built-in `nan_guard`: a bad value of the metric `Config.nan_guard` names fails the run,
or rolls it back (`Config.on_guard="rollback"` or ``"replay"``, `plugins/rollback.py`).

- `guard`: `NanGuardPlugin`, which checks each step's value one step late, and
  `RunningMedian` (spikes);
- `plugin(config)`: the guard this Config asks for: none without a metric, the
  rollback guard (a `NanGuardPlugin` that rolls back) with ``on_guard`` other than
  ``"raise"``.
"""

from __future__ import annotations

from loopkit.config import Config
from loopkit.plugins.nan_guard.guard import NanGuardPlugin, RunningMedian

__all__ = ["NanGuardPlugin", "RunningMedian", "plugin"]


def plugin(config: Config) -> NanGuardPlugin | None:
    if not config.nan_guard:
        return None
    if config.on_guard in ("rollback", "replay"):
        from loopkit.plugins.rollback import RollbackGuard

        return RollbackGuard(config)
    return NanGuardPlugin(config)
