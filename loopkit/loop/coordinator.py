"""The Coordinator: one stop flag, the first error, and the threads to join."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import threading
import time
from typing import Any, Callable, Iterator

__all__ = ["Coordinator", "LooperThread", "SignalHandlers", "StopEvent"]

log = logging.getLogger("loopkit")


def add_note(exc: BaseException, note: str) -> None:
    """Add a PEP 678 note once (Python 3.10 has no `add_note`)."""
    notes = getattr(exc, "__notes__", None) or []
    if note in notes:
        return
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        exc.__notes__ = [*notes, note]  # type: ignore[attr-defined]


def has_origin(exc: BaseException) -> bool:
    """True when a loopkit note already says where `exc` was raised."""
    return any(n.startswith("raised in loopkit") for n in getattr(exc, "__notes__", ()))


def raise_stop_errors(error: BaseException | None, stop_errors: list[BaseException]) -> None:
    """Raise what ended a session: `error`, with each `on_stop` error as a note; after
    a clean run, the first `on_stop` error, with the others as notes; else nothing."""
    first = error if error is not None else (stop_errors[0] if stop_errors else None)
    if first is None:
        return
    for ex in stop_errors:
        if ex is not first:
            plugin = getattr(ex, "_loopkit_plugin", None)
            where = f"on_stop of plugin {plugin!r} raised " if plugin else ""
            add_note(first, f"while stopping, also: {where}{type(ex).__name__}: {ex}")
    raise first


class StopEvent:
    """A one-way event that a signal handler may set.

    `threading.Event.set` takes a lock that the interrupted thread may hold (inside
    its own `set` or `wait`): a signal there would deadlock. `queue.SimpleQueue.put`
    is reentrant (CPython documents it as safe from `__del__`, which runs between
    bytecodes as a signal handler does), so setting puts a token and each waiter
    that takes it puts it back for the next.
    """

    def __init__(self) -> None:
        self._set = False
        self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._tokens.put(None)

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        try:
            self._tokens.get(timeout=timeout)
        except queue.Empty:
            return self._set
        self._tokens.put(None)  # wake the next waiter too
        return True


class Coordinator:
    """Stops every thread of a session cleanly and keeps the error that stopped it.

    As `tf.train.Coordinator`: `request_stop(ex)` sets a flag that cannot be unset;
    the first exception wins and is re-raised when the session closes;
    `StopIteration` (exhausted input) is a clean stop.
    """

    def __init__(self) -> None:
        self.stopped = False  # read on the per-step path: a plain attribute
        self._reason: str | None = None
        self._signalled = False  # a signal asked for the stop (`stop_on_signal`)
        #: a stop signal waiting for the processes to agree (multi-process runs)
        self.signal_pending = False
        #: multi-process runs: stops wait for the processes' agreement (set by the Supervisor)
        self.agreed = False
        #: a background thread's error waiting for that agreement
        self.error_pending: BaseException | None = None
        self.exception: BaseException | None = None
        self._event = StopEvent()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    @property
    def reason(self) -> str | None:
        """Why the stop came: the first reason asked for (a signal counts first)."""
        if self._reason is None and self._signalled:
            return "signal"
        return self._reason

    def should_stop(self) -> bool:
        """True once a stop was requested."""
        return self.stopped

    def stop_on_signal(self) -> None:
        """Stop with reason "signal"; what a signal handler calls.

        Sets flags and the event only: the handler interrupts a thread that may
        hold `request_stop`'s lock (`close`, the max-steps callback), so taking it
        here could deadlock. The next `request_stop` keeps "signal" as the reason.
        """
        self._signalled = True
        self.stopped = True
        self._event.set()

    def request_stop(self, ex: BaseException | None = None, reason: str = "requested",
                     agreed: bool = False) -> None:
        """Ask every thread to stop. The first exception (or reason) is kept.

        `agreed=True` is for a background thread's error: in a multi-process run
        it waits for the processes' next agreement, where all stop at one step
        (a process stopping alone would leave the others in a collective).
        """
        with self._lock:
            if agreed and self.agreed and ex is not None:
                if self.error_pending is None:
                    self.error_pending = ex
                return
            if isinstance(ex, StopIteration):
                reason = "data_exhausted"
            elif ex is not None:
                reason = "error"
                if self.exception is None:
                    self.exception = ex
            if self._reason is None:
                self._reason = "signal" if self._signalled else reason
            self.stopped = True
            self._event.set()

    def wait_for_stop(self, timeout: float | None = None) -> bool:
        """Block until a stop is requested (or `timeout` passes); True if stopped."""
        return self._event.wait(timeout)

    @contextlib.contextmanager
    def stop_on_exception(self) -> Iterator[None]:
        """Turn an exception raised in the block into `request_stop(ex)`.

        As in TensorFlow, the exception is recorded, not re-raised here; it comes
        back when the session ends.
        """
        try:
            yield
        except BaseException as ex:  # noqa: BLE001 - re-raised at the session's end
            self.request_stop(ex)

    def register_thread(self, thread: threading.Thread) -> None:
        self._threads.append(thread)

    def join(self, grace_secs: float) -> list[threading.Thread]:
        """Join registered threads within `grace_secs`; warn about and return stragglers."""
        deadline = time.monotonic() + grace_secs
        stragglers = []
        for t in self._threads:
            if t is threading.current_thread():
                continue
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("thread %r did not stop within stop_grace_secs=%s; leaving it "
                            "behind", t.name, grace_secs)
                stragglers.append(t)
        self._threads = stragglers
        return stragglers


class LooperThread(threading.Thread):
    """Calls `target(*args, **kwargs)` every `interval_secs` until the coordinator stops.

    An exception in `target` stops the coordinator and comes back, with a note
    naming this thread, from `train` or the `with` block.
    """

    def __init__(self, coord: Coordinator, interval_secs: float | None,
                 target: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
                 name: str | None = None) -> None:
        super().__init__(name=name or f"loopkit-loop-{getattr(target, '__name__', 'target')}",
                         daemon=True)
        self._coord = coord
        self._interval = interval_secs
        self._target_fn = target
        self._args = tuple(args or ())
        self._kwargs = dict(kwargs or {})

    def run(self) -> None:
        try:
            if self._interval is None:
                # Run once: the target runs its own loop (and should poll should_stop).
                self._target_fn(*self._args, **self._kwargs)
                return
            next_time = time.monotonic()
            while not self._coord.stopped:
                self._target_fn(*self._args, **self._kwargs)
                # fell behind: don't try to catch up
                next_time = max(next_time + self._interval, time.monotonic())
                if self._coord.wait_for_stop(max(0.0, next_time - time.monotonic())):
                    break
        except BaseException as ex:  # noqa: BLE001 - handed to the main thread
            add_note(ex, f"raised in loopkit thread {self.name!r}")
            self._coord.request_stop(ex)


_SIGHUP = getattr(signal, "SIGHUP", None)  # not on Windows


class SignalHandlers:
    """SIGINT/SIGTERM during a session: the first stops after the current step.

    A second signal aborts (KeyboardInterrupt). Under `loopkit run` a SIGHUP, the
    runner's death (`runner._on_parent_death`), stops the same way, and never
    aborts: the kernel repeats it as it hands the process from one of the dying
    runner's threads to the next, so a SIGHUP after any first signal is ignored
    (outside the runner SIGHUP keeps its own handler). With many processes the stop
    waits for the processes to agree on a step (`Coordinator.signal_pending`),
    so none is left in a collective the others skipped. Installed only in the
    main thread; `restore()` puts the previous handlers back.

    The handler runs in the main thread wherever it was interrupted (a save, the
    close, JAX's backend start-up), so it only sets flags and the event: no lock,
    no logging (a buffered stream interrupted mid-write refuses a reentrant
    write), no JAX call. Its one line goes to stderr's descriptor directly.
    """

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self._saved: dict[int, Any] = {}
        self._seen = 0
        self._many = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        import jax

        from loopkit.process.run_status import STATUS_ENV

        self._many = jax.process_count() > 1  # asked now: the handler calls no JAX
        runner = bool(os.environ.get(STATUS_ENV))  # a `loopkit run` child
        for sig in (signal.SIGINT, signal.SIGTERM) + ((_SIGHUP,) if runner and _SIGHUP else ()):
            with contextlib.suppress(ValueError, OSError):  # not the main interpreter
                self._saved[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, old in self._saved.items():
            signal.signal(sig, old)
        self._saved.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == _SIGHUP and self._seen:
            return  # the runner's death, told again, or after a stop already under way
        self._seen += 1
        if self._seen > 1:
            self.restore()
            raise KeyboardInterrupt
        name = signal.Signals(signum).name
        if signum == _SIGHUP:
            name += " (the runner died)"
        again = ("press Ctrl-C again to abort" if signum == signal.SIGINT
                 else "a second signal aborts")
        with contextlib.suppress(OSError):  # no stderr: the stop matters, not the line
            os.write(2, f"loopkit: got {name}, stopping after the current step "
                        f"({again})\n".encode())
        if self._many:
            self.coord.signal_pending = True
        else:
            self.coord.stop_on_signal()
