"""The step as sharded training needs it, on 4 CPU devices: layout, compiles, donation.

argv: directory case [host_copy]; case is "layout", "compiles" or "prejitted".
"host_copy" makes the compiled step protect buffers as it does off CPU (a host
copy at each save, a non-donating first step) instead of with host views.
Prints OK, then one line of figures, on success.
"""

from __future__ import annotations

import logging
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import loopkit  # noqa: E402
import loopkit.loop.step  # noqa: E402
from loopkit.testing import assert_same_state  # noqa: E402

directory, case = sys.argv[1:3]
if "host_copy" in sys.argv[3:]:
    loopkit.loop.step.views_protect = lambda: False

mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"))
FSDP_TP = NamedSharding(mesh, P("tensor", "fsdp"))
KW = dict(progress=False, disable=("summaries",), save_model_secs=None, autoload=False)


class Compiles(logging.Handler):
    """Counts XLA compilations as jax reports them with ``jax_log_compiles``."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("Finished XLA compilation of "):
            self.names.append(msg.split(" ")[4])


LOGGERS = ("jax._src.dispatch", "jax._src.interpreters.pxla")


def counting() -> Compiles:
    jax.config.update("jax_log_compiles", True)
    handler = Compiles()
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.propagate = False
    return handler


def stop_counting(handler: Compiles) -> None:
    jax.config.update("jax_log_compiles", False)
    for name in LOGGERS:
        logging.getLogger(name).removeHandler(handler)


def replicating_step(s):
    """XLA's propagation replicates every output here (nothing ties them to w's layout)."""
    total = jnp.sum(s["w"])
    w = jnp.full(s["w"].shape, total * 1e-3) + jnp.arange(s["w"].size,
                                                          dtype=jnp.float32).reshape(s["w"].shape)
    return {"w": w, "frozen": s["frozen"], "n": s["n"] + 1}, {"loss": total}


def layout_init():
    return {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8), FSDP_TP),
            "frozen": jax.device_put(jnp.ones((8, 8)), FSDP_TP), "n": 0}


def check_layout(state):
    for name in ("w", "frozen"):
        got = state[name].sharding
        assert got.is_equivalent_to(FSDP_TP, 2), f"{name}: {got}"


def case_layout():
    with jax.set_mesh(mesh):
        plain = jax.jit(replicating_step)(layout_init())[0]["w"].sharding
        assert not plain.is_equivalent_to(FSDP_TP, 2), f"XLA kept the layout anyway: {plain}"
        want = loopkit.train(replicating_step, init=layout_init, max_steps=6, **KW).state
        check_layout(want)
        for backend in ("orbax", "npz"):
            logdir = os.path.join(directory, backend)
            for n in (4, 6):  # saves at 2, 4 (then stopped), a resume, a save at 6
                got = loopkit.train(replicating_step, init=layout_init, logdir=logdir,
                                    checkpoint_backend=backend, max_steps=n,
                                    save_model_steps=2, **KW).state
                check_layout(got)
            assert_same_state(got, want)
            restored = loopkit.load_checkpoint(logdir)
            np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(want["w"]))
    return f"plain jit gave {plain.spec}; loopkit kept {FSDP_TP.spec}"


def many_leaf_init():
    """48 leaves of 16 shapes, sharded, replicated and frozen, plus scalars."""
    state = {}
    for i in range(16):
        shape = (4 * (i + 1), 8)
        state[f"layer{i}"] = {
            "w": jax.device_put(jnp.full(shape, float(i)), FSDP_TP),
            "b": jax.device_put(jnp.zeros(shape[1:]) + i, NamedSharding(mesh, P())),
            "frozen": jax.device_put(jnp.ones(shape), FSDP_TP),
        }
    state["step"] = 0
    return state


def many_leaf_step(s):
    new = {k: (dict(v, w=v["w"] * 0.5 + 1.0, b=v["b"] - 1.0) if k != "step" else v + 1)
           for k, v in s.items()}
    return new, {"loss": sum(jnp.sum(v["w"]) for k, v in s.items() if k != "step")}


def case_compiles():
    with jax.set_mesh(mesh):
        init = many_leaf_init()
        jax.block_until_ready(init)
        compiles = counting()
        result = loopkit.train(many_leaf_step, init=init, logdir=directory, max_steps=10,
                               save_model_steps=2, max_to_keep=None, **KW)
        stop_counting(compiles)
    steps = [n for n in compiles.names if "inner" in n]
    saves = 5
    # the normal step once, and once either its non-donating first-step variant (off
    # CPU) or its save variant that writes into spare buffers (CPU, in the background)
    assert len(steps) <= 2, compiles.names
    if "host_copy" not in sys.argv:
        assert steps.count("jit(inner)") == 1, compiles.names
    assert len(compiles.names) <= 8, compiles.names
    want = init
    for _ in range(10):
        want = jax.jit(lambda s: many_leaf_step(s)[0])(want)
    assert_same_state(result.state, want)
    # the caller's init arrays were never donated
    assert not init["layer3"]["w"].is_deleted()
    assert np.all(np.asarray(init["layer3"]["w"]) == 3.0)
    for step in (2, 4, 6, 8, 10):
        got = loopkit.load_checkpoint(os.path.join(directory, f"model.ckpt-{step}"))
        assert np.asarray(got["layer15"]["b"])[0] == 15.0 - step
    return (f"{len(jax.tree.leaves(init))} leaves, {saves} saves: {len(compiles.names)} "
            f"compiles ({', '.join(compiles.names)})")


def case_prejitted():
    def step(s):
        return {"w": s["w"] * 2.0 + 1.0, "frozen": s["frozen"], "n": s["n"] + 1}, {}

    jitted = jax.jit(step, donate_argnums=0)
    with jax.set_mesh(mesh):
        init = {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8), FSDP_TP),
                "frozen": jax.device_put(jnp.ones((8, 8)), FSDP_TP), "n": jnp.int32(0)}
        compiles = counting()
        for backend in ("orbax", "npz"):
            result = loopkit.train(jitted, init=init, logdir=os.path.join(directory, backend),
                                   checkpoint_backend=backend, max_steps=6, save_model_steps=1,
                                   max_to_keep=None, **KW)
        stop_counting(compiles)
    want = {"w": np.arange(64.0, dtype=np.float32).reshape(8, 8), "n": 0}
    for n in range(1, 7):
        want = {"w": want["w"] * 2.0 + 1.0, "n": n}
        for backend in ("orbax", "npz"):
            got = loopkit.load_checkpoint(os.path.join(directory, backend, f"model.ckpt-{n}"))
            np.testing.assert_array_equal(np.asarray(got["w"]), want["w"])
            assert int(np.asarray(got["n"])) == n
    np.testing.assert_array_equal(np.asarray(result.state["w"]), want["w"])
    # the caller's arrays are still there, unchanged
    assert not init["w"].is_deleted()
    np.testing.assert_array_equal(np.asarray(init["w"]), np.arange(64.0).reshape(8, 8))
    steps = [n for n in compiles.names if n == "jit(step)"]
    assert len(steps) == 1, compiles.names
    assert len(compiles.names) <= 4, compiles.names  # no per-leaf copy
    tagged = prejitted_with_static_leaves()
    return f"compiles: {', '.join(compiles.names)}; {tagged}"


def prejitted_with_static_leaves():
    """An equinox step: a string leaf is static to it, a typed key is an array."""
    import equinox as eqx

    @eqx.filter_jit(donate="all")
    def step(s):
        return {"w": s["w"] + 1, "key": jax.random.split(s["key"])[0], "tag": s["tag"]}, {}

    init = {"w": jnp.zeros(4), "key": jax.random.key(0), "tag": "run-a"}
    result = loopkit.train(step, init=init, logdir=os.path.join(directory, "eqx"),
                           max_steps=4, save_model_steps=2, **KW)
    np.testing.assert_array_equal(np.asarray(result.state["w"]), np.full(4, 4.0))
    assert result.state["tag"] == "run-a"
    assert not init["w"].is_deleted() and not init["key"].is_deleted()
    saved = loopkit.load_checkpoint(os.path.join(directory, "eqx", "model.ckpt-2"))
    np.testing.assert_array_equal(np.asarray(saved["w"]), np.full(4, 2.0))
    return "equinox step with a string leaf: ok"


figures = {"layout": case_layout, "compiles": case_compiles, "prejitted": case_prejitted}[case]()
print("OK", flush=True)
print(figures, flush=True)
