"""Paths and URLs: what a logdir may be, and the start-up errors for ones that cannot work."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from loopkit import storage

pytest.importorskip("fsspec")


def step_fn(state, batch):
    return {"w": state["w"] + batch}, {"loss": jnp.sum(state["w"])}


def data(start):
    return (np.full(3, i, np.float32) for i in range(start, 1000))


def test_a_local_logdir_is_an_absolute_path_as_before(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert loopkit.Config(logdir="runs/a").logdir_path == tmp_path / "runs" / "a"
    assert loopkit.Config(logdir=f"file://{tmp_path}/b").logdir_path == tmp_path / "b"


def test_a_url_logdir_stays_a_url():
    assert loopkit.Config(logdir="memory://bucket/run/").logdir_path == "memory://bucket/run"
    sv = loopkit.Supervisor(logdir="memory://bucket/run", checkpoint_backend=None)
    assert sv.save_path == "memory://bucket/run/model.ckpt"


def test_an_unknown_scheme_fails_at_start_up_naming_it():
    with pytest.raises(ValueError, match=r"Config\.logdir='nosuch://b/run'.*unknown URL scheme "
                                         r"'nosuch'"):
        loopkit.Config(logdir="nosuch://b/run")
    calls = []

    def init():
        calls.append(1)
        return {"w": jnp.zeros(3)}

    with pytest.raises(ValueError, match="nosuch"):
        loopkit.train(step_fn, init=init, data=data, logdir="nosuch://b/run", max_steps=1)
    assert calls == []  # refused before anything ran
    with pytest.raises(ValueError, match=r"logdir='nosuch://b/run'.*unknown URL scheme"):
        loopkit.latest_checkpoint("nosuch://b/run")


@pytest.mark.parametrize("url,module,extra", [
    ("s3://bucket/run", "s3fs", "jax-loopkit[s3]"),
    ("s3://bucket/run", "boto3", "jax-loopkit[s3]"),
    ("gs://bucket/run", "gcsfs", "jax-loopkit[gcs]"),
])
def test_a_url_whose_extra_is_missing_fails_naming_the_extra(monkeypatch, url, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    with pytest.raises(ImportError, match=rf"Config\.logdir='{url}' needs {module}.*"
                                          + re.escape(extra)):
        loopkit.Config(logdir=url)
    with pytest.raises(ImportError, match=module):
        loopkit.load_checkpoint(url)


def test_a_url_whose_client_fails_to_import_names_the_extra(tmp_path):
    # installed but broken (an aiobotocore that refuses the installed botocore): the
    # error still says what to install, on every path, never a bare import error
    broken = tmp_path / "s3fs"
    broken.mkdir()
    (broken / "__init__.py").write_text(
        "raise ImportError(\"cannot import name 'AioSession' from 'aiobotocore'\")\n")
    script = (
        "import loopkit, jax.numpy as jnp\n"
        "for call in (lambda: loopkit.Config(logdir='s3://b/run'),\n"
        "             lambda: loopkit.latest_checkpoint('s3://b/run'),\n"
        "             lambda: loopkit.train(lambda s: (s, {}), init=jnp.zeros(()),\n"
        "                                   logdir='s3://b/run', max_steps=1)):\n"
        "    try:\n"
        "        call()\n"
        "    except ImportError as e:\n"
        "        print('ERR', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=env)
    lines = [x for x in out.stdout.splitlines() if x.startswith("ERR")]
    assert len(lines) == 3, out.stdout + out.stderr
    for line in lines:
        assert "s3fs, which failed to import" in line and "jax-loopkit[s3]" in line, line
        assert "AioSession" in line, line


def test_the_cli_names_a_bad_url():
    out = subprocess.run([sys.executable, "-m", "loopkit", "checkpoints", "nosuch://b/run"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "unknown URL scheme 'nosuch'" in out.stderr


@pytest.mark.parametrize("backend", ["npz", "orbax"])
def test_memory_url_round_trip(backend):
    url = "memory://loopkit-test-" + backend
    storage.remove(url)
    init = {"w": jnp.arange(3, dtype=jnp.float32)}
    r = loopkit.train(step_fn, init=init, data=data, logdir=url, max_steps=4,
                      save_model_steps=2, save_model_secs=None, checkpoint_backend=backend,
                      disable=("summaries",), progress=False, autoload=False)
    assert loopkit.latest_checkpoint(url) == (4, f"{url}/model.ckpt-4")
    np.testing.assert_array_equal(loopkit.load_checkpoint(url)["w"], r.state["w"])
    assert storage.read_bytes(f"{url}/checkpoint").startswith(b'model_checkpoint_path: "model.ckpt-4"')
    storage.remove(url)


def test_the_staged_backend_lists_only_committed_directories():
    from loopkit.plugins.checkpoint.backends.orbax import OrbaxBackend
    from loopkit.plugins.checkpoint.backends.staged import MARKER, StagedBackend

    url = "memory://loopkit-test-staged"
    storage.remove(url)
    # what a crash in the middle of an upload leaves: objects but no marker
    storage.write_atomic(f"{url}/model.ckpt-5/_METADATA", b"{}")
    backend = StagedBackend(url, "model.ckpt", lambda d: OrbaxBackend(d, "model.ckpt"))
    try:
        assert backend.steps() == []
        backend.save(3, {"w": np.arange(4.0)}, {})
        assert backend.steps() == []  # saved locally, not uploaded: not committed
        backend.wait()  # uploads; a writer's first upload removes the partial one
        assert backend.steps() == [3]
        assert storage.exists(f"{url}/model.ckpt-3/{MARKER}")
        assert not storage.exists(f"{url}/model.ckpt-5")
        backend.save(4, {"w": np.arange(4.0) + 1}, {})
        backend.wait()
        assert backend.steps() == [3, 4]
        state, _ = backend.restore(4, None)
        np.testing.assert_array_equal(state["w"], np.arange(4.0) + 1)
        backend.delete(3)
        assert backend.steps() == [4]
        stage = backend._stage
    finally:
        backend.close()
    assert not Path(stage).exists()
    storage.remove(url)


def test_a_local_file_backend_handed_a_url_says_how_to_stage_it():
    from loopkit.plugins.checkpoint.backends.npz import NpzBackend
    from loopkit.plugins.checkpoint.backends.staged import StagedBackend, local_or_staged

    with pytest.raises(ValueError, match=r"NpzBackend writes local files and was given the URL "
                                         r"'memory://x/run'.*local_or_staged"):
        NpzBackend("memory://x/run")
    staged = local_or_staged("memory://x/run", "model.ckpt", lambda d: NpzBackend(d))
    try:
        assert isinstance(staged, StagedBackend)
        assert staged.path(7) == "memory://x/run/model.ckpt-7.npz"
    finally:
        staged.close()


def test_size_and_mtime_of_a_tree_is_its_newest_file(tmp_path):
    # `loopkit checkpoints` shows a checkpoint's age from this: a file written into an
    # old directory makes the tree as young as the file
    tree = tmp_path / "model.ckpt-5"
    (tree / "sub").mkdir(parents=True)
    (tree / "a").write_bytes(b"x" * 10)
    (tree / "sub" / "b").write_bytes(b"y" * 5)
    os.utime(tree, (1_000_000, 1_000_000))
    os.utime(tree / "a", (2_000_000, 2_000_000))
    os.utime(tree / "sub", (1_000_000, 1_000_000))
    os.utime(tree / "sub" / "b", (3_000_000, 3_000_000))
    assert storage.size_and_mtime(tree) == (15, 3_000_000)
    assert storage.size_and_mtime(tree / "a") == (10, 2_000_000)
