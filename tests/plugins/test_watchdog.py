"""A hang is a failure: the watchdog ends a process that makes no progress, with a report."""

from __future__ import annotations

import os
import re
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


def _child(code: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=240, env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})
    return r, time.monotonic() - t0


def test_a_data_source_blocked_before_its_first_batch_is_a_hang_within_the_allowance(tmp_path):
    t0 = time.monotonic()
    hung = _train(tmp_path, "hang 0", env={"HANG_SECS": "1", "STARTUP_SECS": "4"})
    elapsed = time.monotonic() - t0
    assert hung.returncode == 75, hung.stderr[-3000:]
    # the allowance, then the report: well within startup_timeout_secs + the 60 s bound
    # (the interpreter's and JAX's start-up count too; the machine is shared)
    assert 4 <= elapsed < 4 + 60, elapsed
    text = (tmp_path / "run" / "hangs" / "hang-0-0.txt").read_text()
    assert "has not completed its first step" in text
    assert "Config.startup_timeout_secs=4.0" in text
    # the headline names the place: the prefetch thread inside the user's iterator
    assert re.search(r"waiting for the first batch: the prefetch thread is inside the data "
                     r"source, at blocked_forever \(.*run_worker\.py:\d+\)", text), text[:1000]
    assert "no first step" in hung.stderr and "waiting for the first batch" in hung.stderr


def test_a_first_step_that_never_compiles_is_named_compiling(tmp_path):
    code = (
        "import threading, jax.numpy as jnp, loopkit\n"
        "def step(s):\n"
        "    threading.Event().wait()  # runs while jax traces: a compile that never ends\n"
        "    return s + 1, {}\n"
        f"loopkit.train(step, init=jnp.zeros(()), max_steps=5, logdir={str(tmp_path)!r},\n"
        "              hang_timeout_secs=1.0, startup_timeout_secs=3, progress=False,\n"
        "              autoload=False)\n")
    r, elapsed = _child(code)
    assert r.returncode == 75 and elapsed < 3 + 60, (elapsed, r.stderr[-3000:])
    text = (tmp_path / "hangs" / "hang-0-0.txt").read_text()
    assert "running the first step: compiling, at step (<string>:3)" in text, text[:1000]


RESTORE = """
import os, sys, threading, jax.numpy as jnp, loopkit
from loopkit.plugins.checkpoint.backends.npz import NpzBackend

class SlowRestore(NpzBackend):  # a store whose read never returns
    def restore(self, step, like):
        if os.environ.get("BLOCK_RESTORE"):
            threading.Event().wait()
        return super().restore(step, like)

class Backends:
    @loopkit.hookimpl
    def checkpoint_backend(self, name, directory, config):
        return SlowRestore(directory, config.checkpoint_basename) if name == "slow" else None

r = loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), max_steps=int(sys.argv[1]),
                  logdir=sys.argv[2], checkpoint_backend="slow", save_model_steps=2,
                  save_model_secs=None, plugins=[Backends()], hang_timeout_secs=1.0,
                  startup_timeout_secs=3, progress=False, autoload=False)
print("DONE", r.step)
"""


def test_a_restore_that_blocks_is_reported_as_restoring_its_step(tmp_path):
    logdir = str(tmp_path / "run")
    first = subprocess.run([sys.executable, "-c", RESTORE, "4", logdir], capture_output=True,
                           text=True, timeout=240, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert first.returncode == 0 and "DONE 4" in first.stdout, first.stderr[-2000:]
    t0 = time.monotonic()
    hung = subprocess.run([sys.executable, "-c", RESTORE, "8", logdir], capture_output=True,
                          text=True, timeout=240,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "BLOCK_RESTORE": "1"})
    assert hung.returncode == 75 and time.monotonic() - t0 < 3 + 60, hung.stderr[-3000:]
    # the restore runs before the state exists: the report's step is the session's 0
    text = (tmp_path / "run" / "hangs" / "hang-0-0.txt").read_text()
    assert re.search(r"restoring step 4: at restore \(<string>:\d+\)", text), text[:1000]
    assert loopkit.latest_checkpoint(logdir)[0] == 4  # untouched


def test_a_report_whose_writes_block_still_exits_within_the_bound(tmp_path):
    # the storage layer's write of the report and the ledger's record of the hang never
    # return: the process still exits 75, well within hang_timeout_secs + 60 s
    t0 = time.monotonic()
    hung = _train(tmp_path, "hang 3", env={"BLOCK_REPORT": "1"})
    assert hung.returncode == 75, hung.stderr[-3000:]
    assert time.monotonic() - t0 < 2 + 60
    assert "blocked_forever" in hung.stderr  # the report is in the log all the same
    assert re.search(r"the hang report could not be written to .*hang-0-3\.txt: the write "
                     r"did not return within \d+ s", hung.stderr)
    assert "could not record the hang in the goodput ledger: the ledger's write did not " \
           "return" in hung.stderr


def test_hangs_being_a_file_still_logs_the_report_and_why(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "hangs").write_text("not a directory")
    hung = _train(tmp_path, "hang 3")
    assert hung.returncode == 75, hung.stderr[-3000:]
    assert "blocked_forever" in hung.stderr and "report: None" not in hung.stderr
    assert f"could not be written to {tmp_path / 'run' / 'hangs' / 'hang-0-3.txt'}: " \
           f"NotADirectoryError: {tmp_path / 'run' / 'hangs'} is a file, not a directory" \
           in hung.stderr


def test_a_slow_but_steady_step_does_not_trip_it(tmp_path):
    # 0.6 s per step against a 1.5 s timeout: slow, but progressing
    r = _train(tmp_path, "sleep 0.6", max_steps=6, env={"HANG_SECS": "1.5"})
    assert r.returncode == 0 and "DONE 6" in r.stdout, r.stderr[-2000:]
    assert not (tmp_path / "run" / "hangs").exists()


@pytest.mark.parametrize("startup", [None, 30])
def test_a_slow_start_inside_the_allowance_is_not_a_hang(tmp_path, startup):
    # a slow init and a first compile each longer than hang_timeout_secs, both inside
    # the start-up allowance (None: the default 30 minutes)
    code = (
        "import time, jax.numpy as jnp, loopkit\n"
        "def init():\n"
        "    time.sleep(2)  # a slow init\n"
        "    return jnp.zeros(())\n"
        "def step(s):\n"
        "    time.sleep(3)  # runs while jax traces: a long compile\n"
        "    return s + 1, {}\n"
        f"r = loopkit.train(step, init=init, max_steps=5, logdir={str(tmp_path)!r},\n"
        f"                  hang_timeout_secs=1.0, startup_timeout_secs={startup},\n"
        "                  progress=False, autoload=False)\n"
        "print('DONE', r.step)\n")
    r, _ = _child(code)
    assert r.returncode == 0 and "DONE 5" in r.stdout, r.stderr[-2000:]
    assert not (tmp_path / "hangs").exists()


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


@pytest.mark.parametrize("bad", [0, -1, float("nan"), True, "30", [30]])
def test_config_checks_the_startup_allowance(bad):
    with pytest.raises(ValueError, match=rf"Config.startup_timeout_secs={re.escape(repr(bad))} "
                                         r"is not allowed: expected a number of seconds > 0 "
                                         r"or None"):
        loopkit.Config(hang_timeout_secs=60, startup_timeout_secs=bad)


def test_the_startup_allowance_needs_the_watchdog():
    with pytest.raises(ValueError, match=r"Config.startup_timeout_secs=600 needs "
                                         r"Config.hang_timeout_secs"):
        loopkit.Config(startup_timeout_secs=600)
    c = loopkit.Config(hang_timeout_secs=60, startup_timeout_secs=600.5)
    assert (c.startup_timeout_secs, loopkit.Config(hang_timeout_secs=60).startup_timeout_secs) \
        == (600.5, None)
