"""`Config.on_guard="rollback"`: the `nan_guard` built-in goes back instead of failing.

On a bad value (see `plugins/nan_guard.py`) at step b, detected at step d > b,
`RollbackGuard` asks the `rollback_state` hook (the `checkpoint` built-in: it
waits for the save in flight) for the newest committed checkpoint of a step
c < b, or goes back to the session's initial state (`HostCopy`). The input is
not rewound: the batches the steps c+1..d consumed, the bad one among them, are
skipped, and training goes on from the next batch. The session's `input`
records it: ``offset`` (batches consumed minus the step) grows by d - c and the
range ``(first, end)`` joins ``input.skipped``, which every later checkpoint
saves with the input position; a restart hands a callable `data(start)` the
batches consumed, and a stateful iterator its saved state, so a resumed run
computes what this one computes. Rollbacks are counted by ``input.skipped``,
across restarts, up to `Config.max_rollbacks`.

With several processes a process that sees a bad value votes at the next
agreement (a time trigger of a timer named "rollback", the way a process asks
for a checkpoint); every process then rolls back at that step to the checkpoint
before the earliest bad step any of them saw. A durable save that comes first
carries the verdict in its own gather (`SAVE_VETO`, the value of its step checked
then): no bad state is saved, nor compared as a replica, and the rollback replaces
the save on every process. The last step, and a stop before the vote, are agreed too.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Mapping

import jax
import numpy as np

from loopkit.plugin.backend import RollbackRecord
from loopkit.config import Config
from loopkit.loop.coordinator import add_note
from loopkit.errors import NonFiniteError, SpikeError
from loopkit.plugin.hookspec import hookimpl
from loopkit.plugins.checkpoint.backends.records import weakly_typed
from loopkit.plugins.checkpoint.replicas import SAVE_VETO
from loopkit.plugins.nan_guard import NanGuardPlugin
from loopkit.state.pytree import is_key

if TYPE_CHECKING:
    from loopkit.loop.session import Session

__all__ = ["HostCopy", "ROLLBACKS_TAG", "RollbackGuard"]

log = logging.getLogger("loopkit")

#: the TensorBoard scalar: rollbacks so far (across restarts), at the bad step
ROLLBACKS_TAG = "loopkit/rollbacks"
_NONE = np.iinfo(np.int32).max  # "no bad step here", in the agreement's vector


class HostCopy:
    """A state copied to host memory, put back on its devices on demand.

    The session's initial state, to go back to when no checkpoint comes before
    the bad step: device memory holds no second copy of it. Each array leaf
    keeps its placement (sharding, committed or not), its weak type, and a typed
    PRNG key its implementation (the key's data is what is copied); a leaf
    spread over several processes keeps only this process's shards.
    """

    def __init__(self, step: int, state: Any) -> None:
        self.step = step
        leaves, self.treedef = jax.tree.flatten(state)
        self.leaves = [self._save(x) for x in leaves]

    @staticmethod
    def _save(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return ("value", np.array(x, copy=True) if isinstance(x, np.ndarray) else x)
        impl = jax.random.key_impl(x) if is_key(x.dtype) else None
        kind = (impl, bool(getattr(x, "weak_type", False)))  # what the host copy loses
        data = jax.random.key_data(x) if impl is not None else x
        if data.is_fully_addressable:  # copied: a view of a buffer a step donates would change
            return ("array", kind, np.array(data, copy=True),
                    data.sharding if x.committed else None)
        shards = [(s.device, np.array(s.data, copy=True)) for s in data.addressable_shards]
        return ("shards", kind, data.shape, data.sharding, shards)

    @staticmethod
    def _load(saved: Any) -> Any:
        if saved[0] == "value":
            return saved[1]
        if saved[0] == "array":
            _, (impl, weak), host, sharding = saved
            x = jax.device_put(host, sharding) if sharding is not None else jax.numpy.asarray(host)
        else:
            _, (impl, weak), shape, sharding, shards = saved
            x = jax.make_array_from_single_device_arrays(
                shape, sharding, [jax.device_put(data, device) for device, data in shards])
        if impl is not None:
            return jax.random.wrap_key_data(x, impl=impl)
        return weakly_typed(x) if weak and not x.weak_type else x

    def state(self) -> Any:
        return jax.tree.unflatten(self.treedef, [self._load(s) for s in self.leaves])


def refuse_input(inp: Any) -> None:
    """Rollback skips batches: it needs an input that can say where it stands."""
    can = ("a callable data(start), called with the number of batches consumed, or an "
           "iterator with get_state()/set_state() (grain's DataLoader or DatasetIterator)")
    if inp is None:
        raise ValueError(
            "Config.on_guard='rollback' skips the batches after a bad value, and this "
            f"session reads none: pass data= to train or managed_session, as {can}")
    if inp.kind == "iterable":
        raise ValueError(
            "Config.on_guard='rollback' cannot be used with a plain iterable as data (a list, "
            "a generator): a run resumed after a rollback could not find the batches it "
            f"skipped. Pass {can}; or on_guard='raise'")


class RollbackGuard(NanGuardPlugin):
    """`nan_guard` with `on_guard="rollback"`: restore, skip the batches since, go on."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.max_rollbacks = config.max_rollbacks
        self.max_steps = config.max_steps
        self.initial: HostCopy | None = None
        self.first_bad: NonFiniteError | None = None  # many processes: waiting for a vote
        self.vote: Any = None

    @hookimpl
    def session_create(self, session: Session) -> None:
        refuse_input(session.input)
        if session.restored is None:  # the initial state, for a bad step before any save
            self.initial = HostCopy(session.step, session.state)
        if jax.process_count() > 1:
            self.vote = session.every(self._agreed, secs=math.inf, name="rollback")
            session.stash[SAVE_VETO] = self  # a durable save carries the verdict

    @hookimpl
    def after_step(self, session: Session, step: int, metrics: Mapping[str, Any]) -> None:
        super().after_step(session, step, metrics)
        if step == self.max_steps and session.step == step and self._pending is not None:
            # the stop follows: this step has no next step to trail it, and a bad
            # value found at the stop could no longer be rolled back. Many processes:
            # every one is here at this step (max_steps is the same everywhere)
            if self.vote is None:
                bad = self._check(*self._pending)
                if bad is not None:
                    self._bad(session, bad)
            else:
                self.vetoes(session)  # this step's value, checked now
                self._agreed(session)

    @hookimpl
    def on_stop(self, session: Session, error: BaseException | None) -> None:
        if self.vote is not None and error is None:
            # a stop agreed before the vote: every process raises the earliest bad value
            # (none alone, which would leave the others in the final save's collective)
            self.vetoes(session)
            agreed = self._agreed_error()
            if agreed is not None:
                raise agreed
            return
        unresolved, self.first_bad = self.first_bad, None  # the stop came before the vote
        super().on_stop(session, error)
        if error is None and unresolved is not None:
            raise unresolved

    def vetoes(self, session: Session) -> bool:
        """Many processes, before a durable save's agreement: whether this process has
        a bad value not yet agreed. The value not yet checked (the current step's) is
        checked now: a save waits for the step anyway, and must not save a bad state."""
        pending = self._pending
        if self.first_bad is None and pending is not None:
            self._pending = None
            self.first_bad = self._check(*pending)
        return self.first_bad is not None

    def vetoed(self, session: Session, final: bool) -> None:
        """Some process vetoed the save at this step: every process is here. Roll back,
        or at the final save, where no step follows, raise the earliest bad value."""
        if not final:
            self._agreed(session)
            return
        agreed = self._agreed_error()
        if agreed is not None:
            raise agreed

    def _bad(self, session: Session, error: NonFiniteError) -> None:
        if self.vote is None:
            self._roll_back(session, error)
        elif self.first_bad is None:  # vote at the next agreement; keep the first
            self.first_bad = error
            self.vote.next_time = -math.inf

    def _agreed(self, session: Session) -> None:
        """Every process, at one step: roll back before the earliest bad step seen."""
        error = self._agreed_error()
        if error is not None:
            self._roll_back(session, error)

    def _agreed_error(self) -> NonFiniteError | None:
        """The earliest bad value any process holds (a collective: every process calls it
        at the same step), or None; this process's own is forgotten."""
        from jax.experimental import multihost_utils

        mine, self.first_bad = self.first_bad, None
        row = ([mine.step, mine.value, isinstance(mine, SpikeError),
                getattr(mine, "median", 0.0)] if mine is not None else [_NONE, 0.0, 0, 0.0])
        rows = np.asarray(multihost_utils.process_allgather(np.asarray(row, np.float64)))
        rows = rows.reshape(-1, 4)
        first = rows[int(np.argmin(rows[:, 0]))]
        if first[0] >= _NONE:
            return None
        step, value = int(first[0]), float(first[1])
        if mine is not None and mine.step == step:
            return mine
        if first[2]:
            return SpikeError(self.metric, step, value, float(first[3]), self.threshold)
        return NonFiniteError(self.metric, step, value)

    def _roll_back(self, session: Session, error: NonFiniteError) -> None:
        inp = session.input
        done = len(inp.skipped)
        if done >= self.max_rollbacks:
            add_note(error, f"loopkit rolled back {done} times already "
                            f"(Config.max_rollbacks={self.max_rollbacks}): raised")
            raise error
        restored = session.hook.rollback_state(session=session, before_step=error.step)
        if restored is not None:
            state, to, where = restored.state, restored.step, restored.path
        elif self.initial is not None and self.initial.step < error.step:
            state, to, where = self.initial.state(), self.initial.step, "the initial state"
        else:
            add_note(error, f"loopkit found nothing to roll back to: no checkpoint before "
                            f"step {error.step}, and the session did not start fresh")
            raise error
        consumed = session.step + inp.offset
        first = max(to + inp.offset, inp.skipped[-1][1] if inp.skipped else 0)
        # the step first, then the offset: prefetch reads step + offset from its thread,
        # and must never see more batches consumed than there are
        session.rewind(to, state)
        inp.offset = consumed - to
        inp.skipped.append((first, consumed))
        self._pending = None
        if self.window is not None:
            self.window.clear()  # as a restart from this checkpoint would have it
        record = RollbackRecord(error.step, to, (first, consumed), self.metric, error.value)
        log.warning(
            "loopkit: %s; rolled back to step %d (%s), skipping batches [%d, %d) (%d); "
            "rollback %d of Config.max_rollbacks=%d", error, to, where, first, consumed,
            consumed - first, done + 1, self.max_rollbacks)
        session.hook.on_rollback(session=session, record=record)
        if session.summary_writer is not None:  # after the summaries' purge, which hides it
            session.summary_writer.add_scalar(ROLLBACKS_TAG, done + 1, error.step)
