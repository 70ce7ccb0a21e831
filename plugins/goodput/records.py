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
import logging
import math
import os
import typing
from pathlib import Path
from typing import Any, ClassVar, Iterator

from loopkit import storage

log = logging.getLogger("loopkit")

__all__ = ["LEDGER_NAME", "BadLine", "Fault", "Hang", "Record", "Restart", "Rollback", "Start", "Stop", "Window",
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
    (``"durable"``, ``"local"``, ``"peer"``, None for a fresh start); `machine` what
    the local tier says of the machine the previous session ran on (`MACHINE`:
    ``"lived"``, ``"lost"``, None without a local tier or when it cannot tell), which
    tells a process death from a lost machine. The session's time from
    `process_start` to `time` is startup + `restore_secs` + `input_secs` (opening the
    data and waiting for the first batch) + `first_step_secs` (the first step, its
    compile). `summary_secs` is how often the session writes a window (None: by steps
    only), which tells a live session from a dead one by its last record's age.
    """

    event: ClassVar[str] = "start"
    host: str
    pid: int
    process_start: float
    tier: str | None
    restore_secs: float
    first_step_secs: float | None  # None: the session stopped before its first step
    input_secs: float = 0.0
    summary_secs: float | None = None
    local_dir: str | None = None  # Config.local_checkpoint_dir, on `host`
    machine: str | None = None


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
    #: every tier's checkpoints committed in the window: [step, tier, wall time]
    saved: list[tuple[int, str, float]] = dataclasses.field(default_factory=list)

    @property
    def step_secs(self) -> float:
        return max(0.0, self.secs - self.input_secs - self.save_secs - sum(self.timers.values()))


@dataclasses.dataclass(frozen=True)
class Stop(Window):
    """The session's last window, up to its stop (the final save included), and why."""

    event: ClassVar[str] = "stop"
    reason: str | None = None  # Session.stop_reason, or "error"
    error: str | None = None  # the error that stopped it: "TypeName: first line"


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
#: each record type's field annotations, resolved once
HINTS: dict[type[Record], dict[str, Any]] = {t: typing.get_type_hints(t) for t in TYPES.values()}


class BadLine(ValueError):
    """A ledger line that is not a record: not JSON, not an object, a field missing or of
    the wrong type. Its message says what is wrong with it."""


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a record field's annotation (the few kinds records use)."""
    if hint is float:  # JSON has no int/float split; NaN or inf is no time or duration
        return isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is dict:  # dict[str, float]: the timers
        return isinstance(value, dict) and all(
            isinstance(k, str) and _fits(v, args[1]) for k, v in value.items())
    if origin is list:
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
    if origin is tuple:  # a JSON array of fixed length
        return isinstance(value, list) and len(value) == len(args) and all(
            _fits(v, a) for v, a in zip(value, args))
    if args and type(None) in args:  # X | None
        return value is None or any(_fits(value, a) for a in args if a is not type(None))
    raise TypeError(f"a ledger record field annotated {hint!r}")  # a record type's bug


def parse(line: str) -> Record | None:
    """The record of one line; None for an event this version does not know (a later
    version's record). Raises `BadLine` saying what is wrong with a malformed line.

    Every field's type is checked here, so that a reader of records never meets a
    wrong one (``"step": "zero"`` would fail a sum far from where it came in)."""
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise BadLine(f"not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise BadLine(f"not a JSON object but {type(obj).__name__}")
    event = obj.pop("event", None)
    if not isinstance(event, str):
        raise BadLine(f"no \"event\" naming the record type (got {event!r})")
    kind = TYPES.get(event)
    if kind is None:
        return None
    fields = {f.name: f for f in dataclasses.fields(kind)}
    hints = HINTS[kind]
    values = {}
    for name, f in fields.items():
        if name in obj:
            if not _fits(obj[name], hints[name]):
                raise BadLine(f"{event} record: {name}={obj[name]!r} is not "
                              f"{_describe(hints[name])}")
            values[name] = obj[name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise BadLine(f"{event} record without its field {name!r}")
    return kind(**values)


def _describe(hint: Any) -> str:
    names = {float: "a finite number", int: "an integer", str: "a string",
             type(None): "null"}
    if typing.get_origin(hint) is dict:
        return "an object of names to numbers"
    if typing.get_origin(hint) is list:
        return "a list of [step, tier, time]"
    args = typing.get_args(hint)
    return " or ".join(names.get(a, str(a)) for a in args) if args else names[hint]


def read_records(logdir: Path | str) -> list[Record]:
    """Every whole record of `logdir`'s ledger, in the order written (none: []); a
    malformed line is skipped with a warning naming the file and the line."""
    path = storage.join(logdir, LEDGER_NAME)
    try:
        data = storage.read_bytes(path)
    except FileNotFoundError:
        return []
    return list(records_in(data.decode("utf-8", errors="replace"), str(path)))


def records_in(text: str, source: str = LEDGER_NAME) -> Iterator[Record]:
    """The records of a ledger's text; each malformed line is skipped with one WARNING
    naming `source` and the line number (the ledger never stops a run)."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = parse(line)
        except BadLine as e:
            log.warning("loopkit: %s:%d: skipped a malformed goodput ledger line: %s",
                        source, number, e)
            continue
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
