"""A training script for the goodput tests.

    goodput_worker.py LOGDIR MAX_STEPS KILL_AT CONFIG_JSON

Trains a small MLP; SIGKILLs itself after global step KILL_AT (0: never);
CONFIG_JSON holds extra `loopkit.train` keywords, and "step_sleep": seconds each step
sleeps after it (a slow run to watch live). Prints "DONE step reason".
"""

import json
import logging
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp

import loopkit

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
logdir, max_steps, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
step_sleep = extra.pop("step_sleep", 0.0)


def step(s, b):
    def loss(p):
        h = jnp.tanh(b @ p["w1"])
        return jnp.mean((h @ p["w2"] - 1.0) ** 2)

    value, g = jax.value_and_grad(loss)(s)
    return jax.tree.map(lambda p, d: p - 0.01 * d, s, g), {"loss": value}


def init():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (256, 256)) * 0.05,
            "w2": jax.random.normal(k2, (256, 1)) * 0.05}


def data(start):
    for i in range(start, 10**6):
        yield jnp.full((64, 256), 0.001 * (i % 13))


class Kill:
    @loopkit.hookimpl
    def after_step(self, step):
        if step == kill_at:
            # the last save before the kill committed first (a loaded machine may not
            # have published it yet), so that every run restores the same step
            every = extra.get("save_model_steps", 15)
            saved = step - step % every if every else -1
            deadline = time.monotonic() + 60
            while ((loopkit.latest_checkpoint(logdir) or (-1,))[0] < saved
                   and time.monotonic() < deadline):
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)


class Slow:
    @loopkit.hookimpl
    def after_step(self, step):
        time.sleep(step_sleep)


options = dict(max_steps=max_steps, progress=False, autoload=False,
               save_summaries_secs=None, save_summaries_steps=5,
               save_model_secs=None, save_model_steps=15, checkpoint_backend="npz")
options.update(extra)
r = loopkit.train(step, init=init, data=data, logdir=logdir,
                  plugins=([Kill()] if kill_at else []) + ([Slow()] if step_sleep else []),
                  **options)
print("DONE", r.step, r.stop_reason, flush=True)
