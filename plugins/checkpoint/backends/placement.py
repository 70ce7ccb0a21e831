"""Placing restored leaves like a ``like`` tree: which become jax arrays, with which sharding.

Shared by the built-in backends and the readers of others' formats. A restored leaf
becomes a jax array only where ``like`` has an array of its shape there (never cast),
and every array is placed in one batch (`put_all`): a `jax.device_put` per leaf costs
tens of µs of Python, which thousands of leaves add up.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Iterable, Sequence

import jax
import numpy as np

from loopkit.state.init_trace import Guessed
from loopkit.state.pytree import is_key, leaves_with_paths

log = logging.getLogger("loopkit")


def like_leaves(like: Any) -> dict[str, Any]:
    """``like``'s leaves by leaf path (empty for None)."""
    return dict(leaves_with_paths(like))


def placement(like_leaf: Any, shape: tuple[int, ...], dtype: np.dtype,
              layout: Any = None) -> tuple[bool, Any]:
    """(as a jax array?, sharding or None) for a stored leaf next to ``like_leaf``.

    A leaf becomes a jax array when ``like`` has a jax array or abstract leaf of
    the same shape there, and jax can hold its dtype as is (not float64 without
    x64: never cast); it takes that leaf's sharding (None: the default device),
    or, where that sharding is XLA's guess (`Guessed`), the stored ``layout``
    (`layout_of`) when it fits. Anything else comes back as stored, on the host.
    A typed key in ``like`` places its stored key data (the key's shape and
    trailing implementation dims).
    """
    if (isinstance(like_leaf, (jax.Array, jax.ShapeDtypeStruct)) and is_key(like_leaf.dtype)
            and tuple(like_leaf.shape) == tuple(shape)[:len(like_leaf.shape)]
            and np.dtype(dtype) == np.uint32):
        return True, _sharding(like_leaf, layout)
    if (isinstance(like_leaf, (jax.Array, jax.ShapeDtypeStruct))
            and not is_key(like_leaf.dtype)
            and tuple(like_leaf.shape) == tuple(shape)
            and jax.dtypes.canonicalize_dtype(dtype) == dtype):
        return True, _sharding(like_leaf, layout)
    return False, None


# -- layouts: how a leaf was placed when saved --------------------------------------

_LAYOUTS: dict[Any, Any] = {}  # sharding -> its layout: few shardings, thousands of leaves


def layout_of(x: jax.Array) -> Any:
    """How ``x`` is placed, as JSON, or None when it cannot be said portably.

    ``"default"`` for an array left on the default device (not committed);
    ``{"mesh": [[axis, size], ...], "spec": [...]}`` for a `NamedSharding`
    (the spec's entries: None, an axis name, or a list of names).
    """
    if not x.committed:
        return "default"
    return _named_layout(x.sharding)


def _named_layout(s: Any) -> Any:
    """A `NamedSharding`'s layout (`layout_of`), or None for any other sharding."""
    if not isinstance(s, jax.sharding.NamedSharding):
        return None
    try:
        return _LAYOUTS[s]
    except KeyError:
        pass
    spec: list[Any] = []
    for entry in s.spec:
        if entry is None or isinstance(entry, str):
            spec.append(entry)
        elif isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
            spec.append(list(entry))
        else:
            return None  # P.UNCONSTRAINED and the like: not a layout
    if getattr(s.spec, "unreduced", None) or getattr(s.spec, "reduced", None):
        return None
    out = {"mesh": _mesh_axes(s.mesh), "spec": spec}
    if len(_LAYOUTS) < 1024:
        _LAYOUTS[s] = out
    return out


def _mesh_axes(mesh: Any) -> list[list[Any]]:
    """A mesh as a layout names it: ``[[axis, size], ...]``."""
    return [[str(n), int(k)] for n, k in zip(mesh.axis_names, mesh.axis_sizes)]


def _trimmed(spec: list[Any]) -> list[Any]:
    """``spec`` without its trailing Nones (``P("d", None)`` places as ``P("d")``)."""
    spec = list(spec)
    while spec and spec[-1] is None:
        spec.pop()
    return spec


def _same_layout(a: Any, b: Any) -> bool:
    """Whether two layouts place alike (``P("d")`` is ``P("d", None)``; on a mesh of one
    device every spec is the one placement)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a["mesh"] != b["mesh"]:
            return False
        one_device = math.prod(k for _, k in a["mesh"]) == 1
        return one_device or _trimmed(a["spec"]) == _trimmed(b["spec"])
    return a == b


def layouts_hold(like: dict[str, Any], records: Sequence[Any], where: str) -> bool:
    """Whether the saved layouts describe this run: `init` places the leaves it places
    itself as the run that saved ``where`` had them.

    When it places one otherwise (a parameter resharded between runs), the leaves
    that follow it (optax's state) must follow it anew: the `Guessed` leaves then
    get XLA's choice, not their saved layouts.
    """
    for rec in records:
        leaf = like.get(rec.name)
        if (rec.layout is None or isinstance(leaf, Guessed)
                or not isinstance(getattr(leaf, "sharding", None), jax.sharding.NamedSharding)):
            continue
        if not _same_layout(_named_layout(leaf.sharding), rec.layout):
            if any(isinstance(x, Guessed) for x in like.values()):
                log.info("loopkit: init places %r otherwise than the run that saved %s; "
                         "the leaves init does not place take XLA's placement, not the "
                         "saved one", rec.name, where)
            return False
    return True


def valid_layout(obj: Any) -> bool:
    """Whether ``obj`` (read from a file: data, not trusted) is a layout `layout_of` writes."""
    if obj == "default":
        return True
    return (isinstance(obj, dict) and isinstance(obj.get("mesh"), list)
            and all(isinstance(a, list) and len(a) == 2 and isinstance(a[0], str)
                    and type(a[1]) is int for a in obj["mesh"])
            and isinstance(obj.get("spec"), list)
            and all(e is None or isinstance(e, str)
                    or (isinstance(e, list) and all(isinstance(a, str) for a in e))
                    for e in obj["spec"]))


def _sharding(like_leaf: Any, layout: Any) -> Any:
    """``like_leaf``'s sharding, or the saved ``layout`` where that is only XLA's guess.

    `init` left the leaf's placement to XLA (`Guessed`: `init` run for real may
    place it otherwise, as optax's state beside parameters it placed); the run that
    saved it had it as ``layout``, which is taken when its mesh has the guess's
    axes and sizes, and "the default device" with one process and no mesh set (a
    host-local replica with several is the replicas' business). The caller passes
    no layout when they no longer hold (`layouts_hold`).
    """
    if not isinstance(like_leaf, Guessed):
        if isinstance(like_leaf, jax.Array) and not like_leaf.committed:
            # left on the default device, as the fresh state was: committing it would
            # give the step another signature than the fresh run's (a cache miss)
            return None
        return getattr(like_leaf, "sharding", None)
    if layout is None:
        return like_leaf.xla_sharding()
    if layout == "default":  # not under a mesh, where jax commits every new array to it
        single = jax.process_count() == 1 and jax.sharding.get_abstract_mesh().empty
        return None if single else like_leaf.xla_sharding()
    mesh = like_leaf.mesh
    if not isinstance(mesh, jax.sharding.Mesh) or _mesh_axes(mesh) != layout["mesh"]:
        return like_leaf.xla_sharding()
    spec = [tuple(e) if isinstance(e, list) else e for e in layout["spec"]]
    # device memory: a leaf in another is never deferred, and its sharding names it
    kind = getattr(like_leaf.sharding, "memory_kind", None)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec), memory_kind=kind)


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary.

    jax's CPU backend places such an array without copying it (numpy's own start
    16 bytes into a page): a restore then touches its memory once, not twice.
    """
    size = math.prod(shape) * dtype.itemsize
    buf = np.empty(size + 64, np.uint8)
    start = -buf.__array_interface__["data"][0] % 64
    return np.ndarray(shape, dtype, buf, start)


_REGIONS: dict[Any, tuple[list[tuple[slice, ...]], list[tuple[Any, int]]]] = {}


def _regions(sharding: Any, shape: tuple[int, ...]
             ) -> tuple[list[tuple[slice, ...]], list[tuple[Any, int]]]:
    """The distinct regions this process's devices hold of an array of ``shape`` placed by
    ``sharding``, and (device, its region's position) for each of those devices."""
    key = (sharding, shape)
    if key in _REGIONS:
        return _REGIONS[key]
    regions: list[tuple[slice, ...]] = []
    seen: dict[tuple, int] = {}
    devices = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        if bounds not in seen:
            seen[bounds] = len(regions)
            regions.append(tuple(slice(a, b) for a, b in bounds))
        devices.append((device, seen[bounds]))
    if len(_REGIONS) < 4096:
        _REGIONS[key] = regions, devices
    return regions, devices


@functools.cache
def _on(device: Any) -> Any:
    """A sharding placing on ``device`` alone (jax places a list of them faster than a list
    of devices)."""
    return jax.sharding.SingleDeviceSharding(device)


def addressable_regions(sharding: Any, shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """The distinct regions of an array of ``shape`` placed by ``sharding`` that this
    process's devices hold (a restore reads those alone)."""
    return _regions(sharding, tuple(shape))[0]


def put_regions(items: Sequence[tuple[tuple[int, ...], Any, list[np.ndarray]]]
                ) -> list[jax.Array]:
    """Each ``(shape, sharding, parts)`` as a jax array: ``parts`` the values of its
    `addressable_regions`, in their order, each placed on the devices holding it.

    Every part goes to its device in one `jax.device_put` for all (a call per leaf
    costs tens of µs); a part held by several devices is copied for each after the
    first (on CPU a placed array may share the part's memory, and the devices' buffers
    must not be one).
    """
    buffers, devices, counts = [], [], []
    for shape, sharding, parts in items:
        used = set()
        _, where = _regions(sharding, tuple(shape))
        for device, k in where:
            buffers.append(parts[k] if k not in used else parts[k].copy())
            devices.append(_on(device))
            used.add(k)
        counts.append(len(where))
    placed = iter(jax.device_put(buffers, devices)) if buffers else iter(())
    return [jax.make_array_from_single_device_arrays(
                tuple(shape), sharding, [next(placed) for _ in range(n)])
            for (shape, sharding, _), n in zip(items, counts)]


def put_like(values: list[Any], likes: Iterable[tuple[int, Any, Any]]) -> None:
    """Place each ``values[i]`` named in ``likes`` (``(i, like's leaf, saved layout)``) as
    `placement` says, all in one batch (`put_into`); the others stay as they are."""
    at, shardings = [], []
    for i, like_leaf, layout in likes:
        value = values[i]
        as_jax, sharding = placement(like_leaf, np.shape(value), np.asarray(value).dtype, layout)
        if as_jax:
            at.append(i)
            shardings.append(sharding)
    put_into(values, at, shardings)


def put_into(values: list[Any], at: Sequence[int], shardings: Sequence[Any]) -> None:
    """Replace ``values[i]``, for each ``i`` in ``at``, by it placed with its sharding (one batch)."""
    for i, x in zip(at, put_all([np.asarray(values[i]) for i in at], shardings)):
        values[i] = x


def put_all(arrays: Sequence[np.ndarray], shardings: Sequence[Any]) -> list[jax.Array]:
    """Each array as a jax array with its sharding (None: the default device).

    Batched: one `jax.device_put` for all that this process holds whole (a call
    per leaf costs tens of µs of Python, which thousands of leaves add up).
    """
    out: list[Any] = [None] * len(arrays)
    default = [i for i, s in enumerate(shardings) if s is None]
    given = [i for i, s in enumerate(shardings) if s is not None and s.is_fully_addressable]
    if default:
        for i, x in zip(default, jax.device_put([arrays[i] for i in default])):
            out[i] = x
    if given:
        for i, x in zip(given, jax.device_put([arrays[i] for i in given],
                                              [shardings[i] for i in given])):
            out[i] = x
    for i, s in enumerate(shardings):
        if out[i] is None:
            arr = arrays[i]
            out[i] = jax.make_array_from_callback(arr.shape, s, lambda index, a=arr: a[index])
    return out
