"""The interpreter's settings while checkpoint I/O runs: quick thread switches, rare collections.

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

`checkpoint_io` sets both while a save or restore runs, and gives them back after.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from typing import Iterator

__all__ = ["GC_THRESHOLD", "SWITCH_INTERVAL", "checkpoint_io"]

SWITCH_INTERVAL = 2e-4  # seconds: Python's thread switch interval while checkpoint I/O runs
GC_THRESHOLD = 50_000  # the collector's first threshold meanwhile (Python's default: 700)

_lock = threading.Lock()
_state: list = []  # [settings before, settings set, uses in flight] while in use


def _settings() -> tuple[float, tuple[int, ...]]:
    return sys.getswitchinterval(), gc.get_threshold()


@contextlib.contextmanager
def checkpoint_io() -> Iterator[None]:
    """Lower the switch interval to `SWITCH_INTERVAL`, raise the collector's first
    threshold to `GC_THRESHOLD`, meanwhile.

    Settings of the user's that already go further (a lower interval, a higher
    threshold, a threshold of 0: automatic collection off) are left alone. Nested
    and concurrent uses share one change; the last to end gives back each setting
    as it was before, unless something else changed it meanwhile.
    """
    with _lock:
        if not _state:
            before = _settings()
            if before[0] > SWITCH_INTERVAL:
                sys.setswitchinterval(SWITCH_INTERVAL)
            if 0 < before[1][0] < GC_THRESHOLD:
                gc.set_threshold(GC_THRESHOLD, *before[1][1:])
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
