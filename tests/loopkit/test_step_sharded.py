"""The step as sharded training needs it, on a 4-device CPU mesh (DESIGN.md, Timers and
the per-step path): the layout survives steps, saves and a resume; compiles are few
whatever the number of leaves; a user's donating step keeps the caller's arrays.

XLA_FLAGS must be set before jax starts, so each case runs in a fresh process
(tests/workers/sharded_step_worker.py). ``host_copy`` runs the protection used off
CPU (a host copy of the rewritten leaves at each save, a non-donating first step).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent.parent / "workers" / "sharded_step_worker.py"


def run_worker(tmp_path: Path, *args: str) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path), *args],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
    return proc.stdout


def test_a_layout_xla_would_replicate_survives_steps_saves_and_a_resume(tmp_path):
    run_worker(tmp_path, "layout")


@pytest.mark.parametrize("protect", ["views", "host_copy"])
def test_a_many_leaf_state_with_saves_compiles_the_step_at_most_twice(tmp_path, protect):
    run_worker(tmp_path, "compiles", protect)


@pytest.mark.parametrize("protect", ["views", "host_copy"])
def test_a_pre_jitted_donating_step_with_saves_keeps_the_callers_arrays(tmp_path, protect):
    run_worker(tmp_path, "prejitted", protect)
