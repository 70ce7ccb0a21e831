"""Where the compiled step's arrays live: pinned output shardings, and dispatch on a CPU mesh."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

__all__ = ["on_cpu_devices", "one_in_flight", "pins"]


def on_cpu_devices(leaves: Sequence[Any]) -> bool:
    """Whether the state spans several CPU devices (a forced host device count).

    There XLA:CPU runs each device's part of a step on one shared thread pool, and
    two steps in flight can deadlock a collective: each holds a pool thread at an
    all-reduce whose partner cannot be scheduled, and after 40 s the process aborts
    (measured: a 2x2 FSDP step on a 2-core machine, 4 runs of 4 with a plain jax
    loop too; none when each step is awaited). So there each step is awaited
    before the next is dispatched; on GPUs and TPUs dispatch stays asynchronous.
    """
    devices = {d for x in leaves if isinstance(x, jax.Array) for d in x.sharding.device_set}
    return len(devices) > 1 and all(d.platform == "cpu" for d in devices)


def one_in_flight(step: Callable[..., Any]) -> Callable[..., Any]:
    """`step`, returning once its outputs are computed (see `on_cpu_devices`)."""

    def call(*args: Any) -> Any:
        return jax.block_until_ready(step(*args))

    return call


def pins(leaves: Sequence[Any]) -> tuple[Any, ...] | None:
    """Each rewritten leaf's output sharding: its own, on a state spread over devices.

    A state on one device keeps no pins (there is nothing to re-lay out). Leaves
    that are not committed jax arrays (Python scalars, numpy, uncommitted arrays)
    are replicated over the mesh of the others.
    """
    spread = [x.sharding for x in leaves
              if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1]
    if not spread:
        return None
    mesh = next((s.mesh for s in spread if isinstance(s, jax.sharding.NamedSharding)), None)
    replicated = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
                  if mesh is not None else spread[0])
    out = []
    for x in leaves:
        if isinstance(x, jax.Array) and (x.committed or len(x.sharding.device_set) > 1):
            out.append(x.sharding)
        else:
            out.append(replicated)
    return tuple(out)
