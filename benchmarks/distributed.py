"""Per-step overhead and save time of loopkit with 1, 2 and 4 jax.distributed processes.

    python benchmarks/distributed.py [--steps 1000] [--repeats 3] [--mb 4]

One script run starts the three jobs on localhost (CPU, gloo), one after another.
In each job every process runs, in turns:

- bare: a plain loop calling the jitted, donating step (a 4 KB replicated state) on
  global batches placed beforehand, for `--steps` steps;
- loopkit: `loopkit.train` on the same step and batches (the loop, the agreement
  rounds with their read-ahead; no logdir);
- save: a `Supervisor.managed_session` whose `with` block ends with the final
  checkpoint of a replicated global state of `--mb` MB (orbax; the time of leaving
  the block: the save, its commit and the `checkpoint` file).

Per-step overhead is the median over turns of (loopkit - bare) / steps; the ratios
compare each job with the 1-process job. On a machine with fewer cores than
processes, the 4-process figures measure contention as much as loopkit.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def worker(args: argparse.Namespace) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.n > 1:
        jax.distributed.initialize(f"127.0.0.1:{args.port}", args.n, args.rank,
                                   initialization_timeout=60)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import loopkit

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    size = args.mb * 2**20 // 4

    def init(n: int = 1024):  # a small state: the per-step figures show loopkit's own cost
        return {"w": jax.device_put(jnp.zeros(n, jnp.float32), replicated)}

    def step(state, x):
        return {"w": state["w"] + jnp.mean(x)}, {"x": jnp.mean(x)}

    donating = jax.jit(step, donate_argnums=0)  # what loopkit's jit does
    local = [np.full((8 // args.n, 8), i, np.float32) for i in range(args.steps)]
    # global batches placed ahead: both loops then pay only the loop itself
    batches = [jax.make_array_from_process_local_data(rows, b) for b in local]

    def bare() -> float:
        state = init()
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for b in batches:
            state, _ = donating(state, b)
        jax.block_until_ready(state)
        return time.perf_counter() - t0

    def looped() -> float:
        t0 = time.perf_counter()
        r = loopkit.train(step, init=init, data=batches, progress=False, max_steps=args.steps)
        jax.block_until_ready(r.state)
        return time.perf_counter() - t0

    def save(k: int) -> float:
        sv = loopkit.Supervisor(logdir=os.path.join(args.tmp, f"save{k}"), save_model_secs=0,
                                save_summaries_secs=0, progress=False,
                                disable=("summaries", "step_counter"))
        with sv.managed_session(step, init=lambda: init(size)) as sess:
            sess.run(batches[0])
            jax.block_until_ready(sess.state)
            t0 = time.perf_counter()
        return time.perf_counter() - t0

    bare()  # compile
    looped()
    out = {"bare": [], "loopkit": [], "save": []}
    for k in range(args.repeats):
        out["bare"].append(bare())
        out["loopkit"].append(looped())
        out["save"].append(save(k))
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    if args.n > 1:
        jax.distributed.shutdown()


def run_job(n: int, args: argparse.Namespace) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--worker", "--n", str(n), "--rank", str(i),
             "--port", str(port), "--tmp", tmp, "--steps", str(args.steps),
             "--repeats", str(args.repeats), "--mb", str(args.mb)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
            for i in range(n)]
        outs = [p.communicate(timeout=600)[0] for p in procs]
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tmp", default="")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mb", type=int, default=4)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"{os.cpu_count()} CPUs; {args.steps} steps x {args.repeats} turns; "
          f"saved state {args.mb} MB replicated")
    rows = {}
    for n in (1, 2, 4):
        r = run_job(n, args)
        over = statistics.median((lk - b) / args.steps for lk, b in zip(r["loopkit"], r["bare"]))
        rows[n] = (statistics.median(r["bare"]) / args.steps, over, statistics.median(r["save"]))
    b1, o1, s1 = rows[1]
    print(f"{'processes':>9} {'bare us/step':>13} {'overhead us/step':>17} {'x1':>6} "
          f"{'save ms':>8} {'x1':>6}")
    for n, (b, o, s) in rows.items():
        print(f"{n:>9} {b * 1e6:>13.1f} {o * 1e6:>17.1f} {o / o1 if o1 > 0 else float('nan'):>6.2f} "
              f"{s * 1e3:>8.1f} {s / s1:>6.2f}")


if __name__ == "__main__":
    main()
