"""The array writes of one orbax save, started in one batch: the writer's common part.

Both of the backend's batched type handlers (numpy arrays, `write`; jax arrays spread
over processes, `sharded`) hand their arrays here: orbax's write spec built once
per distinct shape and dtype, the checkpoint's database opened once, every array
opened and written at once; the checkpoint handler's `finalize` waits for them.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, Sequence

from loopkit.plugins.checkpoint.backends.orbax.layout import split_kvstore

__all__ = ["Writes", "start_batch"]


class Writes:
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

    def start(self, generation: int, jobs: list[tuple[tuple, str, list, bool]]) -> list[Any]:
        """Open every array (all at once) and start its writes; return once all are started,
        the tensorstore operations begun (`join` waits for them too).

        Each job is ``((spec, kvstore, kvstore key, context), name, regions, create)``:
        the spec without its path and the checkpoint's kvstore, or (kvstore None) a
        whole spec; ``regions``, ``[(index or None for all, value)]``; ``create``:
        whether this process creates the array's metadata, else it opens it as the
        spec describes it (`sharded`: the primary process writes it).
        """
        import tensorstore as ts

        with self._cv:
            if generation != self._generation:
                return []  # its save was abandoned
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
        return futures

    def finish(self, futures: list[Any]) -> None:
        """Wait for ``futures`` (of `start`), no longer `join`'s to wait for; raise the first
        error once all have ended."""
        try:
            self.wait(futures)
        finally:
            ids = {id(f) for f in futures}
            with self._cv:
                self._futures = [f for f in self._futures if id(f) not in ids]

    @staticmethod
    def wait(futures: list[Any]) -> None:
        """Wait for ``futures``; raise the first error once all have ended."""
        error: BaseException | None = None
        for future in futures:
            try:
                future.result()
            except BaseException as e:  # noqa: BLE001 - the first is raised after the rest end
                error = error or e
        if error is not None:
            raise error

    def join(self) -> None:
        """Wait for every write started; raise the first error once all have ended."""
        with self._cv:
            self._cv.wait_for(lambda: not self._starting)
            futures, self._futures = self._futures, []
        self.wait(futures)

    def abandon(self) -> None:
        """End the save's generation, then wait for what it began; its errors are dropped."""
        with self._cv:
            self._generation += 1
        try:
            self.join()
        except Exception:  # noqa: BLE001 - the save's own error is the one raised
            pass

async def start_batch(writes: Writes, generation: int, items: Sequence[tuple],
                      parent: Any) -> list[Any]:
    """Start the writes of ``items``, ``(info, save arg, global shape, shape of the part
    each process writes, dtype, [(index, value)], create)`` each, in the directory
    ``parent`` (see `Writes.start`); return once all are under way, their futures."""
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
    return await asyncio.to_thread(writes.start, generation, jobs)


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
    # (the kvstore as JSON too: groups of one database open it once, in `Writes.start`)
    return ts.Spec(split[0]), split[1], json.dumps(split[1], sort_keys=True), info.ts_context
