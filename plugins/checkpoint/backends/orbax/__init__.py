"""The `orbax` checkpoint backend: asynchronous, multi-process, atomic and durable.

A checkpoint is the directory ``<directory>/<basename>-<step>/``, a standard
orbax PyTree checkpoint (OCDBT, zarr3, uncompressed) of the state in its own
structure, as ``StandardCheckpointer().save(path, state)`` writes it: lists stay
lists, tuples and NamedTuples restore into a target, Python scalars are stored as
0-d arrays too; strings and empty arrays (which orbax cannot store) are None
there. So ``StandardCheckpointer().restore(path, jax.eval_shape(init))`` restores
it. Beside the tree, in the step metadata's ``custom_metadata`` (which orbax's
readers ignore), loopkit keeps JSON: the step, the caller's metadata, one record
per leaf (path, kind, dtype, shape; the same records as the `npz` backend's,
values of Python scalars and strings inline), and which stored nodes are
sequences, so `structure` reads no array data. Reading is
`read`, which also reads the earlier layout (nested
dicts keyed by the path components) and plain orbax saves.

Committing. orbax saves ``<name>.loopkit-staging`` (through its own temporary
directory and atomic rename; neither name is ever listed) but does not fsync
its metadata files (tensorstore syncs only its own). Once orbax's save has
returned on every process (its own barriers), the primary process fsyncs every
file and directory of the finished tree, publishes it as ``<name>`` by one
atomic rename, and fsyncs the parent directory; the other processes wait at a
barrier until it has. Nothing of orbax's internals is touched: loopkit walks
the directory orbax finished.

Asynchrony, and what it relies on. orbax's own `AsyncCheckpointer.save` blocks
the caller for: the previous save, a start barrier, creating the temporary
directory and its metadata file, a device-to-host copy of every jax array
(``np.asarray`` per shard: all arrays are "prioritized"), a deep copy of numpy
leaves, and a fresh asyncio loop and thread (15-30 ms on a busy 2-core machine
for 256 MB). Of these only the host copy protects against donation, and the
loop makes it unnecessary: the checkpoint plugin saves `Session.stage_state()`,
whose buffers the next steps never donate while the save runs (on CPU host views
hold them, elsewhere the rewritten leaves are already in host memory), so they
stay valid and unchanged for as long as this backend holds them (jax arrays are
immutable). So `save` only flattens the tree,
copies numpy leaves (those the caller could mutate in place), and hands the
rest -- the host copy, orbax's save, fsyncs, rename -- to one background thread,
which runs a synchronous orbax `Checkpointer`. There, the leaves this process
holds whole go to orbax as numpy arrays (the host copy; on CPU a view), which
orbax stores exactly as it stores jax arrays but without writing each one's
sharding to a metadata file in turn (most of a save's time with thousands of
leaves), and without its defensive copy of numpy arrays (the thread owns them);
`orbax.write` writes them all in one batch, the same bytes as orbax's own handler, a
third of its time with thousands of leaves; leaves spread over processes go as jax
arrays, written in one batch too (`orbax.sharded`). Its barriers go through the
jax.distributed client (``active_processes`` set), not orbax's default device
collectives, which in a background thread would interleave with the training
step's own collectives in a different order on each process; every process
starts its saves in the same order, so the barriers line up. At most one save
is in flight; `wait` joins it and re-raises its error, chained. A
caller that donates the state's buffers to the very next step without that
guarantee gets a failed save (jax raises for a deleted array), not a corrupt one.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from loopkit import storage
from loopkit.errors import CheckpointError
from loopkit.storage.local import fsync_dir, fsync_tree
from loopkit.plugins.checkpoint.backends.orbax import parts as orbax_parts
from loopkit.plugins.checkpoint.backends.orbax.layout import (
    HEAD_KEY as _KEY, VERSION as _VERSION, Head, objects_needed, sequence_nodes,
)
from loopkit.plugins.checkpoint.backends.orbax.read import ReadsOrbax, read_head
from loopkit.plugins.checkpoint.backends.orbax.write import Saver
from loopkit.plugins.checkpoint.backends.records import head_json, leaf_records
from loopkit.plugins.checkpoint.backends.staged import refuse_url
from loopkit.plugins.checkpoint.collectives import barrier
from loopkit.plugins.checkpoint.backends.temporaries import remove_stale, saving_lock

if TYPE_CHECKING:
    from loopkit.config import Config

__all__ = ["OrbaxBackend"]

_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's, see atomicity_types.TMP_DIR_SUFFIX
#: where orbax finishes a save (its own atomic rename) before loopkit makes the
#: finished tree durable and publishes it under its final name
_STAGING = ".loopkit-staging"


class OrbaxBackend(ReadsOrbax):
    """Stores each step's state as the orbax checkpoint ``<basename>-<step>/`` in ``directory``.

    Asynchronous: `save` hands the write to a background thread and returns;
    `wait` blocks until it is committed. The keyword options go to orbax's
    `PyTreeCheckpointHandler`; the defaults are the fastest measured here
    (benchmarks/README.md, "Checkpoint I/O"). ``restore_concurrent_gb`` bounds orbax's
    reads of arrays spread over processes; arrays a process reads whole go straight
    into their own buffers (`read.read_direct`). ``process_local``: in a job of
    many processes, this process's own checkpoints in a directory of its own (the
    shards it holds, its host-local leaves), written and read without waiting for
    the others (the local tier; orbax's emergency checkpointing writes its local
    checkpoints the same way).

    ``own_files``: ``directory`` is this process's alone, a stage `StagedBackend`
    uploads from, and each process writes its own part of each checkpoint there so
    that the union of every process's files is the checkpoint. orbax then writes at
    the checkpoint's own path with its commit file (as on GCS), not under a
    temporary name only the primary renames; every process publishes its own part
    by rename, unfsynced (the upload is the durable copy). With several processes
    each process's part is its own OCDBT database, which the chief merges once
    every part is uploaded (`merge_parts`; orbax's primary would see only its own
    in its stage; ``use_ocdbt=False``: the earlier layout, a zarr3 array per leaf).
    See docs/storage.md.
    """

    def __init__(self, directory: str | os.PathLike[str], basename: str = "model.ckpt",
                 config: Config | None = None, *, use_ocdbt: bool = True,
                 use_zarr3: bool = True, use_compression: bool = False,
                 save_concurrent_gb: int | None = None,
                 restore_concurrent_gb: int | None = None,
                 process_local: bool = False, own_files: bool = False) -> None:
        refuse_url(directory, type(self).__name__)
        self.directory = Path(directory)
        self.basename = basename
        self.config = config
        # own_files: `directory` is this process's alone (a stage `StagedBackend` uploads
        # from): each writes its own part there; the union of every process's is the checkpoint
        self.own_files = bool(own_files)
        many = jax.process_count() > 1
        # own_files with many processes and OCDBT: each process's part is its own database,
        # which the chief merges once every part is uploaded (orbax's primary merges
        # only the databases it sees, its own in its stage: `parts`); without
        # OCDBT, one zarr3 array per leaf and each process's chunks of it
        self._parts = self.own_files and many and bool(use_ocdbt)
        self._zarr3 = bool(use_zarr3)  # recorded in the head: how to read the arrays back
        self._name = re.compile(re.escape(basename) + r"-(0|[1-9][0-9]*)")
        self._stale = re.compile(
            r"\.?" + re.escape(basename) + r"-[0-9]+(" + re.escape(_TMP_SUFFIX) + r".*|"
            + re.escape(_STAGING) + r".*|\.replaced)")
        self._saves = 0  # names each save's publish barrier (the same on every process)
        # process_local: this process's own checkpoints in a directory of its own (a local
        # tier of many processes): each the primary of its own save, waiting for no other
        self._local = process_local and many
        self._processes = {jax.process_index()} if self._local else set(range(jax.process_count()))
        self._options = dict(use_ocdbt=use_ocdbt, use_zarr3=use_zarr3,
                             use_compression=use_compression,
                             save_concurrent_gb=save_concurrent_gb,
                             restore_concurrent_gb=restore_concurrent_gb)
        self._thread: threading.Thread | None = None
        self._pending: int | None = None  # the step of the save in flight
        self._error: BaseException | None = None  # the save thread's, raised at `wait`
        remove_stale(self.directory, self._stale)

    @functools.cached_property
    def _orbax(self) -> tuple[Any, Any, Any, bool]:
        """orbax's part: the writer, the saving and the reading `Checkpointer`, and whether
        this process is the primary. Built at the first read or save, in the caller's
        thread, not with the backend: importing orbax then runs beside the session's
        start-up (the checkpoint plugin's `import_ahead`), not before `init`."""
        import orbax.checkpoint as ocp

        many = jax.process_count() > 1
        if self._local:
            me = jax.process_index()
            multiprocessing = ocp.options.MultiprocessingOptions(
                primary_host=None, active_processes={me},
                barrier_sync_key_prefix=f"loopkit-local-{me}")
        else:
            # Barriers through the jax.distributed client, not orbax's default device
            # collectives: the save runs in a background thread, and a device collective
            # there would interleave with the training step's own collectives in a
            # different order on each process (gloo aborts: "collective mismatch").
            multiprocessing = ocp.options.MultiprocessingOptions(
                active_processes=self._processes if many else None)
        options = dict(self._options, multiprocessing_options=multiprocessing)

        def checkpointer(handler: Any, **kw: Any) -> Any:
            return ocp.Checkpointer(handler, multiprocessing_options=multiprocessing, **kw)

        # used by the save thread only: numpy arrays written in one batch, not copied
        # again (see _write and `write`)
        writer = Saver(**options)
        # own_files: orbax writes at the final path and marks it with its commit file
        # (as on GCS), not under a temporary name that only the primary renames: the
        # other processes' files would be left under that name in their own directories
        saver = checkpointer(writer.handler, **({"temporary_path_class":
                                                 ocp.path.atomicity.CommitFileTemporaryPath}
                                                if self.own_files else {}))
        reader = checkpointer(ocp.PyTreeCheckpointHandler(**options))  # caller's thread
        primary = multiprocessing.primary_host is None or ocp.multihost.is_primary_host(0)
        return writer, saver, reader, primary

    @property
    def _reader(self) -> Any:  # `ReadsOrbax` reads through it
        return self._orbax[2]

    def path(self, step: int) -> Path:
        """The directory of ``step``: ``<directory>/<basename>-<step>``."""
        return self.directory / f"{self.basename}-{int(step)}"

    # -- writing --

    def save(self, step: int, state: Any, metadata: dict) -> None:
        """Start saving ``state`` and ``metadata`` as ``step`` in the background."""
        self.wait()  # at most one save in flight; surfaces the last one's error
        self._orbax  # noqa: B018 - built here, in the caller's thread (an import error too)
        step = int(step)
        tree, custom = self._stored(step, state, metadata)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._pending = step
        self._thread = threading.Thread(target=self._write, args=(self.path(step), tree, custom),
                                        name=f"loopkit-orbax-save-{step}")
        self._thread.start()

    def _stored(self, step: int, state: Any, metadata: dict) -> tuple[Any, dict]:
        """The tree orbax is given for ``state``, and the step metadata's loopkit head."""
        records, leaves = leaf_records(state)
        names: dict[str, str] = {}
        stored: list[Any] = []  # the state's leaves as orbax stores them, None where it stores none
        for rec, leaf in zip(records, leaves):
            if (rec.kind == "none" or isinstance(rec.value, str)
                    or (rec.has_array and 0 in rec.shape)):
                stored.append(None)  # None, a string, or empty: kept in the records alone
                continue
            name = ".".join(rec.path or ("state",))  # orbax names arrays by keys joined with "."
            if name in names:
                raise ValueError(f"checkpoint leaves {names[name]!r} and {rec.name!r} "
                                 f"would both be stored by orbax as {name!r}")
            names[name] = rec.name
            if rec.kind == "py":
                # also stored as an array, so that orbax alone restores the whole state
                try:
                    with np.errstate(over="raise"):
                        leaf = np.asarray(rec.value, rec.struct().dtype)
                except (OverflowError, FloatingPointError):  # too big for jax's dtype too
                    leaf = np.asarray(rec.value)
            elif not isinstance(leaf, jax.Array):
                leaf = np.array(leaf)  # a copy: numpy arrays can change under the writer
            elif leaf.is_deleted():
                raise ValueError(f"checkpoint leaf {names[name]!r} was deleted (donated?)")
            stored.append(leaf)
        # The state's own structure, as `StandardCheckpointer().save(path, state)` writes it.
        if len(records) == 1 and not records[0].path:
            tree = {"state": stored[0]}  # a single leaf: orbax needs a container
        else:
            treedef = jax.tree_util.tree_structure(state, is_leaf=lambda x: x is None)
            tree = jax.tree_util.tree_unflatten(treedef, stored)
        if not names:
            tree = {"__empty__": np.zeros((1,), np.uint8)}  # orbax needs one array
        custom = {_KEY: {"version": _VERSION, "step": step, "metadata": metadata,
                         "zarr3": self._zarr3,
                         "leaves": [r.to_json() for r in records],
                         "sequences": sequence_nodes(tree)}}
        head_json(custom)  # refused now, in the caller's thread
        return tree, custom

    def _write(self, final: Path, tree: Any, custom: dict) -> None:
        """The background part of a save: host copy, orbax's write, fsyncs, rename.

        orbax writes the standard checkpoint under a staging name (with its own
        temporary directory and atomic rename); the chief then makes the finished
        tree durable (every file, then every directory, fsynced), publishes it under
        its final name by one atomic rename and fsyncs the directory holding it. No
        orbax internals: orbax does not fsync, so loopkit walks what it wrote.
        """
        try:
            with saving_lock(self.directory):
                trash = final.with_name(f".{final.name}.replaced")
                writer, saver, _, primary = self._orbax
                if (primary or self.own_files) and final.exists():
                    # Replacing a step: move the old one aside; orbax refuses to write over
                    # a directory. Other processes look only after orbax's start barrier.
                    # Removed once the new one is committed.
                    self._move_aside(final)
                # What this process holds whole is handed to orbax as numpy (on CPU a
                # view, elsewhere the host copy orbax would make): orbax writes a jax
                # array's sharding to a metadata file one array at a time, most of the
                # cost of a save with thousands of leaves; the data written is the same.
                tree = jax.tree.map(
                    lambda x: np.asarray(x) if isinstance(x, jax.Array)
                    and x.is_fully_addressable else x, tree)
                staging = final.with_name(final.name + _STAGING)
                try:
                    saver.save(staging, args=writer.args(tree), custom_metadata=custom)
                except BaseException:
                    writer.abandon()  # no write may outlive the save that began it
                    raise
                if self.own_files:
                    # this process's part, published in its own directory; not fsynced:
                    # the durable copy is the upload (`StagedBackend`), not this one
                    if self._parts and staging.exists():
                        orbax_parts.own_part(staging)
                    if staging.exists():
                        os.rename(staging, final)
                    else:
                        final.mkdir()  # this process had nothing of its own to write
                    shutil.rmtree(trash, ignore_errors=True)
                    return
                if primary:
                    fsync_tree(staging)
                    os.rename(staging, final)
                    fsync_dir(self.directory)
                    shutil.rmtree(trash, ignore_errors=True)
                self._saves += 1
                # no process goes on before it is published
                barrier(f"loopkit-published-{final.name}-{self._saves}", self._processes)
        except BaseException as e:  # re-raised by wait(), in the caller's thread
            self._error = e

    def wait(self) -> None:
        """Block until the save in flight is committed; re-raise its error, chained."""
        thread, step = self._thread, self._pending
        if thread is None:
            return
        thread.join()
        self._thread = self._pending = None
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"saving checkpoint {self.path(step)} failed: {error}") from error

    def close(self) -> None:
        """Wait for the save in flight, then release orbax's resources."""
        try:
            self.wait()
        finally:
            if "_orbax" in vars(self):  # built: a backend that never read nor saved has none
                _, saver, reader, _ = self._orbax
                saver.close()
                reader.close()

    # -- listing --

    def steps(self) -> list[int]:
        """The committed steps, ascending (a save in flight is listed after `wait`)."""
        found = {int(m.group(1)) for name, is_dir in storage.list_names(self.directory).items()
                 if is_dir and (m := self._name.fullmatch(name))}
        thread = self._thread
        if thread is not None and (thread.is_alive() or self._error is not None):
            found.discard(self._pending)  # maybe renamed, but not known to be durable yet
        return sorted(found)

    def delete(self, step: int) -> None:
        """Remove the checkpoint of ``step`` (nothing happens when there is none)."""
        if self._pending == step:
            self.wait()
        path = self.path(step)
        if path.exists():
            shutil.rmtree(self._move_aside(path), ignore_errors=True)

    def _move_aside(self, path: Path) -> Path:
        """Rename ``path`` to a name never listed (atomically: a reader never meets a
        half-removed tree), to be removed after; the new name."""
        trash = path.with_name(f".{path.name}.replaced")
        shutil.rmtree(trash, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.rename(path, trash)
            fsync_dir(self.directory)
        return trash

    # -- reading --

    def _head(self, step: int) -> Head:
        """What ``step`` holds, without its array data (a plain orbax save is read too)."""
        path = self.path(step)
        if not path.is_dir():
            raise FileNotFoundError(f"no orbax checkpoint for step {step}: {path}")
        return read_head(path)

    def restore(self, step: int, like: Any = None) -> tuple[Any, dict]:
        """The state of ``step`` as stored (placed like ``like`` where shapes match), and its metadata."""
        if self._pending == step:
            self.wait()
        return super().restore(step, like)

    def merge_parts(self, step: int, names: list[str], read: Any) -> list[str] | None:
        """The chief's merge of every process's database of ``step`` (`parts`), in
        this stage, once all are on the store (``names``, read by ``read``); the
        objects it wrote, to upload. None without a database per process."""
        if not self._parts:
            return None
        return orbax_parts.merge(self.path(step), names, read, self._zarr3)

    def fetch_needed(self, step: int, names: list[str], get: Any, read: Any,
                     like: Any) -> int | None:
        """Download what a restore of ``step`` into ``like`` reads of a merged database
        over per-process ones (`orbax_parts.fetch_needed`); None for another layout."""
        if not orbax_parts.is_merged_layout(names):
            return None
        return orbax_parts.fetch_needed(self.path(step), names, get, read, like)

    def objects_needed(self, names: list[str], read_json: Any, like: Any) -> list[str] | None:
        """Of a checkpoint's files (``names``, relative), those a restore into ``like`` on
        this process reads; None for all (`StagedBackend` downloads only those): a leaf
        sharded over several processes needs only its addressable shards' chunks."""
        return objects_needed(names, read_json, like)
