"""A grain DataLoader run killed with SIGKILL resumes and reads every batch exactly once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from loopkit.testing import kill_after_checkpoint

WORKER = textwrap.dedent("""
    import sys, time
    import grain, jax, jax.numpy as jnp, numpy as np, loopkit

    logdir, n = sys.argv[1], 48
    loader = grain.DataLoader(
        data_source=grain.sources.RangeDataSource(0, n, 1),
        sampler=grain.samplers.IndexSampler(n, shuffle=True, seed=0, num_epochs=1),
        operations=[grain.transforms.Batch(4)], worker_count=0)

    def init():
        return {"seen": jnp.zeros((n,), jnp.int32), "key": jax.random.key(0), "lr": 0.5}

    @jax.jit
    def step(state, batch):
        key, _ = jax.random.split(state["key"])
        return dict(state, seen=state["seen"].at[batch].add(1), key=key), {}

    def slow(state, batch):
        time.sleep(0.05)  # time for the test to kill it mid-run
        return step(state, batch)

    r = loopkit.train(slow, init=init, data=iter(loader), logdir=logdir,
                      checkpoint_backend="orbax", save_model_steps=2, save_model_secs=0,
                      save_summaries_secs=0, progress=False, jit=False)
    print("SEEN", "".join(map(str, np.asarray(r.state["seen"]).tolist())), r.stop_reason,
          r.step, flush=True)
""")


@pytest.mark.timeout(180)
def test_a_grain_loader_killed_and_resumed_reads_every_batch_once(tmp_path):
    script, logdir = tmp_path / "worker.py", tmp_path / "run"
    script.write_text(WORKER)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, str(script), str(logdir)]
    kill_after_checkpoint(cmd, logdir, 4, env)

    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    seen, reason, step = re.search(r"^SEEN (\d+) (\w+) (\d+)$", out.stdout, re.M).groups()
    assert seen == "1" * 48  # every example once: none skipped, none read twice
    assert (reason, int(step)) == ("data_exhausted", 12)
