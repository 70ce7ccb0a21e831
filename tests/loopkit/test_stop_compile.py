"""A stop, and the process's exit, never wait for the CPU save variant's background
compile, nor abort inside it: real processes, real XLA compiles under way at the exit.

The compile thread here is kept inside XLA for as long as the test needs (it compiles
the save variant, then one fresh program after another), so a process that waited for
it would never exit, and one that ended it wrongly would abort (status -6)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

import loopkit

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="the save variant exists on CPU only")
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
ENV.pop("LOOPKIT_RUN_STATUS", None)
ENV.pop("LOOPKIT_RUN_ID", None)

# A program that keeps a background thread inside XLA: the 500-layer step's
# compile (`deep`), then fresh compiles of it for ever (a new constant each time).
DEEP = textwrap.dedent(
    """
    import os, sys, threading, time
    import jax, jax.numpy as jnp

    LAYERS, WIDTH = 500, 16

    def deep(ws, c=0.0):
        def loss(ws):
            h = jnp.ones((4, WIDTH)) + c
            for w in ws:
                h = jnp.tanh(h @ w) + h
            return jnp.mean(h ** 2)
        return jax.grad(loss)(ws)

    in_xla = threading.Event()

    def compile_for_ever():
        ws = [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)] * LAYERS
        i = 0
        while True:
            i += 1
            lowered = jax.jit(deep, static_argnums=1).lower(ws, float(i))
            in_xla.set()
            lowered.compile()
            print("A COMPILE ENDED", flush=True)
    """
)

TRAIN = DEEP + textwrap.dedent(
    """
    import signal
    import numpy as np
    import loopkit

    compile_ = jax.stages.Lowered.compile

    def held(self, *args, **kwargs):
        out = compile_(self, *args, **kwargs)
        if threading.current_thread().name == "loopkit-compile-save-variant":
            compile_for_ever()
        return out

    jax.stages.Lowered.compile = held

    class Stop:
        @loopkit.hookimpl
        def after_step(self, step):
            if step == 3:  # the save at step 2 started the variant's compile
                busy = [t.name for t in threading.enumerate()]
                print("COMPILING", "loopkit-compile-save-variant" in busy, flush=True)
                if sys.argv[2] == "self":
                    os.kill(os.getpid(), signal.SIGTERM)

    def init():
        return {"w": [jnp.full((WIDTH, WIDTH), 0.01) for _ in range(LAYERS)],
                "n": jnp.int32(0)}

    def step(s):
        grads = deep(s["w"])
        return {"w": [w - 1e-4 * g for w, g in zip(s["w"], grads)], "n": s["n"] + 1}, {}

    r = loopkit.train(step, init=init, logdir=sys.argv[1], save_model_steps=2,
                      save_model_secs=None, max_steps=10**6, progress=False,
                      disable=("summaries",), plugins=[Stop()])
    total = sum(float(np.sum(np.asarray(w, np.float64))) for w in r.state["w"])
    print("RETURNED", r.stop_reason, r.step, time.time(), repr(total), flush=True)
    """
)


def _as_runner_child(tmp_path) -> dict[str, str]:
    """The environment `loopkit run` gives its child (its status file): only there does
    loopkit take over the interpreter's exit (the last test shows a script by itself)."""
    return {**ENV, "LOOPKIT_RUN_STATUS": str(tmp_path / "status.json")}


def _lines(out: str, head: str) -> list[list[str]]:
    return [line.split()[1:] for line in out.splitlines() if line.startswith(head)]


def test_a_sigterm_while_the_save_variant_compiles_exits_after_the_final_save(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run"), "self"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_as_runner_child(tmp_path))
    out, err = proc.communicate(timeout=300)  # waiting for the compile: never
    ended = time.time()
    assert proc.returncode == 0, err[-3000:]
    assert _lines(out, "COMPILING") == [["True"]], out
    (reason, step, returned, total), = _lines(out, "RETURNED")
    assert (reason, step) == ("signal", "3")
    # the exit after `train` returned: the atexit functions and a flush, not a compile
    # (generous for a loaded machine; benchmarks/stop.py measures it)
    assert ended - float(returned) < 30, ended - float(returned)
    assert loopkit.latest_checkpoint(tmp_path / "run")[0] == 3
    saved = loopkit.load_checkpoint(str(tmp_path / "run" / "model.ckpt-3"))
    layers = jax.tree.leaves(saved["w"])
    assert int(saved["n"]) == 3 and len(layers) == 500
    # the state `train` returned, every leaf of it
    np.testing.assert_allclose(sum(float(np.sum(np.asarray(w, np.float64))) for w in layers),
                               float(total), rtol=1e-12)


def test_loopkit_run_stops_its_child_while_the_save_variant_compiles(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    proc = subprocess.Popen(
        [sys.executable, "-m", "loopkit", "run", "--backoff-secs", "0", "--",
         sys.executable, str(script), str(tmp_path / "run"), "runner"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
        start_new_session=True)
    try:
        line = ""
        while not line.startswith("COMPILING"):
            line = proc.stdout.readline()
            assert line, proc.stderr.read()[-3000:]
        assert line.split() == ["COMPILING", "True"]
        os.killpg(proc.pid, signal.SIGTERM)  # a preemption's notice to the whole job
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert proc.returncode == 0, err[-3000:]
    (reason, step, *_), = _lines(out, "RETURNED")  # one child: no restart after a stop
    assert reason == "signal"
    assert loopkit.latest_checkpoint(tmp_path / "run")[0] == int(step)  # the final save


EXITS = DEEP + textwrap.dedent(
    """
    from loopkit.process.background_compile import compile_in_background

    mode = sys.argv[1]
    kept = open(sys.argv[2], "w")  # never closed: the exit flushes it, as Python's does
    kept.write("kept")
    if mode == "waits":  # one compile: the exit waits for it
        ws = [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)] * LAYERS
        lowered = jax.jit(deep).lower(ws)
        in_xla.set()
        compile_in_background(lambda: (lowered.compile(), print("A COMPILE ENDED", flush=True)),
                              "loopkit-test-compile")
    else:
        compile_in_background(compile_for_ever, "loopkit-test-compile")
    in_xla.wait(120)
    time.sleep(0.3)  # inside XLA by now
    print("ENDING", end="")  # not flushed
    if mode == "raises":
        raise RuntimeError("after train")
    if mode == "exit3":
        sys.exit(3)
    if mode == "exit-message":
        sys.exit("a message for the user")
    if mode == "interrupt":
        raise KeyboardInterrupt
    if mode == "waits":
        raise SystemExit(4)
    """
)


@pytest.mark.parametrize("mode, status, stderr", [
    ("returns", 0, None),
    ("raises", 1, "RuntimeError: after train"),
    ("exit3", 3, None),
    ("exit-message", 1, "a message for the user"),
    ("interrupt", -signal.SIGINT, "KeyboardInterrupt"),
    ("waits", 4, None),  # `raise SystemExit` itself: its status is known only to Python
])
def test_the_exit_keeps_pythons_status_while_a_compile_runs(tmp_path, mode, status, stderr):
    script = tmp_path / "exits.py"
    script.write_text(EXITS)
    r = subprocess.run([sys.executable, str(script), mode, str(tmp_path / "kept")],
                       capture_output=True, text=True, env=_as_runner_child(tmp_path),
                       timeout=300, check=False)
    assert r.returncode == status, r.stderr[-3000:]
    assert r.stdout.startswith("ENDING"), r.stdout  # flushed
    assert (tmp_path / "kept").read_text() == "kept"
    if stderr is not None:
        assert stderr in r.stderr
        assert r.stderr.count("Traceback") == (mode in ("raises", "interrupt"))
    # the exit waited for the compile only where the status was not known
    assert ("A COMPILE ENDED" in r.stdout) == (mode == "waits"), r.stdout


def test_a_second_train_in_the_process_runs_beside_the_first_ones_compile(tmp_path,
                                                                          monkeypatch):
    """`train` returns while its save variant still compiles (held here until the end),
    and a second `train` in the same process is not held by it."""
    import threading

    import jax.numpy as jnp

    gate = threading.Event()
    compile_ = jax.stages.Lowered.compile

    def held(self, *args, **kwargs):
        if threading.current_thread().name == "loopkit-compile-save-variant":
            gate.wait(120)
        return compile_(self, *args, **kwargs)

    def updating(s):
        return {"w": s["w"] * 0.5 + 1.0, "n": s["n"] + 1}, {}

    monkeypatch.setattr(jax.stages.Lowered, "compile", held)
    try:
        results = [loopkit.train(updating, init={"w": jnp.zeros((64, 64)), "n": jnp.int32(0)},
                                 logdir=str(tmp_path / name), save_model_steps=2,
                                 save_model_secs=None, max_steps=6, progress=False,
                                 disable=("summaries",))
                   for name in ("first", "second")]
        held_now = [t for t in threading.enumerate() if t.name == "loopkit-compile-save-variant"]
        assert len(held_now) == 2  # neither train waited for its variant's compile
    finally:
        gate.set()
    for name, r in zip(("first", "second"), results):
        assert (r.stop_reason, r.step) == ("max_steps", 6)
        saved = loopkit.load_checkpoint(str(tmp_path / name / "model.ckpt-6"))
        assert int(saved["n"]) == 6
        np.testing.assert_allclose(saved["w"], np.full((64, 64), 2 - 2 ** -5))
    for t in held_now:
        t.join(60)
    assert not any(t.is_alive() for t in held_now)


def test_a_script_run_by_itself_keeps_pythons_exit(monkeypatch):
    """Outside `loopkit run` the interpreter's exit is left as it is (a process-wide
    change the user did not ask for): the compile thread is not a daemon, and neither
    `sys.exit` nor threading's shutdown is replaced."""
    import threading

    from loopkit.process.background_compile import compile_in_background

    monkeypatch.delenv("LOOPKIT_RUN_STATUS", raising=False)
    exit_, shutdown = sys.exit, threading._shutdown
    gate = threading.Event()
    thread = compile_in_background(lambda: gate.wait(60), name="held")
    try:
        assert not thread.daemon
        assert sys.exit is exit_ and threading._shutdown is shutdown
    finally:
        gate.set()
        thread.join(60)
