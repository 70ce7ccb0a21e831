"""The ledger's records grouped by session, how each session ended, and whether the
last one still runs.

A session is a `Start` and the records after it up to its `Stop` (or the next
`Start`). How it ended:

- ``finished``: a `Stop` for `max_steps`, `data_exhausted` or `requested`;
- ``preempted``: a `Stop` for a signal (SIGTERM, Ctrl-C), or a `Restart` of kind
  ``"preemption"`` after it;
- ``hung``: a `Hang` record (the watchdog's exit, `HANG_EXIT_CODE`);
- ``refused``: stopped by `LogdirInUseError` (another run took the logdir);
- ``crashed``: a `Stop` for an error, or no `Stop` at all (a SIGKILL, an OOM kill,
  a power cut); the exit code or signal comes from `loopkit run`'s `Restart` record
  after it, when the runner restarted it;
- ``running``: no `Stop` yet and the process is alive (`is_running`).

Every session but a running or finished one is an interruption.
"""

from __future__ import annotations

import dataclasses
import signal as signals
import time
from pathlib import Path
from typing import Any, Sequence

from loopkit import storage
from loopkit.storage.local import read_json_object
from loopkit.plugins.goodput.records import (
    Fault, Hang, Record, Restart, Rollback, Start, Stop, Window,
)

__all__ = ["FINISHED", "LedgerSession", "group", "is_running"]

#: stop reasons of a session that finished its work (not an interruption)
FINISHED = ("max_steps", "data_exhausted", "requested")
#: a session whose records carry no interval is judged live while its last record is
#: younger than this many summary intervals (at least `MIN_SILENCE_SECS`)
SILENT_INTERVALS = 3
MIN_SILENCE_SECS = 60.0
#: the summary interval assumed when a session's start record gives none
DEFAULT_INTERVAL_SECS = 120.0


@dataclasses.dataclass
class LedgerSession:
    """One session's records (a process from its start to its last record)."""

    start: Start
    windows: list[Window] = dataclasses.field(default_factory=list)
    rollbacks: list[Rollback] = dataclasses.field(default_factory=list)
    hang: Hang | None = None
    stop: Stop | None = None
    #: `loopkit run`'s records after it, before the next session (the first is this
    #: session's exit; any later one, a child that died before its first record)
    restarts: list[Restart] = dataclasses.field(default_factory=list)
    #: machines named at fault (replica mismatch, compute fault, straggler)
    faults: list[Fault] = dataclasses.field(default_factory=list)
    last_time: float = 0.0
    last_step: int | None = None
    #: set by the reader that knows: the process still runs (only ever the last session)
    running: bool = False

    @property
    def straggler_secs(self) -> float:
        """The time the other processes waited for a straggler, within the steps."""
        return sum(f.secs for f in self.faults if f.cause == "straggler")

    def first_window_step(self) -> int | None:
        s = self.start
        if s.step is None:
            return None
        return s.step + (1 if s.first_step_secs is not None else 0)

    def step_time(self) -> float:
        """The mean time of this session's steps (0.0 before a window)."""
        steps, secs, prev = 0, 0.0, self.first_window_step()
        for w in self.windows:
            if w.step is not None and prev is not None:
                steps += max(0, w.step - prev)
                prev = w.step
            secs += w.step_secs
        return secs / steps if steps else 0.0

    @property
    def ended(self) -> str:
        """How it ended: finished, preempted, hung, refused, crashed or running."""
        stop = self.stop
        if stop is not None:
            if stop.reason in FINISHED:
                return "finished"
            if stop.reason == "signal":
                return "preempted"
            if stop.error is not None and stop.error.startswith("LogdirInUseError"):
                return "refused"
            return "crashed"
        if self.hang is not None:
            return "hung"
        if self.running:
            return "running"
        if self.restarts and self.restarts[0].kind == "preemption":
            return "preempted"
        return "crashed"

    @property
    def interrupted(self) -> bool:
        return self.ended not in ("finished", "running")

    @property
    def exit(self) -> str | None:
        """The process's exit as `loopkit run` saw it ("exit 1", "SIGKILL"), or None."""
        if not self.restarts:
            return None
        r = self.restarts[0]
        if r.signal is not None:
            try:
                return signals.Signals(r.signal).name
            except ValueError:
                return f"signal {r.signal}"
        return None if r.exit_code is None else f"exit {r.exit_code}"


def group(records: Sequence[Record]) -> list[LedgerSession]:
    """The ledger's records, by session, in order (a line before any start is dropped)."""
    sessions: list[LedgerSession] = []
    for r in records:
        if isinstance(r, Start):
            sessions.append(LedgerSession(start=r, last_time=r.time, last_step=r.step))
            continue
        if not sessions:
            continue
        s = sessions[-1]
        if isinstance(r, Restart):
            s.restarts.append(r)
            continue
        if s.stop is not None:
            continue  # a stray line after its session's stop
        if isinstance(r, Window):  # Stop too
            s.windows.append(r)
            if isinstance(r, Stop):
                s.stop = r
        elif isinstance(r, Rollback):
            s.rollbacks.append(r)
        elif isinstance(r, Hang):
            s.hang = r
        elif isinstance(r, Fault):
            s.faults.append(r)
        else:
            continue
        s.last_time = max(s.last_time, r.time)
        if r.step is not None and not isinstance(r, Hang):
            s.last_step = r.step
    return sessions


def is_running(logdir: Path | str | None, session: LedgerSession,
               now: float | None = None) -> bool:
    """Whether `session` (the ledger's last) is still running.

    A session with a stop or hang record has ended. Otherwise the logdir's lock says:
    on a local logdir, the ``.loopkit-lock`` held (``/proc/locks``) by the session's
    own process (its host and pid, written in the lock file) means running; not held,
    or held by another process (the next session starting), means it ended. On a URL
    logdir the lease says the same: the session's own, renewed within its expiry. Where
    neither can be read, the last record's age decides: running while it is younger
    than `SILENT_INTERVALS` of the session's summary interval (its start record's
    `summary_secs`, else the longest gap between its records), at least
    `MIN_SILENCE_SECS`.
    """
    if session.stop is not None or session.hang is not None:
        return False
    now = time.time() if now is None else now
    holder = _holder(logdir) if logdir is not None else None
    if holder is not None:
        return bool(holder) and holder.get("pid") == session.start.pid \
            and holder.get("host") == session.start.host
    return now - session.last_time < _silence(session)


def _silence(session: LedgerSession) -> float:
    interval = session.start.summary_secs
    if interval is None:
        times = [session.start.time] + [w.time for w in session.windows]
        gaps = [b - a for a, b in zip(times, times[1:])]
        interval = max(gaps) if gaps else DEFAULT_INTERVAL_SECS
    return max(SILENT_INTERVALS * interval, MIN_SILENCE_SECS)


def _holder(logdir: Path | str) -> dict[str, Any] | None:
    """The live holder of `logdir`'s lock or lease ({} when none holds it), or None
    when this machine cannot tell."""
    from loopkit.process import logdir_lock

    if storage.is_url(logdir):
        try:
            raw = storage.read_bytes(storage.join(logdir, logdir_lock.LEASE_NAME))
        except FileNotFoundError:
            return {}  # released at a clean stop
        except Exception:  # noqa: BLE001 - an unreadable store: judge by the ledger's age
            return None
        lease = _json_object(raw)
        if lease is None:
            return None
        try:
            age = time.time() - float(lease.get("renewed", "nan"))
            expiry = logdir_lock.EXPIRY_RENEWALS * logdir_lock.renew_secs()
        except (TypeError, ValueError):
            return None
        return lease if age < expiry else {}
    path = Path(logdir) / logdir_lock.LOCK_NAME
    try:
        inode = path.stat().st_ino
        with open("/proc/locks") as f:
            locks = f.read().splitlines()
        raw = path.read_bytes()
    except FileNotFoundError:
        return {} if not path.exists() else None
    except OSError:
        return None
    # "1: FLOCK  ADVISORY  WRITE 16940 fe:00:2148930 0 EOF": matched by inode, as an
    # overlay filesystem may show another device number than stat() gives
    held = any(len(f := line.split()) > 5 and f[1] == "FLOCK"
               and f[5].rsplit(":", 1)[-1] == str(inode) for line in locks)
    if not held:
        return {}
    return _json_object(raw) or {"pid": None}  # held, its name not written yet


def _json_object(raw: bytes) -> dict[str, Any] | None:
    return read_json_object(lambda: raw)

