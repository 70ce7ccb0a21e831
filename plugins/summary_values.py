"""Which metrics a summary shows (`Config.summary_metrics`) and their interval mean.

`chosen` keeps the metrics whose names match the patterns. `IntervalMean` is the
`StepCarry` behind ``Config.summary_reduce="mean"``: it adds each chosen
metric to a running sum inside the jitted step (the scalars packed in one vector
with the step count, so the step gains one input and one output array, not one
per metric) and turns the sums into means when a summary is written.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from loopkit.loop.carry import StepCarry

__all__ = ["IntervalMean", "chosen", "is_chosen"]


def is_chosen(name: str, patterns: Sequence[str] | None) -> bool:
    """Whether metric `name` matches one of `patterns` (None: every name)."""
    return patterns is None or any(fnmatch.fnmatchcase(name, p) for p in patterns)


def chosen(metrics: Mapping[str, Any], patterns: Sequence[str] | None) -> dict[str, Any]:
    """The metrics whose names match `patterns`, in their order.

    >>> chosen({"loss": 1.0, "acc": 0.5, "denominator": 8}, ("loss", "acc*"))
    {'loss': 1.0, 'acc': 0.5}
    """
    if patterns is None:
        return dict(metrics)
    return {k: v for k, v in metrics.items() if is_chosen(k, patterns)}


def _averaged(like: Any) -> bool:
    return np.dtype(like.dtype).kind in "biuf"


def _placed_like(new: Any, old: Any) -> Any:
    """`new` placed as `old` is: on its sharding when it is committed, else uncommitted."""
    if isinstance(old, jax.Array) and old.committed:
        return jax.device_put(new, old.sharding)
    return jnp.asarray(new)


class IntervalMean:
    """Each chosen metric's mean over the steps since the last `take`, summed on device."""

    def __init__(self, patterns: Sequence[str] | None) -> None:
        self.patterns = patterns
        #: names summed in the packed vector (scalars) and as their own arrays
        self.scalars: list[str] = []
        self.arrays: list[str] = []
        #: every metric, when all are scalars of the sums' dtype: their latest values
        #: ride at the end of the packed vector and the step returns no metric arrays
        self.latest: list[str] = []
        self._like: Any = None
        self.carry = StepCarry(self._init, self._update, name="Config.summary_reduce='mean'")

    def _init(self, state: Any, metrics: Any) -> Any:
        if not isinstance(metrics, Mapping):
            metrics = {}
        dtype = jnp.result_type(float)  # float32, or float64 with x64 on
        for name, like in metrics.items():
            if isinstance(name, str) and is_chosen(name, self.patterns) and _averaged(like):
                (self.scalars if like.ndim == 0 else self.arrays).append(name)
        # Exact only when every metric already has the vector's dtype (an int count
        # would be rounded in float32): otherwise the step returns its metrics as usual.
        if metrics and all(isinstance(k, str) and getattr(v, "shape", None) == ()
                           and v.dtype == dtype for k, v in metrics.items()):
            self.latest = list(metrics)
            self.carry.metrics_of = self._latest
        self._like = (
            jax.ShapeDtypeStruct((len(self.scalars) + 1 + len(self.latest),), dtype),
            {k: jax.ShapeDtypeStruct(metrics[k].shape, dtype) for k in self.arrays},
        )
        return self._zeros()

    def _zeros(self, like: Any = None) -> Any:
        """Zeros shaped as ``like`` (the whole carry by default)."""
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                            self._like if like is None else like)

    def _update(self, value: Any, state: Any, metrics: Mapping[str, Any]) -> Any:
        packed, arrays = value
        dtype = packed.dtype
        n = len(self.scalars) + 1
        step = jnp.stack([jnp.asarray(metrics[k]).astype(dtype) for k in self.scalars]
                         + [jnp.ones((), dtype)])
        arrays = {k: a + jnp.asarray(metrics[k]).astype(dtype) for k, a in arrays.items()}
        if not self.latest:
            return packed + step, arrays
        latest = jnp.stack([jnp.asarray(metrics[k]) for k in self.latest])
        return jnp.concatenate([packed[:n] + step, latest]), arrays

    def _latest(self, value: Any) -> dict[str, Any]:
        """The step's latest metrics, from the end of the packed vector (device slices)."""
        packed, n = value[0], len(self.scalars) + 1
        return {k: packed[n + i] for i, k in enumerate(self.latest)}

    def restart(self) -> None:
        """Drop the sums (a rollback abandoned the steps they hold); the next mean
        covers the steps from now on. Call it at a step boundary, as `take`."""
        value = self.carry.value
        if value is not None:
            packed = np.array(jax.device_get(value[0]))  # a copy: device_get may give a view
            packed[:len(self.scalars) + 1] = 0  # the latest values (if any) stay
            self.carry.value = jax.tree.map(_placed_like, (packed, self._zeros(self._like[1])),
                                            value)

    def take(self) -> dict[str, Any]:
        """The means since the last `take` (host values), and a fresh sum.

        Empty when no step ran since. Call it at a step boundary (a timer or
        `on_stop`): the next step donates the sums.
        """
        value = self.carry.value
        if value is None:
            return {}
        packed, arrays = jax.device_get(value)
        n = len(self.scalars) + 1
        count = packed[n - 1]
        if count == 0:
            return {}
        head = np.zeros_like(packed)
        head[n:] = packed[n:]  # the sums start again; the latest values (if any) stay
        # placed exactly as the sums they replace: the step's signature never changes
        # (under jax.set_mesh an uncommitted array would compile the step again)
        self.carry.value = jax.tree.map(_placed_like, (head, self._zeros(self._like[1])),
                                        value)
        means: dict[str, Any] = {k: float(s / count) for k, s in zip(self.scalars, packed)}
        means.update({k: a / count for k, a in arrays.items()})
        return means
