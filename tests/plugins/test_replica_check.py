"""`Config.replica_check_steps`: a replicated leaf whose copies differ is named (leaf,
step, process, device), recorded in the ledger (cause "sdc"), and raised or rolled back
without skipping a batch; clean runs report nothing.

On 4 CPU devices: XLA_FLAGS must be set before jax starts, so each case runs in a
fresh process (tests/workers/replica_worker.py). The fault: the first time step 23
runs, device 2's copy of the replicated leaf "w" is perturbed (a `shard_map` with the
replication check off, behind a host counter: the same batch, the step's output
differs); checks every 5 steps, saves every 10.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import loopkit

WORKER = Path(__file__).parent.parent / "workers" / "replica_worker.py"
NAMED = ("silent data corruption at step 25: the copy of leaf 'w' on device 2 of process 0 "
         "({host}) differs from the other 3 of its 4 copies (the last check that passed: "
         "step 20)")


def run_case(tmp_path: Path, case: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path / case), case],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    out = run_case(tmp_path_factory.mktemp("clean"), "clean")
    assert out["errors"] == [] and out["faults"] == [] and out["rollbacks"] == []
    return out


def test_a_differing_copy_raises_naming_the_leaf_step_and_device(tmp_path):
    import socket

    out = run_case(tmp_path, "raise")
    message, leaf, step, process, device = out["error"]
    host = socket.gethostname()
    assert message == NAMED.format(host=host)
    assert (leaf, step, process, device) == ("w", 25, 0, 2)  # within one interval of 23
    assert out["errors"] == ["loopkit: " + message]  # logged at ERROR
    assert out["faults"] == [["sdc", 25, 0, 2, "leaf w", host]]  # the ledger's line


@pytest.mark.parametrize("on_guard", ["rollback", "replay"])
def test_a_differing_copy_rolls_back_skipping_nothing_and_equals_a_clean_run(
        tmp_path, clean, on_guard):
    out = run_case(tmp_path, on_guard)
    assert out["errors"] == ["loopkit: " + NAMED.format(host=out["faults"][0][5])]
    # back to the checkpoint of step 20 (the last check that passed), batches [20, 25)
    # trained again, none skipped
    assert out["rollbacks"] == [[25, 20, [20, 20], "replica w"]]
    assert out["faults"] == [["sdc", 25, 0, 2, "leaf w", out["faults"][0][5]]]
    assert out["copies_equal"] and (out["n"], out["step"]) == (40, 40)
    assert (out["w"], out["shard"]) == (clean["w"], clean["shard"])  # bit for bit


def test_a_thousand_clean_steps_checked_at_every_step_report_nothing(tmp_path):
    out = run_case(tmp_path, "many")
    assert (out["n"], out["step"], out["copies_equal"]) == (1000, 1000, True)
    assert out["errors"] == [] and out["faults"] == [] and out["rollbacks"] == []


@pytest.mark.parametrize("fields, message", [
    (dict(replica_check_steps=0), r"Config.replica_check_steps=0 .* an int >= 1 or None"),
    (dict(replica_check_steps=2.5), r"Config.replica_check_steps=2.5 .* an int >= 1"),
    (dict(replica_check_steps=True), r"Config.replica_check_steps=True .* an int >= 1"),
    (dict(on_guard="replay"), r"Config.on_guard='replay' needs Config.nan_guard .* or "
                              r"Config.replica_check_steps"),
    (dict(on_guard="again", replica_check_steps=5), r"Config.on_guard='again' .* \"replay\""),
])
def test_bad_values_fail_at_start_up_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        loopkit.Config(**fields)


def test_rollback_with_a_plain_list_is_refused_at_start_up(tmp_path):
    import jax.numpy as jnp

    with pytest.raises(ValueError, match=r"Config.on_guard='rollback' cannot be used with a "
                                         r"plain iterable"):
        loopkit.train(lambda s, b: (s + b, {}), init=jnp.zeros(()), data=[1.0, 2.0],
                      max_steps=2, replica_check_steps=1, on_guard="rollback",
                      progress=False, logdir=str(tmp_path))


def test_a_single_device_state_has_nothing_to_compare(tmp_path, caplog):
    import logging

    import jax.numpy as jnp

    with caplog.at_level(logging.INFO, logger="loopkit"):
        r = loopkit.train(lambda s, b: (s + b, {}), init=jnp.zeros(3), data=lambda i: iter(
            [1.0] * 10), max_steps=4, replica_check_steps=2, progress=False)
    assert r.step == 4
    assert "the state has no replicated leaf" in caplog.text


def two_processes(tmp_path: Path, case: str) -> list[dict]:
    from loopkit.testing import free_port

    worker = WORKER.with_name("replica_procs_worker.py")
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, str(worker), str(tmp_path / "run"), str(i),
                               str(port), case], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


@pytest.mark.parametrize("case", ["raise", "clean"])
def test_copies_on_two_processes_name_the_process_and_device_that_differs(tmp_path, case):
    # the fleet's case: a leaf replicated over two hosts of two devices each, the last
    # device's copy perturbed at step 13; every process stops at the check of step 15
    # naming process 1 and that device
    outs = two_processes(tmp_path, case)
    if case == "clean":
        assert [o.get("step") for o in outs] == [30, 30]
        assert [o["errors"] for o in outs] == [[], []]
        return
    last_process, last_device = outs[0]["devices"][-1]
    assert last_process == 1
    for out in outs:
        message, leaf, step, process, device = out["error"]
        assert (leaf, step, process, device) == ("w", 15, 1, last_device), message
        assert (f"the copy of leaf 'w' on device {last_device} of process 1 " in message
                and "differs from the other 3 of its 4 copies" in message
                and "the last check that passed: step 10" in message), message
    assert outs[0]["errors"] == ["loopkit: " + outs[0]["error"][0]]
    from loopkit.plugins.goodput.records import Fault, read_records

    faults = [(f.cause, f.step, f.process, f.device) for f in read_records(tmp_path / "run")
              if isinstance(f, Fault)]
    assert faults == [("sdc", 15, 1, last_device)]  # one line, the chief's
