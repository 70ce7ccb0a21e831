"""loopkit-example-plugin: a third-party plugin, registered through an entry point."""

from __future__ import annotations

import logging
import os

import loopkit

log = logging.getLogger("loopkit")

ENV = "LOOPKIT_TIME_LIMIT_SECS"


class TimeLimit:
    """Stop the run after `LOOPKIT_TIME_LIMIT_SECS` seconds of training (a normal stop).

    Entry-point plugins are built with no arguments, so the limit comes from the
    environment; unset, the plugin does nothing and costs nothing. The check is a
    timer of the session's scheduler, not a per-step hook.
    """

    def __init__(self, limit_secs: float | None = None) -> None:
        if limit_secs is None and os.environ.get(ENV):
            try:
                limit_secs = float(os.environ[ENV])
            except ValueError:
                raise ValueError(f"{ENV}={os.environ[ENV]!r} must be a number of seconds") from None
        if limit_secs is not None and limit_secs <= 0:
            raise ValueError(f"TimeLimit(limit_secs={limit_secs!r}): must be > 0")
        self.limit_secs = limit_secs
        self.expired_at: int | None = None

    @loopkit.hookimpl
    def session_create(self, session: loopkit.Session) -> None:
        if self.limit_secs is not None:
            session.every(self._expire, secs=self.limit_secs, name="time_limit")

    def _expire(self, session: loopkit.Session) -> None:
        self.expired_at = session.step
        log.warning("loopkit: time limit of %s s reached at step %d; stopping",
                    self.limit_secs, session.step)
        session.request_stop()
