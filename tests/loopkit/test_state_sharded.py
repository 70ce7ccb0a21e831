"""A state sharded by a callable init over 4 CPU devices resumes with its shardings, bitwise.

XLA_FLAGS must be set before jax starts, so each case runs in a fresh process
(tests/workers/sharded_state_worker.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent.parent / "workers" / "sharded_state_worker.py"


@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
def test_a_sharded_state_from_a_callable_init_resumes_sharded_and_bitwise(tmp_path, mesh_kind):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path), mesh_kind],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
