"""The goodput plugin's part of the ``loopkit`` command: ``loopkit goodput LOGDIR``,
``loopkit report LOGDIR``, and the restart records of ``loopkit run``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from loopkit.plugin.hookspec import hookimpl

__all__ = ["command_line", "run_restarted"]


@hookimpl
def command_line(subparsers: Any) -> None:
    g = subparsers.add_parser(
        "goodput", help="where LOGDIR's wall time went: goodput and badput by cause, "
                        "from its ledger",
        description="Read LOGDIR's ledger (goodput.jsonl) and print where the run's wall "
                    "time went: the productive fraction, badput by cause (start-up, "
                    "restore, compile, recompute, checkpoints, input, timers, downtime, "
                    "hangs), the sessions, interruptions and rollbacks, the mean time "
                    "between interruptions and the measured cost of a save; a run still "
                    "running is shown as such.")
    g.add_argument("logdir")
    g.add_argument("--json", action="store_true",
                   help="print JSON (keys: GoodputReport's attribute names)")
    g.add_argument("--sessions", action="store_true",
                   help="list the sessions: start, end, how each ended, steps, what it restored")
    g.set_defaults(func=_goodput)
    h = subparsers.add_parser(
        "report", help="draw LOGDIR's life (sessions, restarts, hangs, rollbacks, saves, "
                       "goodput) as one self-contained HTML file",
        description="Write one self-contained HTML page (no network: styles, script and "
                    "SVG drawings inline) showing the run's life on a wall-clock axis: "
                    "each session and how it ended, restarts and downtime, rollbacks, "
                    "saves, the step and goodput over time, badput by cause.")
    h.add_argument("logdir")
    h.add_argument("-o", "--output", default=None,
                   help="the HTML file to write (default LOGDIR/report.html; for a URL "
                        "logdir, report.html here)")
    h.set_defaults(func=_report)


@hookimpl
def run_restarted(logdir: str, kind: str, exit_code: int | None, signal: int | None,
                  step: int | None) -> None:
    from loopkit.plugins.goodput.records import record_restart

    record_restart(logdir, kind, exit_code, signal, step)


def _goodput(args: argparse.Namespace) -> int:
    from loopkit.plugins.goodput import format_report
    from loopkit.plugins.goodput.output import format_sessions, report_json, session_rows
    from loopkit.plugins.goodput.report import read_sessions, summarise_sessions

    logging.basicConfig(format="%(name)s: %(message)s")  # the skipped lines' warnings
    try:
        sessions = read_sessions(args.logdir)
    except (ValueError, ImportError, OSError) as e:  # a bad path or URL
        print(f"loopkit goodput: {e}", file=sys.stderr)
        return 1
    if not sessions:
        print(f"no goodput ledger (goodput.jsonl) with a session in {args.logdir}",
              file=sys.stderr)
        return 1
    report = summarise_sessions(sessions)
    if args.sessions:
        rows = session_rows(sessions)
        print(json.dumps(rows, indent=1) if args.json else format_sessions(rows))
    else:
        print(json.dumps(report_json(report), indent=1) if args.json
              else format_report(report))
    return 0


def _report(args: argparse.Namespace) -> int:
    from loopkit.plugins.goodput.report_html import write_report

    try:
        path = write_report(args.logdir, args.output)
    except (ValueError, ImportError, OSError) as e:  # a bad path or URL, no ledger
        print(f"loopkit report: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
