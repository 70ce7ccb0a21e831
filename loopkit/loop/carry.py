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

from typing import Any, Callable, Mapping, Protocol, Sequence

__all__ = ["CarriedMetrics", "StepCarry", "attach", "first_values", "update_all"]

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
        #: set by `init` when the carried value also holds the step's latest metrics:
        #: ``metrics_of(value) -> {name: array}``. The compiled step then returns no
        #: metric arrays of its own (one output less per metric) when no plugin needs
        #: them per step, and `session.metrics` reads them from the carry.
        self.metrics_of: Callable[[PyTree], Mapping[str, Any]] | None = None
        self._store: CarryStore | None = None
        self._index = 0
        self._value: PyTree = None  # until the session threads it

    @property
    def value(self) -> PyTree:
        store = self._store
        if store is None:
            return self._value
        values = store.carry_values
        return None if values is None else values[self._index]

    @value.setter
    def value(self, new: PyTree) -> None:
        store = self._store
        if store is None or store.carry_values is None:
            self._value = new
            return
        values = list(store.carry_values)
        values[self._index] = new
        store.carry_values = tuple(values)


class CarriedMetrics(Mapping):
    """`session.metrics` when a carry holds them: the latest values, read on demand.

    Reading a metric slices the carried value (a device operation), so read them on
    a timer, as every metric should be read; the object itself stays the same from
    step to step.
    """

    def __init__(self, carry: StepCarry) -> None:
        self._carry = carry
        self._seen: tuple[Any, Mapping[str, Any]] = (None, {})

    def _now(self) -> Mapping[str, Any]:
        value = self._carry.value
        if value is None or self._carry.metrics_of is None:
            return {}
        if self._seen[0] is not value:  # read once per carried value
            self._seen = (value, self._carry.metrics_of(value))
        return self._seen[1]

    def __getitem__(self, name: str) -> Any:
        return self._now()[name]

    def __iter__(self) -> Any:
        return iter(self._now())

    def __len__(self) -> int:
        return len(self._now())


class CarryStore(Protocol):
    """Where the carries' values live between steps (the compiled step's `live`)."""

    carry_values: tuple | None


def attach(carries: Sequence[StepCarry], store: CarryStore) -> None:
    """Make `carries` read and write their values in `store.carry_values`."""
    for i, c in enumerate(carries):
        c._store, c._index = store, i


def first_values(carries: Sequence[StepCarry], like_state: PyTree,
                 like_metrics: Mapping[str, Any]) -> tuple:
    """The carries' values before the first step (a value set beforehand wins)."""
    return tuple(c._value if c._value is not None else c.init(like_state, like_metrics)
                 for c in carries)


def update_all(carries: Sequence[StepCarry], values: tuple, state: PyTree,
               metrics: Mapping[str, Any]) -> tuple:
    """Every carry's next value, traced inside the step after ``step_fn``."""
    return tuple(c.update(v, state, metrics) for c, v in zip(carries, values))
