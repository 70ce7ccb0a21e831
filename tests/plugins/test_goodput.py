"""The goodput ledger (``logdir/goodput.jsonl``), `loopkit.goodput`, ``loopkit goodput``,
the ``goodput/`` summaries and ``save_model_secs="auto"``, with real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import pytest

import loopkit
from loopkit.plugins.goodput.records import read_records
from loopkit.plugins.goodput.report import CAUSES, summarise, young_daly

WORKER = Path(__file__).parent.parent / "workers" / "goodput_worker.py"
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
# The causes and the productive time are parts of one timeline cut at the records'
# timestamps, so they add up to the wall time but for float rounding and one clamp
# (a window's step time is never negative): a millisecond per record is generous.
TOLERANCE_PER_RECORD = 1e-3


def _train(logdir: Path, max_steps: int, kill_at: int = 0, **extra) -> tuple[float, float, str]:
    """Run the worker once; (launch time, exit time, its stderr)."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(WORKER), str(logdir), str(max_steps),
                           str(kill_at), json.dumps(extra)],
                          capture_output=True, text=True, timeout=240, env=ENV)
    t1 = time.time()
    if kill_at:
        assert proc.returncode == -9, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0 and f"DONE {max_steps}" in proc.stdout, proc.stderr[-3000:]
    return t0, t1, proc.stderr


def _ledger(logdir: Path) -> list[dict]:
    return [json.loads(x) for x in (logdir / "goodput.jsonl").read_text().splitlines()]


def _adds_up(report: loopkit.GoodputReport, records: int) -> None:
    assert set(report.badput) == set(CAUSES)
    total = report.productive_secs + report.badput_secs()
    assert total == pytest.approx(report.wall_secs, abs=TOLERANCE_PER_RECORD * records)
    assert report.fraction == pytest.approx(report.productive_secs / report.wall_secs)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("clean") / "run"
    t0, t1, err = _train(logdir, 60, save_model_secs="auto", save_model_steps=None)
    return logdir, t0, t1, err


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Three sessions: SIGKILL after step 40 (saved at 30), after step 70 (saved at 60),
    then to step 90; a second's pause before each restart."""
    logdir = tmp_path_factory.mktemp("killed") / "run"
    _train(logdir, 90, kill_at=40)
    time.sleep(1.0)
    _train(logdir, 90, kill_at=70)
    time.sleep(1.0)
    _train(logdir, 90)
    return logdir


def test_a_clean_runs_ledger_has_its_start_windows_and_stop(clean):
    logdir, t0, t1, _ = clean
    lines = _ledger(logdir)
    assert [x["event"] for x in lines][0] == "start" and lines[-1]["event"] == "stop"
    start, stop = lines[0], lines[-1]
    assert {"host", "pid", "process_start", "step", "tier", "restore_secs",
            "first_step_secs"} <= set(start)
    assert start["step"] == 0 and start["tier"] is None and start["pid"] != os.getpid()
    # the process's start, from /proc: after the launch, before the session's first step
    assert t0 - 0.05 <= start["process_start"] <= start["time"] <= stop["time"] <= t1
    windows = [x for x in lines if x["event"] == "window"]
    assert len(windows) >= 5  # every 5 steps: on the summary timer, never per step
    assert {"secs", "input_secs", "save_secs", "timers"} <= set(windows[0])
    assert stop["reason"] == "max_steps" and stop["step"] == 60
    assert stop["save_secs"] > 0  # the final save is in the last window


def test_a_clean_runs_report_adds_up(clean):
    logdir, t0, t1, _ = clean
    report = loopkit.goodput(logdir)
    assert (report.sessions, report.interruptions, report.rollbacks) == (1, 0, 0)
    assert report.mtbi_secs is None
    # never interrupted: the run's time so far stands for the MTBI, at least an hour
    assert report.suggested_save_secs == pytest.approx(
        young_daly(report.save_cost_secs, 3600.0, report.commit_secs))
    assert report.wall_secs <= t1 - t0 + 0.05
    assert 0 < report.productive_secs < report.wall_secs and 0 < report.fraction < 1
    for cause in ("startup", "compile", "checkpoint"):
        assert report.badput[cause] > 0, cause
    assert report.badput["recompute"] == report.badput["downtime"] == 0
    assert "summaries" in report.badput["timers"]
    assert report.save_cost_secs is not None and report.save_cost_secs > 0
    _adds_up(report, len(_ledger(logdir)))


def test_three_sessions_with_sigkills_count_interruptions_recompute_and_downtime(killed):
    lines = _ledger(killed)
    starts = [x for x in lines if x["event"] == "start"]
    assert [s["step"] for s in starts] == [0, 30, 60]
    assert [s["tier"] for s in starts] == [None, "durable", "durable"]
    report = loopkit.goodput(killed)
    assert (report.sessions, report.interruptions) == (3, 2)
    assert report.mtbi_secs == pytest.approx(report.wall_secs / 2)
    assert report.badput["downtime"] >= 2.0  # the pauses, at least
    assert report.badput["restore"] > 0
    # recomputed: 31..35 of the first session (its last record: the window at 35; the
    # kill at 40 comes before that step's timers) and 61..65 of the second, at their
    # sessions' mean step times
    by_session, current = [], None
    for x in lines:
        if x["event"] == "start":
            current = {"first": x["step"] + 1, "secs": 0.0, "last": x["step"] + 1}
            by_session.append(current)
        elif x["event"] in ("window", "stop"):
            t = x["secs"] - x["input_secs"] - x["save_secs"] - sum(x["timers"].values())
            current["secs"] += max(0.0, t)
            current["last"] = x["step"]
    mean = [s["secs"] / (s["last"] - s["first"]) for s in by_session]
    assert [s["last"] for s in by_session] == [35, 65, 90]
    assert report.badput["recompute"] == pytest.approx(5 * mean[0] + 5 * mean[1], rel=1e-6)
    _adds_up(report, len(lines))


def test_the_cli_prints_the_report(killed, tmp_path):
    out = subprocess.run([sys.executable, "-m", "loopkit", "goodput", str(killed)],
                         capture_output=True, text=True, timeout=120, env=ENV)
    assert out.returncode == 0, out.stderr
    assert "goodput)" in out.stdout and "sessions 3, interruptions 2" in out.stdout
    for cause in CAUSES:
        assert f"  {cause} " in out.stdout
    empty = subprocess.run([sys.executable, "-m", "loopkit", "goodput", str(tmp_path)],
                           capture_output=True, text=True, timeout=120, env=ENV)
    assert empty.returncode == 1 and "no goodput ledger" in empty.stderr


def test_the_report_goes_to_tensorboard_under_goodput(clean):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = clean[0]
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for cause in CAUSES:
        if cause != "timers":
            assert f"goodput/badput/{cause}" in tags, sorted(tags)
    assert {"goodput/fraction", "goodput/wall_secs", "goodput/productive_secs",
            "goodput/badput/timers/summaries", "goodput/interruptions",
            "goodput/suggested_save_secs"} <= tags  # save_cost_secs once a save is measured
    # written with each window: the last one (step 55) has the report of the records
    # up to it (the stop comes after the summaries plugin closed the writer)
    last = acc.Scalars("goodput/fraction")[-1]
    assert last.step == 55
    records = read_records(logdir)
    assert records[-1].event == "stop"
    assert last.value == pytest.approx(summarise(records[:-1]).fraction, rel=1e-5)


def test_auto_is_accepted_and_its_interval_logged(clean):
    assert loopkit.Config(save_model_secs="auto").save_model_secs == "auto"
    with pytest.raises(ValueError, match=r'save_model_secs=\'fast\'.*"auto"'):
        loopkit.Config(save_model_secs="fast")
    logdir, _, _, err = clean
    # no save measured yet: the first comes within a minute (it measures the cost)
    assert 'save_model_secs="auto": saving every 60 s' in err, err[-3000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    assert acc.Scalars("loopkit/save_model_secs")[0].value == pytest.approx(60)


def test_auto_picks_young_and_dalys_interval_within_its_bounds():
    assert young_daly(2.0, 3600.0) == pytest.approx((2 * 2.0 * 3600) ** 0.5)
    assert young_daly(None, None) == 60.0  # unmeasured: the first save comes soon
    assert young_daly(None, 100.0) == pytest.approx((2 * 1.0 * 100.0) ** 0.5)
    assert young_daly(100.0, 86400.0 * 30) == 3600.0  # at most an hour
    assert young_daly(0.01, 10.0, commit_secs=5.0) == 5.0  # at least a commit


def test_auto_shortens_the_interval_once_the_ledger_has_interruptions(killed, tmp_path):
    _, _, err = _train(killed, 100, save_model_secs="auto", save_model_steps=None)
    report = loopkit.goodput(killed)
    assert report.interruptions == 2 and report.save_cost_secs is not None
    expected = young_daly(report.save_cost_secs, 3600.0)  # the same cost, uninterrupted
    line = [x for x in err.splitlines() if 'save_model_secs="auto"' in x][0]
    picked = float(line.split("saving every ")[1].split(" s")[0])
    assert picked < expected / 4  # a few seconds between interruptions, not an hour


def test_a_url_logdir_mirrors_its_ledger():
    url = "memory://loopkit-test-goodput/run"

    def step(s, b):
        return s + b, {"loss": s.sum()}

    for n in (5, 10):
        loopkit.train(step, init=jnp.zeros(4), data=lambda start: iter(lambda: jnp.ones(4), None),
                      logdir=url, max_steps=n, progress=False, autoload=False,
                      save_summaries_steps=2, checkpoint_backend="npz")
    report = loopkit.goodput(url)
    assert report.sessions == 2 and report.interruptions == 0
    import fsspec

    text = fsspec.filesystem("memory").cat_file("/loopkit-test-goodput/run/goodput.jsonl")
    assert [json.loads(x)["event"] for x in text.decode().splitlines()].count("stop") == 2
