"""The mistakes users make get an error that says what to do, at the first step."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopkit

QUIET = dict(progress=False, autoload=False)
# loopkit's jit, no jit, and a step the user jitted: every path answers the same way
PATHS = [
    pytest.param(lambda f: (f, {}), id="loopkit-jit"),
    pytest.param(lambda f: (f, {"jit": False}), id="no-jit"),
    pytest.param(lambda f: (jax.jit(f), {}), id="user-jit"),
]


@pytest.mark.parametrize("path", PATHS)
def test_a_step_returning_the_state_alone_says_what_to_return(path):
    step, kw = path(lambda s: {"w": s["w"] + 1})
    with pytest.raises(TypeError, match=r"must return a pair \(state, metrics\).*"
                                        r"it returned dict .*looks like the state alone"):
        loopkit.train(step, init={"w": jnp.zeros(3)}, max_steps=2, **kw, **QUIET)


@pytest.mark.parametrize("path", PATHS)
def test_a_step_returning_three_things_names_them(path):
    step, kw = path(lambda s: (s + 1, {}, s))
    with pytest.raises(TypeError, match=r"must return a pair.*it returned a tuple of 3 "
                                        r"elements \(float32\[3\]"):
        loopkit.train(step, init=jnp.zeros(3), max_steps=2, **kw, **QUIET)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("metrics,shown", [
    (lambda s: jnp.sum(s), r"float32\[\]"),
    (lambda s: [jnp.sum(s)], r"list"),
])
def test_metrics_that_are_not_a_mapping_say_so(path, metrics, shown):
    step, kw = path(lambda s: (s + 1, metrics(s)))
    with pytest.raises(TypeError, match=r"metrics \(the second element it returns\) must be "
                                        r"a mapping of metric names to scalars.*" + shown):
        loopkit.train(step, init=jnp.zeros(3), max_steps=2, **kw, **QUIET)


def test_a_metric_that_is_not_an_array_is_named():
    with pytest.raises(TypeError, match=r"metric 'loss' must be a scalar.*dict"):
        loopkit.train(lambda s: (s + 1, {"loss": {"a": jnp.sum(s)}}), init=jnp.zeros(3),
                      max_steps=2, **QUIET)


def test_a_data_generator_function_without_start_step_says_how_it_is_called(tmp_path):
    def batches():  # the usual slip: a generator function of no argument
        while True:
            yield np.ones(3, np.float32)

    with pytest.raises(TypeError, match=r"data=batches is called as data\(start_step\).*"
                                        r"takes no such argument.*pass data=batches\(\)"):
        loopkit.train(lambda s, b: (s + b, {}), init=jnp.zeros(3), data=batches,
                      max_steps=2, **QUIET)

    # a callable that does take the step, however spelt, still trains, and resumes
    kw = dict(init=jnp.zeros(3), logdir=str(tmp_path), checkpoint_backend="npz",
              save_model_secs=None, **QUIET)
    data = lambda start_step=0, *rest: (np.full(3, i, np.float32) for i in range(start_step, 99))
    loopkit.train(lambda s, b: (s + b, {}), data=data, max_steps=2, **kw)
    again = loopkit.train(lambda s, b: (s + b, {}), data=data, max_steps=4, **kw)
    np.testing.assert_array_equal(again.state, np.full(3, 0.0 + 1 + 2 + 3))


@pytest.mark.parametrize("path", PATHS)
def test_a_step_that_adds_a_key_is_refused_after_the_first_step(path):
    calls = []

    def data():
        for i in range(10):
            calls.append(i)
            yield jnp.float32(i)

    step, kw = path(lambda s, b: ({**s, "extra": s["w"] * b}, {}))
    with pytest.raises(TypeError, match=r"structure differs from its input at '<root>'.*"
                                        r"'extra'.*build every entry in init"):
        loopkit.train(step, init={"w": jnp.ones(3)}, data=data(), max_steps=5, prefetch=0,
                      **kw, **QUIET)
    assert len(calls) == 1  # refused at the first step, not later


@pytest.mark.parametrize("path", PATHS)
def test_a_step_that_changes_a_dtype_names_the_leaf_and_both_types(path):
    step, kw = path(lambda s: ({"w": s["w"].astype(jnp.int32), "b": s["b"]}, {}))
    with pytest.raises(TypeError, match=r"changed state leaf 'w' from float32\[3\] to "
                                        r"int32\[3\].*astype\(jnp.float32\)"):
        loopkit.train(step, init={"w": jnp.ones(3), "b": jnp.zeros(())}, max_steps=2,
                      **kw, **QUIET)


def test_a_step_that_changes_a_shape_is_named():
    with pytest.raises(TypeError, match=r"changed state leaf 'params/0' from float32\[3\] "
                                        r"to float32\[6\]"):
        loopkit.train(lambda s: ({"params": [jnp.concatenate([s["params"][0]] * 2)]}, {}),
                      init={"params": [jnp.ones(3)]}, max_steps=2, **QUIET)


def test_a_weak_leaf_that_the_step_makes_strong_trains():
    # one more compile, once; the checkpoint holds the strong leaf: not a mistake
    r = loopkit.train(lambda s: ({"lr": s["lr"] * jnp.float32(0.5)}, {}), init={"lr": 0.1},
                      max_steps=3, **QUIET)
    assert float(r.state["lr"]) == pytest.approx(0.0125)


def test_a_well_formed_step_with_python_scalars_and_keys_trains():
    def step(s):
        key, sub = jax.random.split(s["key"])
        return ({"key": key, "n": s["n"] + 1, "w": s["w"] + jax.random.normal(sub, (2,))},
                {"n": s["n"]})

    r = loopkit.train(step, init={"key": jax.random.key(0), "n": 0, "w": jnp.zeros(2)},
                      max_steps=3, **QUIET)
    assert int(r.state["n"]) == 3


def test_batches_whose_shapes_keep_changing_are_named_in_a_warning(caplog):
    def data():
        for i in range(1, 8):
            yield np.ones((i, 2), np.float32)

    def ragged_step(s, batch):
        return s + jnp.sum(batch), {}

    with caplog.at_level(logging.WARNING, logger="loopkit"):
        r = loopkit.train(ragged_step, init=jnp.zeros(()), data=data(), **QUIET)
    assert r.step == 7
    warned = [rec.getMessage() for rec in caplog.records if "compiled for" in rec.getMessage()]
    assert len(warned) == 1, warned  # once, not once per compile
    assert "ragged_step" in warned[0] and "4 different batch shapes" in warned[0]
    assert "float32[1,2] -> float32[4,2]" in warned[0]


def test_a_few_batch_shapes_do_not_warn(caplog):
    # a smaller last batch of an epoch is normal: two shapes, no warning
    batches = [np.ones((4, 2), np.float32)] * 5 + [np.ones((1, 2), np.float32)]
    with caplog.at_level(logging.WARNING, logger="loopkit"):
        loopkit.train(lambda s, b: (s + jnp.sum(b), {}), init=jnp.zeros(()), data=batches,
                      **QUIET)
    assert not [r for r in caplog.records if "compiled for" in r.getMessage()]


def test_an_unknown_keyword_suggests_the_closest_field():
    with pytest.raises(TypeError, match=r"unknown Config field 'save_model_sec' \(did you "
                                        r"mean 'save_model_secs'\?\)"):
        loopkit.train(lambda s: (s, {}), init=jnp.zeros(()), save_model_sec=10)
    with pytest.raises(TypeError, match=r"'max_step' \(did you mean 'max_steps'\?\), "
                                        r"'zzz'; the fields"):
        loopkit.Supervisor(max_step=3, zzz=1)
