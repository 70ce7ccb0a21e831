"""One process of a two-process job that trains many short runs with a bad value on one
process, for tests/plugins/test_rollback.py.

    python rollback_worker.py BASE PROCESS_ID PORT CASES

CASES is a JSON list of [bad_process, bad_step, save_steps, save_secs] (and, optionally,
the batch the data ends before and the `on_guard`): each case is a
run in BASE/run-<k> whose batch bad_step - 1 is NaN on bad_process only, so that its
state (a host-local replica) and its loss go non-finite there while the other
process's stay good. One `jax.distributed` start serves every case: a case costs
its training, not a process start. Prints, per case, ``ROLLBACK k bad restored first
end`` from the `on_rollback` hook and ``W k <state hex> <step>`` at the end; exits 1 at
the first case that raises (after printing ``ERROR k <error>``).
"""

import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main():
    base, me, port, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, me, initialization_timeout=60)
    import numpy as np

    import loopkit

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "plugins"))
    from test_rollback import N, init, step_fn, value

    for k, (bad_process, bad_step, save_steps, save_secs, *rest) in enumerate(cases):
        end, on_guard = rest if rest else (None, "rollback")

        def data(start, poisoned=bad_step - 1 if me == bad_process else None, end=end):
            i = start
            while end is None or i < end:
                yield np.float32("nan") if i == poisoned else value(i)
                i += 1

        class Rec:
            @loopkit.hookimpl
            def on_rollback(self, record, case=k):
                print("ROLLBACK", case, record.step, record.restored_step, *record.skipped,
                      flush=True)

        # time-based saves land wherever the agreement puts them: a short sleep per
        # step spreads the run over a few agreement rounds
        step = step_fn if save_secs is None else (
            lambda s, b: (time.sleep(0.005), step_fn(s, b))[1])
        try:
            r = loopkit.train(step, init=init, data=data, logdir=os.path.join(base, f"run-{k}"),
                              max_steps=N if end is None else None,
                              save_model_steps=save_steps, save_model_secs=save_secs,
                              nan_guard="loss", on_guard=on_guard, progress=False,
                              plugins=[Rec()])
        except Exception as e:  # noqa: BLE001 - reported, then the job ends
            print("ERROR", k, type(e).__name__, str(e).replace("\n", " | "), flush=True)
            sys.exit(1)
        print("W", k, np.asarray(r.state["w"]).tobytes().hex(), r.step, flush=True)


if __name__ == "__main__":
    main()
