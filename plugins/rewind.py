"""Going back: the state a rollback restores, and the batches it trains again.

Shared by the rollback guard (`plugins/rollback.py`, `Config.on_guard="rollback"` and
`"replay"`) and the replica check (`plugins/replica_check.py`). `restore_before`
asks the `rollback_state` hook (the checkpoint plugin) for the newest committed
checkpoint of a step before a given one, else takes the session's initial state
(`HostCopy`, kept on the host from a fresh start). A rollback that skips no batch
(a replay, a replica mismatch: the data was not at fault) then hands the input's
`Replay` front the batches the undone steps consumed, read again from the source
(`Rereader`): a callable `data(start)` is opened again at the first of them; a
stateful iterator's spare copy, made before the loop read anything, is set to the
checkpoint's position and advanced. The loop's own input is not touched: once the
batches trained again are taken, it goes on where it stood.
"""

from __future__ import annotations

import copy
import logging
import socket
from typing import TYPE_CHECKING, Any, Iterator, Optional

import jax
import numpy as np

from loopkit.loop.coordinator import add_note
from loopkit.loop.data import global_batch, snapshot_state
from loopkit.loop.stash import StashKey
from loopkit.plugins.checkpoint.backends.records import weakly_typed
from loopkit.state.pytree import is_key

if TYPE_CHECKING:
    from loopkit.loop.data import Input

__all__ = ["HOSTS", "INITIAL", "HostCopy", "Replay", "Rereader", "hosts", "initial_copy",
           "refuse_input", "restore_before"]

log = logging.getLogger("loopkit")


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


#: the session's initial state on the host (a fresh start), shared by the plugins that go back
INITIAL = StashKey[Optional[HostCopy]]()
#: every process's host name, by process index (gathered once, at session_create)
HOSTS = StashKey[list]()


def initial_copy(session: Any) -> HostCopy | None:
    """The session's initial state on the host, one copy per session; None after a restore
    (a checkpoint at or before the start step exists then)."""
    if session.restored is not None:
        return None
    saved = session.stash.get(INITIAL)
    if saved is None:
        saved = session.stash[INITIAL] = HostCopy(session.step, session.state)
    return saved


def hosts(session: Any) -> list[str]:
    """Every process's host name, by process index. A collective the first time (every
    process calls it from session_create), then kept in the stash."""
    known = session.stash.get(HOSTS)
    if known is not None:
        return known
    mine = socket.gethostname()
    if jax.process_count() == 1:
        known = [mine]
    else:
        from jax.experimental import multihost_utils

        raw = np.zeros(64, np.uint8)
        name = mine.encode()[:64]
        raw[:len(name)] = np.frombuffer(name, np.uint8)
        table = np.asarray(multihost_utils.process_allgather(raw)).reshape(-1, 64)
        known = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in table]
    session.stash[HOSTS] = known
    return known


def refuse_input(inp: Input | None, on_guard: str, what: str = "skips the batches after a "
                 "bad value") -> None:
    """Going back needs an input that can say where it stands, and read it again."""
    can = ("a callable data(start), called with the number of batches consumed, or an "
           "iterator with get_state()/set_state() (grain's DataLoader or DatasetIterator)")
    if inp is None:
        raise ValueError(
            f"Config.on_guard={on_guard!r} {what}, and this session reads none: pass data= "
            f"to train or managed_session, as {can}")
    if inp.kind == "iterable":
        raise ValueError(
            f"Config.on_guard={on_guard!r} cannot be used with a plain iterable as data (a "
            "list, a generator): a run that goes back could not find its batches again. "
            f"Pass {can}; or on_guard='raise'")


def restore_before(session: Any, before_step: int, error: BaseException) -> tuple[Any, int, str, Any]:
    """(state, step, where, `Restored` or None): the newest committed checkpoint of a step
    before `before_step`, else the initial state; raises `error`, noted, when neither."""
    restored = session.hook.rollback_state(session=session, before_step=before_step)
    if restored is not None:
        return restored.state, restored.step, restored.path, restored
    initial = session.stash.get(INITIAL)
    if initial is not None and initial.step < before_step:
        return initial.state(), initial.step, "the initial state", None
    add_note(error, f"loopkit found nothing to roll back to: no checkpoint before step "
                    f"{before_step}, and the session did not start fresh")
    raise error


class Replay:
    """The loop's batches (`main`) with batches to train again in front (`side`).

    A rollback that skips no batch (`Config.on_guard="replay"`, a replica mismatch)
    sets `side` to the batches the undone steps consumed, read again from the source;
    once they are taken the loop reads `main` again, where it stood. `positions`
    holds the input position after each batch trained again, by step, for a save
    among them (a stateful source).
    """

    def __init__(self) -> None:
        self.main: Iterator[Any] = iter(())
        self.side: Iterator[Any] | None = None
        self.positions: dict[int, Any] = {}
        self.end = 0  #: batches `main` has consumed while `side` is read
        self.left = 0  #: batches of `side` not taken yet (the read-ahead counts them)

    def __iter__(self) -> Replay:
        return self

    def __next__(self) -> Any:
        side = self.side
        if side is not None:
            try:
                batch = next(side)
                self.left -= 1
                return batch
            except StopIteration:
                self.side, self.positions, self.left = None, {}, 0
        return next(self.main)


class Rereader:
    """Reads again the batches that rolled-back steps consumed (`Input.replay`'s side).

    Made at session_create, before the loop (or a prefetch thread) reads the
    source: a stateful source is copied then, and the copy is what is read again.
    """

    def __init__(self, session: Any, on_guard: str) -> None:
        inp = session.input
        refuse_input(inp, on_guard, "trains batches again after going back")
        if inp.replay is None:  # one front for every plugin that goes back
            inp.replay = Replay()
        self.replay: Replay = inp.replay
        self.transform = session.config.data_transform
        self.sharding = session.config.data_sharding
        self.spare: Any = None
        if inp.kind == "stateful":
            try:
                self.spare = copy.deepcopy(inp.source)
                self.start = snapshot_state(inp.source)
            except Exception as ex:  # noqa: BLE001 - named, with what to do
                raise ValueError(
                    f"Config.on_guard={on_guard!r} reads batches again from a copy of the "
                    f"data iterator, and {type(inp.source).__name__} cannot be copied "
                    f"(copy.deepcopy: {type(ex).__name__}: {ex}). Pass a callable "
                    "data(start) instead") from ex

    def train_again(self, session: Any, first: int, end: int, restored: Any) -> None:
        """The loop's next batches are batches [first, end) again, for the steps from
        `session.step` + 1 (a rollback just went there; `restored`: its checkpoint, or
        None for the initial state)."""
        inp = session.input
        self.replay.side = self._batches(inp, first, end, session.step, restored)
        self.replay.positions, self.replay.end, self.replay.left = {}, end, end - first

    def _batches(self, inp: Input, first: int, end: int, step: int,
                 restored: Any) -> Iterator[Any]:
        positions = self.replay.positions
        if self.spare is None:
            assert inp.reopen is not None
            source = iter(inp.reopen(first))
        else:
            source = self.spare
            if restored is None:
                at, state = inp.start_step, self.start
            else:
                at = restored.step if restored.consumed is None else restored.consumed
                state = restored.data_position
            if state is None:
                raise ValueError(f"loopkit cannot read batches {first}..{end - 1} again: "
                                 "the checkpoint holds no input position")
            source.set_state(copy.deepcopy(state))
            for _ in range(first - at):  # batches a rollback at that checkpoint skipped
                next(source)
        for k in range(end - first):
            batch = next(source)
            if self.spare is not None:
                positions[step + k + 1] = snapshot_state(source)
            if self.transform is not None:
                batch = self.transform(batch)
            if self.sharding is not None:
                batch = global_batch(self.sharding, batch)
            yield batch
