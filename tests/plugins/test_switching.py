"""Checkpoint I/O lowers Python's thread switch interval while it runs, and gives it back."""

from __future__ import annotations

import sys
import threading

import jax.numpy as jnp
import pytest

from loopkit.plugins.leaf_records import SWITCH_INTERVAL, quick_switching
from loopkit.plugins.npz_backend import NpzBackend
from loopkit.plugins.orbax_backend import OrbaxBackend


@pytest.fixture(autouse=True)
def default_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_the_interval_is_lowered_inside_and_given_back_after_the_last_of_overlapping_uses():
    first, second = quick_switching(), quick_switching()
    first.__enter__()
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL, rel=0.01)
    second.__enter__()
    first.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL, rel=0.01)  # one still in use
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(0.005, rel=0.05)


def test_an_interval_set_by_someone_else_meanwhile_is_kept():
    with quick_switching():
        sys.setswitchinterval(0.001)
    assert sys.getswitchinterval() == pytest.approx(0.001, rel=0.05)


def test_a_lower_interval_of_the_users_is_never_raised():
    sys.setswitchinterval(0.0001)
    with quick_switching():
        assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)
    assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)


@pytest.mark.parametrize("backend", [OrbaxBackend, NpzBackend])
def test_saves_and_restores_run_with_the_lower_interval_and_give_it_back(tmp_path, backend):
    seen = []
    state = {"w": jnp.ones(3), "stack": [jnp.zeros(2)] * 20}
    b = backend(tmp_path)
    stop = threading.Event()

    def watch():
        while not stop.wait(0.0005):
            seen.append(sys.getswitchinterval())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for step in range(1, 4):
            b.save(step, state, {})
            b.wait()
            b.restore(step, state)
    finally:
        stop.set()
        watcher.join()
        b.close()
    assert sys.getswitchinterval() == pytest.approx(0.005, rel=0.05)
    assert min(seen) == pytest.approx(SWITCH_INTERVAL, rel=0.01)  # lowered while they ran
