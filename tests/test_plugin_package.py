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
    p = run(site, "from loopkit.process.cli import main; main(['plugins'])")
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
    """, LOOPKIT_TIME_LIMIT_SECS="1")
    reason, step = p.stdout.split("RESULT")[1].split()[:2]
    assert reason == "requested" and int(step) > 0  # stopped by the time limit, cleanly
    assert "time limit of 1.0 s reached" in p.stderr
    ckpt = tmp_path / f"model.ckpt-{step}.npzc"
    with zipfile.ZipFile(ckpt) as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_DEFLATED}
    assert not list(tmp_path.glob("*.npz"))  # its own files, which no built-in backend reads


def test_every_helper_and_the_cli_read_the_plugin_backend(site, tmp_path):
    p = run(site, f"""
        import jax, jax.numpy as jnp, numpy as np, loopkit
        from loopkit.process.cli import main
        logdir = {str(tmp_path)!r}
        init = {{"w": jnp.zeros(3), "b": jnp.zeros(2)}}
        r = loopkit.train(lambda s: (jax.tree.map(lambda x: x + 1, s), {{}}), init=init,
                          logdir=logdir, max_steps=4, save_model_steps=2, save_model_secs=None,
                          checkpoint_backend="npz-compressed", progress=False)
        step, path = loopkit.latest_checkpoint(logdir)
        print("LATEST", step, path)
        print("ITER", next(loopkit.checkpoints_iterator(logdir, timeout=0)))
        print("LOAD", float(loopkit.load_checkpoint(logdir)["w"][0]),
              float(loopkit.load_checkpoint(logdir + "/model.ckpt-2", like=init)["b"][1]))
        fresh = loopkit.from_pretrained(logdir, include=["w"])({{"w": jnp.zeros(3), "b": -jnp.ones(2)}})
        print("PRETRAINED", float(fresh["w"][2]), float(fresh["b"][0]))
        main(["checkpoints", logdir])
    """)
    out = p.stdout
    assert f"LATEST 4 {tmp_path}/model.ckpt-4" in out
    assert f"ITER (4, '{tmp_path}/model.ckpt-4')" in out
    assert "LOAD 4.0 2.0" in out
    assert "PRETRAINED 4.0 -1.0" in out
    rows = [ln for ln in out.splitlines() if ln.startswith("model.ckpt-")]
    assert [r.split()[0] for r in rows] == ["model.ckpt-2.npzc", "model.ckpt-4.npzc"]
    assert "<- latest" in rows[1]


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


def test_a_step_counter_from_the_public_surface_alone(site, tmp_path):
    p = run(site, f"""
        import jax.numpy as jnp, loopkit
        from loopkit.testing import FakeClock, Tick
        from loopkit_example_plugin.rate import StepRate
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        clock = FakeClock()
        loopkit.train(lambda s: (s + 1, {{}}), init=jnp.zeros(()), max_steps=25,
                      logdir={str(tmp_path)!r}, checkpoint_backend=None, progress=False,
                      disable=("step_counter",), clock=clock,
                      plugins=[StepRate(tag="example/rate", steps=10), Tick(clock, 0.25)])
        acc = EventAccumulator({str(tmp_path)!r}); acc.Reload()
        print("TAGS", sorted(t for t in acc.Tags()["scalars"]  # the goodput built-in's aside
                             if ("rate" in t or "sec" in t) and not t.startswith("goodput/")))
        print("RATE", [(e.step, e.value) for e in acc.Scalars("example/rate")])
    """)
    # the built-in is off; the plugin's timer counted at 10 and 20, on_stop the last stretch
    assert "TAGS ['example/rate']" in p.stdout
    assert "RATE [(10, 4.0), (20, 4.0), (25, 4.0)]" in p.stdout  # 1 step per 0.25 s

