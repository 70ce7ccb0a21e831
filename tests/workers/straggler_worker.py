"""One process of a two-process job for tests/plugins/test_straggler.py.

    python straggler_worker.py LOGDIR PROCESS_ID PORT SLOW SECS

Each process reads its batches from a source that takes `READ_SECS` a batch, times
`SLOW` on process 1 (1.0: a clean run). The step holds a collective (the mean of a
state sharded over both processes), so the fast process waits for the slow one in
the step. Summary windows every `WINDOW` steps, `straggler_threshold=1.25`; the run
lasts about SECS seconds. Prints ``NAMED <step>`` for each window the `loopkit/straggler`
scalar is written at, then ``DONE <step> <window steps>``.
"""

import logging
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

READ_SECS = 0.008
WINDOW = 25


def main():
    logdir, me, port, slow, secs = (sys.argv[1], int(sys.argv[2]), sys.argv[3],
                                    float(sys.argv[4]), float(sys.argv[5]))
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, me, initialization_timeout=60)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import loopkit

    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    mesh = Mesh(np.array(jax.devices()), ("p",))
    read = READ_SECS * (slow if me == 1 else 1.0)

    def data(start):
        i = start
        while True:
            time.sleep(read)  # the input's own work
            yield np.float32((i * 37 % 11 + 1) / 11)
            i += 1

    def init():
        return {"w": jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("p")))}

    def step(state, x):
        w = state["w"] * 0.5 + jnp.mean(state["w"]) * 0.5 + x  # an all-reduce
        return {"w": w}, {"loss": jnp.mean(w)}

    class Named:
        @loopkit.hookimpl
        def session_create(self, session):
            writer = session.summary_writer
            if writer is not None:
                add = writer.add_scalar

                def spy(tag, value, step, *a, **k):
                    if tag == "loopkit/straggler":
                        print("NAMED", step, value, flush=True)
                    return add(tag, value, step, *a, **k)
                writer.add_scalar = spy

    steps = int(secs / (READ_SECS * max(slow, 1.0)))
    r = loopkit.train(step, init=init, data=data, logdir=logdir, max_steps=steps,
                      save_model_secs=None, save_summaries_secs=None,
                      save_summaries_steps=WINDOW, straggler_threshold=1.25,
                      progress=False, plugins=[Named()])
    print("DONE", r.step, WINDOW, flush=True)


if __name__ == "__main__":
    main()
