"""Built-in `watchdog`: a hang is a failure (`Config.hang_timeout_secs`).

A thread watches the loop's progress: a step completing (the session's host
integer `step`) or a timer action returning (`session.timer_returned`). It starts
with the session (`session_open`, before the logdir lock and the restore) and
gives the start-up, up to the first completed step, `Config.startup_timeout_secs`
(default 30 minutes): the lock, the restore, the first batch, the first compile.
After the first step a timer action that runs long (an evaluation) gets the same
allowance as a step, from its start. When nothing has progressed for
`hang_timeout_secs`, it writes a report (the step reached, how long nothing
moved, where the loop is stuck: the start-up phase, the timer action, or the
place in words (`hang_place`), every Python thread's stack, and native stacks
when `py-spy` is installed: ``jax-loopkit[debug]``) to the ``"loopkit"`` logger at
ERROR and to ``logdir/hangs/hang-<process>-<step>.txt``, records it in the goodput
ledger, then ends the process with `loopkit.HANG_EXIT_CODE` (75): a hung collective
cannot be stopped gracefully. The report's work runs in a thread of its own and
each write has a deadline: whatever they do (a URL whose write blocks, a ledger
mirror that never returns), the process exits within `EXIT_WITHIN` seconds of the
hang. Committed checkpoints are untouched; a save in flight is abandoned, as after
a SIGKILL, and cleaned at the next start.

Nothing runs per step: the thread reads `session.step` every quarter of the
timeout (at most once a second). With several processes it also publishes that
step in `jax.distributed`'s key-value store when it changed, and a report lists
every process's step and names the ones behind.
"""

from __future__ import annotations

import contextlib
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
from loopkit.plugins.hang_place import place

if TYPE_CHECKING:
    from loopkit.loop.session import Session

__all__ = ["EXIT_WITHIN", "STARTUP_TIMEOUT_SECS", "HangWatchdog", "plugin"]

log = logging.getLogger("loopkit")

INACTIVE = "Config.hang_timeout_secs is None"

#: the start-up allowance when `Config.startup_timeout_secs` is None: 30 minutes
STARTUP_TIMEOUT_SECS = 1800.0
#: at most this many seconds from a hang to the exit, whatever the report's writes do
#: (DESIGN: within `hang_timeout_secs` + 60 s; a poll and the exit itself fit in the rest)
EXIT_WITHIN = 55.0


class HangWatchdog:
    """Ends a process whose loop has made no progress for `timeout` seconds, or whose
    start-up has not completed a step within `startup` seconds."""

    def __init__(self, config: Config, exit: Callable[[int], Any] = os._exit) -> None:
        self.timeout: float = config.hang_timeout_secs  # type: ignore[assignment]
        self.startup_setting = config.startup_timeout_secs
        self.startup: float = (STARTUP_TIMEOUT_SECS if config.startup_timeout_secs is None
                               else config.startup_timeout_secs)
        self._exit = exit
        self._stop = threading.Event()
        self._start_step: int | None = None  # the step the session opened at, once known
        #: the report written at a hang (its text), for tests that replace `exit`
        self.report: str | None = None

    @hookimpl(tryfirst=True)
    def session_open(self, session: Session) -> None:
        thread = threading.Thread(target=self._watch, args=(session,), daemon=True,
                                  name="loopkit-hang-watchdog")
        session.register_thread(thread)
        thread.start()

    @hookimpl(tryfirst=True)
    def session_create(self, session: Session) -> None:
        # restored or not, the step is final here: no step runs before session_create
        self._start_step = session.step

    @hookimpl
    def on_stop(self) -> None:
        self._stop.set()

    def _watch(self, session: Session) -> None:
        poll = min(self.timeout / 4, self.startup / 4, 1.0)
        steps = ProcessSteps.connect()
        if not self._watch_startup(session, poll, steps):
            return
        step, moved = session.step, time.monotonic()
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

    def _watch_startup(self, session: Session, poll: float, steps: ProcessSteps) -> bool:
        """From the session's start to its first completed step (True); False at a stop
        or a hang (the start-up took longer than `startup`: compiling counts here)."""
        opened = time.monotonic()
        while not self._stop.wait(poll) and not session.should_stop():
            start = self._start_step
            if start is not None and session.step != start:
                return True
            idle = time.monotonic() - opened
            if idle >= self.startup and not self._stop.is_set():
                self._hang(session, idle, None, steps, first=True)
                return False
        return False

    def _hang(self, session: Session, idle: float, running: Any,
              steps: ProcessSteps | None = None, first: bool = False) -> None:
        """Report, then exit: the report runs in a thread of its own, and the exit comes
        within `EXIT_WITHIN` s whatever it does (a write may block for ever)."""
        deadline = time.monotonic() + EXIT_WITHIN
        done = threading.Event()

        def report() -> None:
            try:
                self._report(session, idle, running, steps or ProcessSteps(None), first,
                             deadline)
            except BaseException:  # noqa: BLE001 - exiting anyway; say why the report failed
                log.exception("loopkit: the hang report failed")
            finally:
                done.set()

        threading.Thread(target=report, daemon=True, name="loopkit-hang-report").start()
        if not done.wait(EXIT_WITHIN):
            _last_words(f"loopkit: the hang report did not finish within {EXIT_WITHIN:.0f} s "
                        f"(a write or a log handler that blocks): ending the process with "
                        f"exit code {HANG_EXIT_CODE} all the same\n")
        self._exit(HANG_EXIT_CODE)

    def _report(self, session: Session, idle: float, running: Any, steps: ProcessSteps,
                first: bool, deadline: float) -> None:
        # every process of a hung job fires within a poll of the others: meet in
        # the store first, so each report can say which process is behind
        bound = min(self.timeout, 20.0)
        steps.mark_hung(session.step)
        peers = steps.gather("hung", bound)
        why = self._why(idle, first)
        report = hang_report(session, idle, self.timeout, running, steps, peers,
                             startup=self._startup_words() if first else None)
        self.report = report
        path = _report_path(session)
        # the log first: it holds the report whatever the file's write does
        log.error("loopkit: %s: ending the process with exit code %d; the report follows%s\n%s",
                  why, HANG_EXIT_CODE, "" if path is None else f" (also written to {path})",
                  report)
        writes = min(self.timeout, 10.0)  # each write's share of EXIT_WITHIN
        if path is not None:
            failed = _bounded(lambda: _write_file(path, report), writes, "the write")
            if failed is not None:
                log.error("loopkit: the hang report could not be written to %s: %s; it is "
                          "in the log above", path, failed)
        ledger = session.stash.get(LEDGER)  # the chief's goodput ledger: a hang line
        if ledger is not None:
            record = Hang(time=time.time(), step=session.step, idle_secs=idle)
            failed = _bounded(lambda: ledger.write(record, wait=True), writes / 2,
                              "the ledger's write")
            if failed is not None:
                log.error("loopkit: could not record the hang in the goodput ledger: %s",
                          failed)
        _flush()
        # the chief hosts the job's coordinator: its exit aborts the others, so it
        # leaves last, once every process has written its report (bounded)
        steps.mark("reported")
        steps.await_exit_turn(max(0.0, min(bound, deadline - time.monotonic() - 2.0)))

    def _startup_words(self) -> str:
        return ("None, 30 minutes" if self.startup_setting is None
                else repr(self.startup_setting))

    def _why(self, idle: float, first: bool) -> str:
        if not first:
            return f"no progress for {idle:.0f} s (Config.hang_timeout_secs={self.timeout})"
        return (f"no first step {idle:.0f} s after the session's start "
                f"(Config.startup_timeout_secs={self._startup_words()})")


def _bounded(fn: Callable[[], Any], secs: float, what: str) -> str | None:
    """Run `fn()` in a daemon thread for at most `secs`: None when it returned, else why
    not (its error, or that it did not return in time and was abandoned)."""
    errors: list[str] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(f"{type(e).__name__}: {e}")

    thread = threading.Thread(target=run, daemon=True, name="loopkit-hang-write")
    thread.start()
    thread.join(secs)
    if thread.is_alive():
        return f"{what} did not return within {secs:.0f} s (abandoned)"
    return errors[0] if errors else None


def _flush() -> None:
    for handler in logging.getLogger().handlers + log.handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    sys.stdout.flush()
    sys.stderr.flush()


def _last_words(text: str) -> None:
    """Straight to stderr's file descriptor: a logging handler may be what blocks."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode())


def hang_report(session: Session, idle: float, timeout: float, running: Any,
                steps: ProcessSteps | None = None, peers: dict | None = None,
                startup: str | None = None) -> str:
    """The text of a hang report: where the loop is, and every thread's stack.
    `startup`: the start-up allowance in words, for a hang before the first step."""
    import jax

    lines = [
        f"loopkit hang report: host {socket.gethostname()}, pid {os.getpid()}, "
        f"process {jax.process_index()} of {jax.process_count()}",
        f"the loop reached step {session.step} and made no progress for {idle:.1f} s "
        f"(Config.hang_timeout_secs={timeout})" if startup is None else
        f"the session opened {idle:.1f} s ago and has not completed its first step: it is "
        f"at step {session.step} (Config.startup_timeout_secs={startup})",
    ]
    if running is not None:
        lines.append(f"the timer action {running.name!r} has been running for "
                     f"{time.monotonic() - running.since:.1f} s")
    else:  # the headline: where the loop is stuck, in words
        lines.append(place(session, first=startup is not None))
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
                             capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"native stacks: py-spy failed ({e})"
    if out.returncode != 0:
        return f"native stacks: py-spy failed ({out.stderr.strip()[-500:]})"
    return "native stacks (py-spy dump --native):\n" + out.stdout


def _report_path(session: Session) -> str | None:
    """`logdir/hangs/hang-<process>-<step>.txt`, or None without a logdir."""
    import jax

    if session.logdir is None:
        return None
    return str(storage.join(session.logdir, "hangs",
                            f"hang-{jax.process_index()}-{session.step}.txt"))


def _write_file(path: str, report: str) -> None:
    folder = storage.parent(path)
    if not storage.is_url(folder) and os.path.exists(folder) and not os.path.isdir(folder):
        raise NotADirectoryError(f"{folder} is a file, not a directory")
    storage.makedirs(folder)
    storage.write_atomic(path, report.encode())


def plugin(config: Config) -> HangWatchdog | None:
    return None if config.hang_timeout_secs is None else HangWatchdog(config)
