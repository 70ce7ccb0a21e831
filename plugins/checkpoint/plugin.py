"""Built-in `checkpoint`: timer-driven saves, recovery at start-up, retention.

Saves run on the shared timer (`save_model_secs` / `save_model_steps`) and once
more at a normal stop. A save is started from the main thread (the backend may
write asynchronously); a commit thread of this plugin then waits for it to be
durable and only then, on the chief, rewrites ``logdir/checkpoint`` and applies
retention (`retention.Ledger`; the first publish also records the backend's name
beside the file, `tf_file.write_backend_name`). At most one save is in flight: the
next save, and the stop, first wait for the previous commit. An error while
committing stops the run and is re-raised from `train`. Recovery at start-up is
`recovery.find_restorable`, in the order `tf_file.recovery_order` gives. How long
each save held the loop is written beside the metrics as
``loopkit/checkpoint_blocking_secs``.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax

from loopkit import storage
from loopkit.checkpoint import CheckpointBackend, Restored
from loopkit.config import Config
from loopkit.coordinator import add_note
from loopkit.errors import CheckpointError
from loopkit.hookspec import hookimpl
from loopkit.pytree import abstract, check_storable, conform
from loopkit.plugins.checkpoint.position import encode_position
from loopkit.plugins.checkpoint.recovery import find_restorable, read_checkpoint
from loopkit.plugins.checkpoint.replicas import agree_to_save, host_copies
from loopkit.plugins.checkpoint.retention import Ledger
from loopkit.plugins.checkpoint.tf_file import CheckpointState, checkpoint_path
from loopkit.plugins.goodput.cadence import AutoInterval
from loopkit.plugins.goodput.ledger import SAVE_TIMES, SaveTimes, SaveTiming

__all__ = ["BUILTIN_BACKENDS", "INACTIVE", "CheckpointPlugin", "plugin"]

log = logging.getLogger("loopkit")

INACTIVE = "needs Config.logdir and Config.checkpoint_backend (one of them is None)"

#: the backend names this plugin's `checkpoint_backend` hook provides
BUILTIN_BACKENDS = ("orbax", "npz")

PyTree = Any


#: how often a wait for a commit looks whether a stop was requested meanwhile
NOTICE_SECS = 0.1

BLOCKING_TAG = "loopkit/checkpoint_blocking_secs"


class Commit:
    """One save in flight: a thread waits until the backend made it durable, then publishes.

    `hold` (the `Staged` state) stays referenced until the backend has read and
    written it, then is released: off CPU the staged state holds host copies; on
    CPU it may hold the very buffers, which the step after a later save then
    writes into.
    """

    def __init__(self, step: int, backend: CheckpointBackend, hold: Any,
                 publish: Callable[[], None], failed: Callable[[BaseException], None],
                 timing: Beside | None = None) -> None:
        self.step = step
        self.error: BaseException | None = None
        self.timing = timing
        self.done = threading.Event()
        self._args = (backend, hold, publish, failed)
        self.thread = threading.Thread(
            target=self._run, name=f"loopkit-checkpoint-commit-{step}",
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
            self.error = ex
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
    ran beside the steps (until it was durable or the loop joined it), over how many."""

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


class CheckpointPlugin:
    """Saves the state on a timer and at a normal stop; restores it at start-up."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.backend: CheckpointBackend | None = None
        self.ledger: Ledger | None = None
        #: how long the latest save held the loop, in seconds
        self.blocking_secs: float | None = None
        self._owns_backend = False
        self._file: CheckpointState | None = None  # the `checkpoint` file at the start
        self._last_save_step: int | None = None
        self._restored: tuple[int, list[int]] | None = None  # (step, leaf ids) just restored
        self._commit: Commit | None = None
        self._times = SaveTimes()  # the session's (in the stash: the ledger reads it)
        self._timer: Any = None
        self._auto: AutoInterval | None = None
        #: the first commit that failed or never committed: no save after it
        self._failed: BaseException | None = None

    # -- the backend -------------------------------------------------------------------

    @hookimpl(trylast=True)
    def checkpoint_backend_names(self) -> list[str]:
        return list(BUILTIN_BACKENDS)

    @hookimpl(trylast=True)
    def checkpoint_backend(self, name: str, directory: Path | str, config: Config) -> Any:
        basename = config.checkpoint_basename
        if name == "orbax":
            from loopkit.plugins.checkpoint.backends.orbax import OrbaxBackend as make
        elif name == "npz":
            from loopkit.plugins.checkpoint.backends.npz import NpzBackend as make
        else:
            return None
        from loopkit.plugins.checkpoint.backends.staged import local_or_staged

        # under a URL: staged on local disk, uploaded when committed
        return local_or_staged(directory, basename, lambda d: make(d, basename, config))

    def _open(self, session: Any) -> tuple[CheckpointBackend, Ledger]:
        """Build the session's one backend (restore_state runs first, so usually there)."""
        if self.backend is not None and self.ledger is not None:
            return self.backend, self.ledger
        spec = self.config.checkpoint_backend
        logdir = session.logdir
        storage.makedirs(logdir)
        if isinstance(spec, str):
            backend = session.hook.checkpoint_backend(name=spec, directory=logdir,
                                                      config=self.config)
            if backend is None:
                raise ValueError(
                    f"Config.checkpoint_backend={spec!r} names no known backend; built-in: "
                    f"{', '.join(repr(n) for n in BUILTIN_BACKENDS)} (a plugin adds others "
                    "through the 'checkpoint_backend' hook), or pass a backend instance"
                )
            self._owns_backend = True
        else:
            backend = spec
        name = spec if isinstance(spec, str) else None  # recorded for the helpers
        self.backend, self.ledger = backend, Ledger(logdir, self.config, name)
        self._file = self.ledger.load(backend.steps())
        return backend, self.ledger

    def _path(self, step: int) -> str:
        assert self.ledger is not None
        return checkpoint_path(self.ledger.logdir, self.config.checkpoint_basename, step)

    # -- recovery ----------------------------------------------------------------------

    @hookimpl(trylast=True)
    def restore_state(self, session: Any, like: PyTree) -> Restored | None:
        backend, ledger = self._open(session)
        state = self._file
        # `like` as init gives it: a leaf without a sharding comes back uncommitted on
        # the default device, as a fresh one is, so the step compiles to the same
        # program (and a restart finds it in the persistent compilation cache)
        found = find_restorable(backend, ledger, state, like, self._path,
                                self.config.recovery_wait_secs)
        ledger.adopt(None if found is None else found.step, state)
        if found is None:
            return None
        self._restored = (found.step, sorted(map(id, jax.tree.leaves(found.tree))))
        log.info("loopkit: restored %s", self._path(found.step))
        return Restored(found.tree, found.step, found.data_position, self._path(found.step),
                        found.consumed, found.skipped)

    @hookimpl(trylast=True)
    def rollback_state(self, session: Any, before_step: int) -> Restored | None:
        """Wait for the save in flight, then read back the newest committed checkpoint
        of a step before `before_step` (many processes: the chief's choice). Committed
        checkpoints from `before_step` on hold abandoned steps: they are deleted, so a
        restart never resumes from them."""
        self._join_commit(session)
        if self._commit is not None:
            raise CheckpointError(f"the checkpoint save {self._path(self._commit.step)} "
                                  "never committed; cannot roll back past it")
        backend, ledger = self._open(session)
        older = [s for s in ledger.on_disk if s < before_step]
        step = max(older, default=-1)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            import numpy as np

            step = int(multihost_utils.broadcast_one_to_all(np.asarray(step, np.int32)))
        for doomed in sorted((s for s in ledger.on_disk if s >= before_step), reverse=True):
            log.warning("loopkit: deleting %s: it holds a step after the bad step %d",
                        self._path(doomed), before_step)
            if session.is_chief:
                ledger.make_room(doomed)
                backend.delete(doomed)
            ledger.on_disk.discard(doomed)
        self._last_save_step = None  # a save at the restored step writes the new position
        if step < 0:
            return None
        like = abstract(session.state)
        found = read_checkpoint(backend, step, like)
        return Restored(conform(found.tree, like), step, found.data_position,
                        self._path(step), found.consumed, found.skipped)

    # -- saving ------------------------------------------------------------------------

    @hookimpl(tryfirst=True)  # built-in services start before other plugins'
    def session_create(self, session: Any) -> None:
        # refused now, naming the leaf, rather than at the first save
        check_storable(session.state)
        self._open(session)
        self._times = session.stash.setdefault(SAVE_TIMES, SaveTimes())
        secs = self.config.save_model_secs or None
        if secs == "auto":
            self._auto = AutoInterval(session)
            secs = self._auto.interval
        steps = self.config.save_model_steps or None
        if secs or steps:
            self._timer = session.every(self._save, secs=secs, steps=steps, name="checkpoint")

    def _save(self, session: Any) -> None:
        """Start saving the current state (the timer action, and the final save)."""
        t0 = time.perf_counter()
        try:
            self._start_save(session, t0)
        finally:
            self._times.held_secs += time.perf_counter() - t0
        if self._auto is not None and self._timer is not None and not session.should_stop():
            self._timer.secs = self._auto.update(session)  # in force from the re-arm

    def _start_save(self, session: Any, t0: float) -> None:
        step, many = session.step, jax.process_count() > 1
        self._join_commit(session)
        stuck = self._commit and CheckpointError(
            f"the checkpoint save {self._path(self._commit.step)} never committed")
        if not many and (self._failed or stuck):
            raise self._failed or stuck
        # The backend may read in the background: the state staged so that the
        # next steps donate none of what it reads, kept until the save commits.
        staged = session.stage_state()
        state = staged.state
        if many:
            # every process saves at this step: agree that all may, and on the replicas
            state, names, prints = host_copies(state)
            agree_to_save(self._path(step), names, prints, self._failed or stuck)
        backend, ledger = self._open(session)
        if step in ledger.on_disk and session.is_chief:  # saved over: named no more first
            ledger.make_room(step)
            backend.delete(step)
        inp = session.input
        metadata = {
            "step": step,
            "data_position": encode_position(inp.position(step) if inp is not None else None),
            "timestamp": time.time(),
        }
        if inp is not None and inp.skipped:  # rollbacks skipped batches: where the input is
            metadata.update(consumed=step + inp.offset, skipped=[list(r) for r in inp.skipped])
        backend.save(step, state, metadata)
        self._last_save_step = step
        self.blocking_secs = time.perf_counter() - t0
        timing = Beside(SaveTiming(step, self.blocking_secs), self._times, lambda: session.step)
        self._commit = Commit(step, backend, staged,
                              lambda: self._committed(session, step, metadata["timestamp"]),
                              lambda ex: self._commit_failed(session, step, ex), timing)
        if session.summary_writer is not None:
            session.summary_writer.add_scalar(BLOCKING_TAG, self.blocking_secs, step)

    def _committed(self, session: Any, step: int, timestamp: float) -> None:
        """In the commit thread: `step` is durable; the chief names it and applies retention."""
        backend, ledger = self._open(session)
        ledger.on_disk.add(step)
        if session.is_chief:
            for old in ledger.publish(step, timestamp):
                backend.delete(old)

    def _commit_failed(self, session: Any, step: int, ex: BaseException) -> None:
        add_note(ex, f"raised in loopkit plugin 'checkpoint' while committing {self._path(step)}")
        if self._failed is None:
            self._failed = ex
        # stops the run at the next step (many processes: at the next agreement)
        session.request_stop(ex, agreed=True)

    def _join_commit(self, session: Any) -> None:
        """Wait for the save in flight. A commit that outlives the stop's grace period
        is named and left behind: it stays `_commit`, and no save follows it."""
        commit = self._commit
        if commit is not None and commit.join(session.should_stop, self.config.stop_grace_secs):
            self._commit = None

    # -- stopping ----------------------------------------------------------------------

    def _owes_final_save(self, session: Any, error: BaseException | None) -> bool:
        """A normal stop saves the final step, unless it is saved already (or is the
        state just restored, untouched), or a save failed or never committed (many
        processes agree on a failed commit inside `_save`)."""
        if error is not None or session.state is None or self._last_save_step == session.step:
            return False
        if self._commit is not None:  # a save never committed: left behind
            return False
        if self._failed is not None and jax.process_count() == 1:
            return False
        restored = self._restored
        return not (restored is not None and restored[0] == session.step
                    # the same leaf objects: neither a step nor local_init_fn replaced them
                    and sorted(map(id, jax.tree.leaves(session.state))) == restored[1])

    @hookimpl
    def on_stop(self, session: Any, error: BaseException | None) -> None:
        if self.backend is None:
            return
        t0, held = time.perf_counter(), self._times.held_secs
        try:
            self._join_commit(session)
            if self._owes_final_save(session, error):
                self._save(session)
                self._join_commit(session)
        finally:
            self._times.held_secs = held + time.perf_counter() - t0  # the final save's too
            if self._commit is not None:
                pass  # left behind: closing would wait for the stuck save again
            elif self._owns_backend:
                self.backend.close()
            else:
                self.backend.wait()  # the caller's instance: theirs to close
        failed = self._failed
        if failed is not None and failed is not error and failed is not session.coord.exception:
            raise failed


def plugin(config: Config) -> CheckpointPlugin | None:
    if config.logdir is None or config.checkpoint_backend is None:
        return None
    return CheckpointPlugin(config)
