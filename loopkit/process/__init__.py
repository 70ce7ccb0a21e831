"""The process around a run: `loopkit run` and its status file, the logdir lock, the compilation cache, the CLI."""
