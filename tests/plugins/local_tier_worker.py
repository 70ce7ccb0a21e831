"""A deterministic run with two checkpoint tiers, for the SIGKILL tests of the local tier.

    python local_tier_worker.py LOGDIR LOCAL_DIR MAX_STEPS OUT

The model and data of crash_worker.py; durable checkpoints every `DURABLE_STEPS` steps,
local ones every `LOCAL_STEPS`; each step is slowed a little so the test can kill the
process between saves. Prints ``started <step> <tier>`` once the session is ready
(the tier it restored from, or None), writes the final state to OUT (an .npz) and
prints ``done <step>``.
"""

from __future__ import annotations

import sys
import time

import jax.numpy as jnp
import numpy as np

import loopkit
from crash_worker import data, init, step_fn
from loopkit.plugins.checkpoint import RESTORED_TIER

DURABLE_STEPS = 20
LOCAL_STEPS = 3
STEP_SLEEP_SECS = 0.02


class Announce:
    @loopkit.hookimpl
    def session_create(self, session) -> None:
        print(f"started {session.step} {session.stash[RESTORED_TIER]}", flush=True)

    @loopkit.hookimpl
    def after_step(self, session, step: int) -> None:
        time.sleep(STEP_SLEEP_SECS)  # room for the test to kill it between saves


def main(argv: list[str]) -> None:
    logdir, local, max_steps, out = argv
    result = loopkit.train(
        step_fn, init=init, data=data, plugins=[Announce()],
        logdir=logdir, local_checkpoint_dir=local,
        save_model_steps=DURABLE_STEPS, save_model_secs=None,
        save_local_steps=LOCAL_STEPS, save_local_secs=None,
        max_steps=int(max_steps), disable=("summaries",), progress=False, autoload=False,
    )
    np.savez(out, **{k: np.asarray(v.astype(jnp.float32) if k == "h" else v)
                     for k, v in result.state.items()})
    print(f"done {result.step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
