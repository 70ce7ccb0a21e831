"""A training script for the hang watchdog and `loopkit run` tests.

    run_worker.py LOGDIR MAX_STEPS PLAN_FILE OUT

PLAN_FILE holds one line per attempt, consumed in order (the first line is removed at
each start): "crash N" SIGKILLs the process after step N, "hang N" blocks the data
reader at batch N (the watchdog ends it; "hang 0": before the first batch),
"slow-timer" runs a timer action that never returns, "sleep S" sleeps S seconds per
step, "ok" trains to MAX_STEPS. Every start appends a line to PLAN_FILE.starts. The
final state goes to OUT (npy).
Environment: STOP_SECS makes the close that long; HANG_SECS and STARTUP_SECS set
Config.hang_timeout_secs and startup_timeout_secs; BLOCK_REPORT=1 makes every write
under logdir/hangs, and the goodput ledger's record of a hang, block for ever.
"""

import os
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import loopkit

logdir, max_steps, plan_file, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
with open(plan_file) as f:
    lines = f.read().splitlines()
plan = lines[0].split() if lines else ["ok"]
with open(plan_file, "w") as f:
    f.write("\n".join(lines[1:]))
with open(plan_file + ".starts", "a") as f:
    f.write(" ".join(plan) + "\n")


def blocked_forever():
    threading.Event().wait()


if os.environ.get("BLOCK_REPORT"):  # a storage layer whose write of the report blocks
    import loopkit.storage

    write_atomic = loopkit.storage.write_atomic

    def blocking_write(path, data):
        if "/hangs/" in str(path):
            blocked_forever()
        return write_atomic(path, data)

    loopkit.storage.write_atomic = blocking_write
    # and a goodput ledger whose record of the hang never returns (a mirror that blocks)
    from loopkit.plugins.goodput.ledger import Ledger

    ledger_write = Ledger.write

    def blocking_ledger(self, record, wait=False):
        if type(record).__name__ == "Hang":
            blocked_forever()
        return ledger_write(self, record, wait)

    Ledger.write = blocking_ledger


def data(start):
    for i in range(start, 10**6):
        if plan[0] == "hang" and i == int(plan[1]):
            blocked_forever()
        yield np.full((4,), 0.01 * (i % 7), np.float32)


def step(s, b):
    w = s["w"] * 0.99 + jnp.sin(b).sum()
    return {"w": w, "n": s["n"] + 1}, {"loss": jnp.sum(w)}


class Plan:
    @loopkit.hookimpl
    def session_create(self, session):
        if plan[0] == "slow-timer":
            session.every(lambda s: blocked_forever(), steps=5, name="slow_eval")

    @loopkit.hookimpl
    def after_step(self, step):
        if plan[0] == "crash" and step == int(plan[1]):
            os.kill(os.getpid(), signal.SIGKILL)
        if plan[0] == "sleep":
            time.sleep(float(plan[1]))

    @loopkit.hookimpl
    def on_stop(self):
        time.sleep(float(os.environ.get("STOP_SECS", "0")))  # a slow close


r = loopkit.train(step, init=lambda: {"w": jnp.ones(4), "n": jnp.zeros((), jnp.int32)},
                  data=data, logdir=logdir, max_steps=max_steps, save_model_steps=2,
                  save_model_secs=None, checkpoint_backend="npz", plugins=[Plan()],
                  hang_timeout_secs=float(os.environ.get("HANG_SECS", "2")), progress=False,
                  startup_timeout_secs=float(os.environ.get("STARTUP_SECS", "1800")),
                  autoload=False)
np.save(out, np.asarray(r.state["w"]))
print("DONE", r.step, r.stop_reason, flush=True)
