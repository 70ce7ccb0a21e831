"""Checkpoint I/O lowers Python's thread switch interval and raises the garbage collector's
first threshold while it runs, and gives both back."""

from __future__ import annotations

import gc
import sys
import threading

import jax.numpy as jnp
import pytest

from loopkit.plugins.io_settings import GC_THRESHOLD, SWITCH_INTERVAL, checkpoint_io
from loopkit.plugins.npz_backend import NpzBackend
from loopkit.plugins.orbax_backend import OrbaxBackend


@pytest.fixture(autouse=True)
def defaults():
    before = sys.getswitchinterval(), gc.get_threshold()
    sys.setswitchinterval(0.005)
    gc.set_threshold(700, 10, 10)
    yield
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


@pytest.mark.parametrize("backend", [OrbaxBackend, NpzBackend])
def test_saves_and_restores_run_with_the_settings_and_give_them_back(tmp_path, backend):
    seen = []
    state = {"w": jnp.ones(3), "stack": [jnp.zeros(2)] * 20}
    b = backend(tmp_path)
    stop = threading.Event()

    def watch():
        while not stop.wait(0.0005):
            seen.append((sys.getswitchinterval(), gc.get_threshold()[0]))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for step in range(1, 4):
            b.save(step, state, {})
            b.wait()
            restored, _ = b.restore(step, state)
            assert restored["stack"][19].shape == (2,)
            assert set(b.restore_leaves(step, ["w"])) == {"w"}
    finally:
        stop.set()
        watcher.join()
        b.close()
    assert sys.getswitchinterval() == pytest.approx(0.005, rel=0.05)
    assert gc.get_threshold() == (700, 10, 10)
    assert min(s for s, _ in seen) == pytest.approx(SWITCH_INTERVAL, rel=0.01)  # set while they ran
    assert max(t for _, t in seen) == GC_THRESHOLD
