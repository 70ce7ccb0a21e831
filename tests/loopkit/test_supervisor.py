from __future__ import annotations

import jax.numpy as jnp
import pytest

import loopkit
from loopkit.testing import HookRecorder

FAST = dict(progress=False, checkpoint_backend=None)


def step(state, batch):
    return state + batch, {"loss": state}


def test_managed_session_runs_the_users_loop():
    rec = HookRecorder()
    sv = loopkit.Supervisor(plugins=[rec], **FAST)
    with sv.managed_session(step, init=jnp.zeros(())) as sess:
        for batch in [1.0, 2.0, 3.0]:
            if sv.should_stop():
                break
            metrics = sess.run(batch)
            assert "loss" in metrics
    assert float(sess.state) == 6.0 and sess.step == 3
    assert sv.should_stop()
    assert rec.names()[-1] == "on_stop" and rec.getcall("on_stop").kwargs["error"] is None


def test_should_stop_turns_true_at_max_steps():
    sv = loopkit.Supervisor(max_steps=2, **FAST)
    seen = []
    with sv.managed_session(step, init=jnp.zeros(())) as sess:
        while not sv.should_stop():
            sess.run(1.0)
            seen.append(sv.should_stop())
    assert seen == [False, True] and isinstance(seen[0], bool)


def test_a_later_session_starts_afresh():
    sv = loopkit.Supervisor(max_steps=1, **FAST)
    for _ in range(2):
        with sv.managed_session(step, init=jnp.zeros(())) as sess:
            assert sv.should_stop() is False
            sess.run(1.0)
        assert sv.should_stop() is True


def test_stop_iteration_in_the_block_is_a_normal_stop():
    rec = HookRecorder()
    sv = loopkit.Supervisor(plugins=[rec], **FAST)
    data = iter([1.0])
    with sv.managed_session(step, init=jnp.zeros(())) as sess:
        while True:
            sess.run(next(data))
    assert sess.step == 1
    assert rec.getcall("on_stop").kwargs["error"] is None


def test_stop_on_exception_records_and_reraises_at_exit():
    rec = HookRecorder()
    sv = loopkit.Supervisor(plugins=[rec], **FAST)
    after = []
    with pytest.raises(RuntimeError, match="inside"):
        with sv.managed_session(step, init=jnp.zeros(())) as sess:
            with sv.stop_on_exception():
                sess.run(1.0)
                raise RuntimeError("inside")
            after.append(sv.should_stop())  # the block goes on, as in TensorFlow
    assert after == [True]
    assert isinstance(rec.getcall("on_stop").kwargs["error"], RuntimeError)


def test_exception_in_the_block_runs_on_stop_and_propagates():
    rec = HookRecorder()
    sv = loopkit.Supervisor(plugins=[rec], **FAST)
    with pytest.raises(KeyError):
        with sv.managed_session(step, init=jnp.zeros(())) as sess:
            sess.run(1.0)
            raise KeyError("user")
    assert isinstance(rec.getcall("on_stop").kwargs["error"], KeyError)


def test_request_stop_with_exception_first_wins():
    sv = loopkit.Supervisor(**FAST)
    with pytest.raises(ValueError, match="first"):
        with sv.managed_session(step, init=jnp.zeros(())):
            sv.request_stop(ValueError("first"))
            sv.request_stop(TypeError("second"))
            sv.request_stop()  # a later clean request changes nothing
    assert sv.coord.reason == "error"


def test_wait_for_stop_and_loop_threads():
    sv = loopkit.Supervisor(**FAST)
    ticks = []
    with sv.managed_session(step, init=jnp.zeros(())):
        thread = sv.loop(0.005, lambda n: ticks.append(n) or (len(ticks) >= 3 and sv.request_stop()),
                         args=(1,))
        assert sv.wait_for_stop(timeout=30)
    assert len(ticks) >= 3 and not thread.is_alive()


def test_summary_computed_without_logdir():
    chief = loopkit.Supervisor(is_chief=True, **FAST)
    with pytest.raises(RuntimeError, match="needs a summary writer"):
        with chief.managed_session(step, init=jnp.zeros(())):
            chief.summary_computed({"x": 1.0})
    other = loopkit.Supervisor(is_chief=False, **FAST)
    with other.managed_session(step, init=jnp.zeros(())):
        other.summary_computed({"x": 1.0})  # a non-chief does nothing


def test_properties():
    sv = loopkit.Supervisor(logdir="/tmp/x", save_model_secs=30, save_summaries_secs=5,
                            is_chief=False, **FAST)
    assert sv.save_path == "/tmp/x/model.ckpt"
    assert (sv.save_model_secs, sv.save_summaries_secs, sv.is_chief) == (30, 5, False)
    assert sv.summary_writer is None and isinstance(sv.coord, loopkit.Coordinator)
    assert loopkit.Supervisor().save_path is None


def test_summary_computed_after_the_block_raises(tmp_path):
    sv = loopkit.Supervisor(logdir=str(tmp_path), checkpoint_backend=None, progress=False)
    with sv.managed_session(step, init=jnp.zeros(())) as sess:
        sess.run(1.0)
        sv.summary_computed({"x": 1.0})
    assert sv.summary_writer is None
    with pytest.raises(RuntimeError, match="while the session runs"):
        sv.summary_computed({"x": 2.0})


def test_run_after_the_block_raises():
    sv = loopkit.Supervisor(**FAST)
    with sv.managed_session(step, init=jnp.zeros(())) as sess:
        sess.run(1.0)
    with pytest.raises(RuntimeError, match="session has ended"):
        sess.run(1.0)
    assert sess.step == 1


def test_a_nested_session_on_one_supervisor_is_refused():
    sv = loopkit.Supervisor(**FAST)
    with sv.managed_session(step, init=jnp.zeros(())):
        with pytest.raises(RuntimeError, match="already runs a session"):
            with sv.managed_session(step, init=jnp.zeros(())):
                pass
        assert not sv.should_stop()
    with sv.managed_session(step, init=jnp.zeros(())):  # afterwards: fine
        pass


def test_loop_started_before_the_session_stops_with_it():
    import threading

    sv = loopkit.Supervisor(**FAST)
    ticks = threading.Event()
    thread = sv.loop(0.01, ticks.set)
    with sv.managed_session(step, init=jnp.zeros(())) as sess:
        assert ticks.wait(30)
        sess.run(1.0)
    thread.join(30)
    assert not thread.is_alive()


def test_user_errors_in_the_block_are_not_blamed_on_the_step():
    sv = loopkit.Supervisor(**FAST)
    with pytest.raises(ValueError) as info:
        with sv.managed_session(step, init=jnp.zeros(())) as sess:
            sess.run(1.0)
            raise ValueError("mine")
    assert not any("step function" in n for n in getattr(info.value, "__notes__", []))


def test_second_ctrl_c_while_threads_are_joined_still_runs_on_stop():
    import os
    import signal
    import threading

    from loopkit.testing import HookRecorder

    release = threading.Event()
    rec = HookRecorder()

    class Stuck:
        @loopkit.hookimpl
        def session_create(self, session):
            session.loop(None, release.wait)  # ignores the stop: joined for stop_grace_secs

    def send_twice():
        os.kill(os.getpid(), signal.SIGINT)
        import time
        time.sleep(1.0)  # the loop has stopped; the join is waiting
        os.kill(os.getpid(), signal.SIGINT)

    def slow(s):
        import time
        time.sleep(0.01)
        return s + 1, {}

    threading.Timer(0.3, send_twice).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            loopkit.train(slow, init=jnp.zeros(()), jit=False, stop_grace_secs=60,
                          plugins=[Stuck(), rec], **FAST)
    finally:
        release.set()
    assert isinstance(rec.getcall("on_stop").kwargs["error"], KeyboardInterrupt)
