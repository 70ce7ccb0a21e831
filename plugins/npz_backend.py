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

The tree helpers here (leaf records, nesting, placement like ``like``, stale
temporaries) are shared with the `orbax` backend.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import jax
import ml_dtypes
import numpy as np

from loopkit.errors import CheckpointError
from loopkit.fs import fsync_dir
from loopkit.pytree import conform, leaf_path

if TYPE_CHECKING:
    from loopkit.config import Config

__all__ = ["NpzBackend"]

log = logging.getLogger("loopkit")

_META_MEMBER = "__loopkit__"
_FORMAT = "loopkit-npz"
_VERSION = 1
_PY_TYPES = (bool, int, float, str)


# -- leaf records, shared with the orbax backend -----------------------------------


def dtype_name(dtype: np.dtype) -> str:
    """A name `dtype_from_name` turns back into ``dtype`` (numpy's own, or an ml_dtypes name)."""
    dtype = np.dtype(dtype)
    if dtype.name in ml_dtypes.__all__:  # bfloat16, float8_e4m3fn, int4, ...
        return dtype.name
    if dtype.kind in "OV":
        raise TypeError(f"dtype {dtype} is not supported (objects would need pickling)")
    return dtype.str


def dtype_from_name(name: str) -> np.dtype:
    """The dtype ``name`` stands for; only numpy's and ml_dtypes' names are accepted."""
    if not isinstance(name, str):
        raise TypeError(f"a dtype name must be a string, not {name!r}")
    if name in ml_dtypes.__all__:
        return np.dtype(getattr(ml_dtypes, name))
    dtype = np.dtype(name)  # raises TypeError for anything it does not know
    if dtype.kind in "OV":
        raise TypeError(f"dtype {name!r} is not a plain array dtype")
    return dtype


def leaf_records(state: Any) -> tuple[list[dict], list[Any]]:
    """One JSON-able record per leaf of ``state`` (None leaves included), and the leaves.

    A record holds ``path`` (the keys, as strings), ``kind`` (``"array"`` for numpy,
    ``"jax"``, ``"npscalar"``, ``"py"`` for a Python scalar or string stored inline,
    ``"none"``), and for arrays ``dtype`` and ``shape``. The leaf list holds, for
    array kinds, the leaf itself (not yet copied to the host), else None.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: x is None)
    records, leaves, seen = [], [], {}
    for keypath, leaf in flat:
        path = [leaf_path((k,)) for k in keypath]
        name = "/".join(path)
        if name in seen:
            raise ValueError(f"checkpoint leaf path {name!r} occurs twice in the state "
                             "(keys that differ only in type, such as 1 and '1')")
        seen[name] = True
        if leaf is None:
            records.append({"path": path, "kind": "none"})
            leaves.append(None)
        elif type(leaf) in _PY_TYPES:  # exactly: np.float64 is a float subclass
            records.append({"path": path, "kind": "py", "value": leaf})
            leaves.append(None)
        else:
            if isinstance(leaf, jax.Array):
                kind = "jax"
            elif isinstance(leaf, np.generic):
                kind = "npscalar"
            elif isinstance(leaf, np.ndarray):
                kind = "array"
            else:
                leaf = np.asarray(leaf)  # complex and other array-likes
                kind = "array"
            try:
                dtype = dtype_name(leaf.dtype)
            except TypeError as e:
                raise TypeError(f"checkpoint leaf {name!r}: {e}") from None
            records.append({"path": path, "kind": kind, "dtype": dtype,
                            "shape": list(leaf.shape)})
            leaves.append(leaf)
    return records, leaves


def record_struct(rec: dict) -> jax.ShapeDtypeStruct | None:
    """The shape and dtype a record's leaf restores as (None for None leaves and strings)."""
    if rec["kind"] == "none":
        return None
    if rec["kind"] == "py":
        if isinstance(rec["value"], str):
            return None
        # what jax makes of a Python scalar: the default dtype of its kind
        dtype = jax.dtypes.canonicalize_dtype(np.asarray(rec["value"]).dtype)
        return jax.ShapeDtypeStruct((), dtype)
    return jax.ShapeDtypeStruct(tuple(rec["shape"]), dtype_from_name(rec["dtype"]))


def check_records(records: Any, where: str) -> list[dict]:
    """``records`` read from a file, checked: they are data, not trusted."""

    def ok(rec: Any) -> bool:
        if not (isinstance(rec, dict) and isinstance(rec.get("path"), list)
                and all(isinstance(p, str) for p in rec["path"])):
            return False
        if rec.get("kind") == "none":
            return True
        if rec.get("kind") == "py":
            return type(rec.get("value")) in _PY_TYPES
        shape = rec.get("shape")
        try:
            dtype_from_name(rec.get("dtype"))
        except TypeError:
            return False
        return (rec.get("kind") in ("jax", "array", "npscalar") and isinstance(shape, list)
                and all(type(n) is int and n >= 0 for n in shape))

    if not (isinstance(records, list) and all(map(ok, records))):
        raise CheckpointError(f"checkpoint {where} has a malformed leaf index")
    return records


def nest(records: Sequence[dict], values: Sequence[Any]) -> Any:
    """Nested dicts keyed by the path components, holding ``values`` (None leaves as None)."""
    if len(records) == 1 and not records[0]["path"]:
        return values[0]  # the state was a single leaf
    root: dict = {}
    for rec, value in zip(records, values):
        node = root
        *parents, last = rec["path"] or [""]
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return root


def like_leaves(like: Any) -> dict[str, Any]:
    """``like``'s leaves by leaf path (empty for None)."""
    if like is None:
        return {}
    flat, _ = jax.tree_util.tree_flatten_with_path(like)
    return {leaf_path(kp): leaf for kp, leaf in flat}


def placement(like_leaf: Any, shape: tuple[int, ...], dtype: np.dtype) -> tuple[bool, Any]:
    """(as a jax array?, sharding or None) for a stored leaf next to ``like_leaf``.

    A leaf becomes a jax array when ``like`` has a jax array or abstract leaf of
    the same shape there, and jax can hold its dtype as is (not float64 without
    x64: never cast); it takes that leaf's sharding (None: the default device).
    Anything else comes back as stored, on the host.
    """
    if (isinstance(like_leaf, (jax.Array, jax.ShapeDtypeStruct))
            and tuple(like_leaf.shape) == tuple(shape)
            and jax.dtypes.canonicalize_dtype(dtype) == dtype):
        return True, getattr(like_leaf, "sharding", None)
    return False, None


def host_value(rec: dict, arr: np.ndarray | None) -> Any:
    """A record's leaf as stored, on the host."""
    kind = rec["kind"]
    if kind == "none":
        return None
    if kind == "py":
        return rec["value"]
    return arr[()] if kind == "npscalar" else arr


def put(arr: np.ndarray, sharding: Any) -> jax.Array:
    """``arr`` as a jax array with ``sharding`` (None: the default device)."""
    if sharding is None:
        return jax.device_put(arr)
    return jax.make_array_from_callback(arr.shape, sharding, lambda index: arr[index])


# -- temporaries of dead saves --------------------------------------------------------


@contextlib.contextmanager
def saving_lock(directory: Path) -> Iterator[None]:
    """Hold a shared lock on ``directory`` while a save writes temporaries in it."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing drops the lock; so does the process dying


def remove_stale(directory: Path, pattern: re.Pattern[str]) -> list[str]:
    """Remove names matching ``pattern`` when no save holds the directory's lock.

    Savers hold a shared `flock` on the directory while they write, and the lock
    dies with its process: if an exclusive lock can be had, every temporary left
    is from a save that died. An evaluator's backend in the same directory as a
    running trainer therefore never removes the trainer's work in progress.
    """
    removed: list[str] = []
    try:
        fd = os.open(directory, os.O_RDONLY)
    except FileNotFoundError:
        return removed
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return removed  # a save is in progress somewhere: leave its files alone
        for entry in os.scandir(directory):
            if pattern.fullmatch(entry.name):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                removed.append(entry.name)
        if removed:
            fsync_dir(directory)
            log.info("removed temporaries of interrupted checkpoint saves in %s: %s",
                     directory, ", ".join(sorted(removed)))
    finally:
        os.close(fd)
    return removed


# -- the backend ----------------------------------------------------------------------


class NpzBackend:
    """Stores each step's state as ``<basename>-<step>.npz`` in ``directory``.

    Synchronous: `save` returns once the checkpoint is committed (durable).
    `restore` with ``like=None`` returns nested dicts keyed by the path components.
    """

    #: how members are stored in the zip (a subclass may choose `zipfile.ZIP_DEFLATED`)
    compression = zipfile.ZIP_STORED

    def __init__(self, directory: str | os.PathLike[str], basename: str = "model.ckpt",
                 config: Config | None = None) -> None:
        self.directory = Path(directory)
        self.basename = basename
        self.config = config
        self._name = re.compile(re.escape(basename) + r"-(0|[1-9][0-9]*)\.npz")
        self._tmp = re.compile(r"\." + re.escape(basename) + r"-[0-9]+\.npz\.tmp-.+")
        remove_stale(self.directory, self._tmp)

    def path(self, step: int) -> Path:
        """The file of ``step``: ``<directory>/<basename>-<step>.npz``."""
        return self.directory / f"{self.basename}-{int(step)}.npz"

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
                values.append(value)
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
                    out[name] = host_value(rec, self._read(npz, rec, self.path(step)))
        missing = wanted - out.keys()
        if missing:
            raise KeyError(f"checkpoint {self.path(step)} has no leaves {sorted(missing)}")
        return out
