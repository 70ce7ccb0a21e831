"""Pretrain an MLP on digits 0-4, then fine-tune a new head on digits 5-9 from its trunk.

    python examples/finetune.py [--workdir runs/finetune] [--steps 600]

The fine-tuning run starts from `loopkit.from_pretrained`, which loads only the
trunk (`params/trunk/*`) of the pretrained checkpoint: the new output head and the
optimiser state keep their fresh values. As with the Supervisor's `init_fn`, this
happens only on a fresh start: rerun the script and both runs resume from their
own checkpoints instead.
"""

from __future__ import annotations

import argparse
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import loopkit

optimizer = optax.adam(3e-3)


def split(digits):
    x, y = load_digits(return_X_y=True)
    keep = np.isin(y, digits)
    x, y = (x[keep] / 16.0).astype(np.float32), (y[keep] - min(digits)).astype(np.int32)
    perm = np.random.default_rng(0).permutation(len(x))
    x, y = x[perm], y[perm]
    n = int(0.8 * len(x))
    return (x[:n], y[:n]), (x[n:], y[n:])


def init_state(seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {
        "trunk": {"w": jax.random.normal(k1, (64, 128)) / 8.0, "b": jnp.zeros(128)},
        "head": {"w": jax.random.normal(k2, (128, 5)) / np.sqrt(128), "b": jnp.zeros(5)},
    }
    return {"params": params, "opt": optimizer.init(params)}


def logits(params, x):
    h = jax.nn.relu(x @ params["trunk"]["w"] + params["trunk"]["b"])
    return h @ params["head"]["w"] + params["head"]["b"]


def accuracy(params, x, y):
    return float((logits(params, x).argmax(-1) == y).mean())


def step_fn(state, batch):
    x, y = batch

    def loss_fn(p):
        return optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = optimizer.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}


def batches(x, y, size=32):
    def data(start_step):
        step = start_step
        while True:
            idx = np.random.default_rng(step).integers(0, len(x), size)
            yield x[idx], y[idx]
            step += 1

    return data


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/finetune")
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args(argv)
    # loopkit logs progress on the "loopkit" logger; show it when stderr is not a terminal
    logging.basicConfig(format="%(asctime)s %(message)s")
    logging.getLogger("loopkit").setLevel(logging.INFO)
    common = dict(max_steps=args.steps, save_model_secs=60, save_summaries_secs=30,
                  progress=False)

    (xa, ya), (xa_test, ya_test) = split(range(0, 5))
    pre = loopkit.train(step_fn, init=lambda: init_state(0), data=batches(xa, ya),
                        logdir=os.path.join(args.workdir, "pretrain"), **common)
    print(f"pretrained on digits 0-4: test accuracy {accuracy(pre.state['params'], xa_test, ya_test):.3f}")

    (xb, yb), (xb_test, yb_test) = split(range(5, 10))
    init_fn = loopkit.from_pretrained(os.path.join(args.workdir, "pretrain"),
                                      include=["params/trunk/*"])
    start = init_fn(init_state(1))
    print(f"digits 5-9 with the pretrained trunk and a fresh head, before fine-tuning: "
          f"{accuracy(start['params'], xb_test, yb_test):.3f}")
    fine = loopkit.train(step_fn, init=lambda: init_state(1), data=batches(xb, yb),
                         init_fn=init_fn, logdir=os.path.join(args.workdir, "finetune"),
                         **common)
    after = accuracy(fine.state["params"], xb_test, yb_test)
    print(f"after fine-tuning {fine.step} steps: test accuracy {after:.3f}")
    return after


if __name__ == "__main__":
    main()
