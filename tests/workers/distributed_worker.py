"""One process of a data-parallel loopkit job, for tests/test_distributed.py.

    python distributed_worker.py LOGDIR OUT NUM_PROCESSES PROCESS_ID PORT MAX_STEPS
        [--step-sleep S] [--save-secs S] [--save-steps N] [--data-lens N0,N1,...]
        [--host-local] [--differ] [--shard-state] [--local-dir DIR]

--host-local: the state is plain jax arrays each process holds on its own (replicas),
fed the same batches on every process, without data_sharding; --differ seeds them
with the process index. --data-lens: process i's data ends after global step N_i.
--shard-state: `w` is sharded over every device of every process.
--plan FILE: this process's plan for this start, the first line of FILE.p<ID> (removed
as it is read, as tests/workers/run_worker.py does): "crash N" SIGKILLs the process
after step N, once the saves in flight have committed; "hang N" blocks its data reader
at batch N; "ok" trains on.
--hang-secs S: Config.hang_timeout_secs; --startup-secs S: Config.startup_timeout_secs.
--local-dir: a local checkpoint tier in DIR (each process's in DIR/process-<id>), saved
every 3 steps.
--backend NAME: Config.checkpoint_backend (default orbax).
--local-replicas K: Config.local_replicas (peer copies of the local tier).
--stateful: the data is a stateful iterator (get_state/set_state) per process, the
same batches as the default's, so only a restored position resumes them bitwise.
--fail-uploading P:STEP: under a URL logdir, process P's upload of its part of the
checkpoint of STEP raises OSError (a network error).
--fail-local-save P:STEP: process P's orbax save of STEP raises OSError once orbax has
written it and the loop waits for it (a full local disk, say).
--fail-downloading P:STEP: under a URL logdir, process P's download of the checkpoint
of STEP raises FileNotFoundError (an object of it missing: its content is wrong, which
is not an error of the store).
--die-uploading P:STEP: under a URL logdir, process P SIGKILLs itself in the middle of
uploading its part of the checkpoint of STEP (after its first object).
--die-copying P:STEP: process P SIGKILLs itself in the middle of copying its part of the
local checkpoint of STEP to its peer (after the first file has arrived there).
"""

import argparse
import os
import signal
import sys
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("logdir")
    p.add_argument("out")
    p.add_argument("num_processes", type=int)
    p.add_argument("process_id", type=int)
    p.add_argument("port", type=int)
    p.add_argument("max_steps", type=int)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--save-secs", type=float, default=None)
    p.add_argument("--save-steps", type=int, default=None)
    p.add_argument("--data-lens", default=None)
    p.add_argument("--host-local", action="store_true")
    p.add_argument("--differ", action="store_true")
    p.add_argument("--shard-state", action="store_true")
    p.add_argument("--plan", default=None)
    p.add_argument("--hang-secs", type=float, default=None)
    p.add_argument("--startup-secs", type=float, default=None)
    p.add_argument("--heartbeat-secs", type=int, default=100)
    p.add_argument("--local-dir", default=None)
    p.add_argument("--die-uploading", default=None)
    p.add_argument("--die-copying", default=None)
    p.add_argument("--backend", default="orbax")
    p.add_argument("--fail-uploading", default=None)
    p.add_argument("--fail-local-save", default=None)
    p.add_argument("--fail-downloading", default=None)
    p.add_argument("--local-replicas", type=int, default=0)
    p.add_argument("--stateful", action="store_true")
    p.add_argument("--momentum", action="store_true")  # a leaf `m` init does not place
    args = p.parse_args()
    if args.die_uploading is not None:
        who, step = map(int, args.die_uploading.split(":"))
        if who == args.process_id:
            die_uploading(step)
    if args.die_copying is not None:
        who, step = map(int, args.die_copying.split(":"))
        if who == args.process_id:
            die_copying(step)
    if args.fail_uploading is not None:
        who, step = map(int, args.fail_uploading.split(":"))
        if who == args.process_id:
            die_uploading(step, fail=True)
    if args.fail_downloading is not None:
        who, step = map(int, args.fail_downloading.split(":"))
        if who == args.process_id:
            fail_downloading(step)
    if args.fail_local_save is not None:
        who, step = map(int, args.fail_local_save.split(":"))
        if who == args.process_id:
            fail_local_save(step)
    plan = ["ok"]
    if args.plan:
        plan_file = f"{args.plan}.p{args.process_id}"
        with open(plan_file) as f:
            lines = f.read().splitlines()
        plan = lines[0].split() if lines else ["ok"]
        with open(plan_file, "w") as f:
            f.write("\n".join(lines[1:]))
        with open(plan_file + ".starts", "a") as f:
            f.write(" ".join(plan) + "\n")
    if args.num_processes > 1:
        jax.distributed.initialize(f"127.0.0.1:{args.port}", args.num_processes,
                                   args.process_id, initialization_timeout=60,
                                   heartbeat_timeout_seconds=args.heartbeat_secs)

    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import loopkit
    from loopkit.plugins.checkpoint import RESTORED_TIER

    # --momentum: auto axes, where a compiled init leaves `m`'s placement to XLA (on
    # explicit axes, jax.make_mesh's default, the trace's types already carry it)
    axis_types = (jax.sharding.AxisType.Auto if args.momentum else jax.sharding.AxisType.Explicit,)
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=axis_types)
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P("data"))
    true_w = np.linspace(-1.0, 1.0, 8).astype(np.float32)

    w_sharding = NamedSharding(mesh, P("data")) if args.shard_state else replicated
    data_len = int(args.data_lens.split(",")[args.process_id]) if args.data_lens else None

    def init():
        if args.host_local:
            seed = jax.process_index() if args.differ else 0
            return {"w": jnp.full(8, float(seed)), "b": jnp.zeros(())}
        state = {"w": jax.device_put(jnp.zeros(8), w_sharding),
                 "b": jax.device_put(jnp.zeros(()), replicated)}
        if args.momentum:  # as optax's state: placed like `w` by zeros_like, not by init
            state["m"] = jnp.zeros_like(state["w"])
        return state

    def data(start_step):
        n, i = jax.process_count(), jax.process_index()
        if args.host_local:  # every process reads the whole batch
            n, i = 1, 0
        rows = slice(i * 16 // n, (i + 1) * 16 // n)
        step = start_step
        while data_len is None or step < data_len:
            if plan[0] == "hang" and step == int(plan[1]):
                threading.Event().wait()
            x = np.random.default_rng(step).normal(size=(16, 8)).astype(np.float32)
            yield x[rows], (x @ true_w + 0.5)[rows]
            step += 1

    class Rows:
        """`data` as a stateful iterator: its state is the next step's batch."""

        def __init__(self):
            self.state = {"next": 0}
            self.batches = None

        def __iter__(self):
            return self

        def __next__(self):
            if self.batches is None:
                self.batches = data(self.state["next"])
            batch = next(self.batches)
            self.state = {"next": self.state["next"] + 1}
            return batch

        def get_state(self):
            return dict(self.state)

        def set_state(self, state):
            self.state, self.batches = dict(state), None

    def step_fn(state, batch):
        x, y = batch
        wb = {"w": state["w"], "b": state["b"]}
        loss, g = jax.value_and_grad(lambda s: jnp.mean((x @ s["w"] + s["b"] - y) ** 2))(wb)
        if "m" not in state:
            return jax.tree.map(lambda a, b: a - 0.05 * b, state, g), {"loss": loss}
        m = 0.9 * state["m"] + g["w"]
        return {"w": state["w"] - 0.05 * m, "b": state["b"] - 0.05 * g["b"], "m": m}, \
            {"loss": loss}

    def host(state):
        from jax.experimental import multihost_utils

        return {k: multihost_utils.process_allgather(v, tiled=True)
                if not v.is_fully_addressable and not v.is_fully_replicated
                else jax.device_get(v) for k, v in state.items()}

    class Pace:
        """Makes this process slower than the others, and says when it is running."""

        session = None

        @loopkit.hookimpl
        def session_create(self, session):
            Pace.session = session
            np.savez(args.out + ".ready.npz", **host(session.state))  # what it started from
            local = all(x.is_fully_addressable for x in jax.tree.leaves(session.state))
            print(f"READY {session.step} host_local={local}", flush=True)
            print(f"TIER {session.stash.get(RESTORED_TIER)}", flush=True)
            if args.stateful:
                print(f"POS {session.input.source.get_state()['next']}", flush=True)
            backend = session.plugin_manager.get_plugin("checkpoint").backend
            fetched = getattr(backend, "last_fetch", None)  # a URL logdir: what it downloaded
            if fetched is not None:
                print(f"FETCHED {fetched[0]} of {fetched[1]}", flush=True)
            for name, x in sorted(session.state.items()):  # where each leaf now lives
                # from the sharding: JAX 0.10's `addressable_shards` raises for an init
                # leaf `device_put` to a multi-process sharding (a JAX quirk, seen here)
                shards = [tuple(x.sharding.shard_shape(x.shape))]
                print(f"SHARDING {name} spec={tuple(getattr(x.sharding, 'spec', ()))} "
                      f"devices={len(x.sharding.device_set)} "
                      f"local={len(x.sharding.addressable_devices)}x{shards}", flush=True)

        @loopkit.hookimpl
        def on_stop(self, session, error):
            print(f"STOPPED {session.step} {type(error).__name__}", flush=True)

        @loopkit.hookimpl
        def after_step(self, step):
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if plan[0] == "crash" and step == int(plan[1]):
                # once the saves started before the kill have committed (under load an
                # upload may outlast the steps to the kill), so what survives is known
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and any(
                        t.name.startswith("loopkit-checkpoint") and "-commit-" in t.name
                        for t in threading.enumerate()):
                    time.sleep(0.01)
                local = Pace.session.plugin_manager.get_plugin("checkpoint").local
                if local is not None and local.peers is not None:
                    local.peers.wait(60)  # and their copies on the peers are complete,
                    from jax._src import distributed  # the others' copies here too

                    distributed.global_state.client.wait_at_barrier(f"crash-{step}", 60_000)
                os.kill(os.getpid(), signal.SIGKILL)

    tiers = {} if args.local_dir is None else dict(
        local_checkpoint_dir=args.local_dir,
        save_local_steps=3, save_local_secs=None, local_replicas=args.local_replicas)
    r = loopkit.train(step_fn, init=init, data=Rows() if args.stateful else data,
                      data_sharding=None if args.host_local else batch_sharding,
                      logdir=args.logdir, max_steps=args.max_steps, plugins=[Pace()],
                      save_model_secs=args.save_secs, save_model_steps=args.save_steps,
                      save_summaries_steps=5, progress=False,
                      hang_timeout_secs=args.hang_secs, checkpoint_backend=args.backend,
                      startup_timeout_secs=args.startup_secs,
                      **tiers)
    state = host(r.state)
    np.savez(args.out, step=r.step, **state)
    print(f"RESULT {r.step} {r.stop_reason}", flush=True)
    if args.num_processes > 1:
        jax.distributed.shutdown()


def die_uploading(step, fail=False):
    """SIGKILL this process once it has uploaded one object of its part of `step`
    (`fail`: raise OSError there instead)."""
    from loopkit import storage

    upload = storage.upload_tree

    def upload_then_die(local, url):
        if not str(url).rstrip("/").endswith(f"-{step}"):
            return upload(local, url)
        fs, base = storage.filesystem(url)
        first = sorted(p for p in __import__("pathlib").Path(local).rglob("*") if p.is_file())[0]
        fs.put_file(str(first), f"{base}/{first.relative_to(local).as_posix()}")
        if fail:
            raise OSError(f"injected upload failure after the first object of {url}")
        print(f"DYING uploading {url}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    storage.upload_tree = upload_then_die


def die_copying(step):
    """SIGKILL this process once the first file of its part of local step `step` has
    reached its peer (the copy runs in the background: the loop is somewhere after the
    local commit)."""
    from loopkit.plugins.checkpoint import peer_transfer

    send = peer_transfer._Connection.send

    def send_then_die(self, method, path, query, body=None, length=0):
        answer = send(self, method, path, query, body, length)
        if method == "PUT" and int(query["step"]) == step:
            answer.read()  # the peer has written that file
            print(f"DYING copying {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return answer

    peer_transfer._Connection.send = send_then_die


def fail_downloading(step):
    """This process's download of the checkpoint of `step` from a URL logdir finds an
    object missing."""
    from loopkit.plugins.checkpoint.backends.staged import StagedBackend

    fetch = StagedBackend._fetch

    def fetch_or_fail(self, at, like=None):
        if at == step:
            raise FileNotFoundError(f"injected download failure of step {step}")
        return fetch(self, at, like)

    StagedBackend._fetch = fetch_or_fail


def fail_local_save(step):
    """The orbax backend's save of `step` on this process fails once orbax has written it,
    and only when the loop has come to wait for that save (the next local save's join),
    so the next save always finds it in flight, waits for it and meets the failure."""
    from loopkit.plugins.checkpoint.backends.orbax import OrbaxBackend
    from loopkit.plugins.checkpoint.tier import Commit

    wait, join = OrbaxBackend.wait, Commit.join
    joined = threading.Event()

    def wait_then_fail(self):
        pending = self._pending
        wait(self)
        if pending == step:
            joined.wait(120)
            raise OSError(f"injected local save failure of step {step}")

    def join_and_tell(self, stopping, grace_secs):
        if self.step == step:
            joined.set()
        return join(self, stopping, grace_secs)

    OrbaxBackend.wait = wait_then_fail
    Commit.join = join_and_tell


if __name__ == "__main__":
    sys.exit(main())
