"""Time to the first step: loopkit (fresh, resumed, resumed with the compile cache) vs a bare loop.

    python benchmarks/startup.py [--repeats 3] [--layers 8] [--width 512] [--axes explicit]

Each measurement runs in a fresh process under `jax.set_mesh` (one CPU device unless
XLA_FLAGS says otherwise), so nothing is cached in memory between them. It times the
call (`loopkit.train`, or the bare loop's `jax.jit(step)(state, batch)`) to the first
step's metrics being ready ("first step"): tracing and compiling the step, and for
loopkit also its checks, the restore and the services' start; and of that, the time
spent tracing, lowering and compiling in the main thread ("compiling": jax's
`/jax/core/compile/` duration events; a compile ahead in a background thread, such as
the CPU save variant's, is not the loop's wait), and in the restore ("restore": loopkit's
`restore_state` hook, or the hand-written resume's read). "import" is the time to import
jax and loopkit (or orbax, for the hand-written resume) in the fresh process, and
"total" the import plus the first step. Cases:

- bare: the hand-written loop: `init()`, then the jitted step (the reference of a fresh
  start);
- fresh: loopkit on an empty logdir, `compilation_cache=False`;
- resumed: loopkit restoring the fresh run's checkpoint, `compilation_cache=False`;
- bare-resume: the hand-written resume (the reference of a restart): import jax and
  orbax, read loopkit's checkpoint with orbax's `StandardCheckpointer` (a standard orbax
  checkpoint) into the state's shapes, then the jitted step with JAX's persistent
  compile cache filled by an earlier run;
- cached: loopkit resuming again with `compilation_cache=True` (the default), the cache
  filled by an earlier run: what a restart under `loopkit run` pays. Its "total" is
  compared with bare-resume's.
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
    start = time.perf_counter()  # before any import: "import" and "total" count from here
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    if case == "bare-resume":
        import orbax.checkpoint as ocp
    elif case != "bare":
        import loopkit
    imported = time.perf_counter()

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
    restore = 0.0
    with jax.set_mesh(mesh):
        if case == "bare":
            t0 = time.perf_counter()  # from init, as loopkit's figure is
            state, batch = init(), next(data(0))
            state, metrics = jax.jit(step, donate_argnums=0)(state, batch)
            jax.block_until_ready(metrics)
            secs = time.perf_counter() - t0
            compile_secs = compiling["secs"]
        elif case == "bare-resume":
            # JAX's persistent cache as loopkit sets it (every compile kept), its own folder
            jax.config.update("jax_compilation_cache_dir", os.path.join(logdir, "bare-cache"))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
            t0 = time.perf_counter()
            ckpt = max((n for n in os.listdir(logdir) if n.startswith("model.ckpt-")),
                       key=lambda n: int(n.rsplit("-", 1)[1]))
            whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole),
                                jax.eval_shape(init))
            state = ocp.StandardCheckpointer().restore(os.path.join(logdir, ckpt), like)
            restore = time.perf_counter() - t0
            batch = next(data(int(state["step"])))
            state, metrics = jax.jit(step, donate_argnums=0)(state, batch)
            jax.block_until_ready(metrics)
            secs = time.perf_counter() - t0
            compile_secs = compiling["secs"]
        else:
            first: dict = {}

            class First:
                @loopkit.hookimpl(wrapper=True)
                def restore_state(self, session, like):
                    t = time.perf_counter()
                    try:
                        return (yield)
                    finally:
                        first["restore"] = time.perf_counter() - t

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
            restore = first.get("restore", 0.0)
    print(json.dumps({"case": case, "secs": secs, "compile": compile_secs, "restore": restore,
                      "import": imported - start, "total": imported - start + secs}))


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
    # each case's runs, in order: a "warm" case is a throwaway run that fills a compile
    # cache for the next one; max_steps grows by 3 a run, so each resume has steps to run
    order = ("bare", "fresh", "resumed", "warm:bare-resume", "bare-resume", "warm:cached",
             "cached")
    results: dict[str, list[dict]] = {}
    load = os.getloadavg()[0]
    for _ in range(a.repeats):
        logdir = tempfile.mkdtemp(prefix="loopkit-startup-")
        try:
            for steps, case in enumerate(order):
                run_as = case.removeprefix("warm:")
                out = subprocess.run(
                    [sys.executable, __file__, "--layers", str(a.layers), "--width",
                     str(a.width), "--axes", a.axes, "--child", run_as, logdir, str(3 * steps)],
                    capture_output=True, text=True, check=True)
                if run_as == case:
                    got = json.loads(out.stdout.strip().splitlines()[-1])
                    results.setdefault(case, []).append(got)
        finally:
            shutil.rmtree(logdir, ignore_errors=True)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load "
          f"{load:.1f} -> {os.getloadavg()[0]:.1f}, {a.layers} layers of {a.width}x{a.width}, "
          f"{a.axes} axes, median of {a.repeats}")
    median = {case: {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "case"}
              for case, runs in results.items()}
    bare, resume = median["bare"], median["bare-resume"]
    print(f"{'case':<12} {'import':>7} {'restore':>8} {'compiling':>10} {'first step':>11} "
          f"{'vs bare':>8} {'total':>7} {'vs bare-resume':>15}")
    for case, m in median.items():
        print(f"{case:<12} {m['import']:>7.2f} {m['restore']:>8.2f} {m['compile']:>10.2f} "
              f"{m['secs']:>11.2f} {m['secs'] / bare['secs']:>8.2f} {m['total']:>7.2f} "
              f"{m['total'] / resume['total']:>15.2f}")


if __name__ == "__main__":
    main()
