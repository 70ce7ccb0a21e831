"""Built-in `replica_check` (`Config.replica_check_steps=N`): silent data corruption, named.

Every N steps (a step timer) the leaves of the state that are replicated -- the same
value on several devices of a process, a host-local leaf that each of several
processes holds, a global array replicated over a mesh axis -- are fingerprinted on
each device: each device reduces its own copy's raw bits (as 32-bit words, mixed
with their positions, summed) in a `shard_map` whose inputs keep their shardings, so
no copy is moved and each is read where it lives; one compiled program per mesh
(one in practice) covers the whole state. The fingerprints (a few bytes a copy) are
compared across the copies: with several processes in one small gather. A copy
that differs from the others is logged at ERROR naming the leaf, the step, and the
process and device that hold it; the ledger records a `Fault` (cause ``"sdc"``);
then `Config.on_guard` decides: ``"raise"`` raises `loopkit.ReplicaMismatchError`
on every process; ``"rollback"`` and ``"replay"`` go back, skipping no batch (the
data was not at fault), to the newest checkpoint of a step at or before the last
check that passed (one saved after it may hold the corrupt copy), and train the
batches since again. Each such rollback counts against `Config.max_rollbacks`.

Its timer runs before the checkpoint plugin's at a shared step: a corrupt state is
caught before it is saved.
"""

from __future__ import annotations

import collections
import logging
import math
import time
import zlib
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from loopkit.config import Config
from loopkit.errors import ReplicaMismatchError
from loopkit.loop.coordinator import add_note
from loopkit.plugin.backend import RollbackRecord
from loopkit.plugin.hookspec import hookimpl
from loopkit.plugins.rewind import Rereader, hosts, initial_copy, restore_before
from loopkit.state.pytree import is_key, leaf_path

if TYPE_CHECKING:
    from loopkit.loop.session import Session

__all__ = ["INACTIVE", "ReplicaCheck", "fingerprint", "plugin"]

log = logging.getLogger("loopkit")

INACTIVE = "Config.replica_check_steps is None"
_GOLDEN, _MIX = np.uint32(0x9E3779B9), np.uint32(0x85EBCA6B)


def _words(x: jax.Array) -> jax.Array:
    """`x`'s raw bits as a flat vector of uint32 (narrower types widened, wider split)."""
    if is_key(x.dtype):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag])
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = x.dtype.itemsize
    narrow = {1: jnp.uint8, 2: jnp.uint16}.get(size)
    if narrow is not None:
        return jax.lax.bitcast_convert_type(x, narrow).astype(jnp.uint32).reshape(-1)
    return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)  # 4 bytes, or 8 as 2 words


def fingerprint(x: jax.Array) -> jax.Array:
    """A uint32 of `x`'s bits: each word, xor its position times the golden ratio, through
    a bijective mix, summed. A changed word always changes its term (the mix is a
    bijection), so one corrupt word, or bit, is always seen; changes to several
    cancel with a chance of 2^-32. One pass over the memory, a few integer ops a word."""
    w = _words(x)
    h = w ^ (jnp.arange(w.shape[0], dtype=jnp.uint32) * _GOLDEN)
    h = (h ^ (h >> 16)) * _MIX
    return jnp.sum(h ^ (h >> 13), dtype=jnp.uint32)


def _index_key(index: tuple) -> int:
    """A stable number for a shard's index (its slices): the same on every process."""
    return zlib.crc32(repr(tuple((s.start, s.stop, s.step) for s in index)).encode())


class _Group:
    """The replicated leaves on one mesh, and their fingerprints' compiled program."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh, self.leaves, self.specs = mesh, [], []
        self.program: Any = None

    def compile(self) -> None:
        from jax import shard_map

        axes = tuple(self.mesh.axis_names)

        def each(*copies: jax.Array) -> jax.Array:  # on each device, its own copies
            return jnp.stack([fingerprint(c) for c in copies])[None]

        # check_vma off: the outputs differ per device, which is the point
        self.program = jax.jit(shard_map(each, mesh=self.mesh, in_specs=tuple(self.specs),
                                         out_specs=PartitionSpec(axes), check_vma=False))

    def run(self, leaves: list) -> dict[int, np.ndarray]:
        """Device id -> the fingerprints of its copies, for this process's devices."""
        out = self.program(*(leaves[i] for i in self.leaves))
        shards = out.addressable_shards
        rows = jax.device_get([s.data for s in shards])
        return {s.device.id: np.asarray(r).reshape(-1) for s, r in zip(shards, rows)}


class _Layout:
    """Which leaves are replicated, on which meshes; what each process sends, and how the
    copies group: an entry is (process, leaf, device id, index key), and the entries of
    one leaf with one index key are copies of one value."""

    def __init__(self, flat: list, many: bool) -> None:
        me = jax.process_index()
        self.names = [leaf_path(path) for path, _ in flat]
        groups: dict[Any, _Group] = {}
        keys: dict[int, dict[int, int]] = {}  # leaf -> device id -> index key
        for i, (_, x) in enumerate(flat):
            if not isinstance(x, jax.Array):
                continue  # host values: the checkpoint's save compares them across processes
            sharding = x.sharding
            if isinstance(sharding, NamedSharding):
                mesh, spec = sharding.mesh, sharding.spec
            elif isinstance(sharding, SingleDeviceSharding):
                mesh, spec = Mesh(np.array(list(sharding.device_set)), ("copy",)), PartitionSpec()
            else:
                continue  # a sharding without a mesh (positional, GSPMD): not looked at
            index = {d.id: _index_key(ix) for d, ix in sharding.devices_indices_map(x.shape).items()}
            if len(set(index.values())) == len(index) and not (many and x.is_fully_addressable):
                continue  # every device holds a different part: no copies
            group = groups.setdefault(mesh, _Group(mesh))
            group.leaves.append(i)
            group.specs.append(spec)
            keys[i] = index
        self.groups = list(groups.values())
        for g in self.groups:
            g.compile()
        self.local = [(me, i, d.id, keys[i][d.id])  # the order of this process's vector
                      for g in self.groups for d in sorted(
                          (d for d in g.mesh.devices.flat if d.process_index == me),
                          key=lambda d: d.id)
                      for i in g.leaves]
        self.entries = self.local
        self.width = len(self.local)
        if many:
            self._gather_entries()

    def _gather_entries(self) -> None:
        """Every process's entries (once per layout: the layout is the same at each check)."""
        from jax.experimental import multihost_utils

        counts = np.asarray(multihost_utils.process_allgather(
            np.asarray(len(self.local), np.int64))).reshape(-1)
        self.width = int(counts.max())
        mine = np.full((self.width, 4), -1, np.int64)
        if self.local:
            mine[:len(self.local)] = np.asarray(self.local, np.int64)
        table = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, self.width, 4)
        self.entries = [tuple(int(v) for v in row) for p, n in enumerate(counts)
                        for row in table[p, :n]]

    def fingerprints(self, leaves: list) -> np.ndarray:
        """This process's vector: one fingerprint per local entry, padded to the width."""
        out = np.zeros(self.width, np.uint32)
        rows = {}
        for g in self.groups:
            for device, row in g.run(leaves).items():
                rows.update({(i, device): v for i, v in zip(g.leaves, row)})
        for k, (_, i, device, _) in enumerate(self.local):
            out[k] = rows[(i, device)]
        return out

    def mismatches(self, table: np.ndarray) -> list[tuple[str, list, int]]:
        """(leaf, the differing entries, copies) for each group of copies that disagree:
        those whose fingerprint differs from the most common one (on a tie, from the
        copy on the first process's first device)."""
        copies: dict[tuple[int, int], list] = collections.defaultdict(list)
        counts: dict[int, int] = collections.defaultdict(int)
        for entry in self.entries:
            counts[entry[0]] += 1
        flat = iter(range(len(self.entries)))
        for p in sorted(counts):
            for k in range(counts[p]):
                entry = self.entries[next(flat)]
                copies[(entry[1], entry[3])].append((entry, int(table[p, k])))
        found = []
        for (leaf, _), held in sorted(copies.items()):
            values = collections.Counter(v for _, v in held)
            if len(held) < 2 or len(values) == 1:
                continue
            best = max(values.values())
            common = next(v for _, v in sorted(held) if values[v] == best)
            found.append((self.names[leaf], [e for e, v in held if v != common], len(held)))
        return found


class ReplicaCheck:
    """Compares the copies of the state's replicated leaves every N steps."""

    def __init__(self, config: Config) -> None:
        self.steps: int = config.replica_check_steps  # type: ignore[assignment]
        self.on_guard = config.on_guard
        self.max_rollbacks = config.max_rollbacks
        self.layout: _Layout | None = None
        self.signature: Any = None
        self.passed = 0  # the last step whose check passed (or the session's start)
        self.rereader: Rereader | None = None
        self.many = False

    @hookimpl(tryfirst=True)  # before the checkpoint's timer: a corrupt state is not saved
    def session_create(self, session: Session) -> None:
        self.passed = session.step
        self.many = jax.process_count() > 1
        if self.on_guard != "raise":
            self.rereader = Rereader(session, self.on_guard)
            initial_copy(session)
        hosts(session)
        session.every(self._check, steps=self.steps, name="replica_check")

    @hookimpl
    def on_rollback(self, session: Session, record: Any) -> None:
        self.passed = min(self.passed, record.restored_step)  # any plugin's rollback

    def _check(self, session: Session) -> None:
        flat = jax.tree_util.tree_flatten_with_path(session.state)[0]
        signature = tuple((getattr(x, "sharding", None), getattr(x, "shape", None),
                           getattr(x, "dtype", None)) for _, x in flat)
        if signature != self.signature:  # the same on every process: shapes, shardings
            self.layout, self.signature = _Layout(flat, self.many), signature
            if not self.layout.entries:
                log.info("loopkit: Config.replica_check_steps: the state has no replicated "
                         "leaf; nothing to compare")
        layout = self.layout
        assert layout is not None
        if not layout.entries:
            return
        mine = layout.fingerprints([x for _, x in flat])
        if self.many:
            from jax.experimental import multihost_utils

            table = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, layout.width)
        else:
            table = mine[None]
        found = layout.mismatches(table)
        if not found:
            self.passed = session.step
            return
        self._mismatch(session, found)

    def _mismatch(self, session: Session, found: list) -> None:
        names = hosts(session)
        leaf, odd, copies = found[0]
        (process, _, device, _), *more = odd
        where = ", ".join(f"device {d} of process {p} ({names[p]})" for p, _, d, _ in odd)
        message = (f"silent data corruption at step {session.step}: the copy of leaf {leaf!r} "
                   f"on {where} differs from the other {copies - len(odd)} of its {copies} "
                   f"copies" + (f"; {len(found) - 1} more leaves differ too"
                                if len(found) > 1 else "")
                   + f" (the last check that passed: step {self.passed})")
        log.error("loopkit: %s", message)
        from loopkit.plugins.goodput.ledger import LEDGER
        from loopkit.plugins.goodput.records import Fault

        ledger = session.stash.get(LEDGER)
        if ledger is not None:
            ledger.write(Fault(time=time.time(), step=session.step, cause="sdc",
                               process=process, host=names[process], device=device,
                               detail=f"leaf {leaf}"))
        error = ReplicaMismatchError(message, leaf, session.step, process, device)
        if self.rereader is None:
            raise error
        self._go_back(session, error)

    def _go_back(self, session: Session, error: ReplicaMismatchError) -> None:
        """Back to a checkpoint at or before the last check that passed; the batches
        since are trained again (none skipped: the data was not at fault)."""
        from loopkit.plugins.rollback import ROLLBACKS_TAG

        inp = session.input
        done = len(inp.skipped)
        if done >= self.max_rollbacks:
            add_note(error, f"loopkit rolled back {done} times already "
                            f"(Config.max_rollbacks={self.max_rollbacks}): raised")
            raise error
        state, to, where, restored = restore_before(session, self.passed + 1, error)
        end, first = inp.consumed(session.step), to + inp.offset
        session.rewind(to, state, again=True)
        assert self.rereader is not None
        self.rereader.train_again(session, first, end, restored)
        inp.skipped.append((first, first))  # skips nothing, counts as a rollback
        log.warning("loopkit: rolled back to step %d (%s) after the replica mismatch, to train "
                    "batches [%d, %d) again; rollback %d of Config.max_rollbacks=%d", to,
                    where, first, end, done + 1, self.max_rollbacks)
        record = RollbackRecord(error.step, to, (first, first), f"replica {error.leaf}", math.nan)
        session.hook.on_rollback(session=session, record=record)
        if session.summary_writer is not None:
            session.summary_writer.add_scalar(ROLLBACKS_TAG, done + 1, error.step)


def plugin(config: Config) -> ReplicaCheck | None:
    return None if config.replica_check_steps is None else ReplicaCheck(config)
