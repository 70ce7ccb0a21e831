"""`SessionView`: what a hook receives, as a Protocol that `loopkit.Session` implements.

Hooks, the plugin manager and the state's opening are typed against this view
rather than against `Session` itself, so the plugin API (`loopkit/plugin/`) and
the state (`loopkit/state/`) import nothing from the loop (`loopkit/loop/`) that
imports them back: there is no import cycle, `TYPE_CHECKING` imports included.
A third-party plugin may use every name here; built-ins use nothing else.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Protocol

if TYPE_CHECKING:
    from loopkit.config import Config
    from loopkit.loop.coordinator import Coordinator, LooperThread
    from loopkit.loop.data import Input
    from loopkit.loop.scheduler import RunningAction, Timer
    from loopkit.state.staging import Staged
    from loopkit.loop.stash import Stash
    from loopkit.plugin.backend import Restored

PyTree = Any

__all__ = ["SessionStats", "SessionView"]


@dataclasses.dataclass
class SessionStats:
    """Where loopkit's own time goes; the summaries and progress plugins report it."""

    #: seconds spent in timer actions (checkpoints, summaries, ...), by timer name
    timer_secs: dict[str, float] = dataclasses.field(default_factory=dict)
    #: seconds the loop waited for input (prefetch queue empty)
    input_wait_secs: float = 0.0
    #: seconds the prefetch threads spent reading, transforming and placing batches,
    #: measured only while `Config.straggler_threshold` compares the processes' own work
    input_read_secs: float = 0.0
    #: the batches those threads read meanwhile (they read ahead of the steps)
    input_read_batches: int = 0
    #: how many times the metrics were fetched to the host (`Session.host_metrics`)
    host_conversions: int = 0
    #: seconds spent opening the data (`data(start_step)`, `iter(data)`) at the start
    input_open_secs: float = 0.0
    #: seconds `train`'s loop waited for its first batch (None until it came)
    first_batch_secs: float | None = None

    def overhead_secs(self) -> float:
        return sum(self.timer_secs.values()) + self.input_wait_secs


class SessionView(Protocol):
    """The session as plugins see it (DESIGN.md, "Session")."""

    config: Config
    logdir: Path | str | None
    is_chief: bool
    step: int
    #: the latest step's metrics, possibly device arrays
    metrics: Mapping[str, Any]
    #: the chief's event writer while the summaries plugin runs (a tensorboardX
    #: `SummaryWriter`, opened in the background: its first use waits), else None
    summary_writer: Any
    #: what recovery restored, or None for a fresh start
    restored: Restored | None
    #: the input the loop reads (None when `train` got ``data=None`` or in the
    #: Supervisor idiom, where the user feeds `run(batch)`)
    input: Input | None
    #: what the start-up is doing ("taking the logdir lock", "restoring step 40",
    #: "waiting for the first batch"): set at start-up points only, never per step,
    #: so once the first step has run it holds the last of them (a hang watchdog
    #: reads it from its own thread; a plugin may refine it while it starts up)
    phase: str
    #: per-session plugin state (`StashKey` -> value)
    stash: Stash
    stats: SessionStats
    coord: Coordinator
    hook: Any

    @property
    def state(self) -> PyTree: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def stop_reason(self) -> str | None: ...

    @property
    def timer_running(self) -> RunningAction | None: ...

    @property
    def timer_returned(self) -> float: ...

    @property
    def timers(self) -> tuple[Timer, ...]: ...

    def should_stop(self) -> bool: ...

    def request_stop(self, ex: BaseException | None = None, *, agreed: bool = False) -> None: ...

    def every(self, action: Callable[..., Any], secs: float | None = None,
              steps: int | None = None, name: str | None = None) -> Timer: ...

    def at_step(self, step: int, action: Callable[..., Any],
                name: str | None = None) -> Timer: ...

    def loop(self, interval_secs: float | None, target: Callable[..., Any],
             args: tuple | None = None, kwargs: dict | None = None) -> LooperThread: ...

    def register_thread(self, thread: threading.Thread) -> None: ...

    def summary_computed(self, values: Mapping[str, Any], step: int | None = None) -> None: ...

    def stage_state(self) -> Staged: ...

    def skip_donation_once(self) -> None: ...

    def host_metrics(self) -> dict[str, Any]: ...

    def batches(self) -> Iterator[Any]: ...

    def rewind(self, step: int, state: PyTree, again: bool = False) -> None: ...
