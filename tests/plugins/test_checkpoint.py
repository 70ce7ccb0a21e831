"""The `checkpoint` plugin on real checkpoints: timers, final saves, recovery, retention."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from loopkit.process.compile_cache import CACHE_NAME
from loopkit.process.logdir_lock import LOCK_NAME
from loopkit.plugin.manager import make_plugin_manager
from loopkit.plugins import checkpoint as ckpt_plugin
from loopkit.plugins.checkpoint.tf_file import read_state
from loopkit.plugins.checkpoint.backends.npz import NpzBackend
from loopkit.plugins.goodput.records import LEDGER_NAME
from loopkit.testing import FakeClock

BACKENDS = ["orbax", "npz"]


def count_step(state, batch):
    return {"w": state["w"] + batch, "n": state["n"] + 1}, {"w0": state["w"][0]}


def init():
    return {"w": jnp.zeros((3,), jnp.float32), "n": jnp.zeros((), jnp.int32)}


def data(start_step):
    return (np.full((3,), float(i), np.float32) for i in itertools.count(start_step))


def expected(steps: int) -> dict:
    """The state after `steps` steps of `count_step` on `data`."""
    return {"w": np.full((3,), steps * (steps - 1) / 2, np.float32), "n": np.int32(steps)}


def run(logdir, backend="npz", *, plugins=(), **kw):
    kw.setdefault("save_model_secs", None)
    return loopkit.train(count_step, init=init, data=data, logdir=logdir,
                         checkpoint_backend=backend, plugins=plugins, progress=False,
                         disable=("summaries",), autoload=False, **kw)


def steps_on_disk(logdir: Path) -> list[int]:
    out = []
    for p in Path(logdir).iterdir():
        name = p.name[:-4] if p.name.endswith(".npz") else p.name
        if name.startswith("model.ckpt-") and name[11:].isdigit():
            out.append(int(name[11:]))
    return sorted(out)


def listed(logdir: Path) -> tuple[int | None, list[int]]:
    state = read_state(logdir)
    return state.latest, [s for s, _ in state.listed]


def restore(logdir: Path, step: int, backend: str) -> tuple[dict, dict]:
    """Read one checkpoint back with a fresh backend, as a new process would."""
    if backend == "npz":
        b = NpzBackend(logdir)
    else:
        from loopkit.plugins.checkpoint.backends.orbax import OrbaxBackend

        b = OrbaxBackend(logdir)
    try:
        state, meta = b.restore(step, None)
    finally:
        b.close()
    return jax.tree.map(np.asarray, state), meta


def assert_state(got, steps):
    want = expected(steps)
    np.testing.assert_array_equal(np.asarray(got["w"]), want["w"])
    assert int(got["n"]) == steps


class Seen:
    """Remembers what the session started from and how the last save held the loop."""

    restored = start = blocking = None

    @loopkit.hookimpl
    def session_create(self, session):
        self.restored, self.start = session.restored, session.step

    @loopkit.hookimpl
    def on_stop(self, session):
        self.blocking = session.plugin_manager.get_plugin("checkpoint").blocking_secs


class Recording:
    """A backend instance wrapping another, recording calls (and the checkpoint file then)."""

    def __init__(self, inner, logdir: Path) -> None:
        self.inner, self.logdir = inner, logdir
        self.calls: list[tuple] = []

    def save(self, step, state, metadata):
        self.calls.append(("save", step, listed(self.logdir) if (self.logdir / "checkpoint").exists()
                           else None))
        self.inner.save(step, state, metadata)

    def restore(self, step, like):
        self.calls.append(("restore", step))
        return self.inner.restore(step, like)

    def steps(self):
        return self.inner.steps()

    def delete(self, step):
        self.calls.append(("delete", step))
        self.inner.delete(step)

    def wait(self):
        self.calls.append(("wait",))
        self.inner.wait()

    def close(self):
        self.calls.append(("close",))
        self.inner.close()

    def saves(self) -> list[int]:
        return [c[1] for c in self.calls if c[0] == "save"]


def no_commit_threads() -> bool:
    return not any(t.name.startswith("loopkit-checkpoint") for t in threading.enumerate())


# -- activation and backends -------------------------------------------------------------


def test_inactive_without_logdir_or_backend(tmp_path):
    assert ckpt_plugin.plugin(loopkit.Config()) is None
    assert ckpt_plugin.plugin(loopkit.Config(logdir=tmp_path, checkpoint_backend=None)) is None
    pm = make_plugin_manager(loopkit.Config(autoload=False))
    assert pm.inactive["checkpoint"] == ckpt_plugin.INACTIVE
    assert "Config.logdir" in ckpt_plugin.INACTIVE
    r = run(tmp_path, backend=None, max_steps=3)
    # nothing but the run's logdir lock (loopkit.process.logdir_lock): no checkpoint, no event file
    # no checkpoint: only the run's lock, the compilation cache and the goodput ledger
    assert r.step == 3 and {p.name for p in tmp_path.iterdir()} <= {LOCK_NAME, CACHE_NAME,
                                                                     LEDGER_NAME}


def test_unknown_backend_name_is_an_error_naming_the_field(tmp_path):
    with pytest.raises(ValueError) as info:
        run(tmp_path, backend="zarr", max_steps=1)
    msg = str(info.value)
    assert "Config.checkpoint_backend='zarr'" in msg
    assert "'orbax'" in msg and "'npz'" in msg


def test_a_plugin_adds_a_backend_by_name(tmp_path):
    built = []

    class Compressed:
        @loopkit.hookimpl
        def checkpoint_backend(self, name, directory, config):
            if name == "mine":
                built.append(directory)
                return Recording(NpzBackend(directory, config.checkpoint_basename), directory)
            return None

    r = run(tmp_path, backend="mine", plugins=[Compressed()], save_model_steps=2, max_steps=4)
    assert r.step == 4 and built == [tmp_path.absolute()]
    assert steps_on_disk(tmp_path) == [2, 4]
    # built-in names still resolve with the plugin present
    run(tmp_path / "b", backend="npz", plugins=[Compressed()], max_steps=1)
    assert len(built) == 1


def test_a_backend_instance_is_used_as_is_and_left_open(tmp_path):
    backend = Recording(NpzBackend(tmp_path), tmp_path)
    run(tmp_path, backend=backend, save_model_steps=2, max_steps=5)
    assert backend.saves() == [2, 4, 5]
    assert ("close",) not in backend.calls and backend.calls[-1] == ("wait",)
    backend.calls.clear()
    r = run(tmp_path, backend=backend, max_steps=7)  # the same instance restores
    assert backend.calls[0] == ("restore", 5) and r.step == 7
    assert_state(r.state, 7)


# -- when saves happen ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_timer_saves_at_multiples_and_once_more_at_the_stop(tmp_path, backend):
    seen = Seen()
    r = run(tmp_path, backend, save_model_steps=4, max_steps=10, max_to_keep=None,
            plugins=[seen])
    assert r.step == 10 and no_commit_threads()
    assert steps_on_disk(tmp_path) == [4, 8, 10]
    assert listed(tmp_path) == (10, [4, 8, 10])
    for step in (4, 8, 10):
        state, meta = restore(tmp_path, step, backend)
        assert_state(state, step)
        assert meta["step"] == step and meta["data_position"] is None
    assert seen.blocking is not None and seen.blocking >= 0


def test_seconds_timer_with_a_fake_clock(tmp_path):
    clock = FakeClock()

    class Tick:  # one fake second per step
        @loopkit.hookimpl
        def after_step(self):
            clock.advance(1.0)

    run(tmp_path, save_model_secs=5, max_steps=12, max_to_keep=None, plugins=[Tick()],
        clock=clock)
    assert steps_on_disk(tmp_path) == [5, 10, 12]


@pytest.mark.parametrize("stop", ["max_steps", "data_exhausted", "requested"])
def test_a_normal_stop_saves_even_with_both_triggers_off(tmp_path, stop):
    kw = {"max_steps": 6} if stop == "max_steps" else {}
    feed = data
    plugins = []
    if stop == "data_exhausted":
        def feed(start):
            return itertools.islice(data(start), 6 - start)
    if stop == "requested":
        class Stopper:
            @loopkit.hookimpl
            def after_step(self, session, step):
                if step == 6:
                    session.request_stop()
        plugins = [Stopper()]
    r = loopkit.train(count_step, init=init, data=feed, logdir=tmp_path,
                      checkpoint_backend="npz", save_model_secs=None, save_model_steps=None,
                      plugins=plugins, progress=False, disable=("summaries",), autoload=False,
                      **kw)
    assert r.stop_reason == stop and r.step == 6
    assert steps_on_disk(tmp_path) == [6] and listed(tmp_path) == (6, [6])
    assert_state(restore(tmp_path, 6, "npz")[0], 6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stop_by_error_saves_nothing_new_but_commits_the_pending_save(tmp_path, backend):
    class Boom:
        @loopkit.hookimpl
        def after_step(self, step):
            if step == 5:
                raise RuntimeError("boom at 5")

    with pytest.raises(RuntimeError, match="boom at 5"):
        run(tmp_path, backend, save_model_steps=2, max_steps=10, plugins=[Boom()])
    assert no_commit_threads()
    # the save at 4 had committed when train raised; nothing was saved at 5
    assert steps_on_disk(tmp_path) == [2, 4] and listed(tmp_path) == (4, [2, 4])


def test_a_run_resumed_at_max_steps_saves_nothing(tmp_path):
    run(tmp_path, max_steps=6)
    before = os.stat(tmp_path / "model.ckpt-6.npz")
    text = (tmp_path / "checkpoint").read_text()
    backend = Recording(NpzBackend(tmp_path), tmp_path)
    seen = Seen()
    r = run(tmp_path, backend=backend, max_steps=6, plugins=[seen])
    assert r.step == 6 and seen.start == 6 and backend.saves() == []
    after = os.stat(tmp_path / "model.ckpt-6.npz")
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert (tmp_path / "checkpoint").read_text() == text


def test_local_init_fn_changing_the_restored_state_is_saved_again(tmp_path):
    run(tmp_path, max_steps=6)
    r = run(tmp_path, max_steps=6,
            local_init_fn=lambda s: setattr(s, "state", {**s.state, "w": s.state["w"] + 100}))
    assert r.step == 6
    np.testing.assert_array_equal(restore(tmp_path, 6, "npz")[0]["w"], expected(6)["w"] + 100)


# -- recovery ------------------------------------------------------------------------------


def test_resume_continues_exactly(tmp_path):
    run(tmp_path, save_model_steps=3, max_steps=7)
    seen = Seen()
    r = run(tmp_path, save_model_steps=3, max_steps=12, plugins=[seen])
    assert seen.start == 7 and seen.restored.step == 7
    assert seen.restored.path == str(tmp_path.absolute() / "model.ckpt-7")
    assert_state(r.state, 12)


def garble(path: Path, how: str) -> None:
    """Damage every file of a checkpoint (an .npz file or an orbax directory)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    assert files
    rng = np.random.default_rng(0)
    for f in files:
        size = f.stat().st_size
        if how == "truncate":
            os.truncate(f, size // 2)
        else:
            f.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())


def ckpt_path(logdir: Path, step: int, backend: str) -> Path:
    return logdir / (f"model.ckpt-{step}" + (".npz" if backend == "npz" else ""))


@pytest.mark.parametrize("how", ["truncate", "garble"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_corrupt_newest_checkpoint_is_skipped_with_a_warning(tmp_path, backend, how, caplog):
    run(tmp_path, backend, save_model_steps=3, max_steps=9, max_to_keep=None)
    garble(ckpt_path(tmp_path, 9, backend), how)
    seen = Seen()
    with caplog.at_level(logging.WARNING, logger="loopkit"):
        r = run(tmp_path, backend, save_model_steps=3, max_steps=10, max_to_keep=None,
                plugins=[seen])
    warnings = [rec for rec in caplog.records if rec.name == "loopkit"
                and rec.levelno == logging.WARNING]
    assert any(str(tmp_path.absolute() / "model.ckpt-9") in rec.getMessage() for rec in warnings)
    assert seen.start == 6
    assert_state(r.state, 10)
    # the damaged step was saved again by the resumed run
    assert_state(restore(tmp_path, 9, backend)[0], 9)
    assert listed(tmp_path) == (10, [3, 6, 9, 10])


@pytest.mark.parametrize("backend", BACKENDS)
def test_when_no_checkpoint_restores_start_up_fails(tmp_path, backend):
    run(tmp_path, backend, save_model_steps=3, max_steps=6)
    for step in (3, 6):
        garble(ckpt_path(tmp_path, step, backend), "truncate")
    with pytest.raises(loopkit.CheckpointError) as info:
        run(tmp_path, backend, save_model_steps=3, max_steps=9)
    assert "model.ckpt-6" in str(info.value) and "model.ckpt-3" in str(info.value)
    assert steps_on_disk(tmp_path) == [3, 6]  # nothing was saved over them


@pytest.mark.parametrize("first,then", [("orbax", "npz"), ("npz", "orbax")])
def test_a_logdir_of_another_backend_is_refused_never_started_fresh(tmp_path, first, then):
    # a run that changes Config.checkpoint_backend over its logdir sees none of the
    # checkpoints: it started fresh with a warning, and saved over the run's steps
    run(tmp_path, first, save_model_steps=3, max_steps=6)
    with pytest.raises(loopkit.CheckpointError) as info:
        run(tmp_path, then, save_model_steps=3, max_steps=9)
    msg = str(info.value)
    assert f"backend {first!r}" in msg and f"checkpoint_backend={then!r}" in msg
    assert f"set checkpoint_backend={first!r} to resume" in msg
    assert listed(tmp_path) == (6, [3, 6])  # nothing written over the run
    seen = Seen()
    r = run(tmp_path, first, save_model_steps=3, max_steps=9, plugins=[seen])
    assert seen.start == 6
    assert_state(r.state, 9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_logdir_of_another_basename_is_refused_never_started_fresh(tmp_path, backend):
    # the same with a changed Config.checkpoint_basename: the checkpoint file's entries
    # were ignored as "not a checkpoint name", and the run started fresh over them
    run(tmp_path, backend, save_model_steps=3, max_steps=6)
    with pytest.raises(loopkit.CheckpointError) as info:
        run(tmp_path, backend, save_model_steps=3, max_steps=9, checkpoint_basename="ckpt")
    msg = str(info.value)
    assert "basename 'model.ckpt' (the latest model.ckpt-6)" in msg
    assert "set checkpoint_basename='model.ckpt' to resume" in msg
    assert listed(tmp_path) == (6, [3, 6]) and steps_on_disk(tmp_path) == [3, 6]
    assert not list(tmp_path.glob("ckpt-*"))


def test_a_checkpoint_file_naming_a_missing_checkpoint_falls_back(tmp_path, caplog):
    run(tmp_path, save_model_steps=3, max_steps=6)
    (tmp_path / "model.ckpt-6.npz").unlink()
    seen = Seen()
    with caplog.at_level(logging.WARNING, logger="loopkit"):
        run(tmp_path, max_steps=6, plugins=[seen])
    assert seen.start == 3
    assert any("model.ckpt-6" in r.getMessage() for r in caplog.records)


def test_without_a_checkpoint_file_the_newest_is_recovered(tmp_path):
    run(tmp_path, save_model_steps=2, max_steps=5)
    (tmp_path / "checkpoint").unlink()
    seen = Seen()
    run(tmp_path, max_steps=5, plugins=[seen])
    assert seen.start == 5


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shape_mismatch_names_the_leaf(tmp_path, backend):
    run(tmp_path, backend, max_steps=2)

    def other_init():
        return {"w": jnp.zeros((4,), jnp.float32), "n": jnp.zeros((), jnp.int32)}

    with pytest.raises(ValueError) as info:
        loopkit.train(count_step, init=other_init, data=data, logdir=tmp_path,
                      checkpoint_backend=backend, max_steps=4, progress=False,
                      disable=("summaries",), autoload=False)
    assert not isinstance(info.value, loopkit.CheckpointError)
    assert "w: " in str(info.value) and "(3,)" in str(info.value) and "(4,)" in str(info.value)
    assert steps_on_disk(tmp_path) == [2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hand_picked_older_checkpoint_is_recovered_and_newer_ones_leave_the_list(
        tmp_path, backend):
    run(tmp_path, backend, save_model_steps=3, max_steps=12, max_to_keep=None)
    assert listed(tmp_path) == (12, [3, 6, 9, 12])
    text = (tmp_path / "checkpoint").read_text()
    (tmp_path / "checkpoint").write_text(
        text.replace('model_checkpoint_path: "model.ckpt-12"', 'model_checkpoint_path: "model.ckpt-6"'))
    assert loopkit.latest_checkpoint(tmp_path)[0] == 6

    seen = Seen()
    r = run(tmp_path, backend, save_model_steps=3, max_steps=9, max_to_keep=None,
            plugins=[seen])
    assert seen.start == 6 and r.step == 9
    # 9 was saved again; 12 left the list but stays on disk until overwritten
    assert listed(tmp_path) == (9, [3, 6, 9])
    assert steps_on_disk(tmp_path) == [3, 6, 9, 12]
    assert loopkit.latest_checkpoint(tmp_path)[0] == 9


def test_while_a_step_is_saved_again_the_file_names_an_earlier_one(tmp_path):
    run(tmp_path, save_model_steps=2, max_steps=6, max_to_keep=None)
    state = (tmp_path / "checkpoint").read_text()
    (tmp_path / "checkpoint").write_text(state.replace('path: "model.ckpt-6"', 'path: "model.ckpt-2"'))
    backend = Recording(NpzBackend(tmp_path), tmp_path)
    r = loopkit.train(lambda s, b: ({"w": s["w"] + 2 * b, "n": s["n"] + 1}, {}), init=init,
                      data=data, logdir=tmp_path, checkpoint_backend=backend,
                      save_model_steps=2, save_model_secs=None, max_steps=6, max_to_keep=None,
                      progress=False, disable=("summaries",), autoload=False)
    assert r.step == 6
    saves = [c for c in backend.calls if c[0] == "save"]
    # replacing 4: the file names 2 and lists only what precedes; the old 4 was deleted first
    assert saves[0] == ("save", 4, (2, [2]))
    assert saves[1] == ("save", 6, (4, [2, 4]))
    assert backend.calls.index(("delete", 4)) < backend.calls.index(saves[0])
    # the new 4 and 6 hold the second run's values (w grows by 2*i from step 2)
    w2 = expected(2)["w"]
    np.testing.assert_array_equal(restore(tmp_path, 4, "npz")[0]["w"], w2 + 2 * (2 + 3))
    assert listed(tmp_path) == (6, [2, 4, 6])


# -- retention -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_to_keep(tmp_path, backend):
    run(tmp_path, backend, save_model_steps=1, max_steps=8, max_to_keep=3)
    assert steps_on_disk(tmp_path) == [6, 7, 8]
    assert listed(tmp_path) == (8, [6, 7, 8])


def test_max_to_keep_none_keeps_all(tmp_path):
    run(tmp_path, save_model_steps=1, max_steps=7, max_to_keep=None)
    assert steps_on_disk(tmp_path) == list(range(1, 8))


def test_keep_checkpoint_every_n_hours_keeps_one_per_period_off_the_list(tmp_path):
    hours = 1000.0
    run(tmp_path, save_model_steps=1, max_steps=2, max_to_keep=2,
        keep_checkpoint_every_n_hours=hours)
    text = (tmp_path / "checkpoint").read_text()
    assert "last_preserved_timestamp" in text and "all_model_checkpoint_timestamps" in text
    # pretend the last preserved checkpoint is two periods old
    state = read_state(tmp_path)
    old = state.listed[0][1] - 2 * hours * 3600
    lines = [ln for ln in text.splitlines() if not ln.startswith("last_preserved")]
    (tmp_path / "checkpoint").write_text("\n".join(lines + [f"last_preserved_timestamp: {old}"]))
    run(tmp_path, save_model_steps=1, max_steps=6, max_to_keep=2,
        keep_checkpoint_every_n_hours=hours)
    # 1 left the window a period after the last preserved one: kept, off the list;
    # 2, 3, 4 left it within the same period: deleted
    assert steps_on_disk(tmp_path) == [1, 5, 6]
    assert listed(tmp_path) == (6, [5, 6])


def test_a_non_chief_saves_but_neither_writes_the_checkpoint_file_nor_deletes(tmp_path):
    run(tmp_path, save_model_steps=1, max_steps=4, max_to_keep=2, is_chief=False)
    assert steps_on_disk(tmp_path) == [1, 2, 3, 4]
    assert not (tmp_path / "checkpoint").exists()
    seen = Seen()
    run(tmp_path, max_steps=4, is_chief=False, plugins=[seen])
    assert seen.start == 4  # without the file: the newest committed one


# -- donation and asynchronous saves ----------------------------------------------------------


def test_donation_and_async_saves_of_the_same_buffers(tmp_path):
    n = 1 << 20  # 4 MiB per array: the write is still going when the next step runs

    def step(state):
        return {"a": state["a"] + 1.0, "b": state["b"] * 2 + 1}, {}

    def big_init():
        return {"a": jnp.zeros((n,), jnp.float32), "b": jnp.zeros((n,), jnp.int32)}

    r = loopkit.train(step, init=big_init, logdir=tmp_path, checkpoint_backend="orbax",
                      save_model_steps=1, save_model_secs=None, max_steps=8, max_to_keep=None,
                      donate=True, progress=False, disable=("summaries",), autoload=False)
    assert float(r.state["a"][0]) == 8.0 and int(r.state["b"][-1]) == 2 ** 8 - 1
    assert steps_on_disk(tmp_path) == list(range(1, 9))
    for k in range(1, 9):
        state, meta = restore(tmp_path, k, "orbax")
        assert meta["step"] == k
        np.testing.assert_array_equal(state["a"], np.full((n,), k, np.float32))
        np.testing.assert_array_equal(state["b"], np.full((n,), 2 ** k - 1, np.int32))


class DeferredCopy:
    """An asynchronous backend that reads the state's arrays only after the next step ran.

    Also a plugin (to see the steps). On CPU, orbax's host copy is a numpy view
    that keeps XLA from donating the buffer; this backend holds the jax arrays
    themselves, as an accelerator backend that copies in the background would,
    so a donating step right after the save would delete what it still reads.
    """

    def __init__(self, directory: Path) -> None:
        self.inner = NpzBackend(directory)
        self.pending = None
        self.cond = threading.Condition()
        self.step_seen = 0
        self.stopping = False

    def save(self, step, state, metadata):
        assert self.pending is None, "a second save while one is in flight"
        self.pending = (step, state, metadata)

    def wait(self):
        if self.pending is None:
            return
        step, state, metadata = self.pending
        with self.cond:
            self.cond.wait_for(lambda: self.step_seen > step or self.stopping)
        self.inner.save(step, state, metadata)  # reads the arrays only now
        self.pending = None

    def restore(self, step, like):
        return self.inner.restore(step, like)

    def steps(self):
        return self.inner.steps()

    def delete(self, step):
        self.inner.delete(step)

    def close(self):
        self.wait()

    @loopkit.hookimpl
    def after_step(self, step):
        with self.cond:
            self.step_seen = step
            self.cond.notify_all()

    @loopkit.hookimpl
    def on_stop(self):
        with self.cond:
            self.stopping = True
            self.cond.notify_all()


def test_the_step_after_a_save_does_not_donate_the_buffers_being_saved(tmp_path):
    backend = DeferredCopy(tmp_path)
    r = loopkit.train(count_step, init=init, data=data, logdir=tmp_path,
                      checkpoint_backend=backend, plugins=[backend], save_model_steps=2,
                      save_model_secs=None, max_steps=9, max_to_keep=None, donate=True,
                      progress=False, disable=("summaries",), autoload=False)
    assert_state(r.state, 9)
    assert steps_on_disk(tmp_path) == [2, 4, 6, 8, 9]
    for k in (2, 4, 6, 8, 9):
        assert_state(restore(tmp_path, k, "npz")[0], k)


def test_an_error_while_committing_is_raised_from_train(tmp_path):
    class FailingWait(Recording):
        failed = False

        def wait(self):  # the commit of the save at 4 fails, once
            if self.saves() == [2, 4] and not self.failed:
                self.failed = True
                raise OSError("disk on fire")
            super().wait()

    backend = FailingWait(NpzBackend(tmp_path), tmp_path)
    with pytest.raises(OSError, match="disk on fire") as info:
        run(tmp_path, backend=backend, save_model_steps=2, max_steps=50)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "'checkpoint'" in notes and "model.ckpt-4" in notes
    assert backend.saves() == [2, 4]  # the run stopped; no final save after an error
    assert no_commit_threads()
    assert listed(tmp_path) == (2, [2])


# -- the input position ------------------------------------------------------------------------


class Counter:
    """An iterator with grain's get_state()/set_state(); its state holds bytes."""

    def __init__(self):
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        value = np.full((3,), float(self.i), np.float32)
        self.i += 1
        return value

    def get_state(self):
        return {"i": self.i, "tag": b"\x00pos\xff", "hist": [self.i - 1, self.i]}

    def set_state(self, state):
        assert state["tag"] == b"\x00pos\xff"
        self.i = state["i"]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_the_input_position_of_a_stateful_iterator_is_saved_and_restored(tmp_path, prefetch):
    def go(max_steps):
        return loopkit.train(count_step, init=init, data=Counter(), logdir=tmp_path,
                             checkpoint_backend="npz", save_model_steps=3,
                             save_model_secs=None, max_steps=max_steps, prefetch=prefetch,
                             progress=False, disable=("summaries",), autoload=False)

    go(7)
    _, meta = restore(tmp_path, 3, "npz")
    # after step 3 the step consumed batches 0, 1, 2: the position is 3, whatever was prefetched
    assert meta["data_position"]["i"] == 3
    assert meta["data_position"]["hist"] == [2, 3]
    assert meta["data_position"]["tag"] == {"__loopkit_bytes__": "AHBvc/8="}
    assert restore(tmp_path, 7, "npz")[1]["data_position"]["i"] == 7
    r = go(10)
    assert_state(r.state, 10)


def test_a_save_that_never_commits_does_not_hang_the_stop(tmp_path, caplog):
    """A backend whose wait() blocks: the stop waits stop_grace_secs, names the thread."""
    import threading

    release = threading.Event()

    class Stuck(NpzBackend):
        def wait(self):
            release.wait()

    backend = Stuck(tmp_path)
    started = time.monotonic()
    try:
        r = loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), max_steps=3,
                          logdir=str(tmp_path), checkpoint_backend=backend,
                          save_model_secs=None, stop_grace_secs=1, progress=False)
        elapsed = time.monotonic() - started
    finally:
        release.set()
    assert r.step == 3 and elapsed < 60
    assert any("loopkit-checkpoint-commit-3" in rec.getMessage() and "stop_grace_secs=1"
               in rec.getMessage() for rec in caplog.records)
