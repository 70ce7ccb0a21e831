"""Built-in `checkpoint`: timer-driven saves, recovery at start-up, retention.

Saves run on the shared timer (`save_model_secs` / `save_model_steps`) and once
more at a normal stop. A save is started from the main thread (the backend may
write asynchronously); a commit thread of this plugin then waits for it to be
durable and only then, on the chief, rewrites ``logdir/checkpoint`` and applies
retention. At most one save is in flight: the next save, and the stop, first
wait for the previous commit. An error while committing stops the run and is
re-raised from `train`.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from loopkit import storage
from loopkit.checkpoint import CheckpointBackend, Restored
from loopkit.config import Config
from loopkit.coordinator import add_note
from loopkit.errors import CheckpointError
from loopkit.hookspec import hookimpl
from loopkit.pytree import check_storable
from loopkit.plugins.checkpoint_helpers import (
    checkpoints_iterator,
    describe_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    place_like,
)
from loopkit.plugins.checkpoint_replicas import agree_to_save, host_copies
from loopkit.plugins.checkpoint_state import (
    CheckpointState,
    decode_position,
    encode_position,
    read_state,
    recovery_order,
    write_state,
)

__all__ = [
    "BUILTIN_BACKENDS",
    "CheckpointPlugin",
    "checkpoints_iterator",
    "describe_checkpoints",
    "latest_checkpoint",
    "load_checkpoint",
    "plugin",
]

log = logging.getLogger("loopkit")

INACTIVE = "needs Config.logdir and Config.checkpoint_backend (one of them is None)"

#: the backend names this plugin's `checkpoint_backend` hook provides
BUILTIN_BACKENDS = ("orbax", "npz")

PyTree = Any


class CheckpointPlugin:
    """Saves the state on a timer and at a normal stop; restores it at start-up."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.backend: CheckpointBackend | None = None
        self._owns_backend = False
        self._logdir: Path | str | None = None  # a URL for an object store
        self._basename = config.checkpoint_basename
        #: committed checkpoints on disk (listed or not)
        self._on_disk: set[int] = set()
        #: the `checkpoint` file's list: (step, wall time of the save), in save order
        self._listed: list[tuple[int, float | None]] = []
        self._last_preserved = time.time()
        self._last_save_step: int | None = None
        self._restored: tuple[int, list[int]] | None = None  # (step, leaf ids) just restored
        self._commit: threading.Thread | None = None
        self._commit_error: BaseException | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self._abandoned = False  # a commit outlived stop_grace_secs

    # -- the backend -------------------------------------------------------------------

    @hookimpl(trylast=True)
    def checkpoint_backend_names(self) -> list[str]:
        return list(BUILTIN_BACKENDS)

    @hookimpl(trylast=True)
    def checkpoint_backend(self, name: str, directory: Path | str, config: Config) -> Any:
        basename = config.checkpoint_basename
        if name == "orbax":
            from loopkit.plugins.orbax_backend import OrbaxBackend as make
        elif name == "npz":
            from loopkit.plugins.npz_backend import NpzBackend as make
        else:
            return None
        from loopkit.plugins.staged_backend import local_or_staged

        # under a URL: staged on local disk, uploaded when committed
        return local_or_staged(directory, basename, lambda d: make(d, basename, config))

    def _open(self, session: Any) -> CheckpointBackend:
        """Build the session's one backend (restore_state runs first, so usually there)."""
        if self.backend is not None:
            return self.backend
        spec = self.config.checkpoint_backend
        logdir = self._logdir = session.logdir
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
        self.backend = backend
        self._on_disk = set(backend.steps())
        state = read_state(logdir, self._basename)
        if state is not None:
            self._listed = list(state.listed)
            if state.last_preserved_timestamp is not None:
                self._last_preserved = state.last_preserved_timestamp
        return backend

    def _path(self, step: int) -> str:
        assert self._logdir is not None
        return str(storage.join(self._logdir, f"{self._basename}-{step}"))

    # -- recovery ----------------------------------------------------------------------

    @hookimpl(trylast=True)
    def restore_state(self, session: Any, like: PyTree) -> Restored | None:
        backend = self._open(session)
        state = read_state(self._logdir, self._basename)
        committed = sorted(self._on_disk)
        placed = place_like(like)
        if jax.process_count() > 1:
            return self._restore_agreed(session, backend, state, placed)
        failures: list[tuple[int, BaseException]] = []
        for step in recovery_order(state, committed):
            name = f"{self._basename}-{step}"
            if step not in self._on_disk:
                log.warning("loopkit: %s/checkpoint names %s, which is not a committed "
                            "checkpoint; trying the next older one", self._logdir, name)
                continue
            try:
                tree, metadata = backend.restore(step, placed)
                position = decode_position((metadata or {}).get("data_position"))
            except Exception as ex:  # noqa: BLE001 - unreadable data marks it corrupt
                log.warning("loopkit: checkpoint %s is unreadable, skipping it (%s: %s)",
                            self._path(step), type(ex).__name__, ex)
                failures.append((step, ex))
                continue
            return self._accept(step, tree, position, state)
        if failures:
            details = "; ".join(f"{self._basename}-{s}: {type(e).__name__}: {e}"
                                for s, e in failures)
            raise CheckpointError(
                f"checkpoints exist in {self._logdir} but none can be restored ({details}). "
                "Not starting fresh: move them away to start over."
            ) from failures[0][1]
        if state is not None and state.latest is not None:
            log.warning("loopkit: %s/checkpoint names checkpoints but none exists; "
                        "starting fresh", self._logdir)
        self._listed = []
        return None

    def _restore_agreed(self, session: Any, backend: CheckpointBackend,
                        state: CheckpointState | None, placed: PyTree) -> Restored | None:
        """Many processes: all restore the step the chief chose, or all start fresh.

        The chief (process 0) picks the candidate by the single-process rules and
        broadcasts it; a process whose view of a shared directory lags polls every
        `recovery_wait_secs` until the checkpoint appears (up to a bound); then
        every process restores it, and they agree whether all succeeded. If one
        failed, the chief's next candidate is tried, together.
        """
        from jax.experimental import multihost_utils

        order = recovery_order(state, sorted(self._on_disk)) if jax.process_index() == 0 else []
        tried: set[int] = set()
        failures: list[tuple[int, BaseException]] = []
        while True:
            mine = next((s for s in order if s not in tried and s in self._on_disk), -1)
            step = int(multihost_utils.broadcast_one_to_all(np.asarray(mine, np.int32)))
            if step < 0:
                break
            tried.add(step)
            result: Any = None
            try:
                self._wait_until_visible(step)
                tree, metadata = backend.restore(step, placed)
                result = (tree, decode_position((metadata or {}).get("data_position")))
            except Exception as ex:  # noqa: BLE001 - unreadable here: agree on it below
                log.warning("loopkit: checkpoint %s is unreadable on process %d (%s: %s)",
                            self._path(step), jax.process_index(), type(ex).__name__, ex)
                failures.append((step, ex))
            ok = multihost_utils.process_allgather(np.asarray(result is not None, np.int32))
            if np.all(np.asarray(ok)):
                self._on_disk.add(step)
                return self._accept(step, *result, state)
            log.warning("loopkit: checkpoint %s could not be restored on every process; "
                        "trying the chief's next candidate", self._path(step))
        if tried:
            raise CheckpointError(
                f"checkpoints exist in {self._logdir} but none could be restored on every "
                f"process (tried steps {sorted(tried)})"
            ) from (failures[0][1] if failures else None)
        self._listed = []
        return None

    def _wait_until_visible(self, step: int) -> None:
        """Poll every `recovery_wait_secs` until `step` is committed in this process's view."""
        poll = max(0.05, float(self.config.recovery_wait_secs))
        bound = max(60.0, 10 * poll)
        deadline = time.monotonic() + bound
        while step not in self._on_disk:
            assert self.backend is not None
            self._on_disk = set(self.backend.steps())
            if step in self._on_disk:
                return
            if time.monotonic() > deadline:
                raise FileNotFoundError(
                    f"checkpoint {self._path(step)} chosen by the chief did not appear here "
                    f"within {bound:.0f} s")
            log.info("loopkit: waiting for %s to appear (recovery_wait_secs=%s)",
                     self._path(step), self.config.recovery_wait_secs)
            time.sleep(poll)

    def _accept(self, step: int, tree: PyTree, position: Any,
                state: CheckpointState | None) -> Restored:
        """Take `step` as the recovered checkpoint (one process or all of them)."""
        self._adopt(step, state)
        self._restored = (step, sorted(map(id, jax.tree.leaves(tree))))
        log.info("loopkit: restored %s", self._path(step))
        return Restored(tree, step, position, self._path(step))

    def _adopt(self, step: int, state: CheckpointState | None) -> None:
        """Take the `checkpoint` file's list up to the restored step.

        Checkpoints newer than the restored one (a hand-picked older restart)
        leave the list; they stay on disk until this run overwrites them.
        """
        if state is None:
            listed: list[tuple[int, float | None]] = [(s, None) for s in sorted(self._on_disk)]
        else:
            listed = list(state.listed)
        listed = [(s, t) for s, t in listed if s <= step]
        if step not in {s for s, _ in listed}:
            listed.append((step, None))
        self._listed = listed

    # -- saving ------------------------------------------------------------------------

    @hookimpl(tryfirst=True)  # built-in services start before other plugins'
    def session_create(self, session: Any) -> None:
        # refused now, naming the leaf, rather than at the first save
        check_storable(session.state)
        self._open(session)
        secs = self.config.save_model_secs or None
        steps = self.config.save_model_steps or None
        if secs or steps:
            session.every(self._save, secs=secs, steps=steps, name="checkpoint")

    def _save(self, session: Any) -> None:
        """Start saving the current state (the timer action, and the final save)."""
        t0 = time.perf_counter()
        step = session.step
        if jax.process_count() > 1:
            self._join_commit(session)
        else:
            self._finish_commit(session)
        # The backend may read in the background: the state staged so that the
        # next steps donate none of what it reads, kept until the save commits.
        staged = session.stage_state()
        state = staged.state
        if jax.process_count() > 1:
            # every process saves at this step: agree that all may, and on the replicas
            state, names, prints = host_copies(state)
            agree_to_save(self._path(step), names, prints, self._commit_error or (
                CheckpointError(f"a checkpoint save in {self._logdir} never committed")
                if self._abandoned else None))
        backend = self.backend
        assert backend is not None
        if step in self._on_disk:
            self._make_room(session, step)
        metadata = {
            "step": step,
            "data_position": encode_position(
                session.input.position(step) if session.input is not None else None
            ),
            "timestamp": time.time(),
        }
        backend.save(step, state, metadata)
        self._last_save_step = step
        self._commit = threading.Thread(
            target=self._committer, args=(session, step, metadata["timestamp"], staged),
            name=f"loopkit-checkpoint-commit-{step}",
            daemon=True,  # a backend that never commits must not keep the process alive
        )
        self._commit.start()
        session.stats.checkpoint_blocking_secs = time.perf_counter() - t0

    def _make_room(self, session: Any, step: int) -> None:
        """Before replacing the checkpoint of `step`: name an earlier one, then delete it."""
        if not session.is_chief:
            return
        self._listed = [(s, t) for s, t in self._listed if s != step]
        earlier = [s for s, _ in self._listed if s < step]
        self._write_state(max(earlier) if earlier else None)
        assert self.backend is not None
        self.backend.delete(step)
        self._on_disk.discard(step)

    def _committer(self, session: Any, step: int, timestamp: float, staged: Any) -> None:
        try:
            assert self.backend is not None
            self.backend.wait()
            del staged  # read and written: the buffers may be donated again
            self._on_disk.add(step)
            if session.is_chief:
                self._publish(step, timestamp)
        except BaseException as ex:  # noqa: BLE001 - handed to the main thread
            add_note(ex, f"raised in loopkit plugin 'checkpoint' while committing "
                         f"{self._path(step)}")
            self._commit_error = ex
            with self._lock:
                if not self._stopping:  # many processes: all stop at the next agreement
                    session.request_stop(ex, agreed=True)

    def _publish(self, step: int, timestamp: float) -> None:
        """Name the committed `step` in the `checkpoint` file, then apply retention."""
        listed = [(s, t) for s, t in self._listed if s != step] + [(step, timestamp)]
        keep, hours = self.config.max_to_keep, self.config.keep_checkpoint_every_n_hours
        keep = keep or None  # as tf.train.Saver: 0 or None keeps every checkpoint
        doomed = []
        while keep is not None and len(listed) > keep:
            old, t = listed.pop(0)
            # As tf.train: one checkpoint per `hours` leaves the list but stays on disk.
            if hours and t is not None and t - hours * 3600 >= self._last_preserved:
                self._last_preserved = t
                continue
            doomed.append(old)
        self._listed = listed
        self._write_state(step)
        assert self.backend is not None
        for old in doomed:
            self.backend.delete(old)
            self._on_disk.discard(old)

    def _write_state(self, latest: int | None) -> None:
        hours = self.config.keep_checkpoint_every_n_hours
        write_state(self._logdir, CheckpointState(
            basename=self._basename, latest=latest, listed=list(self._listed),
            last_preserved_timestamp=self._last_preserved if hours else None,
        ))

    def _join_commit(self, session: Any = None) -> None:
        """Wait for the commit in flight. Once a stop is under way, for at most
        `stop_grace_secs`: a backend that never commits is named and left behind."""
        thread = self._commit
        if thread is None:
            return
        deadline = None
        while thread.is_alive():
            thread.join(0.1)
            if self._stopping or (session is not None and session.should_stop()):
                now = time.monotonic()
                deadline = deadline or now + self.config.stop_grace_secs
                if now > deadline and thread.is_alive():
                    log.warning("loopkit: thread %r did not commit within stop_grace_secs=%s;"
                                " leaving it behind", thread.name, self.config.stop_grace_secs)
                    self._abandoned = True
                    return
        self._commit = None

    def _finish_commit(self, session: Any = None) -> None:
        """Wait for the save in flight to commit; re-raise an error from its commit."""
        self._join_commit(session)
        if self._abandoned:
            raise CheckpointError(f"a checkpoint save in {self._logdir} never committed")
        if self._commit_error is not None:
            raise self._commit_error

    # -- stopping ----------------------------------------------------------------------

    def _is_restored_state(self, session: Any) -> bool:
        if self._restored is None or self._restored[0] != session.step:
            return False
        # the same leaf objects: neither a step nor local_init_fn replaced them
        return sorted(map(id, jax.tree.leaves(session.state))) == self._restored[1]

    @hookimpl
    def on_stop(self, session: Any, error: BaseException | None) -> None:
        if self.backend is None:
            return
        with self._lock:
            self._stopping = True  # from now on a commit error is raised here, not sent
        try:
            self._join_commit()
            # Many processes: a failed commit is agreed inside `_save`, by all of them.
            clean = jax.process_count() > 1 or (self._commit_error is None
                                                and not self._abandoned)
            if (error is None and clean
                    and session.state is not None
                    and self._last_save_step != session.step
                    and not self._is_restored_state(session)):
                self._save(session)
                self._join_commit()
        finally:
            if self._abandoned:
                pass  # closing would wait for the stuck save again
            elif self._owns_backend:
                self.backend.close()
            else:
                self.backend.wait()  # the caller's instance: theirs to close
        failed = self._commit_error
        if failed is not None and failed is not error and failed is not session.coord.exception:
            raise failed


def plugin(config: Config) -> CheckpointPlugin | None:
    if config.logdir is None or config.checkpoint_backend is None:
        return None
    return CheckpointPlugin(config)
