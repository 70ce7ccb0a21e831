"""Recovery at start-up: the newest checkpoint that can be read, on one process or all.

A checkpoint that cannot be read is skipped with a warning naming it; if
checkpoints exist but none can be restored, `CheckpointError` — never a silent
fresh start. An error of the store is not an unreadable checkpoint: it is retried
(`loopkit.storage.retry.retrying`) and then fails the run with `CheckpointError` (its
`StoreFailure`), never a resume from an older step. With many processes the chief
chooses and every process restores the same step, or all start fresh; a store that
failed on one process fails every process.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Collection

import jax
import numpy as np

from loopkit.plugin.backend import CheckpointBackend, Restored
from loopkit.errors import CheckpointError
from loopkit.storage.retry import StoreFailure, retrying
from loopkit.plugins.checkpoint.collectives import (
    broadcast_from_chief, common_steps, gather_rows, worst_of,
)
from loopkit.plugins.checkpoint.position import own_position
from loopkit.plugins.checkpoint.tf_file import (
    BACKEND_FILE, CheckpointState, read_backend_name, read_state, recovery_order,
)

__all__ = ["durable_best", "find_local", "find_restorable",
           "read_checkpoint"]

log = logging.getLogger("loopkit")

PyTree = Any


def find_restorable(backend: CheckpointBackend, steps: Collection[int], logdir: Path | str,
                    state: CheckpointState | None, like: PyTree, path_of: Callable[[int], str],
                    recovery_wait_secs: float, name: str | None = None) -> Restored | None:
    """The newest readable checkpoint of the committed `steps` in `logdir`, placed like
    `like`; None when there is none. `name`: the backend's, as Config names it."""
    refusal = _another_writer(logdir, name, state) if not steps and state is not None else None
    if jax.process_count() > 1:
        # every process enters, and the chief's view decides: a lagging view of a shared
        # directory may not show the files yet, and no process may fail alone
        if int(broadcast_from_chief(np.asarray(refusal is not None, np.int32))):
            raise CheckpointError(refusal or f"process 0 refused {logdir}: it holds the "
                                  "checkpoints of another backend or basename (its error "
                                  "names them)")
        return _agreed(backend, steps, logdir, state, like, path_of, recovery_wait_secs)
    if refusal is not None:
        raise CheckpointError(refusal)
    failures: list[tuple[int, BaseException]] = []
    for step in recovery_order(state, sorted(steps)):
        if step not in steps:
            log.warning("loopkit: %s/checkpoint names %s, which is not a committed "
                        "checkpoint; trying the next older one", logdir, path_of(step))
            continue
        try:
            return read_checkpoint(backend, step, like, path_of(step))
        except StoreFailure:
            raise  # the store's, not the checkpoint's: an older one is no answer
        except Exception as ex:  # noqa: BLE001 - unreadable data marks it corrupt
            log.warning("loopkit: checkpoint %s is unreadable, skipping it (%s: %s)",
                        path_of(step), type(ex).__name__, ex)
            failures.append((step, ex))
    if failures:
        details = "; ".join(f"{path_of(s)}: {type(e).__name__}: {e}" for s, e in failures)
        raise CheckpointError(
            f"checkpoints exist in {logdir} but none can be restored ({details}). "
            "Not starting fresh: move them away to start over."
        ) from failures[0][1]
    if state is not None and state.latest is not None:
        log.warning("loopkit: %s/checkpoint names checkpoints but none exists; "
                    "starting fresh", logdir)
    return None


def _another_writer(logdir: Path | str, name: str | None,
                    state: CheckpointState) -> str | None:
    """Why not to start: the `checkpoint` file names checkpoints this run does not see,
    of another basename, or the logdir records another backend (`checkpoint_backend.json`);
    starting fresh over them would lose the run (a changed `Config.checkpoint_basename`
    or `checkpoint_backend`). None: no such checkpoints."""
    own = read_state(logdir)  # the file as it is, whatever basename it names
    if own is not None and own.latest is not None and own.basename != state.basename:
        return (f"{logdir}/checkpoint names checkpoints of the basename {own.basename!r} "
                f"(the latest {own.basename}-{own.latest}), which Config.checkpoint_basename="
                f"{state.basename!r} does not read. Not starting fresh: set "
                f"checkpoint_basename={own.basename!r} to resume, or give this run another "
                "logdir")
    recorded = read_backend_name(logdir)
    if state.latest is None or name is None or recorded in (None, name):
        return None
    return (f"{logdir} holds checkpoints of the backend {recorded!r} (it says so in "
            f"{BACKEND_FILE}), which Config.checkpoint_backend={name!r} does not read. Not "
            f"starting fresh: set checkpoint_backend={recorded!r} to resume, or give this "
            "run another logdir")


def durable_best(steps: Collection[int], state: CheckpointState | None) -> int | None:
    """The step the durable tier would restore first (not read: it may be corrupt)."""
    return next((s for s in recovery_order(state, sorted(steps)) if s in steps), None)


def find_local(backend: CheckpointBackend, steps: Collection[int], state: CheckpointState | None,
               like: PyTree, path_of: Callable[[int], str], floor: int | None,
               peers: Any = None) -> Restored | None:
    """The local tier's newest readable checkpoint at or after step `floor` (the
    durable tier's best), written by as many processes as there are now; None
    when there is none, and the durable tier is tried next.

    A local checkpoint that cannot be read is skipped with a warning naming it:
    an older one, or the durable tier, serves instead. Many processes (each with
    its own local tier): the newest step that every process holds and reads; with
    `peers` (`peers.Peers`), the newest whose every part is held by its owner or a
    peer, a part that is not here received from the peer first.
    """
    if jax.process_count() > 1:
        return _agreed_local(backend, steps, like, path_of, floor, peers)
    for step in recovery_order(state, sorted(steps)):
        if step not in steps:
            continue
        if floor is not None and step < floor:
            break
        try:
            tree, metadata = _restore(backend, step, like, path_of(step))
        except StoreFailure:
            raise  # the store's, not the checkpoint's: an older one is no answer
        except Exception as ex:  # noqa: BLE001 - unreadable data marks it corrupt
            log.warning("loopkit: local checkpoint %s is unreadable, skipping it (%s: %s)",
                        path_of(step), type(ex).__name__, ex)
            continue
        count = (metadata or {}).get("process_count", 1)
        if count != jax.process_count():
            log.warning("loopkit: local checkpoint %s was written by %s processes, this run "
                        "has %d; restoring from the durable tier", path_of(step), count,
                        jax.process_count())
            return None
        return _found(step, tree, metadata, path_of(step))
    return None


#: what a process's read came to, agreed as the worst over processes (`_worst`)
_READ, _UNREADABLE, _STORE = 0, 1, 2
#: what a read that met a store error for the whole retry bound says to do
_ADVICE = ("Not falling back on an older checkpoint (this one may be fine): restart once "
           "the store answers")


def read_together(backend: CheckpointBackend, step: int, like: Any, where: str,
                  failed: Callable[[Any], Any],
                  before: Callable[[], None] = lambda: None) -> Restored | None:
    """`read_checkpoint` on every process at once, or on none: `before()` and the
    download first (of what `restore(step, like)` reads, where the backend keeps
    checkpoints remotely: its optional `fetch`, the staged backend's of URL logdirs),
    then one agreement, so that no process starts orbax's read,
    which ends at a barrier, while another has failed; then the read and a second
    agreement. The checkpoint on every process, or None on every process when it is
    unreadable anywhere (`failed((step, error))` gets this process's error). An error
    of the store, retried here on each process alone, raises `CheckpointError` on every
    process, wherever it happened. Every process runs the same collectives here
    (one, or two when the downloads succeeded everywhere), whatever fails. (Retrying
    alone keeps them in order: a download has none, and a read's one, orbax's closing
    barrier, comes after the reads that may fail, so each process reaches it once; a
    collective's own error is jax's RuntimeError, never retried.)"""
    def download() -> None:
        before()
        fetch = getattr(backend, "fetch", None)
        if fetch is not None:
            fetch(step, like)

    found: Restored | None = None
    mine: BaseException | None = None
    try:
        retrying(download, f"downloading checkpoint {where}", _ADVICE)
        outcome = _READ
    except Exception as ex:  # noqa: BLE001 - agreed below
        outcome, mine = _judged(where, step, ex, failed), ex
    outcome = worst_of(outcome)
    if outcome == _READ:
        try:
            found = read_checkpoint(backend, step, like, where)
        except Exception as ex:  # noqa: BLE001 - agreed below
            outcome, mine = _judged(where, step, ex, failed), ex
        outcome = worst_of(outcome)
    if outcome == _STORE:
        if isinstance(mine, StoreFailure):
            raise mine
        raise CheckpointError(
            f"reading checkpoint {where} failed on another process: an error of the store "
            f"(that process's output names it). {_ADVICE}") from mine
    return found if outcome == _READ else None



def _judged(where: str, step: int, ex: BaseException, failed: Callable[[Any], Any]) -> int:
    """`_STORE` for a store that kept failing, else `_UNREADABLE` (warned, `failed`)."""
    if isinstance(ex, StoreFailure):
        return _STORE
    _unreadable(where, ex)
    failed((step, ex))
    return _UNREADABLE


def _unreadable(where: str, ex: BaseException) -> None:
    on = f" on process {jax.process_index()}" if jax.process_count() > 1 else ""
    log.warning("loopkit: checkpoint %s is unreadable%s (%s: %s)", where, on,
                type(ex).__name__, ex)


def _agreed_local(backend: CheckpointBackend, steps: Collection[int], like: PyTree,
                  path_of: Callable[[int], str], floor: int | None,
                  peers: Any) -> Restored | None:
    """Many processes: the newest step every process holds in its local tier, at or
    after the chief's `floor`, restored by every process from its own; None (the
    durable tier) when there is none, or when the local tiers were written by
    another number of processes."""
    floor = int(broadcast_from_chief(np.asarray(-1 if floor is None else floor, np.int32)))
    for step in common_steps(steps) if peers is None else peers.plan(steps):
        if step < floor:
            break
        # 0: unreadable here, 1: restored, 2: another job's layout, 3: the store failed
        found, code, mine = None, 0, None
        try:
            if peers is not None:  # this process's part, from the peer holding it
                peers.fetch(step)
            tree, metadata = _restore(backend, step, like, path_of(step))
            count = (metadata or {}).get("process_count", 1)
            if count == jax.process_count():
                found, code = _found(step, tree, metadata, path_of(step)), 1
            else:
                code = 2
                log.warning("loopkit: local checkpoint %s was written by %s processes, "
                            "this run has %d", path_of(step), count, jax.process_count())
        except StoreFailure as ex:
            code, mine = 3, ex
        except Exception as ex:  # noqa: BLE001 - unreadable data: agree on it below
            log.warning("loopkit: local checkpoint %s is unreadable on process %d (%s: %s)",
                        path_of(step), jax.process_index(), type(ex).__name__, ex)
        codes = gather_rows(np.asarray(code, np.int32))
        if np.any(codes == 3):
            if mine is not None:
                raise mine
            raise CheckpointError(
                f"reading local checkpoint {path_of(step)} failed on another process: an "
                f"error of the store (that process's output names it). {_ADVICE}")
        if np.all(codes == 1):
            return found
        if np.any(codes == 2):
            break
        log.warning("loopkit: local checkpoint %s could not be restored on every process; "
                    "trying an older one", path_of(step))
    log.info("loopkit: no local checkpoint every process holds; restoring from the "
             "durable tier")
    return None


def read_checkpoint(backend: CheckpointBackend, step: int, like: PyTree, path: str) -> Restored:
    """The checkpoint of `step` (at `path`), read from `backend` and placed like `like`;
    `StoreFailure` when the store kept failing (`_restore`)."""
    tree, metadata = _restore(backend, step, like, path)
    return _found(step, tree, metadata, path)


def _restore(backend: CheckpointBackend, step: int, like: PyTree, path: str) -> tuple[Any, Any]:
    """`backend.restore(step, like)`, retried while the store fails (`retrying`)."""
    return retrying(lambda: backend.restore(step, like), f"reading checkpoint {path}", _ADVICE)


def _found(step: int, tree: PyTree, metadata: dict | None, path: str) -> Restored:
    metadata = metadata or {}
    skipped = tuple((int(a), int(b)) for a, b in metadata.get("skipped") or ())
    return Restored(tree, step, own_position(metadata, path), path,
                    metadata.get("consumed"), skipped)


def _agreed(backend: CheckpointBackend, steps: Collection[int], logdir: Path | str,
            state: CheckpointState | None, like: PyTree, path_of: Callable[[int], str],
            recovery_wait_secs: float) -> Restored | None:
    """Many processes: all restore the step the chief chose, or all start fresh.

    The chief (process 0) picks the candidate by the single-process rules and
    broadcasts it; a process whose view of a shared directory lags polls every
    `recovery_wait_secs` until the checkpoint appears (up to a bound); then
    every process restores it, and they agree whether all succeeded. If one
    failed, the chief's next candidate is tried, together.
    """
    order = recovery_order(state, sorted(steps)) if jax.process_index() == 0 else []
    tried: set[int] = set()
    failures: list[tuple[int, BaseException]] = []
    while True:
        mine = next((s for s in order if s not in tried and s in steps), -1)
        step = int(broadcast_from_chief(np.asarray(mine, np.int32)))
        if step < 0:
            break
        tried.add(step)
        def visible(step: int = step) -> None:
            nonlocal steps
            steps = _wait_until_visible(backend, steps, step, path_of, recovery_wait_secs)

        found = read_together(backend, step, like, path_of(step), failures.append,
                              before=visible)
        if found is not None:  # (agreed: read on every process)
            return found
        log.warning("loopkit: checkpoint %s could not be restored on every process; "
                    "trying the chief's next candidate", path_of(step))
    if tried:
        raise CheckpointError(
            f"checkpoints exist in {logdir} but none could be restored on every "
            f"process (tried steps {sorted(tried)})"
        ) from (failures[0][1] if failures else None)
    return None


def _wait_until_visible(backend: CheckpointBackend, steps: Collection[int], step: int,
                        path_of: Callable[[int], str],
                        recovery_wait_secs: float) -> Collection[int]:
    """Poll every `recovery_wait_secs` until `step` is committed in this process's view;
    the committed steps then seen."""
    poll = max(0.05, float(recovery_wait_secs))
    bound = max(60.0, 10 * poll)
    deadline = time.monotonic() + bound
    while step not in steps:
        steps = set(backend.steps())
        if step in steps:
            break
        if time.monotonic() > deadline:
            raise FileNotFoundError(
                f"checkpoint {path_of(step)} chosen by the chief did not appear here "
                f"within {bound:.0f} s")
        log.info("loopkit: waiting for %s to appear (recovery_wait_secs=%s)",
                 path_of(step), recovery_wait_secs)
        time.sleep(poll)
    return steps
