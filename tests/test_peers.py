"""Peer copies of the local tier (`Config.local_replicas`): real `jax.distributed`
processes on 127.0.0.1, SIGKILLed, a machine replaced (its local directory wiped)."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import loopkit

import distributed_jobs as d  # tests/plugins: real jax.distributed jobs on localhost
from bucket_servers import one_store, s3_endpoint, store  # noqa: F401 - fixtures

COMMON = ("--save-steps", "10", "--shard-state", "--step-sleep", "0.05", "--stateful")


def plans(path, *per_process):
    """One plan file per process (as test_distributed.plan, for any process count)."""
    for i, lines in enumerate(per_process):
        Path(f"{path}.p{i}").write_text("\n".join(lines) + "\n")
    return ["--plan", str(path)]


def copies(local, holder, owner):
    """The steps of `owner`'s peer copies that process `holder` keeps."""
    where = local / f"process-{holder}" / f"peer-{owner}"
    return {int(p.name.rsplit("-", 1)[1]) for p in where.glob("model.ckpt-*")} \
        if where.is_dir() else set()


def unreadable(run, step):
    """The durable checkpoint of `step` stays listed, but any read of it fails: its
    files are moved away (chmod would not stop root)."""
    ckpt = run / f"model.ckpt-{step}"
    ckpt.rename(run.parent / f"moved-{step}")
    ckpt.mkdir()


def ready(outs):
    """(step, tier, position) each process started from."""
    found = []
    for _, out, _ in outs:
        lines = dict(line.split(" ", 1) for line in out.splitlines()
                     if line.split(" ", 1)[0] in ("READY", "TIER", "POS"))
        found.append((int(lines["READY"].split()[0]), lines["TIER"], int(lines["POS"])))
    return found


def sessions(run):
    cli = subprocess.run([sys.executable, "-m", "loopkit", "goodput", str(run), "--sessions",
                          "--json"], capture_output=True, text=True, timeout=60, check=False)
    assert cli.returncode == 0, cli.stderr
    return json.loads(cli.stdout)


def test_a_replaced_machine_resumes_from_its_peer_bitwise(tmp_path):
    """Two processes, `w` sharded over both, each reading its own data through a
    stateful iterator, `local_replicas=1`: SIGKILLed after local saves newer than the
    durable one, process 1's machine replaced (its local directory wiped) and the
    durable checkpoint made unreadable: both resume from the newest local step,
    process 1's part received from process 0's copy, bitwise equal to a run never
    interrupted, and the ledger says "peer"."""
    full, run, local = (tmp_path / n for n in ("full", "run", "local"))
    for x in (full, run):
        x.mkdir()
    d.finish(d.start(full, full, 2, 30, *COMMON, devices=2))
    tiers = ("--local-dir", str(local), "--local-replicas", "1",
             *plans(run / "plan", ["crash 14", "ok"], ["crash 14", "ok"]))
    d.finish(d.start(run, run, 2, 30, *COMMON, *tiers, devices=2), ok=False)  # SIGKILLed
    assert loopkit.latest_checkpoint(run)[0] == 10
    own = [d.local_steps(local / f"process-{i}") for i in range(2)]
    assert max(own[0] & own[1]) == 12, own  # every 3 steps, all committed before the kill
    assert 12 in copies(local, 1, 0) and 12 in copies(local, 0, 1)
    assert len(copies(local, 0, 1)) <= 2  # max_to_keep_local, as the owner's
    shutil.rmtree(local / "process-1")  # a replaced machine
    unreadable(run, 10)

    outs = d.finish(d.start(run, run, 2, 30, *COMMON, *tiers, devices=2))
    assert ready(outs) == [(12, "peer", 12)] * 2, outs
    assert all("RESULT 30 max_steps" in out for _, out, _ in outs), outs
    for k in ("w", "b"):
        assert d.load(run / "p0.npz")[k].tobytes() == d.load(full / "p0.npz")[k].tobytes(), k
    restored = [r for r in sessions(run) if r["restored_step"] is not None]
    assert [(r["restored_step"], r["restored_tier"]) for r in restored] == [(12, "peer")]
    assert min(max(copies(local, 0, 1)), max(copies(local, 1, 0))) > 12  # copying went on


class Requests(logging.Handler):
    """The requests the in-process S3 server (moto, on werkzeug) answers, from its own
    request log: (method, path)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.seen = []

    def emit(self, record):
        if m := re.search(r'"([A-Z]+) (\S+) HTTP/[0-9.]+"', record.getMessage()):
            self.seen.append((m.group(1), m.group(2)))

    def __enter__(self):
        self.logger = logging.getLogger("werkzeug")
        self.was = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.was)


@pytest.fixture
def default_lease(monkeypatch):
    """The lease's default settings: a killed job's restart takes its lease over at once
    (the processes inherit this environment; no job id of the test runner's own)."""
    from loopkit.process.logdir_lock import JOB_ENVS

    for name in ("LOOPKIT_LEASE_RENEW_SECS", *JOB_ENVS):
        monkeypatch.delenv(name, raising=False)


@one_store("s3")
def test_a_replaced_machine_resumes_from_its_peer_with_the_durable_tier_on_s3(
        store, tmp_path, default_lease):
    """The same with the durable tier on the local S3 server: the restart reads none of
    the durable checkpoint's objects, counted on the server (its request log: no GET of
    any key under the checkpoint's prefix; listings, existence checks and the
    `checkpoint` file aside), and those objects are gone besides (deleted, the commit
    marker aside, so the step still counts as committed): a read would fail."""
    full, run, local = (tmp_path / n for n in ("full", "run", "local"))
    for x in (full, run):
        x.mkdir()
    url = store.url("run")
    d.finish(d.start(full, full, 2, 30, *COMMON, devices=2))
    tiers = ("--local-dir", str(local), "--local-replicas", "1",
             *plans(run / "plan", ["crash 14", "ok"], ["crash 14", "ok"]))
    d.finish(d.start(url, run, 2, 30, *COMMON, *tiers, devices=2), ok=False)  # SIGKILLed
    assert loopkit.latest_checkpoint(url)[0] == 10
    assert 12 in copies(local, 0, 1)
    shutil.rmtree(local / "process-1")  # a replaced machine
    prefix = "run/model.ckpt-10/"
    objects = [k for k in store.objects(prefix) if not k.endswith("/commit_success.txt")]
    assert objects, store.objects("run/")
    store.fs.rm([f"{store.bucket}/{k}" for k in objects])

    with Requests() as served:
        outs = d.finish(d.start(url, run, 2, 30, *COMMON, *tiers, devices=2))
    assert ready(outs) == [(12, "peer", 12)] * 2, outs
    assert all("RESULT 30 max_steps" in out for _, out, _ in outs), outs
    for k in ("w", "b"):
        assert d.load(run / "p0.npz")[k].tobytes() == d.load(full / "p0.npz")[k].tobytes(), k
    path = f"/{store.bucket}/{prefix}"
    assert any(m == "GET" and p.startswith(f"/{store.bucket}/run/checkpoint")
               for m, p in served.seen), served.seen  # the log saw this job's requests
    read = [(m, p) for m, p in served.seen if m == "GET" and p.startswith(path)]
    assert read == [], read
    restored = [r for r in sessions(url) if r["restored_step"] is not None]
    assert [(r["restored_step"], r["restored_tier"]) for r in restored] == [(12, "peer")]


def test_a_peer_killed_while_copying_leaves_no_partial_copy_counted(tmp_path):
    """Process 1 is SIGKILLed while its part of local step 15 is on its way to process
    0 (one file arrived), then the job, and process 1's machine is replaced: the partial
    copy, under a temporary name, is not counted (step 15 has no complete part of
    process 1 anywhere); the job resumes from step 12, complete through process 0's
    copy, bitwise equal to a run never interrupted, and the partial copy is removed."""
    full, run, local = (tmp_path / n for n in ("full", "run", "local"))
    for x in (full, run):
        x.mkdir()
    d.finish(d.start(full, full, 2, 30, *COMMON, devices=2))
    tiers = ("--local-dir", str(local), "--local-replicas", "1")
    procs = d.start(run, run, 2, 30, *COMMON, *tiers, "--die-copying", "1:15", devices=2)
    try:
        procs[1].wait(timeout=d.TIMEOUT)
    finally:
        procs[0].kill()  # the rest of the job, as a scheduler restarting it would
    outs = d.finish(procs, ok=False)
    assert "DYING copying 15" in outs[1][1], outs
    held = local / "process-0" / "peer-1"
    partial = [p.name for p in held.iterdir() if p.name.startswith(".model.ckpt-15.incoming-")]
    assert partial and 15 not in copies(local, 0, 1) and 12 in copies(local, 0, 1), \
        sorted(p.name for p in held.iterdir())
    assert 15 in d.local_steps(local / "process-1")  # committed by its owner, then lost
    shutil.rmtree(local / "process-1")  # a replaced machine

    outs = d.finish(d.start(run, run, 2, 30, *COMMON, *tiers, devices=2))
    assert ready(outs) == [(12, "peer", 12)] * 2, outs
    for k in ("w", "b"):
        assert d.load(run / "p0.npz")[k].tobytes() == d.load(full / "p0.npz")[k].tobytes(), k
    assert not any(p.name.startswith(".") for p in held.iterdir())  # removed at the start


def test_four_processes_resume_from_peers_until_two_neighbours_are_lost(tmp_path):
    """Four processes in a ring with `local_replicas=1`, SIGKILLed after step 14 (local
    12, durable 10). One replaced machine resumes from its successor's copy of its part;
    from the same wreck with two neighbours replaced (process 1's only copy was on
    process 2) the job falls back to the durable tier. The two resumed runs end bitwise
    equal: a part from a peer is the state the durable path trains to."""
    run, local = tmp_path / "run", tmp_path / "local"
    run.mkdir()
    common = ("--save-steps", "10", "--shard-state", "--stateful")  # four are slow enough
    tiers = ("--local-dir", str(local), "--local-replicas", "1")
    d.finish(d.start(run, run, 4, 20, *common, *tiers,
                     *plans(run / "plan", *[["crash 14"]] * 4)), ok=False)
    assert loopkit.latest_checkpoint(run)[0] == 10
    shutil.copytree(run, tmp_path / "run2")
    shutil.copytree(local, tmp_path / "local2")

    shutil.rmtree(local / "process-2")
    unreadable(run, 10)
    outs = d.finish(d.start(run, run, 4, 20, *common, *tiers))
    assert ready(outs) == [(12, "peer", 12)] * 4, outs

    run2, local2 = tmp_path / "run2", tmp_path / "local2"
    shutil.rmtree(local2 / "process-1")
    shutil.rmtree(local2 / "process-2")
    outs = d.finish(d.start(run2, run2, 4, 20, *common, "--local-dir", str(local2),
                            "--local-replicas", "1"))
    assert ready(outs) == [(10, "durable", 10)] * 4, outs
    for k in ("w", "b"):
        assert d.load(run / "p0.npz")[k].tobytes() == d.load(run2 / "p0.npz")[k].tobytes(), k


def test_local_replicas_refused_naming_the_field(tmp_path, caplog):
    with pytest.raises(ValueError, match=r"Config.local_replicas=-1 is not allowed"):
        loopkit.Config(logdir=str(tmp_path), local_replicas=-1)
    with pytest.raises(ValueError, match=r"Config.local_replicas=1 needs "
                                         r"Config.local_checkpoint_dir"):
        loopkit.Config(logdir=str(tmp_path), local_replicas=1)
    # one process: nothing to copy to, said once
    with caplog.at_level(logging.INFO, logger="loopkit"):
        loopkit.train(lambda s, b: (s, {}), init=lambda: {"w": np.zeros(2)}, data=range(3),
                      logdir=str(tmp_path / "one"), local_checkpoint_dir=str(tmp_path / "l"),
                      local_replicas=1, max_steps=2, progress=False)
    said = [r.getMessage() for r in caplog.records if "local_replicas" in r.getMessage()]
    assert said == [("loopkit: Config.local_replicas=1 is ignored: this job has one process, "
                     "no peers to keep copies")], said
    # two processes: a copy on two others is more than there are
    outs = d.finish(d.start(tmp_path, tmp_path, 2, 10, "--local-dir", str(tmp_path / "l2"),
                            "--local-replicas", "2"), ok=False)
    for _, _, err in outs:
        assert "Config.local_replicas=2 is not allowed with 2 processes" in err, err[-3000:]
