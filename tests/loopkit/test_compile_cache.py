"""`Config.compilation_cache`: a restarted process loads its step instead of compiling it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import loopkit
from loopkit.process.compile_cache import CACHE_NAME

RUN = textwrap.dedent("""
    import logging, sys, jax, jax.numpy as jnp, numpy as np, loopkit
    logging.basicConfig(level=logging.WARNING)
    jax.config.update("jax_log_compiles", True)
    def mlp_step(s, b):
        g = jax.grad(lambda w: jnp.mean((jnp.tanh(b @ w) - 1.0) ** 2))(s["w"])
        return {"w": s["w"] - 0.1 * g, "n": s["n"] + 1}, {}
    data = lambda start: (jnp.full((4, 8), 0.1 * i) for i in range(start, 10**6))
    make = lambda: {"w": jnp.ones((8, 8)) * 0.01, "n": jnp.zeros((), jnp.int32)}
    form = sys.argv[4]
    if form == "a state made under a mesh":
        jax.set_mesh(jax.make_mesh((1,), ("data",)))
    init = {"a callable": make, "jax arrays": make,
            "numpy arrays": lambda: jax.tree.map(np.asarray, make()),
            "a state made under a mesh": make}[form]
    init = init if form == "a callable" else init()
    r = loopkit.train(mlp_step, init=init, data=data, logdir=sys.argv[1],
                      max_steps=int(sys.argv[2]), save_model_steps=5, save_model_secs=None,
                      progress=False, autoload=False, **eval(sys.argv[3]))
    print("DONE", r.step, float(r.state["w"].sum()))
""")


def _run(logdir, steps, extra="{}", env=None, form="a callable"):
    proc = subprocess.run([sys.executable, "-c", RUN, str(logdir), str(steps), extra, form],
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _hits(proc) -> list[str]:
    return [x for x in proc.stderr.splitlines() if "Persistent compilation cache hit" in x]


@pytest.mark.parametrize("form", ["a callable", "jax arrays", "numpy arrays",
                                  "a state made under a mesh"])
def test_a_restart_loads_its_step_from_the_cache_beside_the_run(tmp_path, form):
    env = {"JAX_COMPILATION_CACHE_DIR": ""}
    first = _run(tmp_path, 10, env=env, form=form)
    assert (tmp_path / CACHE_NAME).is_dir() and any((tmp_path / CACHE_NAME).iterdir())
    assert not [h for h in _hits(first) if "jit_inner" in h]
    restarted = _run(tmp_path, 20, env=env, form=form)  # resumes at step 10 from the checkpoint
    assert "DONE 20" in restarted.stdout
    # the restored state is placed as the fresh one was: the same program, from the cache
    assert [h for h in _hits(restarted) if "jit_inner" in h], restarted.stderr[-3000:]


def test_a_cache_the_user_set_is_left_alone(tmp_path):
    mine = tmp_path / "mine"
    _run(tmp_path / "run", 5, env={"JAX_COMPILATION_CACHE_DIR": str(mine)})
    assert not (tmp_path / "run" / CACHE_NAME).exists()
    # JAX's own thresholds too: its default keeps no compile under a second, and this
    # step compiles in less (loopkit lowers them only for the cache it sets up)
    assert not mine.exists() or not any(mine.iterdir())


def test_false_leaves_jax_alone(tmp_path):
    _run(tmp_path, 5, "{'compilation_cache': False}", env={"JAX_COMPILATION_CACHE_DIR": ""})
    assert not (tmp_path / CACHE_NAME).exists()


def test_the_settings_are_given_back_when_the_session_closes(tmp_path):
    before = (jax.config.jax_compilation_cache_dir,
              jax.config.jax_persistent_cache_min_compile_time_secs)
    loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), logdir=tmp_path, max_steps=2,
                  progress=False, autoload=False)
    assert (tmp_path / CACHE_NAME).is_dir()
    assert (jax.config.jax_compilation_cache_dir,
            jax.config.jax_persistent_cache_min_compile_time_secs) == before
