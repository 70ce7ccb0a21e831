"""Every collective the checkpoint package enters, in one place.

With several processes every process must enter the same collectives in the same
order, or the job hangs. The functions below are the only ones in the package that
enter one; each says who calls it and when. A process that failed still takes part
and reports its failure through the collective (it never returns early).

The order, by what the run does (every process at the same step):

- **A save** (`plugin.CheckpointPlugin._save`, a timer due on every process at the
  same step, or the final save):
  1. `gather_rows`, once (`replicas.agree_to_save`): each process's error from its
     previous save, whether its local timer is due, a rollback guard's veto, and the
     fingerprints of its host-local leaves;
  2. with stateful iterators, `gather_positions`: two `gather_rows` (the lengths,
     then the JSON bytes of every process's input position);
  3. the backend's own: orbax's save and wait (orbax's collectives), the staged
     backend's barriers (``cleared``, ``written``, ``committed``) and the orbax
     backend's ``published`` barrier (`barrier`).
- **A restore at start-up** (`recovery`):
  1. with a local tier: `broadcast_from_chief` (the durable tier's first candidate,
     the floor); `common_steps` (or, with peer copies, one `gather_rows` of what
     each process holds, `peers.Peers.plan`); then for each step tried, one
     `gather_rows` of each process's outcome;
  2. the durable tier: first `broadcast_from_chief` (whether the chief refuses the
     logdir: another backend's or basename's checkpoints), then for each candidate,
     `broadcast_from_chief` (the chief's
     choice, -1 for none), then `worst_of` after the downloads (staged) and
     `worst_of` after the read;
  3. with a local tier and a checkpoint restored: `any_process` (whether some
     process's machine was lost, `cadence.agreed_fate`).
- **A rollback** (`rollback_point`): `any_process` (a save that never committed),
  `common_steps` of the local tier, `broadcast_from_chief` of the best step of each
  tier; then the chosen checkpoint is read as at a restore (`worst_of`, twice).

With one process each function returns at once, entering nothing.
"""

from __future__ import annotations

import json
from typing import Any, Collection

import jax
import numpy as np

__all__ = ["COMPARED_STEPS", "any_process", "barrier", "broadcast_from_chief", "common_steps",
           "gather_positions", "gather_rows", "worst_of"]

#: how many of its newest local steps each process offers when they look for a common one
COMPARED_STEPS = 64


def gather_rows(row: np.ndarray) -> np.ndarray:
    """Every process's `row` (all of one shape and dtype), stacked by process index."""
    if jax.process_count() == 1:
        return np.asarray(row)[None]
    from jax.experimental import multihost_utils

    row = np.asarray(row)
    return np.asarray(multihost_utils.process_allgather(row)).reshape(-1, *row.shape)


def broadcast_from_chief(value: np.ndarray) -> np.ndarray:
    """Process 0's `value` on every process (the others' are ignored, shape and dtype
    must match)."""
    if jax.process_count() == 1:
        return np.asarray(value)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(value)))


def any_process(flag: bool) -> bool:
    """Whether `flag` is true on some process."""
    return bool(np.any(gather_rows(np.asarray(int(flag), np.int32))))


def worst_of(outcome: int) -> int:
    """The largest (worst) of every process's `outcome`."""
    return int(np.max(gather_rows(np.asarray(outcome, np.int32))))


def common_steps(steps: Collection[int]) -> list[int]:
    """The steps in every process's `steps` (each its own local tier's), newest first;
    each offers its newest `COMPARED_STEPS`."""
    mine = sorted(steps, reverse=True)[:COMPARED_STEPS]
    row = np.full((COMPARED_STEPS,), -1, np.int32)
    row[:len(mine)] = mine
    rows = gather_rows(row)
    common = set.intersection(*(set(r.tolist()) for r in rows))
    return sorted((s for s in common if s >= 0), reverse=True)


def gather_positions(position: Any) -> list[Any]:
    """Every process's encoded input `position` (JSON-able), by process index: two small
    gathers, the lengths, then the JSON bytes padded to the longest."""
    mine = json.dumps(position).encode()
    sizes = gather_rows(np.asarray(len(mine), np.int64)).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:len(mine)] = np.frombuffer(mine, np.uint8)
    table = gather_rows(padded)
    return [json.loads(row[:n].tobytes()) for row, n in zip(table, sizes)]


def barrier(name: str, processes: set[int], timeout: int | None = None) -> None:
    """Wait until every one of ``processes`` reaches ``name`` (none with one process).

    Through the jax.distributed client, not orbax's default device collectives, which
    in a save or commit thread would interleave with the step's own in a different
    order on each process. A process that died never arrives: the others raise after
    ``timeout`` seconds (None: orbax's default), or when jax.distributed's failure
    detection ends them first."""
    if len(processes) < 2:
        return
    import orbax.checkpoint as ocp

    ocp.multihost.sync_global_processes(
        name, timeout=timeout, processes=processes,
        barrier_sync_fn=ocp.multihost.get_barrier_sync_fn(processes=processes))
