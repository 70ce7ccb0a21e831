"""The names two built-ins share, so that neither imports the other.

The checkpoint plugin reports its saves (`SAVE_TIMES`) and the tier it restored
from (`RESTORED_TIER`); the goodput plugin reads both, and offers the interval
policy behind ``save_model_secs="auto"`` (`AUTO_INTERVAL`), which the checkpoint
plugin asks for. Each is a typed slot of the session's stash.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Optional, Protocol

from loopkit.loop.stash import StashKey

__all__ = ["AUTO_INTERVAL", "MACHINE", "RESTORED_TIER", "SAVE_TIMES", "IntervalPolicy", "SaveTiming",
           "SaveTimes"]


@dataclasses.dataclass
class SaveTiming:
    """One save: how long it held the loop, and its commit beside the steps.

    `commit_secs` runs from the end of the hold to durable. `overlap_secs` is the
    part of it the loop went on stepping (until the commit ended or the loop
    joined it), during which `overlap_steps` steps ran.
    """

    step: int
    hold_secs: float
    commit_secs: float = 0.0
    overlap_secs: float = 0.0
    overlap_steps: int = 0


@dataclasses.dataclass
class SaveTimes:
    """What the checkpoint plugin reports: the seconds it held the loop, and saves done."""

    #: seconds the loop was held by saves (their start, a wait for a commit, the final save)
    held_secs: float = 0.0
    #: committed saves not yet taken into a ledger record (appended by commit threads)
    committed: collections.deque[SaveTiming] = dataclasses.field(
        default_factory=collections.deque)

    #: every tier's commits not yet recorded: (step, tier, wall time), from commit threads
    saved: collections.deque[tuple[int, str, float]] = dataclasses.field(
        default_factory=collections.deque)

    def take(self) -> list[SaveTiming]:
        """The committed saves not taken yet (thread-safe against the commit threads)."""
        return _drain(self.committed)

    def take_saved(self) -> list[tuple[int, str, float]]:
        """Every tier's commits not taken yet: (step, tier, wall time)."""
        return _drain(self.saved)


def _drain(queue: collections.deque[Any]) -> list[Any]:
    taken = []
    while queue:
        taken.append(queue.popleft())
    return taken


#: the checkpoint plugin's `SaveTimes` for this session
SAVE_TIMES: StashKey[SaveTimes] = StashKey()


#: which tier the session restored from: "durable", "local", "peer" (a part from a
#: peer, `Config.local_replicas`), or None (a fresh start)
RESTORED_TIER = StashKey[Optional[str]]()


#: what the local tier says of the machine the previous session ran on: "lived" (a
#: process death: its local checkpoints were there), "lost" (a replaced machine: a part
#: came from a peer, or the durable tier served although the local tier should have held
#: a newer step or held none), or None (no local tier, or nothing to tell it by)
MACHINE = StashKey[Optional[str]]()


class IntervalPolicy(Protocol):
    """``save_model_secs="auto"`` / ``save_local_secs="auto"``: the intervals in force,
    updated after saves."""

    #: the durable tier's interval (``save_model_secs="auto"``)
    interval: float
    #: the local tier's (``save_local_secs="auto"``), else None
    local_interval: float | None

    def update(self, session: Any) -> float:
        """Recompute both; the durable interval to use from the next re-arm on."""


#: the goodput plugin's `IntervalPolicy` factory (``factory(session)``); absent when the
#: goodput plugin is off
AUTO_INTERVAL = StashKey[Callable[[Any], IntervalPolicy]]()
