"""The `npz` checkpoint backend: numpy only, synchronous, atomic and durable.

A checkpoint is one file, ``<directory>/<basename>-<step>.npz``: a zip of ``.npy``
members, one per non-empty array leaf, plus ``__loopkit__``, a uint8 array holding
JSON: the step, the caller's metadata, and one record per leaf (its path, kind,
dtype name and shape; Python scalars and strings are stored inline). Nothing is
ever pickled or unpickled: arrays are written and read with
``allow_pickle=False``, so a tampered file whose unpickling would run code fails
to restore instead. Dtypes numpy cannot name in a ``.npy`` header (bfloat16 and
the other ml_dtypes) are stored as raw void bytes and viewed back by name.

The file is written under a temporary name (``.<basename>-<step>.npz.tmp-...``,
which `steps` never lists), fsynced, renamed to its final name, and the directory
is fsynced: only then is the save committed (DESIGN.md, Checkpoints).

The leaf records (`records`) are shared with the `orbax` backend.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import logging
import os
import re
import socket
import struct
import threading
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import jax
import numpy as np

try:  # ISA-L's CRC-32, 3-4x zlib's (the `fast` extra); the same checksum
    from isal.isal_zlib import crc32
except ImportError:
    from zlib import crc32

from loopkit.errors import CheckpointError
from loopkit.storage.local import atomic_file, fsync_dir
from loopkit.state.pytree import conform

if TYPE_CHECKING:
    from loopkit.config import Config

__all__ = ["NpzBackend"]

log = logging.getLogger("loopkit")

_META_MEMBER = "__loopkit__"
_FORMAT = "loopkit-npz"
_VERSION = 1
_READERS = min(4, os.cpu_count() or 1)  # threads reading members at once (more than cores: slower)

from loopkit.plugins.checkpoint.backends.placement import (  # noqa: E402
    aligned_empty, layouts_hold, like_leaves, put_like,
)
from loopkit.plugins.checkpoint.backends.records import (  # noqa: E402
    LeafRecord, chosen, dtype_from_name, finish, head_json, host_value, leaf_records, nest,
    read_records, reading,
)
from loopkit.plugins.checkpoint.backends.staged import refuse_url  # noqa: E402
from loopkit.plugins.checkpoint.backends.temporaries import remove_stale, saving_lock  # noqa: E402


class NpzBackend:
    """Stores each step's state as ``<basename>-<step>.npz`` in ``directory``.

    Synchronous: `save` returns once the checkpoint is committed (durable).
    `restore` with ``like=None`` returns nested dicts keyed by the path components.
    """

    #: how members are stored in the zip (a subclass may choose `zipfile.ZIP_DEFLATED`)
    compression = zipfile.ZIP_STORED
    #: the file name's extension (a subclass writing another format picks its own)
    extension = ".npz"

    def __init__(self, directory: str | os.PathLike[str], basename: str = "model.ckpt",
                 config: Config | None = None) -> None:
        refuse_url(directory, type(self).__name__)
        self.directory = Path(directory)
        self.basename = basename
        self.config = config
        ext = re.escape(self.extension)
        self._name = re.compile(re.escape(basename) + r"-(0|[1-9][0-9]*)" + ext)
        self._tmp = re.compile(r"\." + re.escape(basename) + r"-[0-9]+" + ext + r"\.tmp-.+")
        remove_stale(self.directory, self._tmp)

    def path(self, step: int) -> Path:
        """The file of ``step``: ``<directory>/<basename>-<step>.npz``."""
        return self.directory / f"{self.basename}-{int(step)}{self.extension}"

    # -- writing --

    def save(self, step: int, state: Any, metadata: dict) -> None:
        """Write ``state`` and ``metadata`` as ``step``; returns once committed."""
        step = int(step)
        records, leaves = leaf_records(state)
        members: list[tuple[str, np.ndarray]] = []
        for i, (rec, leaf) in enumerate(zip(records, leaves)):
            if leaf is None:
                continue
            if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
                raise ValueError(f"checkpoint leaf {rec.name!r} spans several "
                                 "processes; the npz backend is single-process (use 'orbax')")
            arr = np.asarray(leaf)
            if arr.size == 0:
                continue  # shape and dtype in the record say it all
            records[i] = rec = rec._replace(member=str(len(members)))
            if arr.dtype.str != rec.dtype:  # an ml_dtypes dtype: raw bytes
                # (not ascontiguousarray: it turns 0-d arrays into 1-d ones)
                arr = (arr if arr.flags.c_contiguous else arr.copy()).view(f"V{arr.dtype.itemsize}")
            members.append((rec.member, arr))
        head = head_json({"format": _FORMAT, "version": _VERSION, "step": step,
                          "metadata": metadata, "leaves": [r.to_json() for r in records]})
        blob = np.frombuffer(head.encode("utf-8"), dtype=np.uint8)

        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.path(step)
        tmp = final.with_name(f".{final.name}.tmp-{socket.gethostname()}-{os.getpid()}")
        with saving_lock(self.directory), atomic_file(final, tmp) as f:
            headers: dict[tuple, bytes] = {}
            with zipfile.ZipFile(f, "w", self.compression, allowZip64=True) as zf:
                for name, arr in [(_META_MEMBER, blob), *members]:
                    with zf.open(name + ".npy", "w", force_zip64=True) as out:
                        _write_npy(out, arr, headers)

    def wait(self) -> None:
        """Nothing to wait for: `save` is synchronous."""

    def close(self) -> None:
        """Nothing to release."""

    # -- listing --

    def steps(self) -> list[int]:
        """The committed steps, ascending."""
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for e in entries
                      if (m := self._name.fullmatch(e.name)) and e.is_file())

    def delete(self, step: int) -> None:
        """Remove the checkpoint of ``step`` (nothing happens when there is none)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(step))
            fsync_dir(self.directory)

    # -- reading --

    @contextlib.contextmanager
    def _open(self, step: int) -> Iterator[tuple[_Reader, dict, list[LeafRecord]]]:
        """The open npz file of ``step``, its validated header and leaf records."""
        path = self.path(step)
        if not path.exists():
            raise FileNotFoundError(f"no npz checkpoint for step {step}: {path}")
        with reading(f"checkpoint {path}"):
            reader = _Reader(path)
        with reader:
            with reading(f"checkpoint {path}"):
                head = json.loads(reader.array(_META_MEMBER).tobytes().decode("utf-8"))
                if not (isinstance(head, dict) and head.get("format") == _FORMAT):
                    raise ValueError(f"not a {_FORMAT} file")
                if head.get("version") != _VERSION:
                    raise ValueError(f"format version {head.get('version')!r}, "
                                     f"this loopkit reads {_VERSION}")
            yield reader, head, read_records(head.get("leaves"), str(path))

    def _read(self, reader: _Reader, rec: LeafRecord, where: Path) -> np.ndarray | None:
        """One record's array, checked against its record; never unpickles."""
        if not rec.has_array:
            return None
        try:
            dtype, shape = dtype_from_name(rec.dtype), rec.shape
            if rec.member is None:
                if int(np.prod(shape)) != 0:
                    raise ValueError("its data is missing")
                return np.zeros(shape, dtype)
            arr = reader.array(rec.member)
            if arr.dtype != dtype:
                if arr.dtype.kind != "V" or arr.dtype.itemsize != dtype.itemsize:
                    raise ValueError(f"stored as {arr.dtype}, its record says {dtype}")
                arr = arr.view(dtype)
            if arr.shape != shape:
                raise ValueError(f"stored with shape {arr.shape}, its record says {shape}")
        except Exception as e:
            raise CheckpointError(f"checkpoint {where}: leaf {rec.name!r} cannot be read: {e}") from e
        return arr

    def restore(self, step: int, like: Any = None) -> tuple[Any, dict]:
        """The state of ``step`` as stored (placed like ``like`` where shapes match), and its metadata."""
        want = like_leaves(like)
        with self._open(step) as (reader, head, records):
            # several members at once: reading and checking each is mostly outside the GIL
            # in a few tasks, not one per leaf: a task costs tens of µs
            tasks = min(len(records), 4 * _READERS)
            with concurrent.futures.ThreadPoolExecutor(_READERS) as pool:
                parts = list(pool.map(lambda part: [self._read(reader, r, self.path(step))
                                                    for r in part],
                                      [records[i::tasks] for i in range(tasks)]))
            arrays = [parts[i % tasks][i // tasks] for i in range(len(records))]
            values = [host_value(rec, arr) for rec, arr in zip(records, arrays)]
        # placed in one batch: a device_put per leaf costs more than reading it
        hold = layouts_hold(want, records, str(self.path(step)))
        put_like(values, [(i, want.get(rec.name), rec.layout if hold else None)
                          for i, rec in enumerate(records) if rec.has_array])
        values = [finish(rec, value) for rec, value in zip(records, values)]
        state = nest([r.path for r in records], values)
        return (state if like is None else conform(state, like)), head.get("metadata") or {}

    def structure(self, step: int) -> dict[str, jax.ShapeDtypeStruct]:
        """Leaf path -> shape and dtype of every leaf of ``step``, without reading array data."""
        with self._open(step) as (_, _, records):
            return {r.name: st for r in records if (st := r.struct()) is not None}

    def restore_leaves(self, step: int, paths: Sequence[str]) -> dict[str, Any]:
        """Read only the leaves at ``paths`` (leaf paths as `structure` names them)."""
        where = self.path(step)
        with self._open(step) as (reader, _, records):
            return {rec.name: finish(rec, host_value(rec, self._read(reader, rec, where)))
                    for rec in chosen(records, paths, where)}


class _Reader:
    """The ``.npy`` members of a zip written by `NpzBackend`, each read straight into its array.

    What ``np.load`` does, without its per-member cost: a stored member's bytes are
    read once, into the array (no intermediate buffers), headers with the same bytes
    are parsed once, and the zip's CRC of every member is checked. ``allow_pickle``
    is never on: an object dtype is refused.
    """

    def __init__(self, path: Path) -> None:
        self._file = open(path, "rb", buffering=0)
        try:
            self._zip = zipfile.ZipFile(self._file)
        except BaseException:
            self._file.close()
            raise
        self._headers: dict[bytes, tuple[tuple[int, ...], bool, np.dtype]] = {}
        # numpy parses a header with `ast`, which CPython 3.11 (3.11.7 here) can break
        # when threads switch inside it, more often at the short switch interval of
        # checkpoint I/O ("AST constructor recursion depth mismatch", cpython#106905):
        # one reader thread parses at a time
        self._parsing = threading.Lock()

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._zip.close()
        self._file.close()

    def array(self, member: str) -> np.ndarray:
        info = self._zip.getinfo(member + ".npy")
        if info.compress_type != zipfile.ZIP_STORED:  # a subclass's compressed members
            with self._zip.open(info) as f:
                return np.lib.format.read_array(f, allow_pickle=False)
        fd, at = self._file.fileno(), info.header_offset
        # one read for the zip's local header and, usually, the whole .npy header
        first = os.pread(fd, _HEAD, at)
        local = first[:30] if len(first) >= 30 else _pread(fd, 30, at)
        if local[:4] != b"PK\x03\x04":
            raise ValueError(f"member {member!r}: bad local header")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        at += 30 + name_len + extra_len
        first = first[30 + name_len + extra_len:]
        magic = first[:8] if len(first) >= 8 else _pread(fd, 8, at)
        if magic[:6] != b"\x93NUMPY" or magic[6] not in (1, 2, 3):
            raise ValueError(f"member {member!r} is not a .npy array")
        size_len = 2 if magic[6] == 1 else 4
        size_bytes = first[8:8 + size_len]
        if len(size_bytes) != size_len:
            size_bytes = _pread(fd, size_len, at + 8)
        header_len = struct.unpack("<H" if magic[6] == 1 else "<I", size_bytes)[0]
        header = first[8 + size_len:8 + size_len + header_len]
        if len(header) != header_len:
            header = _pread(fd, header_len, at + 8 + size_len)
        parsed = self._headers.get(header)
        if parsed is None:
            with self._parsing:
                read_header = (np.lib.format.read_array_header_1_0 if magic[6] == 1
                               else np.lib.format.read_array_header_2_0)
                parsed = read_header(io.BytesIO(size_bytes + header))
                if parsed[2].hasobject:
                    raise ValueError(f"member {member!r} holds Python objects (never unpickled)")
                self._headers[header] = parsed
        shape, fortran, dtype = parsed
        arr = aligned_empty(shape[::-1] if fortran else shape, dtype)
        data = memoryview(arr.reshape(-1).view(np.uint8))
        head_len = len(magic) + len(size_bytes) + len(header)
        if head_len + len(data) != info.file_size:
            raise ValueError(f"member {member!r} has {info.file_size} bytes, its header says "
                             f"{head_len + len(data)}")
        at += head_len
        # os.preadv and crc32 release the GIL: members are read by several threads at once
        crc = crc32(size_bytes + header, crc32(magic))
        for start in range(0, max(len(data), 1), _CHUNK):
            chunk = data[start:start + _CHUNK]
            done = 0
            while done < len(chunk):
                n = os.preadv(fd, [chunk[done:]], at + start + done)
                if not n:
                    raise ValueError(f"member {member!r} is truncated")
                done += n
            crc = crc32(chunk, crc)
        if crc != info.CRC:
            raise ValueError(f"member {member!r} is corrupt (CRC mismatch)")
        return arr.T if fortran else arr


_CHUNK = 16 << 20  # read, then checksum while the bytes are still in the CPU's cache
_HEAD = 512  # bytes read at once at a member's start: its zip and .npy headers fit


def _write_npy(out: Any, arr: np.ndarray, headers: dict[tuple, bytes]) -> None:
    """`np.lib.format.write_array`, with each distinct header made once (a deep
    state repeats a few shapes thousands of times)."""
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")  # (not ascontiguousarray: it turns 0-d into 1-d)
    key = (arr.dtype.str, arr.shape)
    header = headers.get(key)
    if header is None:
        buf = io.BytesIO()
        meta = np.lib.format.header_data_from_array_1_0(arr)
        try:
            np.lib.format.write_array_header_1_0(buf, meta)
        except ValueError:  # a header over 64 KiB (a huge number of dimensions)
            buf = io.BytesIO()
            np.lib.format.write_array_header_2_0(buf, meta)
        header = headers[key] = buf.getvalue()
    out.write(header)
    if arr.size:
        out.write(memoryview(arr.reshape(-1)).cast("B"))


def _pread(fd: int, n: int, offset: int) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise ValueError("the file is truncated")
    return data
