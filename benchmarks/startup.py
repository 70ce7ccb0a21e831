"""Time to the first step: loopkit (fresh, resumed, resumed with the compile cache) vs a bare loop.

    python benchmarks/startup.py [--repeats 3] [--layers 8] [--width 512]

Each measurement runs in a fresh process under `jax.set_mesh` (one CPU device unless
XLA_FLAGS says otherwise), so nothing is cached in memory between them. It times the
call (`loopkit.train`, or the bare loop's `jax.jit(step)(state, batch)`) to the first
step's metrics being ready: tracing and compiling the step, and for loopkit also its
checks, the restore and the services' start. Cases:

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
import time


def child(case: str, logdir: str, max_steps: int, layers: int, width: int) -> None:
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

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    with jax.set_mesh(mesh):
        if case == "bare":
            t0 = time.perf_counter()  # from init, as loopkit's figure is
            state, batch = init(), next(data(0))
            state, metrics = jax.jit(step, donate_argnums=0)(state, batch)
            jax.block_until_ready(metrics)
            secs = time.perf_counter() - t0
        else:
            import loopkit

            first: dict = {}

            class First:
                @loopkit.hookimpl
                def after_step(self, session, step, metrics):
                    if "t" not in first:
                        jax.block_until_ready(metrics)
                        first["t"] = time.perf_counter()

            t0 = time.perf_counter()
            loopkit.train(step, init=init, data=data, logdir=logdir, max_steps=max_steps,
                          plugins=[First()],
                          save_model_secs=None, save_summaries_secs=None, progress=False,
                          compilation_cache=case == "cached", autoload=False)
            secs = first["t"] - t0
    print(json.dumps({"case": case, "secs": secs}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child[0], a.child[1], int(a.child[2]), a.layers, a.width)
        return
    results: dict[str, list[float]] = {}
    for _ in range(a.repeats):
        logdir = tempfile.mkdtemp(prefix="loopkit-startup-")
        try:
            # "cached" first fills the cache (a throwaway run), then each case in turn
            for steps, case in enumerate(("bare", "fresh", "resumed", "warm-cache", "cached")):
                run_as = "cached" if case == "warm-cache" else case
                out = subprocess.run(
                    [sys.executable, __file__, "--layers", str(a.layers), "--width",
                     str(a.width), "--child", run_as, logdir, str(3 * steps)],
                    capture_output=True, text=True, check=True)
                if case != "warm-cache":
                    secs = json.loads(out.stdout.strip().splitlines()[-1])["secs"]
                    results.setdefault(case, []).append(secs)
        finally:
            shutil.rmtree(logdir, ignore_errors=True)
    bare = statistics.median(results["bare"])
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{a.layers} layers of {a.width}x{a.width}, median of {a.repeats}")
    print(f"{'case':<10} {'first step (s)':>15} {'vs bare':>8}")
    for case, secs in results.items():
        m = statistics.median(secs)
        print(f"{case:<10} {m:>15.2f} {m / bare:>8.2f}")


if __name__ == "__main__":
    main()
