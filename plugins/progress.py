"""Built-in `progress`: a tqdm bar on a terminal, periodic `"loopkit"` log lines otherwise.

Nothing per step: on a terminal a timer moves the bar every `BAR_SECS` by the
step delta and refreshes the latest metrics every `METRICS_SECS`; elsewhere
(a log file, a batch job) it logs at INFO on the ``"loopkit"`` logger one line
at the start (``starting at step N`` / ``resumed at step N``), one every
`LOG_SECS` of wall time (step, steps/s, latest metrics) and one at the stop
(final step, steps/s, latest metrics). Chief only. Off with
``Config(progress=False)``.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any, Mapping, TextIO

from loopkit.config import Config
from loopkit.hookspec import hookimpl

if TYPE_CHECKING:
    from loopkit.session import Session

__all__ = ["BAR_SECS", "LOG_SECS", "METRICS_SECS", "ProgressPlugin", "format_metrics", "plugin"]

INACTIVE = "Config.progress is False"

#: seconds between log lines when stderr is not a terminal
LOG_SECS = 10.0
#: seconds between bar updates on a terminal (no device sync: a step count)
BAR_SECS = 0.25
#: seconds between metric refreshes on the bar (each waits for the latest step)
METRICS_SECS = 1.0

log = logging.getLogger("loopkit")


def format_metrics(metrics: Mapping[str, Any]) -> dict[str, str]:
    """Host metrics as short strings; arrays are left out (they belong in TensorBoard)."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, float):
            out[k] = f"{v:.4g}"
        elif isinstance(v, (str, int)):
            out[k] = str(v)
    return out


def _line(metrics: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in format_metrics(metrics).items())


class ProgressPlugin:
    """Shows how far the run is: a bar on a terminal, log lines otherwise."""

    def __init__(self, config: Config, stream: TextIO | None = None,
                 log_secs: float = LOG_SECS, bar_secs: float = BAR_SECS) -> None:
        self.config = config
        self.stream = stream  # None: sys.stderr when the session starts
        self.log_secs, self.bar_secs = log_secs, bar_secs
        self.bar: Any = None
        self._active = False
        self._start_step = self._last_step = 0
        self._start_time = self._last_time = self._metrics_time = 0.0

    @hookimpl(tryfirst=True)  # built-in services start before other plugins'
    def session_create(self, session: Session) -> None:
        if not session.is_chief:
            return
        self._active = True
        step, now = session.step, session.clock()
        self._start_step = self._last_step = step
        self._start_time = self._last_time = self._metrics_time = now
        stream = self.stream if self.stream is not None else sys.stderr
        isatty = getattr(stream, "isatty", None)
        if isatty is not None and isatty():
            from tqdm import tqdm

            # the timer below is the rate limit: tqdm redraws on every update
            self.bar = tqdm(total=self.config.max_steps, initial=step, unit="step",
                            file=stream, dynamic_ncols=True, mininterval=0, miniters=1,
                            desc="resumed" if session.restored is not None else None)
            session.every(self._update_bar, secs=self.bar_secs, name="progress")
        else:
            of = "" if self.config.max_steps is None else f" of {self.config.max_steps}"
            verb = "resumed" if session.restored is not None else "starting"
            log.info("loopkit: %s at step %d%s", verb, step, of)
            session.every(self._log, secs=self.log_secs, name="progress")

    def _rate(self, session: Session) -> float | None:
        step, now = session.step, session.clock()
        rate = (step - self._last_step) / (now - self._last_time) if now > self._last_time else None
        self._last_step, self._last_time = step, now
        return rate

    def _log(self, session: Session) -> None:
        rate = self._rate(session)
        of = "" if self.config.max_steps is None else f"/{self.config.max_steps}"
        speed = "" if rate is None else f", {rate:.4g} steps/s"
        metrics = _line(session.host_metrics())
        log.info("loopkit: step %d%s%s%s", session.step, of, speed,
                 f", {metrics}" if metrics else "")

    def _update_bar(self, session: Session) -> None:
        now = session.clock()
        if now - self._metrics_time >= METRICS_SECS:
            self._metrics_time = now
            self.bar.set_postfix(format_metrics(session.host_metrics()), refresh=False)
        self.bar.update(session.step - self.bar.n)

    @hookimpl
    def on_stop(self, session: Session, error: BaseException | None) -> None:
        if not self._active:
            return
        step, bar = session.step, self.bar
        elapsed = session.clock() - self._start_time
        ran = step - self._start_step
        try:
            metrics = session.host_metrics() if error is None else {}
            if bar is not None:
                if metrics:
                    bar.set_postfix(format_metrics(metrics), refresh=False)
                bar.update(step - bar.n)
                return
            speed = f", {ran / elapsed:.4g} steps/s" if elapsed > 0 and ran > 0 else ""
            how = "" if error is None else f" by {type(error).__name__}"
            line = _line(metrics)
            log.info("loopkit: stopped at step %d%s after %.4g s%s%s", step, how, elapsed,
                     speed, f"; {line}" if line else "")
        finally:
            if bar is not None:
                bar.close()


def plugin(config: Config) -> ProgressPlugin | None:
    return ProgressPlugin(config) if config.progress else None
