"""A run that is killed with SIGKILL and resumed, exactly.

    python examples/resume.py [--logdir runs/resume] [--steps 300] [--kill-at 180]

Trains softmax regression on scikit-learn's bundled digits with optax's Adam,
checkpointing every 50 steps. The first training process kills itself with
SIGKILL at step 180 (no clean-up, no final checkpoint: as a preempted machine).
The second one recovers the latest committed checkpoint -- 150, or 100 when the
save of step 150 was still being written in the background at the kill -- and
finishes with the same batches from there on. Its result is then compared with
a run that was never interrupted: they are bitwise equal.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import loopkit

BATCH = 64
opt = optax.adam(1e-2)


def load_data(cache: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The digits (8x8 images, 10 classes); from `cache` when the parent wrote one."""
    if cache is not None and os.path.exists(cache):
        with np.load(cache) as f:
            return f["x"], f["y"]
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
    if cache is not None:  # spare the training processes importing scikit-learn
        np.savez(cache, x=x, y=y)
    return x, y


def init() -> dict:
    params = {"w": jnp.zeros((64, 10), jnp.float32), "b": jnp.zeros((10,), jnp.float32)}
    return {"params": params, "opt": opt.init(params)}


def loss_fn(params, x, y):
    logits = x @ params["w"] + params["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def step_fn(state, batch):
    x, y = batch
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
    updates, opt_state = opt.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}, {"loss": loss}


def make_data(x: np.ndarray, y: np.ndarray):
    def data(start_step: int):
        """Batches as a function of the step: a resumed run sees the same ones."""
        step = start_step
        while True:
            idx = np.random.default_rng(step).choice(len(x), BATCH, replace=False)
            yield x[idx], y[idx]
            step += 1

    return data


class KillAt:
    """Plays a preempted machine: SIGKILL at a given step, mid-run."""

    def __init__(self, step: int) -> None:
        self.step = step

    @loopkit.hookimpl
    def after_step(self, step: int) -> None:
        if step == self.step:
            print(f"  [training] step {step}: SIGKILL", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def train(logdir: str | None, steps: int, kill_at: int | None = None,
          cache: str | None = None) -> loopkit.TrainResult:
    x, y = load_data(cache)
    return loopkit.train(
        step_fn, init=init, data=make_data(x, y), logdir=logdir, max_steps=steps,
        save_model_steps=50, save_model_secs=None, save_summaries_steps=50,
        plugins=[KillAt(kill_at)] if kill_at else [], progress=False,
    )


def child(logdir: str, steps: int, kill_at: int | None, cache: str) -> None:
    """One training process (run by the parent as a subprocess)."""
    found = loopkit.latest_checkpoint(logdir)
    print(f"  [training] starting; latest checkpoint: {found[0] if found else None}", flush=True)
    result = train(logdir, steps, kill_at, cache)
    print(f"  [training] finished at step {result.step} ({result.stop_reason})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default="runs/resume")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill-at", type=int, default=180)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cache = args.logdir.rstrip("/") + ".digits.npz"
    if args.child:
        child(args.logdir, args.steps, args.kill_at or None, cache)
        return

    shutil.rmtree(args.logdir, ignore_errors=True)
    x, y = load_data(cache)
    cmd = [sys.executable, __file__, "--child", "--logdir", args.logdir, "--steps", str(args.steps)]
    print(f"1. train to step {args.steps}, killed at step {args.kill_at}:")
    first = subprocess.run(cmd + ["--kill-at", str(args.kill_at)])
    print(f"   exit status {first.returncode} (-9: SIGKILL); on disk now:")
    from loopkit.plugins.checkpoint import describe_checkpoints

    for line in describe_checkpoints(args.logdir):
        print("     " + line)

    print("2. run the same command again: it resumes from the latest checkpoint")
    second = subprocess.run(cmd + ["--kill-at", "0"])
    if second.returncode != 0:
        sys.exit(f"the resumed run failed (exit status {second.returncode})")

    print("3. compare with a run that was never interrupted")
    resumed = loopkit.load_checkpoint(args.logdir, like=jax.eval_shape(init))
    straight = train(None, args.steps, cache=cache).state
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(resumed),
                                                    jax.tree.leaves(straight)))
    os.remove(cache)
    acc = float(np.mean(np.argmax(x @ resumed["params"]["w"] + resumed["params"]["b"], 1) == y))
    print(f"   resumed == uninterrupted, bitwise: {same}; training accuracy {acc:.3f}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
