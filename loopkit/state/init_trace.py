"""`init`'s abstract state for a restore: traced, not run; where each leaf goes.

A restore needs `init`'s structure, shapes, dtypes and shardings, not its values:
`trace_init` traces `init` and takes each leaf's sharding from what `init` asked for
(`device_put`, `out_shardings`), else from the trace's explicit-axis types, else from
XLA (the compiled `init`, only when a restore needs it). Leaves whose sharding is
XLA's choice are `Guessed`: a restore may place them as the run that saved them had
them (plugins/checkpoint/backends/placement.py).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import jax

from loopkit.state.pytree import PyTree, _short, abstract

__all__ = ["Guessed", "trace_init"]

log = logging.getLogger("loopkit")


def _needs_shardings(like: PyTree) -> bool:
    """Whether lowering must tell where the leaves live (several devices, or a mesh).

    Under `jax.set_mesh` even a one-device state is committed to the mesh
    (`NamedSharding`): a restore must place it so, or the step compiles again.
    """
    if jax.device_count() > 1 or not jax.sharding.get_abstract_mesh().empty:
        return True
    return any(getattr(getattr(x, "sharding", None), "mesh", None) is not None
               for x in jax.tree.leaves(like))


def _device_put_shardings(jaxpr: Any) -> list[Any]:
    """For each output of ``jaxpr``, the sharding a top-level ``device_put`` gave it, or None."""
    made: dict[Any, Any] = {}
    for eqn in jaxpr.eqns:
        # a device_put, or a nested jit with out_shardings (`jax.jit(f, out_shardings=s)()`)
        param = {"device_put": "devices", "jit": "out_shardings",
                 "pjit": "out_shardings"}.get(eqn.primitive.name)
        if param is not None:
            for var, where in zip(eqn.outvars, eqn.params.get(param, ())):
                if isinstance(where, jax.Device):  # `jax.device_put(x, device)`
                    where = jax.sharding.SingleDeviceSharding(where)
                if isinstance(where, jax.sharding.Sharding):
                    made[var] = where
    return [None if type(v).__name__ == "Literal" else made.get(v) for v in jaxpr.outvars]


class Guessed(jax.ShapeDtypeStruct):
    """A leaf of `init`'s abstract state whose sharding XLA chose, not `init` itself.

    `init` did not place the leaf (no `jax.device_put`, no `out_shardings`) on a
    mesh or several devices, so its sharding is the one XLA gives `jax.jit(init)`'s
    output, which `init` run for real may not give: on auto axes optax's state,
    made beside parameters `init` placed, follows them, while XLA replicates it
    (on explicit axes too, when the parameters came from a nested `jax.jit` with
    ``out_shardings``), and a layout may be spelled otherwise (``P("d", None)``
    for ``P("d")``), which is another program. A restore may place such a leaf
    as the run that saved it had it.

    Where `init`'s own leaves name one mesh, XLA's choice is compiled only when a
    restore asks for it (`xla_sharding`; ``sharding`` is then None): a restore that
    follows the saved layouts compiles nothing.
    """

    #: where XLA's choice is compiled later: the `_Deferred` of the trace, and this leaf's
    #: index among its outputs (None, 0 where ``sharding`` is already XLA's choice)
    __slots__ = ("deferred", "index")

    @property
    def mesh(self) -> Any:
        """The mesh the leaf lives on (its sharding's, or that of `init`'s own leaves)."""
        deferred = getattr(self, "deferred", None)
        return deferred.mesh if deferred is not None else getattr(self.sharding, "mesh", None)

    def xla_sharding(self) -> Any:
        """The sharding XLA gives the leaf in the compiled `init` (compiled now, once, if
        the trace deferred it)."""
        deferred = getattr(self, "deferred", None)
        return self.sharding if deferred is None else deferred.sharding(self.index)


class _Deferred:
    """The output shardings of a lowered `init`, compiled on first need, once.

    Lowered at once: what fails to lower (`jax.set_mesh` inside `init`) still sends
    `trace_init` to calling `init`, before any restore. A compile that fails later
    must not read as a corrupt checkpoint (a restore's error means one): the leaves
    are then replicated on the mesh, which fits any of them, with a warning.
    """

    def __init__(self, lowered: Any, mesh: jax.sharding.Mesh) -> None:
        self.mesh = mesh
        self._lowered: Any = lowered
        self._shardings: list[Any] | None = None  # None after a failed compile
        self._lock = threading.Lock()  # a restore may place leaves from several threads

    def sharding(self, index: int) -> Any:
        with self._lock:
            if self._lowered is not None:
                lowered, self._lowered = self._lowered, None  # tried once, whatever happens
                try:
                    self._shardings = jax.tree.leaves(lowered.compile().output_shardings)
                except Exception as ex:  # noqa: BLE001 - a placement, not the checkpoint's fault
                    log.warning("loopkit: compiling init to learn where XLA puts the leaves "
                                "init does not place failed (%s: %s); they are restored "
                                "replicated on the mesh", type(ex).__name__,
                                _short(str(ex), 200))
        if self._shardings is None:
            return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return self._shardings[index]


def _guessed(x: jax.ShapeDtypeStruct, sharding: Any,
             deferred: _Deferred | None = None, index: int = 0) -> Guessed:
    """``x`` with the ``sharding`` XLA chose (or will, `deferred`), marked as XLA's choice."""
    g = Guessed(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type,
                manual_axis_type=x.manual_axis_type, is_ref=x.is_ref)
    g.deferred, g.index = deferred, index
    return g


def _one_mesh(placed: list[Any], mesh: Any) -> jax.sharding.Mesh | None:
    """The one concrete mesh of `init`'s placed leaves and the context, or None."""
    meshes = {s.mesh for s in placed if isinstance(s, jax.sharding.NamedSharding)}
    if mesh is not None:
        meshes.add(mesh)
    found = meshes.pop() if len(meshes) == 1 else None
    return found if isinstance(found, jax.sharding.Mesh) else None


def _one_device(placed: list[Any], jaxpr: Any) -> Any:
    """The one device `init` named in `jax.device_put(x, device)` (a device, not a
    sharding) for all the leaves it placed, as a sharding; else None."""
    named = {d for eqn in jaxpr.eqns if eqn.primitive.name == "device_put"
             for d in eqn.params.get("devices", ()) if isinstance(d, jax.Device)}
    places = {p for p in placed if p is not None}
    if len(named) != 1 or len(places) != 1:
        return None
    (device,) = named
    return places.pop() if places == {jax.sharding.SingleDeviceSharding(device)} else None


def _typed(x: jax.ShapeDtypeStruct, aval: Any, mesh: Any) -> Any:
    """The sharding an explicit-axis trace gives ``x`` on the context ``mesh``, or None.

    On explicit axes the trace's types are what compiling would give: a leaf's
    type names its spec on the abstract mesh (a constant has none: it is
    replicated). Auto axes leave placement to XLA (None), except on a mesh of
    one device, which has one placement (XLA may spell it otherwise; a restore
    follows the saved spelling, `Guessed`). A leaf in another memory than the
    device's (`jax.memory.Space.Host`) is left to the compile, which names it.
    """
    if mesh is None or getattr(aval, "memory_space", None) != jax.memory.Space.Device:
        return None
    s = getattr(x, "sharding", None)
    if isinstance(s, jax.sharding.NamedSharding) and s.mesh == mesh.abstract_mesh:
        return jax.sharding.NamedSharding(mesh, s.spec)
    explicit = all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    if s is None and (explicit or mesh.size == 1):
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return None


def trace_init(init: Callable[[], PyTree]) -> tuple[PyTree, PyTree | None]:
    """(abstract state, built state or None) of a zero-argument `init`, running it only if needed.

    `init` is traced once (`jax.jit(init).trace()`): shapes, dtypes, weak types
    and key types. Where shardings matter, each leaf takes the sharding `init`
    gave it itself (`jax.device_put`, a nested jit's `out_shardings`), else the
    one its explicit-axis type names under `jax.set_mesh`, else the one XLA gives
    the compiled `init` (lowered and compiled, nothing run, when some leaf needs
    it; where `init`'s leaves name one mesh, compiled only once a restore asks for
    XLA's choice); those not placed by `init` are `Guessed`. If tracing or lowering
    fails for any reason (numpy on a traced value, `jax.set_mesh` inside, an
    unstorable leaf), `init` is called once for real and that state is returned
    as built.
    """
    try:
        traced = jax.jit(init).trace()
        like = traced.out_info
        if _needs_shardings(like):
            leaves, treedef = jax.tree.flatten(like)
            placed = _device_put_shardings(traced.jaxpr.jaxpr)
            mesh = jax.sharding.get_mesh()
            mesh = None if mesh.empty else mesh
            known = [_typed(x, a, mesh) for x, a in zip(leaves, traced.jaxpr.out_avals)]
            unknown = [p is None and k is None for p, k in zip(placed, known)]
            deferred = None
            device = _one_device(placed, traced.jaxpr.jaxpr) if mesh is None else None
            if any(unknown) and device is not None:
                # init put its leaves on one device (`jax.device_put(x, device)`), which
                # under jit is no constraint; run for real, the step's jit joins the
                # others to it: so does the restore
                known = [k if k is not None else device for k in known]
            elif any(unknown):  # XLA's choice: compiled when a restore needs it, or now
                one = _one_mesh(placed, mesh)
                if one is not None and all(
                        getattr(a, "memory_space", None) == jax.memory.Space.Device
                        for a, u in zip(traced.jaxpr.out_avals, unknown) if u):
                    deferred = _Deferred(traced.lower(), one)
                else:
                    compiled = jax.tree.leaves(traced.lower().compile().output_shardings)
                    known = [k if k is not None else c for k, c in zip(known, compiled)]
            # what init asked for with device_put wins over the types and XLA's choice
            # (on auto axes, a device_put inside jit is no constraint)
            like = jax.tree.unflatten(treedef, [
                x.update(sharding=p) if p is not None
                else _guessed(x, k) if k is not None
                else _guessed(x, None, deferred, i) if deferred is not None else x
                for i, (x, p, k) in enumerate(zip(leaves, placed, known))])
        return like, None
    except Exception as ex:  # noqa: BLE001 - any failure: build it once, for real
        log.info("loopkit: init could not be traced (%s: %s); calling it",
                 type(ex).__name__, _short(str(ex), 200))
    built = init()
    return abstract(built), built
