"""Crash test: SIGKILL a training process at random moments, restart it, get the same result.

A real subprocess (tests/plugins/crash_worker.py) trains a small deterministic
model with a checkpoint every 3 steps. It is killed at seeded random moments:
just after it starts (restoring, compiling), or a few milliseconds after a
timer save begins (so inside a save, its commit, the checkpoint file's rewrite
or the retention that follows), and restarted until it finishes. The final state must be bitwise equal to an
uninterrupted run's, every restart must resume at or after the previous one,
and no restart may meet a corrupt checkpoint.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import loopkit

WORKER = Path(__file__).with_name("crash_worker.py")
MAX_STEPS = 240
SAVE_STEPS = 3
# 10 + 10 = 20 kills over the suite: enough to land in every phase of a save
KILLS = {"orbax": 10, "npz": 10}


def _load_worker():
    spec = importlib.util.spec_from_file_location("loopkit_crash_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    """The uninterrupted run, in this process, without checkpoints."""
    w = _load_worker()
    r = loopkit.train(w.step_fn, init=w.init, data=w.data, max_steps=MAX_STEPS,
                      checkpoint_backend=None, disable=("summaries",), progress=False,
                      autoload=False)
    assert r.step == MAX_STEPS
    return {k: np.asarray(v.astype(np.float32) if k == "h" else v) for k, v in r.state.items()}


class Life:
    """One run of the worker, its stdout lines read by a thread into a queue."""

    def __init__(self, logdir: Path, backend: str, out: Path, log: Path) -> None:
        env = dict(os.environ, LOOPKIT_DISABLE_PLUGIN_AUTOLOAD="1")
        self.stderr = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(logdir), backend, str(MAX_STEPS),
             str(SAVE_STEPS), str(out)],
            stdout=subprocess.PIPE, stderr=self.stderr, env=env, text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def next_line(self, prefix: str) -> str | None:
        """The next line starting with `prefix`, or None once the process ended."""
        while True:
            line = self.lines.get(timeout=120)
            if line is None:
                return None
            if line.startswith(prefix):
                return line

    def finish(self) -> int:
        rc = self.proc.wait(timeout=120)
        self.stderr.close()
        return rc


@pytest.mark.parametrize("backend", ["orbax", "npz"])
def test_sigkill_and_restart_gives_the_uninterrupted_result(tmp_path, backend, reference):
    rng = random.Random(f"loopkit-crash-{backend}")
    logdir, out, log = tmp_path / "run", tmp_path / "final.npz", tmp_path / "stderr.txt"
    starts: list[int] = []
    kills = 0
    for _life in range(KILLS[backend] + 5):
        life = Life(logdir, backend, out, log)
        started = life.next_line("started")
        if started is not None:
            starts.append(int(started.split()[1]))
        if kills < KILLS[backend] and started is not None:
            # Kill by progress, not by time, so no life can run to the end on a fast
            # machine: right after start-up (restore, compilation, the first steps), or
            # a few milliseconds after the k-th save of this life began.
            if rng.random() < 0.3:
                time.sleep(rng.uniform(0.0, 0.05))
            else:
                for _ in range(rng.randint(1, 4)):
                    life.next_line("save")
                time.sleep(rng.uniform(0.0, 0.02))
            if life.proc.poll() is None:
                life.proc.send_signal(signal.SIGKILL)
                kills += 1
        rc = life.finish()
        if rc == 0:
            break
        assert rc == -signal.SIGKILL, f"worker failed (rc {rc}):\n{log.read_text()[-3000:]}"
    else:
        pytest.fail(f"the run did not finish after {len(starts)} lives")

    assert kills == KILLS[backend], f"only {kills} kills landed before the run finished"
    errors = log.read_text()
    for bad in ("unreadable", "not a committed", "ignoring", "Traceback", "CheckpointError"):
        assert bad not in errors, errors[-3000:]
    assert starts == sorted(starts), f"a restart went back in time: {starts}"
    assert starts[-1] > 0
    final = dict(np.load(out))
    assert final.keys() == reference.keys()
    for key, want in reference.items():
        assert final[key].dtype == want.dtype
        np.testing.assert_array_equal(final[key], want, err_msg=key)
        assert final[key].tobytes() == want.tobytes(), key
    # the finished run left a checkpoint file naming its final, committed step
    assert loopkit.latest_checkpoint(logdir) == (MAX_STEPS, str(logdir / f"model.ckpt-{MAX_STEPS}"))


def test_sigterm_is_a_normal_stop_with_a_final_checkpoint(tmp_path):
    logdir, out = tmp_path / "run", tmp_path / "final.npz"
    life = Life(logdir, "orbax", out, tmp_path / "stderr.txt")
    assert life.next_line("started") == "started 0"
    life.next_line("save")
    life.proc.send_signal(signal.SIGTERM)
    done = life.next_line("done")
    assert life.finish() == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
    _, step, reason = done.split()
    step = int(step)
    assert reason == "signal" and 0 < step < MAX_STEPS
    # the final checkpoint is the stopped step, committed and named in the checkpoint file
    assert loopkit.latest_checkpoint(logdir) == (step, str(logdir / f"model.ckpt-{step}"))
    saved = loopkit.load_checkpoint(logdir)
    assert int(saved["n"]) == step == int(np.load(out)["n"])
