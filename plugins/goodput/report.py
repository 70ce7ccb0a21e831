"""`loopkit.goodput(logdir)`: where a run's wall time went, read from its ledger.

Sessions are read in order. Each session's time, from its process's start to
its last record, splits into startup, restore, the first step (compile), and
the windows' steps, input waits, save holds and timers; the time from one
session's last record to the next process's start is downtime (no trainer, or
a killed trainer's unrecorded tail), except the idle time of a hang. Steps
trained again (the previous session's steps past the step the next one
restored, and the steps a rollback undid) move from productive to recompute,
at their session's mean step time. By construction the causes and the
productive time add up to the wall time.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Mapping, Sequence

from loopkit.plugins.goodput.records import Record, Start, read_records
from loopkit.plugins.goodput.sessions import FINISHED, LedgerSession, group, is_running

__all__ = ["CAUSES", "DEFAULT_MTBI_SECS", "MAX_SAVE_SECS", "FINISHED", "GoodputReport",
           "UNINTERRUPTED_MTBI_SECS", "UNMEASURED_SAVE_SECS", "format_report", "goodput",
           "read_sessions", "summarise", "summarise_sessions", "young_daly"]

CAUSES = ("startup", "restore", "compile", "recompute", "checkpoint", "input", "timers",
          "downtime", "hang", "straggler")
#: the mean time between interruptions `young_daly` assumes when given none (a report
#: before the first interruption gives the run's wall time so far instead)
DEFAULT_MTBI_SECS = 24 * 3600.0
#: before the first interruption the report takes the run's wall time so far as the
#: MTBI (as if it were interrupted now), but never less than this: a young run saves
#: more often than a long one that has never been interrupted
UNINTERRUPTED_MTBI_SECS = 3600.0
#: the longest interval "auto" picks
MAX_SAVE_SECS = 3600.0
#: the save cost assumed until a save has been measured
ASSUMED_SAVE_COST_SECS = 1.0
#: the longest interval before the first measured save: a run's first save comes soon,
#: since it measures the cost every later interval is picked from
UNMEASURED_SAVE_SECS = 60.0


@dataclasses.dataclass(frozen=True)
class GoodputReport:
    """Where the wall time of a run went (`loopkit.goodput`)."""

    #: from the first session's process start to the ledger's last record
    wall_secs: float
    #: time in steps that were kept (recomputed steps are badput)
    productive_secs: float
    #: productive / wall (0.0 for an empty ledger)
    fraction: float
    #: seconds by cause (`CAUSES`); "timers" is itself a mapping of timer name to seconds
    badput: Mapping[str, float | Mapping[str, float]]
    sessions: int
    #: sessions that ended without finishing (a crash, a kill, a hang, a preemption)
    interruptions: int
    rollbacks: int
    #: wall / interruptions; None before the first interruption
    mtbi_secs: float | None
    #: what a save costs the run: the loop held, plus its commit's slowdown of the steps
    #: beside it; None before a save was measured
    save_cost_secs: float | None
    #: the interval `save_model_secs="auto"` picks now (before the first interruption,
    #: with the wall time so far as the MTBI, at least `UNINTERRUPTED_MTBI_SECS`)
    suggested_save_secs: float
    #: the mean time from a save's hold to durable (the lower bound of "auto")
    commit_secs: float | None = None
    #: the last session still runs (`sessions.is_running`): not an interruption
    running: bool = False
    #: when the ledger's last record was written (wall clock), None for an empty ledger
    last_record_time: float | None = None
    #: interruptions after which the machine lived (its local tier was there: the
    #: local tier's job), and those that lost a machine (`Start.machine`); with a local
    #: tier, an interruption no session followed yet is neither, nor counted below
    process_deaths: int = 0
    lost_machines: int = 0
    #: the mean time between the interruptions the local tier did not restore (all of
    #: them without a local tier): what the durable interval is picked from
    durable_mtbi_secs: float | None = None
    #: with a local tier: the mean time between the interruptions it restored (process
    #: deaths, lost machines restored from peers), its measured save cost (the loop held
    #: by its timer, per local commit) and the interval "auto" picks for it
    local_mtbi_secs: float | None = None
    local_save_cost_secs: float | None = None
    suggested_local_secs: float | None = None

    def badput_secs(self) -> float:
        """Every cause's seconds, added up (the timers' too)."""
        return sum(sum(v.values()) if isinstance(v, Mapping) else v
                   for v in self.badput.values())


def young_daly(save_cost_secs: float | None, mtbi_secs: float | None,
               commit_secs: float | None = None) -> float:
    """Young and Daly's interval ``sqrt(2 * save_cost * MTBI)``, within [commit time, 1 h].

    An unknown cost counts as `ASSUMED_SAVE_COST_SECS`, and then the interval is at most
    `UNMEASURED_SAVE_SECS` (the first save measures the cost); an unknown MTBI counts
    as `DEFAULT_MTBI_SECS`.
    """
    cost = ASSUMED_SAVE_COST_SECS if save_cost_secs is None else max(save_cost_secs, 1e-3)
    mtbi = DEFAULT_MTBI_SECS if mtbi_secs is None else mtbi_secs
    interval = math.sqrt(2.0 * cost * mtbi)
    if save_cost_secs is None:
        interval = min(interval, UNMEASURED_SAVE_SECS)
    return min(MAX_SAVE_SECS, max(interval, commit_secs or 0.0, 1.0))


def summarise(records: Sequence[Record], running: bool = False) -> GoodputReport:
    """The `GoodputReport` of a ledger's records; `running`: the last session, if it
    has no stop record, still runs (else it counts as an interruption)."""
    sessions = group(records)
    if sessions and running:
        sessions[-1].running = sessions[-1].stop is None and sessions[-1].hang is None
    return summarise_sessions(sessions)


def summarise_sessions(sessions: Sequence[LedgerSession]) -> GoodputReport:
    """The `GoodputReport` of a ledger's sessions (`sessions.group`)."""
    # long: one pass over the sessions gathers every figure of the report; split, each part
    # would walk the windows again
    bad: dict[str, float] = {k: 0.0 for k in CAUSES if k != "timers"}
    timers: dict[str, float] = {}
    step_secs = 0.0
    interruptions = rollbacks = 0
    saves = 0
    hold = commit = overlap = 0.0
    overlap_steps = 0
    quiet_secs, quiet_steps = 0.0, 0  # windows without a save: the normal step time
    all_steps = 0
    for i, s in enumerate(sessions):
        st = s.start
        first = st.first_step_secs or 0.0
        bad["restore"] += st.restore_secs
        bad["compile"] += first
        bad["input"] += st.input_secs  # opening the data, the wait for the first batch
        bad["startup"] += max(0.0, st.time - st.process_start - st.restore_secs
                              - st.input_secs - first)
        prev = s.first_window_step()
        for w in s.windows:
            step_secs += w.step_secs
            bad["input"] += w.input_secs
            bad["checkpoint"] += w.save_secs
            for name, secs in w.timers.items():
                timers[name] = timers.get(name, 0.0) + secs
            saves += w.saves
            hold, commit = hold + w.hold_secs, commit + w.commit_secs
            overlap, overlap_steps = overlap + w.overlap_secs, overlap_steps + w.overlap_steps
            if w.step is not None and prev is not None and w.step > prev:
                all_steps += w.step - prev
                if w.saves == 0:
                    quiet_secs, quiet_steps = quiet_secs + w.step_secs, quiet_steps + w.step - prev
            prev = w.step if w.step is not None else prev
        bad["straggler"] += s.straggler_secs
        mean_step = s.step_time()
        for r in s.rollbacks:
            rollbacks += 1
            bad["recompute"] += max(0, (r.step or 0) - r.to_step) * mean_step
        interruptions += s.interrupted  # the last session too: a crash is a crash
        if i + 1 < len(sessions):
            nxt = sessions[i + 1]
            if s.last_step is not None and nxt.start.step is not None:
                bad["recompute"] += max(0, s.last_step - nxt.start.step) * mean_step
            gap = max(0.0, nxt.start.process_start - s.last_time)
            bad["downtime"] += gap
        if s.hang is not None:
            # the hang's idle time is inside the session's last stretch, not in a window
            last_window = s.windows[-1].time if s.windows else st.time
            stretch = max(0.0, s.hang.time - last_window)
            bad["hang"] += min(s.hang.idle_secs, stretch)
            bad["downtime"] += stretch - min(s.hang.idle_secs, stretch)
    bad["recompute"] = min(bad["recompute"], step_secs)
    # the time the others waited for a straggler is inside their steps' time
    bad["straggler"] = min(bad["straggler"], step_secs - bad["recompute"])
    productive = step_secs - bad["recompute"] - bad["straggler"]
    wall = 0.0
    last_time = None
    if sessions:
        last_time = max(s.last_time for s in sessions)
        wall = last_time - sessions[0].start.process_start
    mtbi = wall / interruptions if interruptions else None
    tiers = _by_tier(sessions)
    normal = quiet_secs / quiet_steps if quiet_steps else step_secs / max(1, all_steps)
    cost = None
    if saves:
        slowdown = max(0.0, overlap - overlap_steps * normal)
        cost = (hold + slowdown) / saves
    commit_mean = commit / saves if saves else None
    badput: dict[str, float | Mapping[str, float]] = {
        k: timers if k == "timers" else bad[k] for k in CAUSES}
    # with a local tier, the durable tier serves only what the local one did not restore
    durable_mtbi = wall / tiers.durable if tiers.durable else None
    local_mtbi = wall / tiers.local if tiers.local else None
    prior = max(wall, UNINTERRUPTED_MTBI_SECS)  # no interruption yet: see the constant
    return GoodputReport(
        wall_secs=wall, productive_secs=productive,
        fraction=productive / wall if wall > 0 else 0.0, badput=badput,
        sessions=len(sessions), interruptions=interruptions, rollbacks=rollbacks,
        mtbi_secs=mtbi, save_cost_secs=cost,
        suggested_save_secs=young_daly(cost, durable_mtbi or prior, commit_mean),
        commit_secs=commit_mean,
        running=bool(sessions) and sessions[-1].running, last_record_time=last_time,
        process_deaths=tiers.deaths, lost_machines=tiers.lost,
        durable_mtbi_secs=durable_mtbi, local_mtbi_secs=local_mtbi,
        local_save_cost_secs=tiers.local_cost,
        suggested_local_secs=None if not tiers.has_local
        else young_daly(tiers.local_cost, local_mtbi or prior),
    )


@dataclasses.dataclass
class _Tiers:
    has_local: bool = False  # the last session has a local tier
    deaths: int = 0  # interruptions after which the machine lived
    lost: int = 0  # ... that lost a machine
    local: int = 0  # interruptions the local tier restored (its peers included)
    durable: int = 0  # the others: the durable tier's
    local_cost: float | None = None


def _by_tier(sessions: Sequence[LedgerSession]) -> _Tiers:
    """Each interruption's cause, from the next session's start (`Start.machine`,
    `Start.tier`), and the local tier's save cost (its timer's hold per local commit)."""
    out = _Tiers(has_local=bool(sessions) and sessions[-1].start.local_dir is not None)
    held, commits = 0.0, 0
    for i, s in enumerate(sessions):
        for w in s.windows:
            held += w.timers.get("checkpoint_local", 0.0)
            commits += sum(1 for x in w.saved if x[1] == "local")
        if not s.interrupted:
            continue
        nxt = sessions[i + 1].start if i + 1 < len(sessions) else None
        if nxt is None and out.has_local:
            continue  # nothing restored after it yet: neither tier's to count
        cause = _cause(nxt)
        out.deaths += cause == "lived"
        out.lost += cause == "lost"
        # a process death is the local tier's job (a newer durable step served this
        # time, or not); a lost machine too when its peers held its part
        if cause == "lived" or (nxt is not None and nxt.tier == "peer"):
            out.local += 1
        else:
            out.durable += 1
    out.local_cost = held / commits if commits else None
    return out


def _cause(start: Start | None) -> str | None:
    """What the start after an interruption says of the machine: "lived", "lost", None."""
    if start is None:
        return None
    if start.machine is not None:
        return start.machine
    # a ledger written before `machine`: the tier alone tells
    return {"local": "lived", "peer": "lost"}.get(start.tier or "")


def goodput(logdir: Path | str) -> GoodputReport:
    """Where `logdir`'s wall time went, from its ledger (``logdir/goodput.jsonl``).

    An empty or missing ledger gives a report of zeros. A malformed line is skipped
    with a warning naming the file and the line. The last session counts as an
    interruption unless it still runs (`sessions.is_running`).
    """
    return summarise_sessions(read_sessions(logdir))


def read_sessions(logdir: Path | str) -> list[LedgerSession]:
    """`logdir`'s ledger by session, the last one marked running when it still runs."""
    from loopkit.storage import normalise

    logdir = normalise(logdir, "logdir")
    sessions = group(read_records(logdir))
    if sessions:
        sessions[-1].running = is_running(logdir, sessions[-1])
    return sessions


def _hms(secs: float | None) -> str:
    if secs is None:
        return "-"
    secs = float(secs)
    if secs < 120:
        return f"{secs:.1f} s"
    h, rest = divmod(secs, 3600)
    return f"{int(h)}h{int(rest // 60):02d}m{rest % 60:04.1f}s" if h else \
        f"{int(rest // 60)}m{rest % 60:04.1f}s"


def _cost(secs: float | None) -> str:
    return "-" if secs is None else f"{secs:.2g} s"  # a local save: hundredths


def _live(report: GoodputReport) -> str:
    if not report.running or report.last_record_time is None:
        return ""
    return f"  (running: last record {_ago(time.time() - report.last_record_time)} ago)"


def _ago(secs: float) -> str:
    secs = max(0.0, secs)
    if secs < 120:
        return f"{secs:.0f} s"
    return f"{secs / 60:.0f} min" if secs < 7200 else f"{secs / 3600:.1f} h"


def format_report(report: GoodputReport) -> str:
    """The report as `loopkit goodput` prints it: a summary, then badput by cause."""
    wall = report.wall_secs or 1.0
    lines = [
        f"wall        {_hms(report.wall_secs)}{_live(report)}",
        f"productive  {_hms(report.productive_secs)}  ({100 * report.fraction:.1f}% goodput)",
        f"sessions {report.sessions}, interruptions {report.interruptions}, "
        f"rollbacks {report.rollbacks}, mean time between interruptions "
        f"{_hms(report.mtbi_secs)}",
        f"save cost {_hms(report.save_cost_secs)} (commit {_hms(report.commit_secs)}); "
        f"save_model_secs=\"auto\" would pick {_hms(report.suggested_save_secs)}",
    ]
    if report.suggested_local_secs is not None:
        lines[-1:] = [
            f"  of which process deaths {report.process_deaths} (the local tier's), lost "
            f"machines {report.lost_machines}",
            f"durable tier: mean time between the interruptions it restores "
            f"{_hms(report.durable_mtbi_secs)}, save cost {_cost(report.save_cost_secs)} "
            f"(commit {_hms(report.commit_secs)}); save_model_secs=\"auto\" would pick "
            f"{_hms(report.suggested_save_secs)}",
            f"local tier: mean time between the interruptions it restores "
            f"{_hms(report.local_mtbi_secs)}, save cost {_cost(report.local_save_cost_secs)}; "
            f"save_local_secs=\"auto\" would pick {_hms(report.suggested_local_secs)}"]
    lines.append("badput:")
    for cause in CAUSES:
        value = report.badput[cause]
        if isinstance(value, Mapping):
            lines.append(f"  {cause:<10}  {_hms(sum(value.values())):>12}  "
                         f"{100 * sum(value.values()) / wall:5.1f}%")
            for name, secs in sorted(value.items()):
                lines.append(f"    {name:<14}  {_hms(secs):>8}  {100 * secs / wall:5.1f}%")
        else:
            lines.append(f"  {cause:<10}  {_hms(value):>12}  {100 * value / wall:5.1f}%")
    return "\n".join(lines)
