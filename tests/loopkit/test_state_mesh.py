"""States built under `jax.set_mesh` (explicit axes, as flax NNX's `Rngs` under a mesh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import loopkit


def _step(s):
    key, sub = jax.random.split(s["key"])
    return {"key": key, "w": s["w"] + jax.random.uniform(sub)}, {}


def _init():
    return {"key": jax.random.key(0), "w": jnp.zeros(())}


def test_a_typed_key_made_under_a_mesh_trains():
    # gemma port: a scalar key's sharding describes its uint32[2] data, spec P(None,)
    mesh = jax.make_mesh((1,), ("data",))
    with jax.set_mesh(mesh):
        r = loopkit.train(_step, init={"key": jax.random.key(0), "w": jnp.zeros(())},
                          max_steps=2, progress=False, autoload=False)
    assert r.step == 2 and jax.dtypes.issubdtype(r.state["key"].dtype, jax.dtypes.prng_key)


@pytest.mark.parametrize("backend", ["orbax", "npz"])
def test_a_typed_key_under_a_mesh_resumes_bitwise(tmp_path, backend):
    mesh = jax.make_mesh((1,), ("data",))
    kw = dict(checkpoint_backend=backend, progress=False, autoload=False)
    with jax.set_mesh(mesh):
        loopkit.train(_step, init=_init, max_steps=2, logdir=tmp_path, **kw)
        resumed = loopkit.train(_step, init=_init, max_steps=4, logdir=tmp_path, **kw)
        straight = loopkit.train(_step, init=_init, max_steps=4, **kw)
    assert resumed.step == 4
    assert jnp.array_equal(resumed.state["w"], straight.state["w"])
    assert jnp.array_equal(jax.random.key_data(resumed.state["key"]),
                           jax.random.key_data(straight.state["key"]))
    assert resumed.state["key"].sharding == straight.state["key"].sharding


MESH_WORKER = Path(__file__).parent.parent / "workers" / "mesh_prefetch_worker.py"


@pytest.mark.parametrize("run", [1, 2])
@pytest.mark.parametrize("reduce", ["last", "mean"])
def test_a_2x2_fsdp_tensor_parallel_step_on_a_cpu_mesh_runs_2000_steps(tmp_path, reduce, run):
    # XLA:CPU deadlocked a collective with two steps in flight on a 2-core machine: the
    # process aborted (SIGABRT, exit 134) after 40 s, with loopkit's defaults every time
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(MESH_WORKER), str(tmp_path), reduce, "2000"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0 and "OK 2000" in proc.stdout, (
        f"exit {proc.returncode}: {proc.stderr[-3000:]}")


COMPILES_WORKER = Path(__file__).parent.parent / "workers" / "mesh_compiles_worker.py"


@pytest.mark.parametrize("devices", [1, 4])
def test_a_resumed_session_compiles_what_a_fresh_one_does_and_the_cache_serves_it(
        tmp_path, devices):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(COMPILES_WORKER), str(tmp_path), str(devices)],
                          capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(proc.stdout.splitlines()[-1])
    assert sorted(cases) == ["auto-last", "auto-mean", "explicit-last", "explicit-mean"]
    for name, c in cases.items():
        steps = {k: sorted(n for n in c[k]["compiled"] if "inner" in n)
                 for k in ("fresh", "resumed", "cached")}
        # the step once, and on CPU its save variant once: "mean" adds no recompile
        assert steps["fresh"] == ["jit(inner)", "jit(inner_with_spare)"], (name, c)
        assert steps["resumed"] == steps["fresh"], (name, c)  # a restore changes no signature
        # nor does it compile init to learn where its leaves go: the trace's types say it
        # (explicit axes, one device) or the checkpoint's layouts do (m, on auto axes)
        assert "jit(init)" not in c["resumed"]["compiled"], (name, c["resumed"])
        # a restart reads the step from the cache beside the run: nothing compiled anew
        hits = sorted(h for h in c["cached"]["cache_hits"] if "inner" in h)
        assert hits == ["jit_inner", "jit_inner_with_spare"], (name, c["cached"])
        fresh, resumed = c["shardings"]
        assert resumed == fresh, name  # every leaf placed as `init` placed it
        assert c["committed"][1] == c["committed"][0], name
