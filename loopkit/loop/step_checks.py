"""The mistakes users make with a step function, answered at the first step.

Each check runs once, on what the first call (or its trace) returned, never per
step: a step that returns something other than ``(state, metrics)``, metrics that
are not a mapping of names to scalars, a new state that drifts from the old one
(a key added, a dtype changed), and batches whose shapes change from batch to
batch, so that the step compiles again and again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import jax

from loopkit.state.pytree import _first_difference, _short, abstract, leaves_with_paths

__all__ = ["RecompileWatch", "check_step_output", "is_jitted"]

log = logging.getLogger("loopkit")

PyTree = Any
_EXPECTED = ("the step function must return a pair (state, metrics): the new state and a "
             "mapping of metric names to scalars, e.g. `return state, {\"loss\": loss}` "
             "(`return state, {}` when there are none)")


def is_jitted(fn: Any) -> bool:
    """True for a function JAX has already jitted (`jax.jit` and wrappers built on it)."""
    # jax.jit, flax.nnx.jit and equinox.filter_jit all have `lower`; equinox's
    # wrapper is no PjitFunction and has no `eval_shape`
    return callable(getattr(fn, "lower", None))


def describe(x: Any) -> str:
    """A short description of a value as a user would recognise it: ``float32[3,4]``."""
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        weak = ", weakly typed" if getattr(x, "weak_type", False) else ""
        return f"{dtype}[{','.join(map(str, shape))}]{weak}"
    if isinstance(x, (bool, int, float, complex)):
        return f"the Python {type(x).__name__} {x!r}"
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return f"a tuple of {len(x)} elements ({', '.join(describe(y) for y in x[:4])}" + (
            ", ...)" if len(x) > 4 else ")")
    if isinstance(x, (list, dict)) or x is None:
        return f"{type(x).__name__} {_short(jax.tree.map(describe, x), 100)}"
    return f"{type(x).__name__} {_short(x)}"


def check_step_output(out: Any, state: PyTree) -> None:
    """Raise `TypeError` when `out`, what the first step returned (or its trace),
    is not ``(state, metrics)`` with metrics a mapping of names to scalars and
    the new state like `state` in structure, shapes and dtypes."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        hint = ""
        if jax.tree.structure(out) == jax.tree.structure(state):
            hint = " (it looks like the state alone)"
        raise TypeError(f"{_EXPECTED}; it returned {describe(out)}{hint}")
    new, metrics = out
    _check_metrics(metrics)
    _check_same_state(new, state)


def _check_metrics(metrics: Any) -> None:
    if metrics is None:
        return
    if not isinstance(metrics, Mapping):
        raise TypeError(
            "the step's metrics (the second element it returns) must be a mapping of "
            f"metric names to scalars, e.g. {{\"loss\": loss}}; it returned {describe(metrics)}")
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise TypeError(f"the step's metrics must be keyed by names (str); it returned the "
                            f"key {name!r} ({type(name).__name__})")
        # containers are the mistake (one metric per name); a scalar, an array, a
        # string (a text summary) or an object with __jax_array__ (jit=False) is fine
        if isinstance(value, (Mapping, list, tuple)) or value is None:
            raise TypeError(
                f"the step's metric {name!r} must be a scalar (or an array); it is "
                f"{describe(value)}: return one metric per name, e.g. {{\"loss/a\": a, "
                "\"loss/b\": b}")


def _check_same_state(new: PyTree, old: PyTree) -> None:
    found = _first_difference(new, old)
    if found is not None:
        where, what = found
        raise TypeError(
            f"the step function returned a state whose structure differs from its input at "
            f"{where!r}: {what} (returned vs input); the state must keep its structure from "
            "step to step (a key added or dropped fails the next resume): build every "
            "entry in init")
    old_leaves = dict(leaves_with_paths(abstract(old)))
    for path, x in leaves_with_paths(abstract(new)):
        y = old_leaves.get(path)
        if y is None or not hasattr(x, "dtype") or not hasattr(y, "dtype"):
            continue
        # a weak type turned strong (a Python 0.1 in init times a float32 array) costs
        # one more compile, once, and resumes exactly: not refused
        if (tuple(x.shape), x.dtype) != (tuple(y.shape), y.dtype):
            fix = ""
            if tuple(x.shape) == tuple(y.shape):
                fix = f": cast it back in the step, e.g. `.astype(jnp.{y.dtype})`"
            raise TypeError(
                f"the step function changed state leaf {path or '<root>'!r} from "
                f"{describe(y)} to {describe(x)}{fix}; a state leaf keeps its shape and "
                "dtype from step to step (a drifting one compiles the step again and "
                "fails the next resume)")


class RecompileWatch:
    """Counts the batch signatures a step was traced for; warns once when they keep changing.

    `traced(batch)` runs inside the jitted function's Python body, so only when JAX
    traces it (a compile), never per step.
    """

    #: distinct batch signatures after which the step is named in a warning
    LIMIT = 4

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[tuple] = []
        self.warned = False

    def traced(self, batch: tuple) -> None:
        signature = tuple(describe(x) for x in jax.tree.leaves(batch))
        if signature in self.seen:
            return
        self.seen.append(signature)
        if len(self.seen) >= self.LIMIT and not self.warned:
            self.warned = True
            first, last = self.seen[0], self.seen[-1]
            changed = [f"batch leaf {i}: {a} -> {b}" for i, (a, b) in
                       enumerate(zip(first, last)) if a != b] or [f"{first} -> {last}"]
            log.warning(
                "loopkit: the step function %s has been compiled for %d different batch "
                "shapes (%s); batches whose shapes change from batch to batch recompile the "
                "step each time: pad or bucket them to a few fixed shapes",
                self.name, len(self.seen), "; ".join(changed[:4]))
