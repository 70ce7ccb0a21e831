"""Exceptions loopkit raises on purpose."""

from __future__ import annotations

__all__ = ["CheckpointError", "HANG_EXIT_CODE", "LogdirInUseError", "NonFiniteError",
           "PluginError", "ReplicaMismatchError", "SpikeError"]

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


class SpikeError(NonFiniteError):
    """The metric named by `Config.nan_guard` jumped above `Config.spike_threshold` times
    the median of its recent values.

    A `NonFiniteError` subclass, so one ``except loopkit.NonFiniteError`` catches every
    failure of the guard; `median` and `threshold` say what the value was compared with.
    """

    def __init__(self, metric: str, step: int, value: float, median: float,
                 threshold: float) -> None:
        FloatingPointError.__init__(
            self, f"metric {metric!r} spiked to {value} at step {step}: above "
                  f"spike_threshold={threshold} x the running median {median}")
        self.metric, self.step, self.value = metric, step, value
        self.median, self.threshold = median, threshold

    def __reduce__(self):
        return (type(self), (self.metric, self.step, self.value, self.median, self.threshold))


class ReplicaMismatchError(RuntimeError):
    """The copies of a replicated leaf differ between devices (silent data corruption).

    Raised by `Config.replica_check_steps` with ``Config.on_guard="raise"``; `leaf`,
    `step`, `process` and `device` (the id of the device whose copy differs from the
    others) say where.
    """

    def __init__(self, message: str, leaf: str, step: int, process: int, device: int) -> None:
        super().__init__(message)
        self.leaf, self.step, self.process, self.device = leaf, step, process, device

    def __reduce__(self):
        return (type(self), (str(self), self.leaf, self.step, self.process, self.device))


class PluginError(RuntimeError):
    """A plugin could not be imported or registered; the message names it."""
