"""Every example runs (with a small step count), so none can rot."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from loopkit.testing import free_port

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(*args, timeout=300, **env):
    full = dict(os.environ, JAX_PLATFORMS="cpu", **env)
    p = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                       env=full, timeout=timeout)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    return p


def test_digits_trains_and_a_second_run_resumes(tmp_path):
    logdir = tmp_path / "digits"
    first = run(EXAMPLES / "digits.py", "--logdir", logdir, "--steps", "60")
    assert "stopped at step 60 (max_steps)" in first.stdout
    assert "starting at step 0" in first.stderr  # progress lines on a non-terminal
    assert list(logdir.glob("events.out.tfevents.*"))
    second = run(EXAMPLES / "digits.py", "--logdir", logdir, "--steps", "120")
    assert "resumed at step 60" in second.stderr
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", second.stdout).group(1))
    assert "stopped at step 120" in second.stdout and accuracy > 0.5


def test_finetune_loads_the_trunk_and_improves(tmp_path):
    p = run(EXAMPLES / "finetune.py", "--workdir", tmp_path, "--steps", "150")
    before = float(re.search(r"before fine-tuning: ([0-9.]+)", p.stdout).group(1))
    after = float(re.search(r"test accuracy ([0-9.]+)\s*$", p.stdout).group(1))
    assert after > before and after > 0.8, p.stdout


def test_supervisor_loop_resumes(tmp_path):
    run(EXAMPLES / "supervisor_loop.py", "--logdir", tmp_path, "--steps", "50")
    p = run(EXAMPLES / "supervisor_loop.py", "--logdir", tmp_path, "--steps", "100")
    assert "starting at step 50" in p.stdout and "stopped at step 100" in p.stdout


def test_resume_example_is_bitwise_equal(tmp_path):
    p = run(EXAMPLES / "resume.py", "--logdir", tmp_path / "r", "--steps", "120",
            "--kill-at", "80")
    assert "bitwise" in p.stdout.lower(), p.stdout


def test_distributed_example_two_processes(tmp_path):
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen(
        [sys.executable, str(EXAMPLES / "distributed.py"), "--num-processes", "2",
         "--process-id", str(i), "--coordinator", f"127.0.0.1:{port}", "--logdir",
         str(tmp_path), "--steps", "40"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env) for i in range(2)]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    for i, out in enumerate(outs):
        assert f"process {i}: stopped at step 40 (max_steps)" in out
    assert (tmp_path / "model.ckpt-40").is_dir()
