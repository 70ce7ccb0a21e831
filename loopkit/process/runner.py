"""`loopkit run -- CMD ...`: run a training command until it finishes, restarting it.

A crash (a non-zero exit, death by a signal, `HANG_EXIT_CODE`) is a *failure*,
budgeted by ``--max-restarts``; a clean stop on a signal that the child received
but the runner did not (a preemption aimed at the trainer) is a *preemption*,
budgeted apart by ``--max-preemptions``, as Levanter counts them. The runner
judges its own child from its status file (`loopkit.process.run_status`): a child that
committed a checkpoint past the step it started at made progress, the failure
count starts again and the restart comes at once; otherwise the runner waits
``--backoff-secs``, doubled after each consecutive failure without progress, at
most 10 minutes. A child refused by `LogdirInUseError` (another live run holds the
logdir) is not restarted: the runner exits 1.

The child runs in a session of its own (its own process group), as torch elastic
starts its workers: a terminal's Ctrl-C reaches the runner only, and the runner
forwards each SIGINT/SIGTERM it receives once to the child's group, which stops
cleanly (a final checkpoint); the runner then exits with the child's exit code,
without a restart (a SIGHUP, a closed terminal, goes to the child as SIGTERM). A
runner that dies itself (SIGKILL) takes its child along: on Linux the child gets
SIGHUP at that moment (``PR_SET_PDEATHSIG``) and stops cleanly, as on SIGTERM (the
kernel sends it again each time it hands the child to another of the dying runner's
threads, so the session takes repeated SIGHUPs as one, never as the abort a second
SIGTERM is). A
signal while no child runs (the backoff) ends the runner with 128 + the signal's
number. Each restart is logged with the step the child
reached, its exit and the last lines of its stderr, and, for the chief's child
only, appended to the ledger of the logdir that child held (the `record` callback).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

from loopkit.errors import HANG_EXIT_CODE
from loopkit.process.run_status import RUN_ID_ENV, STATUS_ENV, read_status

__all__ = ["FINISHED", "run"]

log = logging.getLogger("loopkit")

#: stop reasons of a child that finished its work
FINISHED = ("max_steps", "data_exhausted", "requested")
MAX_BACKOFF_SECS = 600.0
_TAIL = 20  # lines of the child's stderr kept for the log

#: what records a restart in the run's ledger: (logdir, kind, exit code, signal, step)
RestartRecorder = Callable[[Any, str, "int | None", "int | None", "int | None"], None]


class _Child:
    """One try: the child in a session of its own, its stderr passed through (last
    lines kept)."""

    def __init__(self, command: Sequence[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(list(command), env=env, stderr=subprocess.PIPE,
                                     start_new_session=True, preexec_fn=_on_parent_death())
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

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):  # the group has ended
            pass

    def wait(self) -> int:
        rc = self.proc.wait()
        self._tee.join(timeout=5)
        return rc


class _Forwarder:
    """The runner's SIGINT/SIGTERM handler: each signal goes to the running child's
    group exactly once.

    The handler and the main loop both call `forward`; `list.pop` is one call
    that a handler cannot split, so no signal is sent twice or lost.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self.child: _Child | None = None
        self._pending: list[int] = []

    def handle(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        # a closed terminal hangs up the runner only (the child has no terminal of
        # its own now): the trainer stops cleanly, as on SIGTERM
        self._pending.append(signal.SIGTERM if signum == signal.SIGHUP else signum)
        self.forward()

    def forward(self) -> None:
        child = self.child
        while child is not None:
            try:
                signum = self._pending.pop(0)
            except IndexError:
                return
            child.signal(signum)


def _on_parent_death() -> Callable[[], None] | None:
    """What the child runs between fork and exec so that the runner's death (a SIGKILL,
    the OOM killer) stops it cleanly: Linux's ``PR_SET_PDEATHSIG``, with SIGHUP.

    Not SIGTERM: the kernel sends the signal each time it reparents the child, and a
    dying runner's threads exit one by one, the child handed to each survivor in turn
    (measured: 1-4 signals from a runner of 5 threads). A session counts a second
    SIGTERM as an abort, which then lost the final checkpoint in about 1 run in 3
    under load; it takes every SIGHUP after the first as the same stop (`SignalHandlers`).

    Without it the trainer, in a session of its own, trains on unwatched and keeps the
    logdir's lease, so the next runner is refused. The function is looked up here,
    before the fork: the child only calls it (no import, no allocation between fork
    and exec). A runner that died before the call leaves the child adopted: it ends
    itself. None off Linux, where there is no such call.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    runner = os.getpid()

    def arm() -> None:
        prctl(1, int(signal.SIGHUP))  # PR_SET_PDEATHSIG
        if os.getppid() != runner:  # the runner died before the call
            os.kill(os.getpid(), signal.SIGHUP)

    return arm


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


def _progressed(status: dict[str, Any]) -> bool:
    """Whether the child committed a checkpoint past the step it started at (its own
    status file says so: never a checkpoint another run wrote)."""
    committed, start = status.get("committed"), status.get("start_step")
    return isinstance(committed, int) and isinstance(start, int) and committed > start


def _check(max_restarts: int, max_preemptions: int, backoff_secs: float) -> None:
    for name, value in (("max_restarts", max_restarts), ("max_preemptions", max_preemptions),
                        ("backoff_secs", backoff_secs)):
        if math.isnan(value) or value < 0:
            raise ValueError(f"loopkit run: {name}={value!r}: give 0 or more")


def run(command: Sequence[str], max_restarts: int = 3, max_preemptions: int = 100,
        backoff_secs: float = 1.0, record: RestartRecorder | None = None) -> int:
    """Run `command` until it finishes or a budget runs out; return the exit code.

    `record` (the goodput plugin's, from ``loopkit run``) writes each restart to
    the ledger of the logdir the chief's child held. A command that cannot be
    started returns 127 (not found) or 126, as a shell does, with one line.
    """
    if not command:
        raise ValueError("loopkit run needs a command after --, e.g. "
                         "loopkit run -- python train.py")
    _check(max_restarts, max_preemptions, backoff_secs)
    forwarder = _Forwarder()
    previous = {s: signal.signal(s, forwarder.handle)
                for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    fd, status_path = tempfile.mkstemp(prefix="loopkit-run-", suffix=".json")
    os.close(fd)
    # one id for this runner's children, kept across restarts (a lease holder with
    # the same id is this job's own earlier child)
    env = {**os.environ, STATUS_ENV: status_path,
           RUN_ID_ENV: os.environ.get(RUN_ID_ENV) or uuid.uuid4().hex}
    try:
        return _Tries(command, env, forwarder, max_restarts, max_preemptions,
                      backoff_secs, record).loop(status_path)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        os.unlink(status_path)


class _Tries:
    """The runner's loop: start a child, judge how it ended, restart or stop."""

    def __init__(self, command: Sequence[str], env: dict[str, str], forwarder: _Forwarder,
                 max_restarts: int, max_preemptions: int, backoff_secs: float,
                 record: RestartRecorder | None) -> None:
        self.command, self.env, self.forwarder = command, env, forwarder
        self.max_restarts, self.max_preemptions = max_restarts, max_preemptions
        self.backoff_secs, self.record = backoff_secs, record
        self.failures = self.preemptions = 0
        self.streak = 0  # consecutive failures without progress: the backoff doubles

    def loop(self, status_path: str) -> int:
        while True:
            Path(status_path).write_bytes(b"")
            if self.forwarder.received:  # a signal while no child ran: no further child
                return self._stopped_between(self.forwarder.received[0])
            try:
                child = _Child(self.command, self.env)
            except OSError as e:
                return _cannot_start(self.command[0], e)
            self.forwarder.child = child
            self.forwarder.forward()  # a signal that came while it was starting
            rc = child.wait()
            self.forwarder.child = None
            status = read_status(status_path) or {}
            if self.forwarder.received:  # the runner was told to stop: no restart
                log.warning("loopkit run: stopped by %s; the child ended (%s)",
                            signal.Signals(self.forwarder.received[0]).name, _describe(rc))
                return _exit_code(rc)
            code, wait = self._judge(rc, status, child)
            if code is not None:
                return code
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and not self.forwarder.received:
                time.sleep(min(0.1, wait))  # a signal ends the sleep early

    def _stopped_between(self, signum: int) -> int:
        log.warning("loopkit run: stopped by %s between two tries; no further child starts",
                    signal.Signals(signum).name)
        return 128 + signum

    def _judge(self, rc: int, status: dict[str, Any], child: _Child) -> tuple[int | None, float]:
        """How the try ended: the runner's exit code, or None and the seconds to wait
        before the restart."""
        reason = status.get("stop_reason")
        if status.get("error_type") == "LogdirInUseError":
            log.error("loopkit run: not restarting: the child was refused the logdir "
                      "(another live run uses it): %s", status.get("error"))
            return 1, 0.0
        if rc == 0 and (not status or reason in FINISHED):
            return 0, 0.0
        progressed, preempted = _progressed(status), rc == 0 and reason == "signal"
        if preempted:
            self.preemptions += 1
            wait = 0.0 if progressed else self.backoff_secs
        else:
            self.failures = 1 if progressed else self.failures + 1
            self.streak = 0 if progressed else self.streak + 1
            wait = (0.0 if progressed else
                    min(self.backoff_secs * 2.0 ** (self.streak - 1), MAX_BACKOFF_SECS))
        kind = "preemption" if preempted else "failure"
        self._record(status, kind, rc)
        last = "\n".join(f"    {line}" for line in list(child.tail)[-10:])
        if preempted and self.preemptions > self.max_preemptions:
            log.error("loopkit run: out of budget: %d preemptions, more than "
                      "--max-preemptions=%d", self.preemptions, self.max_preemptions)
            return _exit_code(rc), 0.0
        if not preempted and self.failures > self.max_restarts:
            log.error("loopkit run: out of budget: %d consecutive failures, more than "
                      "--max-restarts=%d; the last one: %s\n%s", self.failures,
                      self.max_restarts, _describe(rc), last)
            return _exit_code(rc), 0.0
        # the status moves at commits only: the step the child trained to is not known
        committed = status.get("committed")
        log.warning("loopkit run: the child %s (%s) %s (it started at step %s); "
                    "restarting %s (failures %d/%d, preemptions %d/%d)%s",
                    "was preempted" if preempted else "failed", _describe(rc),
                    "with no checkpoint committed" if committed is None
                    else f"with its last checkpoint at step {committed}",
                    status.get("start_step"),
                    f"in {wait:.0f} s" if wait else "at once", self.failures,
                    self.max_restarts, self.preemptions, self.max_preemptions,
                    f"; its last lines:\n{last}" if last and not preempted else "")
        return None, wait

    def _record(self, status: dict[str, Any], kind: str, rc: int) -> None:
        """The chief's child's restart, in the ledger of the logdir that child held."""
        logdir = status.get("logdir")
        if self.record is None or not logdir or status.get("is_chief") is not True:
            return
        try:
            self.record(logdir, kind, rc if rc >= 0 else None, -rc if rc < 0 else None,
                        status.get("step"))
        except Exception:  # noqa: BLE001 - the restart matters more than its record
            log.exception("loopkit run: could not record the restart in the ledger")


def _cannot_start(program: str, e: OSError) -> int:
    """A shell's answer to a command it cannot run: 127 not found, 126 otherwise."""
    what = "not found" if isinstance(e, FileNotFoundError) else (e.strerror or str(e)).lower()
    print(f"loopkit run: cannot run {program!r}: {what}", file=sys.stderr, flush=True)
    return 127 if isinstance(e, FileNotFoundError) else 126
