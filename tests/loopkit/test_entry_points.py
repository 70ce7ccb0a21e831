"""A real distribution with a `loopkit` entry point, installed into a temp dir."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

DIST = Path(__file__).parent / "entry_point_dist"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    src = tmp_path_factory.mktemp("build") / "dist"
    shutil.copytree(DIST, src)  # building writes into the source tree: not into the repo
    p = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
         "--no-build-isolation", "--target", str(target), str(src)],
        cwd=src, capture_output=True, text=True,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return target


def _run(site, code, **env):
    full = dict(os.environ, PYTHONPATH=str(site), JAX_PLATFORMS="cpu")
    full.pop("LOOPKIT_DISABLE_PLUGIN_AUTOLOAD", None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full, timeout=120)


TRAIN = """
    import jax.numpy as jnp, loopkit
    r = loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), max_steps=3,
                      progress=False, checkpoint_backend=None, disable=%s)
    print("DONE", r.step)
"""


def test_entry_point_plugin_is_discovered_and_called(site):
    p = _run(site, TRAIN % '("ep_broken",)')
    assert p.returncode == 0, p.stderr
    assert "EP_DEMO session_create 0" in p.stdout
    assert "EP_DEMO on_stop 3" in p.stdout and "DONE 3" in p.stdout


def test_entry_point_plugin_can_be_disabled_by_name(site):
    p = _run(site, TRAIN % '("ep_broken", "ep_demo")')
    assert p.returncode == 0, p.stderr
    assert "EP_DEMO" not in p.stdout and "DONE 3" in p.stdout


def test_autoload_switch_turns_entry_points_off(site):
    p = _run(site, TRAIN % "()", LOOPKIT_DISABLE_PLUGIN_AUTOLOAD="1")
    assert p.returncode == 0, p.stderr
    assert "EP_DEMO" not in p.stdout and "DONE 3" in p.stdout
    # a config naming an entry-point plugin in `disable` still works with autoload off
    p = _run(site, TRAIN % '("ep_demo",)', LOOPKIT_DISABLE_PLUGIN_AUTOLOAD="1")
    assert p.returncode == 0, p.stderr


def test_import_failure_names_the_plugin(site):
    p = _run(site, TRAIN % "()")
    assert p.returncode != 0
    assert 'Error importing plugin "ep_broken"' in p.stderr
    assert "broken on purpose" in p.stderr


def test_cli_lists_plugins_with_origin_and_hooks(site):
    p = _run(site, "from loopkit.process.cli import main; main(['plugins'])",)
    # the broken plugin makes listing fail loudly too, naming it
    assert 'Error importing plugin "ep_broken"' in p.stderr
    full = dict(os.environ, PYTHONPATH=str(site), JAX_PLATFORMS="cpu")
    full.pop("LOOPKIT_DISABLE_PLUGIN_AUTOLOAD", None)
    p = subprocess.run([sys.executable, "-c",
                        "import loopkit.plugin.manager as m, loopkit.process.cli as c;"
                        "from loopkit import Config;"
                        "orig = m.make_plugin_manager;"
                        "m.make_plugin_manager = lambda cfg, plugins=(): orig(Config(disable=('ep_broken',)));"
                        "c.main(['plugins'])"],
                       capture_output=True, text=True, env=full, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = {l.split()[0]: l for l in p.stdout.splitlines()}
    assert "entry point (loopkit-ep-demo)" in lines["ep_demo"]
    assert "on_stop" in lines["ep_demo"] and "session_create" in lines["ep_demo"]
    assert "built-in" in lines["init"] and "init_state" in lines["init"]


def test_python_dash_m_loopkit_plugins():
    p = subprocess.run([sys.executable, "-m", "loopkit", "plugins"], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.returncode == 0, p.stderr
    names = [l.split()[0] for l in p.stdout.splitlines()]
    for builtin in ("init", "summaries", "checkpoint", "step_counter", "progress", "prefetch",
                    "nan_guard", "profiler", "watchdog", "goodput"):
        assert builtin in names
