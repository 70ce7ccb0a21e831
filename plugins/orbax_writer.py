"""How the `orbax` backend's saves reach orbax: numpy arrays written in one batch.

orbax's `NumpyHandler` stores each numpy array as a zarr array in the checkpoint's
OCDBT database. Per array it builds a tensorstore spec (a JSON dict that tensorstore
parses again), opens the array in an asyncio task of its own and awaits its write:
about 0.5 ms of Python per array on a 2-core machine, 2.4 s of a 2.9 s commit at
4,096 leaves of 128 MiB (benchmarks/README.md, "By leaf count"). The handler here
writes the very same arrays -- orbax's own write spec, keys, zarr metadata and
chunks, so orbax restores them as its own -- but builds one spec per distinct shape
and dtype, opens the database once, and has every array opened and written at once.

Its writes finish while orbax builds the tree metadata: the handler reports the
arrays handed over once every write is under way, and the checkpoint handler's
`finalize`, which orbax calls before it merges the per-process databases and renames
the temporary directory, first waits for them (and raises their first error). A save
that fails before then waits for them too (`Saver.abandon`). Only the public orbax
API is used (the handler classes, `type_handlers.get_json_tspec_write`,
`multihost.process_index`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from typing import Any, Sequence

import jax
import numpy as np

__all__ = ["Saver"]


class Saver:
    """orbax's `PyTreeCheckpointHandler` and type handlers for the backend's save thread.

    ``handler`` is the checkpoint handler to give a `Checkpointer`, ``args(tree)`` the
    save arguments for it; ``abandon`` waits for writes left in flight by a save
    that failed.
    """

    def __init__(self, **options: Any) -> None:
        import orbax.checkpoint as ocp

        self._writes = _Writes()
        th = ocp.type_handlers
        # The save thread owns the arrays it hands to orbax (numpy leaves were copied
        # by the backend's `save`; the rest are views of immutable jax arrays), so
        # orbax's defensive copy is off: it would only double a save's memory.
        registry = th.create_type_handler_registry(
            *[(t, th.get_type_handler(t)) for t in (int, float, bytes, np.number, jax.Array, str)],
            (np.ndarray, _numpy_handler_class()(self._writes)))
        handler_class, self._args = _pytree_handler_class()
        self.handler = handler_class(self._writes, type_handler_registry=registry, **options)

    def args(self, tree: Any) -> Any:
        """The save arguments to give the `Checkpointer` of ``handler`` for ``tree``."""
        return self._args(tree)

    def abandon(self) -> None:
        """Wait for the writes of a failed save; their errors are dropped (the save failed)."""
        try:
            self._writes.join()
        except Exception:  # noqa: BLE001 - the save's own error is the one raised
            pass


class _Writes:
    """The array writes of the save in flight (one at a time, as the backend saves)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: list[Any] = []

    def start(self, jobs: list[tuple[tuple[Any, dict, Any], str, np.ndarray]]) -> None:
        """Open every array (all at once) and start its write; return once all are started."""
        import tensorstore as ts

        stores: dict[tuple[str, int], Any] = {}
        opening = []
        for (spec, kvstore, context), name, _ in jobs:
            key = (json.dumps(kvstore, sort_keys=True), id(context))
            store = stores.get(key)
            if store is None:
                store = stores[key] = ts.KvStore.open(kvstore, context=context).result()
            opening.append(ts.open(spec, kvstore=store / f"{name}/", create=True, open=True,
                                   context=context))
        futures: list[Any] = []
        try:
            for future, (_, _, value) in zip(opening, jobs):
                futures.append(future.result().write(
                    value, can_reference_source_data_indefinitely=True))
        except BaseException:
            futures.extend(opening[len(futures):])  # waited for with the writes
            raise
        finally:
            with self._lock:
                self._futures.extend(futures)

    def join(self) -> None:
        """Wait for every write started; raise the first error once all have ended."""
        with self._lock:
            futures, self._futures = self._futures, []
        error = None
        for future in futures:
            try:
                future.result()
            except Exception as e:  # noqa: BLE001 - the first is raised after the rest end
                error = error or e
        if error is not None:
            raise error


@functools.cache
def _numpy_handler_class() -> type:
    import orbax.checkpoint as ocp

    class BatchedNumpyHandler(ocp.type_handlers.NumpyHandler):
        """orbax's `NumpyHandler`, writing a batch of arrays in one go (see the module)."""

        def __init__(self, writes: _Writes) -> None:
            super().__init__(deepcopy_host_arrays=False)
            self._writes = writes

        async def _background_serialize(self, values: Sequence[np.ndarray],
                                        infos: Sequence[Any],
                                        args: Sequence[Any] | None = None) -> None:
            if ocp.multihost.process_index() != 0:
                return  # as orbax's: numpy arrays are the same on every process
            args = args or [ocp.SaveArgs()] * len(values)
            # orbax gives one handler's arrays one parent directory (ParamInfo's contract)
            await infos[0].await_path_creation()
            parent = infos[0].parent_dir
            groups: dict[tuple, tuple[Any, dict, Any] | None] = {}
            jobs = []
            for value, info, arg in zip(values, infos, args):
                key = (value.shape, value.dtype.str, repr(arg), info.use_compression,
                       info.use_zarr3, info.is_ocdbt_checkpoint,
                       info.ocdbt_target_data_file_size, id(info.ts_context))
                if key not in groups:
                    groups[key] = _group_spec(info.replace(parent_dir=parent), value, arg)
                group = groups[key]
                if group is None:  # a spec not seen here: orbax writes the batch itself
                    return await super()._background_serialize(values, infos, args)
                jobs.append((group, info.name, value))
            await asyncio.to_thread(self._writes.start, jobs)

    return BatchedNumpyHandler


def _group_spec(info: Any, value: np.ndarray, arg: Any) -> tuple[Any, dict, Any] | None:
    """orbax's write spec for ``info`` without the array's path, and the kvstore it names."""
    import orbax.checkpoint as ocp
    import tensorstore as ts

    spec = ocp.type_handlers.get_json_tspec_write(
        info, use_ocdbt=info.is_ocdbt_checkpoint, global_shape=value.shape,
        local_shape=value.shape, dtype=value.dtype,
        process_index=ocp.multihost.process_index() if info.is_ocdbt_checkpoint else None,
        arg=arg)
    kvstore = spec.pop("kvstore", None)
    path = kvstore.get("path") if isinstance(kvstore, dict) else None
    if not (isinstance(path, str) and path.rstrip("/").endswith(info.name)):
        return None
    base = path.rstrip("/")[:-len(info.name)]
    return ts.Spec(spec), {**kvstore, "path": base}, info.ts_context


@functools.cache
def _pytree_handler_class() -> tuple[type, type]:
    """The checkpoint handler class, and its save arguments' class (orbax pairs them)."""
    import orbax.checkpoint as ocp

    class PyTreeHandler(ocp.PyTreeCheckpointHandler):
        """orbax's, but `finalize` first waits for the arrays' writes (see the module)."""

        def __init__(self, writes: _Writes, **options: Any) -> None:
            super().__init__(**options)
            self._writes = writes

        def finalize(self, directory: Any) -> None:
            self._writes.join()
            super().finalize(directory)

    @ocp.args.register_with_handler(PyTreeHandler, for_save=True)
    class PyTreeSave(ocp.args.PyTreeSave):
        pass

    @ocp.args.register_with_handler(PyTreeHandler, for_restore=True)
    class PyTreeRestore(ocp.args.PyTreeRestore):
        pass

    return PyTreeHandler, PyTreeSave
