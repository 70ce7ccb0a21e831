"""The summary-writer protocol every built-in writes through, and its one value dispatch."""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

import numpy as np

__all__ = ["SummaryWriter", "write_values"]


@runtime_checkable
class SummaryWriter(Protocol):
    """What `session.summary_writer` offers (tensorboardX's `SummaryWriter` has it).

    The summaries plugin sets a tensorboardX writer; a plugin that sends metrics
    elsewhere (a metrics service, a CSV file) may set any object with these
    methods instead, and every built-in then writes to it.
    """

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> Any: ...

    def add_histogram(self, tag: str, values: np.ndarray, global_step: int) -> Any: ...

    def add_text(self, tag: str, text_string: str, global_step: int) -> Any: ...

    def flush(self) -> Any: ...

    def close(self) -> Any: ...


def write_values(writer: SummaryWriter, values: Mapping[str, Any], step: int) -> None:
    """Write host `values`: numeric scalars as scalars, numeric arrays as histograms,
    anything else as text. Non-finite array entries are left out of histograms
    (`np.histogram` rejects them); a non-finite scalar is written as is."""
    for tag, value in values.items():
        arr = np.asarray(value)
        if arr.dtype.kind in "biuf":
            if arr.ndim == 0:
                writer.add_scalar(tag, float(arr), step)
            else:
                finite = arr[np.isfinite(arr)]
                if finite.size:
                    writer.add_histogram(tag, finite.astype(np.float64), step)
        else:
            writer.add_text(tag, value if isinstance(value, str) else repr(value), step)
