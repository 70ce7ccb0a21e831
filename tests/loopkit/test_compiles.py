"""The step compiles once per signature, plus at most one save variant, in every
combination a user brings; `import loopkit` stays light."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import loopkit

LEAVES = 40  # of 40 shapes: anything compiled per leaf or per shape shows as 40+


class _Compiles(logging.Handler):
    """Collects jax's "Compiling <name>" log lines while `jax_log_compiles` is on."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Compiling "):
            self.names.append(message.split()[1])


@pytest.fixture
def compiles():
    handler = _Compiles()
    logger = logging.getLogger("jax._src.interpreters.pxla")
    logger.addHandler(handler)
    before = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        yield handler
    finally:
        jax.config.update("jax_log_compiles", before)
        logger.removeHandler(handler)


def _state():
    return {f"w{i}": jnp.full((i + 1,), 0.5, jnp.float32) for i in range(LEAVES)}


def _step(state, batch):
    new = {k: v * 0.9 + batch for k, v in state.items()}
    return new, {"loss": sum(jnp.sum(v) for v in new.values())}


def _data(start):
    return (jnp.float32(0.01 * i) for i in range(start, 10**6))


STEPS = {
    "loopkit jits": _step,
    "user jit, donating": jax.jit(_step, donate_argnums=0),
    "user jit": jax.jit(_step),
}


@pytest.mark.parametrize("mesh", ["none", "state inside", "state outside"])
# "mean" accumulates inside the step loopkit jits: refused for a step the user jitted
@pytest.mark.parametrize("kind, reduce", [("loopkit jits", "last"), ("loopkit jits", "mean"),
                                          ("user jit, donating", "last"), ("user jit", "last")])
def test_the_step_compiles_once_plus_a_save_variant(tmp_path, compiles, kind, mesh, reduce):
    step = STEPS[kind]
    under = jax.make_mesh((1,), ("data",)) if mesh != "none" else None

    def run(max_steps):
        state = _state() if mesh != "state inside" else None
        with jax.set_mesh(under) if under is not None else contextlib.nullcontext():
            if state is None:
                state = _state()
            compiles.names.clear()  # the user's own arrays are built: count from here
            return loopkit.train(step, init=state, data=_data, logdir=tmp_path,
                                 max_steps=max_steps, save_model_steps=3, save_model_secs=None,
                                 save_summaries_steps=3, save_summaries_secs=None,
                                 summary_reduce=reduce, progress=False,
                                 compilation_cache=False)

    for max_steps, what in ((10, "fresh"), (20, "resumed")):
        result = run(max_steps)
        assert result.step == max_steps
        steps = [n for n in compiles.names if "inner" in n or "_step" in n]
        # a step the user jitted is compiled by the user's own jit: once in this process
        least = 1 if what == "fresh" or kind == "loopkit jits" else 0
        assert least <= len(steps) <= 2, f"{what}: {compiles.names}"
        # a constant few (summaries, carries), never one per leaf or per shape
        assert len(compiles.names) < 10, f"{what}: {compiles.names}"


def test_import_loopkit_imports_no_orbax_tensorboardx_or_fsspec():
    code = ("import sys, loopkit\n"
            "heavy = [m for m in sys.modules if m.split('.')[0] in "
            "('orbax', 'tensorboardX', 'fsspec', 'tensorstore')]\n"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
