"""Built-in `checkpoint`: saves on a timer and at the stop, recovery at start-up, retention.

Where each part lives (docs/architecture.md draws the flows):

- `plugin`: the plugin registered as ``"checkpoint"``: its timers (durable and
  local tier), the final save, the order of recovery, the tier restored from
  (`RESTORED_TIER`, kept in `loopkit.plugins.shared`).
- `tier`: one tier's directory, backend, checkpoint list and save in flight (its
  commit thread); one staging shared by both tiers' saves at a step.
- `recovery`: the newest checkpoint that can be read at start-up, on one process
  or agreed by all; the local tier's, when newer than the durable tier's.
  `rollback_point`: the checkpoint a rollback restores.
- `collectives`: every collective a save, a restore or a rollback enters, and
  their order: read this one file to check that every process enters the same.
- `peers` and `peer_transfer`: peer copies of the local tier (`local_replicas`).
- `tf_file`: the tf ``checkpoint`` text file, checkpoint names, the backend
  record; `retention`: what the file lists and what is deleted; `position`: a
  checkpoint's metadata, the input positions as JSON; `replicas`: host-local
  replicas checked at each save of many processes, and the save's veto.
- `helpers`: what reads checkpoints outside a run: `latest_checkpoint`,
  `load_checkpoint`, `checkpoints_iterator`, `from_pretrained`; `helpers.locate`
  (finding a checkpoint and the backend that reads it), `helpers.listing`
  (`describe_checkpoints`, ``loopkit checkpoints`` through `commands`) and
  `helpers.readers` (read-only backends for others' formats: orbax trees,
  safetensors).
- `backends`: the built-in backends (`orbax`, a subpackage; `npz`; `staged` for
  URLs) and what they share (leaf `records`, `placement`, `temporaries`).
- `io_tuning`: `checkpoint_io_tuning()`, an opt-in tuning of the interpreter for
  checkpoint I/O of thousands of leaves (loopkit never changes it by itself).
"""

from __future__ import annotations

from loopkit.plugins.checkpoint.helpers import (
    checkpoints_iterator,
    from_pretrained,
    latest_checkpoint,
    load_checkpoint,
)
from loopkit.plugins.checkpoint.io_tuning import checkpoint_io_tuning
from loopkit.plugins.checkpoint.helpers.listing import describe_checkpoints
# (`plugin` below is the function the plugin manager calls, not the module of that name)
from loopkit.plugins.checkpoint.plugin import BUILTIN_BACKENDS, INACTIVE, CheckpointPlugin, plugin
from loopkit.plugins.shared import RESTORED_TIER

__all__ = [
    "BUILTIN_BACKENDS",
    "INACTIVE",
    "RESTORED_TIER",
    "CheckpointPlugin",
    "checkpoint_io_tuning",
    "checkpoints_iterator",
    "describe_checkpoints",
    "from_pretrained",
    "latest_checkpoint",
    "load_checkpoint",
    "plugin",
]
