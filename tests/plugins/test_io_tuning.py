"""Checkpoint I/O lowers Python's thread switch interval and raises the garbage collector's
first threshold while it runs, and gives both back."""

from __future__ import annotations

import gc
import itertools
import sys
import threading

import jax.numpy as jnp
import numpy as np
import pytest

from loopkit.plugins import io_settings
from loopkit.plugins.io_settings import GC_THRESHOLD, SWITCH_INTERVAL, checkpoint_io
from loopkit.plugins.npz_backend import NpzBackend
from loopkit.plugins.orbax_backend import OrbaxBackend


@pytest.fixture(autouse=True)
def defaults():
    before = sys.getswitchinterval(), gc.get_threshold()
    sys.setswitchinterval(0.005)
    gc.set_threshold(700, 10, 10)
    yield
    assert not io_settings._state  # no use left in force
    sys.setswitchinterval(before[0])
    gc.set_threshold(*before[1])


def test_both_are_set_inside_and_given_back_after_the_last_of_overlapping_uses():
    first, second = checkpoint_io(), checkpoint_io()
    first.__enter__()
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL, rel=0.01)
    assert gc.get_threshold() == (GC_THRESHOLD, 10, 10)
    second.__enter__()
    first.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL, rel=0.01)  # one still in use
    assert gc.get_threshold() == (GC_THRESHOLD, 10, 10)
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(0.005, rel=0.05)
    assert gc.get_threshold() == (700, 10, 10)


def test_settings_changed_by_someone_else_meanwhile_are_kept():
    with checkpoint_io():
        sys.setswitchinterval(0.001)
        gc.set_threshold(2000, 5, 5)
    assert sys.getswitchinterval() == pytest.approx(0.001, rel=0.05)
    assert gc.get_threshold() == (2000, 5, 5)


def test_one_setting_changed_meanwhile_does_not_keep_the_other_from_being_given_back():
    with checkpoint_io():
        gc.set_threshold(2000, 5, 5)
    assert sys.getswitchinterval() == pytest.approx(0.005, rel=0.05)
    assert gc.get_threshold() == (2000, 5, 5)


@pytest.mark.parametrize("threshold", [(0, 10, 10), (10 * GC_THRESHOLD, 10, 10)])
def test_settings_of_the_users_that_go_further_are_left_alone(threshold):
    sys.setswitchinterval(0.0001)
    gc.set_threshold(*threshold)  # 0: automatic collection off
    with checkpoint_io():
        assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)
        assert gc.get_threshold() == threshold
    assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)
    assert gc.get_threshold() == threshold


def test_an_error_inside_still_gives_them_back():
    with pytest.raises(RuntimeError), checkpoint_io():
        raise RuntimeError("boom")
    assert sys.getswitchinterval() == pytest.approx(0.005, rel=0.05)
    assert gc.get_threshold() == (700, 10, 10)


def test_overlapping_uses_from_several_threads_give_both_back_once_all_end():
    errors = []

    def use(n: int) -> None:
        try:
            for _ in range(n):
                with checkpoint_io():
                    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL, rel=0.01)
                    assert gc.get_threshold()[0] == GC_THRESHOLD
        except AssertionError as e:
            errors.append(e)

    threads = [threading.Thread(target=use, args=(500,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sys.getswitchinterval() == pytest.approx(0.005, rel=0.05)
    assert gc.get_threshold() == (700, 10, 10)


def _probe(monkeypatch, owner, name, seen: list) -> None:
    """Record, at each call of ``owner.name``, whether checkpoint I/O settings were in force."""
    real = getattr(owner, name)

    def probe(*args, **kwargs):
        seen.append((name, sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL, rel=0.01)
                     and gc.get_threshold()[0] == GC_THRESHOLD))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, probe)


@pytest.mark.parametrize("backend", [OrbaxBackend, NpzBackend])
def test_each_save_restore_and_partial_restore_runs_with_them(tmp_path, monkeypatch, backend):
    state = {"w": jnp.ones(3), "stack": [jnp.zeros(2)] * 20}
    module = sys.modules[backend.__module__]
    seen: list = []
    # what each call does first: the records of a save; the read of a restore
    _probe(monkeypatch, module, "leaf_records", seen)
    if backend is OrbaxBackend:
        _probe(monkeypatch, module, "restore_state", seen)
        _probe(monkeypatch, module, "restore_some", seen)
    else:
        _probe(monkeypatch, NpzBackend, "_open", seen)
    b = backend(tmp_path)
    if backend is OrbaxBackend:
        _probe(monkeypatch, b._saver, "save", seen)  # the background part: orbax's write
    try:
        for step in range(1, 3):
            b.save(step, state, {})
            b.wait()
            restored, _ = b.restore(step, state)
            assert restored["stack"][19].shape == (2,)
            assert set(b.restore_leaves(step, ["w"])) == {"w"}
    finally:
        b.close()
    probed = {"leaf_records", "restore_state", "restore_some", "save"} \
        if backend is OrbaxBackend else {"leaf_records", "_open"}
    assert {name for name, _ in seen} == probed
    assert all(ok for _, ok in seen), [name for name, ok in seen if not ok]
    assert sys.getswitchinterval() == pytest.approx(0.005, rel=0.05)
    assert gc.get_threshold() == (700, 10, 10)


def test_a_run_restores_and_saves_any_backend_with_them(tmp_path, monkeypatch):
    import loopkit
    from loopkit.plugins import checkpoint as plugin

    seen: list = []
    _probe(monkeypatch, plugin, "find_restorable", seen)
    _probe(monkeypatch, NpzBackend, "save", seen)  # (also decorated itself: probed outside)

    def run(steps: int):
        return loopkit.train(lambda s, b: ({"w": s["w"] + b}, {}), init=lambda: {"w": jnp.zeros(3)},
                             data=lambda start: itertools.repeat(np.ones(3, np.float32)),
                             logdir=tmp_path, checkpoint_backend="npz", max_steps=steps,
                             save_model_steps=2, progress=False, disable=("summaries",),
                             autoload=False)

    run(2)
    assert run(4).step == 4
    assert {name for name, _ in seen} == {"find_restorable", "save"}
    assert all(ok for _, ok in seen), seen
