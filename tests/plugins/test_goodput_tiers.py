"""``"auto"`` intervals that know the tiers: a process death is the local tier's job,
a lost machine the durable tier's.

The ledgers here are written by real runs (tests/plugins/cadence_worker.py in a
subprocess, SIGKILLed once its local tier is ahead of the durable one, restarted;
its local directory wiped for a lost machine), and the intervals asserted are the
ones the runs logged and wrote to TensorBoard.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import loopkit
from loopkit.plugins.checkpoint.cadence import machine_fate
from loopkit.plugins.checkpoint.tf_file import read_state
from loopkit.plugins.goodput.records import Restart, Start, Stop, Window, read_records
from loopkit.plugins.goodput.report import format_report, summarise, young_daly

WORKER = Path(__file__).with_name("cadence_worker.py")
MAX_STEPS = 200
PICKED = re.compile(r'save_model_secs="auto": saving every (\d+) s')
LOCAL_PICKED = re.compile(r'save_local_secs="auto": saving the local tier every (\d+) s')


def latest(directory: Path) -> int | None:
    state = read_state(directory)
    return None if state is None else state.latest


class Life:
    """One run of the worker: started, then killed or finished."""

    def __init__(self, tmp: Path, max_steps: int = MAX_STEPS, **extra) -> None:
        self.tmp, self.err = tmp, tmp / f"stderr-{time.monotonic_ns()}.txt"
        self.max_steps = max_steps
        self.log = open(self.err, "wb")
        env = dict(os.environ, LOOPKIT_DISABLE_PLUGIN_AUTOLOAD="1", JAX_PLATFORMS="cpu")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp / "run"), str(tmp / "local"),
             str(max_steps), json.dumps(extra)],
            stdout=subprocess.PIPE, stderr=self.log, env=env, text=True)
        self.started = self.proc.stdout.readline().split()  # ["started", step, tier]

    def kill_once_local_is_ahead(self, beyond: int) -> int:
        """SIGKILL once the local tier names a step past `beyond` and past the durable
        tier's; the local step then."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            local, durable = latest(self.tmp / "local"), latest(self.tmp / "run")
            if local is not None and durable is not None and local > beyond and local > durable:
                self.proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.01)
        assert self.proc.wait(timeout=60) == -signal.SIGKILL, self.stderr()[-3000:]
        self.log.close()
        return latest(self.tmp / "local")

    def finish(self) -> str:
        out, _ = self.proc.communicate(timeout=120)
        self.log.close()
        assert self.proc.returncode == 0, self.stderr()[-3000:]
        assert out.split() == ["done", str(self.max_steps)]
        return self.stderr()

    def stderr(self) -> str:
        return self.err.read_text()


def picked(stderr: str, pattern: re.Pattern = PICKED) -> list[int]:
    return [int(m) for m in pattern.findall(stderr)]


def report_at_start(logdir: Path, session: int):
    """The report "auto" saw when session `session` (0-based) opened: the records
    before its start, and its start as it was then (the run's last session, running:
    the record written after the first step, less that step and the wait for input)."""
    records = read_records(logdir)
    starts = [i for i, r in enumerate(records) if isinstance(r, Start)]
    start = records[starts[session]]
    opened = dataclasses.replace(
        start, time=start.time - (start.first_step_secs or 0.0) - start.input_secs,
        first_step_secs=None)
    return summarise(records[:starts[session]] + [opened], running=True)


def close_to(logged: int, value: float) -> bool:
    """An interval logged as a whole number of seconds is `value`, but for the rounding
    and the start's time, known here to a few hundredths of a second."""
    return abs(logged - value) <= 0.5 + 0.05 * value


def test_the_machine_is_told_by_the_tier_restored_and_what_the_local_tier_held():
    assert machine_fate("local", 40, {30, 40}) == "lived"
    assert machine_fate("peer", 40, set()) == "lost"  # a part came from a neighbour
    assert machine_fate("durable", 40, set()) == "lost"  # wiped: a replaced machine
    assert machine_fate("durable", 40, {30, 45}) == "lost"  # another process lacked 45
    assert machine_fate("durable", 40, {33, 36}) == "lived"  # the durable one was newer
    assert machine_fate(None, None, set()) is None  # nothing to restore: cannot tell


def test_process_deaths_leave_the_durable_interval_and_a_lost_machine_shortens_it(tmp_path):
    """Three SIGKILLs restored from the local tier, then one with the local directory
    wiped (a replaced machine), restored from the durable tier."""
    # long: one run's five sessions, asserted as they go (each restart costs seconds)
    beyond = 45
    for _ in range(3):
        life = Life(tmp_path)
        beyond = life.kill_once_local_is_ahead(beyond) + 25
    life = Life(tmp_path)  # the fourth session, after three process deaths
    assert life.started[2] == "local"
    local = life.kill_once_local_is_ahead(beyond)
    fourth_log = life.stderr()
    durable = latest(tmp_path / "run")
    assert local > durable
    shutil.rmtree(tmp_path / "local")  # a lost machine: its local disk is gone
    life = Life(tmp_path)
    assert life.started == ["started", str(durable), "durable"]
    last = life.finish()
    logdir = tmp_path / "run"
    starts = [r for r in read_records(logdir) if isinstance(r, Start)]
    assert [(r.tier, r.machine) for r in starts] == [
        (None, None), ("local", "lived"), ("local", "lived"), ("local", "lived"),
        ("durable", "lost")]

    # the fourth session: three process deaths, no lost machine; the durable interval
    # is the uninterrupted one (the run's time so far, at least an hour, as the MTBI)
    fourth = report_at_start(logdir, 3)
    assert (fourth.interruptions, fourth.process_deaths, fourth.lost_machines) == (3, 3, 0)
    assert fourth.durable_mtbi_secs is None and fourth.mtbi_secs is not None
    uninterrupted = young_daly(fourth.save_cost_secs, 3600.0, fourth.commit_secs)
    assert fourth.suggested_save_secs == pytest.approx(uninterrupted)
    as_before = young_daly(fourth.save_cost_secs, fourth.mtbi_secs, fourth.commit_secs)
    assert as_before < uninterrupted  # what counting the process deaths would have picked
    fifth = report_at_start(logdir, 4)
    assert (fifth.process_deaths, fifth.lost_machines) == (3, 1)
    assert fifth.durable_mtbi_secs == pytest.approx(fifth.wall_secs)  # one lost machine
    assert fifth.local_mtbi_secs == pytest.approx(fifth.wall_secs / 3)
    assert fifth.suggested_save_secs == pytest.approx(
        young_daly(fifth.save_cost_secs, fifth.wall_secs, fifth.commit_secs))
    assert fifth.suggested_save_secs < fourth.suggested_save_secs

    # what the sessions logged at their start is what the reports say
    assert close_to(picked(fourth_log)[0], uninterrupted), fourth_log[-3000:]
    assert "counting lost machines only (0), not process deaths (3)" in fourth_log
    first_picked = picked(last)[0]
    assert close_to(first_picked, fifth.suggested_save_secs), last[-3000:]
    assert "counting lost machines only (1), not process deaths (3)" in last
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    assert first_picked in [round(e.value) for e in acc.Scalars("loopkit/save_model_secs")]
    # `loopkit goodput` shows them apart
    text = format_report(loopkit.goodput(logdir))
    assert "process deaths 3 (the local tier's), lost machines 1" in text, text
    from loopkit.plugins.goodput.report_html import render
    from loopkit.plugins.goodput.timeline import build

    from loopkit.plugins.goodput.output import format_sessions, session_rows
    from loopkit.plugins.goodput.report import read_sessions

    table = format_sessions(session_rows(read_sessions(logdir)))  # `--sessions`
    assert f"step {durable} (durable, machine lost)" in table, table
    page = render(build(logdir))  # `loopkit report`
    assert 'data-name="process deaths / lost machines">3 / 1<' in page


def test_local_auto_follows_the_process_deaths(tmp_path):
    life = Life(tmp_path, 80, save_local_secs="auto")
    life.kill_once_local_is_ahead(45)
    life = Life(tmp_path, 80, save_local_secs="auto")
    assert life.started[2] == "local"
    err = life.finish()
    second = report_at_start(tmp_path / "run", 1)
    assert (second.process_deaths, second.lost_machines) == (1, 0)
    assert second.local_mtbi_secs == pytest.approx(second.wall_secs)
    assert second.suggested_local_secs == pytest.approx(
        young_daly(second.local_save_cost_secs, second.wall_secs))
    local = picked(err, LOCAL_PICKED)
    assert local and close_to(local[0], second.suggested_local_secs), err[-3000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run"))
    acc.Reload()
    assert local[0] in [round(e.value) for e in acc.Scalars("loopkit/save_local_secs")]


def test_a_report_counts_a_peer_restore_as_a_lost_machine_the_local_tier_restored():
    """A replaced machine whose part a peer held: lost, but no work for the durable tier."""
    def session(t0: float, tier: str | None, machine: str | None, killed: bool) -> list:
        start = Start(time=t0 + 2, step=0, host="h", pid=1, process_start=t0, tier=tier,
                      restore_secs=0.1, first_step_secs=0.5, local_dir="/ssd/run",
                      machine=machine)
        window = Window(time=t0 + 100, step=100, secs=98, input_secs=0, save_secs=0.2,
                        timers={"checkpoint_local": 0.3}, saves=1, hold_secs=0.2,
                        commit_secs=1.0, saved=[(50, "local", t0 + 50),
                                                (90, "local", t0 + 90)])
        end = [Restart(time=t0 + 101, step=100, kind="failure", exit_code=None, signal=9)] \
            if killed else [Stop(**{**window.__dict__, "time": t0 + 101}, reason="max_steps")]
        return [start, window, *end]

    records = (session(0, None, None, True) + session(110, "local", "lived", True)
               + session(220, "peer", "lost", True) + session(330, "durable", "lost", False))
    report = summarise(records)
    assert (report.interruptions, report.process_deaths, report.lost_machines) == (3, 1, 2)
    assert report.local_mtbi_secs == pytest.approx(report.wall_secs / 2)  # death + peer
    assert report.durable_mtbi_secs == pytest.approx(report.wall_secs)  # the wiped one
    assert report.local_save_cost_secs == pytest.approx(0.15)  # its timer's hold / commit
    assert "process deaths 1 (the local tier's), lost machines 2" in format_report(report)


def test_the_first_measured_save_reaches_the_ledger_before_a_kill(tmp_path):
    """No summary window at all: the first committed save is recorded when "auto" sees
    it, so that the restart picks its interval from a measured cost, not the guess."""
    life = Life(tmp_path, save_summaries_steps=None)
    life.kill_once_local_is_ahead(45)
    windows = [r for r in read_records(tmp_path / "run") if isinstance(r, Window)]
    assert len(windows) == 1 and windows[0].saves >= 1 and windows[0].hold_secs > 0
    life = Life(tmp_path, 60, save_summaries_steps=None)
    err = life.finish()
    second = report_at_start(tmp_path / "run", 1)
    assert second.save_cost_secs is not None
    assert close_to(picked(err)[0], second.suggested_save_secs), err[-3000:]
