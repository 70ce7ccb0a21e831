"""What a training process tells `loopkit run` about itself (``LOOPKIT_RUN_STATUS``).

Under the runner, the environment names a file; `train` and `managed_session`
keep a JSON object there, so that the runner judges its own child, never a
checkpoint another run wrote:

- when the session opens (once the chief holds the logdir): ``logdir``,
  ``process_index`` and ``is_chief`` (the runner writes restart records only for
  the chief's child, to the ledger of the logdir that child holds), then
  ``start_step`` and ``step`` once the state is restored;
- at each committed checkpoint (either tier): ``committed`` and ``step``;
- when it closes: ``stop_reason`` and ``step``, and after a failure ``error_type``
  and ``error`` (a `LogdirInUseError` there tells the runner not to restart).

The runner empties the file before each child, so what it reads is that child's.
``LOOPKIT_RUN_ID`` (set by the runner, kept across its restarts) names the job.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

from loopkit.storage.local import atomic_write_bytes, read_json_object

__all__ = ["RUN_ID_ENV", "STATUS_ENV", "checkpoint_committed", "error_fields", "read_status",
           "update_status", "write_status"]

STATUS_ENV = "LOOPKIT_RUN_STATUS"
RUN_ID_ENV = "LOOPKIT_RUN_ID"

log = logging.getLogger("loopkit")

# One process has one status file (named by its environment), written by the main
# thread and the commit threads: read-modify-write under one process-wide lock.
_write_lock = threading.Lock()


def write_status(**fields: Any) -> None:
    """Replace the runner's status file with `fields`, when there is a runner."""
    _write(fields, merge=False)


def update_status(**fields: Any) -> None:
    """Merge `fields` into the runner's status file, when there is a runner."""
    _write(fields, merge=True)


def checkpoint_committed(step: int) -> None:
    """A checkpoint of `step` is committed (call it from the commit's thread).

    What a checkpoint plugin calls, built-in or not: the runner counts a child's
    progress from these (a child that committed past the step it started at).
    """
    path = os.environ.get(STATUS_ENV)
    if not path:
        return
    with _write_lock:
        old = read_status(path) or {}
        reached = max(step, _int(old.get("step")) or 0)
        committed = max(step, _int(old.get("committed")) or 0)
        _put(path, {**old, "step": reached, "committed": committed})


def error_fields(error: BaseException | None) -> dict[str, str]:
    """The status fields that name what failed a session (none after a clean stop)."""
    return {} if error is None else {"error_type": type(error).__name__, "error": str(error)}


def read_status(path: str) -> dict[str, Any] | None:
    """The status a process wrote, or None (it never opened a session, or died first)."""

    def read() -> bytes:
        with open(path, "rb") as f:
            return f.read()

    return read_json_object(read)


def _write(fields: dict[str, Any], merge: bool) -> None:
    path = os.environ.get(STATUS_ENV)
    if not path:
        return
    with _write_lock:
        _put(path, {**(read_status(path) or {}), **fields} if merge else fields)


def _put(path: str, fields: dict[str, Any]) -> None:
    # the runner's bookkeeping never stops training: a failed write costs only
    # the runner's judgement of this child (it counts no progress)
    try:
        atomic_write_bytes(path, json.dumps(fields, default=str).encode())
    except OSError as e:
        log.warning("loopkit: could not write the runner's status file %s (%s): %s",
                    STATUS_ENV, path, e)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
