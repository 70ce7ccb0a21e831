"""Built-in `nan_guard`: fail the run when the metric `Config.nan_guard` names is not finite.

Opt-in, so it may use `after_step`, but it never waits for the step that just
ran: after step N+1 has been dispatched it checks step N's value, whose
transfer was started asynchronously a step earlier, so the device stays busy
while the host looks. The final step's value is checked at a normal stop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import jax
import numpy as np

from loopkit.config import Config
from loopkit.errors import NonFiniteError
from loopkit.hookspec import hookimpl

if TYPE_CHECKING:
    from loopkit.session import Session

__all__ = ["NanGuardPlugin", "plugin"]

INACTIVE = "Config.nan_guard names no metric"


class NanGuardPlugin:
    """Raises `loopkit.NonFiniteError(metric, step, value)` one step after a bad value."""

    def __init__(self, config: Config) -> None:
        self.metric: str = config.nan_guard  # type: ignore[assignment]
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
            self._check(*pending)

    @hookimpl
    def on_stop(self, session: Session, error: BaseException | None) -> None:
        pending, self._pending = self._pending, None
        if error is None and pending is not None:
            self._check(*pending)  # the last step has no next step to trail it

    def _check(self, step: int, value: Any) -> None:
        host = np.asarray(jax.device_get(value))
        if host.dtype.kind not in "biufc":
            raise TypeError(
                f"Config.nan_guard={self.metric!r}: the metric at step {step} is "
                f"{type(value).__name__} {value!r}, not a number"
            )
        finite = np.isfinite(host)
        if not finite.all():
            bad = host if host.ndim == 0 else host[~finite][0]
            raise NonFiniteError(self.metric, step, bad.item())


def plugin(config: Config) -> NanGuardPlugin | None:
    return NanGuardPlugin(config) if config.nan_guard else None
