"""The profiler built-in: a jax.profiler trace of the chosen steps, in logdir."""

from __future__ import annotations

import logging

import jax.numpy as jnp

import loopkit
from loopkit.plugins import profiler

FAST = dict(progress=False, disable=("checkpoint",), save_summaries_secs=None)


class Capture:
    @loopkit.hookimpl
    def session_create(self, session) -> None:
        self.profiler = session.plugin_manager.get_plugin("profiler")


def step_fn(s):
    return s @ s * 0.5, {"norm": jnp.linalg.norm(s)}


def traces(logdir):
    return sorted(logdir.glob("plugins/profile/*/*.xplane.pb"))


def test_traces_the_chosen_steps(tmp_path):
    capture = Capture()
    loopkit.train(step_fn, init=jnp.eye(16), logdir=tmp_path, max_steps=8, profile_steps=(3, 5),
                  plugins=[capture], **FAST)
    found = traces(tmp_path)
    assert len(found) == 1 and found[0].stat().st_size > 0
    # started at the boundary before step 3, stopped after step 5
    assert (capture.profiler.started_at, capture.profiler.stopped_at) == (2, 5)


def test_range_from_the_first_step_past_the_stop(tmp_path):
    capture = Capture()
    loopkit.train(step_fn, init=jnp.eye(4), logdir=tmp_path, max_steps=4, profile_steps=(1, 10),
                  plugins=[capture], **FAST)
    assert (capture.profiler.started_at, capture.profiler.stopped_at) == (0, 4)
    assert len(traces(tmp_path)) == 1


def test_range_ending_at_max_steps_is_stopped_by_on_stop(tmp_path):
    capture = Capture()
    loopkit.train(step_fn, init=jnp.eye(4), logdir=tmp_path, max_steps=6, profile_steps=(4, 6),
                  plugins=[capture], **FAST)
    assert (capture.profiler.started_at, capture.profiler.stopped_at) == (3, 6)
    assert len(traces(tmp_path)) == 1


def test_range_never_reached_writes_nothing(tmp_path):
    capture = Capture()
    loopkit.train(step_fn, init=jnp.eye(4), logdir=tmp_path, max_steps=3, profile_steps=(5, 6),
                  plugins=[capture], **FAST)
    assert capture.profiler.started_at is None
    assert traces(tmp_path) == []


def test_needs_a_logdir(caplog):
    caplog.set_level(logging.WARNING, logger="loopkit")
    assert profiler.plugin(loopkit.Config(profile_steps=(1, 2))) is None
    assert "Config.profile_steps=(1, 2) is ignored" in caplog.text
    assert profiler.plugin(loopkit.Config(logdir="x")) is None


def test_resumed_inside_the_range_traces_the_rest(tmp_path):
    class ResumeAt:
        @loopkit.hookimpl
        def restore_state(self, like):
            return loopkit.Restored(state=jnp.eye(4, dtype=like.dtype), step=4)

    capture = Capture()
    loopkit.train(step_fn, init=jnp.eye(4), logdir=tmp_path, max_steps=9, profile_steps=(3, 6),
                  plugins=[capture, ResumeAt()], **FAST)
    assert (capture.profiler.started_at, capture.profiler.stopped_at) == (4, 6)
    assert len(traces(tmp_path)) == 1


def test_periodic_traces_last_at_least_the_minimum(tmp_path):
    from loopkit.testing import FakeClock, Tick

    capture, clock = Capture(), FakeClock()
    loopkit.train(step_fn, init=jnp.eye(4), logdir=tmp_path, max_steps=38, clock=clock,
                  profile_every_secs=10, profile_min_secs=3, profile_min_steps=5,
                  plugins=[capture, Tick(clock, 1.0)], **FAST)
    # one step per second: a trace starts every 10 s and stops once it has run
    # 5 steps and 3 s; the one still running at the stop is finished there
    assert capture.profiler.traces == [(11, 15), (21, 25), (31, 35)]
    assert capture.profiler.started_at is None
    assert traces(tmp_path)  # jax names trace directories by the second: may share one


def test_periodic_trace_waits_for_enough_steps(tmp_path):
    from loopkit.testing import FakeClock, Tick

    capture, clock = Capture(), FakeClock()
    loopkit.train(step_fn, init=jnp.eye(4), logdir=tmp_path, max_steps=30, clock=clock,
                  profile_every_secs=4, profile_min_secs=1, profile_min_steps=6,
                  plugins=[capture, Tick(clock, 2.0)], **FAST)
    # 2 s per step: 1 s passes within a step, but 6 steps are needed; the
    # periodic timer is skipped while a trace runs
    first, last = capture.profiler.traces[0]
    assert (first, last) == (3, 8)
    assert all(b - a + 1 >= 6 for a, b in capture.profiler.traces[:-1])


def test_profile_steps_and_periodic_together(tmp_path):
    from loopkit.testing import FakeClock, Tick

    capture, clock = Capture(), FakeClock()
    loopkit.train(step_fn, init=jnp.eye(4), logdir=tmp_path, max_steps=20, clock=clock,
                  profile_steps=(12, 14), profile_every_secs=10, profile_min_secs=0,
                  profile_min_steps=2, plugins=[capture, Tick(clock, 1.0)], **FAST)
    # the periodic trace started at step 10 is still running when the range
    # begins (after step 11): the range takes it over, so one trace covers both
    assert capture.profiler.traces == [(11, 14)]
    assert (capture.profiler.started_at, capture.profiler.stopped_at) == (11, 14)
