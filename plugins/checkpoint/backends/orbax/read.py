"""Reading orbax PyTree checkpoints: the `orbax` backend's restore, and anyone's orbax trees.

loopkit's orbax checkpoints carry a head in the step metadata's ``custom_metadata``
(`layout`), which orbax's readers ignore: the step, the caller's metadata,
one record per leaf (`records`) and the nodes of the stored tree that orbax holds
as sequences. Version 2 stores the state in its own structure (lists stay lists),
version 1 stored nested dicts keyed by the path components; both read the same way.
A checkpoint without that head (a plain `StandardCheckpointer` or
`PyTreeCheckpointer` save) is described from orbax's own tree metadata instead.
Only orbax's public contract is used: the step metadata through
`metadata.get_step_metadata`, the stored tree through a `PyTreeCheckpointHandler`'s
`metadata()` (`stored_arrays`). Arrays this process reads whole are read with
tensorstore directly (`read_direct`), through orbax's own read specs; everything
else goes through orbax's restore.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from loopkit.errors import CheckpointError
from loopkit.plugins.checkpoint.backends.orbax.layout import (
    HEAD_KEY, READS, Head, is_orbax_tree, split_kvstore,
)
from loopkit.plugins.checkpoint.backends.placement import (
    addressable_regions, aligned_empty, layouts_hold, like_leaves, placement, put_into,
    put_like, put_regions,
)
from loopkit.plugins.checkpoint.backends.records import (
    LeafRecord, chosen, dtype_name, finish, host_value, nest, read_records, reading,
)

__all__ = ["ReadsOrbax", "read_arrays", "read_direct", "read_head", "restore_tree",
           "stored_arrays"]


def read_head(path: Path) -> Head:
    """loopkit's head of the checkpoint at ``path``, or one made from orbax's tree metadata."""
    import orbax.checkpoint as ocp

    if not path.is_dir():
        raise FileNotFoundError(f"no orbax checkpoint at {path}")
    with reading(f"checkpoint {path}"):
        custom = None
        if (path / "_CHECKPOINT_METADATA").exists():
            custom = ocp.metadata.get_step_metadata(path).custom_metadata
        head = (custom or {}).get(HEAD_KEY)
        if head is None:
            return _foreign_head(path)
        if head.get("version") not in READS:
            raise ValueError(f"format version {head.get('version')!r}, this loopkit reads "
                             f"{', '.join(map(str, READS))}")
        sequences = {}
        for s in head.get("sequences", []):
            if not (isinstance(s, dict) and isinstance(s.get("path"), list)
                    and all(isinstance(k, str) for k in s["path"])
                    and type(s.get("length")) is int):
                raise ValueError("malformed list of sequence nodes")
            sequences[tuple(s["path"])] = s["length"]
        step = head.get("step")
    records = read_records(head.get("leaves"), str(path))
    zarr3 = head.get("zarr3")
    return Head(records, sequences, head.get("metadata") or {},
                step if type(step) is int else None, zarr3 if type(zarr3) is bool else None)


def _foreign_head(path: Path) -> Head:
    """Records for a checkpoint orbax wrote for someone else, from its tree metadata."""
    import orbax.checkpoint as ocp

    if not is_orbax_tree(path):
        raise ValueError("it is not an orbax PyTree checkpoint (no _METADATA file)")
    with ocp.PyTreeCheckpointer() as reader:
        tree = reader.metadata(path).item_metadata.tree
    records: list[LeafRecord] = []
    sequences: dict[tuple[str, ...], int] = {}
    for path, node in _metadata_leaves(tree, sequences):
        if node is None:
            records.append(LeafRecord(path, "none"))
        elif isinstance(node, (ocp.metadata.ArrayMetadata, ocp.metadata.ScalarMetadata)):
            records.append(LeafRecord(path, "array", dtype_name(node.dtype), tuple(node.shape)))
        # strings (StringMetadata) are not array data: left out
    return Head(records, sequences, {})


def _metadata_leaves(node: Any, sequences: dict[tuple[str, ...], int] | None = None,
                     prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path, leaf) of each leaf of orbax's tree metadata ``node``; the length of each
    sequence node goes to ``sequences``."""
    if isinstance(node, dict):
        for key, child in node.items():
            yield from _metadata_leaves(child, sequences, prefix + (str(key),))
    elif isinstance(node, (list, tuple)):
        if sequences is not None:
            sequences[prefix] = len(node)
        for i, child in enumerate(node):
            yield from _metadata_leaves(child, sequences, prefix + (str(i),))
    else:
        yield prefix, node


def _target(head: Head, args: dict[str, Any]) -> Any:
    """The stored tree's structure holding ``args`` (by path) and None everywhere else.

    Sequence nodes become lists of their stored length: a partial restore skips
    what is None but needs every list whole.
    """
    root: dict = {}
    for path in [r.path or ("state",) for r in head.records] + list(head.sequences):
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        if path and path[-1] not in node:
            node[path[-1]] = args.get("/".join(path)) if tuple(path) not in head.sequences else {}

    def shape(node: Any, prefix: tuple[str, ...]) -> Any:
        if not isinstance(node, dict):
            return node
        node = {k: shape(v, prefix + (k,)) for k, v in node.items()}
        if prefix in head.sequences:
            out = [None] * head.sequences[prefix]
            for k, v in node.items():
                out[int(k)] = v
            return out
        return node

    return shape(root, ())


def _lookup(tree: Any, path: Sequence[str]) -> Any:
    for key in path:
        tree = tree[int(key)] if isinstance(tree, (list, tuple)) else tree[key]
    return tree


_BATCH_LEAVES, _BATCH_BYTES = 256, 64 << 20  # `read_direct` places arrays in batches this big
_NAME = "@loopkit-array-name@"


@functools.cache
def _lister() -> tuple[Any, type]:
    """orbax's `PyTreeCheckpointHandler`, used only for its public `metadata()`.

    Its type handlers for numpy and jax arrays are orbax's, but answer `metadata()`
    from what orbax gives them (`ParamInfo`: the array's name and directory) without
    opening the array as orbax's own do (a tensorstore open per array: most of the
    time of a restore of thousands of small leaves).
    """
    import jax
    import orbax.checkpoint as ocp

    th = ocp.type_handlers

    @dataclasses.dataclass
    class StoredArray(ocp.metadata.Metadata):
        """A leaf orbax stores as one zarr array (a numpy or jax array), not opened."""

    def listing(base: type) -> type:
        class Listing(base):
            """orbax's handler, whose `metadata` names each array without opening it."""

            async def metadata(self, infos: Sequence[Any]) -> Sequence[Any]:
                return [StoredArray(name=i.name, directory=i.parent_dir) for i in infos]

        return Listing

    registry = th.create_type_handler_registry(
        *[(t, th.get_type_handler(t)) for t in (int, float, bytes, np.number, str)],
        (np.ndarray, listing(th.NumpyHandler)()), (jax.Array, listing(th.ArrayHandler)()))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry), StoredArray


def stored_arrays(path: Path) -> tuple[set[tuple[str, ...]], bool] | None:
    """The stored paths of the leaves orbax keeps as one zarr array each at ``path``,
    and whether they are zarr3, from orbax's `metadata()`; None when orbax cannot say."""
    from etils import epath

    handler, stored_type = _lister()
    try:
        meta = handler.metadata(epath.Path(path))
        tree, use_zarr3 = meta.tree, bool(meta.use_zarr3)
    except Exception:  # noqa: BLE001 - orbax's restore reads it, and raises its own error
        return None
    return {p for p, node in _metadata_leaves(tree) if isinstance(node, stored_type)}, use_zarr3


def read_direct(path: Path, wanted: dict[str, tuple[str, ...]],
                place: Callable[[list[str], list[Any]], list[Any]] | None = None,
                stored: tuple[set[tuple[str, ...]], bool] | None = None,
                regions: dict[str, list[tuple[slice, ...]]] | None = None) -> dict[str, Any]:
    """Arrays of ``wanted`` (name -> stored path) read with tensorstore alone.

    The same zarr arrays orbax's restore reads, through orbax's own read specs, but
    all opened and read at once in one context, each straight into a buffer jax
    adopts: orbax's restore adds per-array Python (tree metadata, partial-restore
    trimming, for a leaf spread over processes about 2 ms of it) and a copy out of
    tensorstore's buffers, most of a restore's time (benchmarks/README.md). A name
    in ``regions`` is read only in those regions (global indices: the parts of a
    leaf this process's devices hold), and comes back as the list of them; every
    other whole. Leaves orbax stores otherwise are left out, for orbax's restore
    (``stored``: the stored paths of plain arrays and whether they are zarr3, when
    known; else orbax's `metadata()` says). ``place(names, values)``, if given,
    turns each batch read into what is returned for them (jax arrays), while the
    later reads are still under way: with thousands of leaves the placement's
    Python is as long as the reads.
    """
    # long: opening, reading and placing in one tensorstore context, in the order its
    # buffers are handed on
    import tensorstore as ts
    import orbax.checkpoint as ocp
    from etils import epath

    stored = stored or stored_arrays(path)
    if stored is None:
        return {}  # not a layout described here: orbax reads it
    arrays, use_zarr3 = stored
    names = [n for n, p in wanted.items() if p in arrays]
    if not names:
        return {}
    regions = regions or {}
    ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(epath.Path(path))
    # orbax's cache of OCDBT tree nodes (not of array data): each array's reads look
    # their keys up in the same tree (a cold restore of 16 leaves measured 20% faster)
    context = ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": 100_000_000}})
    # orbax's spec for one placeholder name, without its array's path: one spec and
    # one open database for every array (a spec per array costs more than the open)
    spec = ocp.type_handlers.get_json_tspec_read(ocp.type_handlers.ParamInfo(
        name=_NAME, parent_dir=epath.Path(path), is_ocdbt_checkpoint=ocdbt,
        use_zarr3=use_zarr3, ts_context=context), use_ocdbt=ocdbt)
    split = split_kvstore(spec, _NAME)
    if split is None:
        return {}  # a spec not seen here: orbax reads it
    with reading(f"checkpoint {path}"):
        store = ts.KvStore.open(split[1], context=context).result()
        base = ts.Spec(split[0])
        opening = [ts.open(base, kvstore=store / (".".join(wanted[n]) + "/"), context=context,
                           open=True, read=True) for n in names]
        reads = []  # each read starts as soon as its array is open
        for name, opened in zip(names, opening):
            array = opened.result()
            parts = []
            for index in regions.get(name, [None]):
                source = array if index is None else array[index].translate_to[0]
                out = aligned_empty(tuple(source.shape), np.dtype(array.dtype.numpy_dtype))
                # The target is held until its read is done, and let go on this thread:
                # the last reference to `out` dropped on a tensorstore thread makes that
                # thread wait for the GIL, and the reads queued behind it with it (4,096
                # leaves restored 7-10% faster, in wall and CPU time)
                target = ts.array(out, copy=False, write=True)
                parts.append((out, target.write(source), target))
            reads.append((parts, name in regions))
    values: dict[str, Any] = {}
    start = size = 0  # the batch read since `start`, and its bytes
    for i, (parts, split_up) in enumerate(reads):
        for out, read, _ in parts:
            try:
                read.result()
            except Exception as e:
                raise CheckpointError(f"checkpoint {path} cannot be read: {e}") from e
            size += out.nbytes
        end = i + 1
        if end == len(reads) or size >= _BATCH_BYTES or end - start >= _BATCH_LEAVES:
            batch = names[start:end]
            done = [[p[0] for p in r[0]] if r[1] else r[0][0][0] for r in reads[start:end]]
            values.update(zip(batch, place(batch, done) if place else done))
            reads[start:end] = [None] * (end - start)  # their targets let go here, on this thread
            start, size = end, 0
    return values


def read_arrays(reader: Any, path: Path, head: Head, records: Sequence[LeafRecord],
                like: dict[str, Any]) -> list[Any]:
    """The leaves of ``records`` (a subset of ``head.records``) at ``path``, placed by ``like``.

    Only the arrays asked for are read (an orbax partial restore).
    """
    # long: orbax's partial restore of the leaves asked for and the direct reads beside it,
    # in one pass over the records
    import orbax.checkpoint as ocp

    stored, args, puts = {}, {}, {}
    host: dict[str, tuple[str, ...]] = {}  # read directly: whole, or the regions in `parts`
    parts: dict[str, tuple[tuple[int, ...], Any, list[tuple[slice, ...]]]] = {}
    stored_as: list[str | None] = []  # each record's name in orbax (None: not in orbax)
    hold = layouts_hold(like, head.records, str(path))
    for rec in records:
        struct = rec.struct()
        if not rec.has_array or 0 in struct.shape:
            stored_as.append(None)
            continue
        as_jax, sharding = placement(like.get(rec.name), struct.shape, struct.dtype,
                                     rec.layout if hold else None)
        name = "/".join(rec.path or ("state",))
        stored_as.append(name)
        stored[name] = host[name] = rec.path or ("state",)
        if as_jax and sharding is not None and not sharding.is_fully_addressable:
            # only the regions this process's devices hold (orbax's restore, should
            # the direct read not know the layout)
            args[name] = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=struct.shape)
            parts[name] = (struct.shape, sharding, addressable_regions(sharding, struct.shape))
        else:
            # This process needs every byte anyway: read to the host and place it
            # here (orbax's jax path fills a zeroed host buffer, then copies it
            # to the device).
            args[name] = ocp.RestoreArgs(restore_type=np.ndarray)
            if as_jax:
                puts[name] = sharding

    def place(names: list[str], arrays: list[Any]) -> list[Any]:
        """A batch's arrays placed on their devices, each kind in one call (one per leaf
        adds up): those read whole, and those read in regions."""
        mine = [i for i, n in enumerate(names) if n in puts]
        put_into(arrays, mine, [puts[names[i]] for i in mine])
        spread = [i for i, n in enumerate(names) if n in parts]
        for i, x in zip(spread, put_regions([(*parts[names[i]][:2], arrays[i])
                                             for i in spread])):
            arrays[i] = x
        return arrays

    # Which leaves are plain arrays: loopkit's head says (it stores every leaf as one),
    # else orbax's `metadata()` (a head written before it recorded zarr3, anyone's tree)
    known = (set(host.values()), head.zarr3) if head.zarr3 is not None else None
    values = read_direct(path, host, place, known, {n: p[2] for n, p in parts.items()})
    placed = set(values)
    rest = [p for n, p in stored.items() if n not in values]
    if rest:
        # A partial restore with the stored structure as target: exact for what it
        # names, and it skips the empty nodes (EmptyState, {}) a full restore needs.
        with reading(f"checkpoint {path}"):  # (a tampered head fails in `_target`)
            target = _target(head, {n: a for n, a in args.items() if n not in values})
            tree = reader.restore(path, args=ocp.args.PyTreeRestore(
                item=target, restore_args=target, partial_restore=True))
        values.update({"/".join(p): _lookup(tree, p) for p in rest})
    names = [n for n in puts if n not in placed]  # read by orbax
    values.update(zip(names, place(names, [values[n] for n in names])))
    out: list[Any] = []
    empties = []
    for rec, name in zip(records, stored_as):
        value = None if name is None else values[name]
        # an empty array is not in orbax: made here, placed like the others
        if rec.has_array and name is None:
            struct = rec.struct()
            empties.append((len(out), like.get(rec.name), rec.layout if hold else None))
            value = np.zeros(struct.shape, struct.dtype)
        out.append(host_value(rec, value))
    put_like(out, empties)
    return [finish(rec, value) for rec, value in zip(records, out)]


def restore_tree(reader: Any, path: Path, head: Head, like: Any) -> tuple[Any, dict]:
    """The whole state of the checkpoint at `path` (placed like `like`), and its metadata."""
    from loopkit.state.pytree import conform

    values = read_arrays(reader, path, head, head.records, like_leaves(like))
    state = nest([r.path for r in head.records], values)
    return (state if like is None else conform(state, like)), head.metadata


class ReadsOrbax:
    """The reads of the backend protocol, for a backend of orbax PyTree checkpoints with
    an orbax `Checkpointer` `_reader`, `path(step)` and `_head(step)` (its `Head`)."""

    _reader: Any

    def restore(self, step: int, like: Any = None) -> tuple[Any, dict]:
        """The state of ``step`` as stored (placed like ``like`` where shapes match), and its metadata."""
        return restore_tree(self._reader, self.path(step), self._head(step), like)

    def structure(self, step: int) -> dict[str, Any]:
        """Leaf path -> shape and dtype of every leaf of ``step``, without reading array data."""
        return {r.name: s for r in self._head(step).records if (s := r.struct()) is not None}

    def restore_leaves(self, step: int, paths: Sequence[str]) -> dict[str, Any]:
        """Read only the leaves at ``paths`` (orbax partial restore); a missing one is a KeyError."""
        path, head = self.path(step), self._head(step)
        records = chosen(head.records, paths, path)
        values = read_arrays(self._reader, path, head, records, {})
        return {r.name: v for r, v in zip(records, values)}
