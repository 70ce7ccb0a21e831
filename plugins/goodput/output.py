"""What ``loopkit goodput LOGDIR --json`` and ``--sessions`` print.

`report_json` is the `GoodputReport` as a JSON object whose keys are its attribute
names; `session_rows` is one row per session (when it ran, how it ended, its steps,
what it restored), printed as a table by `format_sessions` or as JSON.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from loopkit.plugins.goodput.report import GoodputReport
from loopkit.plugins.goodput.sessions import LedgerSession

__all__ = ["FAULT_WORDS", "format_sessions", "report_json", "session_rows", "tier_words"]

#: each fault cause in words (the ledger's `Fault.cause`)
FAULT_WORDS = {"sdc": "replica mismatch", "compute": "compute fault", "straggler": "straggler"}
#: each restored tier in words: "peer" is the local tier, a part received from a peer's copy
TIER_WORDS = {"peer": "peer copy of the local tier"}


def tier_words(tier: str) -> str:
    """A restored tier as the report and ``--sessions`` show it ("peer" spelled out)."""
    return TIER_WORDS.get(tier, tier)


def report_json(report: GoodputReport) -> dict[str, Any]:
    """The report as JSON: its attribute names as keys (`badput`'s "timers" a mapping)."""
    out = dataclasses.asdict(report)
    out["badput"] = {k: dict(v) if isinstance(v, dict) else v for k, v in report.badput.items()}
    return out


def session_rows(sessions: Sequence[LedgerSession]) -> list[dict[str, Any]]:
    """One row per session, in order.

    `start` is the process's start, `end` its last record (wall-clock seconds);
    `ended` how it ended (`LedgerSession.ended`), with `exit` (``"exit 75"``,
    ``"SIGKILL"``, from `loopkit run`'s record; None when the runner did not restart it)
    and `error` (the error that stopped it); `first_step` and `last_step` the steps it
    trained; `restored_step` and `restored_tier` what it opened from (None: a fresh start;
    "durable", "local" or "peer"); `machine` what the local tier said of the previous
    session's machine ("lived", "lost", None); `faults` the machines it named at fault, in order:
    each `cause` ("sdc", "compute", "straggler"), `time`, `step`, `process`, `host`,
    `device` (an sdc's differing device, else None), `detail` and `secs` (a straggler's
    cost to the others).
    """
    rows = []
    for i, s in enumerate(sessions, 1):
        st = s.start
        first = s.first_window_step()
        rows.append({
            "session": i, "host": st.host, "pid": st.pid,
            "start": st.process_start, "end": s.last_time,
            "ended": s.ended, "exit": s.exit,
            "error": s.stop.error if s.stop is not None else None,
            "stop_reason": s.stop.reason if s.stop is not None else None,
            "first_step": first if first is not None else st.step,
            "last_step": s.last_step,
            "restored_step": st.step if st.tier is not None else None,
            "restored_tier": st.tier,
            "machine": st.machine,
            "rollbacks": len(s.rollbacks),
            "hang_idle_secs": s.hang.idle_secs if s.hang is not None else None,
            "faults": [{"cause": f.cause, "time": f.time, "step": f.step,
                        "process": f.process, "host": f.host, "device": f.device,
                        "detail": f.detail, "secs": f.secs} for f in s.faults],
        })
    return rows


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def describe_end(row: dict[str, Any]) -> str:
    """How a session ended, in words: "crashed (SIGKILL)", "finished (max_steps)"."""
    detail = row["exit"] or (row["stop_reason"] if row["ended"] in ("finished",) else None)
    if row["ended"] == "hung" and row["exit"] is None:
        detail = "exit 75"
    if row["ended"] in ("crashed", "refused") and row["error"]:
        detail = f"{row['exit']}: {row['error']}" if row["exit"] else row["error"]
    return f"{row['ended']} ({detail})" if detail else row["ended"]


def count_faults(faults: Sequence[dict[str, Any]]) -> str:
    """A session's faults, counted by cause, with the machines named:
    "2 straggler (process 1 on host-b)"."""
    parts = []
    for cause, words in FAULT_WORDS.items():
        mine = [f for f in faults if f["cause"] == cause]
        if mine:
            where = ", ".join(f"process {p} on {h}"
                              for p, h in sorted({(f["process"], f["host"]) for f in mine}))
            parts.append(f"{len(mine)} {words} ({where})")
    others = len(faults) - sum(f["cause"] in FAULT_WORDS for f in faults)
    if others:  # a later version's cause
        parts.append(f"{others} other")
    return "; ".join(parts) or "-"


def format_sessions(rows: Sequence[dict[str, Any]]) -> str:
    """The sessions as ``loopkit goodput LOGDIR --sessions`` prints them."""
    table = [("#", "start", "end", "ended", "steps", "restored", "faults")]
    for r in rows:
        steps = f"{r['first_step']}..{r['last_step']}" if r["last_step"] is not None else "-"
        restored = ("fresh" if r["restored_tier"] is None
                    else f"step {r['restored_step']} ({tier_words(r['restored_tier'])}"
                    + (f", machine {r['machine']})" if r.get("machine") else ")"))
        table.append((str(r["session"]), _when(r["start"]), _when(r["end"]),
                      describe_end(r)[:60], steps, restored, count_faults(r["faults"])))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in table)
