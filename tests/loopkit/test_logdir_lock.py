"""One run per logdir: a second live run fails at start-up naming the first; a dead one never blocks."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax.numpy as jnp
import pytest

import loopkit
from loopkit import storage
from loopkit.process.logdir_lock import LEASE_NAME, RENEW_ENV

QUIET = dict(progress=False, autoload=False)

# trains slowly until killed or max_steps; prints "STEP n" once it is in the loop
RUN = textwrap.dedent("""
    import sys, time, jax.numpy as jnp, loopkit
    class Report:
        @loopkit.hookimpl
        def after_step(self, step):
            print("STEP", step, flush=True)
            time.sleep(float(sys.argv[3]))
    r = loopkit.train(lambda s: (s + 1, {"loss": s}), init=jnp.zeros(()), logdir=sys.argv[1],
                      max_steps=int(sys.argv[2]), save_model_steps=2, save_model_secs=None,
                      save_summaries_steps=1, plugins=[Report()], progress=False,
                      autoload=False)
    print("DONE", r.step, flush=True)
""")


def _start(logdir: Path, max_steps: int, delay: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RUN, str(logdir), str(max_steps), str(delay)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(proc: subprocess.Popen, step: int) -> None:
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if line.startswith("STEP") and int(line.split()[1]) >= step:
            return
        assert time.monotonic() < deadline
    raise AssertionError(f"the run ended before step {step}: {proc.stderr.read()[-2000:]}")


def _events(logdir: Path) -> list[str]:
    return sorted(p.name for p in logdir.glob("events.out.tfevents.*"))


def test_a_second_run_on_a_live_logdir_fails_naming_the_first(tmp_path):
    first = _start(tmp_path, 10**6, 0.05)
    try:
        _wait_for_step(first, 3)
        events = _events(tmp_path)
        second = subprocess.run([sys.executable, "-c", RUN, str(tmp_path), "100", "0"],
                                capture_output=True, text=True, timeout=120)
        assert second.returncode != 0
        assert "LogdirInUseError" in second.stderr
        assert f"process {first.pid} on host {socket.gethostname()!r}, started" in second.stderr
        assert _events(tmp_path) == events  # it wrote nothing: no event file of its own
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-2000:]
    assert "DONE" in out


def test_a_killed_holder_never_blocks_a_restart(tmp_path):
    first = _start(tmp_path, 10**6, 0.02)
    _wait_for_step(first, 5)
    first.kill()  # SIGKILL: the OS lock dies with the process
    first.wait(timeout=60)
    restarted = subprocess.run([sys.executable, "-c", RUN, str(tmp_path), "12", "0"],
                               capture_output=True, text=True, timeout=120)
    assert restarted.returncode == 0, restarted.stderr[-2000:]
    assert "DONE 12" in restarted.stdout


def test_in_one_process_evaluators_and_helpers_are_not_locked_out(tmp_path):
    loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), logdir=tmp_path, max_steps=2,
                  **QUIET)
    sv = loopkit.Supervisor(logdir=tmp_path, save_model_secs=None, **QUIET)
    with sv.managed_session(lambda s: (s + 1, {}), init=jnp.zeros(())) as sess:
        sess.run()
        with pytest.raises(loopkit.LogdirInUseError, match=f"process {os.getpid()}"):
            loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), logdir=tmp_path,
                          max_steps=5, **QUIET)
        # an evaluator (not the chief) and the helpers read the logdir freely
        r = loopkit.train(lambda s: (s, {}), init=jnp.zeros(()), logdir=tmp_path, max_steps=3,
                          is_chief=False, checkpoint_backend=None, **QUIET)
        assert r.step == 3
        assert loopkit.latest_checkpoint(tmp_path)[0] == 2
    # released at the end of the block: the next run goes on
    assert loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), logdir=tmp_path,
                         max_steps=6, **QUIET).step == 6


# -- a lease on an object store (memory:// here; tests/plugins/test_storage_buckets.py: S3 and GCS) ----


@pytest.fixture
def url(monkeypatch):
    monkeypatch.setenv(RENEW_ENV, "0.2")  # expires after 4 renewals: 0.8 s
    url = f"memory://loopkit-lease-{time.monotonic_ns()}"
    yield url
    storage.remove(url)


def _lease(url: str, **fields) -> None:
    lease = {"host": "elsewhere", "pid": 4242, "started": "earlier", "token": "theirs",
             "renewed": time.time(), **fields}
    storage.makedirs(url)
    storage.write_atomic(f"{url}/{LEASE_NAME}", json.dumps(lease).encode())


def test_a_live_lease_refuses_a_second_run(url):
    sv = loopkit.Supervisor(logdir=url, save_model_secs=None, checkpoint_backend="npz", **QUIET)
    with sv.managed_session(lambda s: (s + 1, {}), init=jnp.zeros(())) as sess:
        sess.run()
        t0 = time.monotonic()
        with pytest.raises(loopkit.LogdirInUseError, match=f"process {os.getpid()} on host"):
            loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), logdir=url, max_steps=5,
                          checkpoint_backend="npz", **QUIET)
        assert time.monotonic() - t0 < 10  # told as soon as the lease was renewed
    assert not storage.exists(f"{url}/{LEASE_NAME}")  # a clean stop removes it


@pytest.mark.parametrize("ago", [3600.0, float("nan")], ids=["an hour ago", "NaN"])
def test_an_expired_lease_is_taken_over_at_once(url, caplog, ago):
    # a NaN stamp (a hand-edited or damaged lease) is no proof of life either
    _lease(url, renewed=time.time() - ago)
    with caplog.at_level(logging.WARNING, logger="loopkit"):
        r = loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), logdir=url, max_steps=2,
                          checkpoint_backend="npz", **QUIET)
    assert r.step == 2
    assert any("taking over the logdir" in m and "4242" in m for m in caplog.messages)


def test_a_young_lease_that_is_not_renewed_is_waited_for_then_taken(url, caplog):
    _lease(url)  # a run that died a moment ago
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="loopkit"):
        r = loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), logdir=url, max_steps=2,
                          checkpoint_backend="npz", **QUIET)
    waited = time.monotonic() - t0
    assert r.step == 2 and waited >= 0.7
    assert any("waiting up to" in m for m in caplog.messages)
    assert any("taking over the logdir" in m for m in caplog.messages)
