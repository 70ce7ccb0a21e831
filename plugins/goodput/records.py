"""The ledger's records (``logdir/goodput.jsonl``), one typed family, and how a line is written.

Every line is one JSON object whose ``"event"`` names its record type. The
goodput plugin writes `Start`, `Window`, `Stop`; the watchdog `Hang`; a rollback
`Rollback`; a fault check `Fault`; `loopkit run` `Restart`. Times are wall-clock seconds
(`time.time()`); durations are seconds.

A line is appended with one `write` of the whole line, then flushed and
fsynced, so after a crash each line is whole or absent (a reader skips a torn
last line all the same: a disk may lose the tail of an unsynced append).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, ClassVar, Iterator

from loopkit import storage

__all__ = ["LEDGER_NAME", "Fault", "Hang", "Record", "Restart", "Rollback", "Start", "Stop", "Window",
           "append_line", "parse", "records_in", "read_records", "record_restart"]

LEDGER_NAME = "goodput.jsonl"


@dataclasses.dataclass(frozen=True)
class Record:
    """A ledger line: `time` it was written, and the global `step` then (None: unknown)."""

    event: ClassVar[str] = ""
    time: float
    step: int | None

    def to_line(self) -> str:
        return json.dumps({"event": self.event, **dataclasses.asdict(self)},
                          separators=(",", ":")) + "\n"


@dataclasses.dataclass(frozen=True)
class Start(Record):
    """A session's start, written at the boundary after its first step (or at its stop).

    `step` is the step it opened at (the restored one); `tier` where that came from
    (``"durable"``, ``"local"``, None for a fresh start). The session's time from
    `process_start` to `time` is startup + `restore_secs` + `first_step_secs`.
    """

    event: ClassVar[str] = "start"
    host: str
    pid: int
    process_start: float
    tier: str | None
    restore_secs: float
    first_step_secs: float | None  # None: the session stopped before its first step


@dataclasses.dataclass(frozen=True)
class Window(Record):
    """The time since the session's previous record (`secs`), and where it went.

    `save_secs` held by saves; `timers` in other timer actions, by name; the rest of
    `secs` went to steps (and hooks). `saves` commits finished in the window: their
    loop holds, full commit times, and the part of each commit that ran beside
    steps (`overlap_secs`, over `overlap_steps` steps), which measures the slowdown.
    """

    event: ClassVar[str] = "window"
    secs: float
    input_secs: float
    save_secs: float
    timers: dict[str, float]
    saves: int = 0
    hold_secs: float = 0.0
    commit_secs: float = 0.0
    overlap_secs: float = 0.0
    overlap_steps: int = 0

    @property
    def step_secs(self) -> float:
        return max(0.0, self.secs - self.input_secs - self.save_secs - sum(self.timers.values()))


@dataclasses.dataclass(frozen=True)
class Stop(Window):
    """The session's last window, up to its stop (the final save included), and why."""

    event: ClassVar[str] = "stop"
    reason: str | None = None  # Session.stop_reason, or "error"


@dataclasses.dataclass(frozen=True)
class Hang(Record):
    """The watchdog ends the process: no progress for `idle_secs`."""

    event: ClassVar[str] = "hang"
    idle_secs: float


@dataclasses.dataclass(frozen=True)
class Rollback(Record):
    """A rollback from `step` (the bad step) to the checkpoint of `to_step`."""

    event: ClassVar[str] = "rollback"
    to_step: int
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Fault(Record):
    """A machine named at fault on process `process` (`host`): `cause` "sdc" (the copies
    of a replicated leaf differ; `device` the id of the one that differs), "compute"
    (a bad value that training the same batches again did not bring back) or
    "straggler" (`secs`: the time the other processes waited for it)."""

    event: ClassVar[str] = "fault"
    cause: str
    process: int
    host: str
    device: int | None = None
    detail: str = ""
    secs: float = 0.0


@dataclasses.dataclass(frozen=True)
class Restart(Record):
    """`loopkit run` restarts its child (`kind`: "failure" or "preemption")."""

    event: ClassVar[str] = "restart"
    kind: str
    exit_code: int | None
    signal: int | None


TYPES: dict[str, type[Record]] = {
    t.event: t for t in (Start, Window, Stop, Hang, Rollback, Fault, Restart)
}


def parse(line: str) -> Record | None:
    """The record of one line, or None for a torn line or an unknown event."""
    try:
        obj = json.loads(line)
        kind = TYPES[obj.pop("event")]
        names = {f.name for f in dataclasses.fields(kind)}
        return kind(**{k: v for k, v in obj.items() if k in names})
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def read_records(logdir: Path | str) -> list[Record]:
    """Every whole record of `logdir`'s ledger, in the order written (none: [])."""
    try:
        data = storage.read_bytes(storage.join(logdir, LEDGER_NAME))
    except FileNotFoundError:
        return []
    return list(records_in(data.decode("utf-8", errors="replace")))


def records_in(text: str) -> Iterator[Record]:
    for line in text.splitlines():
        record = parse(line) if line.strip() else None
        if record is not None:
            yield record


def append_line(path: Path | str, line: str, check_end: bool = False) -> None:
    """Append one whole line to a local file: one write, flush, fsync.

    `check_end`: first end a torn last line (a crash mid-write), so that it does
    not swallow this one.
    """
    with open(path, "a+b") as f:
        if check_end and f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                line = "\n" + line
        f.write(line.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())


def record_restart(logdir: Path | str, kind: str, exit_code: int | None,
                   signal: int | None, step: int | None) -> None:
    """Append a `Restart` (from `loopkit run`, between two children) to `logdir`'s ledger.

    Under a URL the object is read, extended and written again in one PUT: no
    child runs meanwhile.
    """
    import time

    if not storage.is_dir(logdir):
        return
    record = Restart(time=time.time(), step=step, kind=kind, exit_code=exit_code,
                     signal=signal)
    path = storage.join(logdir, LEDGER_NAME)
    if not storage.is_url(path):
        append_line(path, record.to_line(), check_end=True)
        return
    try:
        old = storage.read_bytes(path)
    except FileNotFoundError:
        old = b""
    if old and not old.endswith(b"\n"):
        old += b"\n"
    storage.write_atomic(path, old + record.to_line().encode())
