"""The compiled step's body and where its arrays live: pinned output shardings, and
dispatch on a CPU mesh."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

import jax

from loopkit.loop.carry import update_all
from loopkit.state.pytree import sharding_of

if TYPE_CHECKING:
    from loopkit.state.staging import Spare
    from loopkit.loop.carry import StepCarry
    from loopkit.loop.step_checks import RecompileWatch

__all__ = ["Layout", "Program", "on_cpu_devices", "one_in_flight", "pins", "sorted_leaves",
           "step_body"]


class Layout(NamedTuple):
    """How the traced step treats the state's leaves, and where the rewritten ones live."""

    treedef: Any
    rewritten: tuple[int, ...]   # leaf indices the step rewrites (donated)
    frozen: tuple[int, ...]      # leaf indices it returns unchanged (never donated)
    pins: tuple[Any, ...] | None  # per rewritten leaf: its pinned sharding (None: none)


class Program(NamedTuple):
    """What the first call builds, once per session: the step in its calling conventions.

    `donating` is the variant the loop calls (donating `live` where allowed; with the
    frozen leaves bound in front when `bound`); `plain` is the same function donating
    nothing (for the first call of a session off CPU); `spare` is the CPU variant that
    writes into a save's given-back buffers (None where there is none).
    """

    layout: Layout | None     # None: not traced by loopkit (a step the user jitted, jit off)
    donating: Any              # the jitted inner, donating `live` where allowed
    plain: Any                 # its non-donating variant (`donating` itself if none donate)
    spare: Spare | None
    bound: bool                # the jitted function takes the frozen leaves first
    wait_each: bool            # XLA:CPU over several devices: one step in flight at a time
    firsts: tuple              # the carries' first values
    batch_avals: tuple         # the first batch's avals (for the spare's compile ahead)
    unchecked: Any             # the input state's avals when the first output is still unchecked


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

    A state on one device keeps no pins (there is nothing to re-lay out), unless a
    mesh is set (`jax.set_mesh`): there jit returns arrays on the mesh, so a state
    made outside it would change signature after the first step and compile twice;
    its leaves are placed on the mesh from the start. Leaves that are not committed
    jax arrays (Python scalars, numpy, uncommitted arrays) are replicated over the
    mesh of the others.
    """
    spread = [x.sharding for x in leaves
              if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1]
    mesh = next((s.mesh for s in spread if isinstance(s, jax.sharding.NamedSharding)), None)
    if not spread:
        mesh = _mesh_set(leaves)
        if mesh is None:
            return None
    replicated = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
                  if mesh is not None else spread[0])
    out = []
    for x in leaves:
        if isinstance(x, jax.Array) and (x.committed or len(x.sharding.device_set) > 1):
            out.append(sharding_of(x))  # a typed key's, cut to the key's own rank
        else:
            out.append(replicated)
    return tuple(out)


def _mesh_set(leaves: Sequence[Any]) -> Any:
    """The concrete mesh the user set, when it holds every device of the state, else None."""
    mesh = jax.sharding.get_mesh()
    if mesh.empty:
        return None
    devices = set(mesh.devices.flat)
    if any(isinstance(x, jax.Array) and not x.sharding.device_set <= devices for x in leaves):
        return None
    return mesh


def step_body(fn: Callable[..., Any], carries: tuple[StepCarry, ...], treedef: Any,
              rewritten: tuple[int, ...], frozen: tuple[int, ...], watch: RecompileWatch,
              drop: bool) -> Callable[..., Any]:
    """``inner(frozen, live, *batch) -> (live, metrics)``, the function loopkit jits.

    With a `treedef` (the step traced by loopkit), `live` holds the `rewritten`
    leaves and `frozen` the others, which it never returns; without one, `live` is
    the whole state. With `carries`, `live` is paired with their values, each
    updated after the step; `drop`: the metrics live in a carry, none leave the step.
    """
    if treedef is None:
        def inner(frozen_leaves: tuple, live: Any, *batch: Any) -> Any:
            watch.traced(batch)  # runs when jax traces (compiles), not per step
            if not carries:
                return fn(live, *batch)
            state, values = live
            new, metrics = fn(state, *batch)
            return (new, update_all(carries, values, new, metrics)), ({} if drop else metrics)

        return inner
    size = treedef.num_leaves

    def inner(frozen_leaves: tuple, live: Any, *batch: Any) -> Any:  # type: ignore[no-redef]
        watch.traced(batch)  # runs when jax traces (compiles), not per step
        part, values = live if carries else (live, ())
        leaves: list[Any] = [None] * size
        for i, x in zip(rewritten, part):
            leaves[i] = x
        for i, x in zip(frozen, frozen_leaves):
            leaves[i] = x
        new, metrics = fn(treedef.unflatten(leaves), *batch)
        out = treedef.flatten_up_to(new)
        part = tuple(out[i] for i in rewritten)
        if not carries:
            return part, metrics
        return (part, update_all(carries, values, new, metrics)), ({} if drop else metrics)

    return inner


def sorted_leaves(state: Any, jaxpr: Any) -> Layout:
    """The state's leaves sorted by what the traced step does with them: those it
    returns unchanged (the same traced value) are frozen, the others rewritten."""
    leaves, treedef = jax.tree.flatten(state)  # the same structure as the output
    n = len(leaves)
    frozen = tuple(i for i in range(n) if jaxpr.outvars[i] is jaxpr.invars[i])
    rewritten = tuple(i for i in range(n) if i not in set(frozen))
    return Layout(treedef, rewritten, frozen, pins([leaves[i] for i in rewritten]))
