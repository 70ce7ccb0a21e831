"""One run per logdir: an OS lock on a local path, a renewed lease on an object store.

The chief of a run takes the logdir before it reads or writes anything there and
lets it go when the session closes. A second live run on the same logdir fails at
start-up with `LogdirInUseError`, naming the holder's host, process id and start
time, instead of interleaving checkpoints and event files with it.

- Local path: ``logdir/.loopkit-lock``, held with ``flock``; the OS releases it
  when its process dies (SIGKILL, OOM), so a dead holder never blocks a restart.
- URL (``s3://``, ``gs://``, ...): ``logdir/.loopkit-lease.json``, rewritten by a
  thread every `renew_secs()` seconds. A restart takes it over at once when its
  holder is provably gone (`holder_gone`: the same job, or the same host and a
  process that no longer exists), or when it is older than `EXPIRY_RENEWALS`
  renewals. Only an unknown holder's young lease is waited for (saying so in the
  log): taken over once it has not been renewed for that long, a failure if it is
  renewed meanwhile (a live run). The wait ends early when `interrupted()` says
  so (a SIGTERM). An object store has no compare-and-swap that every client
  offers, so two runs started in the same second are told apart by reading the
  lease back after writing it.

Processes of one multi-process job share the lock: only the chief takes it
(`loopkit.process.logdir_claim` tells the others). Evaluators (`is_chief=False`) and the
checkpoint helpers never take it.
"""

from __future__ import annotations

import json
import logging
import math
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

__all__ = ["JOB_ENVS", "LOCK_NAME", "LEASE_NAME", "LogdirLock", "holder_gone", "job_id",
           "renew_secs"]

log = logging.getLogger("loopkit")

LOCK_NAME = ".loopkit-lock"
LEASE_NAME = ".loopkit-lease.json"
#: a lease not renewed for this many renewal intervals belongs to a dead run
EXPIRY_RENEWALS = 4
#: the environment variable that sets the lease's renewal interval (seconds)
RENEW_ENV = "LOOPKIT_LEASE_RENEW_SECS"
#: where a job's id is read, first set wins: `loopkit run` gives its children one kept
#: across restarts; without it, the scheduler's (a requeued SLURM job keeps its id)
JOB_ENVS = ("LOOPKIT_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")


def renew_secs() -> float:
    """How often a run renews its lease on an object store (default 30 s)."""
    raw = os.environ.get(RENEW_ENV, "")
    if not raw.strip():
        return 30.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{RENEW_ENV}={raw!r} is not a number of seconds > 0: it sets how often a run "
            f"renews its lease on an object store (default 30; a lease not renewed for "
            f"{EXPIRY_RENEWALS} intervals is taken over)")
    return value


def job_id() -> str | None:
    """This process's job, as ``"NAME=value"`` from the first of `JOB_ENVS` set, or None."""
    for name in JOB_ENVS:
        value = os.environ.get(name, "").strip()
        # torchrun's default rendezvous id is "none": shared by every job, no identity
        if value and value.lower() != "none":
            return f"{name}={value}"
    return None


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), None where unknown: a pid
    that now names another process started later than the one that wrote a lease."""
    text = _read_text(f"/proc/{pid}/stat")
    try:
        return int(text.rsplit(")", 1)[1].split()[19]) if text else None
    except (IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _holder() -> dict[str, Any]:
    # boot and pid namespace (Linux) tell whether the holder's process id can be
    # checked from here: a host restarted since, or another container on it
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "since": time.time(),
            "job": job_id(), "boot": _read_text("/proc/sys/kernel/random/boot_id"),
            "pidns": _read_link("/proc/self/ns/pid"), "pid_start": _process_start(os.getpid())}


def _read_link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def holder_gone(lease: dict[str, Any], me: dict[str, Any] | None = None) -> str | None:
    """Why the run that wrote `lease` is provably gone, or None (it may be alive).

    Gone: the same job as this process (`job_id`), or the same host and a process
    id that no longer exists (or now names a process started since). Another
    session of this very process is alive, whatever its job.
    """
    me = me or _holder()
    pid, host = lease.get("pid"), lease.get("host")
    same_machine = host == me["host"] and lease.get("pidns") == me["pidns"]
    if same_machine and pid == me["pid"] and lease.get("boot") == me["boot"]:
        return None
    if lease.get("job") and lease.get("job") == me["job"]:
        return f"it belongs to this run's own job ({lease['job']})"
    if host != me["host"]:
        return None
    if lease.get("boot") and me["boot"] and lease["boot"] != me["boot"]:
        return f"host {host!r} has restarted since"
    if not same_machine or type(pid) is not int or pid <= 0:
        return None  # another container (its processes are not visible here), or no pid
    if not _alive(pid):
        return f"process {pid} no longer exists"
    start = lease.get("pid_start")
    if start is not None and _process_start(pid) not in (None, start):
        return f"process {pid} no longer exists (its id names a newer process)"
    return None


def _span(secs: float) -> str:
    if secs < 86400:
        return f"{secs:.0f} s"
    return f"{secs / 86400:.0f} days" if secs < 3.2e10 else "over a thousand years"


def _age(lease: dict[str, Any]) -> tuple[float, str]:
    """The lease's age by its own stamp (NaN: none to trust) and how to say it."""
    try:
        stamp = float(lease.get("renewed"))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan, "with no renewal time"
    if not math.isfinite(stamp):
        return math.nan, f"with the renewal time {stamp}"
    age = time.time() - stamp
    if age < -1:
        return age, (f"dated {_span(-age)} in the future (a clock ahead of this host's, "
                     "or a damaged lease)")
    return age, f"renewed {max(age, 0):.0f} s ago"


def _who(lease: dict[str, Any]) -> str:
    return f"process {lease.get('pid')} on host {lease.get('host')!r}"


def _in_use(logdir: Any, holder: dict[str, Any] | None, how: str) -> LogdirInUseError:
    if holder:
        who = f"{_who(holder)}, started {holder.get('started')}"
    else:
        who = "another process (it has not written its name yet)"
    return LogdirInUseError(
        f"the logdir {str(logdir)!r} is in use by a live run: {who} ({how}). Two runs on "
        "one logdir would interleave their checkpoints and event files: stop that run, "
        "or give this one another logdir")


def _parse(raw: bytes) -> dict[str, Any] | None:
    """The lease in `raw`, or None when it is unreadable (not a JSON object)."""
    return read_json_object(lambda: raw) if raw.strip() else None


class LogdirLock:
    """The chief's claim on a logdir for one session: `acquire()`, then `release()`."""

    def __init__(self, logdir: Path | str,
                 on_lost: Callable[[BaseException], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 interrupted: Callable[[], str | None] = lambda: None) -> None:
        self.logdir = logdir
        self._on_lost = on_lost
        self._clock = clock
        self._interrupted = interrupted
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
        try:
            path.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):  # it, or a parent, is a file
            raise ValueError(f"Config.logdir={str(path)!r} is, or is inside, an existing "
                             "file: expected a directory (created if missing)") from None
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

    def _read_raw(self) -> bytes | None:
        """The lease as stored, None when there is none (a store error propagates: no
        lease is assumed absent because it could not be read)."""
        try:
            return storage.read_bytes(self._lease)
        except FileNotFoundError:
            return None

    def _write_lease(self, since: float | None = None) -> None:
        lease = {**_holder(), "token": self._token, "renewed": time.time()}
        if since is not None:
            lease["since"] = since
        storage.write_atomic(self._lease, json.dumps(lease).encode())

    def _take_lease(self) -> None:
        renew = renew_secs()
        expiry = EXPIRY_RENEWALS * renew
        watched: tuple[bytes, float] | None = None  # (the lease as first seen, its expiry)
        while (raw := self._read_raw()) is not None:
            if watched is not None and raw != watched[0]:
                raise _in_use(self.logdir, _parse(raw),
                              "its lease was renewed while this run waited")
            wait = self._judge(_parse(raw), expiry, watched)
            if wait is None:
                break
            if watched is None:
                watched = (raw, self._clock() + wait)
            self._pause(min(renew / 4, 1.0), _parse(raw))
        storage.makedirs(self.logdir)
        self._write_lease()
        # two runs that wrote at once: the last write wins, the other one leaves
        time.sleep(min(renew / 10, 0.5))
        lease = _parse(self._read_raw() or b"")
        if lease is None or lease.get("token") != self._token:
            raise _in_use(self.logdir, lease, "it took the lease at the same time")
        self._renewer = threading.Thread(target=self._renew, args=(renew,), daemon=True,
                                         name="loopkit-logdir-lease")
        self._renewer.start()

    def _judge(self, lease: dict[str, Any] | None, expiry: float,
               watched: tuple[bytes, float] | None) -> float | None:
        """None: take the lease over now (saying why); else how long to wait for it."""
        where = f"the logdir {self.logdir}"
        if lease is None:
            # an atomic write never leaves this: a damaged lease is no proof of life
            log.warning("loopkit: taking over %s, whose lease %s is unreadable (not a JSON "
                        "object)", where, self._lease)
            return None
        age, renewed = _age(lease)
        gone = holder_gone(lease)
        if gone is not None:
            log.warning("loopkit: taking over %s at once from %s (lease %s): %s", where,
                        _who(lease), renewed, gone)
            return None
        # expired by its own stamp (a NaN stamp too), or unrenewed for `expiry` by
        # this clock (a stamp in the future is judged by this clock alone)
        if not age < expiry:
            why = f"its lease, {renewed}, has expired"
        elif watched is not None and self._clock() >= watched[1]:
            why = f"its lease was not renewed in the {expiry:.0f} s this run watched it"
        else:
            why = None
        if why is not None:
            log.warning("loopkit: taking over %s from %s: %s", where, _who(lease), why)
            return None
        if watched is not None:
            return watched[1] - self._clock()
        wait = expiry - max(age, 0)
        log.warning(
            "loopkit: %s has a lease of %s, %s; waiting up to %.0f s for it to expire (a "
            "run that died) or be renewed (a live run). A restart of the same job takes "
            "over at once when it shares %s with it", where, _who(lease), renewed, wait,
            "/".join(JOB_ENVS))
        return wait

    def _pause(self, secs: float, lease: dict[str, Any] | None) -> None:
        """Sleep `secs`, or raise as soon as `interrupted()` gives a reason (a signal,
        another process of the job that failed)."""
        deadline = time.monotonic() + secs
        while not (why := self._interrupted()):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.1))
        raise LogdirInUseError(
            f"stopped by {why} while waiting for the lease on the logdir "
            f"{str(self.logdir)!r} (held by {_who(lease or {})}): this run wrote nothing there")

    def _renew(self, every: float) -> None:
        since = time.time()
        while not self._stop.wait(every):
            try:
                lease = _parse(self._read_raw() or b"")
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
                lease = _parse(self._read_raw() or b"")
                if lease is not None and lease.get("token") == self._token:
                    storage.remove(self._lease)
            except Exception:  # noqa: BLE001 - it expires by itself
                log.warning("loopkit: could not remove the lease on %s", self.logdir,
                            exc_info=True)
