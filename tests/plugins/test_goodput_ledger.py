"""The goodput ledger never stops a run: malformed lines skipped with a warning naming
file:line, a crash counted as an interruption (the last session's too), a live run shown
as running, the wait for the first batch booked as input; with real processes."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import pytest

import loopkit
from loopkit.plugins.goodput.records import Start, Window, read_records
from loopkit.plugins.goodput.report import summarise
from loopkit.plugins.goodput.sessions import MIN_SILENCE_SECS, group, is_running

WORKER = Path(__file__).parent.parent / "workers" / "goodput_worker.py"
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}

# the malformed lines a ledger may hold: a torn last write, garbage, a field of the
# wrong type, JSON that is not an object
MALFORMED = {
    "truncated": '{"event":"window","time":17000',
    "garbage": "\x00\x17 not json at all",
    "wrong_type": '{"event":"window","time":1.0,"step":"zero","secs":1.0,"input_secs":0.0,'
                  '"save_secs":0.0,"timers":{}}',
    "not_an_object": "[1, 2, 3]",
}


def _train(logdir: Path | str, max_steps: int, **extra) -> loopkit.TrainResult:
    def step(s, b):
        return s + b, {"loss": s.sum()}

    options = dict(progress=False, autoload=False, save_summaries_steps=2, save_model_secs=None,
                   save_model_steps=4, checkpoint_backend="npz")
    options.update(extra)
    return loopkit.train(step, init=jnp.zeros(4), data=lambda start: iter(lambda: jnp.ones(4), None),
                         logdir=logdir, max_steps=max_steps, **options)


@pytest.fixture(scope="module")
def a_run(tmp_path_factory) -> Path:
    logdir = tmp_path_factory.mktemp("ledger") / "run"
    _train(logdir, 6)
    return logdir


@pytest.mark.parametrize("form", sorted(MALFORMED))
def test_a_malformed_line_is_skipped_with_a_warning_naming_file_and_line(
        form, a_run, tmp_path, caplog):
    logdir = tmp_path / "run"
    shutil.copytree(a_run, logdir)
    ledger = logdir / "goodput.jsonl"
    good = len(ledger.read_text().splitlines())
    bad_line = good + 1
    with open(ledger, "a") as f:  # the truncated form ends without its newline
        f.write(MALFORMED[form] + ("" if form == "truncated" else "\n"))
    where = f"{ledger}:{bad_line}"

    cli = subprocess.run([sys.executable, "-m", "loopkit", "goodput", str(logdir)],
                         capture_output=True, text=True, timeout=120, env=ENV)
    assert cli.returncode == 0, cli.stderr
    assert "sessions 1, interruptions 0" in cli.stdout
    assert cli.stderr.count("skipped a malformed goodput ledger line") == 1, cli.stderr
    assert where in cli.stderr, cli.stderr

    with caplog.at_level(logging.WARNING, logger="loopkit"):
        assert loopkit.goodput(logdir).sessions == 1
        # the next session reads it at start-up, at its windows and for "auto"
        r = _train(logdir, 12, save_model_secs="auto", save_model_steps=None)
    assert r.step == 12
    warnings = [m for m in caplog.messages if "skipped a malformed goodput ledger line" in m]
    assert len(warnings) == 2 and all(where in m for m in warnings), warnings
    lines = ledger.read_text().splitlines()
    assert lines[bad_line - 1] == MALFORMED[form]  # kept as it was; the next record
    assert json.loads(lines[bad_line])["event"] == "start"  # starts on a line of its own
    report = loopkit.goodput(logdir)
    assert (report.sessions, report.interruptions) == (2, 0)


def _worker(logdir: Path, max_steps: int, **extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), str(logdir), str(max_steps), "0",
                             json.dumps(extra)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)


def test_a_live_run_is_shown_running_and_counted_as_a_crash_once_sigkilled(tmp_path):
    logdir = tmp_path / "run"
    proc = _worker(logdir, 10**6, step_sleep=0.05, save_summaries_steps=5)
    try:
        deadline = time.monotonic() + 120
        while not any(isinstance(r, Window) for r in read_records(logdir)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        live = loopkit.goodput(logdir)
        assert live.running and live.interruptions == 0 and live.mtbi_secs is None
        cli = subprocess.run([sys.executable, "-m", "loopkit", "goodput", str(logdir)],
                             capture_output=True, text=True, timeout=120, env=ENV)
        assert cli.returncode == 0 and "(running: last record " in cli.stdout, cli.stdout
        page = subprocess.run([sys.executable, "-m", "loopkit", "report", str(logdir), "-o",
                               str(tmp_path / "live.html")], capture_output=True, text=True,
                              timeout=120, env=ENV)
        assert page.returncode == 0, page.stderr
        text = (tmp_path / "live.html").read_text()  # drawn up to its last record
        assert "running: last record " in text and 'data-ended="running"' in text
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    # the last session, killed: an interruption, though no later session started
    dead = loopkit.goodput(logdir)
    assert not dead.running and (dead.sessions, dead.interruptions) == (1, 1)
    assert dead.mtbi_secs == pytest.approx(dead.wall_secs)
    cli = subprocess.run([sys.executable, "-m", "loopkit", "goodput", str(logdir)],
                         capture_output=True, text=True, timeout=120, env=ENV)
    assert "sessions 1, interruptions 1" in cli.stdout and "running" not in cli.stdout


def test_without_a_lock_to_read_the_last_records_age_decides():
    start = Start(time=1000.0, step=0, host="h", pid=1, process_start=990.0, tier=None,
                  restore_secs=0.0, first_step_secs=1.0, summary_secs=30.0)
    window = Window(time=1030.0, step=5, secs=30.0, input_secs=0.0, save_secs=0.0, timers={})
    session = group([start, window])[0]
    # three summary intervals (90 s) of silence, at least a minute
    assert is_running(None, session, now=1030.0 + 89)
    assert not is_running(None, session, now=1030.0 + 91)
    # windows by steps only: the longest gap between its records stands for the interval
    by_steps = group([dataclasses.replace(start, summary_secs=None), window])[0]
    assert is_running(None, by_steps, now=1030.0 + 89)
    assert not is_running(None, by_steps, now=1030.0 + 91)
    quick = group([dataclasses.replace(start, summary_secs=5.0), window])[0]
    assert is_running(None, quick, now=1030.0 + MIN_SILENCE_SECS - 1)
    assert not is_running(None, quick, now=1030.0 + MIN_SILENCE_SECS + 1)
    # the summary of records alone: the last session is an interruption unless running
    assert summarise([start, window]).interruptions == 1
    assert summarise([start, window], running=True).interruptions == 0


@pytest.mark.parametrize("prefetch", [2, 0])
def test_the_wait_for_the_first_batch_is_input_not_startup(tmp_path, prefetch):
    wait = 3.0

    def data(start):
        time.sleep(wait)  # a data source slow to give its first batch
        while True:
            yield jnp.ones(4)

    called = time.time()
    loopkit.train(lambda s, b: (s + b, {"loss": s.sum()}), init=jnp.zeros(4), data=data,
                  logdir=tmp_path, max_steps=4, progress=False, autoload=False,
                  checkpoint_backend="npz", prefetch=prefetch)
    report = loopkit.goodput(tmp_path)
    start = read_records(tmp_path)[0]
    # the wait booked is the loop's: with prefetch the thread asks for the first batch at
    # session_create, so the part of the wait the rest of the start-up overlapped (the
    # other services starting: a tenth of a second, more on a loaded machine) is not
    overlap = 0.5 if prefetch else 0.0
    assert isinstance(start, Start) and start.input_secs >= wait - overlap
    assert report.badput["input"] >= wait - overlap
    # this process started before the test; its startup ends about when `train` was
    # called (the lock, the restore's look), not after the wait
    assert report.badput["startup"] < called - start.process_start + wait - 1.0
    assert report.badput["compile"] < wait - 1.0


def test_config_suggests_the_field_a_misspelt_keyword_meant():
    with pytest.raises(TypeError, match=r"'save_model_sec' \(did you mean 'save_model_secs'\?\)"):
        loopkit.Config(save_model_sec=10)
    with pytest.raises(TypeError, match=r"did you mean 'save_model_secs'"):
        loopkit.Config().replace(save_model_sec=10)
    with pytest.raises(TypeError, match=r"did you mean 'save_model_secs'"):
        loopkit.train(lambda s: (s, {}), init=0, save_model_sec=10)


def test_the_stats_fields_the_hooks_doc_names_exist():
    import re

    from loopkit.loop.session import SessionStats

    doc = (Path(__file__).parents[2] / "docs" / "hooks.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `stats` |"))
    named = re.findall(r"`(\w+)(?:\(\))?`", row.split("|")[2])
    named = [n for n in named if n != "prefetch"]
    stats = SessionStats()
    assert named and all(hasattr(stats, n) for n in named), named
