"""The `loopkit` command: `loopkit plugins`, `loopkit run -- CMD`, and the plugins'
verbs (`loopkit checkpoints LOGDIR`, `loopkit goodput LOGDIR`, `loopkit report LOGDIR`),
which each plugin adds through the `command_line` hook."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Sequence

from loopkit.plugin.manager import make_command_manager

__all__ = ["main"]


def _plugins(args: argparse.Namespace) -> int:
    from loopkit.config import Config
    from loopkit.plugin.manager import make_plugin_manager

    # What a run with a logdir and otherwise default Config uses; a built-in it
    # leaves off says why. (Nothing is written: plugins only start in a session.)
    rows = make_plugin_manager(Config(logdir="LOGDIR")).describe()
    width = max((len(n) for n, _, _ in rows), default=4)
    owidth = max((len(o) for _, o, _ in rows), default=8)
    for name, origin, hooks in rows:
        print(f"{name:<{width}}  {origin:<{owidth}}  {', '.join(hooks) or '-'}")
    return 0


def _run(args: argparse.Namespace) -> int:
    import logging

    from loopkit.process.runner import run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("loopkit run: give the command after --, e.g. loopkit run -- python train.py",
              file=sys.stderr)
        return 2
    restarted = make_command_manager().hook.run_restarted

    def record(logdir: str, kind: str, exit_code: int | None, signal: int | None,
               step: int | None) -> None:
        restarted(logdir=logdir, kind=kind, exit_code=exit_code, signal=signal, step=step)

    return run(command, max_restarts=args.max_restarts, max_preemptions=args.max_preemptions,
               backoff_secs=args.backoff_secs, record=record)


def _count(text: str) -> int:
    """An argparse type: a whole number, 0 or more (a budget)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative: give 0 or more")
    return value


def _secs(text: str) -> float:
    """An argparse type: seconds, 0 or more (NaN refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"{text} seconds: give 0 or more")
    return value


_RUN_HELP = """Run a training command and restart it until it finishes. A crash, a hang (the
watchdog's exit 75) or a death by a signal is a failure, budgeted by
--max-restarts; a clean stop on a signal aimed at the trainer alone is a
preemption, budgeted by --max-preemptions. A child that committed a checkpoint
past the step it started at made progress: the failure count starts again and the
restart comes at once; otherwise the wait doubles from --backoff-secs per failure,
up to 10 minutes. The child runs in a process group of its own: Ctrl-C or SIGTERM
to the runner reaches it once, it stops with a final checkpoint and the runner
exits with its exit code. A child refused the logdir (another run holds it) is not
restarted (exit 1). The children get LOOPKIT_RUN_ID (kept across restarts) and
LOOPKIT_RUN_STATUS (the file where the session tells the runner how far it got)."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loopkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "plugins", help="list the plugins a run would use, and their hooks",
        description="List the plugins a run with a logdir and an otherwise default Config "
                    "would use (built-in, from an entry point, or left off and why), each "
                    "with the hooks it implements. Nothing is started or written.")
    p.set_defaults(func=_plugins)
    r = sub.add_parser("run", help="run a training command, restarting it after a failure "
                                   "or a preemption until it finishes",
                       description=_RUN_HELP)
    r.add_argument("--max-restarts", type=_count, default=3,
                   help="consecutive failures (crash, hang) tolerated (default 3)")
    r.add_argument("--max-preemptions", type=_count, default=100,
                   help="preemptions tolerated (default 100)")
    r.add_argument("--backoff-secs", type=_secs, default=1.0,
                   help="wait before a restart after a failure without progress, doubled "
                        "per consecutive one, at most 10 minutes (default 1)")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...")
    r.set_defaults(func=_run)
    # the plugins' own verbs: `checkpoints`, `goodput`, `report`, and any entry point's
    make_command_manager().hook.command_line(subparsers=sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:
        # the reader left (`loopkit checkpoints LOGDIR | head -1`): end as a shell tool
        # does, quietly with SIGPIPE's status; stdout goes to /dev/null so that the
        # interpreter's flush at exit does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
