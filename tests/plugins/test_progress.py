"""The progress built-in: log lines off a terminal, a tqdm bar on one."""

from __future__ import annotations

import io
import logging
import re
import sys

import jax.numpy as jnp
import pytest

import loopkit
from loopkit.plugins.progress import LOG_SECS, ProgressPlugin
from loopkit.testing import FakeClock, Tick

FAST = dict(disable=("checkpoint",))


class ResumeAt:
    """Simulates recovery from a checkpoint at `step`."""

    def __init__(self, step: int) -> None:
        self.step = step

    @loopkit.hookimpl
    def restore_state(self, like):
        return loopkit.Restored(state=jnp.asarray(float(self.step), like.dtype), step=self.step)


def step_fn(s):
    return s + 1, {"loss": 100.0 / (s + 1), "w": jnp.ones(3)}


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "loopkit"]


def test_log_lines_off_a_terminal(caplog):
    caplog.set_level(logging.INFO, logger="loopkit")
    clock = FakeClock()
    loopkit.train(step_fn, init=jnp.zeros(()), max_steps=45, clock=clock,
                  plugins=[Tick(clock, 1.0)], **FAST)
    out = lines(caplog)
    assert out[0] == "loopkit: starting at step 0 of 45"
    # one line every LOG_SECS of wall time (1 s per step here), never per step
    assert LOG_SECS == 10.0
    periodic = [m for m in out if re.match(r"loopkit: step \d+/45", m)]
    assert periodic == [
        f"loopkit: step {s}/45, 1 steps/s, ETA {45 - s} s, loss={100.0 / s:.4g}; "
        "time: 100% step, 0% input" for s in (10, 20, 30, 40)
    ]
    # the stop: final step, steps/s and the latest metrics (arrays are left out)
    assert out[-1] == ("loopkit: stopped at step 45 after 45 s, 1 steps/s; loss=2.222; "
                       "time: 100% step, 0% input")
    assert len(out) == 6


def test_resume_step_is_shown(caplog):
    caplog.set_level(logging.INFO, logger="loopkit")
    clock = FakeClock()
    loopkit.train(step_fn, init=jnp.zeros(()), max_steps=30, clock=clock,
                  plugins=[Tick(clock, 2.0), ResumeAt(20)], **FAST)
    out = lines(caplog)
    assert out[0] == "loopkit: resumed at step 20 of 30"
    assert out[1] == ("loopkit: step 25/30, 0.5 steps/s, ETA 10 s, loss=4; "
                      "time: 100% step, 0% input")
    # steps/s counts this session's steps only (10 in 20 s)
    assert out[-1] == ("loopkit: stopped at step 30 after 20 s, 0.5 steps/s; loss=3.333; "
                       "time: 100% step, 0% input")


def test_error_stop_is_logged_without_fetching_metrics(caplog):
    caplog.set_level(logging.INFO, logger="loopkit")

    def failing(s):
        if int(s) == 3:
            raise RuntimeError("bad batch")
        return s + 1, {"loss": s}

    with pytest.raises(RuntimeError, match="bad batch"):
        loopkit.train(failing, init=jnp.zeros(()), jit=False, clock=FakeClock(), **FAST)
    assert lines(caplog)[-1] == "loopkit: stopped at step 3 by RuntimeError after 0 s"
    # (no time shares: no time passed on the fake clock)


def test_progress_false_is_silent(caplog):
    caplog.set_level(logging.INFO, logger="loopkit")
    loopkit.train(step_fn, init=jnp.zeros(()), max_steps=5, progress=False, **FAST)
    assert lines(caplog) == []


def test_non_chief_shows_nothing(caplog):
    caplog.set_level(logging.INFO, logger="loopkit")
    loopkit.train(step_fn, init=jnp.zeros(()), max_steps=5, is_chief=False, **FAST)
    assert lines(caplog) == []


class Terminal(io.StringIO):
    """What tqdm writes to, claiming to be a terminal."""

    def isatty(self) -> bool:
        return True


def test_tqdm_bar_on_a_terminal(caplog):
    caplog.set_level(logging.INFO, logger="loopkit")
    term = Terminal()
    clock = FakeClock()
    config = loopkit.Config(max_steps=40, disable=("checkpoint", "progress"))
    bar_plugin = ProgressPlugin(config, stream=term)
    loopkit.train(step_fn, init=jnp.zeros(()), config=config, clock=clock,
                  plugins=[bar_plugin, Tick(clock, 0.1)])
    text = term.getvalue()
    assert lines(caplog) == []  # a bar instead of log lines
    final = text.split("\r")[-1]
    assert "40/40" in final and "step/s" in final and "loss=2.5" in final
    assert bar_plugin.bar.n == 40
    # moved by a timer (every 0.25 s: every 3 steps of 0.1 s), not once per step
    shown = [int(n) for n in re.findall(r"(\d+)/40", text)]
    assert shown == [0, *range(3, 40, 3), 40, 40]


def test_tqdm_bar_starts_at_the_resume_step():
    term = Terminal()
    config = loopkit.Config(max_steps=25, disable=("checkpoint", "progress"))
    bar_plugin = ProgressPlugin(config, stream=term)
    loopkit.train(step_fn, init=jnp.zeros(()), config=config, clock=FakeClock(),
                  plugins=[bar_plugin, ResumeAt(20)])
    first = term.getvalue().split("\r")[1]
    assert first.startswith("resumed") and "20/25" in first
    assert "25/25" in term.getvalue().split("\r")[-1]


class SlowEval:
    """A timer named "evaluate" that takes 2 s of (fake) time every 5 steps."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    @loopkit.hookimpl
    def session_create(self, session) -> None:
        session.every(lambda s: self.clock.advance(2.0), steps=5, name="evaluate")


def test_lines_every_progress_secs_with_eta_and_where_the_time_went(caplog):
    caplog.set_level(logging.INFO, logger="loopkit")
    clock = FakeClock()
    loopkit.train(step_fn, init=jnp.zeros(()), max_steps=100, clock=clock, progress_secs=14,
                  plugins=[Tick(clock, 1.0), SlowEval(clock)], **FAST)
    periodic = [m for m in lines(caplog) if re.match(r"loopkit: step \d+/100", m)]
    # 5 steps take 5 s, then the evaluation 2 s: the first line is due at 14 s,
    # seen after step 11 (15 s): 11 s in steps, 4 s in two evaluations
    assert periodic[0] == ("loopkit: step 11/100, 0.7333 steps/s, ETA 2 min 1 s, loss=9.091; "
                           "time: 73.3% step, 0% input, 26.7% evaluate")
    assert len(periodic) == 9
    assert all("ETA" in m and "% evaluate" in m for m in periodic)
    # the whole run: 100 s of steps and 19 evaluations of 2 s (timers don't fire
    # at the stop, so none after step 100)
    assert lines(caplog)[-1] == ("loopkit: stopped at step 100 after 138 s, 0.7246 steps/s; "
                                 "loss=1; time: 72.5% step, 0% input, 27.5% evaluate")


def test_no_eta_without_max_steps(caplog):
    caplog.set_level(logging.INFO, logger="loopkit")
    clock = FakeClock()
    data = [jnp.float32(1)] * 12
    loopkit.train(lambda s, x: (s + x, {}), init=jnp.zeros(()), data=data, clock=clock,
                  progress_secs=5, plugins=[Tick(clock, 1.0)], **{**FAST, "prefetch": 0})
    periodic = [m for m in lines(caplog) if m.startswith("loopkit: step")]
    assert periodic[0].startswith("loopkit: step 5, 1 steps/s; time: ")
    assert "ETA" not in " ".join(periodic)


def test_bar_keeps_log_records_above_it(tmp_path, monkeypatch):
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    handler = logging.StreamHandler(sys.stderr)  # the user's own console logging
    root = logging.getLogger()
    root.addHandler(handler)
    monkeypatch.setattr(root, "level", logging.INFO)

    class Talk:
        @loopkit.hookimpl
        def session_create(self, session):
            session.every(lambda s: logging.getLogger("user").info("eval at %d", s.step),
                          steps=10, name="talk")

    clock = FakeClock()
    try:
        loopkit.train(step_fn, init=jnp.zeros(()), max_steps=30, logdir=tmp_path, clock=clock,
                      save_summaries_steps=10, save_summaries_secs=None,
                      disable=("checkpoint",), plugins=[Talk(), Tick(clock, 0.1)])
    finally:
        root.removeHandler(handler)
    text = term.getvalue()
    # the bar is cleared before each record, which gets a line of its own
    assert re.search(r"\r +\reval at 10\n\r", text) and re.search(r"\r +\reval at 20\n", text)
    # the bar shows the rate; no global_step/sec line through it
    assert "step/s" in text and "global_step/sec" not in text
    assert root.handlers[-1] is not handler  # the redirect was undone
