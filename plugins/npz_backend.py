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

The leaf records (`loopkit.plugins.leaf_records`) are shared with the `orbax` backend.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import jax
import numpy as np

from loopkit import storage
from loopkit.errors import CheckpointError
from loopkit.fs import fsync_dir
from loopkit.pytree import conform

if TYPE_CHECKING:
    from loopkit.config import Config

__all__ = ["NpzBackend"]

log = logging.getLogger("loopkit")

_META_MEMBER = "__loopkit__"
_FORMAT = "loopkit-npz"
_VERSION = 1
_PY_TYPES = (bool, int, float, str)


from loopkit.plugins.leaf_records import (  # noqa: F401 - re-exported
    check_records,
    dtype_from_name,
    finish,
    host_value,
    leaf_records,
    like_leaves,
    nest,
    placement,
    put,
    record_struct,
    remove_stale,
    saving_lock,
)


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
        storage.refuse_url(directory, type(self).__name__)
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
        for rec, leaf in zip(records, leaves):
            if leaf is None:
                continue
            if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
                raise ValueError(f"checkpoint leaf {'/'.join(rec['path'])!r} spans several "
                                 "processes; the npz backend is single-process (use 'orbax')")
            arr = np.asarray(leaf)
            if arr.size == 0:
                continue  # shape and dtype in the record say it all
            rec["member"] = str(len(members))
            if arr.dtype.str != rec["dtype"]:  # an ml_dtypes dtype: raw bytes
                # (not ascontiguousarray: it turns 0-d arrays into 1-d ones)
                arr = (arr if arr.flags.c_contiguous else arr.copy()).view(f"V{arr.dtype.itemsize}")
            members.append((rec["member"], arr))
        try:
            head = json.dumps({"format": _FORMAT, "version": _VERSION, "step": step,
                               "metadata": metadata, "leaves": records})
        except (TypeError, ValueError) as e:
            raise TypeError(f"checkpoint metadata must be JSON-able: {e}") from None
        blob = np.frombuffer(head.encode("utf-8"), dtype=np.uint8)

        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.path(step)
        tmp = final.with_name(f".{final.name}.tmp-{socket.gethostname()}-{os.getpid()}")
        with saving_lock(self.directory):
            try:
                with open(tmp, "wb") as f:
                    with zipfile.ZipFile(f, "w", self.compression, allowZip64=True) as zf:
                        for name, arr in [(_META_MEMBER, blob), *members]:
                            with zf.open(name + ".npy", "w", force_zip64=True) as out:
                                np.lib.format.write_array(out, arr, allow_pickle=False)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, final)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            fsync_dir(self.directory)

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
    def _open(self, step: int) -> Iterator[tuple[Any, dict]]:
        """The open npz file of ``step`` and its validated header."""
        path = self.path(step)
        if not path.exists():
            raise FileNotFoundError(f"no npz checkpoint for step {step}: {path}")
        try:
            npz = np.load(path, allow_pickle=False)
        except Exception as e:
            raise CheckpointError(f"checkpoint {path} cannot be read: {e}") from e
        with npz:
            try:
                head = json.loads(npz[_META_MEMBER].tobytes().decode("utf-8"))
                if not (isinstance(head, dict) and head.get("format") == _FORMAT):
                    raise ValueError(f"not a {_FORMAT} file")
                if head.get("version") != _VERSION:
                    raise ValueError(f"format version {head.get('version')!r}, "
                                     f"this loopkit reads {_VERSION}")
            except Exception as e:
                raise CheckpointError(f"checkpoint {path} cannot be read: {e}") from e
            check_records(head.get("leaves"), str(path))
            yield npz, head

    def _read(self, npz: Any, rec: dict, where: Path) -> np.ndarray | None:
        """One record's array, checked against its record; never unpickles."""
        if rec["kind"] in ("none", "py"):
            return None
        name = "/".join(rec["path"])
        try:
            dtype, shape = dtype_from_name(rec["dtype"]), tuple(rec["shape"])
            member = rec.get("member")
            if member is None:
                if int(np.prod(shape)) != 0:
                    raise ValueError("its data is missing")
                return np.zeros(shape, dtype)
            arr = npz[str(member)]
            if arr.dtype != dtype:
                if arr.dtype.kind != "V" or arr.dtype.itemsize != dtype.itemsize:
                    raise ValueError(f"stored as {arr.dtype}, its record says {dtype}")
                arr = arr.view(dtype)
            if arr.shape != shape:
                raise ValueError(f"stored with shape {arr.shape}, its record says {shape}")
        except Exception as e:
            raise CheckpointError(f"checkpoint {where}: leaf {name!r} cannot be read: {e}") from e
        return arr

    def restore(self, step: int, like: Any = None) -> tuple[Any, dict]:
        """The state of ``step`` as stored (placed like ``like`` where shapes match), and its metadata."""
        want = like_leaves(like)
        with self._open(step) as (npz, head):
            values = []
            for rec in head["leaves"]:
                value = host_value(rec, self._read(npz, rec, self.path(step)))
                if rec["kind"] not in ("none", "py"):
                    as_jax, sharding = placement(want.get("/".join(rec["path"])),
                                                 np.shape(value), np.asarray(value).dtype)
                    if as_jax:
                        value = put(np.asarray(value), sharding)
                values.append(finish(rec, value))
        metadata = head.get("metadata")
        state = nest(head["leaves"], values)
        return (state if like is None else conform(state, like)), metadata or {}

    def structure(self, step: int) -> dict[str, jax.ShapeDtypeStruct]:
        """Leaf path -> shape and dtype of every leaf of ``step``, without reading array data."""
        with self._open(step) as (_, head):
            return {"/".join(r["path"]): st for r in head["leaves"]
                    if (st := record_struct(r)) is not None}

    def restore_leaves(self, step: int, paths: Sequence[str]) -> dict[str, Any]:
        """Read only the leaves at ``paths`` (leaf paths as `structure` names them)."""
        wanted = set(paths)
        with self._open(step) as (npz, head):
            out = {}
            for rec in head["leaves"]:
                name = "/".join(rec["path"])
                if name in wanted and rec["kind"] != "none":
                    out[name] = finish(rec, host_value(rec, self._read(npz, rec, self.path(step))))
        missing = wanted - out.keys()
        if missing:
            raise KeyError(f"checkpoint {self.path(step)} has no leaves {sorted(missing)}")
        return out
