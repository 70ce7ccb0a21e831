"""The cost per step of the fault checks: the replica check at N = 1, 10, 100, the
straggler accounting, and the replay front.

    python benchmarks/faults.py [--repeats 3] [--quick]

Replica check: a data-parallel MLP (784-1024-1024-10 with momentum: 3.7 M floats,
15 MB, replicated on every device of a 4-device mesh, the batch of 256 split over
it) trained with `replica_check_steps` None against N, in turns; per step, the slope
between a short and a long run (start-up and compile cancel out), and the check's own
timer time per step (`SessionStats.timer_secs`, which also holds the wait for the
steps queued before it). On CPU the 4 devices are forced (XLA_FLAGS); elsewhere the
machine's devices are used. Straggler accounting: what a prefetch thread adds per
batch while it is on (two clock reads and two additions), and what the loop adds per
step (nothing: the window's gather runs on the summary timer). Replay front
(`on_guard="replay"`, a replica check that rolls back): one method call a batch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import timeit

if "--gpu" not in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import loopkit  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("d",))
SIZES = (784, 1024, 1024, 10)


def init():
    keys = jax.random.split(jax.random.key(0), len(SIZES))
    rep = NamedSharding(mesh, P())
    params = {f"w{i}": jax.random.normal(keys[i], (a, b)) * 0.03
              for i, (a, b) in enumerate(zip(SIZES, SIZES[1:]))}
    params.update({f"b{i}": jnp.zeros(b) for i, b in enumerate(SIZES[1:])})
    state = {"params": params, "momentum": jax.tree.map(jnp.zeros_like, params)}
    return jax.device_put(state, rep)


def step(state, batch):
    x, y = batch

    def loss_fn(p):
        h = x
        for i in range(len(SIZES) - 1):
            h = h @ p[f"w{i}"] + p[f"b{i}"]
            h = jax.nn.relu(h) if i < len(SIZES) - 2 else h
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(h), y[:, None], 1))

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    m = jax.tree.map(lambda m, g: 0.9 * m + g, state["momentum"], grads)
    p = jax.tree.map(lambda p, m: p - 0.01 * m, state["params"], m)
    return {"params": p, "momentum": m}, {"loss": loss}


def batches():
    rng = np.random.default_rng(0)
    split = NamedSharding(mesh, P("d"))
    x = jax.device_put(rng.normal(size=(256, 784)).astype(np.float32), split)
    y = jax.device_put(rng.integers(0, 10, size=256).astype(np.int32), split)

    def data(start):
        while True:
            yield x, y
    return data


def timed_run(n, check):
    marks = {}

    class Clock:
        @loopkit.hookimpl(trylast=True)
        def session_create(self, session):
            marks["start"] = time.perf_counter()

        @loopkit.hookimpl(tryfirst=True)
        def on_stop(self, session):
            jax.block_until_ready(session.state)
            marks["stop"] = time.perf_counter()
            marks["check"] = session.stats.timer_secs.get("replica_check", 0.0)

    loopkit.train(step, init=init, data=batches(), max_steps=n, replica_check_steps=check,
                  progress=False, save_model_secs=None, save_summaries_secs=None,
                  plugins=[Clock()])
    return marks["stop"] - marks["start"], marks["check"]


def replica_rows(repeats, short, long):
    rows = []
    for check in (1, 10, 100):
        off, on, own = [], [], []
        for _ in range(repeats):  # in turns: drift of the machine hits both alike
            off.append((timed_run(long, None)[0] - timed_run(short, None)[0]) / (long - short))
            (t_long, c_long), (t_short, c_short) = timed_run(long, check), timed_run(short, check)
            on.append((t_long - t_short) / (long - short))
            own.append((c_long - c_short) / (long - short))
        rows.append((check, statistics.median(off), statistics.median(on),
                     statistics.median(own)))
    return rows


def direct(repeats=20):
    """One check on an idle state (the fingerprints' program, their transfer, the
    comparison) and one step, each alone: medians in seconds. The check's cost per step
    at N is check / N; it also drains the queue of dispatched steps once a check,
    which the slopes above include."""
    from loopkit.plugins.replica_check import _Layout

    state = init()
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    layout = _Layout(flat, False)
    leaves = [x for _, x in flat]
    layout.mismatches(layout.fingerprints(leaves)[None])  # compiled
    f = jax.jit(step)
    x, y = next(batches()(0))
    jax.block_until_ready(f(state, (x, y)))
    checks, steps = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        assert not layout.mismatches(layout.fingerprints(leaves)[None])
        checks.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        jax.block_until_ready(f(state, (x, y)))
        steps.append(time.perf_counter() - t0)
    return statistics.median(checks), statistics.median(steps), len(layout.entries)


def straggler_per_batch():
    from loopkit.plugin.view import SessionStats

    stats = SessionStats()
    perf = time.perf_counter

    def timed():
        t0 = perf()
        stats.input_read_secs += perf() - t0
        stats.input_read_batches += 1

    n = 200_000
    return min(timeit.repeat(timed, number=n, repeat=5)) / n


def replay_front_per_batch():
    from loopkit.plugins.rewind import Replay

    front = Replay()
    n = 200_000
    front.main = iter(range(10 * n))
    hop = min(timeit.repeat(lambda: next(front), number=n, repeat=5)) / n
    plain = iter(range(10 * n))
    bare = min(timeit.repeat(lambda: next(plain), number=n, repeat=5)) / n
    return hop - bare


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="the machine's own devices")
    args = parser.parse_args(argv)
    short, long = (10, 110) if args.quick else (20, 420)
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    check, one_step, copies = direct()
    print(f"one check alone: {1e3 * check:.2f} ms ({copies} copies fingerprinted); one step "
          f"alone: {1e3 * one_step:.2f} ms; per step at N=1, 10, 100: "
          + ", ".join(f"{100 * check / n / one_step:.2f}%" for n in (1, 10, 100)))
    print("| replica_check_steps | off ms/step | on ms/step | added | check's own ms/step |")
    print("|---:|---:|---:|---:|---:|")
    for check, off, on, own in replica_rows(args.repeats, short, long):
        print(f"| {check} | {1e3 * off:.2f} | {1e3 * on:.2f} | {100 * (on - off) / off:+.1f}% | "
              f"{1e3 * own:.3f} ({100 * own / off:.2f}%) |")
    print(f"straggler accounting: {1e9 * straggler_per_batch():.0f} ns a batch in the prefetch "
          "thread, 0 in the loop")
    print(f"replay front: {1e9 * replay_front_per_batch():.0f} ns a batch in the loop")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        main()
