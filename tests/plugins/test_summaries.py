"""The summaries and step_counter built-ins, read back with TensorBoard's own reader."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import loopkit
from loopkit.plugins import nan_guard, profiler, progress, step_counter, summaries
from loopkit.plugins.summaries import event_file_suffix
from loopkit.testing import FakeClock, Tick, scalars
from loopkit.testing import read_events as events
from loopkit.testing import free_port

# No checkpoints here: these tests are about event files (the checkpoint plugin has
# its own tests), and a disabled plugin is not even imported.
FAST = dict(progress=False, disable=("checkpoint",), save_summaries_secs=None)


def steps(acc: EventAccumulator, tag: str) -> list[int]:
    return [s for s, _ in scalars(acc, tag)]


def event_files(logdir) -> list[str]:
    if not os.path.isdir(logdir):
        return []
    return sorted(f for f in os.listdir(logdir) if f.startswith("events.out.tfevents."))


def counting_step(base: float = 0.0):
    return lambda s: (s + 1, {"loss": base + s + 1})


class ResumeAt:
    """Simulates recovery from a checkpoint at `step` (the Restored the checkpoint
    plugin would return), so these tests need no checkpoint backend."""

    def __init__(self, step: int) -> None:
        self.step = step

    @loopkit.hookimpl
    def restore_state(self, like):
        return loopkit.Restored(state=jnp.asarray(float(self.step), like.dtype), step=self.step)


class Capture:
    @loopkit.hookimpl
    def session_create(self, session) -> None:
        self.session = session


def test_builtins_stay_off_the_per_step_path():
    import importlib

    from loopkit.plugin.manager import BUILTINS

    on = 0
    for name in BUILTINS:  # every built-in a default config (with a logdir) turns on
        plugin = importlib.import_module(f"loopkit.plugins.{name}").plugin(
            loopkit.Config(logdir="x"))
        if plugin is not None:
            on += 1
            assert not hasattr(plugin, "before_step") and not hasattr(plugin, "after_step"), name
    assert on == 7  # all but nan_guard, profiler and watchdog
    # the opt-in ones may use them, and are off by default
    assert nan_guard.plugin(loopkit.Config()) is None
    assert profiler.plugin(loopkit.Config()) is None


def test_metrics_scalars_on_the_step_timer(tmp_path):
    clock = FakeClock()
    r = loopkit.train(counting_step(), init=jnp.zeros(()), logdir=tmp_path, max_steps=35,
                      save_summaries_steps=10, clock=clock, plugins=[Tick(clock, 0.5)], **FAST)
    assert r.step == 35
    acc = events(tmp_path)
    # timer at 10, 20, 30; the stop writes the final step 35 (timers don't fire at the stop)
    assert scalars(acc, "loss") == [(10, 10.0), (20, 20.0), (30, 30.0), (35, 35.0)]
    # 0.5 s of (fake) wall time per step: exactly 2 steps/s
    assert scalars(acc, "global_step/sec") == [(10, 2.0), (20, 2.0), (30, 2.0), (35, 2.0)]
    assert steps(acc, "loopkit/overhead_frac") == [10, 20, 30, 35]
    assert "loopkit/checkpoint_blocking_secs" not in acc.Tags()["scalars"]
    # the run's config, once, at the start step
    config = acc.Tensors("loopkit/config/text_summary")
    assert [e.step for e in config] == [0]
    text = config[0].tensor_proto.string_val[0].decode()
    assert "| save_summaries_steps | `10` |" in text and "| max_steps | `35` |" in text
    assert len(event_files(tmp_path)) == 1


def test_global_step_per_sec_real_clock_is_positive(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="loopkit")
    loopkit.train(counting_step(), init=jnp.zeros(()), logdir=tmp_path, max_steps=40,
                  save_summaries_steps=10, **FAST)
    acc = events(tmp_path)
    rates = scalars(acc, "global_step/sec")
    assert [s for s, _ in rates] == [10, 20, 30, 40]
    assert all(np.isfinite(v) and v > 0 for _, v in rates)
    # the step counter also logs, as the Supervisor's did
    logged = [r.getMessage() for r in caplog.records if "global_step/sec" in r.getMessage()]
    assert len(logged) == 4 and "(step 10)" in logged[0]
    overhead = [v for _, v in scalars(acc, "loopkit/overhead_frac")]
    assert all(0.0 <= v for v in overhead)


def test_stop_right_after_the_timer_writes_no_duplicate(tmp_path):
    sv = loopkit.Supervisor(logdir=tmp_path, save_summaries_steps=10, **FAST)
    with sv.managed_session(counting_step(), init=jnp.zeros(())) as sess:
        for _ in range(20):
            sess.run()
    acc = events(tmp_path)
    assert steps(acc, "loss") == [10, 20]
    assert steps(acc, "global_step/sec") == [10, 20]
    assert steps(acc, "loopkit/overhead_frac") == [10, 20]


def test_no_timer_still_writes_the_final_step(tmp_path):
    loopkit.train(counting_step(), init=jnp.zeros(()), logdir=tmp_path, max_steps=7,
                  save_summaries_steps=None, **FAST)
    acc = events(tmp_path)
    assert scalars(acc, "loss") == [(7, 7.0)]
    assert steps(acc, "global_step/sec") == [7]


def test_error_stop_writes_no_final_summary_but_keeps_the_file(tmp_path):
    def step_fn(s):
        if int(s) == 12:
            raise ValueError("boom")
        return s + 1, {"loss": s}

    with pytest.raises(ValueError, match="boom"):
        loopkit.train(step_fn, init=jnp.zeros(()), logdir=tmp_path, max_steps=30, jit=False,
                      save_summaries_steps=5, **FAST)
    acc = events(tmp_path)
    assert steps(acc, "loss") == [5, 10]  # flushed and closed, nothing for the failed step


def test_summary_fn_histograms_scalars_and_text(tmp_path):
    def step_fn(s):
        return {"w": s["w"] + 1.0}, {"loss": jnp.sum(s["w"]), "grads": s["w"] * 2.0}

    def summary_fn(state):
        return {"params/w": state["w"], "params/norm": jnp.linalg.norm(state["w"]),
                "note": "hello"}

    loopkit.train(step_fn, init={"w": jnp.arange(4.0)}, logdir=tmp_path, max_steps=6,
                  save_summaries_steps=3, summary_fn=summary_fn, **FAST)
    acc = events(tmp_path)
    tags = acc.Tags()
    assert {"params/w", "grads"} <= set(tags["histograms"])
    hist = acc.Histograms("params/w")
    assert [h.step for h in hist] == [3, 6]
    assert hist[-1].histogram_value.num == 4
    assert hist[-1].histogram_value.min == 6.0 and hist[-1].histogram_value.max == 9.0
    assert steps(acc, "params/norm") == [3, 6]
    assert [e.step for e in acc.Tensors("note/text_summary")] == [3, 6]


def test_summary_fn_must_return_a_mapping(tmp_path):
    with pytest.raises(TypeError, match=r"Config.summary_fn=.*returned list"):
        loopkit.train(counting_step(), init=jnp.zeros(()), logdir=tmp_path, max_steps=3,
                      save_summaries_steps=1, summary_fn=lambda s: [s], **FAST)


def test_non_finite_array_metric_still_writes(tmp_path):
    step_fn = lambda s: (s + 1, {"v": jnp.array([1.0, jnp.nan, 3.0]), "x": jnp.nan})
    loopkit.train(step_fn, init=jnp.zeros(()), logdir=tmp_path, max_steps=2,
                  save_summaries_steps=1, **FAST)
    acc = events(tmp_path)
    assert [h.histogram_value.num for h in acc.Histograms("v")] == [2, 2]
    assert all(np.isnan(v) for _, v in scalars(acc, "x"))


def test_checkpoint_blocking_secs_is_written_at_each_save(tmp_path):
    loopkit.train(counting_step(), init=jnp.zeros(()), logdir=tmp_path, max_steps=12,
                  save_summaries_steps=6, **dict(FAST, checkpoint_backend="npz", disable=(),
                                                  save_model_steps=4))
    acc = events(tmp_path)
    written = scalars(acc, "loopkit/checkpoint_blocking_secs")
    # at each timer save (4, 8, 12); the stop owes no save (12 was saved)
    assert [s for s, _ in written] == [4, 8, 12]
    assert all(0 < v < 60 for _, v in written)


def test_summary_computed_writes_to_the_same_file(tmp_path):
    sv = loopkit.Supervisor(logdir=tmp_path, save_summaries_steps=5, **FAST)
    with sv.managed_session(counting_step(), init=jnp.zeros(())) as sess:
        for _ in range(5):
            sess.run()
        sv.summary_computed({"eval/acc": 0.75})
        sess.summary_computed({"eval/acc": 0.5}, step=7)
        assert sv.summary_writer is sess.summary_writer is not None
    acc = events(tmp_path)
    assert scalars(acc, "eval/acc") == [(5, 0.75), (7, 0.5)]
    assert len(event_files(tmp_path)) == 1


def test_writer_is_ready_in_other_plugins_session_create(tmp_path):
    class Images:  # a user plugin writing through the run's writer on its own timer
        @loopkit.hookimpl
        def session_create(self, session):
            assert session.summary_writer is not None
            session.every(self.write, steps=4, name="images")

        def write(self, session):
            img = np.full((4, 4), session.step / 10.0)
            session.summary_writer.add_image("img", img, session.step, dataformats="HW")

    loopkit.train(counting_step(), init=jnp.zeros(()), logdir=tmp_path, max_steps=10,
                  plugins=[Images()], **FAST)
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    acc.Reload()
    assert [e.step for e in acc.Images("img")] == [4, 8]
    assert len(event_files(tmp_path)) == 1


def test_non_chief_writes_nothing(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="loopkit")
    logdir = tmp_path / "run"
    capture = Capture()
    loopkit.train(counting_step(), init=jnp.zeros(()), logdir=logdir, max_steps=10,
                  is_chief=False, save_summaries_steps=5, plugins=[capture], **FAST)
    assert event_files(logdir) == []
    assert capture.session.summary_writer is None
    assert capture.session.stats.host_conversions == 0
    capture.session.summary_computed({"x": 1.0})  # a no-op on a non-chief
    assert event_files(logdir) == []
    # without a writer the step counter only logs
    assert any("global_step/sec" in r.getMessage() for r in caplog.records)


def test_disabled_summaries_leave_no_event_file(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="loopkit")
    capture = Capture()
    fast = dict(FAST, disable=("checkpoint", "summaries"))
    loopkit.train(counting_step(), init=jnp.zeros(()), logdir=tmp_path, max_steps=10,
                  save_summaries_steps=5, plugins=[capture], **fast)
    assert event_files(tmp_path) == []
    session = capture.session
    assert session.summary_writer is None
    # the step counter writes through session.summary_writer when there is one;
    # without it, it only logs
    assert any("global_step/sec" in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match="summary writer"):
        session.summary_computed({"x": 1.0})


class Counted:
    """A metric value that counts every conversion to a host value."""

    def __init__(self, value: float, counter: list[int]) -> None:
        self.value, self.counter = value, counter

    def _count(self):
        self.counter[0] += 1
        return self.value

    def __float__(self):
        return float(self._count())

    def item(self):
        return self._count()

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self._count(), dtype=dtype)

    def __jax_array__(self):
        return jnp.asarray(self._count())


@pytest.mark.parametrize("logdir", [True, False])
def test_metrics_are_converted_only_for_summaries(tmp_path, logdir):
    counter = [0]
    capture = Capture()
    step_fn = lambda s: (s + 1, {"loss": Counted(1.5, counter), "aux": Counted(2.0, counter)})
    # progress is on (log lines, as on a non-terminal); its clock never reaches its
    # 10 s period, so it converts only at the stop, sharing the summaries' fetch
    loopkit.train(step_fn, init=jnp.zeros(()), logdir=tmp_path if logdir else None,
                  max_steps=50, save_summaries_steps=10, save_summaries_secs=None, jit=False,
                  clock=FakeClock(), plugins=[capture], disable=("checkpoint",))
    stats = capture.session.stats
    if logdir:
        # four timer writes (10..40) and the final step: 5 fetches of 2 metrics, not 50
        assert stats.host_conversions == 5
        assert counter[0] == 2 * 5
        assert scalars(events(tmp_path), "loss") == [(s, 1.5) for s in (10, 20, 30, 40, 50)]
    else:
        # no summaries: only the progress line at the stop looks at them
        assert stats.host_conversions == 1
        assert counter[0] == 2


@pytest.mark.skipif(jax.default_backend() == "cpu",
                    reason="on CPU the transfer guard does not fire (arrays are in host memory)")
def test_no_implicit_device_to_host_transfer(tmp_path):
    step_fn = lambda s: (s * 0.5 + 1, {"loss": jnp.sum(s), "v": s})
    with jax.transfer_guard_device_to_host("disallow"):
        loopkit.train(step_fn, init=jnp.ones((8,)), logdir=tmp_path, max_steps=30,
                      save_summaries_steps=10, summary_fn=lambda s: {"s": s}, nan_guard="loss",
                      progress=True, disable=("checkpoint",))
    assert steps(events(tmp_path), "loss") == [10, 20, 30]


def test_event_file_names_sort_in_creation_order(tmp_path):
    suffixes = [event_file_suffix() for _ in range(3)]
    assert sorted(suffixes) == suffixes and len(set(suffixes)) == 3
    for base in (1000.0, 2000.0, 3000.0):  # three runs, well within one second or two
        loopkit.train(counting_step(base), init=jnp.zeros(()), logdir=tmp_path, max_steps=2,
                      save_summaries_steps=None, **FAST)
    files = event_files(tmp_path)
    assert len(files) == 3
    firsts = [scalars(events(tmp_path / f), "loss")[0][1] for f in files]
    assert firsts == [1002.0, 2002.0, 3002.0]
    # each fresh run starts at step 0 with a SessionLog.START that hides the older
    # runs' events, as the Supervisor's did: the directory shows the newest run
    assert scalars(events(tmp_path), "loss") == [(2, 3002.0)]


def _purged_resume(logdir: Path) -> None:
    """The second run of a kill + resume: recovered at step 20, runs to 40."""
    loopkit.train(counting_step(2000.0), init=jnp.zeros(()), logdir=logdir, max_steps=40,
                  save_summaries_steps=5, plugins=[ResumeAt(20)], **FAST)


def _check_one_clean_curve(acc: EventAccumulator) -> None:
    loss = scalars(acc, "loss")
    assert [s for s, _ in loss] == [5, 10, 15, 20, 25, 30, 35, 40]  # each step once
    # up to the recovered step from the first run, after it from the resumed one
    assert [v for _, v in loss] == [1000.0 + s for s in (5, 10, 15, 20)] + [
        2000.0 + s for s in (25, 30, 35, 40)]
    for tag in ("global_step/sec", "loopkit/overhead_frac"):
        assert steps(acc, tag) == [5, 10, 15, 20, 25, 30, 35, 40], tag


def test_resume_purges_what_the_first_run_wrote_after_the_recovered_step(tmp_path):
    loopkit.train(counting_step(1000.0), init=jnp.zeros(()), logdir=tmp_path, max_steps=30,
                  save_summaries_steps=5, **FAST)
    assert steps(events(tmp_path), "loss") == [5, 10, 15, 20, 25, 30]
    _purged_resume(tmp_path)
    assert len(event_files(tmp_path)) == 2
    acc = events(tmp_path)
    _check_one_clean_curve(acc)
    # each session records its config once, at its start step
    # one config per session, at its first new step (a resume at 20 writes it at 21)
    assert [e.step for e in acc.Tensors("loopkit/config/text_summary")] == [0, 21]


KILLED_RUN = textwrap.dedent("""
    import sys, time
    import jax.numpy as jnp
    import loopkit

    class Hang:
        @loopkit.hookimpl
        def session_create(self, session):
            session.every(self.hang, steps=32, name="hang")

        def hang(self, session):
            print("hanging at", session.step, flush=True)
            time.sleep(600)  # the test kills us with SIGKILL

    loopkit.train(lambda s: (s + 1, {"loss": 1000.0 + s + 1}), init=jnp.zeros(()),
                  logdir=sys.argv[1], max_steps=100, save_summaries_steps=5,
                  save_summaries_secs=None, progress=False, disable=("checkpoint",),
                  plugins=[Hang()])
""")


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def test_sigkill_then_resume_shows_each_step_once(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED_RUN)
    logdir = tmp_path / "run"
    stderr = open(tmp_path / "stderr.txt", "w")
    proc = subprocess.Popen([sys.executable, str(script), str(logdir)],
                            stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else "(nothing in 120 s)"
        assert line.startswith("hanging at 32"), line + (tmp_path / "stderr.txt").read_text()

        # what the summary at step 30 handed to the writer reaches the file while the
        # process lives on (tensorboardX's writer thread flushes within FLUSH_SECS)
        def flushed():
            return event_files(logdir) and 30 in steps(events(logdir), "loss")

        _wait_for(flushed, 60, "step 30 in the killed run's event file")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        stderr.close()
    assert proc.returncode == -signal.SIGKILL
    _purged_resume(logdir)
    _check_one_clean_curve(events(logdir))



def test_real_tensorboard_server_shows_one_clean_curve(tmp_path):
    """Integration test: a real `tensorboard` process serves the resumed run's curve."""
    loopkit.train(counting_step(1000.0), init=jnp.zeros(()), logdir=tmp_path, max_steps=30,
                  save_summaries_steps=5, **FAST)
    _purged_resume(tmp_path)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path), "--host",
         "127.0.0.1", "--port", str(port), "--load_fast=false"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?run=.&tag=loss"

    def curve():
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                data = json.loads(resp.read())
        except OSError:  # not listening yet, or not loaded yet
            return None
        return data if len(data) == 8 else None

    try:
        data = _wait_for(curve, 90, "tensorboard to serve the loss curve")
    finally:
        server.kill()
        server.wait(30)
    assert [(step, value) for _, step, value in data] == [
        (5, 1005.0), (10, 1010.0), (15, 1015.0), (20, 1020.0),
        (25, 2025.0), (30, 2030.0), (35, 2035.0), (40, 2040.0)]
