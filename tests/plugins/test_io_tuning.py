"""loopkit leaves the interpreter's settings alone while checkpoints are saved and restored;
`checkpoint_io_tuning()` changes them only for a user who turns it on, and gives them back."""

from __future__ import annotations

import gc
import sys
import threading
import time

import jax.numpy as jnp
import pytest

import loopkit
from loopkit.plugins.checkpoint import checkpoint_io_tuning
from loopkit.plugins.checkpoint.backends.npz import NpzBackend
from loopkit.plugins.checkpoint.backends.orbax import OrbaxBackend
from loopkit.plugins.checkpoint.io_tuning import GC_THRESHOLD, SWITCH_INTERVAL

DEFAULTS = (0.005, (700, 10, 10))


@pytest.fixture(autouse=True)
def defaults():
    before = sys.getswitchinterval(), gc.get_threshold()
    sys.setswitchinterval(DEFAULTS[0])
    gc.set_threshold(*DEFAULTS[1])
    yield
    # No use left in force: one more use, on the defaults, gives them back when it ends
    # (a use still counted would keep the tuning on after it).
    sys.setswitchinterval(DEFAULTS[0])
    gc.set_threshold(*DEFAULTS[1])
    with checkpoint_io_tuning():
        pass
    assert (round(sys.getswitchinterval(), 6), gc.get_threshold()) == DEFAULTS
    sys.setswitchinterval(before[0])
    gc.set_threshold(*before[1])


class Sampler:
    """A thread that reads both settings over and over, as a user's thread would see them."""

    def __init__(self) -> None:
        self.seen: set[tuple[float, tuple[int, ...]]] = set()
        self.samples = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="settings-sampler")

    def _run(self) -> None:
        while not self._done.is_set():
            self.seen.add((round(sys.getswitchinterval(), 6), gc.get_threshold()))
            self.samples += 1
            time.sleep(0.0005)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def wide_state(n: int = 2048) -> dict:
    """A state of `n` small leaves (an optimiser state of a deep model has thousands)."""
    return {"layers": [{"w": jnp.full((4,), i, jnp.float32), "b": jnp.zeros((2,))}
                       for i in range(n // 2)]}


@pytest.mark.parametrize("backend", [OrbaxBackend, NpzBackend])
def test_a_save_and_restore_of_2048_leaves_leave_the_settings_alone(tmp_path, backend):
    state = wide_state()
    with Sampler() as sampler:
        b = backend(tmp_path)
        try:
            b.save(1, state, {})
            b.wait()
            restored, _ = b.restore(1, state)
            assert set(b.restore_leaves(1, ["layers/7/w"])) == {"layers/7/w"}
        finally:
            b.close()
    assert float(restored["layers"][1023]["w"][0]) == 1023
    assert sampler.samples >= 5  # it looked while the save and the restore ran
    assert sampler.seen == {DEFAULTS}


def test_a_run_that_saves_and_resumes_leaves_the_settings_alone(tmp_path):
    def run(steps: int):
        return loopkit.train(lambda s: (s, {}), init=wide_state, logdir=tmp_path, jit=False,
                             checkpoint_backend="orbax", max_steps=steps, save_model_steps=1,
                             progress=False, disable=("summaries",), autoload=False)

    with Sampler() as sampler:
        run(1)
        assert run(2).step == 2  # restored, then saved again
        loopkit.load_checkpoint(tmp_path)
    assert sampler.samples >= 5
    assert sampler.seen == {DEFAULTS}


def test_turned_on_it_sets_both_and_gives_them_back():
    with Sampler() as sampler, checkpoint_io_tuning():
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL, rel=0.01)
        assert gc.get_threshold() == (GC_THRESHOLD, 10, 10)
        time.sleep(0.01)
    assert sys.getswitchinterval() == pytest.approx(DEFAULTS[0], rel=0.05)
    assert gc.get_threshold() == DEFAULTS[1]
    assert (round(SWITCH_INTERVAL, 6), (GC_THRESHOLD, 10, 10)) in sampler.seen


def test_turned_on_around_a_run_it_holds_for_the_run_and_ends_with_it(tmp_path):
    with Sampler() as sampler:
        with checkpoint_io_tuning(switch_interval=0.001, gc_threshold=20_000):
            loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(3), logdir=tmp_path,
                          max_steps=3, progress=False, autoload=False)
            assert gc.get_threshold()[0] == 20_000
        assert sys.getswitchinterval() == pytest.approx(DEFAULTS[0], rel=0.05)
        assert gc.get_threshold() == DEFAULTS[1]
    assert (0.001, (20_000, 10, 10)) in sampler.seen


def test_overlapping_uses_share_one_change_given_back_after_the_last():
    first, second = checkpoint_io_tuning(), checkpoint_io_tuning()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL, rel=0.01)  # one still in use
    assert gc.get_threshold() == (GC_THRESHOLD, 10, 10)
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(DEFAULTS[0], rel=0.05)
    assert gc.get_threshold() == DEFAULTS[1]


def test_settings_changed_by_someone_else_meanwhile_are_kept():
    with checkpoint_io_tuning():
        sys.setswitchinterval(0.001)
        gc.set_threshold(2000, 5, 5)
    assert sys.getswitchinterval() == pytest.approx(0.001, rel=0.05)
    assert gc.get_threshold() == (2000, 5, 5)


def test_one_setting_changed_meanwhile_does_not_keep_the_other_from_being_given_back():
    with checkpoint_io_tuning():
        gc.set_threshold(2000, 5, 5)
    assert sys.getswitchinterval() == pytest.approx(DEFAULTS[0], rel=0.05)
    assert gc.get_threshold() == (2000, 5, 5)


@pytest.mark.parametrize("threshold", [(0, 10, 10), (10 * GC_THRESHOLD, 10, 10)])
def test_settings_of_the_users_that_go_further_are_left_alone(threshold):
    sys.setswitchinterval(0.0001)
    gc.set_threshold(*threshold)  # 0: automatic collection off
    with checkpoint_io_tuning():
        assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)
        assert gc.get_threshold() == threshold
    assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)
    assert gc.get_threshold() == threshold


def test_an_error_inside_still_gives_them_back():
    with pytest.raises(RuntimeError), checkpoint_io_tuning():
        raise RuntimeError("boom")
    assert sys.getswitchinterval() == pytest.approx(DEFAULTS[0], rel=0.05)
    assert gc.get_threshold() == DEFAULTS[1]


def test_overlapping_uses_from_several_threads_give_both_back_once_all_end():
    errors = []

    def use(n: int) -> None:
        try:
            for _ in range(n):
                with checkpoint_io_tuning():
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
    assert sys.getswitchinterval() == pytest.approx(DEFAULTS[0], rel=0.05)
    assert gc.get_threshold() == DEFAULTS[1]
