"""The checkpoint-backend protocol. The core knows no file format."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple, Protocol, Sequence, runtime_checkable

__all__ = ["CheckpointBackend", "Restored", "RollbackRecord"]

PyTree = Any


@runtime_checkable
class CheckpointBackend(Protocol):
    """Stores states by step in one directory. Built-ins: ``"orbax"``, ``"npz"``.

    A plugin adds one through the `checkpoint_backend` hook. The logdir records
    the name a run's backend was built by, so the checkpoint helpers build it
    again through that hook and find what it wrote (naming it in the optional
    `checkpoint_backend_names` also finds it where nothing is recorded); they
    reach checkpoints only through these methods. ``save`` may return before the
    data is durable (asynchronous); it must be atomic: a save that did not
    complete is never listed by ``steps``. The first six methods are the
    protocol; ``path``, ``structure`` and ``restore_leaves`` are optional (the
    helpers fall back on the six without them).
    """

    def save(self, step: int, state: PyTree, metadata: dict) -> None:
        """Start saving ``state`` (and JSON-able ``metadata``) as ``step``."""

    def restore(self, step: int, like: PyTree) -> tuple[PyTree, dict]:
        """Read ``step`` back: the state as stored, placed like ``like``, and its metadata.

        ``like`` may be abstract (`jax.ShapeDtypeStruct` leaves), concrete, or None
        (then the state comes back as nested dicts). Never casts. Raises only for
        data it cannot read (that alone marks a checkpoint corrupt). A leaf whose
        placement `init` left to XLA is a `loopkit.state.init_trace.Guessed`; on a mesh its
        ``sharding`` may be None: `xla_sharding()` gives XLA's choice (compiling
        `init` once), or place it on `mesh` as the run that saved it had it.
        """

    def steps(self) -> list[int]:
        """The committed steps, ascending."""

    def delete(self, step: int) -> None:
        """Remove the checkpoint of ``step``."""

    def wait(self) -> None:
        """Block until every pending save is committed (durable)."""

    def close(self) -> None:
        """Wait, then release resources."""

    def path(self, step: int) -> str | os.PathLike[str]:
        """Where ``step`` is stored (listed by ``loopkit checkpoints``: its size and age)."""

    def structure(self, step: int) -> dict[str, Any]:
        """Leaf path (keys joined by ``/``) -> `jax.ShapeDtypeStruct`, without reading array data.

        `from_pretrained` chooses leaves with it.
        """

    def restore_leaves(self, step: int, paths: Sequence[str]) -> dict[str, Any]:
        """The leaves at ``paths`` (as `structure` names them), on the host; only they are read."""


@dataclasses.dataclass
class Restored:
    """What `restore_state` recovered: the state, its global step, the input position."""

    state: PyTree
    step: int
    data_position: Any = None
    path: str | None = None
    #: batches the input had consumed at `step` (None: `step` itself, nothing skipped)
    consumed: int | None = None
    #: the batch ranges ``(first, end)`` rollbacks skipped before `step`, oldest first
    skipped: tuple[tuple[int, int], ...] = ()


class RollbackRecord(NamedTuple):
    """One rollback (`Config.on_guard="rollback"`), as the `on_rollback` hook receives it."""

    step: int  #: the first bad step
    restored_step: int  #: the checkpoint's step (or the initial state's) trained on from
    skipped: tuple[int, int]  #: the batches ``[first, end)`` skipped, by input position
    metric: str
    value: float
