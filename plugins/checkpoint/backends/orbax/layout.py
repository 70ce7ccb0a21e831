"""What loopkit keeps in an orbax checkpoint beside orbax's tree, shared by its writer and reader.

The head (``custom_metadata["loopkit"]`` of orbax's step metadata, which orbax's
readers ignore): its key, the format version written and those read, and the nodes
of the stored tree that orbax holds as sequences; and how to split orbax's
tensorstore spec for one array into the spec and the checkpoint's kvstore.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np

from loopkit.plugins.checkpoint.backends.records import LeafRecord

__all__ = ["HEAD_KEY", "READS", "VERSION", "Head", "is_orbax_tree", "objects_needed",
           "sequence_nodes", "split_kvstore"]

#: the key of loopkit's head in the step metadata's ``custom_metadata``
HEAD_KEY = "loopkit"
#: the head's format version written (2: the state in its own structure)
VERSION = 2
#: the versions read (1: nested dicts keyed by the path components)
READS = (1, 2)


@dataclasses.dataclass
class Head:
    """What a checkpoint holds, read without its array data."""

    records: list[LeafRecord]
    sequences: dict[tuple[str, ...], int]  # stored nodes orbax holds as lists: their lengths
    metadata: dict
    step: int | None = None
    #: whether loopkit had orbax store the arrays as zarr3 (None: not recorded, ask orbax);
    #: every leaf loopkit stores is then one plain zarr array
    zarr3: bool | None = None


def is_orbax_tree(path: Path) -> bool:
    """Whether ``path`` is an orbax PyTree checkpoint directory (it has orbax's ``_METADATA``)."""
    return path.is_dir() and (path / "_METADATA").is_file()


#: a zarr3 chunk's name: its array's name, ``/c``, its grid position
_CHUNK = re.compile(r"(.*)/c(?:/[0-9]+)*")

_LEAF_TYPES = (np.ndarray, np.generic, bool, int, float, complex, str, bytes)


def sequence_nodes(state: Any) -> list[dict]:
    """``{"path", "length"}`` of each node of ``state`` that orbax stores as a sequence."""
    import jax
    import orbax.checkpoint as ocp

    from loopkit.state.pytree import leaf_path

    found: dict[tuple[str, ...], int] = {}
    leaf_types = (jax.Array, *_LEAF_TYPES)

    def walk(node: Any, prefix: tuple[str, ...]) -> None:
        if node is None or isinstance(node, leaf_types):
            return  # always a leaf (and asking jax costs 15 us a leaf)
        children, _ = jax.tree_util.tree_flatten_with_path(
            node, is_leaf=lambda x: x is not node or x is None)
        if not children or children[0][0] == ():
            return  # a leaf
        if ocp.utils.is_sequence_key(children[0][0][0]):
            found[prefix] = len(children)
        for keypath, child in children:
            walk(child, prefix + (leaf_path(keypath),))

    walk(state, ())
    return [{"path": list(p), "length": n} for p, n in found.items()]


def split_kvstore(spec: dict, name: str) -> tuple[dict, dict] | None:
    """orbax's tensorstore ``spec`` for the array ``name``: (the spec without its kvstore,
    the kvstore of the whole checkpoint); None for a spec not seen here."""
    spec = dict(spec)
    kvstore = spec.pop("kvstore", None)
    path = kvstore.get("path") if isinstance(kvstore, dict) else None
    if not (isinstance(path, str) and path.rstrip("/").endswith(name)):
        return None
    return spec, {**kvstore, "path": path.rstrip("/")[:-len(name)]}


def objects_needed(names: list[str], read_json: Any, like: Any) -> list[str] | None:
    """The objects of a checkpoint this process needs to restore ``like``; None for all.

    ``names``: the checkpoint's objects, relative to it; ``read_json(name)``: one of them
    parsed. A leaf of ``like`` placed with a sharding that spans processes needs only the
    zarr3 chunks its addressable shards overlap; every other object (metadata, other
    leaves, an OCDBT database, which is not split by array) is needed. The stored name of a
    leaf is orbax's: its path components joined with ``.``.
    """
    import itertools

    import jax

    from loopkit.state.init_trace import Guessed
    from loopkit.state.pytree import leaf_path

    if like is None or any(n.startswith("ocdbt.") or n.endswith("manifest.ocdbt")
                           for n in names):
        return None
    shards: dict[str, tuple[tuple[int, ...], list[tuple[slice, ...]]]] = {}
    flat, _ = jax.tree_util.tree_flatten_with_path(like, is_leaf=lambda x: x is None)
    for keypath, leaf in flat:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(leaf, Guessed) or sharding is None or sharding.is_fully_addressable:
            continue  # a Guessed leaf may be read with its saved layout: all of it
        shape = tuple(leaf.shape)
        name = ".".join(leaf_path((k,)) for k in keypath) or "state"
        shards[name] = shape, list(sharding.addressable_devices_indices_map(shape).values())
    if not shards:
        return None
    present = set(names)
    chunks: dict[str, list[str]] = {}  # a leaf's stored name -> its chunks' names
    for n in names:
        if (m := _CHUNK.fullmatch(n)) is not None:
            chunks.setdefault(m.group(1), []).append(n)
    dropped: set[str] = set()
    for name, (shape, indices) in shards.items():
        meta_name = f"{name}/zarr.json"
        if meta_name not in present:
            continue
        meta = read_json(meta_name)
        grid = meta.get("chunk_grid", {})
        keys = meta.get("chunk_key_encoding", {})
        if (meta.get("zarr_format") != 3 or tuple(meta.get("shape", ())) != shape
                or grid.get("name") != "regular"
                or keys.get("name") != "default"
                or keys.get("configuration", {}).get("separator", "/") != "/"):
            continue  # not a layout described here: all of it
        chunk = grid["configuration"]["chunk_shape"]
        kept = set()
        for index in indices:
            ranges = []
            for dim, (size, step) in enumerate(zip(shape, chunk)):
                s = index[dim] if dim < len(index) else slice(None)
                start, stop, _ = s.indices(size)
                ranges.append(range(start // step, -(-stop // step)) if stop > start else range(0))
            for coord in itertools.product(*ranges):
                kept.add("/".join((name, "c", *map(str, coord))))
        dropped.update(n for n in chunks.get(name, ()) if n not in kept)
    return [n for n in names if n not in dropped]
