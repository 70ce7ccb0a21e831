"""latest_checkpoint, load_checkpoint, checkpoints_iterator and `loopkit checkpoints`."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from loopkit.plugins.checkpoint.position import decode_position, encode_position
from loopkit.plugins.checkpoint.tf_file import CheckpointState, read_state, write_state

BACKENDS = ["orbax", "npz"]

Opt = collections.namedtuple("Opt", ["count", "mu"])


def init():
    return {
        "params": {"w": jnp.zeros((2, 3), jnp.float32), "b": jnp.zeros((3,), jnp.bfloat16)},
        "layers": [jnp.zeros((2,), jnp.float32), jnp.zeros((), jnp.int32)],
        "opt": Opt(jnp.zeros((), jnp.int32), jnp.zeros((3,), jnp.float32)),
    }


def step(state):
    return jax.tree.map(lambda x: x + 1, state), {}


def train(logdir, backend="npz", **kw):
    kw.setdefault("save_model_secs", None)
    return loopkit.train(step, init=init, logdir=logdir, checkpoint_backend=backend,
                         progress=False, disable=("summaries",), autoload=False, **kw)


def test_latest_checkpoint(tmp_path):
    assert loopkit.latest_checkpoint(tmp_path) is None
    assert loopkit.latest_checkpoint(tmp_path / "missing") is None
    train(tmp_path, save_model_steps=2, max_steps=5)
    assert loopkit.latest_checkpoint(tmp_path) == (5, str(tmp_path.absolute() / "model.ckpt-5"))
    assert loopkit.latest_checkpoint(str(tmp_path))[0] == 5
    # a hand edit of the checkpoint file picks the checkpoint
    text = (tmp_path / "checkpoint").read_text()
    (tmp_path / "checkpoint").write_text(text.replace('path: "model.ckpt-5"', 'path: "model.ckpt-2"'))
    assert loopkit.latest_checkpoint(tmp_path) == (2, str(tmp_path.absolute() / "model.ckpt-2"))
    # without the file: the newest on disk
    (tmp_path / "checkpoint").unlink()
    assert loopkit.latest_checkpoint(tmp_path)[0] == 5


def test_latest_checkpoint_with_another_basename(tmp_path):
    train(tmp_path, max_steps=3, checkpoint_basename="weights")
    assert loopkit.latest_checkpoint(tmp_path) == (3, str(tmp_path.absolute() / "weights-3"))
    (tmp_path / "checkpoint").unlink()
    assert loopkit.latest_checkpoint(tmp_path) is None  # model.ckpt is the default name
    assert loopkit.latest_checkpoint(tmp_path, basename="weights")[0] == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_checkpoint(tmp_path, backend):
    train(tmp_path, backend, save_model_steps=2, max_steps=3)
    # without like: nested dicts keyed by the path components
    state = loopkit.load_checkpoint(tmp_path)
    assert set(state) == {"params", "layers", "opt"}
    assert set(state["layers"]) == {"0", "1"} and set(state["opt"]) == {"count", "mu"}
    np.testing.assert_array_equal(state["params"]["w"], np.full((2, 3), 3, np.float32))
    assert np.asarray(state["params"]["b"]).dtype == jnp.bfloat16
    assert int(state["opt"]["count"]) == 3
    # a checkpoint path (with or without the npz extension) and a like
    assert loopkit.latest_checkpoint(tmp_path)[0] == 3
    path = str(tmp_path / "model.ckpt-2")
    like = jax.eval_shape(init)
    older = loopkit.load_checkpoint(path, like=like)
    assert isinstance(older["opt"], Opt) and isinstance(older["layers"], list)
    assert isinstance(older["params"]["w"], jax.Array)
    assert int(older["layers"][1]) == 2
    if backend == "npz":
        assert int(loopkit.load_checkpoint(path + ".npz")["layers"]["1"]) == 2
    # a like that does not match names the leaf, and calls it what the caller passed
    # (`like`), not the init state of a run there is none of
    bad = {**like, "params": {**like["params"], "w": jax.ShapeDtypeStruct((4,), jnp.float32)}}
    with pytest.raises(ValueError) as info:
        loopkit.load_checkpoint(tmp_path, like=bad)
    assert "params/w: checkpoint " in str(info.value) and "init state" not in str(info.value)
    assert "has shape (2, 3) dtype float32, the like argument has shape (4,)" in str(info.value)


def test_load_checkpoint_without_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        loopkit.load_checkpoint(tmp_path)


def test_checkpoints_iterator_follows_a_running_training(tmp_path):
    started = threading.Event()

    def slow_step(state):
        started.set()
        time.sleep(0.02)
        return jax.tree.map(lambda x: x + 1, state), {}

    def trainer():
        loopkit.train(slow_step, init=init, logdir=tmp_path, checkpoint_backend="npz",
                      save_model_steps=5, save_model_secs=None, max_steps=30, jit=False,
                      progress=False, disable=("summaries",), autoload=False)

    t = threading.Thread(target=trainer)
    t.start()
    started.wait(60)
    seen = []
    # a generous timeout (a loaded machine may pause); the loop ends at step 30
    for found in loopkit.checkpoints_iterator(tmp_path, timeout=60.0, poll_secs=0.05):
        seen.append(found)
        assert found[1] == str(tmp_path.absolute() / f"model.ckpt-{found[0]}")
        # each one can be loaded while the training goes on
        assert int(loopkit.load_checkpoint(found[1])["opt"]["count"]) == found[0]
        if found[0] == 30:
            break
    t.join()
    steps = [s for s, _ in seen]
    assert steps == sorted(set(steps)) and steps[-1] == 30
    assert set(steps) <= {5, 10, 15, 20, 25, 30} and len(steps) >= 2


def test_checkpoints_iterator_timeout_and_min_interval(tmp_path):
    t0 = time.monotonic()
    assert list(loopkit.checkpoints_iterator(tmp_path, timeout=0.2, poll_secs=0.05)) == []
    assert time.monotonic() - t0 >= 0.2 - 0.05
    train(tmp_path, max_steps=2)
    it = loopkit.checkpoints_iterator(tmp_path, min_interval_secs=0.3, timeout=0.1,
                                      poll_secs=0.05)
    assert next(it)[0] == 2
    assert list(it) == []  # nothing new: ends after the timeout


def test_cli_lists_checkpoints_and_marks_the_one_a_restart_recovers(tmp_path):
    train(tmp_path, "npz", save_model_steps=2, max_steps=6, max_to_keep=None)
    train(tmp_path / "orbax", "orbax", max_steps=1)

    def cli(logdir):
        return subprocess.run([sys.executable, "-m", "loopkit", "checkpoints", str(logdir)],
                              capture_output=True, text=True, timeout=120)

    out = cli(tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == [f"model.ckpt-{s}.npz" for s in (2, 4, 6)]
    assert [ln.split()[2] for ln in lines] == ["2", "4", "6"]
    assert all("KiB" in ln and " ago" in ln for ln in lines)
    assert [("<- latest" in ln) for ln in lines] == [False, False, True]

    text = (tmp_path / "checkpoint").read_text()
    (tmp_path / "checkpoint").write_text(text.replace('path: "model.ckpt-6"', 'path: "model.ckpt-4"'))
    lines = cli(tmp_path).stdout.splitlines()
    assert [("<- latest" in ln) for ln in lines] == [False, True, False]

    lines = cli(tmp_path / "orbax").stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("model.ckpt-1 ") and "<- latest" in lines[0]

    (tmp_path / "empty").mkdir()
    empty = cli(tmp_path / "empty")
    assert empty.returncode == 1 and "no checkpoints in" in empty.stderr

    missing = cli(tmp_path / "missing")
    assert missing.returncode == 1 and "missing does not exist" in missing.stderr
    assert "no checkpoints" not in missing.stderr


def test_cli_piped_into_a_reader_that_leaves_ends_quietly(tmp_path):
    # `loopkit checkpoints LOGDIR | head -1`: the reader closes the pipe before the
    # listing is written; the command must end as a shell tool does, with SIGPIPE's
    # status and no BrokenPipeError traceback
    train(tmp_path, "npz", save_model_steps=2, max_steps=6, max_to_keep=None)
    for verb in ("checkpoints", "goodput"):
        proc = subprocess.Popen([sys.executable, "-m", "loopkit", verb, str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.close()  # the reader is gone before anything is printed
        stderr = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 128 + 13, stderr
        assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


def test_the_checkpoint_file_round_trips_in_tf_format(tmp_path):
    state = CheckpointState(latest=20, listed=[(10, 1.5), (20, 2.5)], last_preserved_timestamp=1.0)
    write_state(tmp_path, state)
    text = (tmp_path / "checkpoint").read_text()
    assert text.splitlines()[:3] == [
        'model_checkpoint_path: "model.ckpt-20"',
        'all_model_checkpoint_paths: "model.ckpt-10"',
        'all_model_checkpoint_paths: "model.ckpt-20"',
    ]
    assert read_state(tmp_path) == state
    # absolute paths inside the logdir, as tf.train may write them, are understood
    (tmp_path / "checkpoint").write_text(
        f'model_checkpoint_path: "{tmp_path.absolute()}/model.ckpt-7"\n'
        f'all_model_checkpoint_paths: "{tmp_path.absolute()}/model.ckpt-7"\n')
    assert read_state(tmp_path).latest == 7 and read_state(tmp_path).listed == [(7, None)]


def test_input_positions_round_trip_through_json():
    pos = {"i": np.int64(3), "blob": b"\x00\xff", "xs": (1, 2.5, None), "arr": np.arange(2)}
    enc = encode_position(pos)
    assert enc["blob"] == {"__loopkit_bytes__": "AP8="}
    assert decode_position(enc) == {"i": 3, "blob": b"\x00\xff", "xs": [1, 2.5, None],
                                    "arr": [0, 1]}
    with pytest.raises(TypeError, match=r"input position.*\['f'\]"):
        encode_position({"f": object()})


# -- what a logdir is, and which backend wrote it ------------------------------------


@pytest.mark.parametrize("name", ["trial-0", "seed-42", "run-3"])
def test_a_logdir_named_like_a_checkpoint_is_read_as_a_logdir(tmp_path, name):
    # a logdir named like <basename>-<step> is not checkpoint 0 of a basename `trial`
    logdir = os.path.join(tmp_path, name)
    loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), max_steps=3, logdir=logdir,
                  progress=False, autoload=False)
    assert loopkit.latest_checkpoint(logdir) == (3, os.path.join(logdir, "model.ckpt-3"))
    assert float(loopkit.load_checkpoint(logdir)) == 3.0
    assert float(loopkit.load_checkpoint(logdir, like=jnp.zeros(()))) == 3.0
    assert float(loopkit.from_pretrained(logdir)(jnp.zeros(()))) == 3.0
    # and a checkpoint path inside it is still a checkpoint path
    assert float(loopkit.load_checkpoint(os.path.join(logdir, "model.ckpt-3"))) == 3.0


PROTO_PLUGIN = '''
import json, os, re
from pathlib import Path
import numpy as np
import loopkit
from loopkit.storage.local import atomic_write_bytes, fsync_dir
from loopkit.state.pytree import leaves_with_paths


class JsonBackend:
    """The six protocol methods and nothing else: <basename>-<step>.pjson files."""

    def __init__(self, directory, basename):
        self.directory, self.basename = Path(directory), basename

    def _file(self, step):
        return self.directory / f"{self.basename}-{step}.pjson"

    def save(self, step, state, metadata):
        leaves = {p: np.asarray(x).tolist() for p, x in leaves_with_paths(state)}
        data = json.dumps({"leaves": leaves, "metadata": metadata}).encode()
        atomic_write_bytes(self._file(step), data)

    def restore(self, step, like):
        data = json.loads(self._file(step).read_text())
        state = {}
        for path, value in data["leaves"].items():
            *parents, last = path.split("/")
            node = state
            for key in parents:
                node = node.setdefault(key, {})
            node[last] = np.asarray(value, np.float32)
        return state, data["metadata"]

    def steps(self):
        pattern = re.compile(re.escape(self.basename) + r"-(\\d+)\\.pjson")
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := pattern.fullmatch(n)))

    def delete(self, step):
        self._file(step).unlink(missing_ok=True)
        fsync_dir(self.directory)

    def wait(self):
        pass

    def close(self):
        pass


@loopkit.hookimpl
def checkpoint_backend(name, directory, config):
    if name == "pjson":
        return JsonBackend(directory, config.checkpoint_basename)
    return None
'''


@pytest.fixture
def protocol_only_backend(tmp_path, monkeypatch):
    """An installed plugin (entry point) whose backend has the six methods and the
    `checkpoint_backend` hook, and no `checkpoint_backend_names`."""
    site = tmp_path / "site"
    (site / "loopkit_test_pjson-0.1.dist-info").mkdir(parents=True)
    (site / "loopkit_test_pjson.py").write_text(PROTO_PLUGIN)
    info = site / "loopkit_test_pjson-0.1.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: loopkit-test-pjson\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[loopkit]\npjson = loopkit_test_pjson\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("LOOPKIT_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    yield
    sys.modules.pop("loopkit_test_pjson", None)


def test_a_backend_with_only_the_protocol_and_the_hook_is_found_by_every_helper(
        tmp_path, protocol_only_backend, capsys):
    from loopkit.process.cli import main

    logdir = tmp_path / "run"
    init = {"w": jnp.zeros(3), "b": jnp.zeros(2)}
    loopkit.train(lambda s: (jax.tree.map(lambda x: x + 1, s), {}), init=init, logdir=logdir,
                  max_steps=4, save_model_steps=2, save_model_secs=None,
                  checkpoint_backend="pjson", progress=False, disable=("summaries",))
    assert sorted(p.name for p in logdir.glob("model.ckpt-*")) == [
        "model.ckpt-2.pjson", "model.ckpt-4.pjson"]
    assert json.loads((logdir / "checkpoint_backend.json").read_text()) == {
        "checkpoint_backend": "pjson"}
    path = str(logdir.absolute() / "model.ckpt-4")
    assert loopkit.latest_checkpoint(logdir) == (4, path)
    assert next(loopkit.checkpoints_iterator(logdir, timeout=0)) == (4, path)
    assert loopkit.load_checkpoint(logdir)["w"].tolist() == [4.0, 4.0, 4.0]
    assert loopkit.load_checkpoint(logdir / "model.ckpt-2", like=init)["b"].tolist() == [2.0, 2.0]
    fresh = loopkit.from_pretrained(logdir, include=["w"])({"w": jnp.zeros(3), "b": -jnp.ones(2)})
    assert fresh["w"].tolist() == [4.0, 4.0, 4.0] and fresh["b"].tolist() == [-1.0, -1.0]
    capsys.readouterr()
    assert main(["checkpoints", str(logdir)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [r.split()[0] for r in rows] == ["model.ckpt-2.pjson", "model.ckpt-4.pjson"]
    assert "<- latest" in rows[1]


def test_sizes_listed_by_loopkit_checkpoints_go_up_to_tib():
    from loopkit.plugins.checkpoint.helpers.listing import _human_size

    assert [_human_size(n) for n in (512, 1536, 5 * 1024 ** 3, 5 * 1024 ** 4)] == [
        "512 B", "1.5 KiB", "5.0 GiB", "5.0 TiB"]
