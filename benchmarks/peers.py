"""Peer copies of the local tier: the save's hold with and without them, the copies' cost,
and a restore from peers against one from the durable tier on the local S3 server.

    python benchmarks/peers.py [--mb 32] [--saves 6] [--processes 2 4] [--turns 2]
        [--repeats 3]

Real `jax.distributed` jobs on localhost (CPU, gloo, one device per process), a state of
`--mb` MB sharded over every process (each process's part: 1/n of it). Per process count:

- **hold**: `--turns` pairs of jobs, `local_replicas` 1 then 0, each training with a
  local save every 10 steps (20 ms of sleep per step; the durable tier, a local
  directory, only at the stop): the local save's hold on the loop
  (`CheckpointPlugin.local_blocking_secs`, per save, the first left out: it compiles),
  and with peers each copy a process made (`Peers.copies`: seconds, bytes).
- **restore**: one job saves both tiers at the same step (the durable one on moto's S3
  server, started here on 127.0.0.1, as benchmarks/storage.py does; the local one with
  `local_replicas=1`); then, in turns, `--repeats` restarts with process 1's local
  directory wiped (a replaced machine: its part comes from its successor, `"peer"`)
  and as many with every local directory wiped (every part from S3, `"durable"`). The
  time is the restore's (the `restore_state` hook, the slowest process's), the same
  state and step each time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(args: argparse.Namespace) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", args.n, args.rank,
                               initialization_timeout=120)
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import loopkit
    from loopkit.plugins.checkpoint import RESTORED_TIER

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    size = args.mb * 2**20 // 4 // args.n * args.n
    holds: list[float] = []
    seen: dict = {}

    class Watch:
        last = None

        @loopkit.hookimpl(wrapper=True)
        def restore_state(self, session):
            t0 = time.perf_counter()
            try:
                return (yield)
            finally:
                seen["restore"] = time.perf_counter() - t0

        @loopkit.hookimpl
        def session_create(self, session):
            Watch.plugin = session.plugin_manager.get_plugin("checkpoint")
            seen["step"], seen["tier"] = session.step, session.stash.get(RESTORED_TIER)

        @loopkit.hookimpl
        def after_step(self, step):
            held = Watch.plugin.local_blocking_secs
            if held is not None and held != Watch.last:
                holds.append(held)
                Watch.last = held
            time.sleep(0.02)
            if step == args.kill_at:
                killed(Watch.plugin)

    def init():
        return {"w": jax.device_put(jnp.zeros(size, jnp.float32), NamedSharding(mesh, P("data")))}

    steps = 10 * args.saves
    loopkit.train(lambda s, x: ({"w": s["w"] + x}, {}), init=init,
                  data=lambda start: iter(lambda: 1.0, None), logdir=args.logdir,
                  local_checkpoint_dir=args.local, save_local_steps=10, save_local_secs=None,
                  save_model_secs=None, save_model_steps=steps, local_replicas=args.replicas,
                  max_steps=args.max_steps,
                  plugins=[Watch()], progress=False)
    peers = Watch.plugin.local.peers
    copies = [] if peers is None else [[s, secs, size] for s, secs, size in peers.copies]
    seen["received"] = None if peers is None else peers.received
    print("RESULT " + json.dumps({"holds": holds, "copies": copies, **seen}), flush=True)
    jax.distributed.shutdown()


def killed(plugin) -> None:
    """SIGKILL this process once the saves and the peer copies in flight are done on every
    process: both tiers then hold the last step (a normal stop would save the durable
    tier once more, at the stop, and the local tier not)."""
    import threading

    from jax._src import distributed

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(
            t.name.startswith("loopkit-checkpoint") and "-commit-" in t.name
            for t in threading.enumerate()):
        time.sleep(0.01)
    plugin.local.peers.wait(120)
    distributed.global_state.client.wait_at_barrier("saved", 120_000)
    os.kill(os.getpid(), signal.SIGKILL)


def job(args: argparse.Namespace, n: int, logdir: str, local: Path, replicas: int,
        env: dict | None = None, kill_at: int | None = None,
        max_steps: int | None = None) -> list[dict]:
    """One job of `n` processes; each process's RESULT (none when `kill_at`). A job
    trains to `max_steps` (default: one step after the last save, which it sees)."""
    max_steps = 10 * args.saves + 1 if max_steps is None else max_steps
    from loopkit.testing import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--rank", str(r), "--n",
                               str(n), "--port", str(port), "--mb", str(args.mb), "--saves",
                               str(args.saves), "--replicas-one", str(replicas), "--logdir",
                               logdir, "--local", str(local), "--max-steps", str(max_steps),
                               *(() if kill_at is None else ("--kill-at", str(kill_at)))],
                              stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})))
             for r in range(n)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == (0 if kill_at is None else -signal.SIGKILL)
               for p in procs), outs
    if kill_at is not None:
        return []
    return [json.loads(next(line for line in out.splitlines()
                            if line.startswith("RESULT "))[7:]) for out in outs]


def holds(args: argparse.Namespace, n: int, root: Path) -> None:
    for turn in range(args.turns):
        for k in (1, 0):
            where = root / f"hold-{n}-{turn}-{k}"
            results = job(args, n, str(where / "run"), where / "local", k)
            held = [h * 1e3 for r in results for h in r["holds"][1:]]  # the first compiles
            line = (f"{n} processes, local_replicas={k}: hold median "
                    f"{statistics.median(held):.1f} ms, max {max(held):.1f} ms "
                    f"({len(held)} saves)")
            copies = [c for r in results for c in r["copies"]]
            if copies:
                line += (f"; copies: {len(copies)}, median "
                         f"{statistics.median(c[1] for c in copies) * 1e3:.0f} ms, "
                         f"{statistics.median(c[2] for c in copies) / 2**20:.1f} MB each, "
                         f"{statistics.median(c[2] / c[1] for c in copies) / 2**20:.0f} MB/s")
            print(line, flush=True)
            shutil.rmtree(where, ignore_errors=True)


def restores(args: argparse.Namespace, n: int, root: Path, env: dict, bucket: str) -> None:
    url, saved = f"s3://{bucket}/restore-{n}", root / f"saved-{n}"
    step = 10 * args.saves
    job(args, n, url, saved, 1, env, kill_at=step + 2, max_steps=step + 5)  # both tiers
    # hold `step`, copied
    assert all((saved / f"process-{(i + 1) % n}" / f"peer-{i}" / f"model.ckpt-{step}").is_dir()
               for i in range(n)), "a copy of the last local step is missing"
    times: dict[str, list[float]] = {"peer": [], "durable": []}
    fetched: list[tuple[float, int]] = []  # (seconds, bytes) of the part received
    for _ in range(args.repeats):
        for tier in ("peer", "durable"):
            local = root / f"local-{n}"
            shutil.rmtree(local, ignore_errors=True)
            shutil.copytree(saved, local)
            for i in ((1,) if tier == "peer" else range(n)):  # replaced machines
                shutil.rmtree(local / f"process-{i}")
            results = job(args, n, url, local, 1, env, max_steps=step)  # restores, stops
            got = {(r["step"], r["tier"]) for r in results}
            assert got == {(step, tier)}, got
            times[tier].append(max(r["restore"] for r in results))
            if tier == "peer":
                fetched.append(max(r["received"] for r in results if r["received"]))
    for tier, secs in times.items():
        print(f"{n} processes, restore from {tier}: median {statistics.median(secs):.2f} s "
              f"({', '.join(f'{s:.2f}' for s in secs)})", flush=True)
    print(f"{n} processes, of which receiving the part: median "
          f"{statistics.median(s for s, _ in fetched):.2f} s for "
          f"{fetched[0][1] / 2**20:.1f} MB", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=32)
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--processes", type=int, nargs="*", default=[2, 4])
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-holds", action="store_true")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--rank", type=int)
    p.add_argument("--n", type=int)
    p.add_argument("--port", type=int)
    p.add_argument("--replicas-one", type=int, dest="replicas")
    p.add_argument("--logdir")
    p.add_argument("--local")
    p.add_argument("--kill-at", type=int)
    p.add_argument("--max-steps", type=int)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    sys.path.insert(0, str(Path(__file__).parent))
    from storage import start_s3

    env, bucket, stop = start_s3()
    print(f"state {args.mb} MB sharded over the processes; {args.saves} local saves per "
          f"job; load {os.getloadavg()[0]:.1f}", flush=True)
    try:
        with tempfile.TemporaryDirectory() as root:
            for n in args.processes:
                if not args.skip_holds:
                    holds(args, n, Path(root))
                restores(args, n, Path(root), env, bucket)
                print(f"load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        stop()


if __name__ == "__main__":
    main()
