"""An opt-in tuning of the interpreter for checkpoint I/O: quick thread switches, rare collections.

loopkit never changes these settings by itself: they are process-wide, and a
training script's other threads and libraries see them too. `checkpoint_io_tuning`
is a context manager for the user who wants them, around a run or a load:

    with loopkit.plugins.checkpoint.checkpoint_io_tuning():
        loopkit.train(...)

A checkpoint of thousands of leaves is thousands of small operations in Python, and
two of the interpreter's defaults made it several times slower than its work:

- **The thread switch interval** (`sys.setswitchinterval`, 5 ms). Each call that
  releases the GIL (tensorstore's, file I/O) waits to get it back from any thread
  busy running Python -- the training loop, an input thread -- for up to the
  interval: an orbax commit of 4,096 leaves took 57 s beside one busy thread at
  5 ms, 3.9 s at 0.2 ms (``benchmarks/checkpoint.py --busy``, benchmarks/README.md).
- **The garbage collector's first threshold** (`gc.set_threshold`, 700). A save
  or restore of 4,096 leaves allocates hundreds of thousands of containers (records,
  orbax's parameter infos and asyncio tasks), so the collector ran hundreds of young
  collections and two or three full ones, each full one walking every object of the
  process (jax's included): 0.42 s of a 1.81 s orbax commit, 0.14 s of a 1.33 s
  restore. At 50,000 the same commit took 1.25 s and the restores 7-14% less
  (``benchmarks/checkpoint.py --gc``, benchmarks/README.md). Cycles are still
  collected: a young collection after 50,000 container allocations instead of 700.

`checkpoint_io_tuning()` sets both for as long as it is entered, and gives them back after.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from typing import Iterator

__all__ = ["GC_THRESHOLD", "SWITCH_INTERVAL", "checkpoint_io_tuning"]

SWITCH_INTERVAL = 2e-4  # seconds: the thread switch interval it sets (Python's default: 5 ms)
GC_THRESHOLD = 50_000  # the collector's first threshold it sets (Python's default: 700)

_lock = threading.Lock()
_state: list = []  # [settings before, settings set, uses in flight] while in use


def _settings() -> tuple[float, tuple[int, ...]]:
    return sys.getswitchinterval(), gc.get_threshold()


@contextlib.contextmanager
def checkpoint_io_tuning(*, switch_interval: float = SWITCH_INTERVAL,
                         gc_threshold: int = GC_THRESHOLD) -> Iterator[None]:
    """Lower the thread switch interval to `switch_interval` seconds and raise the
    collector's first threshold to `gc_threshold`, while entered; opt-in.

    Settings of the user's that already go further (a lower interval, a higher
    threshold, a threshold of 0: automatic collection off) are left alone. Nested
    and concurrent uses share one change (the first one's values); the last to end
    gives back each setting as it was before, unless something else changed it
    meanwhile. Also a decorator: ``@checkpoint_io_tuning()``.
    """
    with _lock:
        if not _state:
            before = _settings()
            if before[0] > switch_interval:
                sys.setswitchinterval(switch_interval)
            if 0 < before[1][0] < gc_threshold:
                gc.set_threshold(gc_threshold, *before[1][1:])
            _state[:] = [before, _settings(), 0]
        _state[2] += 1
    try:
        yield
    finally:
        with _lock:
            _state[2] -= 1
            if not _state[2]:
                before, ours, _ = _state
                _state.clear()
                now = _settings()
                if now[0] == ours[0] != before[0]:
                    sys.setswitchinterval(before[0])
                if now[1] == ours[1] != before[1]:
                    gc.set_threshold(*before[1])
