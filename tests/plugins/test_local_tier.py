"""The local checkpoint tier: a process killed on a machine that lives resumes from it.

Real orbax checkpoints; the crash tests run tests/plugins/local_tier_worker.py in a
subprocess and kill it with SIGKILL once a local checkpoint newer than the durable
one is committed, then restart it: it resumes from the local tier (or, with the
local directory wiped, as on a lost machine, from the durable one) and finishes
bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from loopkit.plugins.checkpoint import RESTORED_TIER
from loopkit.plugins.checkpoint.tf_file import read_state
from loopkit.plugins.goodput.records import read_records

WORKER = Path(__file__).with_name("local_tier_worker.py")
MAX_STEPS = 300


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"loopkit_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


crash = _load(Path(__file__).with_name("crash_worker.py"))


def host(state: dict) -> dict[str, np.ndarray]:
    return {k: np.asarray(v.astype(jnp.float32) if k == "h" else v) for k, v in state.items()}


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    """The uninterrupted run, in this process, without checkpoints."""
    r = loopkit.train(crash.step_fn, init=crash.init, data=crash.data, max_steps=MAX_STEPS,
                      checkpoint_backend=None, disable=("summaries",), progress=False,
                      autoload=False)
    return host(r.state)


def latest(directory: Path) -> int | None:
    state = read_state(directory)
    return None if state is None else state.latest


class Life:
    def __init__(self, tmp: Path) -> None:
        self.log = open(tmp / "stderr.txt", "ab")
        env = dict(os.environ, LOOPKIT_DISABLE_PLUGIN_AUTOLOAD="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp / "run"), str(tmp / "local"),
             str(MAX_STEPS), str(tmp / "final.npz")],
            stdout=subprocess.PIPE, stderr=self.log, env=env, text=True)
        self.started = self.proc.stdout.readline().split()  # ["started", step, tier]

    def kill_once_local_is_ahead(self, tmp: Path, beyond: int) -> tuple[int, int]:
        """SIGKILL once the local tier names a step past `beyond` and past the durable
        tier's (which holds one)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            local, durable = latest(tmp / "local"), latest(tmp / "run")
            if local is not None and durable is not None and local > beyond and local > durable:
                self.proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.01)
        assert self.proc.wait(timeout=60) == -signal.SIGKILL, (tmp / "stderr.txt").read_text()
        self.log.close()
        return latest(tmp / "local"), latest(tmp / "run")

    def finish(self, tmp: Path) -> None:
        out, _ = self.proc.communicate(timeout=120)
        self.log.close()
        assert self.proc.returncode == 0, (tmp / "stderr.txt").read_text()[-3000:]
        assert out.split() == ["done", str(MAX_STEPS)]


def assert_bitwise(out: Path, reference: dict[str, np.ndarray]) -> None:
    final = dict(np.load(out))
    assert final.keys() == reference.keys()
    for key, want in reference.items():
        assert final[key].dtype == want.dtype and final[key].tobytes() == want.tobytes(), key


def test_sigkill_after_a_local_save_resumes_from_the_local_step(tmp_path, reference):
    life = Life(tmp_path)
    assert life.started == ["started", "0", "None"]
    local, durable = life.kill_once_local_is_ahead(tmp_path, beyond=45)
    assert local > durable  # the work since the durable save is not lost
    life = Life(tmp_path)
    assert life.started == ["started", str(local), "local"]
    life.finish(tmp_path)
    assert_bitwise(tmp_path / "final.npz", reference)
    errors = (tmp_path / "stderr.txt").read_text()
    assert "unreadable" not in errors and "Traceback" not in errors, errors[-3000:]
    # the logdir's checkpoint file names durable checkpoints only
    durable_listed = [s for s, _ in read_state(tmp_path / "run").listed]
    assert durable_listed and all(s % 20 == 0 for s in durable_listed), durable_listed
    assert latest(tmp_path / "run") == MAX_STEPS
    # the goodput ledger says where each session restored from
    starts = [r for r in read_records(tmp_path / "run") if r.event == "start"]
    assert [(r.step, r.tier) for r in starts] == [(0, None), (local, "local")]


def test_a_wiped_local_directory_resumes_from_the_durable_step(tmp_path, reference):
    life = Life(tmp_path)
    local, durable = life.kill_once_local_is_ahead(tmp_path, beyond=45)
    assert local > durable
    shutil.rmtree(tmp_path / "local")  # a lost machine: its local disk is gone
    life = Life(tmp_path)
    assert life.started == ["started", str(durable), "durable"]
    life.finish(tmp_path)
    assert_bitwise(tmp_path / "final.npz", reference)
    starts = [r for r in read_records(tmp_path / "run") if r.event == "start"]
    assert [(r.step, r.tier) for r in starts] == [(0, None), (durable, "durable")]


def data(start: int):
    return (np.full((4,), float(i), np.float32) for i in itertools.count(start))


def step_fn(state: dict, batch):
    return {"w": state["w"] * 0.5 + batch}, {}


def run(tmp_path: Path, max_steps: int, **config):
    settings = dict(logdir=tmp_path / "run", local_checkpoint_dir=tmp_path / "local",
                    save_model_steps=10, save_model_secs=None, save_local_steps=3,
                    save_local_secs=None, max_steps=max_steps, disable=("summaries",),
                    progress=False, autoload=False)
    settings.update(config)
    seen = {}

    class Tier:
        @loopkit.hookimpl
        def session_create(self, session) -> None:
            seen["tier"] = session.stash[RESTORED_TIER]

    plugins = [Tier(), *settings.pop("plugins", [])]
    result = loopkit.train(step_fn, init=lambda: {"w": jnp.ones((4,), jnp.float32)},
                           data=data, plugins=plugins, **settings)
    return result, seen["tier"]


def test_the_local_tier_keeps_max_to_keep_local_and_its_own_checkpoint_file(tmp_path):
    result, tier = run(tmp_path, 25, max_to_keep_local=2)
    assert tier is None and result.step == 25
    local = tmp_path / "local"
    # local saves at 3, 6, ..., 24: the last two stay, listed in local/checkpoint
    assert sorted(p.name for p in local.iterdir() if p.name.startswith("model.ckpt")) == [
        "model.ckpt-21", "model.ckpt-24"]
    assert [s for s, _ in read_state(local).listed] == [21, 24]
    # the logdir lists the durable saves (every 10 steps and the final one) only
    assert [s for s, _ in read_state(tmp_path / "run").listed] == [10, 20, 25]


def test_the_helpers_read_a_local_tier_directory(tmp_path):
    run(tmp_path, 25)
    local = tmp_path / "local"
    assert loopkit.latest_checkpoint(local) == (24, str(local / "model.ckpt-24"))
    at_24, _ = run(tmp_path / "again", 24, local_checkpoint_dir=tmp_path / "again-local")
    want = np.asarray(at_24.state["w"])
    got = loopkit.load_checkpoint(local)
    assert got["w"].tobytes() == want.tobytes()
    like = {"w": jnp.zeros((4,), jnp.float32)}
    got = loopkit.load_checkpoint(local / "model.ckpt-21", like)
    assert np.asarray(got["w"]).shape == (4,)
    assert [s for s, _ in loopkit.checkpoints_iterator(local, timeout=0)] == [24]


def test_a_relative_local_dir_is_listed_from_another_directory(tmp_path, monkeypatch):
    # local_checkpoint_dir="local", relative to where the run started: `loopkit
    # checkpoints LOGDIR` run elsewhere (an evaluator's directory) must still list the
    # local tier, from where the run had it, not a "local" beside the caller
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "local").mkdir(parents=True)  # a decoy where the caller stands
    monkeypatch.chdir(tmp_path / "a")
    run(tmp_path, 13, local_checkpoint_dir="local")
    out = subprocess.run([sys.executable, "-m", "loopkit", "checkpoints", "--json",
                          str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path / "b")
    assert out.returncode == 0, out.stderr
    local = [r for r in json.loads(out.stdout) if r["tier"] == "local"]
    assert [r["step"] for r in local] == [9, 12], out.stdout
    assert {Path(r["path"]).parent for r in local} == {tmp_path / "a" / "local"}


def test_a_restart_takes_the_newer_tier_and_names_it(tmp_path):
    run(tmp_path, 25, save_model_steps=None)  # durable: the final save at 25 only
    shutil.rmtree(tmp_path / "run" / "model.ckpt-25")  # as if killed before the final save
    (tmp_path / "run" / "checkpoint").unlink()
    result, tier = run(tmp_path, 30, save_model_steps=None)
    assert tier == "local" and result.step == 30
    # the stop saved 30 to the durable tier, newer than the local tier's 27
    assert [s for s, _ in read_state(tmp_path / "local").listed] == [24, 27]
    result, tier = run(tmp_path, 31)
    assert tier == "durable" and result.step == 31


def test_a_run_restored_from_the_local_tier_and_stopped_at_once_saves_it_durably(tmp_path):
    run(tmp_path, 25, save_model_steps=None)
    shutil.rmtree(tmp_path / "run" / "model.ckpt-25")
    (tmp_path / "run" / "checkpoint").unlink()
    result, tier = run(tmp_path, 24, save_model_steps=None)
    assert tier == "local" and result.step == 24
    assert loopkit.latest_checkpoint(tmp_path / "run") == (24, str(tmp_path / "run" / "model.ckpt-24"))


def test_a_corrupt_newest_local_checkpoint_falls_back_with_a_warning(tmp_path, caplog):
    run(tmp_path, 25)
    for f in (tmp_path / "local" / "model.ckpt-24").rglob("*"):
        if f.is_file():
            os.truncate(f, f.stat().st_size // 2)
    (tmp_path / "run" / "model.ckpt-25").rename(tmp_path / "moved-25")
    (tmp_path / "run" / "checkpoint").unlink()
    with caplog.at_level(logging.WARNING, logger="loopkit"):
        result, tier = run(tmp_path, 26)
    assert "local checkpoint" in caplog.text and "model.ckpt-24" in caplog.text
    assert tier == "local"  # the older local checkpoint, 21, is newer than durable 20
    assert result.step == 26


@pytest.mark.parametrize("field, value, allowed", [
    ("local_checkpoint_dir", "s3://bucket/local", "a local path"),
    ("local_checkpoint_dir", "", "a local path"),
    ("save_local_secs", -1, 'a number of seconds >= 0, None, or "auto"'),
    ("save_local_secs", "fast", 'a number of seconds >= 0, None, or "auto"'),
    ("save_local_steps", 1.5, "an int >= 0 or None"),
    ("max_to_keep_local", -1, "an int >= 0 or None"),
])
def test_config_refuses_bad_local_tier_settings(tmp_path, field, value, allowed):
    settings = {"logdir": tmp_path, "local_checkpoint_dir": tmp_path / "local", field: value}
    with pytest.raises(ValueError, match=f"Config.{field}=") as info:
        loopkit.Config(**settings)
    assert allowed in str(info.value)


def test_config_refuses_a_local_tier_in_the_logdir_or_without_one(tmp_path):
    with pytest.raises(ValueError, match="local_checkpoint_dir.*is Config.logdir"):
        loopkit.Config(logdir=tmp_path, local_checkpoint_dir=str(tmp_path))
    with pytest.raises(ValueError, match="local_checkpoint_dir.*needs Config.logdir"):
        loopkit.Config(local_checkpoint_dir=tmp_path / "local")
    c = loopkit.Config(logdir=tmp_path)
    assert (c.local_checkpoint_dir, c.save_local_secs, c.save_local_steps,
            c.max_to_keep_local) == (None, 60, None, 2)


def test_saves_of_both_tiers_at_one_step_share_one_staging(tmp_path):
    stagings = []

    class Count:
        @loopkit.hookimpl
        def session_create(self, session) -> None:
            stage = session.stage_state

            def counted():
                stagings.append(session.step)
                return stage()

            session.stage_state = counted

    run(tmp_path, 13, save_model_steps=6, plugins=[Count()])
    # local saves at 3, 6, 9, 12; durable at 6, 12 and the final 13: one staging a step
    assert stagings == [3, 6, 9, 12, 13]
    durable = loopkit.load_checkpoint(tmp_path / "run" / "model.ckpt-12")
    local = loopkit.load_checkpoint(tmp_path / "local" / "model.ckpt-12")
    assert durable["w"].tobytes() == local["w"].tobytes()
    assert [s for s, _ in read_state(tmp_path / "local").listed] == [9, 12]
