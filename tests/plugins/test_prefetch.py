"""Tests of the built-in `prefetch` plugin: order, stops, errors, placement, positions."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopkit.testing import kill_after_checkpoint

import loopkit
from loopkit import hookimpl
from loopkit.plugins import prefetch

REPO = Path(__file__).resolve().parents[2]
QUIET = dict(progress=False, save_summaries_secs=0, save_model_secs=0, jit=False)


def prefetch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("loopkit-prefetch")]


class Stateful:
    """grain's protocol over `values`; each read sleeps `delay` (after `slow_after` reads)."""

    def __init__(self, values, delay=0.0, slow_after=0):
        self.values, self.delay, self.slow_after, self.i = values, delay, slow_after, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= len(self.values):
            raise StopIteration
        if self.delay and self.i >= self.slow_after:
            time.sleep(self.delay)
        self.i += 1
        return self.values[self.i - 1]

    def get_state(self):
        return {"i": self.i}

    def set_state(self, state):
        self.i = state["i"]


class Probe:
    """Finds the prefetch plugin; every `every` steps records (step, position, batches read)."""

    def __init__(self, every=None):
        self.every, self.positions, self.session = every, [], None

    @hookimpl
    def session_create(self, session):
        self.session = session
        self.plugin = session.plugin_manager.get_plugin("prefetch")
        if self.every:
            session.every(self.record, steps=self.every)

    def record(self, session):
        feed = self.plugin.feed
        self.positions.append(
            (session.step, session.input.position(session.step), feed.read))


def wait_for(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(1e-3)


def recording_step(seen, delay=0.0):
    def step(state, batch):
        if delay:
            time.sleep(delay)
        seen.append(batch)
        return state + 1, {}
    return step


# -- order, exhaustion ---------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 3])
def test_order_preserved_with_parallel_transform(threads):
    rng = random.Random(0)
    delays = [rng.random() * 0.003 for _ in range(60)]

    def transform(i):
        time.sleep(delays[i])  # later batches often finish first
        return i * 10

    seen = []
    r = loopkit.train(recording_step(seen), init=0, data=range(60), prefetch=4,
                      prefetch_threads=threads, data_transform=transform, **QUIET)
    assert seen == [i * 10 for i in range(60)]
    assert (r.step, r.stop_reason) == (60, "data_exhausted")
    assert prefetch_threads() == []


def test_exhaustion_after_queued_batches_are_consumed():
    seen, probe = [], Probe()
    r = loopkit.train(recording_step(seen, delay=0.005), init=0, data=Stateful(range(12), 1e-3),
                      prefetch=8, plugins=[probe], **QUIET)
    assert seen == list(range(12))
    assert (r.step, r.stop_reason) == (12, "data_exhausted")


def test_the_source_is_read_in_the_reader_thread():
    readers = []

    def source():
        for i in range(300):
            readers.append(threading.current_thread().name)
            yield i

    seen = []
    r = loopkit.train(recording_step(seen), init=0, data=source(), **QUIET)
    assert seen == list(range(300)) and r.stop_reason == "data_exhausted"
    assert set(readers) == {"loopkit-prefetch-reader"}


def test_small_batches_in_a_list_are_read_by_the_loop():
    threads = []

    def step(state, batch):
        threads.append(prefetch_threads())
        return state + batch, {}

    r = loopkit.train(step, init=0, data=list(range(100)), **QUIET)
    assert (r.state, r.stop_reason) == (sum(range(100)), "data_exhausted")
    assert threads == [[]] * 100
    # with a transform, a list goes through the reader thread like any source
    readers = []

    def transform(i):
        readers.append(threading.current_thread().name)
        return i

    loopkit.train(step, init=0, data=list(range(100)), data_transform=transform, **QUIET)
    assert set(readers) == {"loopkit-prefetch-reader"}


def test_source_turning_slow_keeps_order_and_positions():
    seen, probe = [], Probe(every=7)
    src = Stateful(range(400), delay=1e-3, slow_after=100)
    loopkit.train(recording_step(seen), init=0, data=src, plugins=[probe], prefetch=4, **QUIET)
    assert seen == list(range(400))
    assert_positions_resume(probe.positions, seen, lambda: Stateful(range(400)))


def test_wait_for_a_slow_source_is_counted():
    probe = Probe()
    loopkit.train(recording_step([]), init=0, data=Stateful(range(5), 0.01), plugins=[probe],
                  **QUIET)
    assert probe.session.stats.input_wait_secs > 0


# -- errors --------------------------------------------------------------------------


def test_source_error_keeps_type_and_message_and_names_the_thread():
    def source():
        for i in range(7):
            time.sleep(1e-3)
            yield i
        raise ValueError("bad record 7 in shard-3")

    seen = []
    with pytest.raises(ValueError) as info:
        loopkit.train(recording_step(seen), init=0, data=source(), **QUIET)
    assert info.value.args == ("bad record 7 in shard-3",)
    assert any("'loopkit-prefetch-reader'" in n and "data source" in n
               for n in info.value.__notes__), info.value.__notes__
    assert seen == list(range(len(seen)))
    assert prefetch_threads() == []


@pytest.mark.parametrize("threads, thread", [(1, "reader"), (2, "transform-")])
def test_transform_error_names_the_thread(threads, thread):
    def transform(i):
        if i == 5:
            raise KeyError("no label for 5")
        return i

    with pytest.raises(KeyError, match="no label for 5") as info:
        loopkit.train(recording_step([]), init=0, data=range(50), data_transform=transform,
                      prefetch_threads=threads, **QUIET)
    notes = info.value.__notes__
    assert len(notes) == 1, notes
    assert re.search(rf"'loopkit-prefetch-{thread}\d*'.*Config.data_transform", notes[0]), notes
    assert prefetch_threads() == []


# -- stopping ------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_stop_with_producer_blocked_on_a_full_queue():
    probe = Probe()

    def step(state, batch):
        feed = probe.plugin.feed  # hold the first step until the reader waits for room
        wait_for(lambda: feed.read >= 50 and feed.wants_room)
        return state + 1, {}

    t0 = time.monotonic()
    r = loopkit.train(step, init=0, data=Stateful(range(10**6), delay=2e-4), prefetch=50,
                      max_steps=3, plugins=[probe], stop_grace_secs=5, **QUIET)
    assert (r.step, r.stop_reason) == (3, "max_steps")
    assert time.monotonic() - t0 < 30
    assert prefetch_threads() == []


@pytest.mark.timeout(60)
def test_stop_while_the_source_blocks(caplog):
    release = threading.Event()

    def source():
        yield from range(3)
        release.wait()  # blocks until the test lets it go
        yield 3

    class StopSoon:  # once the loop waits for the 4th batch
        @hookimpl
        def session_create(self, session):
            def stop():
                wait_for(lambda: session.step == 3)
                time.sleep(0.2)
                session.request_stop()
            session.loop(None, stop)

    t0 = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING):
            r = loopkit.train(recording_step([]), init=0, data=source(), plugins=[StopSoon()],
                              prefetch_threads=1, stop_grace_secs=1, **QUIET)
        assert time.monotonic() - t0 < 30
        assert (r.step, r.stop_reason) == (3, "requested")
        assert any("loopkit-prefetch-reader" in m and "stop_grace_secs" in m
                   for m in caplog.messages), caplog.messages
    finally:
        release.set()
    for t in threading.enumerate():
        if t.name.startswith("loopkit-prefetch"):
            t.join(10)
    assert prefetch_threads() == []


# -- placement -----------------------------------------------------------------------


@pytest.mark.parametrize("depth", [0, 3])
def test_data_sharding_assembles_global_arrays(depth):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    batches = [{"x": np.full((4, 2), i, np.float32)} for i in range(40)]
    seen = []
    loopkit.train(recording_step(seen), init=0, data=batches, data_sharding=sharding,
                  prefetch=depth, **QUIET)
    assert len(seen) == 40
    for i, b in enumerate(seen):
        assert isinstance(b["x"], jax.Array) and b["x"].sharding == sharding
        np.testing.assert_array_equal(b["x"], batches[i]["x"])


def test_large_batches_are_placed_ahead(monkeypatch):
    monkeypatch.setattr(prefetch, "PLACE_MIN_BYTES", 64)
    batches = [np.full((4, 4), i, np.float32) for i in range(30)]  # 64 bytes each
    seen = []
    loopkit.train(recording_step(seen, delay=1e-3), init=0, data=batches, prefetch=8, **QUIET)
    assert all(isinstance(b, jax.Array) for b in seen)
    assert [int(b[0, 0]) for b in seen] == list(range(30))


def test_small_batches_reach_the_jitted_step_as_given():
    r = loopkit.train(lambda s, b: (s + b.sum(), {}), init=jnp.zeros(()),
                      data=[np.ones(3, np.float32)] * 50, progress=False,
                      save_summaries_secs=0, save_model_secs=0)
    assert float(r.state) == 150.0


def test_prefetch_zero_still_applies_the_transform_in_the_loop():
    seen = []
    loopkit.train(recording_step(seen), init=0, data=range(5), prefetch=0,
                  data_transform=lambda i: -i, **QUIET)
    assert seen == [0, -1, -2, -3, -4]
    with pytest.raises(ZeroDivisionError) as info:
        loopkit.train(recording_step([]), init=0, data=range(5), prefetch=0,
                      data_transform=lambda i: 1 / (i - 3), **QUIET)
    assert info.value.__notes__ == [
        "raised in loopkit's prefetch plugin running Config.data_transform in the loop's thread"]
    with loopkit.Supervisor(prefetch=0, **QUIET).managed_session(lambda s: (s, {}), 0) as sess:
        assert "prefetch" in sess.plugin_manager.inactive


def test_supervisor_idiom_is_left_alone():
    probe, seen = Probe(), []
    sv = loopkit.Supervisor(plugins=[probe], **QUIET)
    with sv.managed_session(recording_step(seen), init=0) as sess:
        sess.run(7)
    assert seen == [7]
    assert probe.session.input is None and probe.plugin.feed is None


# -- positions and resume -------------------------------------------------------------


def assert_positions_resume(positions, seen, fresh):
    """Each recorded position, restored into a fresh iterator, yields the next batch."""
    assert positions
    for step, pos, _ in positions:
        json.dumps(pos)
        it = fresh()
        it.set_state(pos)
        rest = list(it)
        assert rest == seen[step:], f"position {pos} at step {step}"


def test_position_is_the_last_consumed_batch_not_the_readers():
    seen, probe = [], Probe(every=3)

    def step(state, batch):  # let the reader get ahead of every step
        wait_for(lambda: probe.plugin.feed.read >= min(60, len(seen) + 4))
        seen.append(batch)
        return state + 1, {}

    loopkit.train(step, init=0, data=Stateful(range(60), 1e-4), prefetch=8, plugins=[probe],
                  **QUIET)
    assert seen == list(range(60))
    assert all(read > step for step, _, read in probe.positions[:-1])  # it did read ahead
    assert_positions_resume(probe.positions, seen, lambda: Stateful(range(60)))

    # a new run started from a recorded position goes on with the same batches
    step, pos, _ = probe.positions[4]
    src, rest = Stateful(range(60), 3e-4), []
    src.set_state(pos)
    loopkit.train(recording_step(rest), init=0, data=src, prefetch=8, **QUIET)
    assert rest == seen[step:]


def test_grain_iterator_positions_resume_exactly():
    def dataset():
        return (grain.MapDataset.range(80).shuffle(seed=3)
                .map(lambda i: np.int64(i) * 2).to_iter_dataset())

    seen, probe = [], Probe(every=5)
    it = iter(dataset())
    loopkit.train(recording_step(seen, delay=1e-3), init=0, data=it, prefetch=6,
                  plugins=[probe], **QUIET)
    assert sorted(seen) == list(range(0, 160, 2)) and seen != sorted(seen)
    assert_positions_resume(probe.positions, seen, lambda: iter(dataset()))


# -- exact resume after SIGKILL, through the checkpoint plugin's npz backend ------------

WORKER = textwrap.dedent("""
    import json, sys, time
    import jax.numpy as jnp, numpy as np, loopkit

    logdir, protocol, n = sys.argv[1], sys.argv[2], 60
    order = np.random.default_rng(0).permutation(n).tolist()

    class Stateful:
        def __init__(self): self.i = 0
        def __iter__(self): return self
        def __next__(self):
            if self.i >= n: raise StopIteration
            time.sleep(5e-4)  # a reader slower than a list, so the plugin keeps a thread
            self.i += 1
            return order[self.i - 1]
        def get_state(self): return {"i": self.i}
        def set_state(self, s): self.i = s["i"]

    def from_step(start):
        for i in range(start, n):
            time.sleep(5e-4)
            yield order[i]

    def step(state, batch):
        time.sleep(0.02)  # a slow step: the reader runs `prefetch` batches ahead
        i = state["i"]
        return {"seq": state["seq"].at[i].set(batch), "i": i + 1}, {}

    start = loopkit.latest_checkpoint(logdir)
    print("START", 0 if start is None else start[0], flush=True)
    r = loopkit.train(step, init={"seq": jnp.full((n,), -1), "i": jnp.zeros((), jnp.int32)},
                      data=Stateful() if protocol == "stateful" else from_step,
                      logdir=logdir, checkpoint_backend="npz", save_model_steps=5,
                      save_model_secs=0, save_summaries_secs=0, progress=False, jit=False,
                      prefetch=8, max_steps=n)
    print("SEQ", json.dumps(np.asarray(r.state["seq"]).tolist()), r.stop_reason, flush=True)
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", ["stateful", "callable"])
def test_killed_and_resumed_run_consumes_the_same_batches(tmp_path, protocol):
    script, logdir = tmp_path / "worker.py", tmp_path / "run"
    script.write_text(WORKER)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, str(script), str(logdir), protocol]
    kill_after_checkpoint(cmd, logdir, 10, env)

    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    start = int(re.search(r"^START (\d+)$", out.stdout, re.M).group(1))
    assert 10 <= start < 60
    seq, reason = re.search(r"^SEQ (\[.*\]) (\w+)$", out.stdout, re.M).groups()
    order = np.random.default_rng(0).permutation(60).tolist()
    assert json.loads(seq) == order
    assert reason == "max_steps"


# -- docs ------------------------------------------------------------------------------


def test_docs_input_examples_run(tmp_path, monkeypatch):
    text = (REPO / "docs" / "input.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/input.md[block {i}]", "exec"), {"__name__": "__main__"})


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_batches_already_on_the_device_are_read_ahead_only_prefetch_deep(depth):
    # gemma port: device batches counted as 0 bytes were buffered 1,024 deep
    reads = 0

    def data():
        nonlocal reads
        while True:
            reads += 1
            yield jnp.zeros((256 * 1024,), jnp.float32)  # 1 MiB, on the device

    class Slow:
        @loopkit.hookimpl
        def after_step(self):
            time.sleep(0.002)

    loopkit.train(lambda s, b: (s + b[0], {}), init=jnp.zeros(()), data=data(),
                  max_steps=100, prefetch=depth, plugins=[Slow()], progress=False,
                  autoload=False)
    # the buffer, plus the batch a blocked producer holds in hand
    assert reads - 100 <= depth + 1, f"{reads - 100} batches read ahead with prefetch={depth}"


def test_small_device_batches_are_bounded_too():
    reads = 0

    def data():
        nonlocal reads
        while True:
            reads += 1
            yield jnp.full((4,), 1.0)  # small, but device memory all the same

    class Slow:
        @loopkit.hookimpl
        def after_step(self):
            time.sleep(0.002)

    loopkit.train(lambda s, b: (s + b[0], {}), init=jnp.zeros(()), data=data(),
                  max_steps=50, prefetch=2, plugins=[Slow()], progress=False, autoload=False)
    assert reads - 50 <= 3
