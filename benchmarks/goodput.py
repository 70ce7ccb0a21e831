"""Goodput under SIGKILLs: a realistic step under `loopkit run`, with a chaos loop.

    python benchmarks/goodput.py [--minutes 3] [--kill-every 60] [--fixed-secs 30]
                                 [--local-secs 10] [--width 2048] [--batch 64]
                                 [--only clean,fixed,auto,local,bucket,
                                         auto-local,auto-wiped]

Variants, each ``--minutes`` long, in fresh log directories:

1. uninterrupted, ``save_model_secs=--fixed-secs``;
2. chaos, the same fixed interval: the trainer is SIGKILLed at random moments
   (uniform in [0.5, 1.5] x ``--kill-every`` seconds apart) and `loopkit run`
   restarts it;
3. chaos, ``save_model_secs="auto"``;
4. chaos, the fixed interval and a local tier (``local_checkpoint_dir`` on the
   temp dir's disk, ``save_local_secs=--local-secs``);
5. chaos, the fixed interval, the logdir on a bucket (``s3://``, moto's S3 server
   on 127.0.0.1, started here as the tests start it): each restart takes over its
   own dead lease at once (`loopkit run` gives its children a ``LOOPKIT_RUN_ID``);
6. chaos, ``save_model_secs="auto"`` and the local tier (a process death: the local
   tier's job, so "auto" keeps the durable interval long);
7. the same, each kill also wiping the killed process's local directory (a replaced
   machine: every restart restores from the durable tier, and "auto" follows them).

One process each (the script starts no ``jax.distributed`` job: peer copies,
``local_replicas``, under the same chaos with wiped machines are measured by
benchmarks/goodput_peers.py, a two-process job). For the "auto" variants the intervals
the run picked (its log) are reported with the ledger's process deaths and lost
machines.

Each ends with SIGTERM to the runner (a clean stop, the final checkpoint). The
goodput fraction and the badput table come from the run's ledger
(`loopkit.goodput`). Then the time from a restarted process's start to its
first step (the last session's ledger start record) against the sum of what it
cannot avoid, measured in fresh processes: importing jax, reading the
checkpoint's bytes raw, and compiling the step from the persistent cache.

The step: an MLP of three ``--width`` x ``--width`` layers with momentum (state
= weights + momentum, float32), a batch of ``--batch``; orbax checkpoints on
local disk.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = Path(__file__).resolve()


def make(width: int, batch: int):
    """(init, step, data) of the benchmark's MLP."""
    import jax
    import jax.numpy as jnp

    def init():
        keys = jax.random.split(jax.random.key(0), 3)
        w = {f"w{i}": jax.random.normal(k, (width, width)) / width ** 0.5
             for i, k in enumerate(keys)}
        return {"w": w, "m": jax.tree.map(jnp.zeros_like, w)}

    def step(s, x):
        def loss(w):
            h = x
            for i in range(3):
                h = jnp.tanh(h @ w[f"w{i}"])
            return jnp.mean((h - 0.5) ** 2)

        value, g = jax.value_and_grad(loss)(s["w"])
        m = jax.tree.map(lambda m, g: 0.9 * m + g, s["m"], g)
        w = jax.tree.map(lambda w, m: w - 0.01 * m, s["w"], m)
        return {"w": w, "m": m}, {"loss": value}

    import numpy as np

    pool = np.random.default_rng(0).standard_normal((16, batch, width), np.float32)

    def data(start):  # a batch depends on its index only: a resumed run sees the same
        for i in range(start, 10**9):
            yield pool[i % len(pool)]

    return init, step, data


def child(logdir: str, save: str, width: int, batch: int, local: str) -> None:
    import logging

    import loopkit

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    init, step, data = make(width, batch)
    secs = save if save == "auto" else float(save)
    tier = {} if local == "-" else dict(local_checkpoint_dir=local.split(":")[0],
                                        save_local_secs=float(local.split(":")[1]))
    loopkit.train(step, init=init, data=data, logdir=logdir, save_model_secs=secs,
                  save_summaries_secs=10, progress=False, max_to_keep=2, **tier)


def _trainer_pid(runner: subprocess.Popen) -> int | None:
    """The runner's child now (at any moment of its life: start-up, compile, training)."""
    try:
        with open(f"/proc/{runner.pid}/task/{runner.pid}/children") as f:
            pids = f.read().split()
    except OSError:
        return None
    return int(pids[0]) if pids else None


def variant(name: str, logdir: Path | str, save: str, args: argparse.Namespace,
            chaos: bool, local: bool = False, base: Path | None = None,
            wipe: bool = False) -> dict:
    base = base or Path(logdir).parent
    local_dir = base / (name + "-local")
    tier = f"{local_dir}:{args.local_secs}" if local else "-"
    cmd = [sys.executable, "-m", "loopkit", "run", "--backoff-secs", "1",
           "--max-restarts", "1000", "--", sys.executable, str(HERE), "--child", str(logdir),
           save, str(args.width), str(args.batch), tier]
    log = open(base / f"{name}.log", "w")
    runner = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    rng = random.Random(args.seed)
    end = time.monotonic() + 60 * args.minutes
    kills = 0
    next_kill = time.monotonic() + rng.uniform(0.5, 1.5) * args.kill_every
    while time.monotonic() < end:
        time.sleep(0.5)
        if chaos and time.monotonic() >= next_kill:
            pid = _trainer_pid(runner)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                    kills += 1
                except ProcessLookupError:
                    pass
                else:
                    if wipe:  # a replaced machine: its local disk goes with it
                        _wipe_after(pid, local_dir)
            next_kill = time.monotonic() + rng.uniform(0.5, 1.5) * args.kill_every
    runner.send_signal(signal.SIGTERM)
    runner.wait(timeout=300)
    log.close()
    import loopkit

    from loopkit.plugins.goodput.records import Start, read_records

    report = loopkit.goodput(logdir)
    starts = [r for r in read_records(logdir) if isinstance(r, Start)][1:]  # restarts
    firsts = sorted(r.time - r.process_start for r in starts)  # start to first step
    text = (base / f"{name}.log").read_text(errors="replace")
    picked = [float(x) for x in re.findall(r'save_model_secs="auto": saving every (\d+) s',
                                           text)]
    return {"name": name, "kills": kills, "report": report, "picked": picked,
            "to_first_step": firsts[len(firsts) // 2] if firsts else None}


def _wipe_after(pid: int, local_dir: Path) -> None:
    """Remove `local_dir` once the killed `pid` is gone (before the runner's backoff
    ends and the next trainer starts)."""
    deadline = time.monotonic() + 0.8
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break  # a zombie: dead, not yet reaped
        except OSError:
            break
        time.sleep(0.01)
    shutil.rmtree(local_dir, ignore_errors=True)


def restart_costs(logdir: Path, args: argparse.Namespace) -> dict:
    """A restarted process's start to its first step, against its unavoidable parts."""
    from loopkit.plugins.goodput.records import Start, read_records

    start = [r for r in read_records(logdir) if isinstance(r, Start)][-1]
    to_first = start.time - start.process_start
    code_import = "import time; t = time.time(); import jax, jax.numpy; print(time.time() - t)"
    imp = float(subprocess.check_output([sys.executable, "-c", code_import], text=True))
    import loopkit

    step_, path = loopkit.latest_checkpoint(logdir)
    t = time.perf_counter()
    n = 0
    for root, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                n += len(fh.read())
    raw = time.perf_counter() - t
    code_compile = (
        "import sys, time, jax; sys.path.insert(0, %r); import goodput as g\n"
        "jax.config.update('jax_compilation_cache_dir', %r)\n"
        "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)\n"
        "init, step, data = g.make(%d, %d)\n"
        "s = jax.eval_shape(init); x = jax.ShapeDtypeStruct((%d, %d), 'float32')\n"
        "t = time.time(); jax.jit(step, donate_argnums=0).lower(s, x).compile(); "
        "print(time.time() - t)"
    ) % (str(HERE.parent), str(logdir / ".jax_cache"), args.width, args.batch,
         args.batch, args.width)
    comp = float(subprocess.check_output([sys.executable, "-c", code_compile], text=True)
                 .split()[-1])
    return {"to_first_step": to_first, "startup": to_first - start.restore_secs
            - (start.first_step_secs or 0), "restore": start.restore_secs,
            "first_step": start.first_step_secs, "import_jax": imp, "raw_read": raw,
            "raw_bytes": n, "cached_compile": comp}


def badput_table(rows: list[dict]) -> None:
    """The goodput and badput (% of wall) of each row's ``report``, as markdown rows
    (benchmarks/goodput_peers.py prints the same)."""
    from loopkit.plugins.goodput.report import CAUSES

    print("\n| cause (% of wall) | " + " | ".join(r["name"] for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    print("| **goodput** | " + " | ".join(f"**{100 * r['report'].fraction:.1f}**"
                                         for r in rows) + " |")
    for cause in CAUSES:
        vals = []
        for r in rows:
            v = r["report"].badput[cause]
            v = sum(v.values()) if isinstance(v, dict) else v
            vals.append(f"{100 * v / r['report'].wall_secs:.1f}")
        print(f"| {cause} | " + " | ".join(vals) + " |")


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    v = sorted(values)
    return f"{v[len(v) // 2]:.0f} ({v[0]:.0f}-{v[-1]:.0f})"


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        logdir, save, width, batch, local = sys.argv[2:7]
        child(logdir, save, int(width), int(batch), local)
        return
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--kill-every", type=float, default=60.0)
    p.add_argument("--fixed-secs", type=float, default=30.0)
    p.add_argument("--local-secs", type=float, default=10.0)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="clean,fixed,auto,local,bucket")  # and auto-local,
    # auto-wiped: "auto" beside a local tier, with kills that keep or wipe it
    args = p.parse_args()
    mib = 2 * 3 * args.width ** 2 * 4 / 2 ** 20
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; state "
          f"{mib:.0f} MiB; {args.minutes} min per variant; a SIGKILL every "
          f"~{args.kill_every:.0f} s", flush=True)
    base = Path(tempfile.mkdtemp(prefix="loopkit-goodput-"))
    rows = []
    plan = {"clean": (str(args.fixed_secs), False, False),
            "fixed": (str(args.fixed_secs), True, False),
            "auto": ("auto", True, False), "local": (str(args.fixed_secs), True, True),
            "bucket": (str(args.fixed_secs), True, False),
            "auto-local": ("auto", True, True), "auto-wiped": ("auto", True, True)}
    for name in args.only.split(","):
        save, chaos, local = plan[name]
        if name == "bucket":
            sys.path.insert(0, str(HERE.parent))
            from storage import start_s3  # moto's server, its environment in os.environ

            _, bucket, _stop = start_s3()
            row = variant(name, f"s3://{bucket}/{name}", save, args, chaos, local, base)
        else:
            row = variant(name, base / name, save, args, chaos, local,
                          wipe=name == "auto-wiped")
        rows.append(row)
        r = row["report"]
        print(f"{name}: kills {row['kills']}, sessions {r.sessions}, goodput "
              f"{100 * r.fraction:.1f}%, save cost {r.save_cost_secs}, suggested "
              f"{r.suggested_save_secs:.1f} s; process deaths {r.process_deaths}, lost "
              f"machines {r.lost_machines}; durable intervals picked {row['picked']}",
              flush=True)
    badput_table(rows)
    print("| SIGKILLs / sessions | " + " | ".join(
        f"{r['kills']} / {r['report'].sessions}" for r in rows) + " |")
    print("| restart to first step, s (median) | " + " | ".join(
        "-" if r["to_first_step"] is None else f"{r['to_first_step']:.2f}"
        for r in rows) + " |")
    print("| process deaths / lost machines | " + " | ".join(
        f"{r['report'].process_deaths} / {r['report'].lost_machines}" for r in rows) + " |")
    print("| \"auto\" durable interval, s (median picked; min-max) | " + " | ".join(
        _spread(r["picked"]) for r in rows) + " |")
    print("| save cost, s | " + " | ".join(
        "-" if r["report"].save_cost_secs is None else f"{r['report'].save_cost_secs:.2f}"
        for r in rows) + " |")
    on_disk = [r["name"] for r in rows if r["name"] != "bucket"]
    if not on_disk:
        return
    costs = restart_costs(base / on_disk[-1], args)
    print("\nrestart: " + json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                      for k, v in costs.items()}))
    print(f"logdirs under {base}")


if __name__ == "__main__":
    main()
