"""A checkpoint of many processes on an object store: a database per process, merged.

orbax's multi-process layout with OCDBT: each process writes the arrays it holds into
its own database, ``ocdbt.process_<i>/`` under the checkpoint (a manifest and a few
data files), and orbax's primary merges them in its ``finalize`` into the checkpoint's
own database (``manifest.ocdbt`` and B-tree nodes under ``d/``), whose entries point at
the values in the per-process files (which stay where they are). orbax merges only the
databases it sees in one directory; under a URL each process writes in a stage of its
own (`staged.StagedBackend`), so the chief merges after every process has uploaded its
part: it downloads each other process's manifest and the byte ranges of its B-tree
nodes (a few kB per thousand leaves; the values are not read), places them at the same
offsets in its stage, and runs orbax's public ``type_handlers.merge_ocdbt_per_process_files``
there. Only the merged manifest and nodes go up. So a save writes a few objects per
process, whatever the leaf count.

Reading such a checkpoint downloads the merged database's manifest and nodes and the
metadata files, then, of the per-process data files, only the byte ranges holding the
values this process reads (a leaf sharded over processes: the chunks its own shards
overlap), each file's ranges fetched as a few spans and written at their offsets.
Locations come from tensorstore's public ``ocdbt.dump``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

__all__ = ["PREFIX", "fetch_needed", "is_merged_layout", "merge", "own_part"]

#: orbax's name of a process's own database under the checkpoint
PREFIX = "ocdbt.process_"
_MANIFEST = "manifest.ocdbt"
#: byte ranges of one file closer than this are fetched as one span
_GAP = 1 << 20
#: the values a compaction holds in memory at most (about): one generation's
_BATCH = 1 << 30

#: reads ``name`` (relative to the checkpoint) from ``start`` to ``end`` (None: to its end)
ReadRange = Callable[[str, "int | None", "int | None"], bytes]


def own_part(path: Path) -> None:
    """Leave in ``path`` (this process's finished part) only what is this process's own:
    its database, compacted, not the merge orbax's primary made of its database alone."""
    _unmerge(path)
    for db in path.glob(PREFIX + "*"):
        _compact(db)


def _unmerge(path: Path) -> None:
    (path / _MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(path / "d", ignore_errors=True)


def _compact(db: Path) -> None:
    """Rewrite the database ``db`` as one generation per `_BATCH` bytes: a data file
    each (its B-tree nodes at its end) and the manifest.

    orbax's writes reach the database as they come, and it commits a generation, with
    a file of nodes and one of values, each time the previous commit ends: tens of
    files for thousands of arrays, more the more arrays. Copied in one transaction, a
    few; about half a second for 4,096 leaves (32 MiB) on a loaded 2-core machine.
    """
    import tensorstore as ts

    if len(list((db / "d").glob("*"))) <= 3:
        return
    src = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{db}/"}).result()
    config = {k: v for k, v in ts.ocdbt.dump(_kvstore(db)).result()["config"].items()
              if k != "uuid"}
    out = db.with_name(db.name + ".compact")
    shutil.rmtree(out, ignore_errors=True)
    dst = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{out}/", "assume_config": True,
                           "config": {**config, "manifest_kind": "single"},
                           "target_data_file_size": 0}).result()
    keys = src.list().result()
    start = 0
    while start < len(keys):
        txn, size, writes = ts.Transaction(atomic=False), 0, []
        into = dst.with_transaction(txn)
        while start < len(keys) and size < _BATCH:
            group = keys[start:start + 256]
            start += len(group)
            for key, read in [(k, src.read(k)) for k in group]:
                value = read.result().value
                size += len(value)
                writes.append(into.write(key, value))
        for write in writes:
            write.result()
        txn.commit_async().result()
    shutil.rmtree(db)
    os.rename(out, db)


def is_merged_layout(names: Sequence[str]) -> bool:
    """Whether a checkpoint of these objects is one merged database over per-process ones."""
    return _MANIFEST in names and any(n.startswith(PREFIX) for n in names)


def _location(loc: str) -> tuple[str, int, int]:
    """(file relative to the database, offset, length) of a dumped ``kind:base:rel:off:len``."""
    _, rest = loc.split(":", 1)
    where, offset, length = rest.rsplit(":", 2)
    base, rel = where.split(":", 1)
    return base + rel, int(offset), int(length)


def _place(path: Path, name: str, offset: int, data: bytes) -> None:
    """Write ``data`` at ``offset`` of the file ``name`` under ``path`` (sparse elsewhere)."""
    target = path / name
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _kvstore(path: Path) -> Any:
    import tensorstore as ts

    return ts.KvStore.open({"driver": "file", "path": f"{path}/"}).result()


def _nodes(kv: Any, path: Path, loc: str, fetch: Callable[[str, int, int], None]
           ) -> Iterator[dict]:
    """Every entry of the B-tree under the node at ``loc`` (depth first), fetching each
    node's bytes with ``fetch(file, offset, length)`` first."""
    import tensorstore as ts

    fetch(*_location(loc))
    for entry in ts.ocdbt.dump(kv, loc).result().get("entries", []):
        if "indirect_value" in entry or "inline_value" in entry:
            yield entry  # a leaf's entry: the common case, thousands of them
            continue
        children = [v for k, v in entry.items()
                    if k not in ("key", "indirect_value", "inline_value")
                    and isinstance(v, str) and v.startswith("btreenode:")]
        if children:
            for child in children:
                yield from _nodes(kv, path, child, fetch)
        else:
            yield entry


def _root(kv: Any) -> str | None:
    """The location of the latest version's root node (None: an empty database)."""
    import tensorstore as ts

    versions = ts.ocdbt.dump(kv).result().get("versions") or []
    return (versions[-1].get("root") or {}).get("location") if versions else None


def merge(path: Path, names: Sequence[str], read: ReadRange, use_zarr3: bool) -> list[str]:
    """Merge every process's database of the checkpoint at ``path`` (the chief's stage,
    holding its own part) into the checkpoint's database; the names of what it wrote.

    ``names``: the checkpoint's objects on the store; ``read``: a ranged read of one.
    Of another process's database only its manifest and its B-tree nodes are fetched
    (the merge copies references to the values, never the values).
    """
    import orbax.checkpoint as ocp
    from etils import epath

    databases = sorted({n[:-len(_MANIFEST) - 1] for n in names
                        if n.startswith(PREFIX) and n.endswith("/" + _MANIFEST)
                        and n.count("/") == 1})
    for db in databases:
        local = path / db
        if (local / _MANIFEST).exists():
            continue  # this process's own, here whole
        local.mkdir(parents=True, exist_ok=True)
        (local / _MANIFEST).write_bytes(read(f"{db}/{_MANIFEST}", None, None))
        kv = _kvstore(local)
        root = _root(kv)
        if root is None:
            continue

        def fetch(name: str, offset: int, length: int, db: str = db) -> None:
            if length:
                _place(path / db, name, offset, read(f"{db}/{name}", offset, offset + length))

        for _ in _nodes(kv, local, root, fetch):
            pass
    _unmerge(path)  # a merge left here before (orbax's primary's, of its own alone)
    context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
    asyncio.run(ocp.type_handlers.merge_ocdbt_per_process_files(
        epath.Path(path), ts_context=context, use_zarr3=use_zarr3))
    if not (path / _MANIFEST).exists():
        raise RuntimeError(f"merging the per-process databases of {path} wrote no manifest")
    return [_MANIFEST] + sorted(f"d/{f.name}" for f in (path / "d").iterdir())


def fetch_needed(path: Path, names: Sequence[str], get: Callable[[list[str]], None],
                 read: ReadRange, like: Any) -> int:
    """Download into ``path`` what a restore into ``like`` on this process reads of a
    checkpoint in the merged layout (`is_merged_layout`); how many objects it touched.

    ``get(names)`` downloads whole objects, ``read`` a range of one. The merged
    database and the metadata files come whole; of the per-process files only the
    spans holding the values read.
    """
    from loopkit.plugins.checkpoint.backends.orbax.layout import objects_needed

    index = [n for n in names if not n.startswith(PREFIX)]
    get(index)
    kv = _kvstore(path)
    root = _root(kv)
    located: dict[str, tuple[str, int, int]] = {}
    inline: dict[str, bytes] = {}

    whole = set(index)  # (the merged database's own nodes among them)

    def fetch(name: str, offset: int, length: int) -> None:
        if length and name not in whole:
            _place(path, name, offset, read(name, offset, offset + length))

    for entry in (_nodes(kv, path, root, fetch) if root else ()):
        key = entry["key"].decode() if isinstance(entry["key"], bytes) else entry["key"]
        if "indirect_value" in entry:
            located[key] = _location(entry["indirect_value"])
        else:
            inline[key] = entry.get("inline_value", b"")

    parsed: dict[bytes, Any] = {}  # leaves of one shape and dtype share their zarr.json

    def read_json(key: str) -> Any:
        if key in inline:
            raw = inline[key]
        else:
            name, offset, length = located[key]
            raw = read(name, offset, offset + length)
        if raw not in parsed:
            parsed[raw] = json.loads(raw)
        return parsed[raw]

    kept = objects_needed(list(located) + list(inline), read_json, like)
    wanted = located if kept is None else [k for k in kept if k in located]
    spans: dict[str, list[list[int]]] = {}
    for name, offset, length in sorted(located[k] for k in wanted):
        runs = spans.setdefault(name, [])
        if runs and offset <= runs[-1][1] + _GAP:
            runs[-1][1] = max(runs[-1][1], offset + length)
        else:
            runs.append([offset, offset + length])
    jobs = [(name, start, end) for name, runs in spans.items() for start, end in runs]
    _read_all(path, jobs, read)
    return len(index) + len(spans)


def _read_all(path: Path, jobs: list[tuple[str, int, int]], read: ReadRange) -> None:
    """Fetch every span of ``jobs`` concurrently (the store's round trip dominates)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(job: tuple[str, int, int]) -> None:
        name, start, end = job
        _place(path, name, start, read(name, start, end))

    with ThreadPoolExecutor(max(1, min(16, len(jobs)))) as pool:
        list(pool.map(one, jobs))
