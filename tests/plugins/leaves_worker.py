"""One process of a job saving or restoring a state of many leaves on a bucket, for
tests/plugins/test_bucket_pods.py.

    python leaves_worker.py URL NUM_PROCESSES PROCESS_ID PORT LEAVES save|restore|orbax
        [--per-leaf] [--values N]

The state at step s: LEAVES float32 leaves of N values (default 2,048: 8 KiB), three in four
sharded over every process's device, the fourth replicated; each value a function of
the leaf and s. ``save``: steps 1 and 2 committed (``COMMITTED s`` after each), then
step 3 started and the process sleeps until it is killed. ``restore``: the latest
committed step restored into the state's layout on this job and compared bit for bit
(``RESTORED s equal=True fetched=A/B bytes=N``, N the bytes downloaded into the stage).
``orbax``: URL is a local copy of a checkpoint directory, restored by plain orbax
(`StandardCheckpointer`, the state's shardings as target) and compared bit for bit
(``ORBAX s equal=True``). ``--per-leaf``: the layout earlier versions wrote with many
processes (no OCDBT, one zarr3 array per leaf).
"""

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")


SIZE = int(sys.argv[sys.argv.index("--values") + 1]) if "--values" in sys.argv else 2048


def values(i, step):
    return (np.arange(SIZE, dtype=np.float32) * (i + 1) + np.float32(step)) / np.float32(7)


def state_for(leaves, step, mesh):
    from jax.sharding import NamedSharding, PartitionSpec as P

    sharded, replicated = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
    return {f"x{i:04d}": jax.make_array_from_callback(
        (SIZE,), replicated if i % 4 == 3 else sharded, lambda idx, i=i: values(i, step)[idx])
        for i in range(leaves)}


def equal(state, step, like):
    """Every shard of ``state`` bitwise the values of ``step``, placed as ``like`` is."""
    return all(state[k].sharding == x.sharding for k, x in like.items()) and all(np.asarray(shard.data).tobytes() == values(int(k[1:]), step)[shard.index].tobytes()
               for k, x in state.items() for shard in x.addressable_shards)


def plain_orbax(path, leaves, mesh, n):
    import orbax.checkpoint as ocp

    step = int(path.rsplit("-", 1)[1])
    target = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
              for k, x in state_for(leaves, 0, mesh).items()}
    with ocp.StandardCheckpointer() as ck:
        state = ck.restore(path, target)
    print(f"ORBAX {step} equal={equal(state, step, target)}", flush=True)
    if n > 1:
        jax.distributed.shutdown()


def main():
    url, n, me, port, leaves, mode = sys.argv[1:7]
    n, me, leaves = int(n), int(me), int(leaves)
    if n > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", n, me, initialization_timeout=60)
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    if mode == "orbax":
        return plain_orbax(url, leaves, mesh, n)
    from loopkit.plugins.checkpoint.backends.orbax import OrbaxBackend
    from loopkit.plugins.checkpoint.backends.staged import StagedBackend

    extra = {"use_ocdbt": False} if "--per-leaf" in sys.argv else {}
    backend = StagedBackend(url, "model.ckpt",
                            lambda p: OrbaxBackend(p, "model.ckpt", own_files=True, **extra))
    if mode == "save":
        for step in (1, 2, 3):
            backend.save(step, state_for(leaves, step, mesh), {"step": step})
            if step == 3:
                print("SAVING 3", flush=True)
                time.sleep(3600)  # killed here, in the middle of step 3's commit or after
            backend.wait()
            print(f"COMMITTED {step}", flush=True)
        return
    step = backend.steps()[-1]
    like = state_for(leaves, 0, mesh)
    backend.fetch(step, like)
    stage = backend.local.path(step)
    fetched = sum(f.stat().st_blocks * 512 for f in stage.rglob("*") if f.is_file())
    state, meta = backend.restore(step, like)
    same = meta == {"step": step} and equal(state, step, like)
    print(f"RESTORED {step} equal={same} fetched={backend.last_fetch[0]}/"
          f"{backend.last_fetch[1]} bytes={fetched}", flush=True)
    backend.close()
    if n > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
