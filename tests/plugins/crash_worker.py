"""A small deterministic training run that the crash test kills with SIGKILL.

    python crash_worker.py LOGDIR BACKEND MAX_STEPS SAVE_STEPS OUT

Prints ``started <step>`` once the session is ready (restored or fresh) and
``save <step>`` just before each timer save, so the test can kill it at chosen
moments; writes the final state to OUT (an .npz) and prints ``done <step> <reason>``.
"""

from __future__ import annotations

import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import loopkit


def init() -> dict:
    k = np.arange(32 * 32, dtype=np.float32).reshape(32, 32) / 1024.0
    return {
        "w": jnp.asarray(k),
        "b": jnp.zeros((32,), jnp.float32),
        "h": jnp.ones((8,), jnp.bfloat16),
        "n": jnp.zeros((), jnp.int32),
    }


def step_fn(state: dict, batch: jax.Array) -> tuple[dict, dict]:
    y = jnp.tanh(state["w"] @ batch + state["b"])
    w = state["w"] * 0.999 + 0.01 * jnp.outer(y, batch)
    b = state["b"] + 0.01 * y
    h = (state["h"].astype(jnp.float32) * 0.99 + y[:8]).astype(jnp.bfloat16)
    return {"w": w, "b": b, "h": h, "n": state["n"] + 1}, {"y": jnp.sum(y)}


def batch_at(step: int) -> np.ndarray:
    """The batch of the step that makes global step ``step + 1``: a function of the step."""
    return np.random.default_rng(step).standard_normal(32).astype(np.float32)


def data(start_step: int):
    return (batch_at(i) for i in itertools.count(start_step))


class Announce:
    """Tells the test where the run stands (stdout, flushed)."""

    def __init__(self, save_steps: int) -> None:
        self.save_steps = save_steps

    @loopkit.hookimpl
    def session_create(self, session) -> None:
        print(f"started {session.step}", flush=True)

    @loopkit.hookimpl
    def after_step(self, session, step: int) -> None:
        if step % self.save_steps == 0:  # the checkpoint timer fires right after this
            print(f"save {step}", flush=True)


def main(argv: list[str]) -> None:
    logdir, backend, max_steps, save_steps, out = argv
    max_steps, save_steps = int(max_steps), int(save_steps)
    result = loopkit.train(
        step_fn, init=init, data=data, plugins=[Announce(save_steps)],
        logdir=logdir, checkpoint_backend=backend, save_model_steps=save_steps,
        save_model_secs=None, max_to_keep=2, max_steps=max_steps,
        disable=("summaries",), progress=False, autoload=False,
    )
    np.savez(out, **{k: np.asarray(v.astype(jnp.float32) if k == "h" else v)
                     for k, v in result.state.items()})
    print(f"done {result.step} {result.stop_reason}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
