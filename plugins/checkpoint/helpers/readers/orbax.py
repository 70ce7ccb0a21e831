"""Reading an orbax PyTree checkpoint that no loopkit logdir holds, through the backend protocol.

What `load_checkpoint` and `from_pretrained` use for a `StandardCheckpointer` or
`PyTreeCheckpointer` save under any name, or one item of an orbax
`CheckpointManager` step; read by the `orbax` backend's own read path.
"""

from __future__ import annotations

from pathlib import Path

from loopkit.plugins.checkpoint.backends.orbax.layout import Head, is_orbax_tree
from loopkit.plugins.checkpoint.backends.orbax.read import ReadsOrbax, read_head
from loopkit.plugins.checkpoint.helpers.readers.read_only import ReadOnly

__all__ = ["OrbaxCheckpoint", "is_orbax_tree"]


class OrbaxCheckpoint(ReadsOrbax, ReadOnly):
    """One orbax PyTree checkpoint at any path, read through the backend protocol.

    Read-only: what `load_checkpoint` and `from_pretrained` use for an orbax
    checkpoint that is not in a loopkit logdir (a `StandardCheckpointer` save under
    any name, or one item of a `CheckpointManager` step).
    """

    def __init__(self, path: str | Path, step: int = 0) -> None:
        import orbax.checkpoint as ocp

        self._path = self.where = Path(path)
        self._step = int(step)
        self._reader = ocp.PyTreeCheckpointer()

    def path(self, step: int) -> Path:
        return self._path

    def steps(self) -> list[int]:
        return [self._step] if is_orbax_tree(self._path) else []

    def _head(self, step: int) -> Head:
        if step != self._step:
            raise FileNotFoundError(f"{self._path} holds one checkpoint, step {self._step}")
        return read_head(self._path)

    def close(self) -> None:
        self._reader.close()
