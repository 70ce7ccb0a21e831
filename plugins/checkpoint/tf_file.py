"""The `checkpoint` file, checkpoint names on disk, and what a checkpoint's metadata holds.

No backend and no heavy import here: the plugin, the helpers for evaluation
scripts and the `loopkit checkpoints` command all read a logdir through this.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from loopkit import storage

__all__ = [
    "CheckpointState",
    "checkpoint_path",
    "decode_position",
    "encode_position",
    "on_disk",
    "read_state",
    "recovery_order",
    "write_state",
]

log = logging.getLogger("loopkit")

STATE_FILE = "checkpoint"
DEFAULT_BASENAME = "model.ckpt"
NPZ_EXT = ".npz"
#: the key that marks base64-encoded bytes inside a JSON input position
BYTES_KEY = "__loopkit_bytes__"

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
    name = os.path.basename(name.rstrip("/"))
    if name.endswith(NPZ_EXT):
        name = name[: -len(NPZ_EXT)]
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
    for line in text.splitlines():
        m = _LINE.match(line)
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
    stamps: list[float | None] = [None] * len(steps)
    raw = fields.get("all_model_checkpoint_timestamps", [])
    if len(raw) == len(steps):
        try:
            stamps = [float(t) for t in raw]
        except ValueError:
            pass
    preserved = None
    if fields.get("last_preserved_timestamp"):
        try:
            preserved = float(fields["last_preserved_timestamp"][-1])
        except ValueError:
            pass
    return CheckpointState(
        basename=base,
        latest=latest[1] if latest and latest[0] == base else None,
        listed=list(zip(steps, stamps)),
        last_preserved_timestamp=preserved,
    )


def write_state(logdir: str | os.PathLike[str], state: CheckpointState) -> None:
    """Write ``logdir/checkpoint`` atomically and durably (on a URL: one object write)."""
    storage.write_atomic(storage.join(storage.normalise(logdir), STATE_FILE),
                         state.to_text().encode("utf-8"))


def on_disk(logdir: str | os.PathLike[str], basename: str = DEFAULT_BASENAME) -> dict[int, Path]:
    """Step -> path of each checkpoint under its final name in `logdir`.

    A final name is ``<basename>-<step>`` with at most one extension: the npz
    backend's ``model.ckpt-5.npz`` file, orbax's ``model.ckpt-5/`` directory, or
    a plugin backend's ``model.ckpt-5.ext``. Backends publish a checkpoint by an
    atomic rename to that name, so a final name means a committed checkpoint;
    temporary names (orbax's ``model.ckpt-5.orbax-checkpoint-tmp-...``, or any
    name starting with a dot) never match.
    """
    pattern = re.compile(rf"^{re.escape(basename)}-(\d+)(\.[A-Za-z0-9]+)?$")
    found: dict[int, Path] = {}
    try:
        entries = list(os.scandir(logdir))
    except (FileNotFoundError, NotADirectoryError):
        return found
    for entry in entries:
        m = pattern.match(entry.name)
        if m is not None:
            found.setdefault(int(m.group(1)), Path(entry.path))
    return found


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


# -- the input position, as JSON -----------------------------------------------------


def _to_json(obj: Any, where: str) -> Any:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {BYTES_KEY: base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: key {k!r} is not a str")
            out[k] = _to_json(v, f"{where}[{k!r}]")
        return out
    if isinstance(obj, (list, tuple)):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    item = getattr(obj, "item", None)  # numpy scalars
    if callable(item) and getattr(obj, "shape", None) == ():
        return _to_json(item(), where)
    tolist = getattr(obj, "tolist", None)  # numpy arrays
    if callable(tolist):
        return _to_json(tolist(), where)
    raise TypeError(f"{where} is {type(obj).__name__} {obj!r}, which JSON cannot hold")


def encode_position(position: Any) -> Any:
    """The input position as a JSON value; bytes become ``{"__loopkit_bytes__": base64}``.

    Raises `TypeError` naming the part that JSON cannot hold.
    """
    value = _to_json(position, "the input position (data.get_state())")
    json.dumps(value)  # fail here, with the message above, not inside a backend
    return value


def decode_position(value: Any) -> Any:
    """Undo `encode_position`."""
    if isinstance(value, dict):
        if set(value) == {BYTES_KEY}:
            return base64.b64decode(value[BYTES_KEY])
        return {k: decode_position(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_position(v) for v in value]
    return value
