"""Reading safetensors files (``*.safetensors``, as published models ship) as a checkpoint.

Read-only, through the backend protocol, for `load_checkpoint` and `from_pretrained`.
A tensor's flat name becomes a leaf path: its ``.`` or ``/`` separators become path
components (``encoder.layer.0.weight`` is ``encoder/layer/0/weight``). Dtypes are
kept as stored (bfloat16 stays bfloat16). Needs the optional extra
``jax-loopkit[safetensors]``; the package is imported only when a file is read.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Sequence

import jax

from loopkit.errors import CheckpointError
from loopkit.plugins.checkpoint.backends.placement import like_leaves, put_like
from loopkit.plugins.checkpoint.backends.records import dtype_from_name, nest, reading
from loopkit.plugins.checkpoint.helpers.readers.read_only import ReadOnly

__all__ = ["SafetensorsCheckpoint"]

#: safetensors' dtype names -> numpy / ml_dtypes names
_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
    "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64",
    "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def _safe_open(file: Path) -> Any:
    try:
        from safetensors import safe_open
    except ImportError:
        raise ImportError(f"reading {file} needs the safetensors package: "
                          "pip install 'jax-loopkit[safetensors]'") from None
    return safe_open(str(file), framework="numpy")


class SafetensorsCheckpoint(ReadOnly):
    """The tensors of one or more ``.safetensors`` files, as one checkpoint (step 0)."""

    def __init__(self, files: Sequence[str | Path], where: str | Path | None = None) -> None:
        self.files = [Path(f) for f in files]
        self.where = Path(where) if where is not None else self.files[0]

    @functools.cached_property
    def _tensors(self) -> dict[str, tuple[Path, str, jax.ShapeDtypeStruct]]:
        """Leaf path -> (file, tensor name, shape and dtype), from the headers alone."""
        index: dict[str, tuple[Path, str, jax.ShapeDtypeStruct]] = {}
        for file in self.files:
            try:
                with _safe_open(file) as f:
                    for key in f.keys():
                        piece = f.get_slice(key)
                        name = piece.get_dtype()
                        if name not in _DTYPES:
                            raise ValueError(f"tensor {key!r} has dtype {name}, which loopkit "
                                             f"does not read (it reads {', '.join(_DTYPES)})")
                        path = "/".join(re.split(r"[./]", key))
                        if path in index:
                            raise ValueError(f"tensors {index[path][1]!r} and {key!r} both "
                                             f"become the leaf path {path!r}")
                        index[path] = (file, key, jax.ShapeDtypeStruct(
                            tuple(piece.get_shape()), dtype_from_name(_DTYPES[name])))
            except ImportError:
                raise
            except Exception as e:
                raise CheckpointError(f"safetensors file {file} cannot be read: {e}") from e
        for path in index:  # a leaf cannot also be a node
            parts = path.split("/")
            for i in range(1, len(parts)):
                if "/".join(parts[:i]) in index:
                    raise CheckpointError(
                        f"{self.where}: tensor {index[path][1]!r} lies under tensor "
                        f"{index['/'.join(parts[:i])][1]!r}: a leaf path cannot also be a node")
        return index

    def path(self, step: int) -> Path:
        return self.where

    def steps(self) -> list[int]:
        return [0] if all(f.is_file() for f in self.files) else []

    def structure(self, step: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {p: s for p, (_, _, s) in self._tensors.items()}

    def restore_leaves(self, step: int, paths: Sequence[str]) -> dict[str, Any]:
        index = self._tensors
        missing = set(paths) - index.keys()
        if missing:
            raise KeyError(f"{self.where} has no tensors for the leaf paths {sorted(missing)}")
        out: dict[str, Any] = {}
        by_file: dict[Path, list[str]] = {}
        for p in paths:
            by_file.setdefault(index[p][0], []).append(p)
        for file, chosen in by_file.items():
            with reading(f"safetensors file {file}"), _safe_open(file) as f:
                for p in chosen:
                    arr = f.get_tensor(index[p][1])
                    if arr.dtype != index[p][2].dtype:  # never cast
                        raise ValueError(f"tensor {index[p][1]!r} read as {arr.dtype}")
                    out[p] = arr
        return out

    def restore(self, step: int, like: Any = None) -> tuple[Any, dict]:
        from loopkit.state.pytree import conform

        values = self.restore_leaves(step, list(self._tensors))
        want = like_leaves(like)
        leaves = list(values.values())
        # placed in one batch: a device_put per tensor adds up over thousands
        put_like(leaves, [(i, want.get(p), None) for i, p in enumerate(values)])
        state = nest([tuple(p.split("/")) for p in values], leaves)
        return (state if like is None else conform(state, like)), {}
