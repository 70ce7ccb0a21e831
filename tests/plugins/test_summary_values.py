"""What reaches TensorBoard: chosen metrics, their interval mean, and hparams."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from loopkit.testing import read_events as events, scalars

FAST = dict(progress=False, disable=("checkpoint",), save_summaries_secs=None)


def lm_step(s):
    """Like lm1b's: a loss, helper sums, and an integer count."""
    n = s + 1
    return n, {"loss": n, "token_sum": 100 * n, "denominator": jnp.float32(8),
               "correct": jnp.int32(2) * n.astype(jnp.int32), "hist": jnp.stack([n, -n])}


def test_only_the_chosen_metrics_reach_the_event_file(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="loopkit")
    loopkit.train(lm_step, init=jnp.zeros(()), logdir=tmp_path, max_steps=6,
                  save_summaries_steps=3, summary_metrics=("loss", "corr*"),
                  **{**FAST, "progress": True})
    tags = events(tmp_path).Tags()
    assert sorted(t for t in tags["scalars"] if "/" not in t) == ["correct", "loss"]
    assert tags["histograms"] == []
    # the progress display shows the same choice
    stop = [r.getMessage() for r in caplog.records if "stopped at step" in r.getMessage()]
    assert "; correct=12, loss=6;" in stop[0] and "token_sum" not in stop[0]


def test_default_is_the_last_steps_values(tmp_path):
    loopkit.train(lm_step, init=jnp.zeros(()), logdir=tmp_path, max_steps=10,
                  save_summaries_steps=4, **FAST)
    acc = events(tmp_path)
    assert scalars(acc, "loss") == [(4, 4.0), (8, 8.0), (10, 10.0)]
    assert scalars(acc, "denominator") == [(4, 8.0), (8, 8.0), (10, 8.0)]


def test_mean_is_exact_over_the_interval(tmp_path):
    capture = Capture()
    loopkit.train(lm_step, init=jnp.zeros(()), logdir=tmp_path, max_steps=10,
                  save_summaries_steps=4, summary_reduce="mean", plugins=[capture], **FAST)
    acc = events(tmp_path)
    # steps 1..4, 5..8, then the stop writes 9..10
    assert scalars(acc, "loss") == [(4, 2.5), (8, 6.5), (10, 9.5)]
    assert scalars(acc, "token_sum") == [(4, 250.0), (8, 650.0), (10, 950.0)]
    assert scalars(acc, "correct") == [(4, 5.0), (8, 13.0), (10, 19.0)]  # an int's mean
    assert scalars(acc, "denominator") == [(4, 8.0), (8, 8.0), (10, 8.0)]
    # an array metric is averaged element by element
    hist = acc.Histograms("hist")
    assert [(h.step, h.histogram_value.min, h.histogram_value.max) for h in hist] == [
        (4, -2.5, 2.5), (8, -6.5, 6.5), (10, -9.5, 9.5)]
    # nothing converted the metrics to host values: the sums were fetched instead
    assert capture.session.stats.host_conversions == 0


def float_step(s):
    """Every metric a float32 scalar: the latest values ride in the carried vector."""
    n = s + 1
    return n, {"loss": n * 2.0, "acc": n * 0.5}


def test_mean_keeps_the_latest_metrics_for_the_session(tmp_path):
    seen = []

    class Look:  # a timer after the summaries' one, which has just reset the sums
        @loopkit.hookimpl
        def session_create(self, session):
            session.every(lambda s: seen.append(
                (s.step, s.host_metrics(), {k: float(v) for k, v in s.metrics.items()})),
                steps=3, name="look")

    capture = Capture()
    loopkit.train(float_step, init=jnp.zeros(()), logdir=tmp_path, max_steps=7,
                  save_summaries_steps=3, summary_reduce="mean", plugins=[Look(), capture],
                  **FAST)
    # the latest step's values, as "last" shows them
    assert seen == [(3, {"loss": 6.0, "acc": 1.5}, {"loss": 6.0, "acc": 1.5}),
                    (6, {"loss": 12.0, "acc": 3.0}, {"loss": 12.0, "acc": 3.0})]
    assert capture.session.host_metrics() == {"loss": 14.0, "acc": 3.5}
    acc = events(tmp_path)
    assert scalars(acc, "loss") == [(3, 4.0), (6, 10.0), (7, 14.0)]  # 2+4+6 / 3, ...
    assert scalars(acc, "acc") == [(3, 1.0), (6, 2.5), (7, 3.5)]


def test_mean_with_a_per_step_reader_gives_it_each_steps_metrics(tmp_path):
    got = []

    class PerStep:
        @loopkit.hookimpl
        def after_step(self, step, metrics):
            got.append((step, float(metrics["loss"])))

    loopkit.train(float_step, init=jnp.zeros(()), logdir=tmp_path, max_steps=4,
                  save_summaries_steps=2, summary_reduce="mean", plugins=[PerStep()], **FAST)
    assert got == [(1, 2.0), (2, 4.0), (3, 6.0), (4, 8.0)]
    assert scalars(events(tmp_path), "loss") == [(2, 3.0), (4, 7.0)]


def test_mean_of_the_chosen_metrics_only(tmp_path):
    loopkit.train(lm_step, init=jnp.zeros(()), logdir=tmp_path, max_steps=4,
                  save_summaries_steps=2, summary_reduce="mean", summary_metrics="loss", **FAST)
    acc = events(tmp_path)
    assert scalars(acc, "loss") == [(2, 1.5), (4, 3.5)]
    assert sorted(t for t in acc.Tags()["scalars"] if "/" not in t) == ["loss"]


def test_mean_compiles_the_step_once_and_never_again(tmp_path):
    traced = {"last": 0, "mean": 0}

    def run(reduce):
        def step(s):
            traced[reduce] += 1
            return lm_step(s)

        loopkit.train(step, init=jnp.zeros(()), logdir=tmp_path / reduce, max_steps=30,
                      save_summaries_steps=3, summary_reduce=reduce, **FAST)

    run("last")
    run("mean")
    # traced twice: once to sort the state's leaves (which also gives the sums'
    # shapes), once by jit; no retrace after a save or after each reset
    assert traced["mean"] == traced["last"] == 2


def test_mean_in_the_supervisor_idiom_and_without_jit(tmp_path):
    for jit in (True, False):
        logdir = tmp_path / str(jit)
        sv = loopkit.Supervisor(logdir=logdir, save_summaries_steps=2, summary_reduce="mean",
                                jit=jit, **FAST)
        with sv.managed_session(lambda s, x: (s + x, {"x": x}), init=jnp.zeros(())) as sess:
            for x in (1.0, 3.0, 5.0, 9.0, 4.0):
                sess.run(jnp.float32(x))
        assert scalars(events(logdir), "x") == [(2, 2.0), (4, 7.0), (5, 4.0)]


def test_mean_refuses_a_step_that_is_already_jitted(tmp_path):
    with pytest.raises(ValueError, match=r"Config.summary_reduce='mean' needs loopkit to jit"):
        loopkit.train(jax.jit(lm_step), init=jnp.zeros(()), logdir=tmp_path, max_steps=2,
                      summary_reduce="mean", **FAST)
    # "last" calls it as given
    r = loopkit.train(jax.jit(lm_step), init=jnp.zeros(()), logdir=tmp_path, max_steps=2,
                      **FAST)
    assert r.step == 2


def test_hparams_in_tensorboards_hparams_dashboard(tmp_path):
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider
    from tensorboard.backend.event_processing import plugin_event_multiplexer as pem
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, get_experiment

    for run, lr in (("a", 0.1), ("b", 0.01)):
        loopkit.train(lm_step, init=jnp.zeros(()), logdir=tmp_path / run, max_steps=2,
                      hparams={"lr": lr, "optimizer": "adam", "layers": 2, "ema": True},
                      summary_metrics="loss", **FAST)
    # what TensorBoard's HParams plugin serves to the dashboard
    mux = pem.EventMultiplexer()
    mux.AddRunsFromDirectory(str(tmp_path))
    mux.Reload()
    tb = base_plugin.TBContext(logdir=str(tmp_path), multiplexer=mux,
                               data_provider=data_provider.MultiplexerDataProvider(
                                   mux, str(tmp_path)))
    exp = get_experiment.Handler(context.RequestContext(), backend_context.Context(tb), "",
                                 api_pb2.GetExperimentRequest()).run()
    infos = {h.name: h for h in exp.hparam_infos}
    assert sorted(infos) == ["ema", "layers", "lr", "optimizer"]
    assert (infos["lr"].domain_interval.min_value, infos["lr"].domain_interval.max_value) == (
        0.01, 0.1)
    assert [v.string_value for v in infos["optimizer"].domain_discrete.values] == ["adam"]
    assert "loss" in [m.name.tag for m in exp.metric_infos]


def test_no_hparams_no_hparams_record(tmp_path):
    loopkit.train(lm_step, init=jnp.zeros(()), logdir=tmp_path, max_steps=2, **FAST)
    acc = events(tmp_path)
    assert [m.plugin_data.plugin_name for m in acc.summary_metadata.values()] == ["text"]


class Capture:
    @loopkit.hookimpl
    def session_create(self, session) -> None:
        self.session = session


def test_step_carry_threads_a_plugins_value(tmp_path):
    """The core mechanism on its own: an exponential average of the weights."""

    class Ema:
        @loopkit.hookimpl
        def step_carry(self):
            self.carry = loopkit.StepCarry(
                lambda state, metrics: jnp.zeros(state.shape, state.dtype),
                lambda ema, state, metrics: 0.5 * ema + 0.5 * state, name="Ema")
            return self.carry

    ema = Ema()
    r = loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(2), max_steps=3, plugins=[ema],
                      **FAST)
    # states 1, 2, 3: ((0.5 * 1) * 0.5 + 0.5 * 2) * 0.5 + 0.5 * 3
    np.testing.assert_array_equal(np.asarray(ema.carry.value), [2.125, 2.125])
    np.testing.assert_array_equal(np.asarray(r.state), [3.0, 3.0])


@pytest.mark.parametrize("reduce", ["last", "mean"])
@pytest.mark.parametrize("axis", ["explicit", "auto"])
def test_under_a_mesh_the_step_compiles_once_whatever_the_reduce(tmp_path, caplog, reduce, axis):
    # the interval sums handed back at a summary are placed as the step left them: an
    # uncommitted array under jax.set_mesh changed the step's signature (a second compile)
    kind = jax.sharding.AxisType.Explicit if axis == "explicit" else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((1,), ("data",), axis_types=(kind,))

    def decay(w):
        return w * 0.9, {"loss": jnp.sum(w)}

    with jax.set_mesh(mesh), jax.log_compiles(), caplog.at_level(logging.WARNING):
        r = loopkit.train(decay, init=jnp.ones(4), max_steps=30, save_summaries_steps=10,
                          save_summaries_secs=None, summary_reduce=reduce,
                          checkpoint_backend=None, logdir=tmp_path, progress=False,
                          autoload=False)
    steps = [m for m in caplog.messages if m.startswith("Compiling") and "jit(inner)" in m]
    assert r.step == 30 and len(steps) == 1, steps
