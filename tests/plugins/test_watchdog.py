"""A hang is a failure: the watchdog ends a process that makes no progress, with a report."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import loopkit

WORKER = Path(__file__).parent.parent / "workers" / "run_worker.py"


def _train(tmp_path: Path, plan: str, max_steps: int = 12, env: dict | None = None,
           logdir: Path | None = None, name: str = "out.npy") -> subprocess.CompletedProcess:
    plan_file = tmp_path / "plan"
    plan_file.write_text(plan)
    return subprocess.run(
        [sys.executable, str(WORKER), str(logdir or tmp_path / "run"), str(max_steps),
         str(plan_file), str(tmp_path / name)],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})


def test_a_blocked_data_reader_ends_the_process_with_a_report(tmp_path):
    t0 = time.monotonic()
    hung = _train(tmp_path, "hang 7")
    assert hung.returncode == loopkit.HANG_EXIT_CODE == 75, hung.stderr[-3000:]
    assert time.monotonic() - t0 < 120
    reports = list((tmp_path / "run" / "hangs").glob("hang-0-*.txt"))
    assert [r.name for r in reports] == ["hang-0-7.txt"]  # steps 1..7 ran; batch 7 blocks
    text = reports[0].read_text()
    assert "the loop reached step 7 and made no progress" in text
    # every thread's Python stack: the reader blocked in the prefetch thread
    assert "blocked_forever" in text and "plugins/prefetch.py" in text
    assert "native stacks" in text  # py-spy's, or why there are none
    assert "blocked_forever" in hung.stderr  # and in the log, at ERROR
    # committed checkpoints are untouched: a restart resumes from step 6, bitwise
    assert loopkit.latest_checkpoint(tmp_path / "run")[0] == 6
    resumed = _train(tmp_path, "ok")
    assert resumed.returncode == 0 and "DONE 12" in resumed.stdout, resumed.stderr[-2000:]
    straight = _train(tmp_path, "ok", logdir=tmp_path / "straight", name="straight.npy")
    assert straight.returncode == 0
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"),
                                  np.load(tmp_path / "straight.npy"))


def test_a_slow_but_steady_step_does_not_trip_it(tmp_path):
    # 0.6 s per step against a 1.5 s timeout: slow, but progressing
    r = _train(tmp_path, "sleep 0.6", max_steps=6, env={"HANG_SECS": "1.5"})
    assert r.returncode == 0 and "DONE 6" in r.stdout, r.stderr[-2000:]
    assert not (tmp_path / "run" / "hangs").exists()


def test_a_first_step_compile_longer_than_the_timeout_does_not_trip_it(tmp_path):
    code = (
        "import time, jax.numpy as jnp, loopkit\n"
        "def step(s):\n"
        "    time.sleep(3)  # runs while jax traces: a long compile\n"
        "    return s + 1, {}\n"
        f"r = loopkit.train(step, init=jnp.zeros(()), max_steps=5, logdir={str(tmp_path)!r},\n"
        "                  hang_timeout_secs=1.0, progress=False, autoload=False)\n"
        "print('DONE', r.step)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "DONE 5" in r.stdout, r.stderr[-2000:]


def test_a_timer_action_longer_than_the_timeout_is_named(tmp_path):
    r = _train(tmp_path, "slow-timer")
    assert r.returncode == 75, r.stderr[-2000:]
    text = next((tmp_path / "run" / "hangs").glob("hang-0-5.txt")).read_text()
    assert "the timer action 'slow_eval' has been running for" in text
    assert "blocked_forever" in text


def test_config_checks_the_timeout():
    with pytest.raises(ValueError, match=r"Config.hang_timeout_secs=0 .*> 0 or None"):
        loopkit.Config(hang_timeout_secs=0)
    assert loopkit.Config(hang_timeout_secs=2.5).hang_timeout_secs == 2.5
