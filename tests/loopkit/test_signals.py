"""SIGTERM/SIGINT to a real training subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import signal, sys, time
    import jax.numpy as jnp
    import loopkit

    class Report:
        @loopkit.hookimpl
        def after_step(self, step):
            if step == 1:  # a step has run: the stop comes after a real step
                print("READY", flush=True)

        @loopkit.hookimpl
        def on_stop(self, session, error):
            print("ON_STOP", session.step, repr(error), flush=True)

    def step(s):
        time.sleep(0.01)
        return s + 1, {}

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    r = loopkit.train(step, init=jnp.zeros(()), jit=False, plugins=[Report()],
                      progress=False, checkpoint_backend=None)
    after = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    print("RESULT", r.stop_reason, r.step, int(r.state), flush=True)
    print("HANDLERS_RESTORED", before == after, flush=True)
    """
)


def _start(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    assert line.strip() == "READY", line + proc.stderr.read()
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_stops_cleanly(tmp_path, sig):
    proc = _start(tmp_path)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    on_stop = [l for l in lines if l.startswith("ON_STOP")]
    assert len(on_stop) == 1 and on_stop[0].endswith("None"), out
    result = [l for l in lines if l.startswith("RESULT")][0].split()
    assert result[1] == "signal" and int(result[2]) > 0 and result[2] == result[3]
    assert "HANDLERS_RESTORED True" in out
    assert f"got {signal.Signals(sig).name}" in err


def test_second_sigint_aborts(tmp_path):
    script = tmp_path / "train.py"
    # on_stop blocks, so the second Ctrl-C arrives while stopping... use a slow step instead
    script.write_text(SCRIPT.replace("time.sleep(0.01)", "time.sleep(0.5)"))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "READY"
    proc.send_signal(signal.SIGINT)
    # the second Ctrl-C only once the first was handled: two signals delivered before
    # the handler runs would coalesce into one
    seen = []
    while not any("got SIGINT" in line for line in seen):
        line = proc.stderr.readline()
        assert line, "".join(seen)
        seen.append(line)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    err = "".join(seen) + err
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in err
    assert "ON_STOP" in out and "KeyboardInterrupt" in out  # on_stop saw the abort
    assert "RESULT" not in out


def test_handlers_only_installed_in_the_main_thread():
    import threading

    import jax.numpy as jnp

    import loopkit

    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def run():
        r = loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), max_steps=3,
                          progress=False, checkpoint_backend=None)
        seen.append((r.step, signal.getsignal(signal.SIGTERM)))

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert seen == [(3, before)]


def test_a_signal_while_the_stop_lock_is_held_stops_without_a_deadlock():
    # The handler interrupts the main thread wherever it is: inside `request_stop`
    # (the close, the max-steps callback) it holds the coordinator's lock. A handler
    # that took that lock again would wait forever; a subprocess bounds the wait.
    script = textwrap.dedent(
        """
        import signal
        from loopkit.loop.coordinator import Coordinator, SignalHandlers

        coord = Coordinator()
        handlers = SignalHandlers(coord)
        handlers.install()
        with coord._lock:  # held, as by request_stop in the interrupted thread
            signal.raise_signal(signal.SIGTERM)
            print("HANDLED", coord.stopped, coord.reason, coord.wait_for_stop(0), flush=True)
        coord.request_stop(reason="max_steps")  # a later stop keeps the signal's reason
        handlers.restore()
        print("STOPPED", coord.reason, flush=True)
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["HANDLED True signal True", "STOPPED signal"]
    assert "got SIGTERM, stopping after the current step" in r.stderr


def test_sigterm_at_random_moments_of_a_session_always_stops_cleanly(tmp_path):
    # 20 sessions in one process (one JAX start-up, not 20: each session takes well
    # under a second, a process start several on this machine); each trial's moment
    # is drawn from its own twentieth of a session's length, so start-up (lock,
    # restore, compile), steps, saves, the close and the time after the return are
    # all hit. Seeded from the clock, printed for a rerun.
    import json
    import time

    seed = int(time.time())
    worker = os.path.join(os.path.dirname(__file__), "..", "workers", "sigterm_trials.py")
    r = subprocess.run([sys.executable, worker, str(tmp_path / "run"), "20", str(seed)],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, f"seed {seed}\n{r.stderr[-3000:]}"
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    trials, end = lines[:-1], lines[-1]
    assert len(trials) == 20, r.stdout
    for t in trials:
        assert t["checkpoint"] == t["step"] == t["n"], (seed, t)  # the final save, whole
        if t["phase"] in ("before", "after"):  # outside the session: a normal run
            assert t["reason"] == "max_steps" and t["step"] == t["target"], (seed, t)
            continue
        # stopped by the signal; or, once max_steps had stopped it, by max_steps
        assert t["reason"] == "signal" or (t["reason"] == "max_steps"
                                           and t["step"] == t["target"]), (seed, t)
        assert t["secs_to_end"] < 30, (seed, t)  # well within a scheduler's grace
    # every stop saved exactly the state it stopped at: the resumed trials end where a
    # straight run ends
    assert end["final"] == end["straight"], seed
    print("phases:", sorted(t["phase"] for t in trials))
