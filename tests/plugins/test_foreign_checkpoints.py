"""No lock-in: loopkit reads what orbax and safetensors wrote, and orbax reads loopkit's."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import loopkit


def make_state():
    params = {"enc": {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)},
              "layers": [jnp.full(2, 2.0), jnp.full(3, 3.0)]}
    return {"params": params, "step": jnp.asarray(7, jnp.int32)}


def test_load_checkpoint_reads_orbax_standard_and_pytree_saves_under_any_name(tmp_path):
    state = make_state()
    std = tmp_path / "exported"
    with ocp.StandardCheckpointer() as ck:
        ck.save(std, state)
    renamed = tmp_path / "logdir" / "model.ckpt-7"  # the same save, named like loopkit's
    renamed.parent.mkdir()
    with ocp.PyTreeCheckpointer() as ck:
        ck.save(renamed, state)
    for path in (std, renamed, renamed.parent):
        got = loopkit.load_checkpoint(path)  # without like: nested dicts
        np.testing.assert_array_equal(got["params"]["layers"]["1"], state["params"]["layers"][1])
        np.testing.assert_array_equal(got["params"]["enc"]["w"], state["params"]["enc"]["w"])
        like = loopkit.load_checkpoint(path, like=jax.eval_shape(lambda: state))
        assert jax.tree.structure(like) == jax.tree.structure(state)
        assert isinstance(like["params"]["layers"][0], jax.Array)
        np.testing.assert_array_equal(like["step"], 7)
    assert loopkit.latest_checkpoint(renamed.parent) == (7, str(renamed))


def test_orbax_checkpoint_manager_directories(tmp_path):
    state = make_state()
    with ocp.CheckpointManager(tmp_path / "mgr") as mgr:
        for step in (1, 5):
            s = jax.tree.map(lambda x: x * step, state)
            mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(s)))
        mgr.wait_until_finished()
    latest = loopkit.load_checkpoint(tmp_path / "mgr")  # the latest step
    np.testing.assert_array_equal(latest["params"]["enc"]["b"], 5 * np.ones(3))
    first = loopkit.load_checkpoint(tmp_path / "mgr" / "1" / "state")
    np.testing.assert_array_equal(first["params"]["enc"]["b"], np.ones(3))
    one = loopkit.load_checkpoint(tmp_path / "mgr" / "1")  # a step's only item
    np.testing.assert_array_equal(one["params"]["enc"]["b"], np.ones(3))


def test_from_pretrained_include_exclude_rename_on_an_orbax_save(tmp_path):
    state = make_state()
    with ocp.StandardCheckpointer() as ck:
        ck.save(tmp_path / "pre", state)
    fresh = {"params": {"backbone": {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)},
                        "layers": [jnp.zeros(2), jnp.zeros(3)]}, "step": jnp.asarray(0)}
    init_fn = loopkit.from_pretrained(tmp_path / "pre", include=["params/*"],
                                      exclude=["params/enc/b", "params/layers/0"],
                                      rename={"params/enc": "params/backbone"})
    out = init_fn(fresh)
    np.testing.assert_array_equal(out["params"]["backbone"]["w"], state["params"]["enc"]["w"])
    np.testing.assert_array_equal(out["params"]["backbone"]["b"], 0)  # excluded
    np.testing.assert_array_equal(out["params"]["layers"][0], 0)  # excluded
    np.testing.assert_array_equal(out["params"]["layers"][1], 3)
    assert int(out["step"]) == 0  # not included
    with pytest.raises(ValueError, match="params/enc/w.*params/enc/w.*no such leaf"):
        loopkit.from_pretrained(tmp_path / "pre", include=["params/enc/w"])(fresh)


class Pair(NamedTuple):
    first: jax.Array
    second: list


def test_orbax_alone_restores_a_loopkit_checkpoint_into_the_users_structure(tmp_path):
    params = {"w": jnp.ones((2, 3)), "stack": [jnp.zeros(2), jnp.ones(2)]}
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))

    def init():
        return {"params": params, "opt": opt.init(params), "pair": Pair(jnp.ones(1), [jnp.ones(2)]),
                "t": (jnp.zeros(1), jnp.ones(1)), "lr": 0.5}

    def step(s):
        return jax.tree.map(lambda x: x + 1, s), {}

    r = loopkit.train(step, init=init, logdir=str(tmp_path), max_steps=3, progress=False)
    _, path = loopkit.latest_checkpoint(tmp_path)
    with ocp.StandardCheckpointer() as ck:
        restored = ck.restore(path, jax.eval_shape(init))
    assert jax.tree.structure(restored) == jax.tree.structure(r.state)
    assert isinstance(restored["opt"][1][0], optax.ScaleByAdamState)
    assert isinstance(restored["pair"], Pair) and isinstance(restored["params"]["stack"], list)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(r.state)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want))
    # and loopkit's own reader, through a resume
    again = loopkit.train(step, init=init, logdir=str(tmp_path), max_steps=4, progress=False)
    assert again.step == 4 and float(again.state["lr"]) == 4.5


def test_safetensors_from_numpy_and_flax_keep_bf16(tmp_path):
    from safetensors.flax import save_file as save_flax
    from safetensors.numpy import save_file as save_numpy

    save_numpy({"encoder.layer.0.weight": np.arange(4, dtype=np.float32).reshape(2, 2),
                "encoder.layer.0.bias": np.ones(2, ml_dtypes.bfloat16)}, tmp_path / "np.safetensors")
    save_flax({"params/dense/kernel": jnp.ones((3, 2), jnp.bfloat16),
               "params/dense/bias": jnp.zeros(2)}, tmp_path / "flax.safetensors")
    got = loopkit.load_checkpoint(tmp_path / "np.safetensors")
    assert got["encoder"]["layer"]["0"]["bias"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got["encoder"]["layer"]["0"]["weight"], [[0, 1], [2, 3]])
    like = {"params": {"dense": {"kernel": jax.ShapeDtypeStruct((3, 2), jnp.bfloat16),
                                 "bias": jax.ShapeDtypeStruct((2,), jnp.float32)}}}
    flax = loopkit.load_checkpoint(tmp_path / "flax.safetensors", like=like)
    assert flax["params"]["dense"]["kernel"].dtype == jnp.bfloat16
    assert isinstance(flax["params"]["dense"]["kernel"], jax.Array)

    fresh = {"backbone": {"kernel": jnp.zeros((3, 2), jnp.bfloat16), "bias": jnp.ones(2)},
             "head": jnp.zeros(4)}
    out = loopkit.from_pretrained(tmp_path / "flax.safetensors", exclude=["*/bias"],
                                  rename={"params/dense": "backbone"})(fresh)
    assert out["backbone"]["kernel"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(out["backbone"]["kernel"].astype(np.float32), 1)
    np.testing.assert_array_equal(out["backbone"]["bias"], 1)  # excluded: fresh value


def test_an_unreadable_path_says_what_is_there_and_what_is_read(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(FileNotFoundError) as info:
        loopkit.load_checkpoint(tmp_path / "notes.txt")
    assert "a file of 5 bytes" in str(info.value) and "safetensors" in str(info.value)
    assert "CheckpointManager" in str(info.value) and "'npz'" not in str(info.value)
    assert "orbax, npz" in str(info.value)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="a directory holding x.json"):
        loopkit.from_pretrained(tmp_path / "d")({"w": jnp.zeros(1)})
    with pytest.raises(FileNotFoundError, match="found nothing there"):
        loopkit.load_checkpoint(tmp_path / "nope")


def test_tensorflow_reads_the_checkpoint_file(tmp_path):
    tf = pytest.importorskip("tensorflow")
    loopkit.train(lambda s: (s + 1, {}), init=jnp.zeros(2), logdir=str(tmp_path), max_steps=2,
                  progress=False, checkpoint_backend="npz")
    ckpt = tf.train.get_checkpoint_state(str(tmp_path))
    assert ckpt.model_checkpoint_path.endswith("model.ckpt-2")


def write_release_0_1_checkpoint(path, state, step):
    """The orbax backend's writer of loopkit 0.1.0: nested dicts keyed by path components."""
    records, tree = [], {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in keypath]
        if isinstance(leaf, float):
            records.append({"path": keys, "kind": "py", "value": leaf})
            continue
        records.append({"path": keys, "kind": "jax", "dtype": leaf.dtype.str,
                        "shape": list(leaf.shape)})
        node = tree
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = np.asarray(leaf)
    head = {"version": 1, "step": step, "leaves": records,
            "metadata": {"step": step, "data_position": None, "timestamp": 0.0}}
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ck:
        ck.save(path, args=ocp.args.PyTreeSave(tree), custom_metadata={"loopkit": head})


def test_a_run_resumes_from_a_checkpoint_of_the_previous_layout(tmp_path):
    def init():
        return {"w": jnp.zeros(3), "layers": [jnp.zeros(2)], "opt": optax.adam(1e-3).init(jnp.zeros(2)),
                "lr": 0.5}

    old = jax.tree.map(lambda x: x + 3, init())
    write_release_0_1_checkpoint(tmp_path / "model.ckpt-3", old, 3)
    assert loopkit.latest_checkpoint(tmp_path) == (3, str(tmp_path / "model.ckpt-3"))
    np.testing.assert_array_equal(loopkit.load_checkpoint(tmp_path)["layers"]["0"], 3)
    r = loopkit.train(lambda s: (jax.tree.map(lambda x: x + 1, s), {}), init=init,
                      logdir=str(tmp_path), max_steps=5, progress=False)
    assert r.step == 5 and float(r.state["w"][0]) == 5.0 and r.state["lr"] == 5.5
    assert isinstance(r.state["opt"][0], optax.ScaleByAdamState)
