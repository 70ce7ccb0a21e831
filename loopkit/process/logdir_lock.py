"""One run per logdir: an OS lock on a local path, a renewed lease on an object store.

The chief of a run takes the logdir before it reads or writes anything there and
lets it go when the session closes. A second live run on the same logdir fails at
start-up with `LogdirInUseError`, naming the holder's host, process id and start
time, instead of interleaving checkpoints and event files with it.

- Local path: ``logdir/.loopkit-lock``, held with ``flock``; the OS releases it
  when its process dies (SIGKILL, OOM), so a dead holder never blocks a restart.
- URL (``s3://``, ``gs://``, ...): ``logdir/.loopkit-lease.json``, rewritten by a
  thread every `renew_secs()` seconds. A lease older than `EXPIRY_RENEWALS`
  renewals is taken over; a restart that finds a young one watches it (saying so
  in the log) and takes it over once it has not been renewed for that long, or
  fails if it is renewed meanwhile (a live run). An object store has no
  compare-and-swap that every client offers, so two runs started in the same
  second are told apart by reading the lease back after writing it.

Processes of one multi-process job share the lock: only the chief takes it.
Evaluators (`is_chief=False`) and the checkpoint helpers never take it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from loopkit import storage
from loopkit.errors import LogdirInUseError
from loopkit.storage.local import read_json_object

__all__ = ["LOCK_NAME", "LEASE_NAME", "LogdirLock", "renew_secs"]

log = logging.getLogger("loopkit")

LOCK_NAME = ".loopkit-lock"
LEASE_NAME = ".loopkit-lease.json"
#: a lease not renewed for this many renewal intervals belongs to a dead run
EXPIRY_RENEWALS = 4
#: the environment variable that sets the lease's renewal interval (seconds)
RENEW_ENV = "LOOPKIT_LEASE_RENEW_SECS"


def renew_secs() -> float:
    """How often a run renews its lease on an object store (default 30 s)."""
    return float(os.environ.get(RENEW_ENV, "30"))


def _holder() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "since": time.time()}


def _in_use(logdir: Any, holder: dict[str, Any] | None, how: str) -> LogdirInUseError:
    if holder:
        who = (f"process {holder.get('pid')} on host {holder.get('host')!r}, started "
               f"{holder.get('started')}")
    else:
        who = "another process (it has not written its name yet)"
    return LogdirInUseError(
        f"the logdir {str(logdir)!r} is in use by a live run: {who} ({how}). Two runs on "
        "one logdir would interleave their checkpoints and event files: stop that run, "
        "or give this one another logdir")


class LogdirLock:
    """The chief's claim on a logdir for one session: `acquire()`, then `release()`."""

    def __init__(self, logdir: Path | str,
                 on_lost: Callable[[BaseException], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logdir = logdir
        self._on_lost = on_lost
        self._clock = clock
        self._fd: int | None = None
        self._token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        #: set when another run took the lease over (handed to `on_lost`)
        self.lost: BaseException | None = None

    # -- local: flock --------------------------------------------------------------

    def acquire(self) -> None:
        """Take the logdir, or raise `LogdirInUseError` naming the run that holds it."""
        if storage.is_url(self.logdir):
            self._take_lease()
        else:
            self._take_flock()

    def _take_flock(self) -> None:
        import fcntl

        path = Path(self.logdir)
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = None
            for _ in range(20):  # the holder writes its name right after locking
                holder = read_json_object(lambda: os.pread(fd, 4096, 0))
                if holder:
                    break
                time.sleep(0.05)
            os.close(fd)
            raise _in_use(self.logdir, holder, f"it holds {path / LOCK_NAME}") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder()).encode(), 0)
        self._fd = fd

    # -- URL: a renewed lease ---------------------------------------------------------

    @property
    def _lease(self) -> str:
        return str(storage.join(self.logdir, LEASE_NAME))

    def _read_lease(self) -> dict[str, Any] | None:
        return read_json_object(lambda: storage.read_bytes(self._lease))  # None: no lease

    def _write_lease(self, since: float | None = None) -> None:
        lease = {**_holder(), "token": self._token, "renewed": time.time()}
        if since is not None:
            lease["since"] = since
        storage.write_atomic(self._lease, json.dumps(lease).encode())

    def _take_lease(self) -> None:
        renew = renew_secs()
        expiry = EXPIRY_RENEWALS * renew
        watched: tuple[Any, float] | None = None  # (its renewal stamp, when it expires)
        while (lease := self._read_lease()) is not None and lease.get("token") != self._token:
            age = time.time() - float(lease.get("renewed", 0))
            if watched is not None and lease.get("renewed") != watched[0]:
                raise _in_use(self.logdir, lease, "its lease was renewed while this run waited")
            # expired by its own stamp (a NaN stamp too), or unrenewed for `expiry` by
            # this clock
            if not age < expiry or (watched is not None and self._clock() >= watched[1]):
                log.warning("loopkit: taking over the logdir %s from process %s on host %r, "
                            "whose lease was last renewed %.0f s ago", self.logdir,
                            lease.get("pid"), lease.get("host"), age)
                break
            if watched is None:
                watched = (lease.get("renewed"), self._clock() + expiry - max(age, 0))
                log.warning(
                    "loopkit: the logdir %s has a lease of process %s on host %r, "
                    "renewed %.0f s ago; waiting up to %.0f s for it to expire (a "
                    "run that died) or be renewed (a live run)", self.logdir,
                    lease.get("pid"), lease.get("host"), age, expiry - age)
            time.sleep(min(renew / 4, 1.0))
        storage.makedirs(self.logdir)
        self._write_lease()
        # two runs that wrote at once: the last write wins, the other one leaves
        time.sleep(min(renew / 10, 0.5))
        lease = self._read_lease()
        if lease is None or lease.get("token") != self._token:
            raise _in_use(self.logdir, lease, "it took the lease at the same time")
        self._renewer = threading.Thread(target=self._renew, args=(renew,), daemon=True,
                                         name="loopkit-logdir-lease")
        self._renewer.start()

    def _renew(self, every: float) -> None:
        since = time.time()
        while not self._stop.wait(every):
            try:
                lease = self._read_lease()
                if lease is not None and lease.get("token") != self._token:
                    self.lost = _in_use(self.logdir, lease, "it took this run's lease over")
                    if self._on_lost is not None:
                        self._on_lost(self.lost)  # this run stops, with the error
                    return
                self._write_lease(since)
            except Exception:  # noqa: BLE001 - a store hiccup: try again next interval
                log.warning("loopkit: could not renew the lease on %s", self.logdir,
                            exc_info=True)

    # -- release -------------------------------------------------------------------

    def release(self) -> None:
        """Let the logdir go (a lease is removed when it is still this run's)."""
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None
        if self._renewer is not None:
            self._stop.set()
            self._renewer.join(timeout=10)
            self._renewer = None
            try:
                lease = self._read_lease()
                if lease is not None and lease.get("token") == self._token:
                    storage.remove(self._lease)
            except Exception:  # noqa: BLE001 - it expires by itself
                log.warning("loopkit: could not remove the lease on %s", self.logdir,
                            exc_info=True)

