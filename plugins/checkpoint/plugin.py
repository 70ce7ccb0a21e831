"""Built-in `checkpoint`: timer-driven saves, recovery at start-up, retention.

Saves run on the shared timer (`save_model_secs` / `save_model_steps`) and once
more at a normal stop. A save is started from the main thread (the backend may
write asynchronously); a commit thread (`tier.Commit`) then waits for it to be
durable and only then, on the chief, rewrites ``logdir/checkpoint`` and applies
retention (`retention.CheckpointList`; the first publish also records the backend's name
beside the file, `tf_file.write_backend_name`). At most one save is in flight: the
next save, and the stop, first wait for the previous commit. An error while
committing stops the run and is re-raised from `train`. Recovery at start-up is
`recovery.find_restorable`, in the order `tf_file.recovery_order` gives. How long
each save held the loop is written beside the metrics as
``loopkit/checkpoint_blocking_secs``.

With `Config.local_checkpoint_dir`, a second `tier.Tier` on its own timer
(``checkpoint_local``): a second instance of the backend, its own `checkpoint` file
and retention (`max_to_keep_local`). A local save due at a durable save's step starts
from that save's staging. Recovery restores the local tier's newest readable
checkpoint when it is at least as new as the durable tier's (`recovery.find_local`);
`RESTORED_TIER` says which tier served. With many processes (the orbax backend) each
process keeps its own local tier in ``<local_checkpoint_dir>/process-<i>``: the shards
it holds and its host-local leaves, written without waiting for the others; recovery
restores the newest step every process holds there (`collectives.common_steps`; with
`local_replicas`, each part held by its owner or a peer: `peers`), else the durable tier.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import jax

from loopkit import storage
from loopkit.plugin.backend import CheckpointBackend, Restored
from loopkit.config import Config
from loopkit.plugin.hookspec import hookimpl
from loopkit.state.pytree import abstract, check_storable, conform
from loopkit.plugins.checkpoint.backends import BUILTIN_BACKENDS, builtin_backend
from loopkit.plugins.checkpoint.position import checkpoint_metadata
from loopkit.storage.retry import retry_secs
from loopkit.plugins.checkpoint import rollback_point
from loopkit.plugins.checkpoint.recovery import (
    durable_best, find_local, find_restorable,
)
from loopkit.plugins.checkpoint.replicas import SAVE_VETO, agree_to_save, host_copies
from loopkit.plugins.checkpoint.peers import open_peers
from loopkit.plugins.checkpoint.retention import CheckpointList
from loopkit.plugins.checkpoint.tier import SharedHold, Tier, refuse_a_file
from loopkit.plugins.checkpoint.cadence import Cadence, agreed_fate
from loopkit.plugins.shared import MACHINE, RESTORED_TIER, SAVE_TIMES, SaveTimes

__all__ = ["BUILTIN_BACKENDS", "INACTIVE", "CheckpointPlugin", "plugin"]

log = logging.getLogger("loopkit")

INACTIVE = "needs Config.logdir and Config.checkpoint_backend (one of them is None)"

PyTree = Any

BLOCKING_TAG = "loopkit/checkpoint_blocking_secs"
LOCAL_BLOCKING_TAG = "loopkit/checkpoint_local_blocking_secs"



class CheckpointPlugin:
    """Saves the state on a timer and at a normal stop; restores it at start-up."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.durable: Tier | None = None
        #: the local tier (`Config.local_checkpoint_dir`), or None
        self.local: Tier | None = None
        #: how long the latest save held the loop, in seconds (durable; local tier's)
        self.blocking_secs: float | None = None
        self.local_blocking_secs: float | None = None
        #: the tier the session restored from: "durable", "local", or None
        self.restored_from: str | None = None
        self._restored: tuple[int, list[int]] | None = None  # (step, leaf ids) just restored
        self._local_timer: Any = None  # the local tier's timer (its handle)
        self._timer: Any = None  # the durable tier's
        self._cadence: Any = None  # the timers' intervals (`Cadence`: "auto")
        self._times = SaveTimes()  # the session's (in the stash: the ledger reads it)

    @property
    def backend(self) -> CheckpointBackend | None:
        """The durable tier's backend (None before the session opened it)."""
        return None if self.durable is None else self.durable.backend

    # -- the backend -------------------------------------------------------------------

    @hookimpl(tryfirst=True)  # first: a resume needs orbax before anything else does
    def import_ahead(self) -> list[str]:  # the backend imports it at its first read or save
        return ["orbax.checkpoint"] if self.config.checkpoint_backend == "orbax" else []

    @hookimpl(trylast=True)
    def checkpoint_backend_names(self) -> list[str]:
        return list(BUILTIN_BACKENDS)

    @hookimpl(trylast=True)
    def checkpoint_backend(self, name: str, directory: Path | str, config: Config) -> Any:
        return builtin_backend(name, directory, config)

    def _tier(self, session: Any, kind: str, directory: Path | str,
              process_local: bool = False) -> Tier:
        """Build one tier's backend (a second instance for the local tier) and ledger.

        `process_local`: this process's own orbax checkpoints (a job of many processes)."""
        spec, config = self.config.checkpoint_backend, self.config
        storage.makedirs(directory)
        if kind == "local":
            if not isinstance(spec, str):
                raise ValueError(
                    "Config.local_checkpoint_dir needs Config.checkpoint_backend as a name "
                    f"(a second backend is built for the local tier); got the instance {spec!r}")
            config = config.replace(max_to_keep=config.max_to_keep_local,
                                    keep_checkpoint_every_n_hours=None)
        if process_local:
            from loopkit.plugins.checkpoint.backends.orbax import OrbaxBackend

            backend = OrbaxBackend(directory, config.checkpoint_basename, self.config,
                                   process_local=True)
        elif isinstance(spec, str):
            backend = session.hook.checkpoint_backend(name=spec, directory=directory,
                                                      config=self.config)
            if backend is None:
                raise ValueError(
                    f"Config.checkpoint_backend={spec!r} names no known backend; built-in: "
                    f"{', '.join(repr(n) for n in BUILTIN_BACKENDS)} (a plugin adds others "
                    "through the 'checkpoint_backend' hook), or pass a backend instance"
                )
        else:
            backend = spec
        name = spec if isinstance(spec, str) else None  # recorded for the helpers
        local = config.local_checkpoint_dir if kind == "durable" else None
        if local is not None:  # recorded absolute: the helpers may run in another cwd
            local = str(storage.normalise(local, "Config.local_checkpoint_dir"))
        kept = CheckpointList(directory, config, name, local)
        return Tier(kind, backend, kept,
                    owns_backend=isinstance(spec, str), chief_writes=kind == "durable")

    def _open(self, session: Any) -> Tier:
        """Build the session's tiers (restore_state runs first, so usually there)."""
        if self.durable is None:
            retry_secs()  # a bad LOOPKIT_STORE_RETRY_SECS fails now, not as a corrupt read
            self.durable = self._tier(session, "durable", session.logdir)
            local = self.config.local_checkpoint_dir
            if local is None:
                return self.durable
            local = storage.normalise(local, "Config.local_checkpoint_dir")
            refuse_a_file(local)
            if jax.process_count() == 1:
                self.local = self._tier(session, "local", local)
            elif self.config.checkpoint_backend == "orbax":
                # each process its own tier, in its own directory (one path in every
                # process's Config, also when several share a machine)
                self.local = self._tier(session, "local", storage.join(
                    local, f"process-{jax.process_index()}"), process_local=True)
            else:
                log.warning(
                    "loopkit: Config.local_checkpoint_dir=%r is not used with %d processes "
                    "and Config.checkpoint_backend=%r: a process's own shards are kept by "
                    "the 'orbax' backend only; checkpoints go to the durable tier only",
                    self.config.local_checkpoint_dir, jax.process_count(),
                    self.config.checkpoint_backend)
            if self.local is not None:  # Config.local_replicas
                self.local.peers = open_peers(self.config, self.local.ledger.logdir)
        return self.durable

    # -- recovery ----------------------------------------------------------------------

    @hookimpl(trylast=True)
    def can_restore(self, session: Any) -> bool | None:
        """False when neither tier holds a committed checkpoint (a fresh start). Many
        processes: None, since the chief's choice is agreed in `restore_state` and
        this process's view of a shared directory may lag the chief's."""
        if jax.process_count() > 1:
            return None
        durable = self._open(session)
        return any(t.ledger.on_disk for t in (durable, self.local) if t is not None)

    @hookimpl(trylast=True)
    def restore_state(self, session: Any, like: PyTree) -> Restored | None:
        durable = self._open(session)
        # `like` as init gives it: a leaf without a sharding comes back uncommitted on
        # the default device, as a fresh one is, so the step compiles to the same
        # program (and a restart finds it in the persistent compilation cache)
        found, tier = None, self.local
        held = set() if tier is None else set(tier.ledger.on_disk)  # its machine lived?
        if tier is not None:
            _phase(session, durable_best(tier.ledger.on_disk, tier.file), "the local tier")
            found = find_local(tier.backend, frozenset(tier.ledger.on_disk), tier.file, like,
                               tier.path, durable_best(durable.ledger.on_disk, durable.file),
                               tier.peers)
        if found is None:
            tier = durable
            _phase(session, durable_best(durable.ledger.on_disk, durable.file), None)
            found = find_restorable(durable.backend, frozenset(durable.ledger.on_disk),
                                    durable.ledger.logdir, durable.file, like, durable.path,
                                    self.config.recovery_wait_secs, durable.ledger.backend_name)
        step = None if found is None else found.step
        if found is not None:  # committed (a lagging view of a shared directory saw it late)
            tier.ledger.on_disk.add(found.step)
        durable.ledger.adopt(step, durable.file)
        if self.local is not None:
            self.local.ledger.adopt(step, self.local.file)
            for t in (self.local, durable):  # each lists only the steps it holds
                t.ledger.listed = [(s, x) for s, x in t.ledger.listed if s in t.ledger.on_disk]
        self.restored_from = None if found is None else (
            "peer" if tier.peers is not None and tier.peers.from_peer else tier.kind)
        session.stash[RESTORED_TIER] = self.restored_from
        if self.local is not None:  # the ledger tells a process death from a lost machine
            session.stash[MACHINE] = agreed_fate(self.restored_from, step, held)
        if found is None:
            return None
        self._restored = (found.step, sorted(map(id, jax.tree.leaves(found.state))))
        log.info("loopkit: restored %s", found.path)
        return found

    @hookimpl(trylast=True)
    def rollback_state(self, session: Any, before_step: int) -> Restored | None:
        """Wait for the saves in flight, then read back the newest committed checkpoint
        of a step before `before_step`, from either tier (`rollback`). Newer committed
        checkpoints hold abandoned steps: they are deleted, so no restart resumes them."""
        durable = self._open(session)
        tiers = [t for t in (self.local, durable) if t is not None]
        for t in tiers:
            t.join(session, self.config.stop_grace_secs)
        rollback_point.refuse_if_stuck(tiers)
        options = rollback_point.candidates(self.local, durable, before_step)
        rollback_point.drop_after(session, tiers, before_step,
                            f"it holds the bad step {before_step} or a later one")
        like = abstract(session.state)
        found = rollback_point.read_agreed(options, like)
        if found is None:
            return None
        rollback_point.drop_after(session, tiers, found.step + 1,  # an unreadable newer candidate
                            f"it holds steps after {found.step}, whose batches are skipped")
        found.state = conform(found.state, like)
        return found

    # -- saving ------------------------------------------------------------------------

    @hookimpl(tryfirst=True)  # built-in services start before other plugins'
    def session_create(self, session: Any) -> None:
        # refused now, naming the leaf, rather than at the first save
        check_storable(session.state)
        self._open(session)
        session.stash.setdefault(RESTORED_TIER, self.restored_from)
        self._times = session.stash.setdefault(SAVE_TIMES, SaveTimes())
        self._cadence = cadence = Cadence(session, self.config, self.local is not None)
        secs, steps = cadence.durable_secs, self.config.save_model_steps or None
        if secs or steps:
            self._timer = session.every(self._save, secs=secs, steps=steps, name="checkpoint")
        secs, steps = cadence.local_secs, self.config.save_local_steps or None
        if self.local is not None and (secs or steps):
            self._local_timer = session.every(self._save_local, secs=secs, steps=steps,
                                              name="checkpoint_local")

    def _save(self, session: Any, final: bool = False) -> None:
        """Start saving the current state (the timer action, and the `final` save).

        When the local tier's timer is due at this step as well, its save starts
        here too, from the same staging of the state (one device-to-host copy).
        """
        t0 = time.perf_counter()
        try:
            self._start_save(session, t0, final)
        finally:
            self._times.held_secs += time.perf_counter() - t0
        if self._cadence is not None:  # "auto": the intervals from the measurements
            self._cadence.retime(session, self._timer, self._local_timer)

    def _start_save(self, session: Any, t0: float, final: bool) -> None:
        step, many = session.step, jax.process_count() > 1
        tier = self._open(session)
        tier.join(session, self.config.stop_grace_secs)
        refused = tier.unusable()
        if not many and refused is not None:
            raise refused
        # The backend may read in the background: the state staged so that the
        # next steps donate none of what it reads, kept until the save commits.
        hold = SharedHold(session.stage_state())
        state = hold.state
        timer = self._local_timer
        local = (not final and timer is not None and not timer.cancelled
                 and timer.due(step, session.clock()))
        if many:
            # every process saves at this step: agree that all may, on the replicas, and
            # whether the local tier saves too (each process's clock may say otherwise);
            # a bad value on any process (the rollback guard's veto) replaces the save
            veto = session.stash.get(SAVE_VETO)
            state, names, prints = host_copies(state)
            local, vetoed = agree_to_save(tier.path(step), names, prints, refused, local,
                                          veto, session)
            if vetoed and veto is not None:
                hold.release()
                veto.vetoed(session, final)
                return
        if local:
            hold.acquire()  # before the durable commit may release it
        metadata = checkpoint_metadata(session, step)
        tier.start(session, step, state, hold, metadata, (self._times, t0))
        self.blocking_secs = time.perf_counter() - t0
        if session.summary_writer is not None:
            session.summary_writer.add_scalar(BLOCKING_TAG, self.blocking_secs, step)
        if local:
            timer.arm(step, session.clock())  # saved: its timer starts over from here
            self._save_local(session, (hold, metadata))

    def _save_local(self, session: Any, staged: tuple[SharedHold, dict] | None = None) -> None:
        """Start saving the current state to the local tier (its timer action), or
        the staging the durable save at this step made (`staged`)."""
        t0 = time.perf_counter()
        tier, step, from_durable = self.local, session.step, staged is not None
        assert tier is not None
        # the timer fires on every process at this step: what follows may differ by process
        metadata = checkpoint_metadata(session, step) if staged is None else None
        refused = None
        if tier.last_save_step != step:  # else the durable save at this step saved it too
            tier.join(session, self.config.stop_grace_secs)
            refused = tier.unusable()
        if tier.last_save_step == step or refused is not None:
            if staged is not None:
                staged[0].release()
            # many processes: the failure already asked for an agreed stop (`Tier._failed`);
            # raising here, on this process alone, would leave the others in a collective
            if refused is not None and jax.process_count() == 1:
                raise refused
            return
        if staged is None:
            staged = SharedHold(session.stage_state()), metadata
        hold, metadata = staged
        tier.start(session, step, hold.state, hold, metadata)
        self.local_blocking_secs = time.perf_counter() - t0
        if session.summary_writer is not None:
            session.summary_writer.add_scalar(LOCAL_BLOCKING_TAG, self.local_blocking_secs, step)
        # "auto": after the local timer's own save (a save beside the durable one is
        # retimed with it)
        if self._cadence is not None and self._cadence.local_auto and not from_durable:
            self._cadence.retime(session, self._timer, self._local_timer)

    # -- stopping ----------------------------------------------------------------------

    def _owes_final_save(self, session: Any, error: BaseException | None) -> bool:
        """A normal stop saves the final step to the durable tier, unless it is saved
        there already (or is the durable state just restored, untouched), or a save
        failed or never committed (many processes agree on a failed commit in `_save`)."""
        tier = self.durable
        assert tier is not None
        if error is not None or session.state is None or tier.last_save_step == session.step:
            return False
        if tier.commit is not None:  # a save never committed: left behind
            return False
        if tier.failed is not None and jax.process_count() == 1:
            return False
        restored = self._restored
        return not (restored is not None and restored[0] == session.step
                    and session.step in tier.ledger.on_disk
                    # the same leaf objects: neither a step nor local_init_fn replaced them
                    and sorted(map(id, jax.tree.leaves(session.state))) == restored[1])

    @hookimpl
    def on_stop(self, session: Any, error: BaseException | None) -> None:
        tier = self.durable
        if tier is None:
            return
        tiers = [t for t in (self.local, tier) if t is not None]
        t0, held = time.perf_counter(), self._times.held_secs
        try:
            for t in tiers:
                t.join(session, self.config.stop_grace_secs)
            if self._owes_final_save(session, error):
                self._save(session, final=True)
                tier.join(session, self.config.stop_grace_secs)
        finally:
            self._times.held_secs = held + time.perf_counter() - t0  # the final save's too
            for t in tiers:
                t.close(self.config.stop_grace_secs)
        for t in tiers:
            failed = t.failed
            if (failed is not None and failed is not error
                    and failed is not session.coord.exception):
                raise failed


def _phase(session: Any, step: int | None, tier: str | None) -> None:
    """Name the step being restored for a hang report ("restoring step 40")."""
    if step is not None:
        session.phase = f"restoring step {step}" + (f" from {tier}" if tier else "")


def plugin(config: Config) -> CheckpointPlugin | None:
    if config.logdir is None or config.checkpoint_backend is None:
        return None
    return CheckpointPlugin(config)
