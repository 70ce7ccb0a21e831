"""init_fn / local_init_fn / from_pretrained on real checkpoints written by loopkit.train."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopkit

BACKENDS = ["orbax", "npz"]


def quiet(**kw):
    return dict(progress=False, save_model_secs=None, save_summaries_secs=None, **kw)


def step(state):
    return jax.tree.map(lambda x: x + 1, state), {}


def pretrained_state():
    return {
        "params": {
            "encoder": {"kernel": jnp.full((3, 4), 7.0), "bias": jnp.full((4,), 7.0)},
            "head": {"kernel": jnp.full((4, 2), 7.0)},
            "layers": [jnp.full((2,), 7.0), jnp.full((2,), 8.0)],
        },
        "opt": {"count": jnp.array(70, jnp.int32)},
    }


def fresh_state():
    return {
        "params": {
            "backbone": {"kernel": jnp.zeros((3, 4)), "bias": jnp.zeros((4,))},
            "encoder": {"kernel": jnp.zeros((3, 4)), "bias": jnp.zeros((4,))},
            "head": {"kernel": jnp.zeros((4, 5))},  # a new head: another shape
            "layers": [jnp.zeros((2,)), jnp.zeros((2,))],
        },
        "opt": {"count": jnp.array(0, jnp.int32)},
    }


@pytest.fixture(params=BACKENDS)
def pretrained(request, tmp_path):
    logdir = tmp_path / "pretrain"
    # a real run: 3 steps of +1 from 7.0 -> leaves are 10.0 (layers[1]: 11.0), count 73
    loopkit.train(step, init=pretrained_state(), max_steps=3, logdir=str(logdir),
                  checkpoint_backend=request.param, **quiet())
    return logdir


def test_init_fn_runs_once_and_local_init_fn_every_session(tmp_path):
    calls = []

    def init_fn(state):
        calls.append("init_fn")
        return state + 100

    def local_init_fn(session):
        calls.append(("local_init_fn", session.step))

    kw = dict(init=jnp.zeros(()), logdir=str(tmp_path), init_fn=init_fn,
              local_init_fn=local_init_fn, checkpoint_backend="npz", **quiet())
    r1 = loopkit.train(step, max_steps=2, **kw)
    assert float(r1.state) == 102.0
    r2 = loopkit.train(step, max_steps=4, **kw)
    assert float(r2.state) == 104.0  # init_fn not applied again after the restore
    assert calls == ["init_fn", ("local_init_fn", 0), ("local_init_fn", 2)]


def test_include_loads_only_the_chosen_leaves(pretrained):
    init_fn = loopkit.from_pretrained(pretrained, include=["params/encoder/*"])
    out = init_fn(fresh_state())
    np.testing.assert_array_equal(out["params"]["encoder"]["kernel"], np.full((3, 4), 10.0))
    np.testing.assert_array_equal(out["params"]["encoder"]["bias"], np.full((4,), 10.0))
    np.testing.assert_array_equal(out["params"]["backbone"]["kernel"], np.zeros((3, 4)))
    assert int(out["opt"]["count"]) == 0
    assert out["params"]["head"]["kernel"].shape == (4, 5)


def test_rename_moves_a_trunk_and_sequence_indices_are_numbers(pretrained):
    init_fn = loopkit.from_pretrained(
        pretrained, include=["params/encoder/*", "params/layers/1"],
        rename={"params/encoder": "params/backbone"},
    )
    out = init_fn(fresh_state())
    np.testing.assert_array_equal(out["params"]["backbone"]["kernel"], np.full((3, 4), 10.0))
    np.testing.assert_array_equal(out["params"]["encoder"]["kernel"], np.zeros((3, 4)))
    np.testing.assert_array_equal(out["params"]["layers"][1], np.full((2,), 11.0))
    np.testing.assert_array_equal(out["params"]["layers"][0], np.zeros((2,)))


def test_exclude_and_errors_name_the_leaf(pretrained):
    # everything but the head: the new head keeps its fresh value
    out = loopkit.from_pretrained(pretrained, exclude=["params/head/*"])(fresh_state())
    assert int(out["opt"]["count"]) == 73
    np.testing.assert_array_equal(out["params"]["head"]["kernel"], np.zeros((4, 5)))

    with pytest.raises(ValueError) as info:  # shape mismatch of the head
        loopkit.from_pretrained(pretrained, include=["params/head/*"])(fresh_state())
    msg = str(info.value)
    assert "params/head/kernel" in msg and "(4, 2)" in msg and "(4, 5)" in msg

    with pytest.raises(ValueError) as info:  # no counterpart after rename
        loopkit.from_pretrained(pretrained, include=["params/encoder/*"],
                                rename={"params/encoder": "params/trunk"})(fresh_state())
    msg = str(info.value)
    assert "params/encoder/kernel" in msg and "params/trunk/kernel" in msg

    state = fresh_state()
    state["opt"]["count"] = jnp.array(0, jnp.float32)
    with pytest.raises(ValueError, match=r"opt/count.*int32.*float32"):
        loopkit.from_pretrained(pretrained, include=["opt/*"])(state)

    with pytest.raises(ValueError, match="choose no leaf"):
        loopkit.from_pretrained(pretrained, include=["nothing/*"])(fresh_state())


def test_a_pattern_given_as_a_string_is_one_pattern(pretrained):
    # include="params/encoder/*" is the one pattern it reads as, never its characters
    # (whose "*" chose every leaf: the new head's shape then failed the load, and an
    # exclude of one string excluded everything)
    out = loopkit.from_pretrained(pretrained, include="params/encoder/*",
                                  rename={"params/encoder": "params/backbone"})(fresh_state())
    np.testing.assert_array_equal(out["params"]["backbone"]["kernel"], np.full((3, 4), 10.0))
    np.testing.assert_array_equal(out["params"]["encoder"]["kernel"], np.zeros((3, 4)))
    assert int(out["opt"]["count"]) == 0

    out = loopkit.from_pretrained(pretrained, exclude="params/head/*")(fresh_state())
    assert int(out["opt"]["count"]) == 73
    np.testing.assert_array_equal(out["params"]["head"]["kernel"], np.zeros((4, 5)))


def test_from_pretrained_accepts_a_checkpoint_path(pretrained):
    step, path = loopkit.latest_checkpoint(pretrained)
    assert step == 3
    out = loopkit.from_pretrained(path, include=["opt/*"])(fresh_state())
    assert int(out["opt"]["count"]) == 73


def test_from_pretrained_as_init_fn_in_a_run_only_on_a_fresh_start(pretrained, tmp_path):
    init_fn = loopkit.from_pretrained(pretrained, include=["params/encoder/*"])
    kw = dict(init=fresh_state, init_fn=init_fn, logdir=str(tmp_path / "fine"),
              checkpoint_backend="npz", **quiet())
    r = loopkit.train(step, max_steps=1, **kw)
    np.testing.assert_array_equal(r.state["params"]["encoder"]["kernel"], np.full((3, 4), 11.0))
    r = loopkit.train(step, max_steps=2, **kw)  # resumed: the checkpoint wins
    np.testing.assert_array_equal(r.state["params"]["encoder"]["kernel"], np.full((3, 4), 12.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_loading_one_leaf_does_not_read_a_large_unchosen_one(tmp_path, backend):
    """Peak memory of a process that loads a 4-byte leaf next to a 400 MB one."""
    logdir = tmp_path / "big"
    big = {"small": jnp.ones((1,)), "big": jnp.ones((100_000_000,), jnp.float32)}
    loopkit.train(step, init=big, max_steps=1, logdir=str(logdir), checkpoint_backend=backend,
                  **quiet())
    del big
    code = textwrap.dedent(f"""
        import resource, jax.numpy as jnp, loopkit
        init_fn = loopkit.from_pretrained({str(logdir)!r}, include=["small"])
        fresh = {{"small": jnp.zeros((1,)), "big": jnp.zeros((1,))}}
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = init_fn(fresh)
        assert float(out["small"][0]) == 2.0, out
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print("GROWTH_MB", (peak - base) / 1024)
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, timeout=180)
    assert p.returncode == 0, p.stderr
    growth = float(p.stdout.split("GROWTH_MB")[1])
    assert growth < 150, f"loading one small leaf grew the process by {growth:.0f} MB"
