"""`StepCarry`: a value a plugin threads through the jitted step, on device.

A plugin that needs something computed every step (a running sum of metrics, an
average of the weights) returns a `StepCarry` from the `step_carry` hook. loopkit
then jits ``step_fn`` together with every carry's `update`, so the work happens
inside the one compiled step, with no per-step host work and no extra dispatch;
the carry's arrays are donated with the state.

>>> import jax.numpy as jnp, loopkit
>>> class CountSteps:
...     @loopkit.hookimpl
...     def step_carry(self):
...         self.carry = loopkit.StepCarry(lambda state, metrics: jnp.zeros((), jnp.int32),
...                                        lambda n, state, metrics: n + 1)
...         return self.carry
>>> counter = CountSteps()
>>> _ = loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(()), max_steps=3,
...                   plugins=[counter], progress=False)
>>> int(counter.carry.value)
3
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax

__all__ = ["StepCarry", "with_carries"]

PyTree = Any


class StepCarry:
    """A pytree of arrays carried from step to step inside the jitted step.

    `init(state, metrics)` builds the first value from the abstract state and
    metrics (`jax.ShapeDtypeStruct` leaves) of the first step; `update(value,
    state, metrics)` runs traced inside the step, after ``step_fn``, with the
    new state and the step's metrics, and returns the next value. A step
    function that is already jitted is called as given, so it cannot carry
    anything: the session then refuses to start, naming `name`.

    `value` holds the latest value (None before the first step). Read or
    replace it from a timer action (`session.every`) or a hook, never from a
    thread: the next step donates it, so copy what you need to the host (or
    replace it with fresh arrays, e.g. to reset a sum) before the loop goes on.
    """

    def __init__(self, init: Callable[[PyTree, Mapping[str, Any]], PyTree],
                 update: Callable[[PyTree, PyTree, Mapping[str, Any]], PyTree],
                 name: str = "a plugin's StepCarry") -> None:
        self.init = init
        self.update = update
        #: what asks for the carry, in errors (e.g. ``"Config.summary_reduce='mean'"``)
        self.name = name
        self._store: _Store | None = None
        self._index = 0
        self._value: PyTree = None  # until the session threads it

    @property
    def value(self) -> PyTree:
        store = self._store
        if store is None:
            return self._value
        return None if store.values is None else store.values[self._index]

    @value.setter
    def value(self, new: PyTree) -> None:
        store = self._store
        if store is None or store.values is None:
            self._value = new
            return
        values = list(store.values)
        values[self._index] = new
        store.values = tuple(values)


class _Store:
    """Every carry's value in one tuple, so the step reads and writes it in one go."""

    values: tuple | None = None


def with_carries(step_fn: Callable[..., Any], carries: Sequence[StepCarry]
                 ) -> tuple[Callable[..., Any], Callable[[Callable[..., Any]], Callable[..., Any]]]:
    """Fold `carries` into `step_fn`.

    Returns ``(inner, host)``: `inner((state, values), *batch) -> ((state, values),
    metrics)` is what to jit (the carried values ride with the state, so they are
    donated with it), and `host(jitted)` turns a jitted `inner` back into the
    ``(state, *batch) -> (state, metrics)`` the loop calls, keeping each carry's
    `value` up to date.
    """
    carries = tuple(carries)
    store = _Store()
    for i, c in enumerate(carries):
        c._store, c._index = store, i

    def inner(pair: tuple[PyTree, tuple], *batch: Any) -> Any:
        state, values = pair
        state, metrics = step_fn(state, *batch)
        values = tuple(c.update(v, state, metrics) for c, v in zip(carries, values))
        return (state, values), metrics

    def start(state: Any, *batch: Any) -> None:
        # the carries' shapes follow the metrics, known once a batch is seen
        like_state, like_metrics = jax.eval_shape(step_fn, state, *batch)
        store.values = tuple(
            c._value if c._value is not None else c.init(like_state, like_metrics)
            for c in carries
        )

    def host(jitted: Callable[..., Any]) -> Callable[..., Any]:
        def call(state: Any, *batch: Any) -> Any:
            if store.values is None:
                start(state, *batch)
            (state, store.values), metrics = jitted((state, store.values), *batch)
            return state, metrics

        return call

    return inner, host
