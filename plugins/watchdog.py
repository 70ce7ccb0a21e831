"""Built-in `watchdog`: a hang is a failure (`Config.hang_timeout_secs`).

A thread watches the loop's progress: a step completing (the session's host
integer `step`) or a timer action returning (`session.timer_returned`). The
clock starts after the first step of the session, so compiling it does not
count, and a timer action that runs long (an evaluation) gets the same
allowance of its own, from its start. When nothing has progressed for
`hang_timeout_secs`, it writes a report (the step reached, how long nothing
moved, the timer action running, every Python thread's stack, and native stacks
when `py-spy` is installed: ``jax-loopkit[debug]``) to
``logdir/hangs/hang-<process>-<step>.txt`` and to the ``"loopkit"`` logger at
ERROR, records it in the goodput ledger, then ends the process at once with `loopkit.HANG_EXIT_CODE` (75): a hung
collective cannot be stopped gracefully. Committed checkpoints are untouched; a
save in flight is abandoned, as after a SIGKILL, and cleaned at the next start.

Nothing runs per step: the thread reads `session.step` every quarter of the
timeout (at most once a second). With several processes it also publishes that
step in `jax.distributed`'s key-value store when it changed, and a report lists
every process's step and names the ones behind.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from loopkit import storage
from loopkit.config import Config
from loopkit.errors import HANG_EXIT_CODE
from loopkit.plugin.hookspec import hookimpl
from loopkit.plugins.goodput.ledger import LEDGER
from loopkit.plugins.goodput.records import Hang
from loopkit.plugins.hang_peers import ProcessSteps

if TYPE_CHECKING:
    from loopkit.loop.session import Session

__all__ = ["HangWatchdog", "plugin"]

log = logging.getLogger("loopkit")

INACTIVE = "Config.hang_timeout_secs is None"


class HangWatchdog:
    """Ends a process whose loop has made no progress for `timeout` seconds."""

    def __init__(self, config: Config, exit: Callable[[int], Any] = os._exit) -> None:
        self.timeout: float = config.hang_timeout_secs  # type: ignore[assignment]
        self._exit = exit
        self._stop = threading.Event()
        #: the report written at a hang (its text), for tests that replace `exit`
        self.report: str | None = None

    @hookimpl(tryfirst=True)
    def session_create(self, session: Session) -> None:
        thread = threading.Thread(target=self._watch, args=(session,), daemon=True,
                                  name="loopkit-hang-watchdog")
        session.register_thread(thread)
        thread.start()

    @hookimpl
    def on_stop(self) -> None:
        self._stop.set()

    def _watch(self, session: Session) -> None:
        poll = min(self.timeout / 4, 1.0)
        first = session.step
        while session.step == first:  # the first step compiles: not counted
            if self._stop.wait(poll) or session.should_stop():
                return
        step, moved = session.step, time.monotonic()
        steps = ProcessSteps.connect()
        steps.publish(step)
        # the loop is watched until a stop is requested; the final save after it
        # is bounded by the orchestrator's grace period, not by this thread
        while not self._stop.wait(poll) and not session.should_stop():
            now = time.monotonic()
            if session.step != step:
                step, moved = session.step, now
                steps.publish(step)
            moved = max(moved, session.timer_returned)
            running = session.timer_running
            since = running.since if running is not None else moved
            if now - since >= self.timeout and not self._stop.is_set():
                steps.publish(session.step)
                self._hang(session, now - since, running, steps)
                return

    def _hang(self, session: Session, idle: float, running: Any,
              steps: ProcessSteps | None = None) -> None:
        steps = steps or ProcessSteps(None)
        # every process of a hung job fires within a poll of the others: meet in
        # the store first, so each report can say which process is behind
        bound = min(self.timeout, 30.0)
        steps.mark_hung(session.step)
        peers = steps.gather("hung", bound)
        report = hang_report(session, idle, self.timeout, running, steps, peers)
        self.report = report
        path = _write(session, report)
        ledger = session.stash.get(LEDGER)  # the chief's goodput ledger: a hang line
        if ledger is not None:
            try:
                ledger.write(Hang(time=time.time(), step=session.step, idle_secs=idle),
                             wait=True)
            except Exception:  # noqa: BLE001 - exiting anyway; the report is written
                log.exception("loopkit: could not record the hang in the goodput ledger")
        log.error("loopkit: no progress for %.0f s (Config.hang_timeout_secs=%s): ending the "
                  "process with exit code %d; report: %s\n%s", idle, self.timeout,
                  HANG_EXIT_CODE, path, report)
        for handler in logging.getLogger().handlers + log.handlers:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        # the chief hosts the job's coordinator: its exit aborts the others, so it
        # leaves last, once every process has written its report (bounded)
        steps.mark("reported")
        steps.await_exit_turn(bound)
        self._exit(HANG_EXIT_CODE)


def hang_report(session: Session, idle: float, timeout: float, running: Any,
                steps: ProcessSteps | None = None, peers: dict | None = None) -> str:
    """The text of a hang report: where the loop is, and every thread's stack."""
    import jax

    lines = [
        f"loopkit hang report: host {socket.gethostname()}, pid {os.getpid()}, "
        f"process {jax.process_index()} of {jax.process_count()}",
        f"the loop reached step {session.step} and made no progress for {idle:.1f} s "
        f"(Config.hang_timeout_secs={timeout})",
    ]
    if running is not None:
        lines.append(f"the timer action {running.name!r} has been running for "
                     f"{time.monotonic() - running.since:.1f} s")
    else:
        lines.append(f"waiting in the step function, the data source or a hook, for step "
                     f"{session.step + 1}")
    if steps is not None and steps.client is not None:
        lines.append(steps.describe(peers or {}))
    lines += ["", "Python stacks of every thread (most recent call first):",
              _python_stacks(), "", _native_stacks()]
    return "\n".join(lines)


def _python_stacks() -> str:
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        return f.read()


def _native_stacks() -> str:
    # beside this interpreter too: a venv's python run without activating it
    spy = shutil.which("py-spy") or shutil.which(
        "py-spy", path=os.path.dirname(sys.executable))
    if spy is None:
        return ("native stacks: py-spy is not installed (pip install 'jax-loopkit[debug]' "
                "adds them)")
    try:
        out = subprocess.run([spy, "dump", "--native", "--pid", str(os.getpid())],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"native stacks: py-spy failed ({e})"
    if out.returncode != 0:
        return f"native stacks: py-spy failed ({out.stderr.strip()[-500:]})"
    return "native stacks (py-spy dump --native):\n" + out.stdout


def _write(session: Session, report: str) -> str | None:
    """`logdir/hangs/hang-<process>-<step>.txt`, or None without a logdir."""
    import jax

    if session.logdir is None:
        return None
    name = f"hang-{jax.process_index()}-{session.step}.txt"
    path = storage.join(session.logdir, "hangs", name)
    try:
        storage.makedirs(storage.parent(path))
        storage.write_atomic(path, report.encode())
    except Exception:  # noqa: BLE001 - the log has the report all the same
        log.exception("loopkit: could not write the hang report to %s", path)
        return None
    return str(path)


def plugin(config: Config) -> HangWatchdog | None:
    return None if config.hang_timeout_secs is None else HangWatchdog(config)
