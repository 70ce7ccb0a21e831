"""Train a small MLP on scikit-learn's bundled digits with checkpoints, summaries, progress.

    python examples/digits.py                   # trains to --steps, saving to runs/digits
    python examples/digits.py --steps 2000      # run again: resumes where it stopped
    tensorboard --logdir runs/digits            # loss, accuracy, global_step/sec

Kill it at any time (Ctrl-C stops cleanly with a final checkpoint; even SIGKILL
loses at most one checkpoint interval): the next run resumes exactly.
"""

from __future__ import annotations

import argparse
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import loopkit

BATCH = 64


def load():
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    perm = np.random.default_rng(0).permutation(len(x))
    x, y = x[perm], y[perm].astype(np.int32)
    return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def init_params(key, sizes=(64, 128, 10)):
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        params.append({"w": jax.random.normal(sub, (fan_in, fan_out)) / np.sqrt(fan_in),
                       "b": jnp.zeros(fan_out)})
    return params


def predict(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


optimizer = optax.adam(1e-3)


def loss_fn(params, x, y):
    logits = predict(params, x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, (logits.argmax(-1) == y).mean()


def step_fn(state, batch):
    x, y = batch
    (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], x, y)
    updates, opt = optimizer.update(grads, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt": opt}, {"loss": loss, "accuracy": acc}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default="runs/digits")
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args(argv)
    # loopkit logs progress on the "loopkit" logger; show it when stderr is not a terminal
    logging.basicConfig(format="%(asctime)s %(message)s")
    logging.getLogger("loopkit").setLevel(logging.INFO)
    (x_train, y_train), (x_test, y_test) = load()

    def init():
        params = init_params(jax.random.key(0))
        return {"params": params, "opt": optimizer.init(params)}

    def data(start_step):
        # Batches are a pure function of the step: a resumed run sees exactly the
        # batches an uninterrupted one would have.
        step = start_step
        while True:
            idx = np.random.default_rng(step).integers(0, len(x_train), BATCH)
            yield x_train[idx], y_train[idx]
            step += 1

    result = loopkit.train(
        step_fn, init=init, data=data, logdir=args.logdir, max_steps=args.steps,
        save_model_secs=30, save_summaries_steps=50,
    )
    test_acc = float((predict(result.state["params"], x_test).argmax(-1) == y_test).mean())
    print(f"stopped at step {result.step} ({result.stop_reason}); test accuracy {test_acc:.3f}")
    return result


if __name__ == "__main__":
    main()
