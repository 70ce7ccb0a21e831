"""A training script whose every try under `loopkit run` ends another way, for the
report tests.

    report_worker.py LOGDIR COUNTER_FILE

COUNTER_FILE counts the tries. Try 1 SIGKILLs itself after step 12 (its checkpoint of
step 10 committed); try 2 hangs in a hook after step 16 (the watchdog exits 75 with its
report); try 3 meets a NaN loss at step 20 and rolls back (`on_guard="rollback"`), then
fails with an error at step 24 (exit 1); try 4 finishes at step 30. Every try keeps a
local tier beside the logdir (LOGDIR-local).
"""

import logging
import os
import signal
import sys
import time
from pathlib import Path

import jax.numpy as jnp

import loopkit

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
logdir, counter = sys.argv[1], Path(sys.argv[2])
attempt = int(counter.read_text() or 0) + 1 if counter.exists() else 1
counter.write_text(str(attempt))


def step(s, b):
    s = s + 0.01 * b
    return s, {"loss": jnp.mean(s * s) + jnp.mean(b)}


def data(start):
    for i in range(start, 10**6):
        bad = attempt == 3 and i == 19  # the batch of step 20
        yield jnp.full((8,), jnp.nan if bad else 0.5)


class Fate:
    @loopkit.hookimpl
    def after_step(self, step):
        if attempt == 1 and step == 12:
            deadline = time.monotonic() + 60  # its checkpoint of step 10 committed first
            while (loopkit.latest_checkpoint(logdir) or (-1,))[0] < 10 \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        if attempt == 2 and step == 16:
            time.sleep(3600)  # a hang: the watchdog ends the process
        if attempt == 3 and step == 24:
            raise RuntimeError("a bug at step 24")


r = loopkit.train(step, init=jnp.zeros(8), data=data, logdir=logdir, max_steps=30,
                  plugins=[Fate()], progress=False, autoload=False,
                  save_summaries_secs=None, save_summaries_steps=2, save_model_secs=None,
                  save_model_steps=5, checkpoint_backend="npz",
                  local_checkpoint_dir=logdir + "-local", save_local_secs=None,
                  save_local_steps=2, hang_timeout_secs=2.0, nan_guard="loss",
                  on_guard="rollback")
print("DONE", r.step, r.stop_reason, flush=True)
