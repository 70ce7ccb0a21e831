"""Compiles in a background thread that the process's exit does not wait for.

An XLA compile cannot be cut short, and neither kind of thread can be left inside one
when the interpreter exits: a non-daemon thread is joined (the exit waits for the
compile), and a daemon thread aborts the process (on Python 3.11 a daemon thread that
takes the GIL after finalisation began is ended with ``pthread_exit``; jaxlib's wait for
the compile takes the GIL every 200 ms and cannot unwind: "FATAL: exception not
rethrown", 30 exits of 30 on jax 0.10.2).

In a `loopkit run` child (its runner owns the process's life: a preempted job's grace
period is its business), the thread is a daemon, and while one compiles, the start of
the interpreter's exit (`threading._shutdown`, the first thing ``Py_FinalizeEx`` calls) is taken over:
after Python's own thread shutdown and the atexit functions, with the standard streams
and open files flushed, the process ends with `os._exit` and the status Python would
have used. That status is read from how the main thread's outermost frame ended: it
returned (0), an uncaught exception (1, its traceback already printed; SIGINT for a
KeyboardInterrupt, as Python does), or `sys.exit(code)` (code). Where it cannot be known
(`raise SystemExit` itself, an interactive interpreter), the exit waits for the
compile, then goes on as Python's own.

Anywhere else the thread is not a daemon and the exit waits for the compile, as
Python's does: taking over the interpreter's exit (and `sys.exit`) is a process-wide
change that a script the user runs by itself did not ask for.
"""

from __future__ import annotations

import atexit
import dis
import gc
import io
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from loopkit.process.run_status import STATUS_ENV

__all__ = ["compile_in_background", "compiling", "when_idle"]

log = logging.getLogger("loopkit")

_lock = threading.Lock()
_running: set[threading.Thread] = set()
_idle: list[Callable[[], None]] = []  # what runs once no compile runs (`when_idle`)
_outermost: list[FrameType | None] = [None]  # the main thread's outermost frame
# the main thread's latest sys.exit: (SystemExit, where its outermost frame was then)
_exited: list[tuple[SystemExit, FrameType, int] | None] = [None]
_python_exit = sys.exit
_python_shutdown: Any = None  # threading's own `_shutdown`, once taken over
_RETURNS = {dis.opmap[name] for name in ("RETURN_VALUE", "RETURN_CONST") if name in dis.opmap}


def compiling() -> list[threading.Thread]:
    """The background compiles still under way."""
    with _lock:
        return list(_running)


def when_idle(then: Callable[[], None]) -> None:
    """Call `then` now when no background compile runs, else once the last one ends (in
    its thread): a session's close gives JAX's cache settings back this way, so that a
    compile outliving its session still writes to the session's compilation cache."""
    with _lock:
        if _running:
            _idle.append(then)
            return
    then()


def compile_in_background(compile_: Callable[[], None], name: str) -> threading.Thread:
    """Run `compile_` in a daemon thread the process's exit does not wait for."""
    take_over = _take_over_exit()
    thread = threading.Thread(target=_run, args=(compile_,), name=name, daemon=take_over)
    with _lock:
        _running.add(thread)
        if take_over:
            _outermost[0] = _main_outermost()
            _exited[0] = None
            sys.exit = _exit
    thread.start()
    return thread


def _run(compile_: Callable[[], None]) -> None:
    try:
        compile_()
    finally:
        with _lock:
            _running.discard(threading.current_thread())
            then = []
            if not _running:
                then, _idle[:] = list(_idle), []
                if sys.exit is _exit:
                    sys.exit = _python_exit
        for fn in then:
            fn()


def _take_over_exit() -> bool:
    """Put `_shutdown` in front of threading's (once); False outside a `loopkit run`
    child, or where there is none (another Python): the thread is then not a daemon,
    and the exit waits for it."""
    global _python_shutdown
    if not os.environ.get(STATUS_ENV):
        return False
    if _python_shutdown is None:
        if not callable(getattr(threading, "_shutdown", None)):
            return False
        _python_shutdown = threading._shutdown  # type: ignore[attr-defined]
        threading._shutdown = _shutdown  # type: ignore[attr-defined]
    return True


def _main_outermost() -> FrameType | None:
    main = threading.main_thread()
    frame = (sys._getframe() if threading.current_thread() is main
             else sys._current_frames().get(main.ident or -1))
    return None if frame is None else _outermost_of(frame)


def _outermost_of(frame: FrameType) -> FrameType:
    while frame.f_back is not None:
        frame = frame.f_back
    return frame


def _exit(*args: Any) -> None:
    """`sys.exit` while a compile runs: the same, noting the exit for `_status`."""
    try:
        _python_exit(*args)
    except SystemExit as ex:
        if threading.current_thread() is threading.main_thread():
            outermost = _outermost_of(sys._getframe())
            _exited[0] = (ex, outermost, outermost.f_lasti)
        raise


def _shutdown() -> None:
    """The interpreter's exit begins: Python's thread shutdown, then, while a compile
    runs, the rest of a normal exit and `os._exit` (or, status unknown, the wait)."""
    _python_shutdown()
    running = compiling()
    if not running:
        return
    status = _status()
    if status is None:
        log.info("loopkit: the exit waits for a background compile (its status is "
                 "not known before Python's own exit)")
        for thread in running:
            thread.join()
        return
    _end(status)


def _ended_at(frame: FrameType, ex: BaseException | None) -> bool:
    """Whether `ex` is what ended `frame` (it left the frame where the frame stopped)."""
    tb = getattr(ex, "__traceback__", None)
    return tb is not None and tb.tb_frame is frame and tb.tb_lasti == frame.f_lasti


def _status() -> int | None:
    """The exit status Python would use (-SIGINT: a KeyboardInterrupt); None: unknown."""
    frame = _outermost[0]
    if frame is None or sys.flags.inspect:
        return None
    code = frame.f_code.co_code
    if 0 <= frame.f_lasti < len(code) and code[frame.f_lasti] in _RETURNS:
        return 0
    # an uncaught exception: PyErr_Print set it (and printed it) before the exit
    uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if _ended_at(frame, uncaught):
        return -signal.SIGINT if isinstance(uncaught, KeyboardInterrupt) else 1
    exited = _exited[0]
    # sys.exit was called inside the call the outermost frame ended on: it ended it
    # (the exception's own traceback is not complete before Python's exit)
    if exited is not None and exited[1] is frame and exited[2] == frame.f_lasti:
        code_ = exited[0].code
        if code_ is None:
            return 0
        return code_ if isinstance(code_, int) else 1  # Python printed any other value
    return None


def _end(status: int) -> None:
    """End the process as Python would have, less the wait: the atexit functions run,
    every open file is flushed, then `os._exit` (no C++ static destructor runs under the
    compile)."""
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001, S110 - each function ran; Python goes on too
        pass
    for obj in gc.get_objects():  # what finalisation would flush as it frees them
        if isinstance(obj, io.IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:  # noqa: BLE001, S110 - a broken pipe: Python ignores it too
                pass
    if status == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        status = 128 + signal.SIGINT
    os._exit(status & 0xFF)
