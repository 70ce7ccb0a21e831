"""`loopkit run -- CMD ...`: run a training command until it finishes, restarting it.

A crash (a non-zero exit, death by a signal, `HANG_EXIT_CODE`) is a *failure*,
budgeted by ``--max-restarts``; a clean stop on a signal that the child received
but the runner did not (a preemption aimed at the trainer) is a *preemption*,
budgeted apart by ``--max-preemptions``, as Levanter counts them. A child that
trained past the step it started at before failing made progress: the failure
count starts again. Between tries the runner waits ``--backoff-secs``, doubled
after each consecutive failure, at most 10 minutes.

The child learns it runs under the runner from ``LOOPKIT_RUN_STATUS``, a file
that `train` and `managed_session` write (`loopkit.process.run_status`). SIGTERM or
SIGINT to the runner goes to the child, which stops cleanly (a final
checkpoint); the runner then exits with the child's exit code, without a restart.
Each restart is logged with the child's exit code or signal and the last lines of
its stderr, and appended to ``logdir/goodput.jsonl`` (the `record` callback).
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from loopkit.errors import HANG_EXIT_CODE
from loopkit.process.run_status import STATUS_ENV, read_status

__all__ = ["FINISHED", "run"]

log = logging.getLogger("loopkit")

#: stop reasons of a child that finished its work
FINISHED = ("max_steps", "data_exhausted", "requested")
MAX_BACKOFF_SECS = 600.0
_TAIL = 20  # lines of the child's stderr kept for the log


class _Child:
    """One try: the child process, its stderr passed through (last lines kept)."""

    def __init__(self, command: Sequence[str], status_path: str) -> None:
        env = {**os.environ, STATUS_ENV: status_path}
        self.proc = subprocess.Popen(list(command), env=env, stderr=subprocess.PIPE)
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL)
        self._tee = threading.Thread(target=self._pass_stderr, daemon=True,
                                     name="loopkit-run-stderr")
        self._tee.start()

    def _pass_stderr(self) -> None:
        assert self.proc.stderr is not None
        for raw in iter(self.proc.stderr.readline, b""):
            sys.stderr.buffer.write(raw)
            sys.stderr.buffer.flush()
            self.tail.append(raw.decode(errors="replace").rstrip("\n"))

    def wait(self) -> int:
        rc = self.proc.wait()
        self._tee.join(timeout=5)
        return rc


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    if rc == HANG_EXIT_CODE:
        return f"exit code {rc} (hang watchdog)"
    return f"exit code {rc}"


def _exit_code(rc: int) -> int:
    """A child's return code as a shell reports it (128 + N for a signal N)."""
    return 128 - rc if rc < 0 else rc


#: what records a restart in the run's ledger: (logdir, kind, exit code, signal, step)
RestartRecorder = Callable[[Any, str, "int | None", "int | None", "int | None"], None]


def _progressed(status: dict[str, Any] | None) -> bool:
    """Whether the child committed a checkpoint past the step it started at."""
    if not status or not status.get("logdir"):
        return False
    import loopkit  # its public helper, as a user's script would call it

    try:
        found = loopkit.latest_checkpoint(status["logdir"])
    except Exception:  # noqa: BLE001 - unreadable: count it as no progress
        return False
    return found is not None and found[0] > int(status.get("start_step") or 0)


def run(command: Sequence[str], max_restarts: int = 3, max_preemptions: int = 100,
        backoff_secs: float = 10.0, record: RestartRecorder | None = None) -> int:
    """Run `command` until it finishes or a budget runs out; return the exit code.

    `record` (the goodput plugin's, from ``loopkit run``) writes each restart to
    the ledger of the logdir the child named.
    """
    if not command:
        raise ValueError("loopkit run needs a command after --, e.g. "
                         "loopkit run -- python train.py")
    failures = preemptions = 0
    received: list[int] = []
    child: _Child | None = None

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        if child is not None and child.proc.poll() is None:
            child.proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    fd, status_path = tempfile.mkstemp(prefix="loopkit-run-", suffix=".json")
    os.close(fd)
    try:
        while True:
            Path(status_path).write_bytes(b"")
            child = _Child(command, status_path)
            rc = child.wait()
            status = read_status(status_path)
            reason = (status or {}).get("stop_reason")
            if received:  # the runner was told to stop: no restart
                log.warning("loopkit run: stopped by %s; the child ended with %s",
                            signal.Signals(received[0]).name, _describe(rc))
                return _exit_code(rc)
            if rc == 0 and (status is None or reason in FINISHED):
                return 0
            preempted = rc == 0 and reason == "signal"
            if preempted:
                preemptions += 1
                kind, wait = "preemption", backoff_secs
            else:
                failures = 1 if _progressed(status) else failures + 1
                kind = "failure"
                wait = min(backoff_secs * 2 ** (failures - 1), MAX_BACKOFF_SECS)
            if record is not None and (status or {}).get("logdir"):
                try:
                    record((status or {})["logdir"], kind, rc if rc >= 0 else None,
                           -rc if rc < 0 else None, (status or {}).get("step"))
                except Exception:  # noqa: BLE001 - the restart matters more than its record
                    log.exception("loopkit run: could not record the restart in the ledger")
            last = "\n".join(f"    {line}" for line in list(child.tail)[-10:])
            if preempted and preemptions > max_preemptions:
                log.error("loopkit run: out of budget: %d preemptions, more than "
                          "--max-preemptions=%d", preemptions, max_preemptions)
                return _exit_code(rc)
            if not preempted and failures > max_restarts:
                log.error("loopkit run: out of budget: %d consecutive failures, more than "
                          "--max-restarts=%d; the last one: %s\n%s", failures, max_restarts,
                          _describe(rc), last)
                return _exit_code(rc)
            log.warning("loopkit run: the child %s (%s, step %s); restarting in %.0f s "
                        "(failures %d/%d, preemptions %d/%d)%s",
                        "was preempted" if preempted else "failed", _describe(rc),
                        (status or {}).get("step"), wait, failures, max_restarts,
                        preemptions, max_preemptions,
                        f"; its last lines:\n{last}" if last and not preempted else "")
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and not received:
                time.sleep(min(0.1, wait))
            if received:
                return _exit_code(rc)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        os.unlink(status_path)
