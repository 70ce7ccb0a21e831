"""The compiled step: frozen leaves are never copied, a replaced state is taken up."""

from __future__ import annotations

import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopkit

QUIET = dict(progress=False, disable=("summaries",), save_model_secs=None, autoload=False)


def fine_tune(s):
    return {"frozen": s["frozen"], "head": s["head"] + s["frozen"][:4].sum()}, {}


def test_leaves_the_step_returns_unchanged_are_never_copied_even_across_saves(tmp_path):
    init = {"frozen": jnp.arange(1000.0), "head": jnp.zeros(3)}
    result = loopkit.train(fine_tune, init=init, logdir=tmp_path, checkpoint_backend="npz",
                           save_model_steps=1, max_steps=5, **QUIET)
    assert result.state["frozen"] is init["frozen"]  # the caller's array, as it was
    np.testing.assert_array_equal(result.state["head"], np.full(3, 5 * 6.0))
    saved = loopkit.load_checkpoint(str(tmp_path / "model.ckpt-3"))
    np.testing.assert_array_equal(saved["head"], np.full(3, 3 * 6.0))
    assert not init["head"].is_deleted()


def test_a_state_replaced_between_steps_is_the_one_the_next_step_takes():
    sv = loopkit.Supervisor(**QUIET)
    with sv.managed_session(fine_tune, init={"frozen": jnp.ones(8), "head": jnp.zeros(3)}) as sess:
        sess.run()
        sess.state = {"frozen": jnp.full(8, 2.0), "head": jnp.zeros(3)}
        sess.run()
        sess.run()
        np.testing.assert_array_equal(sess.state["head"], np.full(3, 16.0))
        assert sess.step == 3


def updating(s):
    return {"w": s["w"] * 0.5 + 1.0, "n": s["n"] + 1}, {}


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="off CPU a save copies the leaves the next step rewrites to host memory")
def test_a_stop_does_not_wait_for_the_save_variants_compile(tmp_path, monkeypatch):
    """The save variant compiles in the background from the first save on. A stop that
    comes while it compiles (a SIGTERM right after the first save, on a cloud's
    30-second notice) does not wait for it: the final checkpoint is committed, the run
    status written and `train` returns while the compile is held here."""
    import json

    status = tmp_path / "status.json"
    monkeypatch.setenv("LOOPKIT_RUN_STATUS", str(status))
    gate = threading.Event()
    compile_ = jax.stages.Lowered.compile

    def held(self, *args, **kwargs):
        if threading.current_thread().name == "loopkit-compile-save-variant":
            gate.wait(120)
        return compile_(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", held)
    try:
        r = loopkit.train(updating, init={"w": jnp.zeros((64, 64)), "n": jnp.int32(0)},
                          logdir=str(tmp_path / "run"), save_model_steps=2,
                          save_model_secs=None, max_steps=5, progress=False,
                          disable=("summaries",))
        compiling = [t for t in threading.enumerate()
                     if t.name == "loopkit-compile-save-variant"]
        assert compiling and not gate.is_set(), "train waited for the compile"
    finally:
        gate.set()
    assert (r.stop_reason, r.step) == ("max_steps", 5)
    assert loopkit.latest_checkpoint(tmp_path / "run")[0] == 5
    assert json.loads(status.read_text())["stop_reason"] == "max_steps"
    compiling[0].join(60)
    assert not compiling[0].is_alive()


def test_on_cpu_a_save_reads_the_buffers_themselves_and_later_steps_reuse_them(tmp_path):
    """The step after a save writes into the buffers of an earlier, finished save.

    Each step's array is kept here (a reference does not stop donation). Saves never
    see a buffer overwritten (every checkpoint holds its own step's values), and the
    buffers of finished saves are donated again rather than left for fresh ones.
    """
    init = {"w": jnp.zeros((256, 256)), "n": jnp.int32(0)}
    sv = loopkit.Supervisor(logdir=str(tmp_path), save_model_steps=1, max_to_keep=None,
                            progress=False, disable=("summaries",), save_model_secs=None,
                            autoload=False)
    steps, arrays, kept = 30, [], 0
    with sv.managed_session(updating, init=init) as sess:
        sess.run()
        arrays.append(sess.state["w"])
        # the first save compiles the save variant in the background: wait for it,
        # so that every later save can use a spare
        for thread in threading.enumerate():
            if thread.name == "loopkit-compile-save-variant":
                thread.join()
        for _ in range(steps - 1):
            sess.run()
            # the step after a save left the saved buffer alone (unless that save's
            # commit had already finished, which it rarely has this soon)
            kept += not arrays[-1].is_deleted()
            arrays.append(sess.state["w"])
    want = np.zeros((256, 256), np.float32)
    for step in range(1, steps + 1):
        want = want * 0.5 + 1.0
        saved = loopkit.load_checkpoint(str(tmp_path / f"model.ckpt-{step}"))
        np.testing.assert_array_equal(saved["w"], want, err_msg=f"step {step}")
        assert int(saved["n"]) == step
    assert kept >= steps // 2, kept
    reused = [step for step, a in enumerate(arrays[:-2], 1) if a.is_deleted()]
    assert reused, "no saved buffer was ever written into again"
    assert not init["w"].is_deleted()


@pytest.mark.parametrize("backend", ["orbax", "npz"])
def test_a_saving_pre_jitted_step_compiles_nothing_per_leaf(tmp_path, caplog, backend):
    # 40 leaves of 40 distinct shapes: a per-shape copy at the first save would compile
    # 40 times; the step itself compiles once
    init = jax.device_put({f"w{i}": np.zeros((i + 1, 3), np.float32) for i in range(40)})
    step = jax.jit(lambda s: (jax.tree.map(lambda x: x + 1, s), {}), donate_argnums=0)
    with caplog.at_level(logging.WARNING), jax.log_compiles():
        r = loopkit.train(step, init=init, max_steps=6, save_model_steps=2,
                          save_model_secs=None, logdir=tmp_path, checkpoint_backend=backend,
                          progress=False, autoload=False)
    compiles = [rec.getMessage() for rec in caplog.records
                if rec.getMessage().startswith("Compiling")]
    assert r.step == 6 and float(r.state["w39"][0, 0]) == 6.0
    assert 1 <= len(compiles) <= 2, compiles  # the step, seen; nothing per leaf
