"""`Config.straggler_threshold`: the process whose own time per step exceeds the threshold
times the others' median, `straggler_windows` summary windows in a row, is named (WARNING,
`loopkit/straggler`, a ledger `Fault` whose seconds are badput "straggler"); a clean run
names none. Real `jax.distributed` processes on localhost (tests/workers/straggler_worker.py):
each reads its batches at 8 ms a batch, process 1 at 1.5x that when slowed; the step holds
a collective; windows every 25 steps, threshold 1.25."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

import loopkit
from loopkit.testing import free_port

WORKER = Path(__file__).parent.parent / "workers" / "straggler_worker.py"


def job(tmp_path: Path, slow: float, secs: float) -> list[str]:
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    outs = [open(tmp_path / f"p{i}.out", "w+") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path / "run"), str(i),
                               str(port), str(slow), str(secs)], env=env, stdout=outs[i],
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        for p in procs:
            p.wait(timeout=secs + 120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    texts = []
    for p, f in zip(procs, outs):
        f.seek(0)
        texts.append(f.read())
        assert p.returncode == 0, texts[-1][-3000:]
    return texts


def test_a_process_slowed_in_its_input_is_named_within_windows_plus_one(tmp_path):
    chief, other = job(tmp_path, 1.5, 4)
    named = [int(s) for s in re.findall(r"^NAMED (\d+)", chief, re.M)]
    window = int(re.search(r"^DONE \d+ (\d+)", chief, re.M).group(1))
    assert named and named[0] <= (3 + 1) * window, chief[-3000:]  # straggler_windows=3
    for text in (chief, other):  # every process names it, with the host and the cause
        assert re.search(r"WARNING:loopkit:loopkit: process 1 on \S+ spends 1\.\dx the others' "
                         r"time per step, in input", text), text[-3000:]
        assert "process 0 on" not in text
    report = loopkit.goodput(tmp_path / "run")
    assert report.badput["straggler"] > 0  # the time process 0 waited for it
    from loopkit.plugins.goodput.records import Fault, read_records

    faults = [r for r in read_records(str(tmp_path / "run")) if isinstance(r, Fault)]
    assert faults and {(f.cause, f.process) for f in faults} == {("straggler", 1)}


def test_a_clean_two_process_run_names_none(tmp_path):
    chief, other = job(tmp_path, 1.0, 20)  # about 2,500 steps, 100 windows
    assert int(re.search(r"^DONE (\d+)", chief, re.M).group(1)) >= 2000
    for text in (chief, other):
        assert "NAMED" not in text and "straggler" not in text, text[-3000:]
    assert loopkit.goodput(tmp_path / "run").badput["straggler"] == 0


def test_one_process_ignores_it_with_one_info_line(caplog):
    with caplog.at_level(logging.INFO, logger="loopkit"):
        r = loopkit.train(lambda s, b: (s + b, {}), init=jnp.zeros(()), data=lambda i: iter(
            [1.0] * 9), max_steps=3, straggler_threshold=1.5, progress=False)
    assert r.step == 3
    assert [m for m in caplog.messages if "straggler" in m] == [
        "loopkit: Config.straggler_threshold is ignored: one process"]


@pytest.mark.parametrize("fields, message", [
    (dict(straggler_threshold=1), r"Config.straggler_threshold=1 .* a number > 1 or None"),
    (dict(straggler_threshold="2"), r"Config.straggler_threshold='2' .* a number > 1"),
    (dict(straggler_windows=0), r"Config.straggler_windows=0 .* an int >= 1"),
    (dict(straggler_threshold=2.0, save_summaries_secs=None),
     r"Config.straggler_threshold=2.0 compares the processes at each summary window"),
])
def test_bad_values_fail_at_start_up_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        loopkit.Config(**fields)
