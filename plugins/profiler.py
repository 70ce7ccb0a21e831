"""Built-in `profiler`: `jax.profiler` traces into `logdir`, of a step range or periodically.

`Config.profile_steps=(first, last)` traces global steps `first..last`: a step
timer starts the trace at the boundary before step `first` (right after step
`first - 1`) and another stops it after step `last`, once the device has
finished it. A resumed run past `first` traces what is left of the range.

`Config.profile_every_secs` traces periodically, as clu's ``Profile`` action:
every that many seconds a trace starts at a step boundary and stops once it has
lasted at least `profile_min_secs` and covered at least `profile_min_steps`
steps. The first trace starts one interval into the session (after the
compile); a trace still running at a normal stop is finished there. A trace
due while another runs is skipped.

No per-step hook. TensorBoard's profile tab reads each trace from
``logdir/plugins/profile/<run>/<host>.xplane.pb``. Every process traces (one
file per host).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from loopkit import storage
from loopkit.config import Config
from loopkit.plugin.hookspec import hookimpl

if TYPE_CHECKING:
    from loopkit.loop.session import Session

__all__ = ["ProfilerPlugin", "plugin"]

INACTIVE = "needs Config.profile_steps or Config.profile_every_secs, and Config.logdir"

log = logging.getLogger("loopkit")


class ProfilerPlugin:
    """Traces `profile_steps` and/or a window every `profile_every_secs`."""

    def __init__(self, config: Config) -> None:
        self.first, self.last = config.profile_steps or (None, None)
        self.every_secs = config.profile_every_secs
        self.min_secs, self.min_steps = config.profile_min_secs, config.profile_min_steps
        #: the global step at which tracing of `profile_steps` started / stopped (None: not yet)
        self.started_at: int | None = None
        self.stopped_at: int | None = None
        #: (first step, last step) of every trace taken, in order
        self.traces: list[tuple[int, int]] = []
        self._timer: Any = None
        self._window: Any = None  # the periodic trace's stop timer while it runs
        self._since = (0, 0.0)  # (step, time) the current trace started
        self._tracing = False
        self._local: str | None = None  # the local trace directory of a URL logdir

    @hookimpl(tryfirst=True)  # built-in services start before other plugins'
    def session_create(self, session: Session) -> None:
        step = session.step
        if self.every_secs is not None:
            session.every(self._periodic_start, secs=self.every_secs, name="profiler")
        if self.last is None or step >= self.last:
            return  # no range, or resumed past it
        if step >= self.first - 1:
            self._start(session)
        else:
            self._timer = session.at_step(self.first - 1, self._start, name="profiler")

    def _trace(self, session: Session) -> None:
        where = session.logdir
        if storage.is_url(where):  # traced locally, uploaded when the trace stops
            where = self._local = tempfile.mkdtemp(prefix="loopkit-profile-")
        jax.profiler.start_trace(str(where))
        self._tracing = True
        self._since = (session.step, session.clock())

    def _untrace(self, session: Session, wait: bool) -> None:
        try:
            if wait:
                jax.block_until_ready(session.state)  # the trace holds the last step's work
        finally:
            jax.profiler.stop_trace()
            self._tracing = False
            self.traces.append((self._since[0] + 1, session.step))
            local, self._local = self._local, None
            if local is not None:
                try:
                    storage.upload_tree(Path(local), str(session.logdir))
                finally:
                    shutil.rmtree(local, ignore_errors=True)

    def _start(self, session: Session) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._tracing:  # a periodic trace is running: the range takes over from here
            self._window.cancel()
            self._window = None
        else:
            self._trace(session)
        self.started_at = session.step
        log.info("loopkit: profiling steps %d..%d into %s", session.step + 1, self.last,
                 session.logdir)
        self._timer = session.at_step(self.last, self._stop, name="profiler")

    def _stop(self, session: Session, wait: bool = True) -> None:
        self._timer.cancel()
        try:
            self._untrace(session, wait)
        finally:
            self.stopped_at = session.step

    def _periodic_start(self, session: Session) -> None:
        if self._tracing:
            return
        self._trace(session)
        log.info("loopkit: profiling from step %d for at least %g s and %d steps into %s",
                 session.step + 1, self.min_secs, self.min_steps, session.logdir)
        steps = self.min_steps
        self._window = session.every(self._periodic_stop, secs=self.min_secs or None,
                                     steps=steps, name="profiler")

    def _periodic_stop(self, session: Session) -> None:
        step, start = session.step - self._since[0], self._since[1]
        if step < self.min_steps or session.clock() - start < self.min_secs:
            return  # not long enough yet: the timer fires again
        self._window.cancel()
        self._window = None
        self._untrace(session, wait=True)

    @hookimpl
    def on_stop(self, session: Session, error: BaseException | None) -> None:
        if not self._tracing:
            return
        if self._window is not None:
            self._window = None
            self._untrace(session, wait=error is None)
        else:
            self._stop(session, wait=error is None)


def plugin(config: Config) -> ProfilerPlugin | None:
    if config.profile_steps is None and config.profile_every_secs is None:
        return None
    if config.logdir is None:
        asked = " and ".join(f"Config.{k}={getattr(config, k)!r}"
                             for k in ("profile_steps", "profile_every_secs")
                             if getattr(config, k) is not None)
        log.warning("loopkit: %s is ignored: the profiler writes into Config.logdir, which "
                    "is None", asked)
        return None
    return ProfilerPlugin(config)
