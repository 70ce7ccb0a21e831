"""Checkpoint I/O: the built-in backends against the raw write and read of the same bytes.

    python benchmarks/checkpoint.py [--mb 256] [--repeats 3] [--dir DIR]
                                    [--orbax KEY=VALUE ...] [--only orbax|npz]
    python benchmarks/checkpoint.py --sweep [--repeats 3] [--dir DIR]
    python benchmarks/checkpoint.py --busy [--dir DIR]
    python benchmarks/checkpoint.py --gc [--repeats 5] [--dir DIR]

On a state of ``--mb`` MB of float32 jax arrays (a few big matrices, many small
vectors, random data so nothing compresses away), each repeat measures:

1. orbax async: how long `save` holds the training thread;
2. synchronous saves: npz `save`, and orbax `save` followed by `wait`;
3. the raw write of the same bytes (``np.save`` of each leaf into one file +
   ``fsync``): the physical limit on this disk;
4. the time until the orbax save is committed (durable: fsynced, renamed,
   directory fsynced);
5. restore time (into jax arrays, like the training state) against a raw read
   of the raw file (``np.load`` of each leaf), both from a cold page cache:
   ``echo 3 > /proc/sys/vm/drop_caches`` when allowed, else
   ``posix_fadvise(DONTNEED)`` on every file read (which drops this guest's
   cached pages of those files; the host under a VM may still cache them).

Medians over the repeats; the first save of each backend (imports, thread pools)
is a warm-up and not counted. ``--orbax use_compression=True`` and the like
pass options to `OrbaxBackend` to compare settings. For comparison, rows
"plain orbax" time orbax's own `AsyncCheckpointer` with orbax's defaults
(compressed zarr, no fsync).

``--sweep`` measures the cost per leaf instead: 16, 256, 1,024 and 4,096 equal
float32 leaves making 128 MiB, and 16 leaves making 512 MiB and 2 GiB. For each,
in one process and paired per repeat: the raw write + fsync and cold raw read,
loopkit's orbax and npz commit and cold restore, and plain orbax
(`StandardCheckpointer` save, no fsync; its restore into `jax.eval_shape` of the
state); and the peak growth of this process's resident memory during each save
and restore (sampled every 2 ms), against the state's size.

``--busy`` commits and restores 4,096 leaves beside a thread busy running Python,
with the opt-in tuning's switch interval and with Python's; ``--gc`` does so alone,
with the tuning's garbage-collector threshold and with Python's
(`loopkit.plugins.checkpoint.checkpoint_io_tuning`, entered around each operation).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from loopkit.state.pytree import abstract  # noqa: E402
from loopkit.plugins.checkpoint.backends.npz import NpzBackend  # noqa: E402
from loopkit.plugins.checkpoint.backends.orbax import OrbaxBackend  # noqa: E402


def make_state(mb: int) -> dict:
    """``mb`` MB of float32: 8 big matrices (95%) and 64 small vectors, random values."""
    rng = np.random.default_rng(0)
    big = int(mb * 0.95 * 2**20 / 4 / 8 / 1024)
    small = int(mb * 0.05 * 2**20 / 4 / 64)
    state = {"layers": [{"w": rng.standard_normal((big, 1024), np.float32)} for _ in range(8)],
             "norms": {f"n{i}": rng.standard_normal(small, np.float32) for i in range(64)},
             "step": np.int32(0)}
    return jax.tree.map(jnp.asarray, state)


def nbytes(state) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(state))


def files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [Path(r) / f for r, _, fs in os.walk(path) for f in fs]


def drop_cache(paths: list[Path]) -> str:
    """Empty the page cache of ``paths``; says how ("drop_caches", "fadvise")."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def raw_write(state, path: Path) -> float:
    leaves = [np.asarray(x) for x in jax.tree.leaves(state)]
    t = time.perf_counter()
    with open(path, "wb") as f:
        for leaf in leaves:
            np.save(f, leaf)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t


def raw_read(path: Path, count: int) -> float:
    t = time.perf_counter()
    with open(path, "rb") as f:
        out = [np.load(f) for _ in range(count)]
    assert sum(a.nbytes for a in out) > 0
    return time.perf_counter() - t


def timed_restore(backend, step: int, like, path: Path) -> tuple[float, str]:
    how = drop_cache(files_under(path))
    t = time.perf_counter()
    state, _ = backend.restore(step, like)
    jax.block_until_ready(state)
    return time.perf_counter() - t, how


def run(args) -> dict[str, list[float]]:
    state = make_state(args.mb)
    jax.block_until_ready(state)
    like = abstract(state)
    count = len(jax.tree.leaves(state))
    root = Path(tempfile.mkdtemp(prefix="loopkit-ckpt-bench-", dir=args.dir))
    res: dict[str, list[float]] = {}
    how = "?"

    def add(key: str, value: float) -> None:
        res.setdefault(key, []).append(value)

    def restore(key: str, backend, step: int) -> None:
        # The disk (a VM's, shared) is noisy: each restore gets its own raw read,
        # just before it, as the reference for its ratio.
        drop_cache([raw])
        add(f"raw read, just before {key}", raw_read(raw, count))
        add(key, timed_restore(backend, step, like, backend.path(step))[0])

    try:
        orbax = OrbaxBackend(root / "orbax", **args.orbax) if args.only != "npz" else None
        npz = NpzBackend(root / "npz") if args.only != "orbax" else None
        raw = root / "raw.npy"
        plain = None
        if orbax is not None:  # orbax alone, its defaults, no fsync: for comparison
            import orbax.checkpoint as ocp

            plain = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler())
            plain.save(root / "plain-0", args=ocp.args.PyTreeSave(state))
            plain.wait_until_finished()
        for backend in (orbax, npz):  # warm-up saves, not counted
            if backend is not None:
                backend.save(0, state, {"step": 0})
                backend.wait()
        for r in range(1, args.repeats + 1):
            add("raw write + fsync", raw_write(state, raw))
            how = drop_cache([raw])
            add("raw read", raw_read(raw, count))
            if orbax is not None:
                t = time.perf_counter()
                orbax.save(r, state, {"step": r})
                add("orbax async: save() blocks", time.perf_counter() - t)
                orbax.wait()
                add("orbax: committed (durable)", time.perf_counter() - t)
                restore("orbax restore", orbax, r)
                orbax.delete(r)
                t = time.perf_counter()
                plain.save(root / f"plain-{r}", args=ocp.args.PyTreeSave(state))
                add("plain orbax async: save() blocks", time.perf_counter() - t)
                plain.wait_until_finished()
                add("plain orbax: written (no fsync)", time.perf_counter() - t)
                shutil.rmtree(root / f"plain-{r}")
            if npz is not None:
                t = time.perf_counter()
                npz.save(r, state, {"step": r})
                add("npz save (sync, durable)", time.perf_counter() - t)
                restore("npz restore", npz, r)
                npz.delete(r)
        for backend in (orbax, npz, plain):
            if backend is not None:
                backend.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res["_cache"] = how  # type: ignore[assignment]
    return res


class PeakRSS:
    """The peak resident memory of this process above its level at entry, sampled."""

    def __enter__(self) -> "PeakRSS":
        import ctypes
        import gc
        import threading

        gc.collect()
        with contextlib.suppress(OSError, AttributeError):  # return freed heap pages first
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.base = self.peak = _rss()
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.wait(0.002):
                self.peak = max(self.peak, _rss())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.growth = self.peak - self.base


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


SWEEP = ((16, 128), (256, 128), (1024, 128), (4096, 128), (16, 512), (16, 2048))


def sweep(args) -> None:
    """Commit and restore against the raw write and read, by leaf count and size."""
    import orbax.checkpoint as ocp

    rows = []
    for leaves, mib in SWEEP:
        rng = np.random.default_rng(0)
        n = mib * 2**20 // 4 // leaves
        state = {"layers": [{"w": jnp.asarray(rng.standard_normal(n, np.float32))}
                            for _ in range(leaves)]}
        jax.block_until_ready(state)
        like = abstract(state)
        size = nbytes(state)
        root = Path(tempfile.mkdtemp(prefix="loopkit-ckpt-sweep-", dir=args.dir))
        raw = root / "raw.npy"
        res: dict[str, list[float]] = {}

        def add(key: str, value: float) -> None:
            res.setdefault(key, []).append(value)

        try:
            orbax, npz = OrbaxBackend(root / "orbax"), NpzBackend(root / "npz")
            plain = ocp.StandardCheckpointer()
            for b in (orbax, npz):  # warm-up saves, not counted
                b.save(0, state, {})
                b.wait()
            plain.save(root / "plain-0", state)
            plain.wait_until_finished()
            repeats = max(1, args.repeats if mib <= 512 else args.repeats // 2)
            for r in range(1, repeats + 1):
                add("raw write", raw_write(state, raw))
                for name, b in (("orbax", orbax), ("npz", npz)):
                    with PeakRSS() as m:
                        t = time.perf_counter()
                        b.save(r, state, {"step": r})
                        b.wait()
                        add(f"{name} commit", time.perf_counter() - t)
                    add(f"{name} save memory", m.growth / size)
                t = time.perf_counter()
                plain.save(root / f"plain-{r}", state)
                plain.wait_until_finished()
                add("plain orbax save", time.perf_counter() - t)
                for name, b, path in (("orbax", orbax, orbax.path(r)), ("npz", npz, npz.path(r)),
                                      ("plain orbax", None, root / f"plain-{r}")):
                    drop_cache([raw])
                    add(f"raw read, before {name}", raw_read(raw, leaves))
                    drop_cache(files_under(path))
                    with PeakRSS() as m:
                        t = time.perf_counter()
                        out = (b.restore(r, like)[0] if b is not None
                               else plain.restore(path, jax.eval_shape(lambda: state)))
                        jax.block_until_ready(out)
                        add(f"{name} restore", time.perf_counter() - t)
                    del out
                    add(f"{name} restore memory", m.growth / size)
                orbax.delete(r)
                npz.delete(r)
                shutil.rmtree(root / f"plain-{r}")
            for b in (orbax, npz, plain):
                b.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)

        def ratio(key: str, ref: str) -> float:
            return statistics.median(v / w for v, w in zip(res[key], res[ref]))

        med = {k: statistics.median(v) for k, v in res.items()}
        rows.append((leaves, mib, repeats, med, {
            f"{b} commit": ratio(f"{b} commit", "raw write") for b in ("orbax", "npz")} | {
            "plain orbax save": ratio("plain orbax save", "raw write")} | {
            f"{b} restore": ratio(f"{b} restore", f"raw read, before {b}")
            for b in ("orbax", "npz", "plain orbax")}))
        print(f"{leaves} leaves, {mib} MiB done", file=sys.stderr)
    print("\nratios: median over repeats of each time / the raw one of the same repeat "
          "(a restore: the cold raw read just before it); memory: peak RSS growth / state size")
    print("| leaves | MiB | n | raw write s | raw read s | orbax commit | npz commit | "
          "plain orbax save | orbax restore | npz restore | plain orbax restore | "
          "memory save orbax/npz | memory restore orbax/npz |")
    print("|" + "---|" * 13)
    for leaves, mib, repeats, med, rat in rows:
        read = statistics.median([med[f"raw read, before {b}"] for b in ("orbax", "npz")])
        print(f"| {leaves:,} | {mib} | {repeats} | {med['raw write']:.3f} | {read:.3f} | "
              f"{rat['orbax commit']:.2f}x | {rat['npz commit']:.2f}x | "
              f"{rat['plain orbax save']:.2f}x | {rat['orbax restore']:.2f}x | "
              f"{rat['npz restore']:.2f}x | {rat['plain orbax restore']:.2f}x | "
              f"{med['orbax save memory']:.2f} / {med['npz save memory']:.2f} | "
              f"{med['orbax restore memory']:.2f} / {med['npz restore memory']:.2f} |")
    sys.stdout.flush()


def busy(args) -> None:
    """Commit and restore of 4,096 leaves beside a thread busy running Python.

    The thread stands for a training loop or an input pipeline that holds the GIL;
    each checkpoint call that releases the GIL waits up to the switch interval to get
    it back. Each backend with the opt-in tuning's 0.2 ms interval around its I/O
    (`checkpoint_io_tuning`), then with Python's default kept (5 ms).
    """
    import threading

    from loopkit.plugins.checkpoint import io_tuning

    rng = np.random.default_rng(0)
    leaves, n = 4096, 128 * 2**20 // 4 // 4096
    state = {"layers": [{"w": jnp.asarray(rng.standard_normal(n, np.float32))}
                        for _ in range(leaves)]}
    root = Path(tempfile.mkdtemp(prefix="loopkit-ckpt-busy-", dir=args.dir))
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i

    print("\n4,096 leaves, 128 MiB: seconds alone / beside a busy Python thread")
    print("| backend | switch interval during I/O | commit alone | commit, busy | "
          "restore alone | restore, busy |")
    print("|---|---|---|---|---|---|")
    try:
        for name, cls in (("orbax", OrbaxBackend), ("npz", NpzBackend)):
            backend = cls(root / name)
            backend.save(0, state, {})  # warm-up
            backend.wait()
            for interval in (io_tuning.SWITCH_INTERVAL, sys.getswitchinterval()):
                row = []
                for op in ("commit", "restore"):
                    for loaded in (False, True):
                        stop.clear()
                        thread = threading.Thread(target=spin, daemon=True)
                        if loaded:
                            thread.start()
                        t = time.perf_counter()
                        with io_tuning.checkpoint_io_tuning(switch_interval=interval):
                            if op == "commit":
                                backend.save(1, state, {})
                                backend.wait()
                            else:
                                jax.block_until_ready(backend.restore(1, state)[0])
                        row.append(time.perf_counter() - t)
                        stop.set()
                        if loaded:
                            thread.join()
                        if op == "commit" and not loaded:
                            backend.delete(1)
                backend.delete(1)
                print(f"| {name} | {interval * 1e3:g} ms | " +
                      " | ".join(f"{v:.2f} s" for v in row) + " |", flush=True)
            backend.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def gc_cost(args) -> None:
    """Commit and restore of 4,096 leaves with loopkit's collector threshold and Python's.

    A model's shape: 2,048 layers of a weight and a bias (128 MiB). Each repeat runs
    every backend twice, paired: with the collector's first threshold at the opt-in
    tuning's `io_tuning.GC_THRESHOLD` around checkpoint I/O and at Python's 700, in
    turns first; the time
    the collector itself took (`gc.callbacks`) is shown beside each.
    """
    import gc

    from loopkit.plugins.checkpoint import io_tuning

    rng = np.random.default_rng(0)
    leaves, n = 4096, 128 * 2**20 // 4 // 4096
    state = {"layers": [{"w": jnp.asarray(rng.standard_normal(n, np.float32)),
                         "b": jnp.asarray(rng.standard_normal(n, np.float32))}
                        for _ in range(leaves // 2)]}
    like = abstract(state)
    root = Path(tempfile.mkdtemp(prefix="loopkit-ckpt-gc-", dir=args.dir))
    spent = [0.0, 0.0]  # collector time, start of the collection under way

    def clock(phase: str, info: dict) -> None:
        if phase == "start":
            spent[1] = time.perf_counter()
        else:
            spent[0] += time.perf_counter() - spent[1]

    ours, python = io_tuning.GC_THRESHOLD, gc.get_threshold()[0]
    res: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    gc.callbacks.append(clock)
    try:
        for name, cls in (("orbax", OrbaxBackend), ("npz", NpzBackend)):
            backend = cls(root / name)
            backend.save(0, state, {})  # warm-up
            backend.wait()
            step = 0
            for r in range(args.repeats):
                for threshold in ((ours, python) if r % 2 == 0 else (python, ours)):
                    step += 1
                    for op in ("commit", "restore"):
                        spent[0] = 0.0
                        t = time.perf_counter()
                        with io_tuning.checkpoint_io_tuning(gc_threshold=threshold):
                            if op == "commit":
                                backend.save(step, state, {})
                                backend.wait()
                            else:
                                jax.block_until_ready(backend.restore(step, like)[0])
                        res.setdefault((name, threshold, op), []).append(
                            (time.perf_counter() - t, spent[0]))
                    backend.delete(step)
            backend.close()
    finally:
        gc.callbacks.remove(clock)
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n4,096 leaves, 128 MiB: seconds (of them in the collector), median of {args.repeats}")
    print("| backend | first threshold during I/O | commit | restore |")
    print("|---|---|---|---|")
    for name in ("orbax", "npz"):
        for threshold in (ours, python):
            cells = []
            for op in ("commit", "restore"):
                got = res[(name, threshold, op)]
                cells.append(f"{statistics.median(t for t, _ in got):.2f} s "
                             f"({statistics.median(g for _, g in got):.2f} s)")
            print(f"| {name} | {threshold:,} | " + " | ".join(cells) + " |", flush=True)


def machine() -> str:
    def sh(cmd: str) -> str:
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
        except OSError:
            return "?"

    cpu = sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2").strip()
    mem = sh("free -h | awk '/Mem:/ {print $2}'")
    disk = sh(f"df -h {tempfile.gettempdir()} | awk 'NR==2 {{print $1\" \"$2}}'")
    return (f"{platform.platform()}, python {platform.python_version()}, jax {jax.__version__}, "
            f"{os.cpu_count()} CPUs ({cpu}), {mem} RAM, disk {disk}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    p.add_argument("--only", choices=("orbax", "npz"), default=None)
    p.add_argument("--sweep", action="store_true",
                   help="leaf counts 16-4,096 at 128 MiB, and 16 leaves at 512 MiB and 2 GiB")
    p.add_argument("--busy", action="store_true",
                   help="4,096 leaves committed and restored beside a thread busy in Python")
    p.add_argument("--gc", action="store_true",
                   help="4,096 leaves committed and restored with loopkit's collector "
                        "threshold and Python's")
    p.add_argument("--orbax", action="append", default=[], metavar="KEY=VALUE",
                   help="an OrbaxBackend option, e.g. use_compression=True")
    args = p.parse_args()
    args.orbax = {k: ast.literal_eval(v) for k, _, v in (o.partition("=") for o in args.orbax)}

    import orbax.checkpoint as ocp

    print(machine())
    print(f"orbax-checkpoint {ocp.__version__}, options {args.orbax or 'loopkit defaults'}")
    print(f"load average {os.getloadavg()}")
    if args.busy:
        busy(args)
        return
    if args.gc:
        gc_cost(args)
        return
    if args.sweep:
        sweep(args)
        print(f"load average {os.getloadavg()}")
        return
    res = run(args)
    how = res.pop("_cache")
    mb = args.mb

    def ratio(key: str) -> float:
        """Median over repeats of key / its reference measured in the same repeat."""
        ref = f"raw read, just before {key}"
        if ref not in res:
            ref = "raw read" if "read" in key else "raw write + fsync"
        return statistics.median(v / r for v, r in zip(res[key], res[ref]))

    print(f"\nstate {mb} MB, median of {args.repeats}; cold reads via {how}; ratio: median of "
          "per-repeat ratios to the raw write of that repeat, or to the raw read made just "
          "before that restore\n")
    print(f"{'':42} {'seconds':>9} {'MB/s':>8}  ratio{'':13} every repeat (s)")
    for key, values in res.items():
        sec = statistics.median(values)
        ref = "raw read" if ("restore" in key or "read" in key) else "raw write"
        every = " ".join(f"{v:.3f}" for v in values)
        print(f"{key:42} {sec:9.4f} {mb / sec:8.0f}  {ratio(key):5.2f}x {ref:9}  {every}")
    if "orbax async: save() blocks" in res:
        block = ratio("orbax async: save() blocks")
        commit = ratio("orbax: committed (durable)")
        restore = ratio("orbax restore")
        print("\ngoals (DESIGN.md, Checkpoints):")
        print(f"  save() blocks <= 5% of raw write+fsync: {100 * block:.1f}%"
              f" {'ok' if block <= 0.05 else 'MISSED'}")
        print(f"  committed within 2x raw write+fsync: {commit:.2f}x"
              f" {'ok' if commit <= 2 else 'MISSED'}")
        print(f"  restore within 1.5x raw read: {restore:.2f}x"
              f" {'ok' if restore <= 1.5 else 'MISSED'}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
