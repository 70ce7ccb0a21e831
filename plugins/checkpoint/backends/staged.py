"""A local-file checkpoint backend's checkpoints kept under a URL (``s3://``, ``gs://``, ...).

The built-in backends write local files (orbax cannot write ``s3://`` at all:
its tensorstore spec builder knows only ``gs://``). Under a URL, each save is
written by the local backend into a staging directory on local disk, exactly
as it would be in a local logdir (the same standard orbax checkpoint, the same
npz file), then uploaded in the commit thread: every object of a directory
checkpoint, then the marker object `MARKER` last; a file
checkpoint is one object, whose write is atomic. So on the store a checkpoint is
committed once its last object is written: `steps` lists a directory only once
its marker is there, and a partial upload left by a crash is never listed and
is removed by the next run's first save. The staged copy is removed once
uploaded. Reading downloads the checkpoint into the staging directory and reads
it there. See docs/storage.md.

Many processes. Each process stages in its own directory and uploads only the
files it wrote there (the orbax backend's ``own_files``: a database per process).
The chief first removes what a crash left; every process uploads and reports its
part written (an object `PART` of its own); a barrier (through the jax.distributed
client: this runs in the commit thread, beside the step's collectives) waits for
every process; then the chief, if every report is there, lets the local backend
join the parts (``merge_parts``: orbax merges the databases) and writes the
marker; a last barrier keeps every process from going on before it is decided. A
process whose upload failed passes the barriers all the same, so no marker is
written and every process fails the save at once. (A failure inside orbax's own
write holds the others at orbax's barrier until its timeout first; a local save
that raises in the main thread ends that process's run, and the others fail at
their next collective.) A file checkpoint is the chief's copy alone (npz holds
replicas). A restore downloads on each process what it reads: what the local
backend's ``fetch_needed`` or ``objects_needed`` chooses for ``like`` (orbax: the
spans of the values its process reads), else the whole checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from loopkit import storage
from loopkit.errors import CheckpointError
from loopkit.plugins.checkpoint.backends.temporaries import own_directory, remove_stale
from loopkit.plugins.checkpoint.collectives import barrier
from loopkit.storage.retry import StoreFailure, retrying

__all__ = ["MARKER", "PART", "StagedBackend", "local_or_staged", "refuse_url"]

log = logging.getLogger("loopkit")

#: the object that commits a tree of objects (a directory checkpoint) on a URL: written
#: after the last of them (the name orbax itself uses on GCS)
MARKER = "commit_success.txt"

_STAGE = "loopkit-stage-"
_STAGED = re.compile(re.escape(_STAGE) + r".+")

#: the object with which a process reports its part of a checkpoint uploaded (many
#: processes); the chief writes `MARKER` only once every process's is there
PART = ".loopkit-part-{}"

#: how long a process waits at an upload's barrier for the others (orbax's default, 300 s,
#: is shorter than one process's upload of a big checkpoint); a process that died ends
#: the wait sooner through jax.distributed's own failure detection
BARRIER_SECS = 3600


def local_or_staged(directory: Path | str, basename: str, make: Callable[[Path | str], Any]) -> Any:
    """``make(directory)`` for a local directory; under a URL, `StagedBackend` over ``make``.

    What a plugin's `checkpoint_backend` hook returns for a backend that writes local
    files, so that it works under ``s3://`` and ``gs://`` too. With many processes each
    process's ``make`` gets a directory of its own (see the module)."""
    if storage.is_url(directory):
        return StagedBackend(str(directory), basename, make)
    return make(directory)


def refuse_url(directory: Any, who: str) -> None:
    """Fail clearly when a backend that writes local files is handed a URL."""
    if storage.is_url(directory):
        raise ValueError(
            f"{who} writes local files and was given the URL {directory!r}: build it through "
            "loopkit.plugins.checkpoint.backends.staged.local_or_staged(directory, basename, "
            "make), which stages it locally and uploads (docs/storage.md)")


def _stage_root() -> Path:
    return Path(tempfile.gettempdir())  # where stages are made (``TMPDIR``)


def _retried(operation: Callable[[], Any], what: str) -> Any:
    """`operation()`, retried while the store fails (`loopkit.storage.retry.retrying`)."""
    return retrying(operation, what, "The checkpoint is not committed; the run stops")


class StagedBackend:
    """Checkpoints under `url`, written and read by the local backend ``make_local(stage_dir)``.

    With many processes each stages and uploads its own part (see the module).
    """

    def __init__(self, url: str, basename: str, make_local: Callable[[Path], Any]) -> None:
        import jax

        self.url = url
        self._processes = set(range(jax.process_count()))
        self._index = jax.process_index()
        self._chief = self._index == 0
        self._uploads = 0  # names each upload's barriers (the same on every process)
        self.basename = basename
        # a crash leaves its stage behind: removed once its owner's lock is free
        remove_stale(_stage_root(), _STAGED, owned=True)
        self._stage, self._owner = own_directory(_stage_root(), f"{_STAGE}{os.getpid()}-")
        try:
            self.local = make_local(self._stage)
        except BaseException:
            self._remove_stage()
            raise
        suffix = self.local_name(0)[len(f"{basename}-0"):]
        self._name = re.compile(re.escape(basename) + r"-(0|[1-9][0-9]*)" + re.escape(suffix))
        self._pending: int | None = None  # saved locally, not yet uploaded
        self._fetched: set[int] = set()  # downloaded whole into the stage for reading
        self._ready: tuple[int, int] | None = None  # (step, id(like)) of the last `fetch`
        #: (objects downloaded, objects in the checkpoint) by the latest read
        self.last_fetch: tuple[int, int] | None = None
        self._cleaned = False

    def local_name(self, step: int) -> str:
        return Path(self.local.path(step)).name

    def path(self, step: int) -> str:
        """The URL of ``step``: ``<url>/<basename>-<step>`` (with the local backend's extension)."""
        return str(storage.join(self.url, self.local_name(step)))

    # -- writing --

    def save(self, step: int, state: Any, metadata: dict) -> None:
        """Start the local save of ``step``; `wait` finishes it and uploads it."""
        self.wait()
        step = int(step)
        self._discard_local(step)
        self.local.save(step, state, metadata)
        self._pending = step

    def wait(self) -> None:
        """Block until the pending save is written locally and uploaded (committed)."""
        step, self._pending = self._pending, None
        if step is None:
            return
        try:
            try:
                self.local.wait()
            except BaseException as e:
                if len(self._processes) < 2:
                    raise
                # through the upload's barriers all the same (it raises at their end), so
                # that no other process waits for this one
                self._upload(step, failed=e)
            else:
                self._upload(step)
        finally:
            self._discard_local(step)

    def _upload(self, step: int, failed: BaseException | None = None) -> None:
        """Upload ``step``: every process its own files, then the chief the marker.

        A directory checkpoint: the chief clears what a crash left, every process
        uploads its files and reports its part written (`PART`, with many processes);
        past a barrier, the chief joins the parts (`_merge`) and writes the marker,
        which commits it, if every report is there. A process whose upload failed
        still passes the barriers and reports nothing: no marker is written, and every
        process raises; so does a process whose local save ``failed`` (chained). A
        file checkpoint is one object, the chief's copy (the same replicas everywhere).
        """
        # long: the upload's steps and barriers in the order every process passes them, read
        # in one place
        src, dst = Path(self.local.path(step)), self.path(step)
        (fs, base), directory = storage.filesystem(dst), src.is_dir()
        self._uploads += 1
        phase = f"loopkit-upload-{self.basename}-{step}-{self._uploads}"
        many, error = len(self._processes) > 1, failed
        try:
            if error is None and directory:  # (else nothing of this process's to upload)
                # a commit file the local backend wrote (orbax's, with `own_files`) is not
                # uploaded: the marker goes up last, once every process's part is there
                (src / MARKER).unlink(missing_ok=True)
                if self._chief:
                    if not self._cleaned:  # only a writer cleans: a reader may watch a save
                        self._remove_partial()
                        self._cleaned = True
                    storage.remove(dst)  # a partial upload of this step, or the one it replaces
        except Exception as e:  # noqa: BLE001 - raised below, after the barriers
            error = e
        barrier(f"{phase}-cleared", self._processes, BARRIER_SECS)
        if error is None:
            try:  # each a retried store operation, which may be done again whole
                if directory:
                    _retried(lambda: storage.upload_tree(src, dst), f"uploading {dst}")
                    if many:
                        part = f"{base}/{PART.format(self._index)}"
                        _retried(lambda: fs.pipe_file(part, b""), f"writing {part}")
                elif self._chief:
                    _retried(lambda: fs.put_file(str(src), base), f"uploading {dst}")
            except Exception as e:  # noqa: BLE001 - raised below, after the barriers
                error = e
        # every process's upload has ended
        barrier(f"{phase}-written", self._processes, BARRIER_SECS)
        if error is None and self._chief and directory:
            try:
                if many:
                    fs.invalidate_cache(base)
                    found = {Path(p).name for p in fs.ls(base, detail=False)}
                    missing = sorted(i for i in self._processes
                                     if PART.format(i) not in found)
                    if missing:
                        raise CheckpointError(
                            f"process{'es' if len(missing) > 1 else ''} "
                            f"{', '.join(map(str, missing))} did not report "
                            "its part uploaded (its own output has the error)")
                    self._merge(step, src, fs, base)
                marker = f"{base}/{MARKER}"  # last: commits the upload
                _retried(lambda: fs.pipe_file(marker, b""), f"writing {marker}")
            except Exception as e:  # noqa: BLE001 - raised below, after the barrier
                error = e
        # no process goes on before it is decided
        barrier(f"{phase}-committed", self._processes, BARRIER_SECS)
        fs.invalidate_cache(base)
        if error is None and many and not self._chief:
            try:  # whether the chief committed it (it did not if a part failed)
                if not fs.exists(f"{base}/{MARKER}" if directory else base):
                    error = CheckpointError("it was not committed: another process failed "
                                            "(that process's output has the error)")
            except Exception as e:  # noqa: BLE001
                error = e
        if isinstance(error, StoreFailure):
            raise error  # it names what failed, and for how long it was retried
        if error is not None:
            raise CheckpointError(f"uploading checkpoint {dst} failed: {error}") from error

    def _merge(self, step: int, src: Path, fs: Any, base: str) -> None:
        """The chief's join of every process's part once all are uploaded, by a local
        backend with ``merge_parts(step, names, read)`` (orbax: the databases merged),
        which reads what it needs of the others' parts from the store; what it wrote
        is uploaded from the stage."""
        if (merge := getattr(self.local, "merge_parts", None)) is None:
            return
        names = [p[len(base) + 1:] for p in fs.find(base) if p.startswith(base + "/")]
        made = merge(step, names, lambda n, start, end: _retried(
            lambda: fs.cat_file(f"{base}/{n}", start=start, end=end), f"reading {base}/{n}"))
        if made:
            _retried(lambda: fs.put([str(src / n) for n in made], [f"{base}/{n}" for n in made]),
                     f"uploading the merged part of {base}")

    def _remove_partial(self) -> None:
        """Remove directory checkpoints whose upload never finished (no marker)."""
        for _, url, committed in self._on_store():
            if not committed:
                log.warning("loopkit: removing %s, a checkpoint whose upload never "
                            "finished", url)
                storage.remove(url)

    def _discard_local(self, step: int) -> None:
        storage.remove(Path(self.local.path(step)))
        self._fetched.discard(step)

    # -- listing --

    def steps(self) -> list[int]:
        """The committed steps under the URL, ascending."""
        return sorted(step for step, _, committed in self._on_store()
                      if committed and step != self._pending)

    def _on_store(self) -> Iterator[tuple[int, str, bool]]:
        """(step, URL, committed) of each checkpoint under the URL: a directory is
        committed once its marker is there (else an upload in progress, or one a crash
        cut short), a file once it is there."""
        for name, is_dir in storage.list_names(self.url).items():
            if (m := self._name.fullmatch(name)) is not None:
                url = str(storage.join(self.url, name))
                committed = not is_dir or storage.exists(str(storage.join(url, MARKER)))
                yield int(m.group(1)), url, committed

    def delete(self, step: int) -> None:
        """Remove the checkpoint of ``step``: its marker first, so it is never half-listed."""
        if self._pending == step:
            self.wait()
        url = self.path(step)
        if storage.exists(marker := str(storage.join(url, MARKER))):
            storage.remove(marker)
        storage.remove(url)
        self._discard_local(step)

    # -- reading --

    def _fetch(self, step: int, like: Any = None) -> None:
        """Download ``step`` into the stage, where the local backend reads it.

        With ``like``, a local backend's ``fetch_needed(step, names, get, read, like)``
        downloads what this process reads (orbax: spans of the per-process files), or
        its ``objects_needed(names, read_json, like)`` names the objects it reads (the
        per-leaf layout: its shards' chunks). Without, the whole checkpoint."""
        if step in self._fetched:
            return
        url, dst = self.path(step), Path(self.local.path(step))
        fs, base = storage.filesystem(url)
        self._discard_local(step)
        if not fs.isdir(base):
            fs.get_file(base, str(dst))  # FileNotFoundError when there is none
            self._fetched.add(step)
            return
        if not fs.exists(f"{base}/{MARKER}"):
            raise FileNotFoundError(f"checkpoint {url} is not committed (no {MARKER})")
        names = sorted(p[len(base) + 1:] for p in fs.find(base) if p.startswith(base + "/"))
        names = [n for n in names if n != MARKER and not n.startswith(PART.format(""))]
        def get(wanted: list[str]) -> None:
            for parent in {(dst / n).parent for n in wanted} | {dst}:
                parent.mkdir(parents=True, exist_ok=True)
            fs.get([f"{base}/{n}" for n in wanted], [str(dst / n) for n in wanted])

        if like is not None and getattr(self.local, "fetch_needed", None) is not None:
            fetched = self.local.fetch_needed(  # None: a layout it does not read in parts
                step, names, get, lambda n, start, end: fs.cat_file(
                    f"{base}/{n}", start=start, end=end), like)
            if fetched is not None:
                self.last_fetch = (fetched, len(names))
                return
        needed = getattr(self.local, "objects_needed", None)
        wanted = None
        if like is not None and needed is not None:
            wanted = needed(names, lambda n: json.loads(fs.cat_file(f"{base}/{n}")), like)
        whole = wanted is None or len(wanted) == len(names)
        wanted = names if wanted is None else wanted
        get(wanted)
        self.last_fetch = (len(wanted), len(names))
        if whole:  # a part is read once, by the restore it was chosen for
            self._fetched.add(step)

    def fetch(self, step: int, like: Any = None) -> None:
        """Download what `restore(step, like)` reads, without reading it.

        With many processes recovery calls this on every process and agrees on the
        outcome before any restore starts: orbax's read ends at a barrier, where the
        others would wait out orbax's 300 s for a process whose download failed.
        """
        self._fetch(step, like)
        self._ready = (step, id(like))

    def restore(self, step: int, like: Any = None) -> tuple[Any, dict]:
        if self._ready != (step, id(like)):
            self._fetch(step, like)
        self._ready = None
        try:
            return self.local.restore(step, like)
        finally:
            if step not in self._fetched:
                self._discard_local(step)  # a part: another `like` may need other parts

    def structure(self, step: int) -> dict[str, Any]:
        self._fetch(step)
        return self.local.structure(step)

    def restore_leaves(self, step: int, paths: Sequence[str]) -> dict[str, Any]:
        self._fetch(step)
        return self.local.restore_leaves(step, paths)

    def close(self) -> None:
        """Finish the pending upload, close the local backend, remove the stage."""
        try:
            self.wait()
        finally:
            try:
                self.local.close()
            finally:
                self._remove_stage()

    def _remove_stage(self) -> None:
        """Remove the stage, then let go of its lock (held until then: it is ours)."""
        shutil.rmtree(self._stage, ignore_errors=True)
        if self._owner is not None:
            os.close(self._owner)
            self._owner = None
