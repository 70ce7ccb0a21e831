"""`Session.stage_state` with readers slower than the steps: what a reader reads is the
state at its step, whatever the loop does meanwhile (a hyperparameter replaced, a
failed step the caller goes on after, a second reader at the same step).

The backend here reads the staged state a while after `save` returns, as an
asynchronous saver (an upload, a slow disk) does, and keeps what it read.
"""

from __future__ import annotations

import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

import loopkit


class SlowReader:
    """A checkpoint backend that reads the staged state `delay` seconds after `save`."""

    def __init__(self, delay: float = 0.3) -> None:
        self.delay, self.read = delay, {}
        self._thread: threading.Thread | None = None

    def save(self, step, state, metadata):
        def read():
            time.sleep(self.delay)
            self.read[step] = {k: np.array(v) for k, v in state.items()}

        self._thread = threading.Thread(target=read)
        self._thread.start()

    def wait(self):
        if self._thread is not None:
            self._thread.join()

    def steps(self):
        return sorted(self.read)

    def restore(self, step, like=None):
        raise KeyError(step)

    def delete(self, step):
        self.read.pop(step, None)

    def close(self):
        self.wait()


def supervisor(tmp_path, backend, every):
    return loopkit.Supervisor(logdir=str(tmp_path), checkpoint_backend=backend,
                              save_model_steps=every, max_to_keep=None, progress=False,
                              disable=("summaries",), save_model_secs=None, autoload=False)


def plus_one(s):
    return {"w": s["w"] + 1.0, "lr": s["lr"]}, {}


def test_a_state_replaced_right_after_a_save_leaves_the_saved_buffers_alone(tmp_path):
    backend = SlowReader()
    init = {"w": jnp.zeros(1000), "lr": jnp.float32(0.1)}
    with supervisor(tmp_path, backend, 3).managed_session(plus_one, init) as sess:
        while sess.step < 12:
            sess.run()
            if sess.step in (6, 9):  # right after a save: a new learning rate
                sess.state = {**sess.state, "lr": jnp.float32(0.05)}
    assert sorted(backend.read) == [3, 6, 9, 12]
    for step, got in backend.read.items():
        np.testing.assert_array_equal(got["w"], np.full(1000, float(step)), err_msg=str(step))


def test_a_failed_step_after_a_save_leaves_the_saved_buffers_alone(tmp_path):
    def step(s, x):
        return {"w": s["w"] + x.reshape(4).sum(), "lr": s["lr"]}, {}

    backend = SlowReader()
    init = {"w": jnp.zeros(1000), "lr": jnp.float32(0.1)}
    failed = []
    with supervisor(tmp_path, backend, 3).managed_session(step, init) as sess:
        while sess.step < 12:
            if sess.step in (6, 9) and sess.step not in failed:  # a malformed batch
                failed.append(sess.step)
                with pytest.raises(TypeError):
                    sess.run(np.ones(5, np.float32))
            sess.run(np.ones(4, np.float32))
    assert failed == [6, 9]
    assert sorted(backend.read) == [3, 6, 9, 12]
    for step, got in backend.read.items():
        np.testing.assert_array_equal(got["w"], np.full(1000, 4.0 * step), err_msg=str(step))


def test_two_readers_of_one_step_each_read_it_whole(tmp_path):
    backend = SlowReader(0.05)
    exported, readers = {}, []

    def export(step, staged):
        time.sleep(0.4)  # slower than the checkpoint
        exported[step] = np.array(staged.state["w"])
        staged.release()

    init = {"w": jnp.zeros(1000), "lr": jnp.float32(0.1)}
    with supervisor(tmp_path, backend, 2).managed_session(plus_one, init) as sess:
        while sess.step < 10:
            sess.run()
            if sess.step % 2 == 0:  # the checkpoint staged this step too
                reader = threading.Thread(target=export, args=(sess.step, sess.stage_state()))
                reader.start()
                readers.append(reader)
            time.sleep(0.05)
    for reader in readers:
        reader.join()
    assert sorted(exported) == sorted(backend.read) == [2, 4, 6, 8, 10]
    for step in exported:
        np.testing.assert_array_equal(exported[step], np.full(1000, float(step)))
        np.testing.assert_array_equal(backend.read[step]["w"], np.full(1000, float(step)))
