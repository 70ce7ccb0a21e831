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
from loopkit.process.logdir_lock import JOB_ENVS, LEASE_NAME, RENEW_ENV, holder_gone

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


@pytest.mark.parametrize("where", ["afile", "afile/run"])
def test_a_logdir_that_is_a_file_is_an_error_naming_the_field(tmp_path, where):
    # a slip such as logdir="train.py": a bare FileExistsError (or NotADirectoryError
    # for a path inside the file) named neither the field nor what was expected
    (tmp_path / "afile").write_text("not a directory")
    with pytest.raises(ValueError, match=r"Config\.logdir=.*afile.* existing file: "
                                         r"expected a directory"):
        loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), max_steps=2,
                      logdir=tmp_path / where, progress=False)
    assert (tmp_path / "afile").read_text() == "not a directory"


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
    for name in JOB_ENVS:  # no job of the test runner's own takes part
        monkeypatch.delenv(name, raising=False)
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


def _train(url, **kw):
    return loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), logdir=url,
                         max_steps=2, checkpoint_backend="npz", **QUIET, **kw)


@pytest.mark.parametrize("name", JOB_ENVS)
def test_a_restart_of_the_same_job_takes_a_live_looking_lease_at_once(
        url, monkeypatch, caplog, name):
    """A restarted job (`loopkit run`'s LOOPKIT_RUN_ID, a requeued SLURM job, a torchrun
    restart) takes its own lease over, however young, from another host too."""
    monkeypatch.setenv(RENEW_ENV, "30")  # a young lease would be waited for 2 minutes
    monkeypatch.setenv(name, "job-7")
    _lease(url, job=f"{name}=job-7")
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="loopkit"):
        assert _train(url).step == 2
    assert time.monotonic() - t0 < 20
    assert any("at once from process 4242" in m and f"own job ({name}=job-7)" in m
               for m in caplog.messages), caplog.messages
    assert not any("waiting up to" in m for m in caplog.messages)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def test_which_holders_are_provably_gone():
    from loopkit.process.logdir_lock import _holder

    me = _holder()
    here = {k: me[k] for k in ("host", "boot", "pidns")}
    parent = os.getppid()
    assert holder_gone({**here, "pid": _dead_pid()}, me).endswith("no longer exists")
    assert holder_gone({**here, "pid": parent, "pid_start": 1}, me).endswith(
        "(its id names a newer process)")  # the id now names a process started later
    assert holder_gone({**here, "pid": parent}, me) is None  # alive
    assert holder_gone({**here, "host": "elsewhere", "pid": _dead_pid()}, me) is None
    # another container on this host: its process ids mean nothing here
    assert holder_gone({**here, "pidns": "pid:[1]", "pid": _dead_pid()}, me) is None
    assert holder_gone({**here, "boot": "another-boot", "pid": parent}, me) == \
        f"host {me['host']!r} has restarted since"
    job = {**me, "job": "SLURM_JOB_ID=9"}
    assert holder_gone({"host": "elsewhere", "pid": 1, "job": "SLURM_JOB_ID=9"}, job) == \
        "it belongs to this run's own job (SLURM_JOB_ID=9)"
    assert holder_gone({"host": "elsewhere", "pid": 1, "job": "SLURM_JOB_ID=8"}, job) is None
    # another session of this very process is alive, whatever its job
    assert holder_gone({**job, "token": "another session"}, job) is None
    for pid in (0, -1, "12", None, True):  # no process id to check: not proof of death
        assert holder_gone({**here, "pid": pid}, me) is None


@pytest.mark.parametrize("ahead,said", [(3600.0, "dated 3600 s in the future"),
                                        (1e30, "dated over a thousand years in the future")])
def test_a_lease_dated_in_the_future_is_judged_by_this_clock(url, caplog, ahead, said):
    _lease(url, renewed=time.time() + ahead)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="loopkit"):
        assert _train(url).step == 2
    assert time.monotonic() - t0 >= 0.7  # waited for it to go unrenewed, by this clock
    text = "\n".join(caplog.messages)
    assert said in text and "waiting up to 1 s" in text, text
    assert "its lease was not renewed in the 1 s this run watched it" in text
    assert "-1000" not in text and "e+" not in text


@pytest.mark.parametrize("body,said", [
    (b"{not json", "is unreadable (not a JSON object)"),
    (json.dumps({"host": "elsewhere", "pid": 4242, "renewed": "soon"}).encode(),
     "with no renewal time, has expired")])
def test_an_unreadable_lease_is_reported_and_taken_over(url, caplog, body, said):
    storage.makedirs(url)
    storage.write_atomic(f"{url}/{LEASE_NAME}", body)
    with caplog.at_level(logging.WARNING, logger="loopkit"):
        assert _train(url).step == 2
    assert any(said in m for m in caplog.messages), caplog.messages


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf"])
def test_a_bad_renewal_interval_is_an_error_naming_the_variable(url, monkeypatch, value):
    monkeypatch.setenv(RENEW_ENV, value)
    with pytest.raises(ValueError, match=f"LOOPKIT_LEASE_RENEW_SECS='{value}' is not a "
                                         "number of seconds > 0"):
        _train(url)


def test_a_lease_taken_over_during_the_run_stops_it(url):
    class TakeOver:
        @loopkit.hookimpl
        def after_step(self, step):
            if step == 3:  # another run takes the logdir
                _lease(url, renewed=time.time() + 3600)
            time.sleep(0.01)

    t0 = time.monotonic()
    with pytest.raises(loopkit.LogdirInUseError, match="it took this run's lease over"):
        loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), logdir=url,
                      max_steps=10**6, checkpoint_backend="npz", plugins=[TakeOver()], **QUIET)
    assert time.monotonic() - t0 < 30
    lease = json.loads(storage.read_bytes(f"{url}/{LEASE_NAME}"))
    assert lease["token"] == "theirs"  # left to its holder


# waits for an unknown holder's lease on a URL the test and the process share
WAIT = textwrap.dedent("""
    import sys, jax.numpy as jnp, loopkit
    loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), logdir=sys.argv[1],
                  max_steps=2, checkpoint_backend="npz", progress=False, autoload=False)
""")


def test_the_wait_for_an_unknown_holder_ends_at_sigterm(tmp_path):
    """A young lease of another host's run is waited for (2 minutes at the default
    settings); a SIGTERM ends that wait within a second or two, cleanly: the lease stays
    its holder's and nothing is written."""
    url = f"local://{tmp_path}/run"
    _lease(url)
    before = storage.read_bytes(f"{url}/{LEASE_NAME}")
    env = {k: v for k, v in os.environ.items() if k != RENEW_ENV and k not in JOB_ENVS}
    proc = subprocess.Popen([sys.executable, "-c", WAIT, url], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stderr:
            if "waiting up to" in line:
                assert "process 4242 on host 'elsewhere', renewed" in line
                break
        else:
            pytest.fail(f"it did not wait: exit {proc.wait()}")
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert time.monotonic() - t0 < 10
    assert proc.returncode == 1
    assert "LogdirInUseError: stopped by a stop signal (SIGTERM or SIGINT) while waiting for " \
           "the lease" in err, err[-3000:]
    assert "this run wrote nothing there" in err
    assert storage.read_bytes(f"{url}/{LEASE_NAME}") == before
    assert sorted(os.listdir(tmp_path / "run")) == [LEASE_NAME]
