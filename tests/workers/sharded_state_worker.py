"""Trains a state sharded by a callable init over 4 CPU devices; stopped, resumed, compared.

argv: directory mesh_kind ("auto" or "explicit"); both backends run, under `jax.set_mesh`
and (auto axes) without it. `m` is made beside `w` as optax makes its state beside the
parameters (`zeros_like`): `init` run for real places it like `w`, which `jax.jit(init)`
does not tell on auto axes. Prints OK on success.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import loopkit  # noqa: E402
from loopkit.testing import assert_same_state  # noqa: E402

directory, kind = sys.argv[1:3]
axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
mesh = jax.make_mesh((4,), ("d",), axis_types=(axis_type,))
rows, replicated = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())


def init(w_sharding=rows, host=True):
    w = jax.device_put(jnp.arange(32.0).reshape(8, 4), w_sharding)
    state = {"w": w, "m": jnp.zeros_like(w), "lr": 0.5, "key": jax.random.key(0),
             "b": jax.device_put(jnp.zeros(4), replicated)}
    if host:  # (not with no mesh set: there it is a SingleDeviceSharding, which a
        # checkpoint does not record; it would resume replicated over the devices)
        state["h"] = jax.device_put(jnp.ones(4), jax.memory.Space.Host)  # in host memory
    return state


def step(s):
    key, sub = jax.random.split(s["key"])
    w = s["w"] * 0.9 + s["lr"] * jax.random.normal(sub, s["w"].shape)
    return ({"w": w, "m": s["m"] * 0.5 + w, "lr": s["lr"], "key": key, "b": s["b"] + w.sum(0),
             **({"h": s["h"]} if "h" in s else {})}, {"loss": w.sum()})


no_host = functools.partial(init, host=False)
kw = dict(progress=False, disable=("summaries",), save_model_secs=None, autoload=False,
          data_sharding=None)
for backend in ("orbax", "npz"):
    for context in ("set_mesh", "none") if kind == "auto" else ("set_mesh",):
        logdir = os.path.join(directory, backend, context)
        make = init if context == "set_mesh" else no_host
        with jax.set_mesh(mesh) if context == "set_mesh" else contextlib.nullcontext():
            want = loopkit.train(step, init=make, max_steps=6, **kw).state
            for n in (2, 4, 6):  # stopped, resumed, resumed again
                got = loopkit.train(step, init=make, logdir=logdir, checkpoint_backend=backend,
                                    max_steps=n, **kw).state
        assert_same_state(got, want)
        for name in ("w", "m"):
            assert got[name].sharding.is_equivalent_to(rows, 2), (name, got[name].sharding)
            assert len(got[name].sharding.device_set) == 4
        for name, x in jax.tree_util.tree_leaves_with_path(got):  # as the fresh run has them
            y = want[name[0].key] if len(name) == 1 else None
            if isinstance(x, jax.Array) and y is not None:
                assert (x.sharding, x.committed) == (y.sharding, y.committed), (
                    backend, context, name, x.sharding, y.sharding)

if kind == "explicit":
    # saved with no mesh set, resumed under one: a leaf left on the default device then
    # is committed to the mesh now, as a fresh run under it has it
    logdir = os.path.join(directory, "mesh-later")
    loopkit.train(step, init=no_host, logdir=logdir, max_steps=2, **kw)
    with jax.set_mesh(mesh):
        got = loopkit.train(step, init=no_host, logdir=logdir, max_steps=4, **kw).state
        fresh = loopkit.train(step, init=no_host, max_steps=4, **kw).state
    for name in ("w", "m", "key", "b"):
        assert (got[name].sharding, got[name].committed) == (
            fresh[name].sharding, fresh[name].committed), (name, got[name].sharding,
                                                          fresh[name].sharding)
    # init resharded between runs (w replicated, then by rows): m, made beside w, follows
    # w anew rather than keep its saved layout
    logdir = os.path.join(directory, "resharded")
    with jax.set_mesh(mesh):
        loopkit.train(step, init=lambda: init(replicated), logdir=logdir, max_steps=2, **kw)
        got = loopkit.train(step, init=init, logdir=logdir, max_steps=4, **kw).state
    assert got["m"].sharding.is_equivalent_to(rows, 2), got["m"].sharding
print("OK", flush=True)
