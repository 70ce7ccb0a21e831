"""Built-in `init`: the Supervisor's `init_fn` and `local_init_fn`.

(`loopkit.from_pretrained`, an `init_fn` that loads a pretrained checkpoint, reads
checkpoints: it lives with the checkpoint plugin, `loopkit.plugins.checkpoint.helpers`.)
"""

from __future__ import annotations

from typing import Any

from loopkit.config import Config
from loopkit.plugin.hookspec import hookimpl

__all__ = ["InitPlugin", "plugin"]

PyTree = Any


class InitPlugin:
    """Applies `Config.init_fn` on a fresh start and `Config.local_init_fn` every session."""

    def __init__(self, config: Config) -> None:
        self.config = config

    @hookimpl(trylast=True)
    def init_state(self, session: Any, state: PyTree) -> PyTree | None:
        fn = self.config.init_fn
        if fn is None:
            return None
        new = fn(state)
        if new is None:
            raise ValueError(
                f"Config.init_fn={fn!r} returned None: it must return the new state "
                "(init_fn(state) -> state)"
            )
        return new

    @hookimpl(trylast=True)
    def local_init(self, session: Any) -> None:
        fn = self.config.local_init_fn
        if fn is not None:
            fn(session)


def plugin(config: Config) -> InitPlugin:
    return InitPlugin(config)
