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

import functools
from typing import Any, Sequence

import jax
import numpy as np

from loopkit.plugins.checkpoint.backends.orbax.batch import Writes, start_batch
from loopkit.plugins.checkpoint.backends.orbax.sharded import array_handler_class

__all__ = ["Saver"]


class Saver:
    """orbax's `PyTreeCheckpointHandler` and type handlers for the backend's save thread.

    ``handler`` is the checkpoint handler to give a `Checkpointer`, ``args(tree)`` the
    save arguments for it; ``abandon`` waits for writes left in flight by a save
    that failed.
    """

    def __init__(self, **options: Any) -> None:
        import orbax.checkpoint as ocp

        primary = getattr(options.get("multiprocessing_options"), "primary_host", 0)
        if primary not in (0, None):  # process 0 writes numpy arrays; the primary joins them
            raise ValueError(f"primary_host must be 0 (process 0 writes numpy arrays), "
                             f"not {primary}")
        self._writes = Writes()
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

        def __init__(self, writes: Writes, every_process: bool = False) -> None:
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


async def _write_batch(writes: Writes, generation: int, values: Sequence[np.ndarray],
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

@functools.cache
def _pytree_handler_class() -> tuple[type, type]:
    """The checkpoint handler class, and its save arguments' class (orbax pairs them)."""
    import orbax.checkpoint as ocp

    class PyTreeHandler(ocp.PyTreeCheckpointHandler):
        """orbax's, but `finalize` first waits for the arrays' writes (see the module)."""

        def __init__(self, writes: Writes, **options: Any) -> None:
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
