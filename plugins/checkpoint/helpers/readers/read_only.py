"""What every reader of others' formats shares: a backend that reads, never writes."""

from __future__ import annotations

from typing import Any

from loopkit.errors import CheckpointError

__all__ = ["ReadOnly"]


class ReadOnly:
    """`save` and `delete` refused, nothing to wait for: loopkit reads these files only.

    A subclass says where it reads in `where`.
    """

    where: Any

    def save(self, step: int, state: Any, metadata: dict) -> None:
        raise CheckpointError(f"{self.where} is read-only here: loopkit reads it, it does not write it")

    def delete(self, step: int) -> None:
        raise CheckpointError(f"{self.where} is read-only here: loopkit reads it, it does not delete it")

    def wait(self) -> None:
        """Nothing to wait for."""

    def close(self) -> None:
        """Nothing to release."""
