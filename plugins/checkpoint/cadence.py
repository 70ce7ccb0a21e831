"""The tiers' intervals under ``"auto"``, and what a restart says of its machine.

The goodput plugin offers the policy (`shared.AUTO_INTERVAL`); this module asks it
for the intervals at the start and after saves, and sets the timers the user left
to it. `machine_fate` is what a restore says of the machine the previous session
ran on, which the ledger records (`shared.MACHINE`; `agreed_fate`: over every
process): a process death is the local tier's job, a lost machine the durable
tier's (or its peers').
"""

from __future__ import annotations

from typing import Any, Collection

import jax

from loopkit.config import Config
from loopkit.plugins.shared import AUTO_INTERVAL, IntervalPolicy

__all__ = ["Cadence", "agreed_fate", "machine_fate"]


def machine_fate(restored_from: str | None, step: int | None,
                 local_steps: Collection[int]) -> str | None:
    """"lived", "lost" or None (cannot tell): the machine of the previous session, from
    the tier restored (`restored_from`, at `step`) and the steps this process's local
    tier held at the start (its own).

    A part from a peer: some process's machine was lost. From the local tier: it
    lived. From the durable tier: the machine lived if the local tier held only older
    steps (the durable one was newer); it was lost if the local tier held none (wiped),
    or held the step or a newer one (another process lacked it, or the process count
    changed). Nothing restored: a crash before any save, nothing to tell it by.
    """
    if restored_from == "peer":
        return "lost"
    if restored_from == "local":
        return "lived"
    if restored_from is None or step is None:
        return None
    if not local_steps or max(local_steps) >= step:
        return "lost"
    return "lived"


def agreed_fate(restored_from: str | None, step: int | None,
                local_steps: Collection[int]) -> str | None:
    """`machine_fate` over every process: "lost" when some process's machine was lost
    (the chief's may have lived beside it). Every process calls it at the restore;
    None (nothing restored) is the same on all, and then no collective is entered."""
    fate = machine_fate(restored_from, step, local_steps)
    if fate is None or jax.process_count() == 1:
        return fate
    from loopkit.plugins.checkpoint.collectives import any_process

    return "lost" if any_process(fate == "lost") else fate


class Cadence:
    """The durable and local timers' intervals: the user's, or the ``"auto"`` policy's."""

    def __init__(self, session: Any, config: Config, has_local: bool) -> None:
        self.durable_auto = config.save_model_secs == "auto"
        self.local_auto = has_local and config.save_local_secs == "auto"
        self.policy: IntervalPolicy | None = None
        if self.durable_auto or self.local_auto:
            factory = session.stash.get(AUTO_INTERVAL)
            if factory is None:
                field = "save_model_secs" if self.durable_auto else "save_local_secs"
                raise ValueError(f'Config.{field}="auto" needs the goodput plugin, which '
                                 "measures the run: do not disable it")
            self.policy = factory(session)
        #: the intervals to register the timers with (None: no time trigger)
        self.durable_secs = self._pick(config.save_model_secs, "interval")
        self.local_secs = self._pick(config.save_local_secs, "local_interval")

    def _pick(self, secs: Any, name: str) -> float | None:
        if secs == "auto":
            return getattr(self.policy, name) if self.policy is not None else None
        return secs or None

    def retime(self, session: Any, durable: Any, local: Any) -> None:
        """After a save: the policy's new intervals, in force from the timers' re-arm."""
        if self.policy is None or session.should_stop():
            return
        self.policy.update(session)
        if self.durable_auto and durable is not None:
            durable.secs = self.policy.interval
        if self.local_auto and local is not None and self.policy.local_interval:
            local.secs = self.policy.local_interval
