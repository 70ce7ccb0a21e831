"""loopkit: tf.train.Supervisor's services for JAX, as pluggy plugins around a small loop."""

from __future__ import annotations

from typing import Any

from loopkit.loop.carry import StepCarry
from loopkit.plugin.backend import CheckpointBackend, Restored, RollbackRecord
from loopkit.config import Config
from loopkit.loop.coordinator import Coordinator
from loopkit.errors import (
    HANG_EXIT_CODE, CheckpointError, LogdirInUseError, NonFiniteError, PluginError,
    ReplicaMismatchError, SpikeError,
)
from loopkit.plugin.hookspec import hookimpl, hookspec
from loopkit.loop.session import Session
from loopkit.loop.stash import StashKey
from loopkit.supervisor import Supervisor
from loopkit.train import TrainResult, train

__version__ = "0.1.0"

__all__ = [
    "CheckpointBackend",
    "CheckpointError",
    "Config",
    "Coordinator",
    "HANG_EXIT_CODE",
    "LogdirInUseError",
    "NonFiniteError",
    "PluginError",
    "ReplicaMismatchError",
    "Restored",
    "RollbackRecord",
    "Session",
    "SpikeError",
    "StashKey",
    "StepCarry",
    "Supervisor",
    "TrainResult",
    "checkpoints_iterator",
    "from_pretrained",
    "goodput",
    "GoodputReport",
    "hookimpl",
    "hookspec",
    "latest_checkpoint",
    "load_checkpoint",
    "train",
]

# Checkpoint helpers live with the checkpoint plugin (they need a backend), the
# goodput report with the goodput plugin;
# imported on first use so `import loopkit` stays light.
_LAZY = {
    "latest_checkpoint": "loopkit.plugins.checkpoint",
    "load_checkpoint": "loopkit.plugins.checkpoint",
    "checkpoints_iterator": "loopkit.plugins.checkpoint",
    "from_pretrained": "loopkit.plugins.checkpoint",
    "goodput": "loopkit.plugins.goodput",
    "GoodputReport": "loopkit.plugins.goodput",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'loopkit' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
