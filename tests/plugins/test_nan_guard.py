"""The nan_guard built-in: a non-finite metric fails the run, one step later at most."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import loopkit
from loopkit.testing import HookRecorder

FAST = dict(progress=False, disable=("checkpoint",))


def bad_at(k: int, value: float = float("nan")):
    """A step whose loss is `value` at global step `k` and finite elsewhere."""
    def step_fn(s):
        new = s + 1
        return new, {"loss": jnp.where(new == k, value, 1.0 / new), "acc": new * 0.0}
    return step_fn


def test_nan_fails_the_run_naming_metric_and_step():
    rec = HookRecorder()
    with pytest.raises(loopkit.NonFiniteError) as info:
        loopkit.train(bad_at(7), init=jnp.zeros(()), max_steps=20, nan_guard="loss",
                      plugins=[rec], **FAST)
    err = info.value
    assert (err.metric, err.step) == ("loss", 7)
    assert err.value != err.value  # NaN
    assert "'loss'" in str(err) and "step 7" in str(err)
    assert any("'nan_guard'" in note for note in err.__notes__)
    # checked after step 8 was dispatched, not by waiting on step 7
    assert [c.kwargs["step"] for c in rec.calls("after_step")][-1] == 8


def test_inf_in_an_array_metric():
    def step_fn(s):
        new = s + 1
        return new, {"per_example": jnp.array([1.0, 2.0]).at[1].set(
            jnp.where(new == 3, jnp.inf, 2.0))}

    with pytest.raises(loopkit.NonFiniteError) as info:
        loopkit.train(step_fn, init=jnp.zeros(()), max_steps=10, nan_guard="per_example",
                      **FAST)
    assert (info.value.metric, info.value.step, info.value.value) == ("per_example", 3,
                                                                     float("inf"))


def test_nan_at_the_last_step_is_caught_at_the_stop():
    with pytest.raises(loopkit.NonFiniteError) as info:
        loopkit.train(bad_at(5), init=jnp.zeros(()), max_steps=5, nan_guard="loss", **FAST)
    assert info.value.step == 5
    assert any("on_stop" in note and "nan_guard" in note for note in info.value.__notes__)


def test_finite_run_passes():
    r = loopkit.train(bad_at(99), init=jnp.zeros(()), max_steps=10, nan_guard="loss", **FAST)
    assert r.step == 10 and r.stop_reason == "max_steps"


def test_unknown_metric_names_the_field_and_the_metrics():
    with pytest.raises(ValueError) as info:
        loopkit.train(bad_at(99), init=jnp.zeros(()), max_steps=3, nan_guard="los", **FAST)
    msg = str(info.value)
    assert "Config.nan_guard='los'" in msg and "['acc', 'loss']" in msg


def test_non_numeric_metric_is_a_clear_error():
    step_fn = lambda s: (s + 1, {"phase": "warmup"})
    with pytest.raises(TypeError, match=r"Config.nan_guard='phase'.*not a number"):
        loopkit.train(step_fn, init=jnp.zeros(()), max_steps=3, nan_guard="phase", jit=False,
                      **FAST)


def test_supervisor_idiom():
    sv = loopkit.Supervisor(nan_guard="loss", **FAST)
    with pytest.raises(loopkit.NonFiniteError) as info:
        with sv.managed_session(bad_at(2, float("-inf")), init=jnp.zeros(())) as sess:
            for _ in range(5):
                sess.run()
    assert info.value.step == 2


def test_nan_at_the_last_step_saves_no_final_checkpoint_and_no_summary(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with pytest.raises(loopkit.NonFiniteError):
        loopkit.train(bad_at(5), init=jnp.zeros(()), max_steps=5, nan_guard="loss",
                      logdir=str(tmp_path), checkpoint_backend="npz", save_model_steps=2,
                      save_model_secs=None, save_summaries_steps=2, progress=False)
    # the stop turned into a failed one: the NaN state is not the one a restart recovers
    assert loopkit.latest_checkpoint(tmp_path)[0] == 4
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [2, 4]
