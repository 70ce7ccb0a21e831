"""Crash atomicity, fsync order and read sizes of the built-in backends, in real subprocesses.

- A process saving checkpoints back to back is killed with SIGKILL at seeded
  moments; a fresh backend then lists only complete checkpoints, and removes the
  dead saves' temporaries.
- A save runs under ``strace``: every file is fsynced before the rename that
  publishes the checkpoint, and the directory is fsynced after it. (These tests
  need ``strace``, ``apt-get install -y strace``, as .ci/run does: without it they
  fail, never skip.)
- orbax's partial restore does not materialise an unchosen big leaf (peak RSS).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from loopkit.plugins.checkpoint.backends.npz import NpzBackend
from loopkit.plugins.checkpoint.backends.temporaries import saving_lock
from loopkit.plugins.checkpoint.backends.orbax import OrbaxBackend
from loopkit.testing import free_port

BACKENDS = {"npz": NpzBackend, "orbax": OrbaxBackend}
MODULES = {"npz": "loopkit.plugins.checkpoint.backends.npz:NpzBackend",
           "orbax": "loopkit.plugins.checkpoint.backends.orbax:OrbaxBackend"}

_PRELUDE = """
import importlib, sys
import numpy as np
module, _, cls = sys.argv[1].partition(":")
Backend = getattr(importlib.import_module(module), cls)
directory = sys.argv[2]
"""


def _child_env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    return env


def _python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=timeout, env=_child_env())


# -- SIGKILL during saves ------------------------------------------------------------

_SAVER = """
import itertools
import jax.numpy as jnp
backend = Backend(directory)
n = int(sys.argv[3])
print("ready", flush=True)
for step in itertools.count(1):
    state = {"a": jnp.full((n,), step, jnp.float32), "b": [np.full((n // 4,), step, np.int16)],
             "c": step}
    backend.save(step, state, {"step": step})
"""


def _check_complete(backend, step: int, n: int) -> None:
    state, meta = backend.restore(step, None)
    assert meta == {"step": step}
    assert state["c"] == step
    a, b = np.asarray(state["a"]), np.asarray(state["b"]["0"])
    assert a.shape == (n,) and b.shape == (n // 4,)
    assert (a == step).all() and (b == step).all(), f"step {step} holds another step's data"


@pytest.mark.parametrize("name", ["npz", "orbax"])
def test_sigkill_during_saves_leaves_only_complete_checkpoints(name, tmp_path):
    rng = random.Random(f"sigkill-{name}")
    n = 2 * 1024 * 1024  # 8 MB + 1 MB a save: most of the child's time is spent saving
    interrupted = 0
    for kill in range(3):
        directory = tmp_path / f"run{kill}"
        proc = subprocess.Popen(
            [sys.executable, "-c", _PRELUDE + textwrap.dedent(_SAVER), MODULES[name],
             str(directory), str(n)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_child_env())
        try:
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
            # the first save has begun (the backend makes its directory then: orbax's
            # import before it takes seconds on a loaded machine), then a kill anywhere
            deadline = time.monotonic() + 120
            while not directory.exists() and proc.poll() is None:
                assert time.monotonic() < deadline, "no save began within 120 s"
                time.sleep(0.01)
            time.sleep(rng.uniform(0.2, 1.2))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        left = sorted(os.listdir(directory))
        backend = BACKENDS[name](directory)
        try:
            steps = backend.steps()
            names = {backend.path(s).name for s in steps}
            temporaries = [x for x in left if x not in names]
            interrupted += bool(temporaries)
            for step in steps:
                _check_complete(backend, step, n)
            # the dead save's temporaries went when the fresh backend started
            assert sorted(os.listdir(directory)) == sorted(names), left
        finally:
            backend.close()
    assert interrupted, "no kill landed inside a save: the test proved nothing"


@pytest.mark.parametrize("name", ["npz", "orbax"])
def test_live_saves_keep_their_temporaries(name, tmp_path):
    """Only a dead save's temporaries are removed: a live saver holds the directory's lock."""
    temps = {"npz": [".model.ckpt-3.npz.tmp-host-1"],
             "orbax": ["model.ckpt-3.orbax-checkpoint-tmp", ".model.ckpt-4.replaced"]}[name]
    for t in temps:
        (tmp_path / t).mkdir()
        (tmp_path / t / "data").write_bytes(b"x")
    (tmp_path / "unrelated.txt").write_text("keep")
    with saving_lock(tmp_path):  # as a save in another process or thread would hold it
        BACKENDS[name](tmp_path).close()
        assert all((tmp_path / t).exists() for t in temps)
    BACKENDS[name](tmp_path).close()
    assert os.listdir(tmp_path) == ["unrelated.txt"]


# -- fsync order under strace ----------------------------------------------------------

_ONE_SAVE = """
import jax.numpy as jnp
backend = Backend(directory)
state = {"params": {"w": jnp.arange(50000, dtype=jnp.float32), "b": jnp.ones(7, jnp.bfloat16)},
         "opt": [np.arange(10, dtype=np.int8), 3.5], "n": 1}
backend.save(1, state, {"position": 1})
backend.wait()
backend.close()
"""

_SYSCALL = re.compile(r"^(\d+)\s+(\w+)\((.*)\)\s+=\s+(-?\d+)")
_FD_PATH = re.compile(r"^\d+<(.*)>$")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _strace(name: str, directory: Path, tmp_path: Path) -> list[tuple[str, list[str]]]:
    """Run one save under strace; the (syscall, paths) it made, in order."""
    # A missing strace fails the test: skipping it would let CI pass without ever
    # checking the durability of a commit (.ci/run installs it).
    assert shutil.which("strace") is not None, \
        "strace is not installed: apt-get install -y strace (this test needs it to check " \
        "the fsync/rename order of a commit)"
    out = tmp_path / "trace.txt"
    proc = subprocess.run(
        ["strace", "-f", "-qq", "-y", "-o", str(out),
         "-e", "trace=fsync,fdatasync,rename,renameat,renameat2",
         sys.executable, "-c", _PRELUDE + textwrap.dedent(_ONE_SAVE), MODULES[name],
         str(directory)],
        capture_output=True, text=True, timeout=120, env=_child_env())
    assert proc.returncode == 0, (
        f"the save under strace failed (strace needs ptrace: a container may need "
        f"--cap-add SYS_PTRACE): {proc.stderr[-3000:]}")
    return _parse_trace(out.read_text())


def _parse_trace(text: str) -> list[tuple[str, list[str]]]:
    """(syscall, paths) of each successful call, in the order the calls completed."""
    calls, pending = [], {}
    for line in text.splitlines():
        # a call interrupted by another thread's: "<unfinished ...>", then "<... resumed>"
        pid = line.split(None, 1)[0]
        if line.endswith("<unfinished ...>"):
            pending[pid] = line[: -len("<unfinished ...>")].rstrip()
            continue
        resumed = re.match(r"^\d+\s+<\.\.\. \w+ resumed>(.*)$", line)
        if resumed:
            line = pending.pop(pid) + resumed.group(1)
        m = _SYSCALL.match(line)
        if not m or int(m.group(4)) < 0:
            continue  # failed calls, exit notices
        call, args = m.group(2), m.group(3)
        if call in ("fsync", "fdatasync"):
            fd = _FD_PATH.match(args.strip())
            assert fd, f"strace -y gave no path for {line!r}"
            calls.append((call, [fd.group(1)]))
        else:
            calls.append(("rename", _QUOTED.findall(args)[-2:]))
    return calls


@pytest.mark.parametrize("name", ["npz", "orbax"])
def test_every_file_is_fsynced_before_the_publishing_rename(name, tmp_path):
    directory = (tmp_path / "ckpt").resolve()
    calls = _strace(name, directory, tmp_path)
    final = str(directory / {"npz": "model.ckpt-1.npz", "orbax": "model.ckpt-1"}[name])
    publishing = [i for i, (c, p) in enumerate(calls) if c == "rename" and p[1] == final]
    assert len(publishing) == 1, calls
    at = publishing[0]
    tmp = calls[at][1][0]
    assert re.fullmatch(r"[^/]*", os.path.relpath(tmp, directory)), tmp  # a sibling name
    synced_before = {p[0] for c, p in calls[:at] if c != "rename"}
    synced_after = {p[0] for c, p in calls[at + 1:] if c != "rename"}

    # every file (and for a tree, every directory) of the checkpoint, under its temporary name
    if os.path.isdir(final):
        wanted = {tmp}
        for root, dirs, files in os.walk(final):
            rel = os.path.relpath(root, final)
            base = tmp if rel == "." else os.path.join(tmp, rel)
            wanted |= {os.path.join(base, f) for f in files + dirs}
        assert len(wanted) > 5  # orbax's data, manifest and metadata files
    else:
        wanted = {tmp}
    missing = sorted(wanted - synced_before)
    assert not missing, f"not fsynced before the publishing rename: {missing}"
    assert str(directory) in synced_after, "the directory was not fsynced after the rename"
    # nothing of the checkpoint is written after it is published
    assert not any(p[0].startswith(final + "/") or p[0] == final for c, p in calls[at + 1:])


# -- partial reads ---------------------------------------------------------------------

_PARTIAL = """
backend = Backend(directory)
def peak():  # this process's peak RSS in MB (VmHWM: unlike ru_maxrss, not the parent's)
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024
# the first read imports orbax and tensorstore and builds the backend's readers (built
# lazily, at the first read or save): the peak measured is the reads' alone
backend.restore_leaves(1, ["small"])
base = peak()
small = backend.restore_leaves(1, ["small"])["small"]
assert small.tolist() == [1, 2, 3], small
after_small = peak()
big = backend.restore_leaves(1, ["big"])["big"]
assert big.shape == (int(sys.argv[3]),) and big[-1] == np.float32(big.shape[0] - 1)
after_big = peak()
print(after_small - base, after_big - after_small)
"""


def test_orbax_partial_restore_leaves_big_unchosen_leaf_unread(tmp_path):
    n = 32 * 1024 * 1024  # 128 MB of float32
    backend = OrbaxBackend(tmp_path)
    backend.save(1, {"big": np.arange(n, dtype=np.float32), "small": np.array([1, 2, 3])}, {})
    backend.close()
    proc = _python(_PARTIAL, MODULES["orbax"], str(tmp_path), str(n), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    small_mb, big_mb = map(float, proc.stdout.split())
    assert big_mb > 100, f"reading the big leaf raised the peak by {big_mb} MB only"
    assert small_mb < 40, f"reading only the small leaf raised the peak by {small_mb} MB"


# -- several processes -------------------------------------------------------------------

_DISTRIBUTED = """
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
n, i, port = map(int, sys.argv[3:6])
jax.distributed.initialize(f"127.0.0.1:{port}", n, i, initialization_timeout=60)
from jax.sharding import NamedSharding, PartitionSpec as P
from loopkit.state.pytree import abstract
mesh = jax.make_mesh((jax.device_count(),), ("d",))
rows = NamedSharding(mesh, P("d"))
full = np.arange(24, dtype=np.float32).reshape(8, 3)
w = jax.make_array_from_callback(full.shape, rows, lambda index: full[index])
r = jax.make_array_from_callback((4,), NamedSharding(mesh, P()), lambda index: np.ones(4)[index])
state = {"w": w, "r": r, "n": 5}
backend = Backend(directory)
backend.save(1, state, {"p": 1})
backend.wait()
assert backend.steps() == [1], backend.steps()
restored, meta = backend.restore(1, abstract(state))
assert meta == {"p": 1} and restored["n"] == 5
assert restored["w"].sharding == rows
for shard in restored["w"].addressable_shards:
    np.testing.assert_array_equal(shard.data, full[shard.index])
backend.close()
print("OK", jax.process_index(), flush=True)
"""


def test_orbax_saves_from_several_processes_and_restores_in_one(tmp_path):
    """Two jax.distributed processes (CPU, gloo) save a sharded state; one process reads it all."""
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(_DISTRIBUTED), MODULES["orbax"],
         str(tmp_path), "2", str(i), str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_child_env())
        for i in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"OK {i}" in out, err[-3000:]
    backend = OrbaxBackend(tmp_path)
    state, meta = backend.restore(1, None)
    np.testing.assert_array_equal(state["w"], np.arange(24, dtype=np.float32).reshape(8, 3))
    np.testing.assert_array_equal(state["r"], np.ones(4, np.float32))
    assert meta == {"p": 1} and state["n"] == 5
    assert sorted(os.listdir(tmp_path)) == ["model.ckpt-1"]
    backend.close()
