"""Taking the logdir at start-up, every process of a job together.

The chief takes the logdir (`LogdirLock`); on an object store that can mean waiting
for an unknown holder's lease to expire (four renewal intervals: two minutes by
default). The other processes must not go ahead meanwhile into the restore's first
collective, whose set-up gives up after 30 s (Gloo's "Connect timeout"): a two-process
job restarted on a bucket failed on both processes that way while the chief waited.
So every process publishes how its part went (the URL check; the chief's lock) in
`jax.distributed`'s key-value store and waits, bounded and answering a stop signal,
until every process has: all go on together, or all fail with the first failure
(the chief's `LogdirInUseError` on every process). A failure published while the
chief waits for a lease ends that wait too.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import zlib
from pathlib import Path
from typing import Any, Callable

from loopkit import storage
from loopkit.errors import LogdirInUseError
from loopkit.process.logdir_lock import EXPIRY_RENEWALS, LogdirLock, renew_secs
from loopkit.process.job import kv_client
from loopkit.storage.store_check import PROBE_SECS, check_store

__all__ = ["claim_logdir", "stop_asked"]

log = logging.getLogger("loopkit")

PREFIX = "loopkit/logdir-claim/"
#: beyond the chief's longest wait, how long the others wait for its word
MARGIN_SECS = 60.0
#: a failing chief waits this long for the others to read its failure before it
#: exits (its exit takes the job's key-value store down)
LINGER_SECS = 5.0
_claims = itertools.count()  # every process opens its sessions in the same order
# the exception types a failure keeps on the other processes (others: RuntimeError)
_KEPT = {c.__name__: c for c in (LogdirInUseError, PermissionError, ConnectionError,
                                 ValueError)}


def stop_asked(coord: Any) -> str | None:
    """Why the session was asked to stop before it opened (a signal), or None."""
    if coord.signal_pending or (coord.stopped and coord.reason == "signal"):
        return "a stop signal (SIGTERM or SIGINT)"
    return f"a stop request ({coord.reason})" if coord.stopped else None


def claim_logdir(logdir: Path | str, *, chief: bool, together: bool,
                 on_lost: Callable[[BaseException], Any],
                 interrupted: Callable[[], str | None]) -> LogdirLock | None:
    """Check a URL logdir's store, take the logdir if `chief`, and with `together` (the
    processes of a multi-process job) go on only once every process has done its part.
    Returns the chief's lock (None elsewhere); raises what failed, on every process."""
    peers = _Peers.connect(logdir) if together else None

    def why_stop() -> str | None:
        return interrupted() or (peers.failure() if peers is not None else None)

    lock = None
    try:
        bound = MARGIN_SECS
        if storage.is_url(logdir):
            # a bad LOOPKIT_LEASE_RENEW_SECS fails every process alike
            bound += PROBE_SECS + EXPIRY_RENEWALS * renew_secs()
            check_store(str(logdir), why_stop)
        if chief:
            lock = LogdirLock(logdir, on_lost=on_lost, interrupted=why_stop)
            lock.acquire()
    except BaseException as ex:
        if peers is not None:
            peers.failed(ex)
        raise
    if peers is not None:
        try:
            peers.gather(bound, interrupted)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
    return lock


class _Peers:
    """The processes' outcomes in the job's key-value store, one key per process."""

    def __init__(self, client: Any, base: str) -> None:
        import jax

        self.client, self.base = client, base
        self.count, self.index = jax.process_count(), jax.process_index()
        self._checked = 0.0

    @classmethod
    def connect(cls, logdir: Path | str) -> _Peers | None:
        client = kv_client()
        if client is None:
            return None
        tag = zlib.crc32(str(logdir).encode())
        return cls(client, f"{PREFIX}{next(_claims)}-{tag:08x}/")

    def _outcomes(self) -> dict[int, dict[str, str]]:
        try:
            pairs = self.client.key_value_dir_get(f"{self.base}outcome/")
        except Exception as ex:  # noqa: BLE001 - the store lives with process 0
            raise RuntimeError(
                "the job's coordinator (process 0) stopped answering while the processes "
                f"opened the logdir: {type(ex).__name__}: {ex}") from None
        return {int(k.rsplit("/", 1)[-1]): json.loads(v) for k, v in pairs}

    def _publish(self, outcome: dict[str, str]) -> None:
        self.client.key_value_set(f"{self.base}outcome/{self.index}", json.dumps(outcome),
                                  allow_overwrite=True)

    def failure(self) -> str | None:
        """Another process's failure, looked up at most twice a second (the chief's
        lease wait asks often)."""
        now = time.monotonic()
        if now - self._checked < 0.5:
            return None
        self._checked = now
        failed = self._first_failure(self._outcomes())
        return None if failed is None else f"process {failed[0]}'s failure ({failed[1]})"

    def _first_failure(self, seen: dict[int, dict[str, str]]) -> tuple[int, str] | None:
        return next(((i, o["error"]) for i, o in sorted(seen.items())
                     if o.get("error") and i != self.index), None)

    def failed(self, ex: BaseException) -> None:
        """Tell the others this process failed; the chief then waits for them to read it."""
        try:
            self._publish({"error": f"{type(ex).__name__}: {ex}", "type": type(ex).__name__})
            self._seen()
        except Exception:  # noqa: BLE001 - they fail at their next collective instead
            log.debug("loopkit: could not publish the failure", exc_info=True)

    def _seen(self) -> None:
        self.client.key_value_set(f"{self.base}seen/{self.index}", "1", allow_overwrite=True)
        if self.index != 0:
            return
        deadline = time.monotonic() + LINGER_SECS
        while time.monotonic() < deadline:
            try:
                if len(self.client.key_value_dir_get(f"{self.base}seen/")) >= self.count:
                    return
            except Exception:  # noqa: BLE001 - nobody left to tell
                return
            time.sleep(0.05)

    def gather(self, bound: float, interrupted: Callable[[], str | None]) -> None:
        """Publish this process's success, then wait until every process has published:
        return if all succeeded, else raise the first failure here too."""
        self._publish({})
        deadline = time.monotonic() + bound
        while True:
            seen = self._outcomes()
            failed = self._first_failure(seen)
            if failed is not None:
                self._seen()
                raise _peer_error(*failed, seen[failed[0]].get("type", ""))
            if len(seen) >= self.count:
                return
            why = interrupted()
            if why or time.monotonic() >= deadline:
                missing = sorted(set(range(self.count)) - set(seen))
                ex: BaseException = LogdirInUseError(
                    f"stopped by {why} while waiting for process(es) {missing} to open the "
                    "logdir") if why else RuntimeError(
                    f"process(es) {missing} did not open the logdir within {bound:.0f} s "
                    "(the chief may be waiting for another run's lease: see its log)")
                self.failed(ex)
                raise ex
            time.sleep(0.1)


def _peer_error(process: int, message: str, kind: str) -> BaseException:
    return _KEPT.get(kind, RuntimeError)(f"process {process} could not open the logdir: "
                                         f"{message}")
