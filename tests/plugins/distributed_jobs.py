"""Real `jax.distributed` jobs on localhost (CPU, gloo) for the tests: start N processes
of tests/workers/distributed_worker.py, wait for them, read what they printed and saved.

Shared by tests/test_distributed.py, tests/test_peers.py and the bucket tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from loopkit.testing import free_port

WORKER = Path(__file__).resolve().parents[1] / "workers" / "distributed_worker.py"
TIMEOUT = 150  # a deadlock fails the test instead of hanging CI


def start(logdir, out, n, steps, *extra, sleeps=None, devices=1):
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    procs = []
    for i in range(n):
        args = [sys.executable, str(WORKER), str(logdir), str(out / f"p{i}.npz"), str(n), str(i),
                str(port), str(steps), *extra]
        if sleeps:
            args += ["--step-sleep", str(sleeps[i])]
        # files, not pipes: a chatty process must never block on a full pipe
        stdout = open(out / f"p{i}.{port}.out", "w+")
        stderr = open(out / f"p{i}.{port}.err", "w+")
        proc = subprocess.Popen(args, stdout=stdout, stderr=stderr, text=True, env=env)
        proc.files = (stdout, stderr)
        procs.append(proc)
    return procs


def read(proc):
    texts = []
    for f in proc.files:
        f.seek(0)
        texts.append(f.read())
    return texts


def finish(procs, ok=True, timeout=TIMEOUT):
    """Wait for ``procs`` (killed after ``timeout`` s); (exit code, stdout, stderr) of each,
    each asserted to have exited 0 (``ok``) or not."""
    outs = []
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p in procs:
        out, err = read(p)
        outs.append((p.returncode, out, err))
    for code, out, err in outs:
        assert (code == 0) == ok, f"exit {code}\n{out}\n{err[-3000:]}"
    return outs


def wait_ready(procs):
    deadline = time.monotonic() + TIMEOUT
    for p in procs:
        while "READY" not in read(p)[0]:
            if p.poll() is not None or time.monotonic() > deadline:
                for q in procs:
                    q.kill()
                out, err = read(p)
                pytest.fail(f"process did not start: exit {p.poll()}\n{out}\n{err[-3000:]}")
            time.sleep(0.1)


def load(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def plan(path, p0, p1):
    for i, lines in enumerate((p0, p1)):
        Path(f"{path}.p{i}").write_text("\n".join(lines) + "\n")
    return ["--plan", str(path)]


def local_steps(directory):
    """The steps a tier's `checkpoint` file lists."""
    from loopkit.plugins.checkpoint.tf_file import read_state

    state = read_state(directory)
    return set() if state is None else {s for s, _ in state.listed}
