"""A run with two checkpoint tiers and ``"auto"`` intervals, for the cadence tests.

    python cadence_worker.py LOGDIR LOCAL_DIR MAX_STEPS CONFIG_JSON

The model and data of crash_worker.py; durable checkpoints every `DURABLE_STEPS`
steps, local ones every `LOCAL_STEPS`, and CONFIG_JSON's keywords on top (the
``"auto"`` intervals); each step is slowed a little so the test can kill the process
between saves. Prints ``started <step> <tier>`` once the session is ready and
``done <step>`` at the end; loopkit's log (the intervals picked) goes to stderr.
"""

from __future__ import annotations

import json
import logging
import sys

import loopkit
from crash_worker import data, init, step_fn
from local_tier_worker import DURABLE_STEPS, LOCAL_STEPS, Announce  # the same trainer


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logdir, local, max_steps, extra = argv
    options = dict(save_model_steps=DURABLE_STEPS, save_model_secs="auto",
                   save_local_steps=LOCAL_STEPS, save_local_secs=None,
                   save_summaries_steps=5, save_summaries_secs=None)
    options.update(json.loads(extra))
    result = loopkit.train(step_fn, init=init, data=data, plugins=[Announce()],
                           logdir=logdir, local_checkpoint_dir=local,
                           max_steps=int(max_steps), progress=False, autoload=False,
                           **options)
    print(f"done {result.step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
