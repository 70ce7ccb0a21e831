"""What a state may hold, how `init` is called, and what loopkit refuses (DESIGN.md, The state)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from loopkit.testing import assert_same_state

BACKENDS = ["orbax", "npz"]
QUIET = dict(progress=False, disable=("summaries",), save_model_secs=None, autoload=False)


def odd_init():
    """Every leaf kind JAX and its libraries put in a state."""
    return {
        "w": jnp.linspace(-1, 1, 6, dtype=jnp.bfloat16).reshape(2, 3),
        "f8": jnp.array([0.5, -2.0], jnp.float8_e4m3fn),
        "i4": jnp.arange(-3, 3, dtype=jnp.int4),
        "mask": jnp.array([True, False, True]),
        "key": jax.random.key(0),
        "raw": jax.random.PRNGKey(1),
        "lr": 0.5,            # Python float: weak float32 in JAX
        "count": 0,           # Python int: weak int32
        "flag": True,
        "nothing": None,
        "empty": {}, "no_items": [], "unit": (),
        "scalar": jnp.float32(2.0),
        "zero_size": jnp.zeros((0, 4), jnp.float32),
    }


def odd_step(s):
    key, sub = jax.random.split(s["key"])
    noise = jax.random.normal(sub, s["w"].shape, jnp.bfloat16)
    raw, _ = jax.random.split(s["raw"])
    return dict(
        s, key=key, raw=raw,
        w=s["w"] + noise * s["lr"],     # the weak lr keeps w bfloat16
        f8=(s["f8"].astype(jnp.float32) * 1.5).astype(jnp.float8_e4m3fn),
        i4=(s["i4"] + 1).astype(jnp.int4),
        mask=~s["mask"], count=s["count"] + 1, scalar=s["scalar"] * 1.5,
    ), {"w0": s["w"][0, 0]}


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_odd_leaf_kind_resumes_bitwise(tmp_path, backend):
    def go(max_steps):
        return loopkit.train(odd_step, init=odd_init, logdir=tmp_path, checkpoint_backend=backend,
                             max_steps=max_steps, **QUIET).state

    want = loopkit.train(odd_step, init=odd_init, max_steps=6, **QUIET).state
    go(2)
    go(4)  # resumed, and saved again
    got = go(6)
    assert_same_state(got, want)
    # lr is passed through unchanged, so it stays the Python float it was
    assert type(want["lr"]) is float and type(got["lr"]) is float
    assert want["count"].weak_type and want["w"].dtype == jnp.bfloat16
    assert str(jax.random.key_impl(got["key"])) == "threefry2x32"


@pytest.mark.parametrize("backend", BACKENDS)
def test_python_scalars_come_back_as_python_scalars(tmp_path, backend):
    # without jit, the step keeps Python values Python values
    def step(s):
        return {"n": s["n"] + 1, "lr": s["lr"] * 0.5, "on": not s["on"], "w": s["w"]}, {}

    init = {"n": 1, "lr": 1.0, "on": True, "w": jnp.zeros(2)}
    loopkit.train(step, init=init, logdir=tmp_path, checkpoint_backend=backend, jit=False,
                  max_steps=3, **QUIET)
    state = loopkit.load_checkpoint(tmp_path)
    assert state["n"] == 4 and type(state["n"]) is int
    assert state["lr"] == 0.125 and type(state["lr"]) is float
    assert state["on"] is False


def test_a_callable_init_runs_once_on_a_fresh_start_and_never_on_a_restore(tmp_path):
    runs = []

    def init():
        jax.debug.callback(lambda: runs.append(1))  # fires only when init really runs
        return {"w": jnp.zeros(3)}

    def step(s):
        return {"w": s["w"] + 1}, {}

    kw = dict(logdir=tmp_path, checkpoint_backend="npz", **QUIET)
    loopkit.train(step, init=init, max_steps=2, **kw)
    assert len(runs) == 1
    loopkit.train(step, init=init, max_steps=4, **kw)
    assert len(runs) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fresh_start_neither_traces_nor_lowers_init(tmp_path, backend):
    """Nothing to restore: init is called once and never traced (a trace would only
    learn shardings for a restore); with a checkpoint it is traced, never run."""
    bodies, runs = [], []

    def init():
        bodies.append(1)  # Python: each trace and each real call
        jax.debug.callback(lambda: runs.append(1))
        return {"w": jnp.zeros(3)}

    def step(s):
        return {"w": s["w"] + 1}, {}

    kw = dict(logdir=tmp_path, checkpoint_backend=backend, **QUIET)
    loopkit.train(step, init=init, max_steps=2, **kw)
    assert (len(bodies), len(runs)) == (1, 1)
    bodies.clear()
    loopkit.train(step, init=init, max_steps=4, **kw)
    assert len(bodies) >= 1 and len(runs) == 1  # traced for the restore, not run


def test_a_resume_compiles_no_init_that_places_every_leaf_itself(tmp_path, caplog):
    """Under a mesh a resume learns where init's leaves live; an init that puts every
    leaf on a sharding itself says so in its trace: it is traced, never compiled, and
    the restored state is placed as the fresh run's."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((1,), ("d",))

    def init_placed():
        where = NamedSharding(mesh, P())
        return {"w": jax.device_put(jnp.zeros(3), where),
                "b": jax.device_put(jnp.ones(()), where)}

    def step(s):
        return {"w": s["w"] + s["b"], "b": s["b"]}, {}

    kw = dict(logdir=tmp_path, checkpoint_backend="npz", **QUIET)
    with jax.set_mesh(mesh):
        fresh = loopkit.train(step, init=init_placed, max_steps=2, **kw)
        jax.config.update("jax_log_compiles", True)
        try:
            with caplog.at_level("WARNING"):
                again = loopkit.train(step, init=init_placed, max_steps=4, **kw)
        finally:
            jax.config.update("jax_log_compiles", False)
    compiled = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert compiled and not any("init_placed" in m for m in compiled), compiled
    assert again.step == 4 and float(again.state["w"][0]) == 4.0
    # placed as the fresh run's state was: the step's one program serves both
    assert ([x.sharding for x in jax.tree.leaves(again.state)]
            == [x.sharding for x in jax.tree.leaves(fresh.state)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_init_that_cannot_be_traced_is_called_once_for_real(tmp_path, backend):
    calls = []

    def init():
        with jax.set_mesh(jax.make_mesh((1,), ("d",))):  # refused under tracing
            w = np.asarray(jnp.ones(3)) * 2  # numpy on a jax value
        calls.append(1)  # reached only by a real call
        return {"w": jnp.asarray(w)}

    def step(s):
        return {"w": s["w"] * 2}, {}

    kw = dict(logdir=tmp_path, checkpoint_backend=backend, **QUIET)
    loopkit.train(step, init=init, max_steps=2, **kw)
    assert len(calls) == 1
    state = loopkit.train(step, init=init, max_steps=3, **kw).state
    assert len(calls) == 2  # a restore needs its shapes: one real call again
    np.testing.assert_array_equal(state["w"], np.full(3, 16.0))


def test_arrays_captured_by_an_init_callable_are_not_donated():
    params0 = {"w": jnp.arange(4.0)}
    loopkit.train(lambda s: (jax.tree.map(lambda x: x + 1, s), {}),
                  init=lambda: {"params": params0}, max_steps=3, **QUIET)
    np.testing.assert_array_equal(params0["w"], np.arange(4.0))  # not deleted


def test_a_restored_run_does_not_donate_on_its_first_step(tmp_path):
    held = []

    class Holder:
        @loopkit.hookimpl
        def local_init(self, session):
            held.append(session.state["w"])

    kw = dict(logdir=tmp_path, checkpoint_backend="npz", **QUIET)
    step = lambda s: ({"w": s["w"] + 1}, {})  # noqa: E731
    loopkit.train(step, init={"w": jnp.zeros(3)}, max_steps=2, **kw)
    loopkit.train(step, init={"w": jnp.zeros(3)}, max_steps=4, plugins=[Holder()], **kw)
    np.testing.assert_array_equal(held[0], np.full(3, 2.0))


def test_an_equinox_filter_jit_step_is_called_as_given():
    eqx = pytest.importorskip("equinox")

    @eqx.filter_jit
    def step(s):
        # filter_jit treats the non-array leaf as static; jax.jit around it would refuse it
        return {"w": s["w"] + 1, "key": jax.random.split(s["key"])[0], "tag": s["tag"]}, {}

    init = {"w": jnp.zeros(2), "key": jax.random.key(0), "tag": "run-a"}
    state = loopkit.train(step, init=init, max_steps=4, **QUIET).state
    np.testing.assert_array_equal(state["w"], np.full(2, 4.0))
    assert state["tag"] == "run-a"
    np.testing.assert_array_equal(init["w"], np.zeros(2))  # the first step did not donate


# -- refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("leaf, kind", [
    (np.array([object(), 1], dtype=object), "dtype object"),
    (print, "builtin_function_or_method"),
])
def test_an_unstorable_leaf_is_refused_at_start_up_naming_it(tmp_path, backend, leaf, kind):
    steps = []

    def step(s):
        steps.append(1)
        return s, {}

    with pytest.raises(TypeError, match=f"state leaf 'model/odd' is .*{kind}"):
        loopkit.train(step, init={"model": {"w": jnp.zeros(2), "odd": leaf}},
                      logdir=tmp_path, checkpoint_backend=backend, jit=False, max_steps=2,
                      **QUIET)
    assert steps == []


def test_an_unstorable_leaf_is_fine_without_checkpoints():
    state = loopkit.train(lambda s: (s, {}), init={"f": print}, jit=False, max_steps=1,
                          **QUIET).state
    assert state["f"] is print


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_different_model_names_the_first_differing_path(tmp_path, backend):
    kw = dict(logdir=tmp_path, checkpoint_backend=backend, max_steps=1, **QUIET)
    loopkit.train(lambda s: (s, {}), init={"a": {"w": jnp.zeros(2)}, "key": jax.random.key(0)},
                  **kw)
    with pytest.raises(ValueError) as info:
        loopkit.train(lambda s: (s, {}),
                      init={"a": {"w": jnp.zeros(2)}, "key": jax.random.key(0, impl="rbg")},
                      **{**kw, "max_steps": 2})
    message = str(info.value)
    assert "key: the restored state has shape () dtype key<fry>" in message
    assert "PyTreeDef" not in message


def test_a_static_field_mismatch_names_the_field_and_both_values():
    flax_struct = pytest.importorskip("flax.struct")

    @flax_struct.dataclass
    class Model:
        w: jax.Array
        activation: str = flax_struct.field(pytree_node=False)

    from loopkit.state.pytree import check_matches

    with pytest.raises(ValueError) as info:
        check_matches({"m": Model(jnp.zeros(2), "relu")}, {"m": Model(jnp.zeros(2), "gelu")})
    message = str(info.value)
    assert "m: the restored state differs" in message
    assert "static field 'activation' differs: 'relu' vs 'gelu'" in message
    assert "PyTreeDef" not in message
