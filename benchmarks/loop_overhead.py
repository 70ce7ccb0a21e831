"""loopkit's cost per step against a bare JAX loop over the same jitted step.

    python benchmarks/loop_overhead.py [--repeats 7] [--quick]

For each workload the per-step time is the slope between a short and a long run
in the same process (so compilation and start-up cancel out). The bare loop and
loopkit are measured in turns, repeat after repeat; the ratio is the median of the
per-repeat ratios, so drift of a shared machine hits both sides alike.
loopkit runs with every default built-in on (logdir set: checkpoints, summaries,
step counter, progress, prefetch) but with timers that do not fire during the
measurement, which is what a long run sees between two checkpoints.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import loopkit  # noqa: E402

logging.getLogger("loopkit").setLevel(logging.WARNING)

IDLE = dict(save_model_secs=10**6, save_summaries_secs=10**6)


# -- workloads ---------------------------------------------------------------------------


def trivial_step(state):
    return state + 1, {}


def trivial_data_step(state, batch):
    return state + batch, {}


def trivial_metrics_step(state):
    return state + 1, {"loss": state * 0.5, "acc": state * 0.25}


def mlp_init():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (64, 256)) * 0.1, "b1": jnp.zeros(256),
        "w2": jax.random.normal(k2, (256, 10)) * 0.1, "b2": jnp.zeros(10),
    }


def mlp_step(params, batch):
    x, y = batch

    def loss_fn(p):
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        logits = h @ p["w2"] + p["b2"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), {"loss": loss}


def mlp_batches(n):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 128, 64)).astype(np.float32)
    y = rng.integers(0, 10, size=(n, 128)).astype(np.int32)
    return [(x[i], y[i]) for i in range(n)]


# -- the two loops -----------------------------------------------------------------------


def bare(step_fn, init, batches, n):
    """The loop a user would write by hand: jit with donation, feed, block at the end."""
    f = jax.jit(step_fn, donate_argnums=0)
    state = jax.tree.map(jnp.array, init)
    t0 = time.perf_counter()
    if batches is None:
        for _ in range(n):
            state, _ = f(state)
    else:
        for i in range(n):
            state, _ = f(state, batches[i])
    jax.block_until_ready(state)
    return time.perf_counter() - t0


def with_loopkit(step_fn, init, batches, n, logdir, **fields):
    # a fresh logdir each time: nothing to restore, and checkpoint saves at the stop
    # are excluded by timing only the loop (start-up and stop cancel out in the slope).
    marks = {}

    class Clock:
        @loopkit.hookimpl(trylast=True)
        def session_create(self, session):
            marks["start"] = time.perf_counter()

        @loopkit.hookimpl(tryfirst=True)
        def on_stop(self, session):
            jax.block_until_ready(session.state)
            marks["stop"] = time.perf_counter()

    data = None if batches is None else batches[:n]
    loopkit.train(step_fn, init=init, data=data, max_steps=n, logdir=logdir,
                  plugins=[Clock()], **IDLE, **fields)
    return marks["stop"] - marks["start"]


def paired_slopes(bare_run, loopkit_run, n_short, n_long, repeats):
    """Per-step times of both loops, measured in turns so that drift of the machine
    (other processes, frequency) hits both alike; medians, and the median ratio."""
    bare, lk, ratios = [], [], []
    for _ in range(repeats):
        b = (bare_run(n_long) - bare_run(n_short)) / (n_long - n_short)
        k = (loopkit_run(n_long) - loopkit_run(n_short)) / (n_long - n_short)
        bare.append(b)
        lk.append(k)
        ratios.append(k / b)
    return statistics.median(bare), statistics.median(lk), statistics.median(ratios)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="fewer steps (smoke test)")
    args = parser.parse_args(argv)
    scale = 10 if args.quick else 1
    tmp = tempfile.mkdtemp(prefix="loopkit-bench-")
    counter = iter(range(10**9))

    def logdir():
        return os.path.join(tmp, f"run{next(counter)}")

    trivial_batches = [np.float32(1.0)] * (40_000 // scale)
    workloads = [
        ("trivial (state + 1, no data)", trivial_step, jnp.zeros(()), None,
         4_000 // scale, 40_000 // scale),
        ("trivial + data (prefetch on)", trivial_data_step, jnp.zeros(()), trivial_batches,
         4_000 // scale, 40_000 // scale),
        ("MLP 64-256-10, batch 128", mlp_step, mlp_init(), mlp_batches(2_000 // scale),
         200 // scale, 2_000 // scale),
    ]
    print(f"# {platform.node()} | {platform.processor() or platform.machine()} | "
          f"{os.cpu_count()} cpus | jax {jax.__version__} | {jax.devices()[0].platform}")
    print(f"{'workload':34} {'bare µs/step':>13} {'loopkit µs/step':>16} "
          f"{'added µs':>9} {'ratio':>7}")
    for name, fn, init, batches, n_short, n_long in workloads:
        b, lk, ratio = paired_slopes(lambda n: bare(fn, init, batches, n),
                                     lambda n: with_loopkit(fn, init, batches, n, logdir()),
                                     n_short, n_long, args.repeats)
        print(f"{name:34} {b * 1e6:13.2f} {lk * 1e6:16.2f} {(lk - b) * 1e6:9.2f} "
              f"{ratio:7.3f}")
    sys.stdout.flush()

    # summary_reduce="mean" against "last" on a step with two scalar metrics: the
    # sums are added inside the jitted step, so the difference is that step's cost
    n_short, n_long = 4_000 // scale, 40_000 // scale
    last, mean, _ = paired_slopes(
        lambda n: with_loopkit(trivial_metrics_step, jnp.zeros(()), None, n, logdir()),
        lambda n: with_loopkit(trivial_metrics_step, jnp.zeros(()), None, n, logdir(),
                               summary_reduce="mean"),
        n_short, n_long, args.repeats)
    print(f"{'trivial + 2 metrics, last -> mean':34} {last * 1e6:13.2f} {mean * 1e6:16.2f} "
          f"{(mean - last) * 1e6:9.2f} {mean / last:7.3f}")


if __name__ == "__main__":
    main()
