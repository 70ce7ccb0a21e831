"""Read-only backends for checkpoints that no loopkit logdir holds: others' formats.

- `orbax`: an orbax PyTree checkpoint under any name, or one item of an orbax
  `CheckpointManager` step.
- `safetensors`: ``*.safetensors`` files, as published models ship.

`loopkit.plugins.checkpoint.helpers.locate` chooses one for a path.
"""
