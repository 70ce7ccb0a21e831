"""A run's life by the clock, from its ledger and its hang reports: what
``loopkit report`` draws (`report_html`).

Everything is in wall-clock seconds (`time.time()`). The run begins at its first
session's process start and is drawn up to its last record (a run still running too).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from loopkit import storage
from loopkit.plugins.goodput.output import describe_end, report_json, session_rows
from loopkit.plugins.goodput.records import Fault, Record, Rollback, Window, read_records
from loopkit.plugins.goodput.report import GoodputReport, summarise, summarise_sessions
from loopkit.plugins.goodput.sessions import LedgerSession, group, is_running

__all__ = ["Timeline", "build", "hang_reports"]

#: the goodput curve is the report of the ledger up to this many of its records, evenly
#: spread (each summary reads the records before it: a week's ledger stays quick)
GOODPUT_POINTS = 120
HANGS = "hangs"


@dataclasses.dataclass
class Timeline:
    """What the report draws."""

    logdir: str
    #: the first process start and the last record
    t0: float
    t1: float
    report: GoodputReport
    #: `listing.session_rows`, each with "label" (how it ended, in words), "open" (the
    #: session's first record) and "hang_report" (the report's text, or None)
    sessions: list[dict[str, Any]]
    #: (time, "failure" | "preemption", exit as "exit 1" / "SIGKILL" or None)
    restarts: list[tuple[float, str, str | None]]
    #: (time, bad step, step trained on from, reason)
    rollbacks: list[tuple[float, int | None, int, str]]
    #: (time, step, "durable" | "local")
    saves: list[tuple[float, int, str]]
    #: (time, step) by session: the step reached over time
    steps: list[list[tuple[float, int]]]
    #: (time, goodput fraction of the run so far)
    goodput: list[tuple[float, float]]
    #: (session number from 1, the record): each machine named at fault, in order
    faults: list[tuple[int, Fault]] = dataclasses.field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        return report_json(self.report)


def hang_reports(logdir: Path | str) -> list[tuple[str, float, str]]:
    """The hang reports in ``logdir/hangs/``: (name, modification time, text)."""
    directory = storage.join(logdir, HANGS)
    try:
        names = storage.list_names(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    reports = []
    for name, is_dir in sorted(names.items()):
        if is_dir or not name.startswith("hang-") or not name.endswith(".txt"):
            continue
        path = storage.join(directory, name)
        try:
            _, mtime = storage.size_and_mtime(path)
            text = storage.read_bytes(path).decode("utf-8", errors="replace")
        except OSError:
            continue
        reports.append((name, mtime, text))
    return reports


def _hang_text(session: LedgerSession, reports: list[tuple[str, float, str]]) -> str | None:
    """The report of `session`'s hang: process 0's at its step, the nearest in time."""
    hang = session.hang
    if hang is None or not reports:
        return None
    step = hang.step

    def rank(r: tuple[str, float, str]) -> tuple[bool, bool, float]:
        parts = r[0][len("hang-"):-len(".txt")].split("-")
        same_step = len(parts) == 2 and parts[1] == str(step)
        return (not same_step, parts[0] != "0", abs(r[1] - hang.time))

    best = min(reports, key=rank)
    other_step, _, distance = rank(best)
    return best[2] if not other_step or distance < 600 else None


def _goodput_curve(records: list[Record]) -> list[tuple[float, float]]:
    marks = [i for i, r in enumerate(records) if isinstance(r, Window)]
    if len(marks) > GOODPUT_POINTS:
        stride = len(marks) / GOODPUT_POINTS
        marks = [marks[int(k * stride)] for k in range(GOODPUT_POINTS)] + [marks[-1]]
    return [(records[i].time, summarise(records[:i + 1]).fraction) for i in marks]


def _steps(session: LedgerSession) -> list[tuple[float, int]]:
    points = [] if session.start.step is None else [(session.start.time, session.start.step)]
    events: list[Any] = sorted(session.windows + session.rollbacks, key=lambda r: r.time)
    for r in events:
        if isinstance(r, Rollback):  # the step falls back at the rollback
            if r.step is not None:
                points.append((r.time, r.step))
            points.append((r.time, r.to_step))
        elif r.step is not None:
            points.append((r.time, r.step))
    return points


def build(logdir: Path | str) -> Timeline:
    """The timeline of the run in `logdir`; `ValueError` when its ledger has no session."""
    logdir = storage.normalise(logdir, "logdir")
    records = read_records(logdir)
    sessions = group(records)
    if not sessions:
        raise ValueError(f"no goodput ledger (goodput.jsonl) with a session in {logdir}")
    sessions[-1].running = is_running(logdir, sessions[-1])
    report = summarise_sessions(sessions)
    reports = hang_reports(logdir)
    rows = session_rows(sessions)
    for row, s in zip(rows, sessions):
        row["label"] = describe_end(row)
        row["open"] = s.start.time
        row["hang_report"] = _hang_text(s, reports)
    restarts = [(r.time, r.kind, LedgerSession(start=s.start, restarts=[r]).exit)
                for s in sessions for r in s.restarts]
    rollbacks = [(r.time, r.step, r.to_step, r.reason) for s in sessions for r in s.rollbacks]
    saves = [(float(t), int(step), str(tier)) for s in sessions for w in s.windows
             for step, tier, t in w.saved]
    t1 = max([s.last_time for s in sessions] + [r[0] for r in restarts])
    return Timeline(logdir=str(logdir), t0=sessions[0].start.process_start, t1=t1,
                    report=report, sessions=rows, restarts=restarts, rollbacks=rollbacks,
                    saves=saves, steps=[_steps(s) for s in sessions],
                    goodput=_goodput_curve(records),
                    faults=[(i, f) for i, s in enumerate(sessions, 1) for f in s.faults])

