"""The input position a checkpoint holds, as JSON (a checkpoint is data, never pickled).

`encode_position` turns what the data source's ``get_state()`` returns into a JSON
value (bytes as base64 under `BYTES_KEY`); `decode_position` undoes it at recovery.

With many processes each reads its own shard, so each has its own position, and the
chief alone writes a durable checkpoint's metadata: every checkpoint, in every tier,
holds them all (`gather_positions`, at the save's step, under ``data_positions``, by
process index), and each process resumes with its own (`own_position`).
"""

from __future__ import annotations

import base64
import json
import logging
import time
from typing import Any

import jax

from loopkit.plugins.checkpoint.collectives import gather_positions

__all__ = ["BYTES_KEY", "checkpoint_metadata", "decode_position", "encode_position",
           "own_position"]

log = logging.getLogger("loopkit")

#: the key that marks base64-encoded bytes inside a JSON input position
BYTES_KEY = "__loopkit_bytes__"


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


def own_position(metadata: dict, where: str) -> Any:
    """This process's input position in a checkpoint's `metadata` (at `where`), decoded:
    its own entry of ``data_positions`` when the checkpoint was written by as many
    processes as there are now, else the writer's ``data_position``."""
    every = metadata.get("data_positions")
    me, count = jax.process_index(), jax.process_count()
    if isinstance(every, list) and len(every) == count:
        return decode_position(every[me])
    if isinstance(every, list) and me == 0:
        log.warning("loopkit: %s holds the input positions of %d processes, and this run "
                    "has %d: every process resumes its data at process 0's position",
                    where, len(every), count)
    return decode_position(metadata.get("data_position"))


def checkpoint_metadata(session: Any, step: int) -> dict:
    """A checkpoint's metadata at `step`: the step, the input position (every process's,
    gathered, with several processes reading their own shards: a collective), the
    skipped ranges after a rollback."""
    inp = session.input
    position = encode_position(inp.position(step) if inp is not None else None)
    metadata = {
        "step": step,
        "data_position": position,
        "timestamp": time.time(),
        "process_count": jax.process_count(),
    }
    if jax.process_count() > 1 and inp is not None and inp.kind == "stateful":
        metadata["data_positions"] = gather_positions(position)  # each reads its shard
    if inp is not None and inp.skipped:  # rollbacks skipped batches: where the input is
        metadata.update(consumed=step + inp.offset, skipped=[list(r) for r in inp.skipped])
    return metadata
