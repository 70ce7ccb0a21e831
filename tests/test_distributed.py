"""Real `jax.distributed` jobs on localhost (CPU, gloo): chief, agreement, preemption."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import loopkit
from loopkit.testing import free_port

from distributed_jobs import (  # tests/plugins: the jobs' helpers
    WORKER, finish, load, local_steps, plan, start, wait_ready,
)







def events(logdir):
    return sorted(Path(logdir).glob("events.out.tfevents.*"))


def test_two_processes_train_resume_and_only_the_chief_writes(tmp_path):
    full, half = tmp_path / "full", tmp_path / "half"
    for d in (full, half):
        d.mkdir()
    finish(start(full, full, 2, 40, "--save-steps", "10"))
    a0, a1 = load(full / "p0.npz"), load(full / "p1.npz")
    np.testing.assert_array_equal(a0["w"], a1["w"])  # replicas agree
    assert len(events(full)) == 1  # one writer: the chief
    assert (full / "checkpoint").read_text().startswith('model_checkpoint_path: "model.ckpt-40"')

    finish(start(half, half, 2, 20, "--save-steps", "10"))
    outs = finish(start(half, half, 2, 40, "--save-steps", "10"))
    assert all("RESULT 40 max_steps" in out for _, out, _ in outs)
    b0 = load(half / "p0.npz")
    np.testing.assert_array_equal(a0["w"], b0["w"])  # resumed == uninterrupted, bitwise
    np.testing.assert_array_equal(a0["b"], b0["b"])

    # a 2-process checkpoint resumes in 1 process (the job shrank after a preemption)
    one = tmp_path / "one"
    one.mkdir()
    finish(start(half, one, 1, 50, "--save-steps", "10"))
    c = load(one / "p0.npz")
    assert int(c["step"]) == 50
    ref = tmp_path / "ref"
    ref.mkdir()
    finish(start(ref, ref, 2, 50, "--save-steps", "10"))
    np.testing.assert_allclose(c["w"], load(ref / "p0.npz")["w"], rtol=1e-5, atol=1e-6)


def test_sigterm_to_one_process_stops_both_at_one_agreed_step(tmp_path):
    # time-based checkpoints on, and process 1 twice as slow as process 0
    procs = start(tmp_path, tmp_path, 2, 100000, "--save-secs", "0.3",
                  sleeps=[0.002, 0.004])
    wait_ready(procs)
    time.sleep(3)
    procs[1].send_signal(signal.SIGTERM)
    outs = finish(procs)
    steps = {out.split("RESULT")[1].split()[0] for _, out, _ in outs}
    assert len(steps) == 1, steps  # both stopped at the same step
    assert all("signal" in out for _, out, _ in outs)
    step = int(steps.pop())
    text = (tmp_path / "checkpoint").read_text()
    assert f'model_checkpoint_path: "model.ckpt-{step}"' in text  # one agreed final checkpoint
    assert (tmp_path / f"model.ckpt-{step}").is_dir()


def test_sigkill_of_both_and_restart_resumes(tmp_path):
    procs = start(tmp_path, tmp_path, 2, 100000, "--save-steps", "20", sleeps=[0.001, 0.001])
    wait_ready(procs)
    deadline = time.time() + 60
    while time.time() < deadline and not (tmp_path / "checkpoint").exists():
        time.sleep(0.2)
    time.sleep(0.5)
    for p in procs:
        p.kill()
    for p in procs:
        p.wait(timeout=30)
    saved = (tmp_path / "checkpoint").read_text().split('"')[1]
    saved_step = int(saved.rsplit("-", 1)[1])
    assert saved_step >= 20
    outs = finish(start(tmp_path, tmp_path, 2, saved_step + 20, "--save-steps", "20"))
    assert all(f"READY {saved_step}" in out for _, out, _ in outs), outs
    assert all(f"RESULT {saved_step + 20} max_steps" in out for _, out, _ in outs)


def test_a_lagging_view_waits_for_the_chiefs_checkpoint(tmp_path):
    """The poll a non-chief runs when the chief's checkpoint is not visible to it yet."""
    import threading

    from loopkit.plugins.checkpoint.recovery import _wait_until_visible
    from loopkit.plugins.checkpoint.backends.npz import NpzBackend

    writer = NpzBackend(tmp_path)
    timer = threading.Timer(0.5, lambda: writer.save(5, {"x": np.zeros(2)}, {}))
    timer.start()
    started = time.monotonic()
    seen = _wait_until_visible(NpzBackend(tmp_path), set(), 5, str, recovery_wait_secs=0.05)
    assert time.monotonic() - started >= 0.4
    assert seen == {5}
    timer.join()


def test_host_local_replicas_are_saved_once_and_resume_bitwise(tmp_path):
    import loopkit

    full, half = tmp_path / "full", tmp_path / "half"
    for d in (full, half):
        d.mkdir()
    finish(start(full, full, 2, 30, "--save-steps", "10", "--host-local"))
    a0, a1 = load(full / "p0.npz"), load(full / "p1.npz")
    np.testing.assert_array_equal(a0["w"], a1["w"])

    outs = finish(start(half, half, 2, 20, "--save-steps", "10", "--host-local"))
    assert all("READY 0 host_local=True" in out for _, out, _ in outs)
    at20 = load(half / "p0.npz")
    saved = loopkit.load_checkpoint(str(half / "model.ckpt-20"))  # the chief's copy
    np.testing.assert_array_equal(saved["w"], at20["w"])
    np.testing.assert_array_equal(saved["b"], at20["b"])

    outs = finish(start(half, half, 2, 30, "--save-steps", "10", "--host-local"))
    # each process got a host-local copy of the saved values back, and went on bitwise
    assert all("READY 20 host_local=True" in out for _, out, _ in outs)
    assert all("RESULT 30 max_steps" in out for _, out, _ in outs)
    for i in (0, 1):
        np.testing.assert_array_equal(load(half / f"p{i}.npz.ready.npz")["w"], at20["w"])
        np.testing.assert_array_equal(load(half / f"p{i}.npz")["w"], a0["w"])
        np.testing.assert_array_equal(load(half / f"p{i}.npz")["b"], a0["b"])


def test_differing_replicas_fail_the_save_on_every_process(tmp_path):
    outs = finish(start(tmp_path, tmp_path, 2, 30, "--save-steps", "10", "--host-local",
                        "--differ"), ok=False)
    for _, _, err in outs:
        assert "CheckpointError: not saving" in err
        assert "model.ckpt-10: the host-local leaf 'b' differs between processes" in err
        assert "(process 0 and process 1 hold different values)" in err
    assert not (tmp_path / "checkpoint").exists()  # nothing of that step is published
    assert not list(tmp_path.glob("model.ckpt-*"))


def test_data_running_out_on_one_process_stops_every_process_at_its_last_batch(tmp_path):
    outs = finish(start(tmp_path, tmp_path, 2, 1000, "--save-steps", "10",
                        "--data-lens", "23,37"))
    assert all("RESULT 23 data_exhausted" in out for _, out, _ in outs), outs
    assert (tmp_path / "checkpoint").read_text().startswith(
        'model_checkpoint_path: "model.ckpt-23"')
    np.testing.assert_array_equal(load(tmp_path / "p0.npz")["w"], load(tmp_path / "p1.npz")["w"])


def test_four_processes_sharded_state_resume_on_two(tmp_path):
    four, two = tmp_path / "four", tmp_path / "two"
    for d in (four, two):
        d.mkdir()
    # 4 processes x 2 CPU devices: `w` sharded over all 8 devices, batches too
    finish(start(four, four, 4, 20, "--save-steps", "10", "--shard-state", devices=2))
    saved = load(four / "p0.npz")
    for i in (1, 2, 3):
        np.testing.assert_array_equal(load(four / f"p{i}.npz")["w"], saved["w"])

    # the job shrank after a preemption: 2 processes x 2 devices resume the same logdir
    outs = finish(start(four, two, 2, 25, "--save-steps", "10", "--shard-state", devices=2))
    assert all("READY 20" in out and "RESULT 25 max_steps" in out for _, out, _ in outs)
    for _, out, _ in outs:
        # restored into the new job's layout: `w` split over its 4 devices, 2 per process
        # (a quarter of the 8 values each), `b` replicated on all 4
        assert "SHARDING w spec=('data',) devices=4 local=2x[(2,)]" in out, out
        assert "SHARDING b spec=() devices=4 local=2x[()]" in out, out
    for i in (0, 1):
        started = load(two / f"p{i}.npz.ready.npz")
        np.testing.assert_array_equal(started["w"], saved["w"])  # the exact saved values
        np.testing.assert_array_equal(started["b"], saved["b"])
    assert (four / "checkpoint").read_text().startswith('model_checkpoint_path: "model.ckpt-25"')


def start_under_runners(logdir, out, steps, *extra):
    """Two processes, each under its own `loopkit run`, as two hosts of a job would."""
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = []
    for i in range(2):
        args = [sys.executable, "-m", "loopkit", "run", "--backoff-secs", "1", "--",
                sys.executable, str(WORKER), str(logdir), str(out / f"p{i}.npz"), "2", str(i),
                str(port), str(steps), *extra]
        stdout = open(out / f"r{i}.out", "w+")
        stderr = open(out / f"r{i}.err", "w+")
        proc = subprocess.Popen(args, stdout=stdout, stderr=stderr, text=True, env=env)
        proc.files = (stdout, stderr)
        procs.append(proc)
    return procs



def test_a_blocked_process_ends_both_and_each_report_names_it(tmp_path):
    # process 1's data reader blocks at batch 20: process 0 waits for it in a collective
    procs = start(tmp_path, tmp_path, 2, 60, "--save-steps", "4", "--hang-secs", "5",
                  *plan(tmp_path / "plan", ["ok"], ["hang 20"]))
    outs = finish(procs, ok=False)
    assert [code for code, _, _ in outs] == [75, 75], [o[2][-2000:] for o in outs]
    reports = sorted((tmp_path / "hangs").glob("hang-*.txt"))
    assert [r.name.split("-")[1] for r in reports] == ["0", "1"]  # one report per process
    for r in reports:
        text = r.read_text()
        assert "process 1 is behind" in text or "process 1 is at step" in text, text[:3000]
        assert "process 0: step" in text and "process 1: step" in text
    # process 1's own stacks show its reader blocked in the user's data function
    assert re.search(r'distributed_worker.py", line \d+ in data', reports[1].read_text())
    assert "model.ckpt-" in (tmp_path / "checkpoint").read_text()  # committed ones intact


def test_a_process_blocked_before_its_first_batch_ends_both_at_start_up(tmp_path):
    # process 1's reader blocks before its first batch: process 0 waits for it in the
    # start-up's first collective; the start-up allowance ends both, each report naming
    # its place
    t0 = time.monotonic()
    procs = start(tmp_path, tmp_path, 2, 20, "--hang-secs", "2", "--startup-secs", "8",
                  *plan(tmp_path / "plan", ["ok"], ["hang 0"]))
    outs = finish(procs, ok=False)
    assert [code for code, _, _ in outs] == [75, 75], [o[2][-2000:] for o in outs]
    assert time.monotonic() - t0 < 8 + 60 + 30  # the allowance, the bound, JAX's start
    texts = [(tmp_path / "hangs" / f"hang-{i}-0.txt").read_text() for i in range(2)]
    assert "has not completed its first step" in texts[0]
    assert re.search(r"waiting for the first batch: in a collective, at ", texts[0]), \
        texts[0][:2000]
    assert re.search(r"waiting for the first batch: the prefetch thread is inside the data "
                     r"source, at data \(.*distributed_worker\.py:\d+\)", texts[1]), \
        texts[1][:2000]
    assert "process 1 is behind" in texts[0], texts[0][:3000]


def test_two_runners_survive_a_sigkill_of_one_child_and_finish_bitwise(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    for d in (ref, run):
        d.mkdir()
    finish(start(ref, ref, 2, 40, "--save-steps", "4"))
    # process 1 SIGKILLs itself after step 10; process 0 then fails in the step's
    # collective; each runner restarts its own process and they meet again
    runners = start_under_runners(run, run, 40, "--save-steps", "4", "--hang-secs", "20",
                                  *plan(run / "plan", ["ok"] * 4, ["crash 10"] + ["ok"] * 3))
    outs = finish(runners)
    assert all("RESULT 40 max_steps" in out for _, out, _ in outs), outs
    assert (run / "plan.p1.starts").read_text().splitlines()[:2] == ["crash 10", "ok"]
    assert "killed by SIGKILL" in outs[1][2]  # runner 1 restarted its killed child
    assert "the child failed" in outs[0][2]  # runner 0 restarted the process that failed with it
    for i in range(2):
        a, b = load(ref / f"p{i}.npz"), load(run / f"p{i}.npz")
        np.testing.assert_array_equal(a["w"], b["w"])
        np.testing.assert_array_equal(a["b"], b["b"])

def test_two_processes_resume_from_their_own_local_tiers_bitwise(tmp_path):
    """Each process keeps its own local tier (its shards of a state sharded over both,
    in DIR/process-<i>): a job SIGKILLed after local saves newer than the durable one
    resumes from the newest local step both hold, bitwise; with one process's local
    tier wiped (its machine lost), both resume from the durable step, bitwise. `m`
    (`--momentum`: optax-like, placed by zeros_like on auto axes, not by init) comes
    back with the layout the run saved, from either tier."""
    full, run, ref, local = (tmp_path / n for n in ("full", "run", "ref", "local"))
    for d in (full, run, ref):
        d.mkdir()
    common = ("--save-steps", "10", "--shard-state", "--step-sleep", "0.05", "--momentum")
    finish(start(full, full, 2, 30, *common, devices=2))
    crashes = plan(run / "plan", ["crash 14", "crash 26", "ok"], ["crash 14", "crash 26", "ok"])
    tiers = ("--local-dir", str(local), *crashes)

    finish(start(run, run, 2, 30, *common, *tiers, devices=2), ok=False)  # both SIGKILLed
    assert loopkit.latest_checkpoint(run)[0] == 10
    held = [local_steps(local / f"process-{i}") for i in range(2)]
    want = max(held[0] & held[1])
    assert want > 10, held  # every 3 steps: 12 committed before the kill at 14
    outs = finish(start(run, run, 2, 30, *common, *tiers, devices=2), ok=False)
    assert all(f"READY {want} " in out and "TIER local" in out for _, out, _ in outs), outs
    for name in ("w", "m"):
        assert all(f"SHARDING {name} spec=('data',) devices=4 local=2x[(2,)]" in out
                   for _, out, _ in outs), outs
    restored = load(str(run / "p0.npz") + ".ready.npz")  # what it resumed from
    finish(start(ref, ref, 2, want, *common, devices=2))
    for k in ("w", "b", "m"):  # the two local tiers' shards together: the state at that step
        np.testing.assert_array_equal(load(ref / "p0.npz")[k], restored[k])

    # killed after step 26: durable 20, local 24; one machine lost with its local tier
    assert loopkit.latest_checkpoint(run)[0] == 20
    assert max(local_steps(local / "process-0")) > 20
    shutil.rmtree(local / "process-1")
    outs = finish(start(run, run, 2, 30, *common, *tiers, devices=2))
    assert all("READY 20 " in out and "TIER durable" in out and "RESULT 30 max_steps" in out
               and "SHARDING m spec=('data',) devices=4 local=2x[(2,)]" in out
               for _, out, _ in outs), outs
    for k in ("w", "b", "m"):
        np.testing.assert_array_equal(load(full / "p0.npz")[k], load(run / "p0.npz")[k])



def _machines(run):
    """(restored step, tier, what the ledger says of the machine) of each restored session."""
    import json

    cli = subprocess.run([sys.executable, "-m", "loopkit", "goodput", str(run), "--sessions",
                          "--json"], capture_output=True, text=True, timeout=60, check=False)
    assert cli.returncode == 0, cli.stderr
    return [(r["restored_step"], r["restored_tier"], r["machine"])
            for r in json.loads(cli.stdout) if r["restored_step"] is not None]


def test_a_lost_machine_beside_a_chief_that_lived_is_recorded_lost(tmp_path):
    """The ledger's word on the previous session's machine (which `save_model_secs="auto"`
    counts) is every process's, not the chief's alone: killed after step 11 (durable
    10, each local tier 6 and 9) both machines lived; killed after 21 (durable 20,
    local 15 and 18) with process 1's machine replaced, its local tier wiped, a
    machine was lost, though the chief's local tier is as after a process death."""
    run, local = tmp_path / "run", tmp_path / "local"
    run.mkdir()
    common = ("--save-steps", "10", "--shard-state", "--step-sleep", "0.02")
    tiers = ("--local-dir", str(local), *plan(run / "plan", ["crash 11", "crash 21", "ok"],
                                              ["crash 11", "crash 21", "ok"]))
    finish(start(run, run, 2, 30, *common, *tiers, devices=2), ok=False)
    assert [local_steps(local / f"process-{i}") for i in range(2)] == [{6, 9}] * 2
    finish(start(run, run, 2, 30, *common, *tiers, devices=2), ok=False)
    assert loopkit.latest_checkpoint(run)[0] == 20
    assert local_steps(local / "process-0") == {15, 18}
    shutil.rmtree(local / "process-1")
    outs = finish(start(run, run, 2, 30, *common, *tiers, devices=2))
    assert all("READY 20 " in out and "TIER durable" in out for _, out, _ in outs), outs
    assert _machines(run) == [(10, "durable", "lived"), (20, "durable", "lost")]


def test_two_processes_on_a_logdir_of_another_backend_both_refuse_it(tmp_path):
    """A two-process run whose Config.checkpoint_backend differs from the backend that
    wrote its logdir: both processes fail with the chief's CheckpointError (neither
    starts fresh over the run, neither waits alone in a collective), and the run's
    checkpoints stay as they were."""
    run = tmp_path / "run"
    run.mkdir()
    common = ("--save-steps", "5", "--shard-state")
    finish(start(run, run, 2, 10, *common, devices=2))
    assert local_steps(run) == {5, 10}
    outs = finish(start(run, run, 2, 20, *common, "--backend", "npz", devices=2), ok=False)
    for _, _, err in outs:  # each sees it (a view that did not would name process 0)
        assert "CheckpointError" in err and "set checkpoint_backend='orbax' to resume" \
            in err, err[-3000:]
    assert local_steps(run) == {5, 10} and loopkit.latest_checkpoint(run)[0] == 10


def test_a_failed_local_save_on_one_process_stops_both_with_its_error(tmp_path):
    """Process 1's local save of step 6 fails (its disk full, say): the failure stops
    both processes at the same agreement, process 1 with that error, even when its
    local timer comes due first (step 9: it skips that save rather than raise alone and
    leave process 0 in the next collective); the next start resumes together from the
    newest step of either tier, bitwise."""
    full, run, local = (tmp_path / n for n in ("full", "run", "local"))
    for d in (full, run):
        d.mkdir()
    common = ("--save-steps", "5", "--shard-state", "--step-sleep", "0.05")
    finish(start(full, full, 2, 30, *common, devices=2))
    outs = finish(start(run, run, 2, 30, *common, "--local-dir", str(local),
                        "--fail-local-save", "1:6", devices=2), ok=False)
    assert "injected local save failure of step 6" in outs[1][2], outs[1][2][-3000:]
    stop = re.search(r"every process stops at step (\d+)", outs[0][2])
    assert stop, outs[0][2][-3000:]
    stop = int(stop.group(1))
    # the failure comes once the save of 9 waits for the save of 6 (--fail-local-save):
    # the save of 9 is skipped, and the agreement after it stops both
    assert stop >= 9 and local_steps(local / "process-1") == {3}, (stop, outs[1][2][-3000:])
    durable = loopkit.latest_checkpoint(run)[0]
    assert durable == 5 * ((stop - 1) // 5)  # an error stop saves nothing at its own step
    outs = finish(start(run, run, 2, 30, *common, "--local-dir", str(local), devices=2))
    ready = {re.search(r"^READY (\d+) .*\nTIER (\w+)", out, re.M).groups() for _, out, _ in outs}
    # the newest step of either tier: durable, or the local 6 both hold (process 1's was
    # written before its commit failed) when that is newer
    assert ready == ({(str(durable), "durable")} if durable > 6 else {("6", "local")}), outs
    assert all("RESULT 30 max_steps" in out for _, out, _ in outs), outs
    for k in ("w", "b"):
        np.testing.assert_array_equal(load(full / "p0.npz")[k], load(run / "p0.npz")[k])
