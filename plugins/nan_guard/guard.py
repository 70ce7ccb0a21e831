"""The NaN and spike guard itself: `NanGuardPlugin` and its running median.

A bad value of the metric `Config.nan_guard` names fails the run (a subclass rolls it
back instead: `Config.on_guard="rollback"`, see `plugins/rollback.py`).

A value is bad when it is not finite, or, with `Config.spike_threshold`, when it
exceeds that many times the median of the last `Config.spike_window` good values
(once half a window has been seen). Opt-in, so it may use `after_step`, but it
never waits for the step that just ran: after step N+1 has been dispatched it
checks step N's value, whose transfer was started asynchronously a step earlier,
so the device stays busy while the host looks. The final step's value is checked
at a normal stop.
"""

from __future__ import annotations

import bisect
import collections
from typing import TYPE_CHECKING, Any, Mapping

import jax
import numpy as np

from loopkit.config import Config
from loopkit.errors import NonFiniteError, SpikeError
from loopkit.plugin.hookspec import hookimpl

if TYPE_CHECKING:
    from loopkit.loop.session import Session

__all__ = ["NanGuardPlugin", "RunningMedian"]

INACTIVE = "Config.nan_guard names no metric"


class RunningMedian:
    """The median of the last `size` values added: a sorted copy kept beside their order,
    so a new value costs two bisections, not a sort."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.order: collections.deque[float] = collections.deque()
        self.sorted: list[float] = []

    def add(self, value: float) -> None:
        self.order.append(value)
        bisect.insort(self.sorted, value)
        if len(self.order) > self.size:
            del self.sorted[bisect.bisect_left(self.sorted, self.order.popleft())]

    def median(self) -> float | None:
        """The median, or None until half a window has been seen."""
        s, n = self.sorted, len(self.sorted)
        if 2 * n < self.size:
            return None
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2

    def clear(self) -> None:
        self.order.clear()
        self.sorted.clear()


class NanGuardPlugin:
    """Raises `loopkit.NonFiniteError` (or `loopkit.SpikeError`) one step after a bad value."""

    def __init__(self, config: Config) -> None:
        self.metric: str = config.nan_guard  # type: ignore[assignment]
        self.threshold = config.spike_threshold
        self.window = RunningMedian(config.spike_window) if self.threshold else None
        self._pending: tuple[int, Any] | None = None  # (step, value) not checked yet
        self._guarded = False  # a transfer guard refused the prefetch once

    @hookimpl
    def after_step(self, session: Session, step: int, metrics: Mapping[str, Any]) -> None:
        try:
            value = metrics[self.metric]
        except (KeyError, TypeError, IndexError):
            available = sorted(metrics) if isinstance(metrics, Mapping) else metrics
            raise ValueError(
                f"Config.nan_guard={self.metric!r} names no metric of the step function; "
                f"the metrics at step {step} are {available!r}"
            ) from None
        copy = getattr(value, "copy_to_host_async", None)
        if copy is not None:  # start the transfer now; it is read one step later
            if not self._guarded:
                try:
                    copy()
                except jax.errors.JaxRuntimeError as e:
                    if "isallowed" not in str(e):  # "Disallowed device-to-host transfer"
                        raise
                    # the user's transfer guard forbids implicit transfers, and newer
                    # jax counts this prefetch as one; the check reads with an
                    # explicit `jax.device_get`, so the guard allows it here too
                    self._guarded = True
            if self._guarded:
                with jax.transfer_guard_device_to_host("allow"):
                    copy()
        pending, self._pending = self._pending, (step, value)
        if pending is not None:
            bad = self._check(*pending)
            if bad is not None:
                self._bad(session, bad)

    @hookimpl
    def on_stop(self, session: Session, error: BaseException | None) -> None:
        pending, self._pending = self._pending, None
        if error is None and pending is not None:
            bad = self._check(*pending)  # the last step has no next step to trail it
            if bad is not None:
                raise bad

    def _bad(self, session: Session, error: NonFiniteError) -> None:
        """What a bad value does: here, fail the run."""
        raise error

    def _check(self, step: int, value: Any) -> NonFiniteError | None:
        """The error step `step`'s value calls for, or None when it is good."""
        host = np.asarray(jax.device_get(value))
        if host.dtype.kind not in "biufc":
            raise TypeError(
                f"Config.nan_guard={self.metric!r}: the metric at step {step} is "
                f"{type(value).__name__} {value!r}, not a number"
            )
        finite = np.isfinite(host)
        if not finite.all():
            bad = host if host.ndim == 0 else host[~finite][0]
            return NonFiniteError(self.metric, step, bad.item())
        window = self.window
        if window is not None:
            x = float(host.real.max()) if host.ndim else float(host.real)
            median = window.median()
            if median is not None and median > 0 and x > self.threshold * median:
                return SpikeError(self.metric, step, x, median, self.threshold)
            window.add(x)
        return None
