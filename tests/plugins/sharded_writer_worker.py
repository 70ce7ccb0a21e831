"""Jax arrays sharded over 4 devices, saved by the orbax backend's writer and by orbax's
own `ArrayHandler`, for tests/plugins/test_orbax_writer.py (a process of its own: the
test process has one device).

    python sharded_writer_worker.py DIRECTORY

Writes DIRECTORY/ours (the backend's `Saver`, its jax arrays in one batch) and
DIRECTORY/theirs (orbax's `PyTreeCheckpointHandler` with its default handlers), then
restores ours with plain orbax into the same shardings; prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import tensorstore as ts  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from loopkit.plugins.checkpoint.backends.orbax.write import Saver  # noqa: E402


def database(path: str) -> dict[bytes, bytes]:
    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
    return {k: store.read(k).result().value for k in store.list().result()}


def main(out: str) -> None:
    mesh = jax.make_mesh((2, 2), ("a", "b"))
    rng = np.random.default_rng(0)

    def arr(shape, spec, dtype=np.float32):
        value = (rng.standard_normal(shape) * 3).astype(dtype)
        return jax.device_put(value, NamedSharding(mesh, spec))

    tree = {"grid": arr((8, 6), P("a", "b")),       # a shard per device
            "rows": arr((8, 4), P()),               # replicated 4x: each replica a cut
            "half": arr((6,), P("a")),              # replicated 2x within each half
            "bf16": arr((4, 4), P(None, "b"), jnp.bfloat16),
            "odd": arr((3,), P()),                  # no axis 4 divides: replica 0 whole
            "int4": arr((8,), P("a"), jnp.int4),
            "key": jax.device_put(jax.random.split(jax.random.key(1), 4),
                                  NamedSharding(mesh, P("a")))}
    options = {"use_ocdbt": True, "use_zarr3": True, "use_compression": False}
    saver = Saver(**options)
    with ocp.Checkpointer(saver.handler) as ck:
        ck.save(f"{out}/ours", args=saver.args(tree))
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**options)) as ck:
        ck.save(f"{out}/theirs", args=ocp.args.PyTreeSave(tree))
    ours, theirs = database(f"{out}/ours"), database(f"{out}/theirs")
    shardings = [json.load(open(f"{out}/{w}/_sharding")) for w in ("ours", "theirs")]
    # (the typed key comes back as its key data: loopkit keeps a key's kind in its head)
    plain = dict(tree, key=jax.random.key_data(tree["key"]))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          plain)
    with ocp.StandardCheckpointer() as ck:
        back = ck.restore(f"{out}/ours", target)
    print(json.dumps({
        "keys": sorted(k.decode() for k in ours), "same_keys": ours.keys() == theirs.keys(),
        "differing": sorted(k.decode() for k in ours if k in theirs and ours[k] != theirs[k]),
        "same_shardings": shardings[0] == shardings[1], "sharded": len(shardings[0]),
        "restored": all(np.array_equal(np.asarray(back[k]), np.asarray(plain[k]))
                        and back[k].sharding == plain[k].sharding for k in target)}))


if __name__ == "__main__":
    main(sys.argv[1])
