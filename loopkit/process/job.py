"""The job around a process: JAX's coordination service (``jax.distributed``).

JAX 0.10 has no public accessor for its coordination client (the key-value store
the job's processes share) nor for the coordinator's address; orbax's multihost
module and `jax.experimental` read them from ``jax._src.distributed`` as here. This
module is the one place loopkit does (its tests allow this file alone), so a JAX
release that adds a public accessor changes one function.
"""

from __future__ import annotations

from typing import Any

__all__ = ["coordinator_address", "kv_client"]


def kv_client() -> Any:
    """The job's key-value store client (``key_value_set``, ``blocking_key_value_get``,
    ...), or None outside ``jax.distributed``."""
    from jax._src import distributed

    return distributed.global_state.client


def coordinator_address() -> str | None:
    """``host:port`` of the job's coordinator, or None outside ``jax.distributed``."""
    from jax._src import distributed

    address = distributed.global_state.coordinator_address
    return None if address is None else str(address)
