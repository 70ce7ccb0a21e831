"""Built-in `profiler`: trace global steps `first..last` with `jax.profiler` into `logdir`.

No per-step hook: a step timer starts the trace at the boundary before step
`first` (right after step `first - 1`) and another stops it after step `last`,
once the device has finished it. TensorBoard's profile tab reads the trace from
``logdir/plugins/profile/<run>/<host>.xplane.pb``. Every process traces (one
file per host). A resumed run past `first` traces what is left of the range.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import jax

from loopkit.config import Config
from loopkit.hookspec import hookimpl

if TYPE_CHECKING:
    from loopkit.session import Session

__all__ = ["ProfilerPlugin", "plugin"]

INACTIVE = "needs Config.profile_steps and Config.logdir"

log = logging.getLogger("loopkit")


class ProfilerPlugin:
    """Starts `jax.profiler` before step `first` and stops it after step `last`."""

    def __init__(self, config: Config) -> None:
        self.first, self.last = config.profile_steps  # type: ignore[misc]
        #: the global step at which tracing started / stopped (None: not yet)
        self.started_at: int | None = None
        self.stopped_at: int | None = None
        self._timer: Any = None

    @hookimpl(tryfirst=True)  # built-in services start before other plugins'
    def session_create(self, session: Session) -> None:
        step = session.step
        if step >= self.last:
            return  # resumed past the range
        if step >= self.first - 1:
            self._start(session)
        else:
            # fires at the first multiple of first-1 after `step`: first-1 itself
            self._timer = session.every(self._start, steps=self.first - 1, name="profiler")

    def _start(self, session: Session) -> None:
        if self._timer is not None:
            self._timer.cancel()
        jax.profiler.start_trace(str(session.logdir))
        self.started_at = session.step
        log.info("loopkit: profiling steps %d..%d into %s", session.step + 1, self.last,
                 session.logdir)
        # fires at the first multiple of `last` after the current step: `last`
        self._timer = session.every(self._stop, steps=self.last, name="profiler")

    def _stop(self, session: Session, wait: bool = True) -> None:
        self._timer.cancel()
        try:
            if wait:
                jax.block_until_ready(session.state)  # the trace holds the last step's work
        finally:
            jax.profiler.stop_trace()
            self.stopped_at = session.step

    @hookimpl
    def on_stop(self, session: Session, error: BaseException | None) -> None:
        if self.started_at is not None and self.stopped_at is None:
            self._stop(session, wait=error is None)


def plugin(config: Config) -> ProfilerPlugin | None:
    if config.profile_steps is None:
        return None
    if config.logdir is None:
        log.warning("loopkit: Config.profile_steps=%r is ignored: the profiler writes into "
                    "Config.logdir, which is None", config.profile_steps)
        return None
    return ProfilerPlugin(config)
