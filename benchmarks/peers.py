"""The local save's hold on the loop with and without peer copies, and the copies' cost.

    python benchmarks/peers.py [--mb 32] [--saves 8] [--replicas 0 1]

For each `local_replicas` value, one two-process `jax.distributed` job on localhost
(CPU, gloo) trains a state of `--mb` MB sharded over both processes (each process's
part: half of it), with a local tier saved every 10 steps (the durable tier only at
the stop). Printed per job: the median and max of the local save's hold on the loop
(`CheckpointPlugin.local_blocking_secs`, per save), and with peers the copies each
process made (`Peers.copies`: seconds and bytes per copy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def worker(args: argparse.Namespace) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", 2, args.rank,
                               initialization_timeout=60)
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import loopkit

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    size = args.mb * 2**20 // 4
    holds: list[float] = []

    class Watch:
        last = None

        @loopkit.hookimpl
        def session_create(self, session):
            Watch.plugin = session.plugin_manager.get_plugin("checkpoint")

        @loopkit.hookimpl
        def after_step(self, step):
            held = Watch.plugin.local_blocking_secs
            if held is not None and held != Watch.last:
                holds.append(held)
                Watch.last = held
            time.sleep(0.02)

    def init():
        return {"w": jax.device_put(jnp.zeros(size, jnp.float32), NamedSharding(mesh, P("data")))}

    root = args.dir
    loopkit.train(lambda s, x: ({"w": s["w"] + x}, {}), init=init,
                  data=iter(lambda: 1.0, None), logdir=f"{root}/run",
                  local_checkpoint_dir=f"{root}/local", save_local_steps=10,
                  save_local_secs=None, save_model_secs=None, local_replicas=args.replicas,
                  max_steps=10 * args.saves + 1, plugins=[Watch()], progress=False)
    peers = Watch.plugin.local.peers
    copies = [] if peers is None else [[s, secs, size] for s, secs, size in peers.copies]
    print("RESULT " + json.dumps({"holds": holds, "copies": copies}), flush=True)
    jax.distributed.shutdown()


def job(args: argparse.Namespace, replicas: int) -> list[dict]:
    from loopkit.testing import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as root:
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--rank", str(r),
                                   "--port", str(port), "--mb", str(args.mb), "--saves",
                                   str(args.saves), "--replicas-one", str(replicas),
                                   "--dir", root], stdout=subprocess.PIPE, text=True,
                                  env=dict(os.environ, JAX_PLATFORMS="cpu"))
                 for r in range(2)]
        outs = [p.communicate(timeout=600)[0] for p in procs]
    return [json.loads(next(line for line in out.splitlines()
                            if line.startswith("RESULT "))[7:]) for out in outs]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=32)
    p.add_argument("--saves", type=int, default=8)
    p.add_argument("--replicas", type=int, nargs="*", default=[0, 1])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--rank", type=int)
    p.add_argument("--port", type=int)
    p.add_argument("--replicas-one", type=int, dest="replicas_one")
    p.add_argument("--dir")
    args = p.parse_args()
    if args.worker:
        args.replicas = args.replicas_one
        return worker(args)
    print(f"state {args.mb} MB sharded over 2 processes; {args.saves} local saves; "
          f"load {os.getloadavg()[0]:.1f}")
    for k in args.replicas:
        results = job(args, k)
        holds = [h * 1e3 for r in results for h in r["holds"][1:]]  # the first compiles
        line = (f"local_replicas={k}: hold median {statistics.median(holds):.1f} ms, "
                f"max {max(holds):.1f} ms ({len(holds)} saves)")
        copies = [c for r in results for c in r["copies"]]
        if copies:
            line += (f"; copies: {len(copies)}, median {statistics.median(c[1] for c in copies) * 1e3:.0f} ms, "
                     f"{statistics.median(c[2] for c in copies) / 2**20:.1f} MB each, "
                     f"{statistics.median(c[2] / c[1] for c in copies) / 2**20:.0f} MB/s")
        print(line, flush=True)


if __name__ == "__main__":
    main()
