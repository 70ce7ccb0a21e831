"""The Supervisor idiom: your own loop, loopkit's services around it.

    python examples/supervisor_loop.py [--logdir runs/manual] [--steps 300]

Linear regression with a hand-written loop: checkpoints, summaries and a clean
stop come from `loopkit.Supervisor.managed_session`; a second run resumes.
"""

from __future__ import annotations

import argparse
import logging

import jax
import jax.numpy as jnp
import numpy as np

import loopkit

TRUE_W = np.array([2.0, -3.0, 0.5], np.float32)


def step_fn(w, batch):
    x, y = batch
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return w - 0.05 * grad, {"loss": loss}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default="runs/manual")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    # loopkit logs progress on the "loopkit" logger; show it when stderr is not a terminal
    logging.basicConfig(format="%(asctime)s %(message)s")
    logging.getLogger("loopkit").setLevel(logging.INFO)

    sv = loopkit.Supervisor(logdir=args.logdir, max_steps=args.steps, save_model_secs=30,
                            save_summaries_steps=25)
    with sv.managed_session(step_fn, init=jnp.zeros(3)) as sess:
        print(f"starting at step {sess.step}")
        while not sv.should_stop():
            rng = np.random.default_rng(sess.step)      # batches follow the step: exact resume
            x = rng.normal(size=(32, 3)).astype(np.float32)
            metrics = sess.run((x, x @ TRUE_W))
            if sess.step % 100 == 0:
                sv.summary_computed({"w_error": float(jnp.linalg.norm(sess.state - TRUE_W))})
    print(f"stopped at step {sess.step}; w = {np.round(np.asarray(sess.state), 3)}")
    return sess


if __name__ == "__main__":
    main()
