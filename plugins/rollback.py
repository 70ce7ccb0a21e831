"""`Config.on_guard="rollback"`: the `nan_guard` built-in goes back instead of failing.

On a bad value (see `plugins/nan_guard/`) at step b, detected at step d > b,
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
import time
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple

import jax
import numpy as np

from loopkit.plugin.backend import RollbackRecord
from loopkit.config import Config
from loopkit.loop.coordinator import add_note
from loopkit.errors import NonFiniteError, SpikeError
from loopkit.plugin.hookspec import hookimpl
from loopkit.plugins.checkpoint.replicas import SAVE_VETO
from loopkit.plugins.nan_guard.guard import NanGuardPlugin
from loopkit.plugins.rewind import (
    HostCopy, Rereader, hosts, initial_copy, refuse_input, restore_before,
)

if TYPE_CHECKING:
    from loopkit.loop.session import Session

__all__ = ["HostCopy", "ROLLBACKS_TAG", "RollbackGuard", "Trial", "refuse_input"]

log = logging.getLogger("loopkit")

#: the TensorBoard scalar: rollbacks so far (across restarts), at the bad step
ROLLBACKS_TAG = "loopkit/rollbacks"
_NONE = np.iinfo(np.int32).max  # "no bad step here", in the agreement's vector


class Trial(NamedTuple):
    """A replay under way: the bad value of `step` is being trained again."""

    step: int
    value: float
    index: int  #: its (empty) range's place in ``input.skipped``: the rollback it counts as
    mine: bool  #: this process saw the bad value (with several, the one that is named)
    process: int  #: the process that saw it


class RollbackGuard(NanGuardPlugin):
    """`nan_guard` with `on_guard="rollback"`: restore, skip the batches since, go on;
    with `on_guard="replay"`, train them again first (`Trial`), and skip them only if
    the bad value comes back."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.on_guard = config.on_guard
        self.max_rollbacks = config.max_rollbacks
        self.max_steps = config.max_steps
        self.initial: HostCopy | None = None
        self.first_bad: NonFiniteError | None = None  # many processes: waiting for a vote
        self.first_process = 0  # many processes: the process whose bad value was agreed
        self.vote: Any = None
        self.rereader: Rereader | None = None
        self.trial: Trial | None = None
        self.session: Any = None

    @hookimpl
    def session_create(self, session: Session) -> None:
        refuse_input(session.input, self.on_guard)
        self.initial = initial_copy(session)  # for a bad step before any save
        self.session = session
        if self.on_guard == "replay":
            self.rereader = Rereader(session, self.on_guard)
        if jax.process_count() > 1:
            hosts(session)  # gathered now, while every process is here
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
    def on_data_end(self, session: Session) -> None:
        """The last step's value is checked now, while going back is still possible
        (every process is here, at one step, with several)."""
        if self.vote is None:
            pending, self._pending = self._pending, None
            bad = None if pending is None else self._check(*pending)
            if bad is not None:
                self._bad(session, bad)
        else:
            self.vetoes(session)
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
        self.first_process = int(np.argmin(rows[:, 0]))
        first = rows[self.first_process]
        if first[0] >= _NONE:
            return None
        step, value = int(first[0]), float(first[1])
        if mine is not None and mine.step == step:
            return mine
        if first[2]:
            return SpikeError(self.metric, step, value, float(first[3]), self.threshold)
        return NonFiniteError(self.metric, step, value)

    def _check(self, step: int, value: Any) -> NonFiniteError | None:
        bad = super()._check(step, value)
        trial = self.trial
        if bad is None and trial is not None and step == trial.step and trial.mine:
            self._compute_fault(trial)  # trained again, the value is good: the machine
        return bad

    def _compute_fault(self, trial: Trial) -> None:
        from loopkit.plugins.goodput.ledger import LEDGER
        from loopkit.plugins.goodput.records import Fault

        session = self.session
        self.trial = trial._replace(mine=False)  # named once; a vote may still follow
        host = hosts(session)[trial.process]
        log.error("loopkit: compute fault on process %d (host %s): %r=%s at step %d did not "
                  "come back when the same batches were trained again; the re-run's state "
                  "stands, nothing skipped. Drain this machine if it happens again",
                  trial.process, host, self.metric, trial.value, trial.step)
        ledger = session.stash.get(LEDGER)
        if ledger is not None:
            ledger.write(Fault(time=time.time(), step=trial.step, cause="compute",
                               process=trial.process, host=host,
                               detail=f"{self.metric}={trial.value!r}"))

    def _roll_back(self, session: Session, error: NonFiniteError) -> None:
        inp, trial = session.input, self.trial
        if trial is not None and error.step == trial.step and trial.index == len(inp.skipped) - 1:
            # the bad value came back at the same step, on the same batch: the data. The
            # replay counted as this rollback already: its range becomes the skipped one
            self.trial = None
            inp.skipped.pop()
            log.warning("loopkit: %s again when trained again: the batch is at fault, "
                        "skipping it", error)
            self._skip_back(session, error)
        elif self.on_guard == "replay":
            self._replay(session, error)
        else:
            self._skip_back(session, error)

    def _budget(self, session: Session, error: NonFiniteError) -> int:
        done = len(session.input.skipped)
        if done >= self.max_rollbacks:
            add_note(error, f"loopkit rolled back {done} times already "
                            f"(Config.max_rollbacks={self.max_rollbacks}): raised")
            raise error
        return done

    def _skip_back(self, session: Session, error: NonFiniteError) -> None:
        inp = session.input
        done = self._budget(session, error)
        state, to, where, _ = restore_before(session, error.step, error)
        consumed = inp.consumed(session.step)
        first = max(to + inp.offset, inp.skipped[-1][1] if inp.skipped else 0)
        # the step first, then the offset: prefetch reads step + offset from its thread,
        # and must never see more batches consumed than there are
        session.rewind(to, state)
        inp.offset = consumed - to
        inp.skipped.append((first, consumed))
        if inp.replay is not None:
            # a replay under way ends here: its batches are skipped
            inp.replay.side, inp.replay.left = None, 0
        self._pending = None
        if self.window is not None:
            self.window.clear()  # as a restart from this checkpoint would have it
        record = RollbackRecord(error.step, to, (first, consumed), self.metric, error.value)
        log.warning(
            "loopkit: %s; rolled back to step %d (%s), skipping batches [%d, %d) (%d); "
            "rollback %d of Config.max_rollbacks=%d", error, to, where, first, consumed,
            consumed - first, done + 1, self.max_rollbacks)
        self._announce(session, record, done + 1)

    def _replay(self, session: Session, error: NonFiniteError) -> None:
        """Go back without skipping: the steps since are trained again on the same
        batches, and the value of `error.step` tells the data from the machine."""
        inp = session.input
        done = self._budget(session, error)
        state, to, where, restored = restore_before(session, error.step, error)
        end = inp.consumed(session.step)
        first = to + inp.offset
        session.rewind(to, state, again=True)
        assert self.rereader is not None
        self.rereader.train_again(session, first, end, restored)
        inp.skipped.append((first, first))  # skips nothing, counts as a rollback
        me = jax.process_index()
        process = me if self.vote is None else self.first_process
        self.trial = Trial(error.step, error.value, len(inp.skipped) - 1, process == me, process)
        self._pending = None  # the spike window is kept: the steps trained again refill it
        record = RollbackRecord(error.step, to, (first, first), self.metric, error.value)
        log.warning(
            "loopkit: %s; rolled back to step %d (%s) to train batches [%d, %d) again: the "
            "same bad value at step %d means the data, none the machine; rollback %d of "
            "Config.max_rollbacks=%d", error, to, where, first, end, error.step, done + 1,
            self.max_rollbacks)
        self._announce(session, record, done + 1)

    def _announce(self, session: Session, record: RollbackRecord, count: int) -> None:
        session.hook.on_rollback(session=session, record=record)
        if session.summary_writer is not None:  # after the summaries' purge, which hides it
            session.summary_writer.add_scalar(ROLLBACKS_TAG, count, record.step)
