"""examples/plugin-package: installed for real, found through its entry points."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "examples" / "plugin-package"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    src = tmp_path_factory.mktemp("build") / "pkg"
    shutil.copytree(PACKAGE, src)
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--no-build-isolation", "--target", str(target), str(src)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    return target


def run(site, code, **env):
    full = dict(os.environ, PYTHONPATH=str(site), JAX_PLATFORMS="cpu", **env)
    full.pop("LOOPKIT_DISABLE_PLUGIN_AUTOLOAD", None)
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, env=full, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    return p


def test_listed_as_entry_point_plugins(site):
    p = run(site, "from loopkit.cli import main; main(['plugins'])")
    rows = {line.split()[0]: line for line in p.stdout.splitlines()}
    assert "entry point (loopkit-example-plugin)" in rows["time_limit"]
    assert "session_create" in rows["time_limit"]
    assert "checkpoint_backend" in rows["npz_compressed"]


def test_time_limit_and_compressed_backend_in_a_run(site, tmp_path):
    p = run(site, f"""
        import time, jax.numpy as jnp, numpy as np, loopkit
        def step(s):
            time.sleep(0.01)
            return s + 1, {{}}
        r = loopkit.train(step, init=jnp.zeros(1000), logdir={str(tmp_path)!r}, jit=False,
                          checkpoint_backend="npz-compressed", progress=False)
        print("RESULT", r.stop_reason, r.step)
        state = loopkit.load_checkpoint({str(tmp_path)!r})
        print("LOADED", float(np.asarray(state).ravel()[0]) == r.step)
    """, LOOPKIT_TIME_LIMIT_SECS="1")
    reason, step = p.stdout.split("RESULT")[1].split()[:2]
    assert reason == "requested" and int(step) > 0  # stopped by the time limit, cleanly
    assert "time limit of 1.0 s reached" in p.stderr
    assert "LOADED True" in p.stdout
    ckpt = tmp_path / f"model.ckpt-{step}.npz"
    with zipfile.ZipFile(ckpt) as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_DEFLATED}


def test_without_the_variable_the_time_limit_costs_nothing(site):
    p = run(site, """
        import jax.numpy as jnp, loopkit

        class Timers:
            @loopkit.hookimpl(trylast=True)
            def session_create(self, session):
                print("TIMERS", sorted(t.name for t in session.timers))

        r = loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), max_steps=5,
                          progress=False, checkpoint_backend=None, plugins=[Timers()])
        print("RESULT", r.stop_reason)
    """)
    assert "RESULT max_steps" in p.stdout
    assert "TIMERS []" in p.stdout  # no timer, no hook on the per-step path
