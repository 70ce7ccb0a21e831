"""The contract every checkpoint backend keeps, run against each one in `FACTORIES`.

A backend package adds itself by adding a factory to `FACTORIES` (``directory ->
backend``) before collection, e.g. from its conftest::

    import importlib.util
    spec = importlib.util.spec_from_file_location("contract", ".../test_backend_contract.py")
    ...; contract.FACTORIES["mine"] = lambda d: MyBackend(d)

or by subclassing `ContractTests` with its own ``make`` fixture. Crash, fsync
and memory checks that need a subprocess live in test_backend_durability.py.
"""

from __future__ import annotations

import collections
import fcntl
import os
import zipfile
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import loopkit
from loopkit.state.pytree import check_matches, conform
from loopkit.plugins.checkpoint.backends.npz import NpzBackend
from loopkit.plugins.checkpoint.backends.orbax import OrbaxBackend


def _example_plugin_backend() -> type:
    """The backend of examples/plugin-package, loaded from its source file."""
    import importlib.util

    path = (Path(__file__).resolve().parents[2] / "examples" / "plugin-package"
            / "loopkit_example_plugin" / "backend.py")
    spec = importlib.util.spec_from_file_location("loopkit_example_plugin_backend", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CompressedNpzBackend


#: name -> factory(directory) for every backend the contract runs against
FACTORIES: dict[str, Callable[[Path], Any]] = {
    "orbax": lambda d: OrbaxBackend(d),
    "npz": lambda d: NpzBackend(d),
    "npz-compressed (example plugin)": lambda d: _example_plugin_backend()(d),
}

Point = collections.namedtuple("Point", "x y")


def flat(tree: Any) -> dict[str, Any]:
    """Leaf path -> leaf, None leaves included (as backends store them)."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    return {"/".join(loopkit.state.pytree.leaf_path((k,)) for k in kp): v for kp, v in pairs}


def assert_same_leaf(got: Any, want: Any, where: str) -> None:
    """Same kind of value, same dtype and shape, same bits."""
    if want is None or type(want) in (bool, int, float, str):
        assert type(got) is type(want), f"{where}: {type(got)} != {type(want)}"
        assert got == want or (got != got and want != want), f"{where}: {got!r} != {want!r}"
        return
    assert isinstance(got, (np.ndarray, np.generic, jax.Array)), f"{where}: got {type(got)}"
    assert isinstance(got, np.generic) == isinstance(want, np.generic), f"{where}: {type(got)}"
    assert isinstance(got, jax.Array) == isinstance(want, jax.Array), f"{where}: {type(got)}"
    g, w = np.asarray(got), np.asarray(want)
    assert g.dtype == w.dtype and g.shape == w.shape, f"{where}: {g.dtype}{g.shape} != {w.dtype}{w.shape}"
    assert g.tobytes() == w.tobytes(), f"{where}: values differ"


def assert_same_tree(got: Any, want: Any) -> None:
    assert jax.tree.structure(got, is_leaf=lambda x: x is None) == \
        jax.tree.structure(want, is_leaf=lambda x: x is None)
    g, w = flat(got), flat(want)
    for path in w:
        assert_same_leaf(g[path], w[path], path)


def awkward_state() -> dict:
    params = {"w": jnp.arange(6, dtype=jnp.bfloat16).reshape(3, 2), "b": jnp.zeros((2,))}
    return {
        "params": params,
        "opt": optax.adam(1e-3).init(params),  # tuple of namedtuples, EmptyState
        "list": [np.int8(-3), 2.5, None, 7, True, "tag"],
        "tuple": (np.zeros((0, 4), np.float32), np.array(3, np.uint32)),
        "point": Point(np.array([True, False]), jnp.asarray(1.5, jnp.float32)),
        "bf16": np.asarray([1.0, -2.0, 3.5], ml_dtypes.bfloat16),
        "scalar0d": np.array(7.25),
        "u32": np.arange(5, dtype=np.uint32) * 1000000,
        "empty_jax": jnp.zeros((3, 0), jnp.int32),
        "big_int": 2**40,
        "ints": {1: np.ones(2, np.int16), 2: None},
    }


class ContractTests:
    """The contract; ``make(directory) -> backend`` comes from the fixture below."""

    @pytest.fixture
    def backend(self, make, tmp_path):
        b = make(tmp_path / "ckpt")
        yield b
        b.close()

    # -- round trips --

    def test_awkward_pytree_round_trip(self, backend):
        state = awkward_state()
        backend.save(10, state, {"position": {"epoch": 2, "offset": [1, 2]}})
        backend.wait()
        restored, meta = backend.restore(10, state)
        assert meta == {"position": {"epoch": 2, "offset": [1, 2]}}
        assert_same_tree(restored, state)
        check_matches(restored, state)
        opt = restored["opt"]
        assert type(opt[0]).__name__ == "ScaleByAdamState" and isinstance(opt[1], optax.EmptyState)

    def test_abstract_like_places_on_device(self, backend):
        state = awkward_state()
        backend.save(1, state, {})
        backend.wait()
        restored, _ = backend.restore(1, loopkit.state.pytree.abstract(state))
        for path, leaf in flat(restored).items():
            want = flat(state)[path]
            if isinstance(want, (np.ndarray, jax.Array)) and not isinstance(want, np.generic):
                assert leaf.dtype == want.dtype and leaf.shape == want.shape, path
                # abstract leaves ask for jax arrays, unless jax would cast (float64, no x64)
                on_device = jax.dtypes.canonicalize_dtype(want.dtype) == want.dtype
                assert isinstance(leaf, jax.Array) == on_device, path

    def test_like_none_gives_nested_dicts_with_string_keys(self, backend):
        state = awkward_state()
        backend.save(3, state, {})
        backend.wait()
        restored, _ = backend.restore(3, None)
        assert restored["opt"]["0"]["mu"]["w"].dtype == ml_dtypes.bfloat16
        assert restored["point"]["x"].tolist() == [True, False]
        assert restored["list"]["1"] == 2.5 and restored["list"]["2"] is None
        assert restored["ints"]["1"].dtype == np.int16 and restored["ints"]["2"] is None
        for path, leaf in flat(restored).items():
            assert not isinstance(leaf, jax.Array), path  # nothing placed without a like
        # conform() rebuilds the caller's containers from the same leaf paths
        assert_same_tree(jax.tree.map(np.asarray, conform(restored, state)),
                         jax.tree.map(np.asarray, state))

    def test_single_array_state(self, backend):
        backend.save(1, jnp.arange(4.0), {})
        backend.wait()
        got, _ = backend.restore(1, None)
        np.testing.assert_array_equal(got, np.arange(4.0, dtype=np.float32))

    def test_sharding_of_like_is_kept(self, backend):
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
        state = {"w": jax.device_put(jnp.arange(8.0), sharding)}
        backend.save(1, state, {})
        backend.wait()
        like = {"w": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharding)}
        restored, _ = backend.restore(1, like)
        assert restored["w"].sharding == sharding
        np.testing.assert_array_equal(restored["w"], np.arange(8.0))

    def test_mismatching_like_returns_what_is_stored(self, backend):
        state = {"w": np.arange(3, dtype=np.float32), "b": jnp.ones((2,), jnp.bfloat16)}
        backend.save(4, state, {})
        backend.wait()
        like = {"w": jax.ShapeDtypeStruct((5,), jnp.float32),  # other shape
                "b": jax.ShapeDtypeStruct((2,), jnp.float32),  # other dtype: never cast
                "extra": jax.ShapeDtypeStruct((1,), jnp.int32)}  # not stored
        restored, _ = backend.restore(4, like)
        assert set(restored) == {"w", "b"}
        assert np.asarray(restored["w"]).shape == (3,)
        assert restored["b"].dtype == ml_dtypes.bfloat16
        with pytest.raises(ValueError, match="w"):
            check_matches(restored, like)
        restored, _ = backend.restore(4, [np.zeros(3)])  # another structure entirely
        assert set(restored) == {"w", "b"}

    # -- listing, deletion, replacement --

    def test_steps_listing_and_deletion(self, backend):
        for step in (30, 4, 200):
            backend.save(step, {"x": np.full(3, step, np.int32)}, {"s": step})
        backend.wait()
        assert backend.steps() == [4, 30, 200]
        assert backend.path(30).exists()
        assert backend.path(30).name.startswith("model.ckpt-30")
        backend.delete(30)
        assert backend.steps() == [4, 200] and not backend.path(30).exists()
        backend.delete(30)  # already gone: nothing happens
        restored, meta = backend.restore(200, None)
        assert meta == {"s": 200} and restored["x"].tolist() == [200] * 3

    def test_only_exact_names_are_listed(self, backend):
        backend.save(5, {"x": np.zeros(2)}, {})
        backend.wait()
        d = backend.path(5).parent
        suffix = backend.path(5).name[len("model.ckpt-5"):]
        as_dir = backend.path(5).is_dir()
        for name in ("model.ckpt-07", "model.ckpt-x", "other-6", "model.ckpt-8.tmp",
                     ".model.ckpt-9", "model.ckpt-10.orbax-checkpoint-tmp", "model.ckpt--1"):
            (d / (name + suffix)).mkdir() if as_dir else (d / (name + suffix)).touch()
        # the right name, the wrong kind of entry (a file for a directory, or back)
        (d / f"model.ckpt-11{suffix}").touch() if as_dir else (d / f"model.ckpt-11{suffix}").mkdir()
        assert backend.steps() == [5]

    def test_save_over_a_step_replaces_it(self, backend):
        backend.save(7, {"x": np.zeros(4)}, {"v": 1})
        backend.wait()
        backend.save(7, {"x": np.ones(4), "y": np.int32(2)}, {"v": 2})
        backend.wait()
        restored, meta = backend.restore(7, None)
        assert meta == {"v": 2} and restored["x"].tolist() == [1.0] * 4 and restored["y"] == 2
        assert backend.steps() == [7]
        assert sorted(os.listdir(backend.path(7).parent)) == [backend.path(7).name]

    def test_a_fresh_backend_sees_committed_steps(self, backend, make):
        backend.save(2, {"x": np.arange(3)}, {})
        backend.wait()
        other = make(backend.path(2).parent)
        try:
            assert other.steps() == [2]
            assert other.restore(2, None)[0]["x"].tolist() == [0, 1, 2]
        finally:
            other.close()

    def test_missing_step_raises_file_not_found(self, backend):
        with pytest.raises(FileNotFoundError, match="step 9"):
            backend.restore(9, None)

    def test_metadata_must_be_json(self, backend):
        with pytest.raises(TypeError, match="JSON"):
            backend.save(1, {"x": np.zeros(1)}, {"bad": object()})
        assert backend.steps() == []

    # -- partial reads --

    def test_structure_and_restore_leaves(self, backend):
        state = awkward_state()
        backend.save(6, state, {})
        backend.wait()
        struct = backend.structure(6)
        assert struct["params/w"] == jax.ShapeDtypeStruct((3, 2), jnp.bfloat16)
        assert struct["opt/0/count"] == jax.ShapeDtypeStruct((), jnp.int32)
        assert struct["tuple/0"] == jax.ShapeDtypeStruct((0, 4), jnp.float32)
        assert struct["list/1"] == jax.ShapeDtypeStruct((), jnp.float32)  # as jax sees 2.5
        assert "list/2" not in struct  # a None leaf has no shape
        got = backend.restore_leaves(6, ["params/w", "list/1", "ints/1"])
        assert set(got) == {"params/w", "list/1", "ints/1"}
        assert_same_leaf(np.asarray(got["params/w"]), np.asarray(state["params"]["w"]), "params/w")
        assert got["list/1"] == 2.5
        with pytest.raises(KeyError, match="nope"):
            backend.restore_leaves(6, ["nope"])


@pytest.fixture(params=sorted(FACTORIES))
def make(request):
    return FACTORIES[request.param]


class TestContract(ContractTests):
    pass


# -- property test ---------------------------------------------------------------------

_DTYPES = [np.float32, np.float64, np.int8, np.uint32, np.bool_, ml_dtypes.bfloat16, np.int64]


@st.composite
def _arrays(draw):
    dtype = np.dtype(draw(st.sampled_from(_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    raw = draw(st.binary(min_size=int(np.prod(shape)) * dtype.itemsize,
                         max_size=int(np.prod(shape)) * dtype.itemsize))
    if dtype == np.bool_:
        raw = bytes(b & 1 for b in raw)
    arr = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    kind = draw(st.sampled_from(["np", "jax", "scalar"]))
    if kind == "jax" and dtype not in (np.float64, np.int64):  # jax would canonicalise those
        return jnp.asarray(arr)
    if kind == "scalar" and arr.ndim == 0:
        return arr[()]
    return arr


_leaves = st.one_of(
    _arrays(), st.none(), st.booleans(), st.integers(-(2**62), 2**62),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5))
_keys = st.text(alphabet="abcxyz_09", min_size=1, max_size=4)
_trees = st.recursive(
    _leaves,
    lambda kids: st.one_of(
        st.dictionaries(_keys, kids, max_size=3),
        st.lists(kids, max_size=3),
        st.lists(kids, max_size=3).map(tuple),
        st.tuples(kids, kids).map(lambda t: Point(*t))),
    max_leaves=8)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_property_round_trip(name, tmp_path_factory):
    backend = FACTORIES[name](tmp_path_factory.mktemp(f"prop-{name}"))
    counter = iter(range(10**6))

    @settings(max_examples=25, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(tree=_trees)
    def check(tree):
        step = next(counter)
        backend.save(step, tree, {"step": step})
        backend.wait()
        restored, meta = backend.restore(step, tree)
        assert meta == {"step": step}
        assert_same_tree(restored, tree)
        backend.delete(step)

    try:
        check()
    finally:
        backend.close()


# -- backend-specific parts of the contract ----------------------------------------------


def test_orbax_save_is_asynchronous_and_reports_background_errors(tmp_path):
    """save() returns before the write; a failed write is re-raised by wait(), chained."""
    backend = OrbaxBackend(tmp_path)
    x = jnp.arange(1000.0)
    # A saver writes under a shared lock of the directory: holding it exclusively
    # keeps the write from starting, whatever the timing.
    fd = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        backend.save(1, {"x": x}, {})  # returns at once: nothing written yet
        assert backend.steps() == [] and not backend.path(1).exists()
        x.delete()  # what donating the buffer to the next step without protection does
    finally:
        os.close(fd)
    with pytest.raises(loopkit.CheckpointError, match="model.ckpt-1") as info:
        backend.wait()
    assert "deleted" in str(info.value.__cause__)
    backend.wait()  # reported once
    assert backend.steps() == []
    backend.save(2, {"x": jnp.ones(3)}, {})  # the backend still works
    backend.close()
    assert backend.steps() == [2]
    with pytest.raises(ValueError, match="'x'.*deleted"):
        OrbaxBackend(tmp_path).save(3, {"x": x}, {})  # already deleted: refused at once


def _rewrite_member(path: Path, member: str, data: bytes) -> None:
    """Replace one member of a zip file (keeping the others as they are)."""
    with zipfile.ZipFile(path) as zf:
        members = {i.filename: zf.read(i.filename) for i in zf.infolist()}
    members[member] = data
    with zipfile.ZipFile(path, "w") as zf:
        for name, blob in members.items():
            zf.writestr(name, blob)


class _Payload:
    """Unpickling this creates the file ``marker``: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("member", ["0.npy", "__loopkit__.npy"])
def test_npz_tampered_with_an_object_array_never_runs_code(tmp_path, member):
    backend = NpzBackend(tmp_path / "ckpt")
    backend.save(1, {"w": np.zeros(3, np.float32)}, {})
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.npy"
    np.save(evil, np.array([_Payload(marker)], dtype=object), allow_pickle=True)
    # the payload is live: loading it with pickling allowed runs it
    np.load(evil, allow_pickle=True)
    assert marker.exists()
    marker.unlink()

    _rewrite_member(backend.path(1), member, evil.read_bytes())
    with pytest.raises(loopkit.CheckpointError, match="model.ckpt-1.npz"):
        backend.restore(1, None)
    with pytest.raises(loopkit.CheckpointError):
        backend.restore_leaves(1, ["w"])
    assert not marker.exists()


def test_npz_restore_leaves_reads_only_the_members_asked_for(tmp_path):
    """Unchosen members are corrupted: reading them would fail their CRC check."""
    backend = NpzBackend(tmp_path)
    state = {"big": np.arange(100_000, dtype=np.float32), "small": np.arange(3, dtype=np.int8),
             "other": np.ones((10, 10))}
    backend.save(1, state, {})
    path = backend.path(1)
    blob = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        head = zf.read("__loopkit__.npy")
        members = {i.filename: i for i in zf.infolist()}
    small = next(f"{r['member']}.npy" for r in _records(head) if r["path"] == ["small"])
    for name, info in members.items():
        if name not in (small, "__loopkit__.npy"):
            magic = blob.index(b"\x93NUMPY", info.header_offset)
            width = 2 if blob[magic + 6] == 1 else 4  # header length field, by npy version
            header = int.from_bytes(blob[magic + 8:magic + 8 + width], "little")
            data = magic + 8 + width + header
            blob[data:data + 8] = b"garbage!"
    path.write_bytes(bytes(blob))

    assert set(backend.structure(1)) == {"big", "small", "other"}
    np.testing.assert_array_equal(backend.restore_leaves(1, ["small"])["small"], state["small"])
    with pytest.raises(loopkit.CheckpointError, match="big"):
        backend.restore_leaves(1, ["big"])
    with pytest.raises(loopkit.CheckpointError):
        backend.restore(1, None)


def _records(head_npy: bytes) -> list[dict]:
    import io
    import json
    arr = np.load(io.BytesIO(head_npy), allow_pickle=False)
    return json.loads(arr.tobytes())["leaves"]


def test_npz_never_pickles_on_save(tmp_path):
    backend = NpzBackend(tmp_path)
    with pytest.raises(TypeError, match="'obj'"):
        backend.save(1, {"obj": np.array([object()], dtype=object)}, {})
    assert backend.steps() == [] and os.listdir(tmp_path) == []


@pytest.mark.parametrize("bad", [
    {"path": ["w"], "kind": "jax", "dtype": "object", "shape": [3]},
    {"path": ["w"], "kind": "jax", "dtype": "<f4", "shape": [-3]},
    {"path": ["w"], "kind": "key", "dtype": "<u4", "shape": [2]},  # no impl
    {"path": ["w"], "kind": "py", "value": [1, 2]},
    {"path": "w", "kind": "none"},
])
def test_npz_malformed_leaf_record_is_a_corrupt_checkpoint(tmp_path, bad):
    import io
    import json

    backend = NpzBackend(tmp_path)
    backend.save(1, {"w": np.zeros(3, np.float32)}, {})
    with zipfile.ZipFile(backend.path(1)) as zf:
        head = json.loads(np.load(io.BytesIO(zf.read("__loopkit__.npy"))).tobytes())
    head["leaves"] = [bad]
    buf = io.BytesIO()
    np.save(buf, np.frombuffer(json.dumps(head).encode(), np.uint8))
    _rewrite_member(backend.path(1), "__loopkit__.npy", buf.getvalue())
    with pytest.raises(loopkit.CheckpointError, match="model.ckpt-1.npz.*malformed leaf index"):
        backend.restore(1, None)
