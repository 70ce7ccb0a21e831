"""`loopkit run`: failures and preemptions restarted within budgets, until the run finishes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

WORKER = Path(__file__).parent.parent / "workers" / "run_worker.py"
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _runner(tmp_path: Path, plan: str, max_steps: int = 15, *options: str,
            logdir: str = "run") -> subprocess.Popen:
    plan_file = tmp_path / "plan"
    plan_file.write_text(plan)
    return subprocess.Popen(
        [sys.executable, "-m", "loopkit", "run", "--backoff-secs", "0", *options, "--",
         sys.executable, str(WORKER), str(tmp_path / logdir), str(max_steps), str(plan_file),
         str(tmp_path / f"{logdir}.npy")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def _starts(tmp_path: Path) -> list[str]:
    return (tmp_path / "plan.starts").read_text().splitlines()


def _ledger(tmp_path: Path, logdir: str = "run") -> list[dict]:
    path = tmp_path / logdir / "goodput.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_crash_then_hang_then_finish_equals_an_uninterrupted_run(tmp_path):
    runner = _runner(tmp_path, "crash 5\nhang 9\nok")
    out, err = runner.communicate(timeout=400)
    assert runner.returncode == 0, err[-3000:]
    assert _starts(tmp_path) == ["crash 5", "hang 9", "ok"]
    assert "killed by SIGKILL" in err and "exit code 75 (hang watchdog)" in err
    restarts = [e for e in _ledger(tmp_path) if e["event"] == "restart"]
    assert [(e["kind"], e["signal"], e["exit_code"]) for e in restarts] == [
        ("failure", signal.SIGKILL, None), ("failure", None, 75)]
    # the watchdog's line, before its exit; each session's start; the last one's stop
    events = [e["event"] for e in _ledger(tmp_path)]
    assert events.count("hang") == 1 and events.count("start") == 3
    assert events.index("hang") < events.index("restart", events.index("hang"))
    assert _ledger(tmp_path)[-1]["event"] == "stop"
    straight = _runner(tmp_path, "ok", 15, logdir="straight")
    assert straight.wait(timeout=300) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "run.npy"),
                                  np.load(tmp_path / "straight.npy"))


def test_an_always_crashing_script_stops_after_its_budget(tmp_path):
    r = subprocess.run([sys.executable, "-m", "loopkit", "run", "--max-restarts", "2",
                        "--backoff-secs", "0", "--", sys.executable, "-c",
                        "import sys; print('boom', file=sys.stderr); sys.exit(3)"],
                       capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 3
    assert "out of budget: 3 consecutive failures, more than --max-restarts=2" in r.stderr
    assert r.stderr.count("boom") >= 3  # the child's stderr passes through, and is quoted


def test_sigterm_to_the_runner_stops_cleanly_without_a_restart(tmp_path):
    runner = _runner(tmp_path, "sleep 0.05", 10**6)
    _wait_for(lambda: (tmp_path / "run" / "checkpoint").exists())
    runner.send_signal(signal.SIGTERM)
    out, err = runner.communicate(timeout=120)
    assert runner.returncode == 0, err[-3000:]
    assert "signal" in out  # the child's train returned with stop_reason "signal"
    assert _starts(tmp_path) == ["sleep 0.05"]  # never restarted


def test_sigterm_to_the_child_alone_is_a_preemption_and_restarts(tmp_path):
    runner = _runner(tmp_path, "sleep 0.05\nok", 40)
    _wait_for(lambda: (tmp_path / "run" / "checkpoint").exists())
    child = _child_of(runner.pid)
    os.kill(child, signal.SIGTERM)
    out, err = runner.communicate(timeout=300)
    assert runner.returncode == 0, err[-3000:]
    assert _starts(tmp_path) == ["sleep 0.05", "ok"]
    assert "was preempted" in err
    assert [e["kind"] for e in _ledger(tmp_path) if e["event"] == "restart"] == ["preemption"]
    assert "DONE 40 max_steps" in out


def _wait_for(condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _child_of(pid: int) -> int:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])
