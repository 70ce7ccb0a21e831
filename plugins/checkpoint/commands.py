"""``loopkit checkpoints LOGDIR``: the checkpoint plugin's verb of the ``loopkit`` command."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from loopkit.plugin.hookspec import hookimpl

__all__ = ["command_line"]


@hookimpl
def command_line(subparsers: Any) -> None:
    c = subparsers.add_parser(
        "checkpoints", help="list the checkpoints in LOGDIR",
        description="List the checkpoints in LOGDIR (a path or a URL) and in the run's "
                    "local tier: their steps, tiers, sizes and times, the newest last, "
                    "marking the one a restart would restore; exit 1 when there are none.")
    c.add_argument("logdir")
    c.add_argument("--local-dir", default=None,
                   help="the run's Config.local_checkpoint_dir: list its checkpoints too, "
                        "as local (default: the one the ledger's last session recorded)")
    c.add_argument("--json", action="store_true",
                   help="print JSON: name, path, step, tier, size, time, listed, restore")
    c.set_defaults(func=_checkpoints)


def _checkpoints(args: argparse.Namespace) -> int:
    from loopkit.plugins.checkpoint import describe_checkpoints
    from loopkit.plugins.checkpoint.helpers.listing import checkpoint_rows, recorded_local_dir, row_json

    try:
        if args.local_dir is None:
            args.local_dir = recorded_local_dir(args.logdir)
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
