"""The compiled step: frozen leaves are never copied, a replaced state is taken up."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

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
