"""A SIGTERM while the CPU save variant compiles: time to `train` returning and to the exit.

    python benchmarks/stop.py [--repeats 5] [--layers 500] [--width 16]

Each run is a fresh process training a deep MLP step (`--layers` matrices of
`--width`², one gradient step each call) with a save every 2 steps. The first save
(step 2) lowers the step's save variant and compiles it in a background thread; the
child sends itself SIGTERM after step 3 while that compile is still under way, so the
stop makes the final save (step 3), `train` returns, and the script ends normally.
Reported per run: whether the compile was still running at the signal, the time from
the signal to `train` returning (the final save included) and to the process's exit
(seen by the parent), and the exit status. The child runs with the environment `loopkit
run` gives its children (its status file), where loopkit ends the process without
waiting for the compile; ``--by-itself``: a script run by itself, whose exit (Python's
own) waits for it.
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

NAME = "loopkit-compile-save-variant"


def child(logdir: str, layers: int, width: int) -> None:
    import signal
    import threading

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    import loopkit

    def init():
        return {"w": [jnp.full((width, width), 0.01) for _ in range(layers)],
                "n": jnp.int32(0)}

    def step(s):
        def loss(ws):
            h = jnp.ones((4, width))
            for w in ws:
                h = jnp.tanh(h @ w) + h
            return jnp.mean(h ** 2)

        grads = jax.grad(loss)(s["w"])
        return {"w": [w - 1e-4 * g for w, g in zip(s["w"], grads)], "n": s["n"] + 1}, {}

    marks: dict = {}

    class Stop:
        @loopkit.hookimpl
        def after_step(self, step):
            if step == 3:  # the first save (step 2) started the variant's compile
                marks["compiling"] = any(t.name == NAME for t in threading.enumerate())
                marks["signal"] = time.time()
                os.kill(os.getpid(), signal.SIGTERM)

    r = loopkit.train(step, init=init, logdir=logdir, save_model_steps=2,
                      save_model_secs=None, max_steps=10**6, progress=False,
                      disable=("summaries",), plugins=[Stop()])
    marks.update(returned=time.time(), step=r.step, reason=r.stop_reason,
                 latest=loopkit.latest_checkpoint(logdir)[0])
    print("MARKS " + json.dumps(marks), flush=True)


def run_once(layers: int, width: int, by_itself: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        env.pop("LOOPKIT_RUN_STATUS", None)
        if not by_itself:  # what `loopkit run` sets for its child
            env["LOOPKIT_RUN_STATUS"] = os.path.join(tmp, "status.json")
        proc = subprocess.run(
            [sys.executable, __file__, "--child", os.path.join(tmp, "run"),
             "--layers", str(layers), "--width", str(width)],
            capture_output=True, text=True, timeout=600, check=False, env=env)
        ended = time.time()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MARKS ")]
    if not lines:
        raise RuntimeError(f"child failed (status {proc.returncode}):\n{proc.stderr[-3000:]}")
    marks = json.loads(lines[-1][6:])
    return {"status": proc.returncode, "compiling": marks["compiling"],
            "returned": marks["returned"] - marks["signal"], "exit": ended - marks["signal"],
            "final": (marks["step"], marks["latest"], marks["reason"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=500)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--by-itself", action="store_true",
                        help="run the child as a script by itself, not as a loopkit run child")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.layers, args.width)
        return
    print(f"load average {os.getloadavg()[0]:.1f}; {args.layers} layers of "
          f"{args.width}x{args.width}")
    runs = []
    for i in range(args.repeats):
        r = run_once(args.layers, args.width, args.by_itself)
        runs.append(r)
        print(f"run {i + 1}: status {r['status']}, compiling at the signal: {r['compiling']}, "
              f"signal -> train returned {r['returned']:.2f} s, -> exit {r['exit']:.2f} s "
              f"(step, latest checkpoint, reason: {r['final']})", flush=True)
    print(f"median: signal -> train returned {statistics.median(r['returned'] for r in runs):.2f}"
          f" s, -> exit {statistics.median(r['exit'] for r in runs):.2f} s; load average "
          f"{os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
