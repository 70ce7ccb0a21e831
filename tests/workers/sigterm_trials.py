"""SIGTERM at random moments of a session, many sessions in one process.

    sigterm_trials.py LOGDIR TRIALS SEED

Two sessions run without a signal; the second measures a resumed session's
length D. Then each
trial resumes the logdir for 12 more steps (a restore, steps, saves every 4
steps, the close's final save) while a thread sends this process SIGTERM at a
random moment: trial k's within [(k - 0.5) D / TRIALS, (k + 0.5) D / TRIALS) (spread
over the whole session, from before its handler to after its return). Each trial
prints one JSON line: when the signal came relative to the session's phases, how
the session ended, the final checkpoint's step, and the seconds from the signal to
`train`'s return. At the end a run straight to the last step prints its state
beside the trials' (the stops saved exactly what they stopped at).
"""

import json
import os
import random
import signal
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np

import loopkit

logdir, trials, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
# the process outside a session: a signal after the run's handlers were given back
late: list[float] = []
signal.signal(signal.SIGTERM, lambda s, f: late.append(time.monotonic()))


def step(s, b):
    return {"w": s["w"] * 0.5 + b, "n": s["n"] + 1}, {"loss": jnp.sum(s["w"])}


def data(start):
    for i in range(start, 10**6):
        yield np.full((4,), np.float32(i % 5))


class Phases:
    """When each phase of the session began (time.monotonic)."""

    def __init__(self):
        self.at = {}
        self.session = None

    @loopkit.hookimpl
    def session_create(self, session):
        self.session = session
        self.at.setdefault("step", time.monotonic())  # start-up ends: services run

    @loopkit.hookimpl
    def after_step(self, step):
        time.sleep(0.02)  # a step of some length, so that signals land in steps too

    @loopkit.hookimpl(tryfirst=True)
    def on_stop(self):
        self.at["close"] = time.monotonic()


def session(steps, delay=None):
    phases, sent = Phases(), []

    def send():
        running = phases.session.timer_running if phases.session is not None else None
        sent.append((time.monotonic(), running.name if running is not None else None))
        os.kill(os.getpid(), signal.SIGTERM)

    timer = threading.Timer(delay, send) if delay is not None else None
    late.clear()
    t0 = time.monotonic()
    if timer is not None:
        timer.start()
    r = loopkit.train(step, init={"w": jnp.zeros(4), "n": jnp.zeros((), jnp.int32)},
                      data=data, logdir=logdir, max_steps=steps, save_model_steps=4,
                      save_model_secs=None, plugins=[phases], progress=False,
                      autoload=False)
    ended = time.monotonic()
    if timer is not None:
        timer.join()
    return r, t0, ended, phases.at, sent, list(late)


session(12)  # the first compiles: the second measures a resumed session's length
second, t0, ended, _, _, _ = session(24)
length = (ended - t0) * 1.1  # a few trials land after the return
target = second.step
for k in range(trials):
    target += 12
    delay = max(0.0, rng.uniform(k - 0.5, k + 0.5) * length / trials)
    r, t0, ended, at, sent, after = session(target, delay)
    moment, timer = sent[0]
    started = moment < at.get("step", ended)  # before the services ran
    phase = (("before" if started else "after") if after else "startup" if started
             else "close" if moment >= at.get("close", ended)
             else f"timer {timer}" if timer else "step")
    found = loopkit.latest_checkpoint(logdir)
    print(json.dumps({"trial": k, "phase": phase, "reason": r.stop_reason, "step": r.step,
                      "target": target, "checkpoint": None if found is None else found[0],
                      "secs_to_end": None if after else ended - moment,
                      "n": int(r.state["n"])}), flush=True)
    target = r.step
straight = loopkit.train(step, init={"w": jnp.zeros(4), "n": jnp.zeros((), jnp.int32)},
                         data=data, max_steps=target, progress=False, autoload=False,
                         checkpoint_backend=None)
print(json.dumps({"final": np.asarray(r.state["w"]).tolist(),
                  "straight": np.asarray(straight.state["w"]).tolist()}), flush=True)
