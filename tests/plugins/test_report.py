"""``loopkit report``, ``loopkit goodput --json / --sessions`` and ``loopkit checkpoints
--json`` on a real run under ``loopkit run`` whose sessions were SIGKILLed, hung (exit 75,
with its report), rolled back then failed (exit 1), and finished; the report loaded in
headless Chromium."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import loopkit

WORKER = Path(__file__).parent.parent / "workers" / "report_worker.py"
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loopkit", *args], capture_output=True,
                          text=True, timeout=120, env=ENV)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("report")
    logdir = base / "run"
    r = subprocess.run(
        [sys.executable, "-m", "loopkit", "run", "--backoff-secs", "0", "--max-restarts", "5",
         "--", sys.executable, str(WORKER), str(logdir), str(base / "tries")],
        capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0 and "DONE 30" in r.stdout, r.stderr[-4000:]
    assert (base / "tries").read_text() == "4"
    return logdir


def test_goodput_json_is_the_report_by_its_attribute_names(run):
    out = _cli("goodput", str(run), "--json")
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    report = loopkit.goodput(run)
    assert printed == json.loads(json.dumps(dataclasses.asdict(report)))
    assert set(printed) == {f.name for f in dataclasses.fields(loopkit.GoodputReport)}
    assert (printed["sessions"], printed["interruptions"], printed["rollbacks"]) == (4, 3, 1)
    assert printed["running"] is False


def test_goodput_sessions_lists_how_each_session_ended(run):
    out = _cli("goodput", str(run), "--sessions", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["ended"] for r in rows] == ["crashed", "hung", "crashed", "finished"]
    assert [r["exit"] for r in rows] == ["SIGKILL", "exit 75", "exit 1", None]
    assert rows[2]["error"] == "RuntimeError: a bug at step 24" and rows[2]["rollbacks"] == 1
    assert rows[0]["restored_tier"] is None and rows[0]["last_step"] == 10
    assert all(r["restored_tier"] in ("durable", "local") for r in rows[1:])
    assert all(a["end"] <= b["start"] for a, b in zip(rows, rows[1:]))
    text = _cli("goodput", str(run), "--sessions").stdout
    assert "crashed (SIGKILL)" in text and "hung (exit 75)" in text
    assert "finished (max_steps)" in text and len(text.splitlines()) == 5  # a header, 4 rows


def test_checkpoints_json_lists_both_tiers_and_the_one_a_restart_restores(run):
    out = _cli("checkpoints", str(run), "--json")  # the local tier from the ledger
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert {r["tier"] for r in rows} == {"durable", "local"}
    assert all(Path(r["path"]).parent == Path(f"{run}-local") for r in rows
               if r["tier"] == "local")
    assert [(r["step"], r["tier"]) for r in rows if r["restore"]] == [(30, "durable")]
    assert {"name", "step", "tier", "size", "time", "restore"} <= set(rows[0])
    assert rows == json.loads(_cli("checkpoints", str(run), "--json", "--local-dir",
                                   f"{run}-local").stdout)
    text = _cli("checkpoints", str(run)).stdout
    assert re.search(r"step 28\s+local", text) and "<- latest" in text


@pytest.fixture(scope="module")
def page(run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("page") / "report.html"
    r = _cli("report", str(run), "-o", str(out))
    assert r.returncode == 0 and r.stdout.strip() == str(out), r.stderr
    return out


def test_the_report_is_one_self_contained_file(page):
    text = page.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", text, re.I)
    assert "@import" not in text and not re.search(r"url\(\s*['\"]?(https?:)?//", text)
    assert "<link" not in text and "<img" not in text
    assert text.count('<g class="session"') == 4


def _chromium(page: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", f"--user-data-dir={tmp}", "--enable-logging=stderr", "--v=0",
         *args, page.as_uri()],
        capture_output=True, text=True, timeout=90)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_chromium_shows_every_session_the_exits_the_hang_report_and_goodput(
        run, page, tmp_path):
    dom = _chromium(page, tmp_path / "profile", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-3000:]
    html = dom.stdout
    assert 'data-sessions="4"' in html  # counted by the page's script: it ran
    assert re.search(r'<div id="errors">\s*</div>', html), html[:2000]
    assert "Uncaught" not in dom.stderr and "CONSOLE" not in dom.stderr, dom.stderr[-3000:]
    assert "crashed (SIGKILL)" in html and "crashed (exit 1: RuntimeError" in html
    assert "hung (exit 75)" in html
    hang = next((run / "hangs").glob("hang-0-*.txt")).read_text()
    details = re.search(r'<details class="hang">.*?</details>', html, re.S).group(0)
    assert "made no progress for" in details and "made no progress for" in hang
    assert "rollback 20→18" in html
    report = loopkit.goodput(run)
    assert f"{100 * report.fraction:.1f} %" in html
    assert "finished (max_steps)" in html

    shot = tmp_path / "report.png"
    r = _chromium(page, tmp_path / "profile2", "--window-size=1100,1600",
                  f"--screenshot={shot}")
    assert r.returncode == 0 and shot.exists(), r.stderr[-3000:]
    from PIL import Image

    with Image.open(shot) as image:
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 20  # drawn, not a blank page
    white = max(colours)[0] / sum(c for c, _ in colours)
    assert white < 0.97


# -- faults and a peer restore, from a ledger written by hand (no training) ----------

def _faulty_ledger(logdir: Path) -> float:
    """A ledger as the goodput plugin, the fault checks and `loopkit run` write it: a fresh
    session that names a replica mismatch, a compute fault and a straggler and then
    crashes, restarted; a session restored from a peer's copy that finishes. Returns t0."""
    from loopkit.plugins.goodput.ledger import Ledger
    from loopkit.plugins.goodput.records import (
        LEDGER_NAME, Fault, Restart, Start, Stop, Window, append_line,
    )

    t0 = 1_700_000_000.0
    common = dict(host="host-a", pid=100, restore_secs=0.0, first_step_secs=0.5,
                  summary_secs=10.0)
    ledger = Ledger(logdir)
    ledger.write(Start(time=t0 + 2, step=0, process_start=t0, tier=None, **common))
    ledger.write(Window(time=t0 + 12, step=10, secs=10.0, input_secs=0.1, save_secs=0.0,
                        timers={}))
    ledger.write(Fault(time=t0 + 14, step=12, cause="sdc", process=1, host="host-b",
                       device=5, detail="leaf params/w"))
    ledger.write(Fault(time=t0 + 18, step=16, cause="compute", process=0, host="host-a",
                       detail="loss=nan"))
    ledger.write(Fault(time=t0 + 22, step=20, cause="straggler", process=2, host="host-c",
                       detail="3.0x the others' time per step, in input", secs=4.0))
    ledger.write(Stop(time=t0 + 24, step=22, secs=12.0, input_secs=0.1, save_secs=0.0,
                      timers={}, reason="error", error="RuntimeError: the machine"))
    ledger.close()
    # `loopkit run`'s record (`record_restart` stamps it now: this one keeps the run's clock)
    append_line(logdir / LEDGER_NAME, Restart(time=t0 + 26, step=22, kind="failure",
                                              exit_code=1, signal=None).to_line(), True)
    ledger = Ledger(logdir)
    ledger.write(Start(time=t0 + 34, step=20, process_start=t0 + 30, tier="peer",
                       **{**common, "pid": 101}))
    ledger.write(Stop(time=t0 + 44, step=30, secs=10.0, input_secs=0.1, save_secs=0.0,
                      timers={}, reason="max_steps"))
    ledger.close()
    return t0


@pytest.fixture(scope="module")
def faulty(tmp_path_factory) -> tuple[Path, Path]:
    logdir = tmp_path_factory.mktemp("faulty") / "run"
    _faulty_ledger(logdir)
    page = logdir.parent / "report.html"
    r = _cli("report", str(logdir), "-o", str(page))
    assert r.returncode == 0, r.stderr
    return logdir, page


def test_goodput_sessions_lists_each_sessions_faults_and_a_peer_restore(faulty):
    logdir, _ = faulty
    out = _cli("goodput", str(logdir), "--sessions", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["ended"] for r in rows] == ["crashed", "finished"]
    assert [(f["cause"], f["process"], f["host"], f["step"], f["device"])
            for f in rows[0]["faults"]] == [("sdc", 1, "host-b", 12, 5),
                                            ("compute", 0, "host-a", 16, None),
                                            ("straggler", 2, "host-c", 20, None)]
    assert [f["time"] for f in rows[0]["faults"]] == [1_700_000_014.0, 1_700_000_018.0,
                                                     1_700_000_022.0]
    assert rows[0]["faults"][2]["secs"] == 4.0 and rows[1]["faults"] == []
    assert (rows[1]["restored_step"], rows[1]["restored_tier"]) == (20, "peer")
    text = _cli("goodput", str(logdir), "--sessions").stdout
    assert "1 replica mismatch (process 1 on host-b)" in text
    assert "1 compute fault (process 0 on host-a)" in text
    assert "1 straggler (process 2 on host-c)" in text
    assert "step 20 (peer copy of the local tier)" in text


def test_the_report_marks_each_fault_by_cause_and_names_the_peer_restore(faulty):
    _, page = faulty
    text = page.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", text, re.I)
    assert "@import" not in text and "<link" not in text and "<img" not in text
    marks = re.findall(r'<g class="fault" data-cause="(\w+)" data-process="(\d)">'
                       r'<title>([^<]*)</title>', text)
    assert [(c, p) for c, p, _ in marks] == [("sdc", "1"), ("compute", "0"), ("straggler", "2")]
    sdc, compute, straggler = (t for _, _, t in marks)
    assert "replica mismatch at step 12" in sdc and "process 1 on host host-b, device 5" in sdc
    assert "leaf params/w" in sdc
    assert "compute fault at step 16" in compute and "host-a" in compute and "loss=nan" in compute
    assert "straggler at step 20" in straggler and "host-c" in straggler
    assert "the others waited 4.0 s" in straggler and "in input" in straggler
    # a marker's shape per cause, each in the legend with its words
    legend = re.search(r'<g class="legend">.*?</svg>', text, re.S).group(0)
    for cause, words in (("sdc", "replica mismatch (sdc)"), ("compute", "compute fault"),
                         ("straggler", "straggler")):
        assert f'data-cause="{cause}"' in legend and words in legend
    assert len(re.findall(r'<tr class="fault-row"', text)) == 3
    assert "step 20 (peer copy of the local tier)" in text
    assert text.count('data-tier="peer"') == 2  # its bar and its row


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_chromium_loads_the_faults_report_without_an_error(faulty, tmp_path):
    _, page = faulty
    dom = _chromium(page, tmp_path / "profile", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-3000:]
    html = dom.stdout
    assert 'data-sessions="2"' in html and 'data-faults="3"' in html  # its script ran
    assert re.search(r'<div id="errors">\s*</div>', html), html[:2000]
    assert "Uncaught" not in dom.stderr and "CONSOLE" not in dom.stderr, dom.stderr[-3000:]
    assert "1 replica mismatch (process 1 on host-b)" in html
