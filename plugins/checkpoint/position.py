"""The input position a checkpoint holds, as JSON (a checkpoint is data, never pickled).

`encode_position` turns what the data source's ``get_state()`` returns into a JSON
value (bytes as base64 under `BYTES_KEY`); `decode_position` undoes it at recovery.
"""

from __future__ import annotations

import base64
import json
from typing import Any

__all__ = ["BYTES_KEY", "decode_position", "encode_position"]

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
