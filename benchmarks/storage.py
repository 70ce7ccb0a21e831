"""Cost of a save to an s3:// logdir: loopkit's staged upload against the raw upload.

    python benchmarks/storage.py [--mb 64] [--leaves 16] [--repeats 3]

Starts moto's S3 server on 127.0.0.1 (in this process, as the tests do), then
for each backend measures, per save of the same state: how long `save` holds the
caller (the loop), how long until it is committed (save + wait: local write,
upload, marker), against the raw costs of the same bytes measured here: a
durable local write (write + fsync) and one upload of them as a single object
(s3fs ``pipe``). Ratios are medians over the repeats. Against moto the upload's
bandwidth is moto's (a Python server on the same cores), not a real store's.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--leaves", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    port = _port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="x",
                      AWS_SECRET_ACCESS_KEY="x", AWS_REGION="us-east-1")
    import boto3
    import jax.numpy as jnp
    import s3fs

    from loopkit.plugins.checkpoint.backends.npz import NpzBackend
    from loopkit.plugins.checkpoint.backends.orbax import OrbaxBackend
    from loopkit.plugins.checkpoint.backends.staged import StagedBackend

    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    n = args.mb * 2**20 // 4 // args.leaves
    rng = np.random.default_rng(0)
    state = {f"l{i}": jnp.asarray(rng.standard_normal(n, dtype=np.float32))
             for i in range(args.leaves)}
    raw = b"".join(np.asarray(v).tobytes() for v in state.values())
    fs = s3fs.S3FileSystem()

    def raw_local(tmp: Path) -> float:
        t0 = time.perf_counter()
        with open(tmp / "raw", "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - t0

    def raw_upload() -> float:
        t0 = time.perf_counter()
        fs.pipe_file(f"{bucket}/raw", raw)
        return time.perf_counter() - t0

    print(f"state: {args.leaves} leaves, {len(raw) / 2**20:.0f} MiB; repeats {args.repeats}")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        local_w = statistics.median(raw_local(tmp) for _ in range(args.repeats))
        upload = statistics.median(raw_upload() for _ in range(args.repeats))
        print(f"raw durable local write {local_w * 1e3:.0f} ms; raw upload (one object) "
              f"{upload * 1e3:.0f} ms")
        for name, make in (("npz", NpzBackend), ("orbax", OrbaxBackend)):
            for where in ("local", "s3"):
                if where == "local":
                    backend = make(tmp / f"{name}-local", "model.ckpt")
                else:
                    url = f"s3://{bucket}/{name}"
                    backend = StagedBackend(url, "model.ckpt",
                                            lambda p, make=make: make(p, "model.ckpt"))
                holds, commits = [], []
                for step in range(args.repeats):
                    t0 = time.perf_counter()
                    backend.save(step, state, {})
                    t1 = time.perf_counter()
                    backend.wait()
                    t2 = time.perf_counter()
                    holds.append(t1 - t0)
                    commits.append(t2 - t0)
                backend.close()
                hold, commit = statistics.median(holds), statistics.median(commits)
                base = local_w if where == "local" else upload
                rows.append((name, where, hold, commit, commit / base))
    server.stop()
    print(f"{'backend':8} {'where':6} {'save holds':>11} {'commit':>9}  commit / raw")
    for name, where, hold, commit, ratio in rows:
        basis = "durable write" if where == "local" else "upload"
        print(f"{name:8} {where:6} {hold * 1e3:9.0f} ms {commit * 1e3:7.0f} ms  "
              f"{ratio:.2f}x raw {basis}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
