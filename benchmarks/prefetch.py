"""Benchmark the `prefetch` plugin: overlap of input with the step, and the hand-off cost.

Run: ``python benchmarks/prefetch.py`` (about a minute; ``--repeats`` to change).

1. Overlap. A step costing t_s and a per-batch input cost t_d (in
   `Config.data_transform`, so that `prefetch_threads` can share it), either
   `time.sleep` or numpy matrix products (which release the GIL). Seconds per
   step with prefetch off, on with 1 thread and on with 2 threads, against the
   ideal max(t_s, t_d / threads), where t_s and t_d are the costs measured alone,
   and against the floor: the same work run in independent threads with nothing
   handed over, which is what this machine can do now (other users' load and the
   core count bound the numpy variant, not the hand-off).
2. Hand-off. A trivial jitted step fed small numpy batches from a list and
   from a generator: `loopkit.train` against a bare Python loop calling the
   same jitted, donating step on the same batches from the same kind of
   source, in turns. Each figure is the slope between a short and a long run
   (start-up and compilation cancel); the added cost is the median of the
   per-repeat differences to the bare loop.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one core per numpy worker
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import platform  # noqa: E402
import queue  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import loopkit  # noqa: E402

QUIET = dict(progress=False, save_summaries_secs=0, save_model_secs=0)


def machine() -> str:
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip()
                         for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{os.cpu_count()} CPUs ({model}), Python {platform.python_version()}, "
            f"jax {jax.__version__}, backend {jax.default_backend()}")


# -- 1. overlap ------------------------------------------------------------------------

_A = np.random.default_rng(0).standard_normal((96, 96))


def _matmuls(n: int) -> None:
    a = _A
    for _ in range(n):
        a = np.tanh(a @ _A)  # matmul releases the GIL; tanh keeps values bounded


def _per_matmul() -> float:
    _matmuls(20)
    t = [(_time(lambda: _matmuls(50))) / 50 for _ in range(7)]
    return statistics.median(t)


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def make_cost(kind: str, secs: float, unit: float):
    if kind == "sleep":
        return lambda: time.sleep(secs)
    n = max(1, round(secs / unit))
    return lambda: _matmuls(n)


def overlap_run(kind: str, t_s: float, t_d: float, unit: float, steps: int,
                repeats: int) -> list[tuple[str, float, float]]:
    step_cost, data_cost = make_cost(kind, t_s, unit), make_cost(kind, t_d, unit)
    # what each costs alone, on this machine now
    real_s = statistics.median(_time(step_cost) for _ in range(30))
    real_d = statistics.median(_time(data_cost) for _ in range(30))

    def step(state, batch):
        step_cost()
        return state + 1, {}

    def transform(i):
        data_cost()
        return i

    def floor(threads: int) -> float:
        """The same work in independent threads, nothing handed over: the machine's best."""
        workers = [threading.Thread(target=lambda: [data_cost() for _ in range(steps // threads)])
                   for _ in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for _ in range(steps):
            step_cost()
        for w in workers:
            w.join()
        return (time.perf_counter() - t0) / steps

    rows = []
    for name, prefetch, threads in (("off", 0, 1), ("on, 1 thread", 2, 1),
                                    ("on, 2 threads", 4, 2)):
        per_step, floors = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            loopkit.train(step, init=0, data=range(steps), data_transform=transform,
                          prefetch=prefetch, prefetch_threads=threads, jit=False, **QUIET)
            per_step.append((time.perf_counter() - t0) / steps)
            if prefetch:
                floors.append(floor(threads))
        ideal = real_s + real_d if prefetch == 0 else max(real_s, real_d / threads)
        best = statistics.median(floors) if floors else ideal
        rows.append((name, statistics.median(per_step), ideal, best))
    print(f"\n{kind}: t_s={t_s * 1e3:.1f} ms (measured {real_s * 1e3:.2f}), "
          f"t_d={t_d * 1e3:.1f} ms (measured {real_d * 1e3:.2f}), {steps} steps, "
          f"median of {repeats}")
    print(f"  {'prefetch':<16}{'ms/step':>9}{'ideal':>9}{'/ideal':>8}{'floor':>9}{'/floor':>8}")
    for name, got, ideal, best in rows:
        print(f"  {name:<16}{got * 1e3:>9.2f}{ideal * 1e3:>9.2f}{got / ideal:>8.2f}"
              f"{best * 1e3:>9.2f}{got / best:>8.2f}")
    return rows


# -- 2. hand-off -----------------------------------------------------------------------


def handoff(repeats: int, short: int, long: int) -> None:
    fn = lambda s, b: (s + b[0], {"s": s})  # noqa: E731 - the trivial step
    jitted = jax.jit(fn, donate_argnums=0)
    batches = [np.full((8,), i, np.float32) for i in range(long)]
    init = lambda: jnp.zeros((), jnp.float32)  # noqa: E731

    def gen(n):  # the same batches from a generator, which a loop cannot read ahead
        return (b for b in batches[:n])

    def bare(source):
        def run(n):
            s = init()
            t0 = time.perf_counter()
            for b in source(n):
                s, _ = jitted(s, b)
            s.block_until_ready()
            return time.perf_counter() - t0
        return run

    def naive(n):
        # a plain thread + queue.Queue + one device_put per batch, for reference
        q: queue.Queue = queue.Queue(maxsize=2)
        t = threading.Thread(target=lambda: [q.put(jax.device_put(b)) for b in batches[:n]],
                             daemon=True)
        s = init()
        t0 = time.perf_counter()
        t.start()
        for _ in range(n):
            s, _ = jitted(s, q.get())
        s.block_until_ready()
        t.join()
        return time.perf_counter() - t0

    def lk(source, **kw):
        def run(n):
            t0 = time.perf_counter()
            r = loopkit.train(fn, init=init, data=source(n), **QUIET, **kw)
            r.state.block_until_ready()
            return time.perf_counter() - t0
        return run

    def listed(n):
        return batches[:n]

    # (name, run, the bare loop it is compared with)
    variants = [
        ("bare loop, list", bare(listed), None),
        ("bare loop, generator", bare(gen), None),
        ("loopkit, prefetch=0, list", lk(listed, prefetch=0), "bare loop, list"),
        ("loopkit, prefetch=2 (default), list", lk(listed), "bare loop, list"),
        ("loopkit, prefetch=2 (default), generator", lk(gen), "bare loop, generator"),
        ("loopkit, prefetch=64, list", lk(listed, prefetch=64), "bare loop, list"),
        ("loopkit, prefetch=64, generator", lk(gen, prefetch=64), "bare loop, generator"),
        ("thread+Queue+device_put, bare", naive, "bare loop, list"),
    ]
    for _, run, _ in variants:  # warm up: compile, import, caches
        run(short)
    slopes: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    for _ in range(repeats):  # interleaved, so load from other users hits all alike
        for name, run, _ in variants:
            slopes[name].append((run(long) - run(short)) / (long - short))
    print(f"\nhand-off: trivial jitted step, slope of runs of {short} and {long} steps, "
          f"median of {repeats}; 'vs bare' is the median of the per-repeat differences")
    print(f"  {'':<42}{'µs/step':>9}{'vs bare':>9}{'spread':>14}")
    for name, _, base in variants:
        xs = slopes[name]
        added = "" if base is None else f"{_paired(xs, slopes[base]):+.2f}"
        print(f"  {name:<42}{statistics.median(xs) * 1e6:>9.2f}{added:>9}"
              f"{f'{min(xs) * 1e6:.1f}..{max(xs) * 1e6:.1f}':>14}")


def _paired(xs: list[float], bases: list[float]) -> float:
    """Median of the per-repeat differences, in µs: load drifts between repeats."""
    return statistics.median(x - b for x, b in zip(xs, bases)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=150, help="steps per overlap run")
    ap.add_argument("--part", choices=("all", "sleep", "numpy", "handoff"), default="all")
    args = ap.parse_args()
    print(machine())
    print("load average before:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    unit = _per_matmul()
    for kind in ("sleep", "numpy"):
        if args.part in ("all", kind):
            overlap_run(kind, 4e-3, 2e-3, unit, args.steps, args.repeats)  # 1 thread suffices
            overlap_run(kind, 2e-3, 4e-3, unit, args.steps, args.repeats)  # 2 threads needed
    if args.part in ("all", "handoff"):
        handoff(args.repeats, 2_000, 20_000)
    print("load average after:", " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
