"""Saving jax arrays spread over processes in one batch: what orbax's `ArrayHandler` writes.

A leaf that no process holds whole (sharded, or replicated, over processes) goes to
orbax as a jax array, and orbax's `ArrayHandler` writes it one array at a time:
a spec built and parsed, an open and a write each in a task of their own, its
sharding written to the ``_sharding`` file through a tensorstore open of its own;
about 2 ms an array on a 2-core machine, most of a 4,096-leaf save from several
processes (benchmarks/README.md). The handler here writes the very same arrays
-- `ArrayHandler`'s type string, its write spec for each array (the global shape,
the shard's shape as zarr's shard, the process's own OCDBT database), its keys
and chunks, its ``_sharding`` entries -- through the batch of the numpy arrays
(`batch.Writes`): one spec per distinct shape, one database opened once, every
array opened and every shard written at once.

Which shards a process writes is `ArrayHandler`'s rule: those of replica 0 of
each region it holds; with replica-parallel writes (orbax's default off GPUs) a
region held by several replicas is cut along its first axis their number
divides, and each replica writes its cut. The process orbax names primary
creates each array's zarr metadata; the others open it as written
(``assume_metadata``), as orbax's do. Orbax's per-process array metadata files
are not written: they hold the shards' shape (zarr's metadata has it) and a
typed key's implementation, and loopkit stores typed keys as their key data,
with the implementation in its own head (a typed key given here is stored as its
key data, as orbax's handler stores it). Public contract only: `ArrayHandler`'s
constructor and its public `serialize`, overridden.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import threading
from typing import Any, Sequence

import jax
import numpy as np

from loopkit.plugins.checkpoint.backends.orbax.batch import Writes, start_batch

__all__ = ["array_handler_class", "shard_writes"]

_SHARDING_FILE = "_sharding"  # orbax's name of the shardings' file in a checkpoint
_REPLICAS: dict[Any, int] = {}  # (sharding, shape) -> replicas: few of them, many leaves
_SHARDINGS: dict[Any, str | None] = {}  # sharding -> orbax's serialized sharding
_FILE_LOCK = threading.Lock()


def _replicas(sharding: Any, shape: tuple[int, ...]) -> int:
    """How many devices hold each region of an array of ``shape`` placed by ``sharding``."""
    key = (sharding, shape)
    try:
        return _REPLICAS[key]
    except KeyError:
        pass
    indices = sharding.devices_indices_map(shape).values()
    regions = {tuple((s.indices(n) if isinstance(s, slice) else s)
                     for s, n in zip(index, shape)) for index in indices}
    count = len(indices) // max(1, len(regions))
    if len(_REPLICAS) < 4096:
        _REPLICAS[key] = count
    return count


def shard_writes(value: jax.Array, replica_id: int | None, parallel: bool
                 ) -> tuple[tuple[int, ...], list[tuple[Any, Any]]]:
    """(the shape each writer's part has, [(global index, shard data)] this process writes).

    `ArrayHandler`'s choice (see the module): the shard data are jax arrays, their
    host copies made by the caller, in one batch.
    """
    shards = value.addressable_shards
    first = shards[0]
    shape = tuple(first.data.shape)
    if parallel and replica_id is not None and first.data.size:
        count = _replicas(value.sharding, tuple(value.shape))
        axis = next((a for a, n in enumerate(shape) if n % count == 0), None) \
            if count > 1 else None
        kind = getattr(value.sharding, "memory_kind", None)
        # orbax's own exception: small pinned-host arrays are not cut
        safe = kind != "pinned_host" or (value.ndim >= 2 and first.data.size % 1024 == 0
                                         and shape[-1] % 128 == 0)
        if axis is not None and safe:
            size = shape[axis] // count
            local = shape[:axis] + (size,) + shape[axis + 1:]
            out = []
            for shard in shards:
                if shard.replica_id >= count:
                    continue
                cut = shard.replica_id * size
                start = shard.index[axis].start or 0
                index = (shard.index[:axis] + (slice(start + cut, start + cut + size),)
                         + shard.index[axis + 1:])
                out.append((index, (shard.data, axis, cut, cut + size)))
            return local, out
    target = first.replica_id if replica_id is None else replica_id
    return shape, [(s.index, (s.data, None, 0, 0)) for s in shards if s.replica_id == target]


def _serialized_sharding(sharding: Any) -> str | None:
    """orbax's serialized form of ``sharding`` for its ``_sharding`` file (None: none)."""
    import orbax.checkpoint as ocp

    try:
        return _SHARDINGS[sharding]
    except KeyError:
        pass
    meta = None
    if isinstance(sharding, jax.sharding.NamedSharding):
        meta = ocp.metadata.NamedShardingMetadata.from_jax_sharding(sharding)
    elif isinstance(sharding, jax.sharding.SingleDeviceSharding):
        meta = ocp.metadata.SingleDeviceShardingMetadata.from_jax_sharding(sharding)
    out = meta.to_serialized_string() if meta is not None else None
    if len(_SHARDINGS) < 1024:
        _SHARDINGS[sharding] = out
    return out


def _write_shardings(parent: Any, entries: dict[str, str]) -> None:
    """Add ``entries`` (array name -> serialized sharding) to ``parent``'s ``_sharding``
    file, keyed as orbax keys them (each name in URL-safe base64)."""
    if not entries:
        return
    path = parent / _SHARDING_FILE
    with _FILE_LOCK:  # one save at a time, but orbax may hand its arrays over in parts
        old = json.loads(path.read_text()) if path.exists() else {}
        old.update({base64.urlsafe_b64encode(k.encode()).decode(): v
                    for k, v in entries.items()})
        path.write_text(json.dumps(old))


@functools.cache
def array_handler_class() -> type:
    import orbax.checkpoint as ocp

    class BatchedArrayHandler(ocp.type_handlers.ArrayHandler):
        """orbax's `ArrayHandler`, whose `serialize` writes its arrays in one batch.

        Everything else (type string, metadata, reading) is orbax's own.
        """

        def __init__(self, writes: Writes, primary_host: int | None = 0,
                     replica_id: int | None = 0, use_replica_parallel: bool | None = None
                     ) -> None:
            super().__init__(primary_host=primary_host, replica_id=replica_id,
                             use_replica_parallel=use_replica_parallel,
                             array_metadata_store=None)
            if use_replica_parallel is None:  # as orbax's default: on, except on GPUs
                use_replica_parallel = jax.default_backend() != "gpu"
            self.writes = writes
            self.primary = primary_host
            self.replica = replica_id
            self.parallel = bool(use_replica_parallel)

        async def serialize(self, values: Sequence[jax.Array], infos: Sequence[Any],
                            args: Sequence[Any] | None = None) -> Sequence[Any]:
            from loopkit.state.pytree import is_key

            generation = self.writes.generation()  # before anything can fail
            args = args or [ocp.SaveArgs()] * len(values)
            ocp.type_handlers.check_input_arguments(values, infos, args)
            # a typed key is stored as its key data, as orbax's handler stores it
            values = [jax.random.key_data(v) if is_key(v.dtype) else v for v in values]
            return [ocp.future.CommitFutureAwaitingContractedSignals(
                _write_arrays(self.writes, generation, values, infos, args,
                              self.primary, self.replica, self.parallel),
                name="loopkit_array_batch")]

    return BatchedArrayHandler


async def _write_arrays(writes: Writes, generation: int, values: Sequence[jax.Array],
                        infos: Sequence[Any], args: Sequence[Any], primary: int | None,
                        replica: int | None, parallel: bool) -> None:
    """Write a handler's batch (`shard_writes`: which shards), and its shardings' file on
    the primary; return once all are written."""
    import orbax.checkpoint as ocp

    create = primary is None or ocp.multihost.process_index() == primary
    await infos[0].await_path_creation()
    parent = infos[0].parent_dir  # one directory for a handler's arrays (ParamInfo)
    planned = [shard_writes(v, replica, parallel) for v in values]
    # every host copy in one call (on CPU, views; elsewhere transfers begun together)
    hosts = iter(jax.device_get([d for _, parts in planned for _, (d, *_) in parts]))
    items, shardings = [], {}
    for value, info, arg, (local, parts) in zip(values, infos, args, planned):
        regions = []
        for index, (_, axis, lo, hi) in parts:
            host = np.asarray(next(hosts))
            if axis is not None:  # a replica's cut of its region
                host = host[(slice(None),) * axis + (slice(lo, hi),)]
            regions.append((index, host))
        if create and (s := _serialized_sharding(value.sharding)) is not None:
            shardings[info.name] = s
        if regions or create:
            items.append((info, arg, tuple(value.shape), local, value.dtype, regions, create))
    if create:
        await asyncio.to_thread(_write_shardings, parent, shardings)
    started = await start_batch(writes, generation, items, parent)
    # Done before this returns, on every process: orbax's `finalize` (where the numpy
    # batch is waited for) runs on the primary alone, and the others' writes must be
    # in their databases before orbax's barrier that precedes the merge.
    await asyncio.to_thread(writes.finish, started)
