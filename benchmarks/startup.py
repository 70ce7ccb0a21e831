"""Time to the first step: loopkit (fresh, resumed, resumed with the compile cache) vs a bare loop.

    python benchmarks/startup.py [--repeats 3] [--layers 8] [--width 512] [--axes explicit]

Each measurement runs in a fresh process under `jax.set_mesh` (one CPU device unless
XLA_FLAGS says otherwise), so nothing is cached in memory between them. It times the
call (`loopkit.train`, or the bare loop's `jax.jit(step)(state, batch)`) to the first
step's metrics being ready: tracing and compiling the step, and for loopkit also its
checks, the restore and the services' start; and of that, the time spent tracing,
lowering and compiling in the main thread (jax's `/jax/core/compile/` duration events;
a compile ahead in a background thread, such as the CPU save variant's, is not the
loop's wait). Cases:

- bare: the hand-written loop: `init()`, then the jitted step (the reference);
- fresh: loopkit on an empty logdir, `compilation_cache=False`;
- resumed: loopkit restoring the fresh run's checkpoint, `compilation_cache=False`;
- cached: loopkit resuming again with `compilation_cache=True` (the default), the cache
  filled by an earlier run: what a restart under `loopkit run` pays.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time


def child(case: str, logdir: str, max_steps: int, layers: int, width: int, axes: str) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    def init():
        keys = jax.random.split(jax.random.key(0), layers)
        params = [jax.random.normal(k, (width, width)) / width**0.5 for k in keys]
        return {"params": params, "mom": [jnp.zeros_like(p) for p in params],
                "step": jnp.int32(0)}

    def step(s, x):
        def loss(ps):
            h = x
            for p in ps:
                h = jax.nn.gelu(h @ p) + h
            return jnp.mean(h ** 2)

        value, grads = jax.value_and_grad(loss)(s["params"])
        mom = [0.9 * m + g for m, g in zip(s["mom"], grads)]
        params = [p - 1e-3 * m for p, m in zip(s["params"], mom)]
        return {"params": params, "mom": mom, "step": s["step"] + 1}, {"loss": value}

    def data(start):
        for i in range(start, 10**6):
            yield np.random.default_rng(i).normal(size=(32, width)).astype(np.float32)

    compiling = {"secs": 0.0}  # tracing, lowering and compiling, in the main thread

    def listen(event: str, secs: float, **_: object) -> None:
        if event.startswith("/jax/core/compile/") and threading.current_thread() is main:
            compiling["secs"] += secs

    main = threading.current_thread()
    jax.monitoring.register_event_duration_secs_listener(listen)
    kind = jax.sharding.AxisType.Auto if axes == "auto" else jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(kind,))
    with jax.set_mesh(mesh):
        if case == "bare":
            t0 = time.perf_counter()  # from init, as loopkit's figure is
            state, batch = init(), next(data(0))
            state, metrics = jax.jit(step, donate_argnums=0)(state, batch)
            jax.block_until_ready(metrics)
            secs = time.perf_counter() - t0
            compile_secs = compiling["secs"]
        else:
            import loopkit

            first: dict = {}

            class First:
                @loopkit.hookimpl
                def after_step(self, session, step, metrics):
                    if "t" not in first:
                        jax.block_until_ready(metrics)
                        first["t"] = time.perf_counter()
                        first["compile"] = compiling["secs"]

            t0 = time.perf_counter()
            loopkit.train(step, init=init, data=data, logdir=logdir, max_steps=max_steps,
                          plugins=[First()],
                          save_model_secs=None, save_summaries_secs=None, progress=False,
                          compilation_cache=case == "cached", autoload=False)
            secs, compile_secs = first["t"] - t0, first["compile"]
    print(json.dumps({"case": case, "secs": secs, "compile": compile_secs}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--axes", choices=("explicit", "auto"), default="explicit",
                   help="the mesh's axis types (jax.make_mesh's default: explicit)")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child[0], a.child[1], int(a.child[2]), a.layers, a.width, a.axes)
        return
    results: dict[str, list[float]] = {}
    compiles: dict[str, list[float]] = {}
    for _ in range(a.repeats):
        logdir = tempfile.mkdtemp(prefix="loopkit-startup-")
        try:
            # "cached" first fills the cache (a throwaway run), then each case in turn
            for steps, case in enumerate(("bare", "fresh", "resumed", "warm-cache", "cached")):
                run_as = "cached" if case == "warm-cache" else case
                out = subprocess.run(
                    [sys.executable, __file__, "--layers", str(a.layers), "--width",
                     str(a.width), "--axes", a.axes, "--child", run_as, logdir, str(3 * steps)],
                    capture_output=True, text=True, check=True)
                if case != "warm-cache":
                    got = json.loads(out.stdout.strip().splitlines()[-1])
                    results.setdefault(case, []).append(got["secs"])
                    compiles.setdefault(case, []).append(got["compile"])
        finally:
            shutil.rmtree(logdir, ignore_errors=True)
    bare = statistics.median(results["bare"])
    bare_compile = statistics.median(compiles["bare"])
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{a.layers} layers of {a.width}x{a.width}, {a.axes} axes, median of {a.repeats}")
    print(f"{'case':<10} {'first step (s)':>15} {'vs bare':>8} {'compiling (s)':>14} {'vs bare':>8}")
    for case, secs in results.items():
        m, c = statistics.median(secs), statistics.median(compiles[case])
        print(f"{case:<10} {m:>15.2f} {m / bare:>8.2f} {c:>14.2f} {c / bare_compile:>8.2f}")


if __name__ == "__main__":
    main()
