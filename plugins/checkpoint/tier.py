"""One tier of checkpoints: a directory, its backend and ledger, the save in flight.

The `checkpoint` plugin keeps the durable tier (``logdir``) and, with
`Config.local_checkpoint_dir`, a local one; each is a `Tier`, written by its own
instance of the same backend, with its own `checkpoint` file and retention, so
each directory is a logdir the helpers read. At most one save per tier is in
flight (`Commit`); the two tiers' saves at one step share one staging of the
state (`SharedHold`).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from loopkit.plugin.backend import CheckpointBackend
from loopkit.loop.coordinator import add_note
from loopkit.errors import CheckpointError
from loopkit.plugins.checkpoint.retention import CheckpointList
from loopkit.plugins.checkpoint.tf_file import CheckpointState, checkpoint_path
from loopkit.plugins.shared import SAVE_TIMES, SaveTimes, SaveTiming
from loopkit.process.run_status import checkpoint_committed

__all__ = ["Beside", "Commit", "SharedHold", "Tier", "refuse_a_file"]

log = logging.getLogger("loopkit")

#: how often a wait for a commit looks whether a stop was requested meanwhile
NOTICE_SECS = 0.1


class Commit:
    """One save in flight: a thread waits until the backend made it durable, then publishes.

    `hold` (the `Staged` state) stays referenced until the backend has read and
    written it, then is released: off CPU the staged state holds host copies; on
    CPU it may hold the very buffers, which the step after a later save then
    writes into.
    """

    def __init__(self, step: int, backend: CheckpointBackend, hold: Any,
                 publish: Callable[[], None], failed: Callable[[BaseException], None],
                 name: str = "checkpoint", timing: Beside | None = None) -> None:
        self.step = step
        self.timing = timing
        self.done = threading.Event()
        self._args = (backend, hold, publish, failed)
        self.thread = threading.Thread(
            target=self._run, name=f"loopkit-{name}-commit-{step}",
            daemon=True,  # a backend that never commits must not keep the process alive
        )
        self.thread.start()

    def _run(self) -> None:
        backend, hold, publish, failed = self._args
        self._args = ()
        try:
            backend.wait()
            hold.release()  # read and written: the buffers may be donated again
            del hold
            publish()
            if self.timing is not None:
                self.timing.committed()
        except BaseException as ex:  # noqa: BLE001 - handed to the main thread
            failed(ex)
        finally:
            self.done.set()

    def join(self, stopping: Callable[[], bool], grace_secs: float) -> bool:
        """Wait until committed; once `stopping()`, at most `grace_secs` more.

        False when the commit outlived the grace period and is left behind. The
        wait wakes every `NOTICE_SECS` only to see a stop requested meanwhile
        (a signal, another thread's error), which bounds it.
        """
        if self.timing is not None:
            self.timing.joined()  # from now on the loop waits: no longer beside the steps
        while not self.done.wait(NOTICE_SECS):
            if stopping():
                if self.done.wait(grace_secs):
                    return True
                log.warning("loopkit: thread %r did not commit within stop_grace_secs=%s; "
                            "leaving it behind", self.thread.name, grace_secs)
                return False
        return True


class Beside:
    """Times one commit: from the end of the save's hold to durable, and how much of it
    ran beside the steps (until it was durable or the loop joined it), over how many.
    The goodput ledger takes the finished timings from `SaveTimes` ("auto" cadence)."""

    def __init__(self, timing: SaveTiming, times: SaveTimes, step: Callable[[], int]) -> None:
        self.timing, self._times, self._step = timing, times, step
        self._t0 = time.perf_counter()
        self._beside: float | None = None

    def joined(self) -> None:
        if self._beside is None:
            self._beside = time.perf_counter() - self._t0
            self.timing.overlap_steps = self._step() - self.timing.step

    def committed(self) -> None:
        self.timing.commit_secs = time.perf_counter() - self._t0
        self.joined()
        self.timing.overlap_secs = self._beside or 0.0
        self._times.committed.append(self.timing)


class SharedHold:
    """One staging of the state read by the saves of both tiers at one step.

    Released (`Staged.release`) when the last save holding it has committed. A
    save that comes after every holder released stages the state again.
    """

    def __init__(self, staged: Any) -> None:
        self.state = staged.state
        self._staged: Any = staged
        self._holders = 1
        self._lock = threading.Lock()

    def acquire(self) -> None:
        """Hold it for one more save (not once it was released already)."""
        with self._lock:
            if self._holders:
                self._holders += 1

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders != 0:
                return
            staged, self._staged = self._staged, None
        if staged is not None:
            staged.release()


class Tier:
    """A directory of checkpoints and the save in flight to it.

    `chief_writes`: whether only the chief names checkpoints in this tier's
    `checkpoint` file and applies retention (the shared durable tier), or every
    process in its own (the local tier).
    """

    def __init__(self, kind: str, backend: CheckpointBackend, ledger: CheckpointList,
                 owns_backend: bool, chief_writes: bool) -> None:
        self.kind = kind
        self.backend, self.ledger = backend, ledger
        self.owns_backend = owns_backend
        self.chief_writes = chief_writes
        #: the `checkpoint` file as it was at the start
        self.file: CheckpointState | None = ledger.load(backend.steps())
        self.commit: Commit | None = None
        #: the first commit that failed or never committed: no save after it
        self.failed: BaseException | None = None
        self.last_save_step: int | None = None
        #: the local tier's peer copies (`peers.Peers`, `Config.local_replicas`), or None
        self.peers: Any = None

    def path(self, step: int) -> str:
        return checkpoint_path(self.ledger.logdir, self.ledger.basename, step)

    def writes(self, session: Any) -> bool:
        return session.is_chief or not self.chief_writes

    def join(self, session: Any, grace_secs: float) -> None:
        """Wait for the save in flight. A commit that outlives the stop's grace period
        is named and left behind: it stays `commit`, and no save follows it."""
        commit = self.commit
        if commit is not None and commit.join(session.should_stop, grace_secs):
            self.commit = None

    def unusable(self) -> BaseException | None:
        """The error that forbids another save here: a failed or a stuck commit."""
        if self.failed is not None:
            return self.failed
        if self.commit is not None:
            return CheckpointError(f"the checkpoint save {self.path(self.commit.step)} "
                                   "never committed")
        return None

    def start(self, session: Any, step: int, state: Any, hold: Any, metadata: dict,
              timed: tuple[SaveTimes, float] | None = None) -> None:
        """Start saving `state` as `step`; a commit thread publishes it once durable.

        `timed`: where the save's timing goes, and when its hold began (`Beside`).
        """
        if step in self.ledger.on_disk and self.writes(session):  # saved over: named no more
            self.ledger.make_room(step)
            self.backend.delete(step)
        self.backend.save(step, state, metadata)
        self.last_save_step = step
        timing = None
        if timed is not None:
            times, t0 = timed
            timing = Beside(SaveTiming(step, time.perf_counter() - t0), times,
                            lambda: session.step)
        self.commit = Commit(step, self.backend, hold,
                             lambda: self._committed(session, step, metadata["timestamp"]),
                             lambda ex: self._failed(session, step, ex),
                             "checkpoint" if self.kind == "durable" else "checkpoint-local",
                             timing)

    def _committed(self, session: Any, step: int, timestamp: float) -> None:
        """In the commit thread: `step` is durable; name it and apply retention."""
        self.ledger.on_disk.add(step)
        times = session.stash.get(SAVE_TIMES)
        if times is not None:  # the goodput ledger's record of saves, by tier
            times.saved.append((step, self.kind, time.time()))
        if self.writes(session):
            for old in self.ledger.publish(step, timestamp):
                self.backend.delete(old)
        if self.peers is not None:  # copied to the peers in their own thread
            self.peers.committed(step)
        checkpoint_committed(step)  # `loopkit run` counts its child's progress from it

    def _failed(self, session: Any, step: int, ex: BaseException) -> None:
        add_note(ex, f"raised in loopkit plugin 'checkpoint' while committing {self.path(step)}")
        if self.failed is None:
            self.failed = ex
        # stops the run at the next step (many processes: at the next agreement)
        session.request_stop(ex, agreed=True)

    def close(self, grace_secs: float = 0.0) -> None:
        if self.peers is not None:  # the copy in flight finishes (at most `grace_secs`)
            self.peers.close(grace_secs)
        if self.commit is not None:
            return  # left behind: closing would wait for the stuck save again
        if self.owns_backend:
            self.backend.close()
        else:
            self.backend.wait()  # the caller's instance: theirs to close


def refuse_a_file(local: Path) -> None:
    """Fail, naming the field, when the local tier's directory (or a parent) is a file."""
    for at in (local, *local.parents):
        if at.exists():
            if not at.is_dir():
                what = "is" if at == local else f"is inside {str(at)!r}, which is"
                raise ValueError(f"Config.local_checkpoint_dir={str(local)!r} {what} an "
                                 "existing file: expected a directory (created if missing)")
            return
