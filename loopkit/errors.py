"""Exceptions loopkit raises on purpose."""

from __future__ import annotations

__all__ = ["CheckpointError", "HANG_EXIT_CODE", "LogdirInUseError", "NonFiniteError",
           "PluginError"]

#: The exit code of a process the hang watchdog ended (`EX_TEMPFAIL`): try again.
HANG_EXIT_CODE = 75


class CheckpointError(RuntimeError):
    """Checkpoints exist but none can be restored (never a silent fresh start)."""


class LogdirInUseError(RuntimeError):
    """Another live run uses this logdir; the message names its host, process id and start."""


class NonFiniteError(FloatingPointError):
    """The metric named by `Config.nan_guard` became NaN or infinite."""

    def __init__(self, metric: str, step: int, value: float) -> None:
        super().__init__(f"metric {metric!r} is not finite ({value}) at step {step}")
        self.metric = metric
        self.step = step
        self.value = value

    def __reduce__(self):  # keep it picklable with its three arguments
        return (type(self), (self.metric, self.step, self.value))


class PluginError(RuntimeError):
    """A plugin could not be imported or registered; the message names it."""
