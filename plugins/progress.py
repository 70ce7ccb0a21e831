"""Built-in `progress`: a tqdm bar on a terminal, periodic `"loopkit"` log lines otherwise.

Nothing per step: on a terminal a timer moves the bar every `BAR_SECS` by the
step delta (the bar shows the step rate) and refreshes the latest metrics every
`METRICS_SECS`; while the bar is shown, log records print above it (tqdm's
logging redirect). Elsewhere (a log file, a batch job) it logs at INFO on the
``"loopkit"`` logger one line at the start (``starting at step N`` / ``resumed
at step N``), one every `Config.progress_secs` of wall time (step, steps/s, the
ETA when `max_steps` is set, the latest metrics, and where the time went since
the previous line: the step, the input wait and each timer by name, as clu's
ReportProgress) and one at the stop (final step, steps/s, latest metrics, the
time shares of the whole session). The metrics shown are those that
`Config.summary_metrics` chooses. Chief only. Off with ``Config(progress=False)``.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any, Mapping, TextIO

from loopkit.config import Config
from loopkit.plugin.hookspec import hookimpl
from loopkit.loop.stash import StashKey
from loopkit.plugins.summary_values import chosen

if TYPE_CHECKING:
    from loopkit.loop.session import Session

__all__ = ["BAR_SECS", "LOG_SECS", "METRICS_SECS", "RATE_SHOWN", "ProgressPlugin",
           "format_duration", "format_metrics", "plugin", "time_shares"]

INACTIVE = "Config.progress is False"

#: seconds between log lines when stderr is not a terminal (`Config.progress_secs`' default)
LOG_SECS = 10.0
#: True in `session.stash` while a bar shows the step rate: others need not log it
RATE_SHOWN = StashKey[bool]()

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


def format_duration(secs: float) -> str:
    """A short human duration.

    >>> format_duration(42.4), format_duration(125), format_duration(7384)
    ('42 s', '2 min 5 s', '2 h 3 min')
    """
    secs = int(round(secs))
    if secs < 60:
        return f"{secs} s"
    minutes, secs = divmod(secs, 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    return f"{minutes // 60} h {minutes % 60} min"


def time_shares(elapsed: float, input_wait: float, timers: Mapping[str, float]) -> str:
    """Where `elapsed` seconds went: the step (the rest), the input wait, each timer.

    >>> time_shares(10.0, 0.5, {"checkpoint": 1.0, "summaries": 0.0})
    '85% step, 5% input, 10% checkpoint'
    """
    if elapsed <= 0:
        return ""
    busy = {name: secs for name, secs in timers.items() if secs > 0}
    step = max(elapsed - input_wait - sum(busy.values()), 0.0)
    parts = [("step", step), ("input", input_wait), *busy.items()]
    return ", ".join(f"{100 * secs / elapsed:.3g}% {name}" for name, secs in parts)


class ProgressPlugin:
    """Shows how far the run is: a bar on a terminal, log lines otherwise."""

    def __init__(self, config: Config, stream: TextIO | None = None,
                 log_secs: float | None = None, bar_secs: float = BAR_SECS) -> None:
        self.config = config
        self.stream = stream  # None: sys.stderr when the session starts
        self.log_secs = config.progress_secs if log_secs is None else log_secs
        self.bar_secs = bar_secs
        self.bar: Any = None
        self._active = False
        self._redirect: Any = None
        self._last_input = 0.0
        self._last_timers: dict[str, float] = {}
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
            session.stash[RATE_SHOWN] = True
            from tqdm.contrib.logging import logging_redirect_tqdm

            # log records (loopkit's and the user's) print above the bar, not through it
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()
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

    def _metrics(self, session: Session) -> dict[str, Any]:
        return chosen(session.host_metrics(), self.config.summary_metrics)

    def _shares(self, session: Session) -> str:
        """The time shares since the previous line."""
        stats, elapsed = session.stats, session.clock() - self._last_time
        timers = {k: v - self._last_timers.get(k, 0.0) for k, v in stats.timer_secs.items()}
        shares = time_shares(elapsed, stats.input_wait_secs - self._last_input, timers)
        self._last_input, self._last_timers = stats.input_wait_secs, dict(stats.timer_secs)
        return shares

    def _log(self, session: Session) -> None:
        shares = self._shares(session)
        rate = self._rate(session)
        step, max_steps = session.step, self.config.max_steps
        parts = [f"loopkit: step {step}"]
        if max_steps is not None:
            parts[0] += f"/{max_steps}"
        if rate is not None:
            parts.append(f"{rate:.4g} steps/s")
            if max_steps is not None and rate > 0:
                parts.append(f"ETA {format_duration((max_steps - step) / rate)}")
        metrics = _line(self._metrics(session))
        if metrics:
            parts.append(metrics)
        log.info("%s%s", ", ".join(parts), f"; time: {shares}" if shares else "")

    def _update_bar(self, session: Session) -> None:
        now = session.clock()
        if now - self._metrics_time >= METRICS_SECS:
            self._metrics_time = now
            self.bar.set_postfix(format_metrics(self._metrics(session)), refresh=False)
        self.bar.update(session.step - self.bar.n)

    @hookimpl
    def on_stop(self, session: Session, error: BaseException | None) -> None:
        if not self._active:
            return
        step, bar = session.step, self.bar
        elapsed = session.clock() - self._start_time
        ran = step - self._start_step
        try:
            metrics = self._metrics(session) if error is None else {}
            if bar is not None:
                if metrics:
                    bar.set_postfix(format_metrics(metrics), refresh=False)
                bar.update(step - bar.n)
                return
            speed = f", {ran / elapsed:.4g} steps/s" if elapsed > 0 and ran > 0 else ""
            how = "" if error is None else f" by {type(error).__name__}"
            line = _line(metrics)
            stats = session.stats
            shares = time_shares(elapsed, stats.input_wait_secs, stats.timer_secs)
            log.info("loopkit: stopped at step %d%s after %.4g s%s%s%s", step, how, elapsed,
                     speed, f"; {line}" if line else "", f"; time: {shares}" if shares else "")
        finally:
            if bar is not None:
                bar.close()
            if self._redirect is not None:
                self._redirect.__exit__(None, None, None)
                self._redirect = None


def plugin(config: Config) -> ProgressPlugin | None:
    return ProgressPlugin(config) if config.progress else None
