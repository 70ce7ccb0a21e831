from __future__ import annotations

import numpy as np
import pytest

import loopkit
from loopkit import Config


def test_defaults_are_the_supervisors():
    c = Config()
    assert c.save_model_secs == 600
    assert c.save_summaries_secs == 120
    assert c.recovery_wait_secs == 30
    assert c.stop_grace_secs == 120
    assert c.checkpoint_basename == "model.ckpt"
    assert c.max_to_keep == 5
    assert c.checkpoint_backend == "orbax"
    assert (c.prefetch, c.prefetch_threads) == (2, 1)
    assert c.jit and c.donate and c.progress


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("save_model_secs", -1, 'a number of seconds >= 0, None, or "auto"'),
        ("save_model_secs", "10", 'a number of seconds >= 0, None, or "auto"'),
        ("save_model_secs", True, 'a number of seconds >= 0, None, or "auto"'),
        ("save_model_steps", 2.5, "an int >= 0 or None"),
        ("save_summaries_steps", -3, "an int >= 0 or None"),
        ("max_steps", -1, "an int >= 0 or None"),
        ("max_to_keep", -1, "an int >= 0 or None"),
        ("prefetch", -1, "an int >= 0"),
        ("prefetch_threads", 0, "an int >= 1"),
        ("stop_grace_secs", None, "a number of seconds >= 0"),
        ("is_chief", "yes", "True, False or None"),
        ("jit", 1, "True or False"),
        ("checkpoint_basename", "a/b", "a non-empty file name without a directory separator"),
        ("checkpoint_backend", 3, "a backend name"),
        ("keep_checkpoint_every_n_hours", 0, "a number of hours > 0 or None"),
        ("init_fn", "not callable", "a callable or None"),
        ("nan_guard", "", "a metric name (str) or None"),
        ("profile_steps", (5, 2), "None or (first, last)"),
        ("profile_steps", (0, 2), "None or (first, last)"),
        ("disable", "progress", "a tuple of plugin names"),
        ("data_sharding", "cpu", "a jax.sharding.Sharding or None"),
        ("logdir", "", "a non-empty path"),
        ("summary_metrics", ("loss", 3), "a non-empty tuple of fnmatch patterns"),
        ("summary_metrics", ("acc[",), "balanced [ ]"),
        ("summary_metrics", ("",), "a non-empty tuple of fnmatch patterns"),
        ("summary_metrics", (), "a non-empty tuple of fnmatch patterns"),
        ("summary_reduce", "average", '"last" or "mean"'),
        ("summary_reduce", None, '"last" or "mean"'),
        ("hparams", [("lr", 0.1)], "a dict of name (str) -> bool, int, float or str"),
        ("hparams", {"layers": [64, 64]}, "'layers' is list [64, 64]"),
        ("hparams", {"lr": None}, "'lr' is NoneType None"),
        ("hparams", {3: 0.1}, "got the name 3"),
        ("progress_secs", 0, "a number of seconds > 0"),
        ("progress_secs", None, "a number of seconds > 0"),
        ("profile_every_secs", 0, "a number of seconds > 0 or None"),
        ("profile_min_secs", -1, "a number of seconds >= 0"),
        ("profile_min_steps", 0, "an int >= 1"),
    ],
)
def test_bad_value_names_field_value_and_what_is_allowed(field, value, allowed):
    with pytest.raises(ValueError) as info:
        Config(**{field: value})
    msg = str(info.value)
    assert f"Config.{field}={value!r}" in msg
    assert allowed in msg


def test_secs_take_int_or_float_and_zero_or_none_disable():
    assert Config(save_model_secs=1.5).save_model_secs == 1.5
    assert Config(save_model_secs=0, save_model_steps=None).save_model_secs == 0
    assert Config(save_summaries_secs=None).save_summaries_secs is None


def test_numpy_scalars_are_the_numbers_they_hold():
    # max_steps = epochs * np.int64(steps_per_epoch) was refused as "expected an int"
    c = Config(max_steps=np.int64(3) * 100, save_model_secs=np.float32(30.0),
               save_model_steps=np.int32(50), progress=np.bool_(False))
    assert (c.max_steps, c.save_model_secs, c.save_model_steps, c.progress) == (300, 30.0, 50, False)
    assert [type(v) for v in (c.max_steps, c.save_model_secs, c.progress)] == [int, float, bool]
    with pytest.raises(ValueError, match=r"Config\.max_steps=-1 is not allowed"):
        Config(max_steps=np.int64(-1))  # still checked, and shown as the number
    with pytest.raises(ValueError, match=r"Config\.save_model_steps=2\.5 is not allowed"):
        Config(save_model_steps=np.float64(2.5))


def test_summary_metrics_take_one_pattern_or_a_list():
    assert Config(summary_metrics="loss").summary_metrics == ("loss",)
    assert Config(summary_metrics=["loss", "acc*"]).summary_metrics == ("loss", "acc*")
    c = Config()
    assert (c.summary_metrics, c.summary_reduce, c.hparams, c.progress_secs) == (
        None, "last", None, 10)
    assert Config(hparams={"lr": 0.1, "opt": "adam", "layers": 2, "ema": True}).hparams


def test_disable_list_becomes_tuple():
    assert Config(disable=["progress"]).disable == ("progress",)


def test_unknown_keyword_to_train_is_a_type_error():
    with pytest.raises(TypeError, match="save_model_sec"):
        loopkit.train(lambda s: (s, {}), init=0.0, save_model_sec=3)


def test_config_and_keywords_combine_and_validate():
    base = Config(max_steps=3)
    sv = loopkit.Supervisor(base, progress=False)
    assert sv.config.max_steps == 3 and sv.config.progress is False
    with pytest.raises(ValueError, match="Config.max_steps=-2"):
        loopkit.Supervisor(base, max_steps=-2)


@pytest.mark.parametrize("fields, message", [
    (dict(nan_guard="loss", spike_threshold=1), "Config.spike_threshold=1 .* a number > 1 or None"),
    (dict(nan_guard="loss", spike_threshold="3"), "Config.spike_threshold='3'"),
    (dict(nan_guard="loss", spike_window=1), "Config.spike_window=1 .* an int >= 2"),
    (dict(nan_guard="loss", on_guard="skip"), "Config.on_guard='skip' .* \"raise\" or \"rollback\""),
    # an array is refused with the field's message, not numpy's "truth value is ambiguous"
    (dict(nan_guard="loss", on_guard=np.array(["raise", "x"])), r"Config.on_guard=array\(.* \"raise\" or"),
    (dict(summary_reduce=np.array(["last"])), r"Config.summary_reduce=array\(.* \"last\" or \"mean\""),
    (dict(nan_guard="loss", max_rollbacks=-1), "Config.max_rollbacks=-1 .* an int >= 0"),
    (dict(spike_threshold=10), "Config.spike_threshold=10 needs Config.nan_guard"),
    (dict(on_guard="rollback"), "Config.on_guard='rollback' needs Config.nan_guard"),
])
def test_guard_fields_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        Config(**fields)


def test_guard_defaults():
    c = Config(nan_guard="loss", spike_threshold=10.0, on_guard="rollback")
    assert (Config().spike_threshold, Config().spike_window, Config().on_guard,
            Config().max_rollbacks) == (None, 100, "raise", 3)
    assert (c.spike_threshold, c.on_guard) == (10.0, "rollback")
