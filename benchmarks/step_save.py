"""How long a save holds the loop, and how much memory it adds, for an updating and a frozen step.

    python benchmarks/step_save.py [--mb 256] [--repeats 5] [--tiers durable,both]

Two states of ``--mb`` MB of float32 (8 matrices): "updating", whose step
rewrites every leaf, and "frozen", whose step passes the matrices through and
rewrites a small head (a fine-tune). For each:

1. the strategies, with JAX alone: how much longer the step after a save takes
   than a normal donating step, when the saver still holds the old buffers by
   host views, by running that step without donation, by a host copy of the
   rewritten leaves at save time (what loopkit does off CPU), or by a variant of
   the step that writes into spare buffers, those of the previous save (what
   loopkit does on CPU);
2. loopkit end to end (orbax backend, saves spaced beyond a commit): the hold
   per save, the extra time of the step that saves plus that of the step after
   it, each step blocked on (the median over the saves after the first, and the
   first save apart), with the durable tier alone and with a local tier saving at
   the same steps (`--tiers`: one staging of the state serves both); the growth of peak
   host memory (VmHWM) during a save, and of resident memory from before the
   first save to after the last; on an accelerator, the peak device memory of
   the run against the state's size (run one step kind per process for that:
   ``--steps updating --skip-strategies``).

Ratios are against the raw durable write of the same bytes (``np.save`` + fsync),
measured in the same process. On CPU, device memory is host memory.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import loopkit  # noqa: E402
from loopkit.state.staging import to_host, views  # noqa: E402
from checkpoint import raw_write  # noqa: E402 - benchmarks/checkpoint.py, beside this one

MB = 2**20


def make_state(mb: int) -> dict:
    rows = mb * MB // 4 // 8 // 1024
    rng = np.random.default_rng(0)
    return {"w": [jnp.asarray(rng.standard_normal((rows, 1024), np.float32)) for _ in range(8)],
            "head": jnp.zeros(1024)}


def updating(s):
    return {"w": [x * 0.999 + 0.001 for x in s["w"]], "head": s["head"] + 1.0}, {}


def frozen(s):
    return {"w": s["w"], "head": s["head"] + s["w"][0][0]}, {}


def host_copy(leaves):
    """The rewritten leaves copied to host memory, as `Session.stage_state` does off CPU."""
    return jax.block_until_ready([to_host(x) for x in leaves])


class DeviceSampler:
    """The most device memory in use, polled every millisecond (None on CPU)."""

    def __init__(self) -> None:
        self.most: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if jax.default_backend() != "cpu" and jax.local_devices()[0].memory_stats():
            self.most = 0
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()

    def _poll(self) -> None:
        dev = jax.local_devices()[0]
        while not self._stop.wait(0.001):
            self.most = max(self.most or 0, dev.memory_stats()["bytes_in_use"])

    def stop(self) -> int | None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.most


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return time.perf_counter() - t, out


def strategies(step, mb: int, repeats: int) -> dict[str, float]:
    """Extra seconds of the step after a save, per strategy (median over repeats)."""
    donating, plain = jax.jit(step, donate_argnums=0), jax.jit(step)
    # the state's rewritten leaves land in `spare`, which is donated; `s` is only read
    into_spare = jax.jit(lambda s, spare: step(s), donate_argnums=1, keep_unused=True)
    state = make_state(mb)
    state, _ = donating(state)
    state = jax.block_until_ready(state)
    out: dict[str, list[float]] = {}

    def after_save(label: str, hold) -> None:
        """The step after a save that keeps `hold(leaves it rewrites)` while it runs."""
        nonlocal state
        rewritten = jax.tree.leaves(state if step is updating else state["head"])
        t0 = time.perf_counter()
        kept = hold(rewritten)  # noqa: F841 - kept alive through the step
        held = time.perf_counter() - t0
        t, (state, _) = timed(donating, state)
        out.setdefault(label, []).append(held + t - normal)

    for _ in range(repeats):
        normal, (state, _) = timed(donating, state)
        # the leaves the next step rewrites (loopkit never donates the frozen ones)
        after_save("host views held, donating step", views)
        t, (state, _) = timed(plain, state)
        out.setdefault("step without donation", []).append(t - normal)
        after_save("host copy of rewritten leaves", host_copy)
    spare = None
    # (a frozen step's big leaves would be copied by `into_spare`; loopkit passes them
    # apart, never returned, so only the updating step measures this strategy)
    for _ in range(repeats + 1 if step is updating else 0):
        normal, (state, _) = timed(donating, state)
        if spare is None:  # the first save has no spare yet: the next one does
            spare = state
            state = jax.block_until_ready(plain(state)[0])
            continue
        t, (new, _) = timed(into_spare, state, spare)
        out.setdefault("spare buffers (previous save's)", []).append(t - normal)
        state, spare = new, state
    return {k: statistics.median(v) for k, v in out.items()}


def status_kb(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM), in kB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def device_peak() -> int | None:
    stats = jax.local_devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    return stats.get("peak_bytes_in_use") if stats else None


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        return True
    except OSError:
        return False


def end_to_end(step, mb: int, repeats: int, root: Path, raw: float,
               both: bool = False) -> dict[str, float]:
    """Median hold per save and save action (s), the first save's hold, memory growth (MB).

    A save runs inside the `run()` of its step (a multiple of `every`); the hold is
    that call's extra time plus the next one's, over the median of the two steps
    before the save (neither next to one). `both`: a local tier saves at the same
    steps as the durable one (one staging serves both saves).
    """
    every = 4
    tiers = dict(local_checkpoint_dir=str(root / "local"), save_local_secs=None,
                 save_local_steps=every, max_to_keep_local=1) if both else {}
    sv = loopkit.Supervisor(logdir=str(root / "run"), save_model_secs=None,
                            save_model_steps=every, progress=False, disable=("summaries",),
                            autoload=False, max_to_keep=1, **tiers)
    holds, actions, growth = [], [], []
    space = max(1.5, 3 * raw)  # the last save has committed: nothing waits for it
    times: dict[int, float] = {}

    def run() -> None:
        t, _ = timed(lambda: (sess.run(), sess.state)[1])
        times[sess.step] = t

    # a callable: loopkit's arrays alone, none the caller keeps alive beside them
    with sv.managed_session(step, init=lambda: make_state(mb)) as sess:
        run()  # compiles
        time.sleep(0.5)
        rss0 = status_kb("VmRSS")
        sampler = DeviceSampler()
        while len(holds) < repeats:
            while (sess.step + 1) % every:  # up to the step that saves
                run()
            time.sleep(space)
            reset_hwm()
            base = status_kb("VmHWM")
            run()  # steps and saves
            save = sess.step
            plugin = sess.plugin_manager.get_plugin("checkpoint")
            action = (plugin.blocking_secs or 0.0) + (plugin.local_blocking_secs or 0.0)
            run()  # the step after the save
            normal = statistics.median([times[save - 2], times[save - 1]])
            holds.append(times[save] - normal + times[save + 1] - normal)
            actions.append(action)
            time.sleep(space)
            growth.append((status_kb("VmHWM") - base) / 1024)
        resident = (status_kb("VmRSS") - rss0) / 1024
        most = sampler.stop()
    return {"hold": statistics.median(holds[1:] or holds), "first": holds[0],
            "action": statistics.median(actions[1:] or actions),
            "growth": statistics.median(growth[1:] or growth), "resident": resident,
            "device": most}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", default="updating,frozen", help="which step kinds, in order")
    p.add_argument("--tiers", default="durable,both",
                   help="durable: one tier; both: a local tier saving at the same steps")
    p.add_argument("--skip-strategies", action="store_true",
                   help="loopkit end to end only (keeps the device peak the run's own)")
    args = p.parse_args()
    print(f"{platform.platform()}, python {platform.python_version()}, jax {jax.__version__}, "
          f"{os.cpu_count()} CPUs, backend {jax.default_backend()}")
    with tempfile.TemporaryDirectory(prefix="loopkit-step-save-") as tmp:
        root = Path(tmp)
        raw = statistics.median(raw_write(make_state(args.mb), root / "raw.npy")
                                for _ in range(3))
        print(f"\nstate {args.mb} MB; raw write + fsync {raw * 1e3:.0f} ms (5% = "
              f"{raw * 50:.1f} ms)\n")
        kinds = {"updating": updating, "frozen": frozen}
        for name in args.steps.split(","):
            step = kinds[name]
            print(f"{name} step")
            for tiers in args.tiers.split(","):
                r = end_to_end(step, args.mb, args.repeats, root / name / tiers, raw,
                               both=tiers == "both")
                what = "durable + local tier at once" if tiers == "both" else "durable tier"
                print(f"  loopkit, orbax, {what}: hold per save {r['hold'] * 1e3:.1f} ms "
                      f"({100 * r['hold'] / raw:.1f}% of raw write; save action "
                      f"{r['action'] * 1e3:.1f} ms; the first save {r['first'] * 1e3:.1f} ms)")
                print(f"    host memory: peak +{r['growth']:.0f} MB during a save "
                      f"({r['growth'] / args.mb:.2f}x the state), resident "
                      f"+{r['resident']:.0f} MB after the saves ({r['resident'] / args.mb:.2f}x)")
            peak = device_peak()
            if peak is not None:
                print(f"  device memory: at most {r['device'] / MB:.0f} MB in use during the "
                      f"saves ({r['device'] / MB / args.mb:.2f}x the state, polled every ms); "
                      f"peak {peak / MB:.0f} MB in the run ({peak / MB / args.mb:.2f}x, the "
                      "first step included: it never donates the caller's arrays)")
            if args.skip_strategies:
                continue
            print("  extra time of the step after a save, by strategy (JAX alone):")
            for key, sec in strategies(step, args.mb, args.repeats).items():
                print(f"    {key:36} {sec * 1e3:8.1f} ms  {100 * sec / raw:6.1f}% of raw write")


if __name__ == "__main__":
    main()
