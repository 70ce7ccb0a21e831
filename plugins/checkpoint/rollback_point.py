"""A rollback's checkpoint: the newest committed step before the bad one, from either tier.

`nan_guard`'s `on_guard="rollback"` asks the checkpoint plugin (`rollback_state`)
for it. With many processes every decision here is taken together, so that no
process raises, or reads, while the others wait in a collective: a save that
never committed on any process fails the rollback on all; the local tier offers
only steps every process holds; the chief chooses; and a checkpoint that one
process cannot read sends every process to the other tier's candidate.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import jax
import numpy as np

from loopkit.plugin.backend import Restored
from loopkit.errors import CheckpointError
from loopkit.plugins.checkpoint.collectives import (
    any_process, broadcast_from_chief, common_steps,
)
from loopkit.plugins.checkpoint.recovery import read_together
from loopkit.plugins.checkpoint.tier import Tier

__all__ = ["candidates", "drop_after", "read_agreed", "refuse_if_stuck"]

log = logging.getLogger("loopkit")


def refuse_if_stuck(tiers: Sequence[Tier]) -> None:
    """Raise on every process when a save on any process never committed: a rollback
    cannot step past a checkpoint that may still be written."""
    stuck = next((t.path(t.commit.step) for t in tiers if t.commit is not None), None)
    if any_process(stuck is not None):
        where = f"the checkpoint save {stuck}" if stuck else "a checkpoint save on another process"
        raise CheckpointError(f"{where} never committed; cannot roll back past it")


def candidates(local: Tier | None, durable: Tier, before_step: int) -> list[tuple[int, Tier]]:
    """The newest step before `before_step` of each tier, newest first, the local tier
    first on a tie (faster to read). Many processes: the local tier's among the steps
    every process holds, and the chief's choice for both."""
    many = jax.process_count() > 1
    local_steps = set() if local is None else local.ledger.on_disk
    if many and local is not None:
        local_steps = set(common_steps(local_steps))
    best = [max((s for s in local_steps if s < before_step), default=-1),
            max((s for s in durable.ledger.on_disk if s < before_step), default=-1)]
    if many:
        best = [int(x) for x in broadcast_from_chief(np.asarray(best, np.int32))]
    found = [(s, t) for s, t in zip(best, (local, durable)) if s >= 0 and t is not None]
    return sorted(found, key=lambda c: (c[0], c[1] is local), reverse=True)


def drop_after(session: Any, tiers: Sequence[Tier], first: int, why: str) -> None:
    """Delete the committed checkpoints of step `first` and later: they hold abandoned
    steps (`why` says which), and a restart must never resume from them."""
    for t in tiers:
        for doomed in sorted((s for s in t.ledger.on_disk if s >= first), reverse=True):
            log.warning("loopkit: deleting %s: %s", t.path(doomed), why)
            if t.writes(session):
                t.ledger.make_room(doomed)
                t.backend.delete(doomed)
            t.ledger.on_disk.discard(doomed)
        if t.peers is not None:  # and the peer copies this process holds of them
            t.peers.drop_after(first, session.config.stop_grace_secs)
        t.last_save_step = None  # a save at the restored step writes the new position


def read_agreed(options: Sequence[tuple[int, Tier]], like: Any) -> Restored | None:
    """The first of `options` that every process reads; None when there are no options.

    An unreadable candidate is skipped with a warning; when none can be read,
    `CheckpointError` on every process."""
    failures: list[BaseException] = []
    many = jax.process_count() > 1
    for i, (step, tier) in enumerate(options):
        found = read_together(tier.backend, step, like, tier.path(step),
                              lambda f: failures.append(f[1]))
        if found is not None:  # (agreed: read on every process; a store error raised)
            return found
        if i + 1 < len(options):
            nxt, other = options[i + 1]
            log.warning("loopkit: cannot roll back to %s (unreadable%s); trying %s",
                        tier.path(step), " on some process" if many else "",
                        other.path(nxt))
    if options:
        raise CheckpointError(
            "no checkpoint to roll back to could be read on every process (tried "
            + ", ".join(t.path(s) for s, t in options) + ")"
        ) from (failures[0] if failures else None)
    return None
