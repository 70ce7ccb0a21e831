"""The Coordinator: one stop flag, the first error, and the threads to join."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from typing import Any, Callable, Iterator

__all__ = ["Coordinator", "LooperThread", "SignalHandlers"]

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


class Coordinator:
    """Stops every thread of a session cleanly and keeps the error that stopped it.

    As `tf.train.Coordinator`: `request_stop(ex)` sets a flag that cannot be unset;
    the first exception wins and is re-raised when the session closes;
    `StopIteration` (exhausted input) is a clean stop.
    """

    def __init__(self) -> None:
        self.stopped = False  # read on the per-step path: a plain attribute
        self.reason: str | None = None
        #: a stop signal waiting for the processes to agree (multi-process runs)
        self.signal_pending = False
        #: multi-process runs: stops wait for the processes' agreement (set by the Supervisor)
        self.agreed = False
        #: a background thread's error waiting for that agreement
        self.error_pending: BaseException | None = None
        self.exception: BaseException | None = None
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def should_stop(self) -> bool:
        """True once a stop was requested."""
        return self.stopped

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
            if self.reason is None:
                self.reason = reason
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


class SignalHandlers:
    """SIGINT/SIGTERM during a session: the first stops after the current step.

    A second signal aborts (KeyboardInterrupt). With many processes the stop
    waits for the processes to agree on a step (`Coordinator.signal_pending`),
    so none is left in a collective the others skipped. Installed only in the
    main thread; `restore()` puts the previous handlers back.
    """

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self._saved: dict[int, Any] = {}
        self._seen = 0

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError, OSError):  # not the main interpreter
                self._saved[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, old in self._saved.items():
            signal.signal(sig, old)
        self._saved.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        import jax

        self._seen += 1
        if self._seen > 1:
            self.restore()
            raise KeyboardInterrupt
        log.warning(
            "loopkit: got %s, stopping after the current step%s",
            signal.Signals(signum).name,
            " (press Ctrl-C again to abort)" if signum == signal.SIGINT else
            " (a second signal aborts)",
        )
        if jax.process_count() > 1:
            self.coord.signal_pending = True
        else:
            self.coord.request_stop(reason="signal")
