"""Goodput under SIGKILLs that replace a machine: a two-process `jax.distributed` job,
with and without peer copies of the local tier.

    python benchmarks/goodput_peers.py [--minutes 3] [--kill-every 60] [--durable-secs 60]
                                       [--local-secs 10] [--width 1024] [--batch 64]
                                       [--only local,peers]

A real two-process job on 127.0.0.1 (CPU, gloo, one device per process): an MLP of
three ``--width`` x ``--width`` layers with momentum, every leaf sharded over both
processes, a batch of ``--batch`` rows split between them (each process reads its own
rows; a batch depends on its index only). Both tiers: the durable one in a local
directory every ``--durable-secs`` (the same in both variants), the local one
(``local_checkpoint_dir``: ``process-<i>`` per process) every ``--local-secs``.

The chaos, ``--minutes`` per variant, in fresh directories: at random moments (uniform
in [0.5, 1.5] x ``--kill-every`` seconds after each start) both processes are SIGKILLed
(a dead process takes the job with it), ONE process's local directory is wiped (a
replaced machine; process 0's at the first kill, then 1's, 0's, ...), and the job is
started again on a new coordinator port. A job that dies by itself (a process lost, the
other then ends) is restarted without a wipe. At the end a SIGTERM to both stops the job cleanly.

Variants:

- ``local``: ``local_replicas=0``: every wipe sends the job back to the durable tier
  (the other process's local part alone is no step);
- ``peers``: ``local_replicas=1``: the wiped process's part comes from its peer's copy.

Reported per variant: the goodput fraction and badput by cause (`loopkit.goodput` on
the logdir), the restores' tiers (the ledger's `Start` records), and the steps lost
per kill (the step reached at the kill, written by process 0 after each step, against
the step the next session opened at). The ledger counts as recompute only the work up
to the killed session's last summary window (every 10 s); the rest of the lost work falls
in its downtime, so the steps lost per kill are the direct measure.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = Path(__file__).resolve()


def worker(a: argparse.Namespace) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{a.port}", 2, a.rank, initialization_timeout=120)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import loopkit
    from loopkit.plugins.checkpoint import RESTORED_TIER

    # auto axes: the matmuls over sharded weights are left to XLA's partitioner
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = NamedSharding(mesh, P("data"))

    from goodput import make  # the one-process benchmark's MLP, its weights placed by rows

    fresh, step, _ = make(a.width, a.batch)

    def init():
        return jax.device_put(fresh(), rows)

    pool = np.random.default_rng(0).standard_normal((16, a.batch, a.width), np.float32)
    mine = slice(a.rank * a.batch // 2, (a.rank + 1) * a.batch // 2)

    def data(start):
        for i in range(start, 10**9):
            yield pool[i % len(pool)][mine]

    class Progress:
        """Process 0 says where each session opened and how far it got, for the parent
        (one `pwrite` per step: microseconds beside a step of tens of milliseconds)."""

        fd = None

        @loopkit.hookimpl
        def session_create(self, session):
            print(f"OPENED {session.step} {session.stash.get(RESTORED_TIER)}", flush=True)
            if a.rank == 0:
                Path(a.progress + ".start").write_text(
                    f"{session.step} {session.stash.get(RESTORED_TIER)}")
                Progress.fd = os.open(a.progress + ".step", os.O_WRONLY | os.O_CREAT)

        @loopkit.hookimpl
        def after_step(self, step):
            if Progress.fd is not None:
                os.pwrite(Progress.fd, b"%12d" % step, 0)

    loopkit.train(step, init=init, data=data, data_sharding=rows, logdir=a.logdir,
                  save_model_secs=a.durable_secs, save_local_secs=a.local_secs,
                  local_checkpoint_dir=a.local, local_replicas=a.replicas,
                  save_summaries_secs=10, max_to_keep=2, progress=False,
                  plugins=[Progress()])
    jax.distributed.shutdown()


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def job(a: argparse.Namespace, base: Path, name: str, replicas: int) -> list[subprocess.Popen]:
    from loopkit.testing import free_port

    port, progress = free_port(), base / f"{name}-progress"
    for end in (".start", ".step"):
        Path(str(progress) + end).unlink(missing_ok=True)
    return [subprocess.Popen(
        [sys.executable, str(HERE), "--worker", "--rank", str(r), "--port", str(port),
         "--logdir", str(base / name), "--local", str(base / f"{name}-local"),
         "--replicas", str(replicas), "--progress", str(progress),
         "--durable-secs", str(a.durable_secs), "--local-secs", str(a.local_secs),
         "--width", str(a.width), "--batch", str(a.batch)],
        stdout=open(base / f"{name}-p{r}.log", "a"), stderr=subprocess.STDOUT)
        for r in range(2)]


def variant(a: argparse.Namespace, base: Path, name: str, replicas: int) -> dict:
    """Run the chaos for `a.minutes`; the sessions as (opened at, tier, reached, wiped)."""
    rng = random.Random(a.seed)
    end = time.monotonic() + 60 * a.minutes
    sessions: list[list] = []
    while True:
        procs = job(a, base, name, replicas)
        kill_at = time.monotonic() + rng.uniform(0.5, 1.5) * a.kill_every
        while time.monotonic() < min(kill_at, end) and all(p.poll() is None for p in procs):
            time.sleep(0.2)
        alive = all(p.poll() is None for p in procs)
        progress = base / f"{name}-progress"
        if time.monotonic() >= end and alive:
            break
        for p in procs:  # a kill, or a job that lost a process: both go
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()
        opened = (_read(Path(f"{progress}.start")) or "- -").split()
        reached = _read(Path(f"{progress}.step"))
        kills = sum(s[3] is not None for s in sessions)
        wiped = kills % 2 if alive else None  # process 0, 1, 0, ...: both are replaced
        if wiped is not None:  # a replaced machine: its local disk goes with it
            shutil.rmtree(base / f"{name}-local" / f"process-{wiped}", ignore_errors=True)
        sessions.append([opened[0], opened[1], reached, wiped])
        time.sleep(1.0)  # a restart's back-off, as `loopkit run`'s
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    opened = (_read(Path(f"{progress}.start")) or "- -").split()
    sessions.append([opened[0], opened[1], _read(Path(f"{progress}.step")), None])
    return {"name": name, "sessions": sessions}


def lost_per_kill(sessions: list[list]) -> list[int]:
    """Steps lost at each kill: the step reached, less the step the next session that
    opened (its start file written) opened at."""
    lost = []
    for i, (_, _, reached, wiped) in enumerate(sessions[:-1]):
        nxt = next((s for s in sessions[i + 1:] if s[0] != "-"), None)
        if wiped is not None and reached is not None and nxt is not None:
            lost.append(int(reached) - int(nxt[0]))
    return lost


def report(row: dict, base: Path) -> dict:
    import loopkit
    from loopkit.plugins.goodput.records import Start, read_records

    logdir = base / row["name"]
    r = loopkit.goodput(logdir)
    tiers = collections.Counter(str(s.tier) for s in read_records(logdir)
                                if isinstance(s, Start) and s.step)
    return {**row, "report": r, "tiers": dict(tiers), "lost": lost_per_kill(row["sessions"]),
            "kills": sum(s[3] is not None for s in row["sessions"])}


def table(rows: list[dict]) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from goodput import badput_table  # the same rows as the one-process benchmark

    badput_table(rows)
    print("| kills (a wipe each) / sessions | " + " | ".join(
        f"{r['kills']} / {r['report'].sessions}" for r in rows) + " |")
    print("| restores by tier (ledger) | " + " | ".join(
        ", ".join(f"{k} {v}" for k, v in sorted(r["tiers"].items())) or "-"
        for r in rows) + " |")
    print("| steps lost per kill | " + " | ".join(
        ", ".join(map(str, r["lost"])) or "-" for r in rows) + " |")
    print("| steps trained (last session's end) | " + " | ".join(
        str(r["sessions"][-1][2]) for r in rows) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--kill-every", type=float, default=60.0)
    p.add_argument("--durable-secs", type=float, default=60.0)
    p.add_argument("--local-secs", type=float, default=10.0)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="local,peers")
    p.add_argument("--worker", action="store_true")  # the rest: one process of the job
    for flag in ("--logdir", "--local", "--progress"):
        p.add_argument(flag)
    for flag in ("--rank", "--port", "--replicas"):
        p.add_argument(flag, type=int)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    mib = 2 * 3 * a.width ** 2 * 4 / 2 ** 20
    print(f"# {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; state {mib:.0f} MiB "
          f"over 2 processes; {a.minutes} min per variant; a kill every ~{a.kill_every:.0f} s",
          flush=True)
    base = Path(tempfile.mkdtemp(prefix="loopkit-goodput-peers-"))
    rows = []
    for name in a.only.split(","):
        row = report(variant(a, base, name, {"local": 0, "peers": 1}[name]), base)
        rows.append(row)
        print(f"{name}: goodput {100 * row['report'].fraction:.1f}%, tiers {row['tiers']}, "
              f"lost {row['lost']}, sessions {json.dumps(row['sessions'])}; load "
              f"{os.getloadavg()[0]:.1f}", flush=True)
    table(rows)
    print(f"directories under {base}")


if __name__ == "__main__":
    main()
