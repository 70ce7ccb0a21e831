"""States as flax (NNX and linen), optax and equinox make them: trained, stopped, resumed twice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import loopkit
from loopkit.testing import assert_same_state

BACKENDS = ["orbax", "npz"]
QUIET = dict(progress=False, disable=("summaries",), save_model_secs=None, autoload=False)

X = jax.random.normal(jax.random.key(7), (8, 4))
Y = jnp.sum(X, axis=1, keepdims=True)


def resumed_equals_uninterrupted(step, init, tmp_path, backend, steps=(2, 4, 6)):
    want = loopkit.train(step, init=init, max_steps=steps[-1], **QUIET).state
    for n in steps:
        got = loopkit.train(step, init=init, logdir=tmp_path, checkpoint_backend=backend,
                            max_steps=n, **QUIET).state
    assert_same_state(got, want)
    return got


@pytest.mark.parametrize("backend", BACKENDS)
def test_flax_nnx_model_with_dropout_and_adamw_on_a_schedule(tmp_path, backend):
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(4, 8, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)  # holds a typed key
            self.b = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            return self.b(self.drop(jax.nn.relu(self.a(x))))

    tx = optax.adamw(optax.cosine_decay_schedule(1e-2, 10), weight_decay=1e-3)

    def init():
        model = MLP(nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return {"params": params, "rest": rest, "opt": tx.init(params)}

    graphdef = nnx.graphdef(MLP(nnx.Rngs(0)))

    @jax.jit
    def step(state):
        model = nnx.merge(graphdef, state["params"], state["rest"])
        value, grads = nnx.value_and_grad(lambda m: jnp.mean((m(X) - Y) ** 2))(model)
        _, _, rest = nnx.split(model, nnx.Param, ...)  # the dropout's key moved on
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "rest": rest,
                "opt": opt}, {"loss": value}

    got = resumed_equals_uninterrupted(step, init, tmp_path, backend)
    keys = [x for x in jax.tree.leaves(got["rest"]) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
    assert keys, "the dropout's key should be in the state"


@pytest.mark.parametrize("backend", BACKENDS)
def test_linen_train_state_built_inside_a_callable_init(tmp_path, backend):
    import flax.linen as nn
    from flax.training import train_state

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.relu(nn.Dense(8)(x)))

    def create_train_state():  # as the flax tutorial writes it: tx made inside
        model = Net()
        params = model.init(jax.random.key(0), X)["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                             tx=optax.sgd(0.1, momentum=0.9))

    @jax.jit
    def step(state):
        def loss(params):
            return jnp.mean((state.apply_fn({"params": params}, X) - Y) ** 2)

        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), {"loss": value}

    got = resumed_equals_uninterrupted(step, create_train_state, tmp_path, backend)
    assert int(got.step) == 6


@pytest.mark.parametrize("backend", BACKENDS)
def test_equinox_model_after_partition(tmp_path, backend):
    import equinox as eqx

    tx = optax.adam(1e-2)

    def init():
        model = eqx.nn.MLP(4, 1, 8, 2, key=jax.random.key(0))
        params, static = eqx.partition(model, eqx.is_array)
        return {"params": params, "opt": tx.init(params), "key": jax.random.key(1)}

    static = eqx.partition(eqx.nn.MLP(4, 1, 8, 2, key=jax.random.key(0)), eqx.is_array)[1]

    @eqx.filter_jit
    def step(state):
        key, sub = jax.random.split(state["key"])
        noise = 0.01 * jax.random.normal(sub, X.shape)

        def loss(params):
            model = eqx.combine(params, static)
            return jnp.mean((jax.vmap(model)(X + noise) - Y) ** 2)

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": eqx.apply_updates(state["params"], updates), "opt": opt,
                "key": key}, {"loss": value}

    resumed_equals_uninterrupted(step, init, tmp_path, backend)
