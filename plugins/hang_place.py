"""Where a hung process waits, in words: the headline of a hang report.

Read from the threads' stacks at the moment of the hang (`sys._current_frames`),
so nothing is recorded per step: the session's own `phase` (set at its start-up
points) says what the start-up was doing, and the main thread's stack says where
inside it: in the step (compiling, in a collective, in a hook), waiting for a batch
(and then where the prefetch thread is: inside the data source, placing a batch),
or reading the data source itself.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any

__all__ = ["place", "where"]

# frames that only say "waiting": the place a thread waits is the caller's
WAITING = ("/threading.py", "/queue.py", "/selectors.py", "/multiprocessing/")
_JAX = ("/jax/_src/", "/jaxlib/", "/jax/experimental/")
# JAX's multi-process collectives run from Python: these name one on the stack
_COLLECTIVE_FILES = ("/multihost_utils.py", "/jax/_src/distributed.py")
_COLLECTIVE_NAMES = ("wait_at_barrier", "blocking_key_value_get", "key_value_dir_get",
                     "sync_global_devices", "broadcast_one_to_all", "process_allgather")
# JAX's tracing, lowering and compiling functions carry one of these in their names
_COMPILING = ("compile", "trace", "lower", "jaxpr")


def _stack(thread: threading.Thread) -> list[FrameType]:
    """`thread`'s frames, innermost first (empty for a thread that has ended)."""
    frame = sys._current_frames().get(thread.ident or -1)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def where(frames: list[FrameType]) -> str:
    """The innermost frame that does more than wait: "function (file:line)"."""
    for f in frames:
        if not any(w in f.f_code.co_filename for w in WAITING):
            return f"{f.f_code.co_name} ({f.f_code.co_filename}:{f.f_lineno})"
    return "unknown"


def _has(frames: list[FrameType], function: Any) -> bool:
    """Whether `function` (loopkit's own: its code object, not a file name a user's
    module could share) is on the stack."""
    code = function.__code__
    return any(f.f_code is code for f in frames)


def _in_train_loop(frames: list[FrameType]) -> bool:
    """Whether `loopkit.train`'s own loop is on the stack (its module's file, exactly)."""
    import importlib

    train = importlib.import_module("loopkit.train").__file__
    return any(f.f_code.co_filename == train and f.f_code.co_name == "_loop" for f in frames)


def _step_file() -> str:
    import loopkit.loop.step

    return loopkit.loop.step.__file__


def _in_jax(f: FrameType) -> bool:
    return any(j in f.f_code.co_filename for j in _JAX)


def _inside(frames: list[FrameType], hooks: bool = True) -> str:
    """What the innermost part of `frames` is doing, and where."""
    at = where(frames)
    if any(any(c in f.f_code.co_filename for c in _COLLECTIVE_FILES)
           or f.f_code.co_name in _COLLECTIVE_NAMES for f in frames):
        return f"in a collective, at {at}"
    jax_frames = [f for f in frames if _in_jax(f)]
    if any(any(c in f.f_code.co_name for c in _COMPILING) for f in jax_frames):
        return f"compiling, at {at}"
    if hooks and any("/pluggy/" in f.f_code.co_filename for f in frames):
        return f"in a hook, at {at}"
    if jax_frames:
        return f"inside JAX, at {at}"
    if frames and frames[0].f_code.co_filename == _step_file():
        # the jitted call runs in JAX's C++ fast path: no Python frame of JAX's
        return f"inside the jitted step (the device, or a collective in it), at {at}"
    return f"at {at}"


def _prefetch(transform: Any) -> str:
    """Where the prefetch threads are, while the loop waits for them."""
    code = getattr(transform, "__code__", None)
    found = []
    for t in threading.enumerate():
        if not t.name.startswith("loopkit-prefetch-"):
            continue
        frames = _stack(t)
        at = where(frames)
        if not frames:
            continue
        if at.split(" (", 1)[0] in ("_wait", "_wait_for_room") and "prefetch.py" in at:
            found.append(f"the prefetch thread {t.name!r} waits for its turn or for room")
        elif code is not None and any(f.f_code is code for f in frames):
            found.append(f"the prefetch thread {t.name!r} is inside Config.data_transform "
                         f"({at})")
        elif any(_in_jax(f) for f in frames):
            found.append(f"the prefetch thread {t.name!r} is placing a batch on the "
                         f"devices, inside JAX ({at})")
        else:
            found.append(f"the prefetch thread is inside the data source, at {at}")
    return "; ".join(found) or "no prefetch thread is running"


def place(session: Any, first: bool) -> str:
    """Where the loop is stuck, in words: "waiting for the first batch: the prefetch
    thread is inside the data source, at data (train.py:12)". `first`: before the
    session's first step completed (then `session.phase` says what the start-up did)."""
    from loopkit.loop.session import Session
    from loopkit.plugins.prefetch import Feed
    frames = _stack(threading.main_thread())
    batch = "the first batch" if first else f"the batch of step {session.step + 1}"
    if _has(frames, Session.run):
        doing = "running the first step" if first else f"running step {session.step + 1}"
        return f"{doing}: {_inside(frames)}"
    if _has(frames, Feed._wait_for_batch):
        return f"waiting for {batch}: {_prefetch(session.config.data_transform)}"
    if _in_train_loop(frames):
        inner = _inside(frames)
        if inner.startswith("at "):  # train's loop reads the source itself
            return f"waiting for {batch}: the main thread is inside the data source, " \
                   f"at {where(frames)}"
        return f"waiting for {batch}: {inner}"
    if first:
        # the start-up runs in hooks (the restore, init_fn): the phase names which
        return f"{session.phase}: {_inside(frames, hooks=False)}"
    return (f"outside the step (your loop, the data source or a hook), for step "
            f"{session.step + 1}: {_inside(frames)}")
