"""A state of many leaves on a bucket from many processes: a database per process.

Real `jax.distributed` processes on 127.0.0.1 (one CPU device each) against the local
servers of tests/plugins/test_storage_buckets.py, through the staged orbax backend
(tests/plugins/leaves_worker.py): each process writes its part of a checkpoint as its
own OCDBT database, a few objects whatever the leaf count, and the chief's commit
merges them; a restore downloads only the spans of the per-process files its process
reads. Checkpoints of the earlier per-leaf layout stay readable.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loopkit.plugins.checkpoint.backends.staged import MARKER
from loopkit.testing import free_port

import distributed_jobs as jobs  # waiting for the processes, reading what they printed
from bucket_servers import one_store  # the fixtures: conftest.py
from distributed_jobs import read

WORKER = Path(__file__).with_name("leaves_worker.py")
TIMEOUT = 240  # a deadlock fails the test instead of hanging CI


#: a process's objects in a checkpoint: its database's manifest and data files. How many
#: data files a commit of the compacted database makes is tensorstore's choice (1-4 seen,
#: with the timing of orbax's writes), not the leaf count's: the per-leaf layout wrote
#: 8,195 objects a process at 4,096 leaves
PER_PROCESS = 6


def start(url, n, leaves, mode, tmp_path, *extra):
    port = free_port()
    procs = []
    for i in range(n):
        out = open(tmp_path / f"{mode}-{port}-p{i}.out", "w+")
        err = open(tmp_path / f"{mode}-{port}-p{i}.err", "w+")
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), url, str(n), str(i), str(port), str(leaves), mode,
             *extra], stdout=out, stderr=err, text=True,
            env=dict(os.environ, JAX_PLATFORMS="cpu",
                     XLA_FLAGS="--xla_force_host_platform_device_count=1"))
        proc.files = (out, err)
        procs.append(proc)
    return procs


def until(procs, line):
    """Wait until every process has printed ``line``."""
    deadline = time.monotonic() + TIMEOUT
    for p in procs:
        while line not in read(p)[0]:
            if p.poll() is not None or time.monotonic() > deadline:
                for q in procs:
                    q.kill()
                pytest.fail(f"no {line!r}: exit {p.poll()}\n" + "\n".join(read(p))[-3000:])
            time.sleep(0.1)


def finish(procs):
    """Each process's stdout, once all have exited 0."""
    return [out for _, out, _ in jobs.finish(procs, timeout=TIMEOUT)]


def save_then_kill(url, n, leaves, tmp_path, *extra):
    """Steps 1 and 2 committed by ``n`` processes, every process SIGKILLed in step 3's."""
    procs = start(url, n, leaves, "save", tmp_path, *extra)
    until(procs, "SAVING 3")
    time.sleep(0.3)  # into step 3's write or upload
    for p in procs:
        p.kill()
    for p in procs:
        p.wait(timeout=30)


def restored(url, n, leaves, tmp_path, *extra):
    """(step, equal, fetched objects, objects, bytes downloaded) of each process's restore."""
    outs = finish(start(url, n, leaves, "restore", tmp_path, *extra))
    found = [re.search(r"RESTORED (\d+) equal=(\w+) fetched=(\d+)/(\d+) bytes=(\d+)", out)
             for out in outs]
    assert all(found), outs
    return [(int(m[1]), m[2] == "True", int(m[3]), int(m[4]), int(m[5])) for m in found]


def test_many_leaves_from_two_processes_are_a_few_objects_each_and_resume_bitwise(
        store, tmp_path):
    leaves = 4096  # 32 MiB: 3,072 leaves sharded over both processes, 1,024 replicated
    url = store.url("run")
    save_then_kill(url, 2, leaves, tmp_path)
    objects = [k.split("/", 2)[2] for k in store.objects("run/model.ckpt-2/")]
    assert MARKER in objects
    per_process = {i: [o for o in objects if o.startswith(f"ocdbt.process_{i}/")]
                   for i in (0, 1)}
    # a few objects per process (a manifest and a data file or two), not one per leaf
    counts = {i: len(v) for i, v in per_process.items()}
    assert all(1 <= n <= PER_PROCESS for n in counts.values()), (counts, sorted(objects))
    # with the metadata, the merged database, each process's report and the marker
    assert len(objects) <= 12 + PER_PROCESS * 2, sorted(objects)

    results = restored(url, 2, leaves, tmp_path)
    step = results[0][0]
    assert step in (2, 3) and all(r[0] == step and r[1] for r in results), results


@one_store("gs")
def test_a_restore_downloads_the_spans_its_process_reads(store, tmp_path):
    """8 leaves of 4 MiB (32 MiB), 6 sharded over 2 processes, 2 replicated: each process
    reads the replicated ones and its own halves, 20 MiB (12 MiB of the other's are not
    fetched); one process alone (the job shrank) fetches all."""
    big = ("--values", str(1 << 20))
    url = store.url("run")
    save_then_kill(url, 2, 8, tmp_path, *big)
    results = restored(url, 2, 8, tmp_path, *big)
    assert all(r[1] and r[0] == results[0][0] for r in results), results
    assert all(20 * 2**20 <= r[4] < 22 * 2**20 for r in results), results
    (one,) = restored(url, 1, 8, tmp_path, *big)
    assert one[1] and one[4] >= 32 * 2**20, one


@one_store("s3")
def test_a_checkpoint_of_the_per_leaf_layout_is_restored(store, tmp_path):
    """The layout earlier versions wrote with many processes (one zarr3 array per leaf,
    each process its own chunks) is read by the new code, on 2 processes and on 1."""
    leaves = 64
    url = store.url("run")
    save_then_kill(url, 2, leaves, tmp_path, "--per-leaf")
    objects = [k.split("/", 2)[2] for k in store.objects("run/model.ckpt-2/")]
    assert not any(o.startswith("ocdbt.") for o in objects)
    assert "x0000/c/1" in objects  # process 1's chunk of a sharded leaf: per leaf
    results = restored(url, 2, leaves, tmp_path)
    assert all(r[1] and r[0] == results[0][0] for r in results), results
    assert all(r[2] < r[3] for r in results), results  # its own chunks only
    (one,) = restored(url, 1, leaves, tmp_path)
    assert one[1], one


def test_four_processes_write_a_database_each_resume_bitwise_and_restore_on_two(
        store, tmp_path):
    leaves = 4096
    url = store.url("run")
    save_then_kill(url, 4, leaves, tmp_path)
    objects = [k.split("/", 2)[2] for k in store.objects("run/model.ckpt-2/")]
    for i in range(4):
        mine = [o for o in objects if o.startswith(f"ocdbt.process_{i}/")]
        assert 1 <= len(mine) <= PER_PROCESS, (i, mine)
    assert len(objects) <= 12 + PER_PROCESS * 4, sorted(objects)
    results = restored(url, 4, leaves, tmp_path)
    step = results[0][0]
    assert step in (2, 3) and all(r[0] == step and r[1] for r in results), results
    # each process fetched its part of the per-process files, not every object
    assert all(r[2] < r[3] for r in results), results
    results = restored(url, 2, leaves, tmp_path)  # the job shrank to 2
    assert all(r[1] and r[0] == step for r in results), results


@one_store("gs")
def test_plain_orbax_restores_what_the_processes_wrote(store, tmp_path):
    """The checkpoint on the store is orbax's own: downloaded as it is, orbax's
    `StandardCheckpointer` on two processes restores it into the shardings, bit for bit
    (the leaves spread over processes were written by loopkit's batched handler)."""
    leaves = 256
    url = store.url("run")
    save_then_kill(url, 2, leaves, tmp_path)
    local = tmp_path / "downloaded"
    store.fs.get(f"{store.bucket}/run/model.ckpt-2", str(local / "model.ckpt-2"),
                 recursive=True)
    assert (local / "model.ckpt-2" / "_sharding").exists()  # orbax's shardings, as it writes them
    outs = finish(start(str(local / "model.ckpt-2"), 2, leaves, "orbax", tmp_path))
    assert all("ORBAX 2 equal=True" in out for out in outs), outs
