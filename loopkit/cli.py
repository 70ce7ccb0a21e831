"""The `loopkit` command: `loopkit plugins`, `loopkit checkpoints LOGDIR`,
`loopkit goodput LOGDIR`, `loopkit report LOGDIR`, `loopkit run -- CMD`."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

__all__ = ["main"]


def _plugins(args: argparse.Namespace) -> int:
    from loopkit.config import Config
    from loopkit.manager import make_plugin_manager

    # What a run with a logdir and otherwise default Config uses; a built-in it
    # leaves off says why. (Nothing is written: plugins only start in a session.)
    rows = make_plugin_manager(Config(logdir="LOGDIR")).describe()
    width = max((len(n) for n, _, _ in rows), default=4)
    owidth = max((len(o) for _, o, _ in rows), default=8)
    for name, origin, hooks in rows:
        print(f"{name:<{width}}  {origin:<{owidth}}  {', '.join(hooks) or '-'}")
    return 0


def _checkpoints(args: argparse.Namespace) -> int:
    import json

    from loopkit.plugins.checkpoint import describe_checkpoints
    from loopkit.plugins.checkpoint.listing import checkpoint_rows, recorded_local_dir, row_json

    if args.local_dir is None:
        args.local_dir = recorded_local_dir(args.logdir)
    try:
        if args.json:
            rows = [row_json(r) for r in checkpoint_rows(args.logdir, local_dir=args.local_dir)]
            print(json.dumps(rows, indent=1))
            return 0
        lines = describe_checkpoints(args.logdir, local_dir=args.local_dir)
    except (FileNotFoundError, ValueError, ImportError) as e:  # a bad path or URL
        print(f"loopkit checkpoints: {e}", file=sys.stderr)
        return 1
    if not lines:
        print(f"no checkpoints in {args.logdir}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


def _run(args: argparse.Namespace) -> int:
    import logging

    from loopkit.runner import run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("loopkit run: give the command after --, e.g. loopkit run -- python train.py",
              file=sys.stderr)
        return 2
    from loopkit.plugins.goodput.records import record_restart

    return run(command, max_restarts=args.max_restarts, max_preemptions=args.max_preemptions,
               backoff_secs=args.backoff_secs, record=record_restart)


def _goodput(args: argparse.Namespace) -> int:
    import json
    import logging

    from loopkit.plugins.goodput import format_report
    from loopkit.plugins.goodput.listing import format_sessions, report_json, session_rows
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loopkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plugins", help="list the plugins a run would use, and their hooks")
    p.set_defaults(func=_plugins)
    c = sub.add_parser("checkpoints", help="list the checkpoints in LOGDIR")
    c.add_argument("logdir")
    c.add_argument("--local-dir", default=None,
                   help="the run's Config.local_checkpoint_dir: list its checkpoints too, "
                        "as local (default: the one the ledger's last session recorded)")
    c.add_argument("--json", action="store_true",
                   help="print JSON: name, path, step, tier, size, time, listed, restore")
    c.set_defaults(func=_checkpoints)
    g = sub.add_parser("goodput", help="where LOGDIR's wall time went: goodput and badput "
                                       "by cause, from its ledger")
    g.add_argument("logdir")
    g.add_argument("--json", action="store_true",
                   help="print JSON (keys: GoodputReport's attribute names)")
    g.add_argument("--sessions", action="store_true",
                   help="list the sessions: start, end, how each ended, steps, what it restored")
    g.set_defaults(func=_goodput)
    h = sub.add_parser("report", help="draw LOGDIR's life (sessions, restarts, hangs, "
                                      "rollbacks, saves, goodput) as one self-contained "
                                      "HTML file")
    h.add_argument("logdir")
    h.add_argument("-o", "--output", default=None,
                   help="the HTML file to write (default LOGDIR/report.html; for a URL "
                        "logdir, report.html here)")
    h.set_defaults(func=_report)
    r = sub.add_parser("run", help="run a training command, restarting it after a failure "
                                   "or a preemption until it finishes")
    r.add_argument("--max-restarts", type=int, default=3,
                   help="consecutive failures (crash, hang) tolerated (default 3)")
    r.add_argument("--max-preemptions", type=int, default=100,
                   help="preemptions tolerated (default 100)")
    r.add_argument("--backoff-secs", type=float, default=10.0,
                   help="wait before a restart, doubled per consecutive failure (default 10)")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...")
    r.set_defaults(func=_run)
    args = parser.parse_args(argv)
    return args.func(args)
