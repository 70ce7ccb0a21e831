"""The cost of `nan_guard` per step, with and without `spike_threshold`, and of a rollback.

    python benchmarks/guard.py [--repeats 5] [--quick]

Per-step cost: the slope between a short and a long run (see loop_overhead.py), the
guard off against the guard on, in turns, on the trivial-with-metrics and MLP
workloads of loop_overhead.py. A rollback: the time from the guard's call of the
`rollback_state` hook (a save in flight waited for, the checkpoint read and placed)
to `on_rollback`, against a restart of the process: from its spawn to its first step
after restoring the same checkpoint (import, restore, compile).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.dirname(__file__))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import loopkit  # noqa: E402
from loop_overhead import (  # noqa: E402
    mlp_batches, mlp_init, mlp_step, paired_slopes, trivial_metrics_step, with_loopkit,
)


def poisoned(batches, at):
    """A callable source over `batches` (cycled) whose batch `at` has NaN inputs."""
    def data(start):
        i = start
        while True:
            x, y = batches[i % len(batches)]
            yield (np.full_like(x, np.nan) if i == at else x), y
            i += 1
    return data


def time_rollback(logdir, n_batches=200):
    marks = {}

    class Watch:
        @loopkit.hookimpl(tryfirst=True)
        def rollback_state(self):
            marks["start"] = time.perf_counter()

        @loopkit.hookimpl
        def on_rollback(self):
            marks["end"] = time.perf_counter()

    loopkit.train(mlp_step, init=mlp_init, data=poisoned(mlp_batches(n_batches), 150),
                  max_steps=200, logdir=logdir, save_model_steps=100, save_model_secs=None,
                  nan_guard="loss", on_guard="rollback", progress=False, plugins=[Watch()])
    return marks["end"] - marks["start"]


RESTART = textwrap.dedent("""
    import sys, time
    t0 = float(sys.argv[2])
    sys.path.insert(0, {here!r})
    import loopkit
    from loop_overhead import mlp_batches, mlp_init, mlp_step

    class First:
        @loopkit.hookimpl
        def after_step(self, session, step):
            print("FIRST", time.time() - t0, flush=True)
            session.request_stop()

    loopkit.train(mlp_step, init=mlp_init, data=lambda s: iter(mlp_batches(10)),
                  logdir=sys.argv[1], save_model_secs=None, progress=False, plugins=[First()])
""")


def time_restart(logdir):
    script = os.path.join(logdir, "restart.py")
    with open(script, "w") as f:
        f.write(RESTART.format(here=os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, script, logdir, repr(time.time())],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return float(out.stdout.split("FIRST")[1].split()[0])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    scale = 10 if args.quick else 1
    tmp = tempfile.mkdtemp(prefix="loopkit-guard-")
    counter = iter(range(10**9))

    def logdir():
        return os.path.join(tmp, f"run{next(counter)}")

    workloads = [
        ("trivial + 2 metrics", trivial_metrics_step, jnp.zeros(()), None,
         2_000 // scale, 20_000 // scale),
        ("MLP 64-256-10, batch 128", mlp_step, mlp_init(), mlp_batches(2_000 // scale),
         200 // scale, 2_000 // scale),
    ]
    guards = [("nan_guard", dict(nan_guard="loss")),
              ("nan_guard + spike_threshold", dict(nan_guard="loss", spike_threshold=10.0))]
    print(f"{'workload':26} {'guard':28} {'off µs/step':>12} {'on µs/step':>11} "
          f"{'added µs':>9}")
    for name, fn, init, batches, n_short, n_long in workloads:
        for label, fields in guards:
            off, on, _ = paired_slopes(
                lambda n: with_loopkit(fn, init, batches, n, logdir()),
                lambda n: with_loopkit(fn, init, batches, n, logdir(), **fields),
                n_short, n_long, args.repeats)
            print(f"{name:26} {label:28} {off * 1e6:12.2f} {on * 1e6:11.2f} "
                  f"{(on - off) * 1e6:9.2f}", flush=True)
    rolls, restarts = [], []
    for _ in range(3):
        d = logdir()
        rolls.append(time_rollback(d))
        restarts.append(time_restart(d))
    print(f"one rollback (MLP, orbax, restore of step 100): median "
          f"{sorted(rolls)[1] * 1e3:.0f} ms; a process restart to its first step: median "
          f"{sorted(restarts)[1] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
