"""Compiles of a session under `jax.set_mesh`, fresh and resumed, for tests/loopkit/test_state_mesh.py.

argv: directory devices. For auto and explicit axes and for "last" and "mean", trains 6
steps fresh (a checkpoint at step 4 and the final one at 6), then resumes to 12, each
session counting its XLA compilations (``jax_log_compiles``); a third session resumes
with the persistent compilation cache already filled by the second. Prints one JSON line:
{case: {"fresh" | "resumed" | "cached": {"compiled": [names], "cache_hits": [names]},
"shardings": [fresh, resumed], "committed": [fresh, resumed]}}.
"""

from __future__ import annotations

import json
import logging
import os
import sys

directory, devices = sys.argv[1], int(sys.argv[2])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import loopkit  # noqa: E402


class Compiles(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.names: list[str] = []
        self.hits: list[str] = []  # compiles served by the persistent cache

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("Finished XLA compilation of "):
            self.names.append(msg.split(" ")[4])
        elif msg.startswith("Persistent compilation cache hit for "):
            self.hits.append(msg.split("'")[1])


LOGGERS = ("jax._src.dispatch", "jax._src.interpreters.pxla", "jax._src.compiler")


def counted(fn):
    handler = Compiles()
    jax.config.update("jax_log_compiles", True)
    for name in LOGGERS:
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).propagate = False
    try:
        result = fn()
        # `train` returns while the save variant may still compile in the background
        # (a stop never waits for it): counted here too, once it is done
        from loopkit.process.background_compile import compiling

        for thread in compiling():
            thread.join()
        return result, {"compiled": handler.names, "cache_hits": handler.hits}
    finally:
        jax.config.update("jax_log_compiles", False)
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(handler)


def case(axes: str, reduce: str) -> dict:
    kind = AxisType.Explicit if axes == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(kind,))
    row = NamedSharding(mesh, P("data"))

    def init():
        w = jax.jit(lambda: jnp.arange(8.0 * devices).reshape(devices, 8) / 10,
                    out_shardings=row)()
        # m beside w, as optax makes its state beside the parameters: `init` run for
        # real places it like w, which jax.jit(init) does not tell on auto axes
        return {"w": w, "m": jnp.zeros_like(w), "b": jnp.zeros(8), "n": jnp.int32(0)}

    def step(s, x):
        loss = jnp.mean((jnp.tanh(s["w"] * x) + s["b"]) ** 2)
        return ({"w": s["w"] * 0.99 + x * 1e-3, "m": s["m"] * 0.9 + x,
                 "b": s["b"] - 1e-3 * loss, "n": s["n"] + 1}, {"loss": loss})

    def data(start):
        for i in range(start, 10**6):
            yield np.full((devices, 8), 0.01 * (i % 5), np.float32)

    logdir = os.path.join(directory, f"{axes}-{reduce}")
    kw = dict(data=data, data_sharding=row, logdir=logdir, save_model_steps=4,
              save_model_secs=None, save_summaries_steps=3, save_summaries_secs=None,
              summary_reduce=reduce, progress=False, autoload=False)
    with jax.set_mesh(mesh):
        fresh, c_fresh = counted(lambda: loopkit.train(step, init=init, max_steps=6, **kw))
        resumed, c_resumed = counted(lambda: loopkit.train(step, init=init, max_steps=12, **kw))
        _, c_cached = counted(lambda: loopkit.train(step, init=init, max_steps=18, **kw))
    leaves = lambda r: jax.tree.leaves(r.state)  # noqa: E731
    return {"fresh": c_fresh, "resumed": c_resumed, "cached": c_cached,
            "shardings": [[str(x.sharding) for x in leaves(r)] for r in (fresh, resumed)],
            "committed": [[x.committed for x in leaves(r)] for r in (fresh, resumed)]}


print(json.dumps({f"{a}-{r}": case(a, r) for a in ("auto", "explicit") for r in ("last", "mean")}))
