"""What a training process tells `loopkit run` about itself (``LOOPKIT_RUN_STATUS``).

Under the runner, the environment names a file; `train` and `managed_session`
write a JSON object there when a session opens (``stop_reason`` None) and when it
closes: ``{"stop_reason", "step", "start_step", "logdir"}``. The runner reads it
after the process exits to tell a finished run from a preempted or failed one.
"""

from __future__ import annotations

import json
import os
from typing import Any

from loopkit.storage.local import atomic_write_bytes, read_json_object

__all__ = ["STATUS_ENV", "read_status", "write_status"]

STATUS_ENV = "LOOPKIT_RUN_STATUS"


def write_status(**fields: Any) -> None:
    """Write `fields` to the runner's status file, when there is a runner."""
    path = os.environ.get(STATUS_ENV)
    if path:
        atomic_write_bytes(path, json.dumps(fields, default=str).encode())


def read_status(path: str) -> dict[str, Any] | None:
    """The status a process wrote, or None (it never opened a session, or died first)."""

    def read() -> bytes:
        with open(path, "rb") as f:
            return f.read()

    return read_json_object(read)
