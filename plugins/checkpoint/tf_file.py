"""The `checkpoint` file (tf.train's text format), checkpoint names, and the backend's name.

``logdir/checkpoint`` names the latest checkpoint and lists the kept ones
(`CheckpointState`, `read_state`, `write_state`); `recovery_order` is the order a
restart tries them in. Beside it, ``logdir/checkpoint_backend.json`` records the
name of the backend that wrote them (`write_backend_name`), so that the helpers build
that backend through the `checkpoint_backend` hook: a plugin's backend needs no more
than the protocol and that hook to be found. (It is a file of its own because
TensorFlow's reader of the `checkpoint` file, a protobuf text-format parser, fails
on a field it does not know.)

No backend and no heavy import here: the plugin, the helpers for evaluation
scripts and the `loopkit checkpoints` command all read a logdir through this.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from loopkit import storage
from loopkit.storage.retry import retrying

__all__ = [
    "BACKEND_FILE",
    "CheckpointState",
    "checkpoint_path",
    "read_backend_name",
    "read_local_dir",
    "read_state",
    "recovery_order",
    "write_backend_name",
    "write_state",
]

log = logging.getLogger("loopkit")

STATE_FILE = "checkpoint"
#: beside the `checkpoint` file: ``{"checkpoint_backend": "<name>"}``, the backend that wrote
BACKEND_FILE = "checkpoint_backend.json"
DEFAULT_BASENAME = "model.ckpt"
NPZ_EXT = ".npz"

_LINE = re.compile(r"^\s*([A-Za-z_]\w*)\s*:\s*(.*?)\s*$")


@dataclasses.dataclass
class CheckpointState:
    """The contents of ``logdir/checkpoint`` (tf.train's ``CheckpointState``), by step.

    ``listed`` holds the steps of ``all_model_checkpoint_paths`` in save order
    with their timestamps; ``latest`` is the step ``model_checkpoint_path`` names.
    """

    basename: str = DEFAULT_BASENAME
    latest: int | None = None
    listed: list[tuple[int, float | None]] = dataclasses.field(default_factory=list)
    last_preserved_timestamp: float | None = None

    def to_text(self) -> str:
        lines = []
        if self.latest is not None:
            lines.append(f'model_checkpoint_path: "{self.basename}-{self.latest}"')
        for step, _ in self.listed:
            lines.append(f'all_model_checkpoint_paths: "{self.basename}-{step}"')
        if self.listed and all(t is not None for _, t in self.listed):
            lines += [f"all_model_checkpoint_timestamps: {t!r}" for _, t in self.listed]
        if self.last_preserved_timestamp is not None:
            lines.append(f"last_preserved_timestamp: {self.last_preserved_timestamp!r}")
        return "\n".join(lines) + "\n"


def checkpoint_path(directory: str | os.PathLike[str], basename: str, step: int) -> str:
    """Where the checkpoint of `step` is named: ``<directory>/<basename>-<step>`` (a path or URL)."""
    return str(storage.join(directory, f"{basename}-{step}"))


def split_name(name: str) -> tuple[str, int] | None:
    """``("model.ckpt", 1234)`` for ``model.ckpt-1234`` (or ``.../model.ckpt-1234.npz``)."""
    name = os.path.basename(name.rstrip("/")).removesuffix(NPZ_EXT)
    m = re.match(r"^(.+)-(\d+)$", name)
    return (m.group(1), int(m.group(2))) if m else None


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        value = value[1:-1].replace('\\"', '"').replace("\\'", "'").replace("\\\\", "\\")
    return value


def read_state(logdir: str | os.PathLike[str], basename: str | None = None) -> CheckpointState | None:
    """Parse ``logdir/checkpoint``; None when there is none or it cannot be read.

    Paths may be relative to ``logdir`` (as loopkit writes them) or absolute
    inside it; an entry that names no checkpoint of ``basename`` is ignored with
    a warning. Unknown fields are ignored (lenient where a protobuf text parser
    would fail: a restart should not stop over a line it does not need).
    """
    path = storage.join(storage.normalise(logdir), STATE_FILE)
    try:
        text = storage.read_bytes(path).decode("utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as ex:
        log.warning("loopkit: cannot read %s (%s); ignoring it", path, ex)
        return None
    fields: dict[str, list[str]] = {}
    for m in map(_LINE.match, text.splitlines()):
        if m:
            fields.setdefault(m.group(1), []).append(_unquote(m.group(2)))

    def step_of(entry: str) -> tuple[str, int] | None:
        if storage.is_url(entry):
            outside = entry.rsplit("/", 1)[0] != str(storage.normalise(logdir))
        else:
            p = Path(entry)
            outside = p.is_absolute() and (storage.is_url(logdir)
                                           or p.parent != Path(logdir).absolute())
        if outside:
            log.warning("loopkit: %s names %s, outside %s; ignoring that entry", path, entry, logdir)
            return None
        found = split_name(entry)
        if found is None or (basename is not None and found[0] != basename):
            log.warning("loopkit: %s names %r, which is not a checkpoint name "
                        "(<basename>-<step>); ignoring that entry", path, entry)
            return None
        return found

    latest = step_of(fields["model_checkpoint_path"][-1]) if fields.get("model_checkpoint_path") else None
    listed = [e for e in map(step_of, fields.get("all_model_checkpoint_paths", [])) if e]
    base = basename or (latest[0] if latest else None)
    if base is None:
        bases = {b for b, _ in listed}
        base = bases.pop() if len(bases) == 1 else DEFAULT_BASENAME
    steps = [s for b, s in listed if b == base]
    raw = fields.get("all_model_checkpoint_timestamps", [])
    stamps = (_floats(raw) if len(raw) == len(steps) else None) or [None] * len(steps)
    preserved = _floats(fields.get("last_preserved_timestamp", [])[-1:])
    return CheckpointState(
        basename=base,
        latest=latest[1] if latest and latest[0] == base else None,
        listed=list(zip(steps, stamps)),
        last_preserved_timestamp=preserved[0] if preserved else None,
    )


def _floats(values: list[str]) -> list[float] | None:
    """``values`` as numbers; None when one is not a number."""
    try:
        return [float(v) for v in values]
    except ValueError:
        return None


def write_state(logdir: str | os.PathLike[str], state: CheckpointState) -> None:
    """Write ``logdir/checkpoint`` atomically and durably (on a URL: one object write,
    retried while the store fails)."""
    _write(storage.join(storage.normalise(logdir), STATE_FILE), state.to_text().encode("utf-8"))


def _write(path: Path | str, data: bytes) -> None:
    """`storage.write_atomic`; on a URL retried while the store fails (`retrying`)."""
    if not storage.is_url(path):
        storage.write_atomic(path, data)
        return
    retrying(lambda: storage.write_atomic(path, data), f"writing {path}")


def recovery_order(state: CheckpointState | None, committed: list[int] | set[int]) -> list[int]:
    """The steps a restart tries, best first.

    The step the `checkpoint` file names (so a hand edit picks the checkpoint),
    then the older committed ones, newest first. Without a file naming one: every
    committed step, newest first.
    """
    if state is not None and state.latest is not None:
        named = state.latest
        return [named] + sorted((s for s in committed if s < named), reverse=True)
    return sorted(committed, reverse=True)


def write_backend_name(logdir: str | os.PathLike[str], name: str | None,
                       local_dir: str | None = None) -> None:
    """Record, beside the `checkpoint` file, that the backend called ``name`` writes here,
    and the local tier the run keeps beside it on this host (for ``loopkit checkpoints``)."""
    import socket

    record: dict[str, Any] = {"checkpoint_backend": name}
    if local_dir is not None:
        record.update(local_checkpoint_dir=local_dir, host=socket.gethostname())
    _write(storage.join(storage.normalise(logdir), BACKEND_FILE),
           json.dumps(record).encode("utf-8"))


def _backend_record(logdir: str | os.PathLike[str]) -> dict[str, Any]:
    path = storage.join(storage.normalise(logdir), BACKEND_FILE)
    try:
        record = json.loads(storage.read_bytes(path).decode("utf-8"))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except (OSError, ValueError) as ex:
        log.warning("loopkit: cannot read %s (%s); ignoring it", path, ex)
        return {}
    return record if isinstance(record, dict) else {}


def read_backend_name(logdir: str | os.PathLike[str]) -> str | None:
    """The backend name recorded in `logdir` (`write_backend_name`); None when there is none."""
    name = _backend_record(logdir).get("checkpoint_backend")
    return name if isinstance(name, str) and name else None


def read_local_dir(logdir: str | os.PathLike[str]) -> str | None:
    """The local tier recorded in `logdir` by a run on this host (None: none, or another
    host's, whose disk this is not)."""
    import socket

    record = _backend_record(logdir)
    local = record.get("local_checkpoint_dir")
    if not isinstance(local, str) or record.get("host") != socket.gethostname():
        return None
    return local