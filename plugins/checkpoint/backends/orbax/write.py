"""How the `orbax` backend's saves reach orbax: numpy arrays written in one batch.

orbax's `NumpyHandler` stores each numpy array as a zarr array in the checkpoint's
OCDBT database. Per array it builds a tensorstore spec (a JSON dict that tensorstore
parses again), opens the array in an asyncio task of its own and awaits its write:
about 0.5 ms of Python per array on a 2-core machine, 2.4 s of a 2.9 s commit at
4,096 leaves of 128 MiB (benchmarks/README.md, "By leaf count"). The handler here
writes the very same arrays -- orbax's own write spec, keys, zarr metadata and
chunks, so orbax restores them as its own -- but builds one spec per distinct shape
and dtype, opens the database once, and has every array opened and written at once.

It is a `TypeHandler` on orbax's public contract (`typestr`, `metadata`,
`serialize`, `deserialize`; registered in the save's type-handler registry for
numpy arrays), with no `_`-prefixed orbax member overridden, called or read:
`serialize` returns orbax's `CommitFutureAwaitingContractedSignals` around one
coroutine for the whole batch, as `TypeHandler.serialize` asks. That coroutine
returns once every write is under way, so the writes finish while orbax builds the
tree metadata; the checkpoint handler's `finalize` (public, and called by orbax
before it merges the per-process databases and renames the temporary directory)
first waits for them and raises their first error. A save that fails before then
waits for them too (`Saver.abandon`). The orbax functions used are public:
`type_handlers.get_json_tspec_write` (listed by orbax as deprecated but exported),
`multihost.process_index`, `future.CommitFutureAwaitingContractedSignals`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from typing import Any, Sequence

import jax
import numpy as np

from loopkit.plugins.checkpoint.backends.orbax.layout import split_kvstore

__all__ = ["Saver"]


class Saver:
    """orbax's `PyTreeCheckpointHandler` and type handlers for the backend's save thread.

    ``handler`` is the checkpoint handler to give a `Checkpointer`, ``args(tree)`` the
    save arguments for it; ``abandon`` waits for writes left in flight by a save
    that failed.
    """

    def __init__(self, **options: Any) -> None:
        import orbax.checkpoint as ocp

        from loopkit.plugins.checkpoint.backends.orbax.sharded import array_handler_class

        primary = getattr(options.get("multiprocessing_options"), "primary_host", 0)
        if primary not in (0, None):  # process 0 writes numpy arrays; the primary joins them
            raise ValueError(f"primary_host must be 0 (process 0 writes numpy arrays), "
                             f"not {primary}")
        self._writes = _Writes()
        th = ocp.type_handlers
        handlers = {t: th.get_type_handler(t) for t in (int, float, bytes, np.number, str)}
        # jax arrays (those no process holds whole) in one batch too (`sharded`)
        if primary is None:
            # Process-local checkpoints (every process the primary of its own directory,
            # as orbax's emergency checkpointing writes its local ones): a process writes
            # every shard it holds, not only those of replica 0, and its numpy arrays.
            handlers[jax.Array] = array_handler_class()(
                self._writes, primary_host=None, replica_id=None, use_replica_parallel=False)
        else:
            handlers[jax.Array] = array_handler_class()(self._writes)
        # The save thread owns the arrays it hands to orbax (numpy leaves were copied
        # by the backend's `save`; the rest are views of immutable jax arrays), so
        # orbax's defensive copy is off: it would only double a save's memory.
        registry = th.create_type_handler_registry(
            *handlers.items(),
            (np.ndarray, _numpy_handler_class()(self._writes, every_process=primary is None)))
        handler_class, self.args = _pytree_handler_class()
        self.handler = handler_class(self._writes, type_handler_registry=registry, **options)

    def abandon(self) -> None:
        """Wait for the writes of a failed save; their errors are dropped (the save failed)."""
        self._writes.abandon()


class _Writes:
    """The array writes of the save in flight (one save at a time, as the backend saves).

    A save that failed is abandoned: its generation ends, and a batch of it that had
    not begun its writes yet (another handler's failure can end a save while this
    one's batch is still being prepared) writes nothing.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._futures: list[Any] = []
        self._starting = 0  # `start` calls under way
        self._generation = 0

    def generation(self) -> int:
        with self._cv:
            return self._generation

    def start(self, generation: int, jobs: list[tuple[tuple, str, list, bool]]) -> None:
        """Open every array (all at once) and start its writes; return once all are started.

        Each job is ``((spec, kvstore, kvstore key, context), name, regions, create)``:
        the spec without its path and the checkpoint's kvstore, or (kvstore None) a
        whole spec; ``regions``, ``[(index or None for all, value)]``; ``create``:
        whether this process creates the array's metadata, else it opens it as the
        spec describes it (`sharded`: the primary process writes it).
        """
        import tensorstore as ts

        with self._cv:
            if generation != self._generation:
                return  # its save was abandoned
            self._starting += 1
        futures: list[Any] = []  # every tensorstore operation begun, for `join`
        try:
            stores: dict[tuple[str, int], Any] = {}
            opening = []
            for (spec, kvstore, where, context), name, _, create in jobs:
                how = (dict(create=True, open=True) if create
                       else dict(open=True, assume_metadata=True))
                if kvstore is None:  # orbax's whole spec for this one array
                    opening.append(ts.open(ts.Spec(spec), context=context, **how))
                    continue
                key = (where, id(context))
                if key not in stores:
                    stores[key] = ts.KvStore.open(kvstore, context=context).result()
                opening.append(ts.open(spec, kvstore=stores[key] / f"{name}/",
                                       context=context, **how))
            futures.extend(opening)
            for future, (_, _, regions, _) in zip(opening, jobs):
                array = future.result()
                for index, value in regions:
                    target = array if index is None else array[index]
                    futures.append(target.write(
                        value, can_reference_source_data_indefinitely=True))
        finally:
            with self._cv:
                self._futures.extend(futures)
                self._starting -= 1
                self._cv.notify_all()

    def join(self) -> None:
        """Wait for every write started; raise the first error once all have ended."""
        with self._cv:
            self._cv.wait_for(lambda: not self._starting)
            futures, self._futures = self._futures, []
        error: BaseException | None = None
        for future in futures:
            try:
                future.result()
            except BaseException as e:  # noqa: BLE001 - the first is raised after the rest end
                error = error or e
        if error is not None:
            raise error

    def abandon(self) -> None:
        """End the save's generation, then wait for what it began; its errors are dropped."""
        with self._cv:
            self._generation += 1
        try:
            self.join()
        except Exception:  # noqa: BLE001 - the save's own error is the one raised
            pass


@functools.cache
def _numpy_handler_class() -> type:
    import orbax.checkpoint as ocp

    class BatchedNumpyHandler(ocp.type_handlers.TypeHandler):
        """A `TypeHandler` for numpy arrays writing all of a save's arrays in one batch.

        It stores what orbax's `NumpyHandler` stores (its type string, write specs,
        keys and zarr metadata), so orbax reads the arrays back as its own; reading
        and metadata are orbax's `NumpyHandler`'s. Public contract only: `serialize`
        returns orbax's `CommitFutureAwaitingContractedSignals` around the batch's
        coroutine, as `TypeHandler.serialize` asks of a handler that writes.
        """

        def __init__(self, writes: _Writes, every_process: bool = False) -> None:
            self.numpy = ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)
            self.writes = writes
            self.every_process = every_process  # else process 0 alone writes them

        def typestr(self) -> str:
            return self.numpy.typestr()  # "np.ndarray": orbax's own handler reads them

        async def metadata(self, infos: Sequence[Any]) -> Sequence[Any]:
            return await self.numpy.metadata(infos)

        async def deserialize(self, infos: Sequence[Any],
                              args: Sequence[Any] | None = None) -> Sequence[Any]:
            return await self.numpy.deserialize(infos, args)

        async def serialize(self, values: Sequence[np.ndarray], infos: Sequence[Any],
                            args: Sequence[Any] | None = None) -> Sequence[Any]:
            generation = self.writes.generation()  # before anything can fail
            args = args or [ocp.SaveArgs()] * len(values)
            if len(args) != len(values) or len(infos) != len(values):
                raise ValueError(f"{len(values)} values, {len(infos)} infos and {len(args)} "
                                 f"save args: orbax gives a handler as many of each")
            return [ocp.future.CommitFutureAwaitingContractedSignals(
                _write_batch(self.writes, generation, values, infos, args,
                             self.every_process),
                name="loopkit_np_batch")]

    return BatchedNumpyHandler


async def _write_batch(writes: _Writes, generation: int, values: Sequence[np.ndarray],
                       infos: Sequence[Any], args: Sequence[Any],
                       every_process: bool = False) -> None:
    """Start every write of a handler's batch; return once all are under way."""
    import orbax.checkpoint as ocp

    if not every_process and ocp.multihost.process_index() != 0:
        return  # as orbax's: numpy arrays are the same on every process
    # orbax gives one handler's arrays one parent directory (ParamInfo's contract)
    await infos[0].await_path_creation()
    items = [(info, arg, value.shape, value.shape, value.dtype, [(None, value)], True)
             for value, info, arg in zip(values, infos, args)]
    await start_batch(writes, generation, items, infos[0].parent_dir)


async def start_batch(writes: _Writes, generation: int, items: Sequence[tuple],
                      parent: Any) -> None:
    """Start the writes of ``items``, ``(info, save arg, global shape, shape of the part
    each process writes, dtype, [(index, value)], create)`` each, in the directory
    ``parent`` (see `_Writes.start`); return once all are under way."""
    groups: dict[tuple, tuple[Any, dict, str, Any] | None] = {}
    jobs = []
    for info, arg, shape, local, dtype, regions, create in items:
        # the dtype itself: int4, uint4 and float8_e4m3fn all have the str '<V1'
        key = (shape, local, dtype, repr(arg), info.use_compression,
               info.use_zarr3, info.is_ocdbt_checkpoint,
               info.ocdbt_target_data_file_size, id(info.ts_context))
        if key not in groups:
            groups[key] = _group_spec(info.replace(parent_dir=parent), shape, local, dtype, arg)
        group = groups[key]
        if group is None:  # a spec not seen here: opened whole, as orbax's handler does
            info = info.replace(parent_dir=parent)
            group = (_write_spec(info, shape, local, dtype, arg), None, None, info.ts_context)
        jobs.append((group, info.name, regions, create))
    await asyncio.to_thread(writes.start, generation, jobs)


def _write_spec(info: Any, shape: tuple[int, ...], local: tuple[int, ...], dtype: Any,
                arg: Any) -> dict:
    """orbax's tensorstore write spec for the array of ``info``: ``shape`` globally,
    each process's part ``local`` (zarr's shard shape)."""
    import orbax.checkpoint as ocp

    return ocp.type_handlers.get_json_tspec_write(
        info, use_ocdbt=info.is_ocdbt_checkpoint, global_shape=shape,
        local_shape=local, dtype=dtype,
        process_index=ocp.multihost.process_index() if info.is_ocdbt_checkpoint else None,
        arg=arg)


def _group_spec(info: Any, shape: tuple[int, ...], local: tuple[int, ...], dtype: Any,
                arg: Any) -> tuple[Any, dict, str, Any] | None:
    """orbax's write spec for ``info`` without the array's path, and the kvstore it names."""
    import tensorstore as ts

    split = split_kvstore(_write_spec(info, shape, local, dtype, arg), info.name)
    if split is None:
        return None
    # (the kvstore as JSON too: groups of one database open it once, in `_Writes.start`)
    return ts.Spec(split[0]), split[1], json.dumps(split[1], sort_keys=True), info.ts_context


@functools.cache
def _pytree_handler_class() -> tuple[type, type]:
    """The checkpoint handler class, and its save arguments' class (orbax pairs them)."""
    import orbax.checkpoint as ocp

    class PyTreeHandler(ocp.PyTreeCheckpointHandler):
        """orbax's, but `finalize` first waits for the arrays' writes (see the module)."""

        def __init__(self, writes: _Writes, **options: Any) -> None:
            super().__init__(**options)
            self.writes = writes

        def finalize(self, directory: Any) -> None:
            self.writes.join()
            super().finalize(directory)

    @ocp.args.register_with_handler(PyTreeHandler, for_save=True)
    class PyTreeSave(ocp.args.PyTreeSave):
        pass

    @ocp.args.register_with_handler(PyTreeHandler, for_restore=True)
    class PyTreeRestore(ocp.args.PyTreeRestore):
        pass

    return PyTreeHandler, PyTreeSave
