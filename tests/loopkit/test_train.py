from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from loopkit.testing import HookRecorder

FAST = dict(progress=False, checkpoint_backend=None)


def count_step(state):
    return state + 1, {"value": state}


def add_step(state, batch):
    return state + batch, {"batch": batch}


def test_hook_order_and_arguments_over_a_run():
    rec = HookRecorder()
    result = loopkit.train(add_step, init=jnp.zeros(()), data=[1.0, 2.0, 3.0], plugins=[rec],
                           **FAST)
    assert rec.names() == [
        "session_open", "restore_state", "init_state", "local_init", "step_carry", "session_create",
        "input_reader", "before_step", "after_step", "before_step", "after_step", "before_step", "after_step",
        "on_data_end", "on_stop",  # the data ran out: the stop follows
    ]
    assert [c.kwargs["step"] for c in rec.calls("before_step")] == [0, 1, 2]
    assert [c.kwargs["step"] for c in rec.calls("after_step")] == [1, 2, 3]
    assert [float(c.kwargs["metrics"]["batch"]) for c in rec.calls("after_step")] == [1, 2, 3]
    stop = rec.getcall("on_stop")
    assert stop.kwargs["error"] is None and stop.kwargs["step"] == 3
    like = rec.getcall("restore_state").kwargs["like"]
    assert isinstance(like, jax.ShapeDtypeStruct) and like.dtype == jnp.float32
    assert float(result.state) == 6.0 and result.step == 3


def test_stop_reason_max_steps():
    r = loopkit.train(count_step, init=jnp.zeros(()), max_steps=7, **FAST)
    assert (r.step, int(r.state), r.stop_reason) == (7, 7, "max_steps")


def test_stop_reason_data_exhausted_and_no_before_step_for_missing_batch():
    rec = HookRecorder()
    r = loopkit.train(add_step, init=jnp.zeros(()), data=iter([1.0, 1.0]), plugins=[rec], **FAST)
    assert (r.step, r.stop_reason) == (2, "data_exhausted")
    assert len(rec.calls("before_step")) == 2


def test_stop_reason_requested_from_a_hook():
    class StopAt4:
        @loopkit.hookimpl
        def after_step(self, session, step):
            if step == 4:
                session.request_stop()

    r = loopkit.train(count_step, init=jnp.zeros(()), plugins=[StopAt4()], **FAST)
    assert (r.step, r.stop_reason) == (4, "requested")


def test_max_steps_zero_runs_nothing():
    rec = HookRecorder()
    r = loopkit.train(count_step, init=jnp.zeros(()), max_steps=0, plugins=[rec], **FAST)
    assert r.step == 0 and r.stop_reason == "max_steps"
    assert "before_step" not in rec.names() and rec.names()[-1] == "on_stop"


def test_init_callable_and_init_fn_and_local_init_fn():
    calls = []

    def init():
        w = jnp.ones(3)
        if not isinstance(w, jax.core.Tracer):  # eval_shape traces init; count real calls
            calls.append("init")
        return {"w": w}

    def init_fn(state):
        calls.append("init_fn")
        return {"w": state["w"] * 10}

    def local_init_fn(session):
        calls.append(("local", session.step, float(session.state["w"][0])))

    r = loopkit.train(lambda s: ({"w": s["w"] + 1}, {}), init=init, init_fn=init_fn,
                      local_init_fn=local_init_fn, max_steps=2, **FAST)
    assert calls == ["init", "init_fn", ("local", 0, 10.0)]
    np.testing.assert_array_equal(r.state["w"], np.full(3, 12.0))


def test_callable_init_is_only_traced_when_a_checkpoint_is_restored():
    materialised = []

    def init():
        x = jnp.zeros((4,))
        if not isinstance(x, jax.core.Tracer):  # traced by eval_shape: no memory used
            materialised.append(1)
        return x

    class Restore:
        @loopkit.hookimpl
        def restore_state(self, like):
            assert isinstance(like, jax.ShapeDtypeStruct)
            return loopkit.Restored(state=jnp.full((4,), 5.0), step=5)

    r = loopkit.train(lambda s: (s + 1, {}), init=init, max_steps=7, plugins=[Restore()], **FAST)
    assert materialised == [], "init() must not be materialised when a checkpoint is restored"
    assert r.step == 7 and float(r.state[0]) == 7.0


def test_ready_check_names_differing_leaves():
    class Restore:
        @loopkit.hookimpl
        def restore_state(self):
            return loopkit.Restored(
                state={"params": {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2, jnp.int32)}}, step=1
            )

    init = {"params": {"w": jnp.zeros((3, 3)), "b": jnp.zeros(2)}}
    with pytest.raises(ValueError) as info:
        loopkit.train(lambda s: (s, {}), init=init, plugins=[Restore()], **FAST)
    msg = str(info.value)
    assert "params/w" in msg and "(3, 2)" in msg and "(3, 3)" in msg
    assert "params/b" in msg and "int32" in msg and "float32" in msg


def test_restored_dicts_take_the_init_containers():
    import collections

    Pair = collections.namedtuple("Pair", "mu nu")

    class Restore:
        @loopkit.hookimpl
        def restore_state(self):
            return loopkit.Restored(state={"mu": jnp.ones(2), "nu": {"0": jnp.ones(1)}}, step=3)

    init = Pair(mu=jnp.zeros(2), nu=[jnp.zeros(1)])
    r = loopkit.train(lambda s: (s, {}), init=init, plugins=[Restore()], max_steps=3, **FAST)
    assert isinstance(r.state, Pair) and isinstance(r.state.nu, list)


def test_user_init_arrays_stay_valid_after_a_donating_run():
    init = {"w": jnp.arange(4.0)}
    batch = jnp.ones(4)
    r = loopkit.train(lambda s, b: ({"w": s["w"] + b}, {}), init=init, data=[batch] * 3, **FAST)
    np.testing.assert_array_equal(init["w"], np.arange(4.0))  # not deleted by donation
    np.testing.assert_array_equal(batch, np.ones(4))
    np.testing.assert_array_equal(r.state["w"], np.arange(4.0) + 3)


def test_state_is_donated_after_the_first_step():
    seen = []

    class Keep:
        @loopkit.hookimpl
        def before_step(self, session, step):
            seen.append(session.state)

    loopkit.train(count_step, init=jnp.zeros((8,)), max_steps=4, plugins=[Keep()], **FAST)
    # the first step used the caller's array without donating; later ones donated
    assert not seen[0].is_deleted()
    assert any(s.is_deleted() for s in seen[1:]), "jit should donate the state"


def test_jit_false_runs_python_and_prejitted_is_used_as_is():
    traced = []

    def step(s):
        traced.append(type(s))
        return s + 1, {}

    loopkit.train(step, init=jnp.zeros(()), max_steps=3, jit=False, **FAST)
    assert len(traced) == 3  # called eagerly every step
    jitted = jax.jit(count_step)
    r = loopkit.train(jitted, init=jnp.zeros(()), max_steps=3, **FAST)
    assert r.step == 3 and int(r.state) == 3
    # called directly with concrete arrays (its own dispatch cache holds the one
    # compilation); wrapped in another jit it would only be traced, leaving it empty
    assert jitted._cache_size() >= 1


def test_exception_in_step_is_reraised_with_a_note_and_on_stop_sees_it():
    rec = HookRecorder()

    def step(s):
        if int(s) == 2:
            raise ArithmeticError("boom at 2")
        return s + 1, {}

    with pytest.raises(ArithmeticError, match="boom at 2") as info:
        loopkit.train(step, init=jnp.zeros(()), jit=False, plugins=[rec], **FAST)
    assert any("step function at step 3" in n for n in info.value.__notes__)
    err = rec.getcall("on_stop").kwargs["error"]
    assert err is info.value


def test_exception_in_a_hook_names_the_hook_and_plugin():
    class Exploding:
        @loopkit.hookimpl
        def after_step(self, step):
            if step == 3:
                raise KeyError("nope")

    rec = HookRecorder()
    with pytest.raises(KeyError) as info:
        loopkit.train(count_step, init=jnp.zeros(()), plugins=[rec, Exploding()], **FAST)
    notes = "\n".join(info.value.__notes__)
    assert "'after_step'" in notes and "'Exploding'" in notes
    assert rec.getcall("on_stop").kwargs["error"] is info.value


def test_exception_in_a_timer_names_the_timer_and_plugin():
    class P:
        @loopkit.hookimpl
        def session_create(self, session):
            session.every(self.tick, steps=2, name="ticker")

        def tick(self, session):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full") as info:
        loopkit.train(count_step, init=jnp.zeros(()), plugins=[P()], **FAST)
    assert any("timer 'ticker' of plugin 'P' at step 2" in n for n in info.value.__notes__)


def test_exception_in_session_create_still_runs_on_stop():
    rec = HookRecorder()

    class Bad:
        @loopkit.hookimpl
        def session_create(self):
            raise RuntimeError("cannot start")

    with pytest.raises(RuntimeError, match="cannot start") as info:
        loopkit.train(count_step, init=jnp.zeros(()), plugins=[rec, Bad()], **FAST)
    assert rec.getcall("on_stop").kwargs["error"] is info.value
    assert "before_step" not in rec.names()


def test_every_on_stop_runs_even_if_one_raises_and_a_clean_run_reraises_it():
    ran = []

    class A:
        @loopkit.hookimpl
        def on_stop(self):
            ran.append("A")
            raise ValueError("A failed")

    class B:
        @loopkit.hookimpl
        def on_stop(self):
            ran.append("B")

    with pytest.raises(ValueError, match="A failed") as info:
        loopkit.train(count_step, init=jnp.zeros(()), max_steps=2, plugins=[A(), B()], **FAST)
    assert sorted(ran) == ["A", "B"]
    assert any("'on_stop' of plugin 'A'" in n for n in info.value.__notes__)


@pytest.mark.parametrize("where", ["init_fn", "on_stop"])
def test_a_stop_iteration_outside_the_loop_comes_out_as_raised(where):
    # e.g. an init_fn taking next() of an empty iterator: the user's StopIteration (an
    # on_stop's with the note naming it), not "RuntimeError: generator raised StopIteration"
    class Stops:
        @loopkit.hookimpl
        def on_stop(self):
            next(iter(()))

    kw = (dict(init_fn=lambda s: next(iter(())))
          if where == "init_fn" else dict(plugins=[Stops()]))
    with pytest.raises(StopIteration) as info:
        loopkit.train(count_step, init=jnp.zeros(()), max_steps=2, **kw, **FAST)
    if where == "on_stop":
        assert any("'on_stop' of plugin" in n for n in info.value.__notes__)


def test_on_stop_error_after_a_failed_run_is_a_note_on_the_original():
    class A:
        @loopkit.hookimpl
        def on_stop(self):
            raise ValueError("cleanup failed")

    def step(s):
        raise ZeroDivisionError("original")

    with pytest.raises(ZeroDivisionError, match="original") as info:
        loopkit.train(step, init=jnp.zeros(()), jit=False, plugins=[A()], **FAST)
    assert any("ValueError: cleanup failed" in n for n in info.value.__notes__)


def test_exception_in_a_loop_thread_stops_the_run_and_names_the_thread():
    class P:
        @loopkit.hookimpl
        def session_create(self, session):
            session.loop(0.001, self.work)

        def work(self):
            raise LookupError("thread broke")

    started = time.monotonic()
    with pytest.raises(LookupError, match="thread broke") as info:
        loopkit.train(count_step, init=jnp.zeros(()), plugins=[P()], **FAST)
    assert time.monotonic() - started < 60
    assert any("loopkit thread 'loopkit-loop-work'" in n for n in info.value.__notes__)


def test_loop_thread_that_ignores_stop_is_left_behind_after_grace(caplog):
    release = threading.Event()

    class P:
        @loopkit.hookimpl
        def session_create(self, session):
            session.loop(None, release.wait)  # blocks, never checks should_stop

    started = time.monotonic()
    r = loopkit.train(count_step, init=jnp.zeros(()), max_steps=3, stop_grace_secs=0.5,
                      plugins=[P()], **FAST)
    elapsed = time.monotonic() - started
    release.set()
    assert r.step == 3
    assert elapsed < 30, "train must not wait for a stuck thread past stop_grace_secs"
    assert any("did not stop within stop_grace_secs=0.5" in rec.message for rec in caplog.records)


def test_loop_thread_runs_periodically_until_stop():
    ticks = []

    class P:
        @loopkit.hookimpl
        def session_create(self, session):
            self.thread = session.loop(0.01, lambda: ticks.append(1))

    p = P()

    def slow(s):
        time.sleep(0.01)
        return s + 1, {}

    loopkit.train(slow, init=jnp.zeros(()), max_steps=20, jit=False, plugins=[p], **FAST)
    assert len(ticks) >= 2
    assert not p.thread.is_alive()


def test_misspelled_hook_fails_loudly_naming_the_plugin():
    class Typo:
        @loopkit.hookimpl
        def afterstep(self, session):
            pass

    with pytest.raises(loopkit.PluginError, match=r"Typo.*afterstep"):
        loopkit.train(count_step, init=jnp.zeros(()), max_steps=1, plugins=[Typo()], **FAST)


def test_unknown_hook_argument_fails_loudly():
    class BadArg:
        @loopkit.hookimpl
        def after_step(self, sesion):
            pass

    with pytest.raises(loopkit.PluginError, match="BadArg"):
        loopkit.train(count_step, init=jnp.zeros(()), max_steps=1, plugins=[BadArg()], **FAST)


def test_disable_unknown_plugin_name_is_an_error():
    with pytest.raises(ValueError, match="sumaries"):
        loopkit.train(count_step, init=jnp.zeros(()), max_steps=1, disable=("sumaries",), **FAST)


def test_builtins_start_first_and_stop_last(tmp_path):
    seen = []

    class User:
        @loopkit.hookimpl
        def session_create(self, session):
            # the built-in services already started: the writer and the first
            # checkpoint timer are there
            seen.append(("start", session.summary_writer is not None,
                         [t.name for t in session.timers]))

        @loopkit.hookimpl(trylast=True)
        def on_stop(self, session):
            # the built-ins stop after every other plugin: the writer is still open
            # and the final checkpoint is not written yet
            seen.append(("stop", session.summary_writer is not None,
                         sorted(p.name for p in tmp_path.glob("model.ckpt-*"))))

    def local_init_fn(session):
        seen.append(("local_init", session.summary_writer is not None, []))

    loopkit.train(count_step, init=jnp.zeros(()), max_steps=1, local_init_fn=local_init_fn,
                  logdir=tmp_path, checkpoint_backend="npz", progress=False,
                  save_model_secs=600, save_summaries_secs=120, plugins=[User()])
    assert seen == [
        ("local_init", False, []),
        ("start", True, ["goodput_start", "goodput", "summary writer", "summaries",
                         "checkpoint", "step_counter"]),
        ("stop", True, []),
    ]
    assert sorted(p.name for p in tmp_path.glob("model.ckpt-*")) == ["model.ckpt-1.npz"]


def test_argument_plugins_with_the_same_class_get_distinct_names():
    rec1, rec2 = HookRecorder(), HookRecorder()
    loopkit.train(count_step, init=jnp.zeros(()), max_steps=2, plugins=[rec1, rec2], **FAST)
    assert rec1.names() == rec2.names()


def test_data_callable_gets_the_start_step():
    got = []

    def data(start):
        got.append(start)
        return iter([1.0, 2.0])

    r = loopkit.train(add_step, init=jnp.zeros(()), data=data, **FAST)
    assert got == [0] and r.step == 2


def test_unsupported_data_is_a_clear_error():
    with pytest.raises(TypeError, match="data=42 is not supported"):
        loopkit.train(add_step, init=jnp.zeros(()), data=42, **FAST)


def test_a_wrapper_on_on_stop_is_refused_at_registration_naming_the_plugin():
    class Wrap:
        @loopkit.hookimpl(wrapper=True)
        def on_stop(self, error):
            yield

    with pytest.raises(loopkit.PluginError, match="plugin 'Wrap': on_stop may not be a hook wrapper"):
        loopkit.train(count_step, init=jnp.zeros(()), max_steps=1, plugins=[Wrap()], **FAST)

    class OldStyle:
        @loopkit.hookimpl(hookwrapper=True)
        def on_stop(self):
            yield

    with pytest.raises(loopkit.PluginError, match="'OldStyle'"):
        loopkit.train(count_step, init=jnp.zeros(()), max_steps=1, plugins=[OldStyle()], **FAST)


def test_wrappers_on_other_hooks_run_around_the_built_ins(tmp_path):
    order = []

    class Wrap:
        @loopkit.hookimpl(wrapper=True)
        def session_create(self, session):
            order.append(("before", session.summary_writer is None))
            yield
            order.append(("after", session.summary_writer is None))

    loopkit.train(count_step, init=jnp.zeros(()), max_steps=1, plugins=[Wrap()],
                  logdir=tmp_path, **FAST)
    # the wrapper surrounds the built-ins: the summaries plugin set the writer inside
    assert order == [("before", True), ("after", False)]


def test_restore_sees_concrete_shardings_for_a_sharded_callable_init():
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((1,), ("data",))
    replicated = NamedSharding(mesh, P())
    seen = []

    class Restore:
        @loopkit.hookimpl
        def restore_state(self, like):
            seen.append(like["w"].sharding)
            return None

    loopkit.train(lambda s: (s, {}), init=lambda: {"w": jax.device_put(jnp.ones(3), replicated)},
                  max_steps=1, plugins=[Restore()], **FAST)
    assert isinstance(seen[0], NamedSharding)
    assert type(seen[0].mesh).__name__ == "Mesh"  # real devices, not an AbstractMesh


def test_prejitted_donating_step_keeps_init_and_lets_async_saves_read(tmp_path):
    step = jax.jit(lambda s: (jax.tree.map(lambda x: x + 1, s), {}), donate_argnums=0)
    init = {"w": jnp.zeros((200_000,))}
    r = loopkit.train(step, init=init, max_steps=30, logdir=str(tmp_path), save_model_steps=5, max_to_keep=0,
                      save_model_secs=None, save_summaries_secs=None, progress=False)
    assert not init["w"].is_deleted()  # the caller's array survived a donating step
    np.testing.assert_array_equal(init["w"], np.zeros(200_000))
    assert float(r.state["w"][0]) == 30.0
    for saved in (5, 10, 30):  # every async save read intact buffers
        got = loopkit.load_checkpoint(str(tmp_path / f"model.ckpt-{saved}"))
        assert float(got["w"][0]) == saved


def test_float64_numpy_init_resumes(tmp_path):
    kw = dict(init={"w": np.zeros(3)}, logdir=str(tmp_path), checkpoint_backend="npz",
              progress=False, save_summaries_secs=None)
    loopkit.train(lambda s: ({"w": s["w"] + 1}, {}), max_steps=2, **kw)
    r = loopkit.train(lambda s: ({"w": s["w"] + 1}, {}), max_steps=4, **kw)
    np.testing.assert_array_equal(r.state["w"], np.full(3, 4.0))


def test_stop_iteration_from_user_code_is_data_exhausted():
    it = iter([])

    def step(s):
        next(it)
        return s, {}

    r = loopkit.train(step, init=jnp.zeros(()), jit=False, **FAST)
    assert r.stop_reason == "data_exhausted" and r.step == 0


def test_data_source_error_without_prefetch_names_the_source():
    def source():
        yield 1.0
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone") as info:
        loopkit.train(add_step, init=jnp.zeros(()), data=source(), prefetch=0, **FAST)
    assert info.value.__notes__ == ["raised in loopkit reading the data source, for step 2"]


def test_a_failing_on_stop_turns_the_stop_into_a_failed_one_for_later_plugins():
    seen = []

    class Fails:
        @loopkit.hookimpl(tryfirst=True)
        def on_stop(self):
            raise ValueError("final check failed")

    class Later:
        @loopkit.hookimpl
        def on_stop(self, error):
            seen.append(error)

    with pytest.raises(ValueError, match="final check failed"):
        loopkit.train(count_step, init=jnp.zeros(()), max_steps=2, plugins=[Later(), Fails()],
                      **FAST)
    assert isinstance(seen[0], ValueError)


def test_on_stop_failure_after_a_failed_run_names_the_plugin():
    class A:
        @loopkit.hookimpl
        def on_stop(self):
            raise RuntimeError("cleanup")

    def step(s):
        raise ZeroDivisionError("original")

    with pytest.raises(ZeroDivisionError) as info:
        loopkit.train(step, init=jnp.zeros(()), jit=False, plugins=[A()], **FAST)
    assert "while stopping, also: on_stop of plugin 'A' raised RuntimeError: cleanup" in \
        info.value.__notes__


def test_an_init_that_cannot_be_traced_is_called_once_for_real(tmp_path):
    calls = []

    def init():
        # numpy on a jax value: fine eagerly, impossible under jax.eval_shape
        w = np.asarray(jax.random.normal(jax.random.key(0), (3,)))
        calls.append(1)  # reached only when init really runs
        return {"w": w}

    kw = dict(init=init, logdir=str(tmp_path), checkpoint_backend="npz", progress=False,
              save_summaries_secs=None)
    r = loopkit.train(lambda s: ({"w": s["w"] + 1}, {}), max_steps=2, **kw)
    assert calls == [1]
    r2 = loopkit.train(lambda s: ({"w": s["w"] + 1}, {}), max_steps=3, **kw)
    np.testing.assert_allclose(r2.state["w"], np.asarray(r.state["w"]) + 1)
