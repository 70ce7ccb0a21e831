"""`on_guard="rollback"`: a bad value restores the last checkpoint before it, the batches
since are skipped, and the run equals, bit for bit, one whose data never held them."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
import time

import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from loopkit.testing import free_port, run_processes

N = 30  # steps of every run here
P = 14  # the poisoned batch (0-based): step 15 consumes it
# saves every 5 steps: step 15 (bad) is saved before the guard sees it at step 16;
# the rollback deletes it, restores step 10 and skips the batches of steps 11..16
SKIPPED = (10, 16)


def value(i: int) -> np.float32:
    return np.float32((i * 37 % 11 + 1) / 11)


def source(poison=(), skip=(0, 0)):
    """A callable data(start): batch i is `value(i)`, NaN at `poison`; the batches in
    `skip` ([first, end)) are not in the data at all."""
    kept = lambda i: i if i < skip[0] else i + skip[1] - skip[0]

    def data(start):
        i = start
        while True:
            j = kept(i)
            yield np.float32("nan") if j in poison else value(j)
            i += 1
    return data


def step_fn(state, batch):
    w = state["w"] * 0.9 + jnp.sin(state["w"] * batch) * 0.1 + batch
    return {"w": w, "n": state["n"] + 1}, {"loss": jnp.mean(w) * batch}


def init():
    return {"w": jnp.linspace(0.0, 1.0, 8, dtype=jnp.float32), "n": jnp.zeros((), jnp.int32)}


class Rollbacks:
    """Records the `on_rollback` hook (what a ledger plugin would consume)."""

    def __init__(self):
        self.records = []

    @loopkit.hookimpl
    def on_rollback(self, session, record):
        self.records.append((record, session.step))


def run(logdir, data, plugins=(), **kw):
    fields = dict(max_steps=N, save_model_steps=5, save_model_secs=None,
                  nan_guard="loss", on_guard="rollback", progress=False)
    return loopkit.train(step_fn, init=init, data=data, logdir=str(logdir), plugins=plugins,
                         **{**fields, **kw})


def same_bits(a, b):
    assert a.step == b.step
    for k in a.state:
        x, y = np.asarray(a.state[k]), np.asarray(b.state[k])
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), k


def test_poisoned_callable_rolls_back_and_equals_a_clean_run(tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rec = Rollbacks()
    with caplog.at_level(logging.WARNING, logger="loopkit"):
        rolled = run(tmp_path / "a", source({P}), plugins=[rec])
    clean = run(tmp_path / "b", source(skip=SKIPPED))
    same_bits(rolled, clean)
    assert int(rolled.state["n"]) == N  # the skipped steps were not counted
    (record, at), = rec.records
    assert record == loopkit.RollbackRecord(15, 10, SKIPPED, "loss", record.value)
    assert record.value != record.value and at == 10  # NaN; the session went back to 10
    msg = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "'loss'" in msg and "step 15" in msg and "rolled back to step 10" in msg
    assert "skipping batches [10, 16) (6)" in msg and "model.ckpt-15" in msg  # deleted
    acc = EventAccumulator(str(tmp_path / "a"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loopkit/rollbacks")] == [(15, 1.0)]
    # every later checkpoint says where the input stands and what was skipped
    import orbax.checkpoint as ocp  # noqa: F401 - the backend that wrote it

    assert loopkit.latest_checkpoint(tmp_path / "a")[0] == N
    # the save timer went back with the step: 15 was saved again, from the good state
    saved = sorted(int(p.name.rsplit("-", 1)[1]) for p in (tmp_path / "a").glob("model.ckpt-*"))
    assert saved == [10, 15, 20, 25, 30]


def test_a_newer_local_checkpoint_is_the_one_rolled_back_to(tmp_path):
    # durable every 10 steps, local every 3: step 15 (bad) was saved locally before the
    # guard saw it; the newest step before it is local 12, not durable 10
    rec = Rollbacks()
    local = tmp_path / "local"
    rolled = run(tmp_path / "a", source({P}), plugins=[rec], save_model_steps=10,
                 local_checkpoint_dir=str(local), save_local_steps=3, save_local_secs=None)
    clean = run(tmp_path / "b", source(skip=(12, 16)), save_model_steps=10)
    same_bits(rolled, clean)
    (record, at), = rec.records
    assert (record.step, record.restored_step, record.skipped, at) == (15, 12, (12, 16), 12)
    assert loopkit.latest_checkpoint(local)[0] == 27  # saved on after it (the final: durable)


def test_an_unreadable_newer_checkpoint_is_passed_over_and_deleted(tmp_path, caplog):
    # local 12 is corrupted before the bad step: the rollback reads durable 10 instead,
    # and deletes local 12, whose steps used batches that are now skipped: a crash right
    # after the rollback must not resume from it
    local = tmp_path / "local"

    class Corrupt:
        done = False

        @loopkit.hookimpl
        def before_step(self, session, step):
            if step == 14 and not self.done:  # once: step 14 comes again after the rollback
                self.done = True
                ckpt = local / "model.ckpt-12"
                while not ckpt.exists():  # published once committed
                    time.sleep(0.01)
                for f in ckpt.rglob("*"):
                    if f.is_file() and f.stat().st_size and "metadata" not in f.name:
                        f.write_bytes(b"x" * f.stat().st_size)

    class OnDisk:
        seen = None

        @loopkit.hookimpl
        def on_rollback(self, record):
            OnDisk.seen = sorted(p.name for p in local.glob("model.ckpt-*"))

    rec = Rollbacks()
    with caplog.at_level(logging.WARNING, logger="loopkit"):
        rolled = run(tmp_path / "a", source({P}), plugins=[rec, Corrupt(), OnDisk()],
                     save_model_steps=10, local_checkpoint_dir=str(local),
                     save_local_steps=3, save_local_secs=None, max_to_keep_local=10)
    (record, _), = rec.records
    assert (record.restored_step, record.skipped) == (10, (10, 16))
    assert OnDisk.seen == ["model.ckpt-3", "model.ckpt-6", "model.ckpt-9"]
    msg = "\n".join(r.getMessage() for r in caplog.records)
    assert "model.ckpt-12 is unreadable (" in msg and "on process" not in msg
    assert "model.ckpt-12: it holds steps after 10, whose batches are skipped" in msg
    same_bits(rolled, run(tmp_path / "b", source(skip=(10, 16)), save_model_steps=10))


def test_no_checkpoint_before_the_bad_step_goes_back_to_the_initial_state(tmp_path):
    rolled = run(tmp_path / "a", source({3}), save_model_steps=None)
    clean = run(tmp_path / "b", source(skip=(0, 5)), save_model_steps=None)
    same_bits(rolled, clean)


def test_a_grain_iterator_is_restored_and_advanced(tmp_path):
    grain = pytest.importorskip("grain")
    values = [value(i) for i in range(N + 10)]
    poisoned = [np.float32("nan") if i == P else v for i, v in enumerate(values)]
    kept = values[:SKIPPED[0]] + values[SKIPPED[1]:]

    def loader(items):
        return iter(grain.MapDataset.source(items).to_iter_dataset())

    it = loader(poisoned)
    assert callable(it.get_state) and callable(it.set_state)
    rolled = run(tmp_path / "a", it)
    clean = run(tmp_path / "b", loader(kept))
    same_bits(rolled, clean)


def test_the_budget_ends_the_run_with_non_finite_error(tmp_path):
    rec = Rollbacks()
    with pytest.raises(loopkit.NonFiniteError) as info:
        run(tmp_path, source({P, 22}), plugins=[rec], max_rollbacks=1)
    assert [r.step for r, _ in rec.records] == [15]
    assert "max_rollbacks=1" in "\n".join(info.value.__notes__)
    with pytest.raises(loopkit.NonFiniteError):
        run(tmp_path / "zero", source({P}), max_rollbacks=0)


def test_a_finite_spike_is_caught(tmp_path):
    def spiky(start):
        i = start
        while True:
            yield np.float32(1000.0 * 10) if i == 20 else value(i)
            i += 1

    with pytest.raises(loopkit.SpikeError) as info:
        run(tmp_path / "raise", spiky, on_guard="raise", spike_threshold=100, spike_window=10)
    err = info.value
    assert isinstance(err, loopkit.NonFiniteError) and err.step == 21 and err.threshold == 100
    assert err.value > 100 * err.median > 0 and "spiked" in str(err)

    rec = Rollbacks()
    r = run(tmp_path / "roll", spiky, plugins=[rec], spike_threshold=100, spike_window=10)
    assert r.step == N and [(x.step, x.restored_step) for x, _ in rec.records] == [(21, 20)]
    assert isinstance(rec.records[0][0].value, float) and rec.records[0][0].value > 1000


def test_a_plain_list_is_refused_at_start_up(tmp_path):
    with pytest.raises(ValueError, match=r"on_guard='rollback'.*plain iterable.*"
                                         r"data\(start\).*get_state\(\)/set_state\(\)"):
        run(tmp_path, [np.float32(1.0)] * 40)
    assert loopkit.latest_checkpoint(tmp_path) is None  # nothing trained, nothing saved


WORKER = textwrap.dedent("""
    import sys, time
    import numpy as np, loopkit
    sys.path.insert(0, {tests!r})
    from test_rollback import source, step_fn, init, P, N

    slow = lambda s, b: (time.sleep(0.03), step_fn(s, b))[1]
    r = loopkit.train(slow, init=init, data=source({{P}}), logdir=sys.argv[1], max_steps=N,
                      save_model_steps=5, save_model_secs=None, nan_guard="loss",
                      on_guard="rollback", progress=False)
    np.savez(sys.argv[2], **{{k: np.asarray(v) for k, v in r.state.items()}})
    print("done", r.step, flush=True)
""")


@pytest.mark.timeout(300)
def test_sigkill_after_the_rollback_and_a_resume_give_the_same_bits(tmp_path):
    from loopkit.testing import kill_after_checkpoint

    script, logdir, out = tmp_path / "worker.py", tmp_path / "run", tmp_path / "final.npz"
    script.write_text(WORKER.format(tests=os.path.dirname(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, str(script), str(logdir), str(out)]
    # step 15 again, after the rollback: its checkpoint holds the skipped batches
    kill_after_checkpoint(cmd, logdir, 20, env)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(rf"^done {N}$", done.stdout, re.M)
    assert "rolled back" not in done.stderr  # the resume found the skip in the checkpoint
    clean = run(tmp_path / "clean", source(skip=SKIPPED))
    with np.load(out) as resumed:
        for k in clean.state:
            assert resumed[k].tobytes() == np.asarray(clean.state[k]).tobytes(), k


TWO = textwrap.dedent("""
    import sys, jax
    jax.distributed.initialize(f"127.0.0.1:{{sys.argv[3]}}", 2, int(sys.argv[2]))
    import jax.numpy as jnp, numpy as np, loopkit
    sys.path.insert(0, {tests!r})
    from test_rollback import value, init, P, N

    me = jax.process_index()
    def data(start):                       # the same batches; the loss is poisoned on process 1
        i = start
        while True:
            yield value(i), np.float32("nan") if (me == 1 and i == P) else np.float32(0)
            i += 1

    def step(state, batch):
        x, flag = batch
        w = state["w"] * 0.9 + jnp.sin(state["w"] * x) * 0.1 + x
        return {{"w": w, "n": state["n"] + 1}}, {{"loss": jnp.mean(w) * x + flag}}

    class Rec:
        @loopkit.hookimpl
        def on_rollback(self, record):
            print("ROLLBACK", record.step, record.restored_step, *record.skipped, flush=True)

    tiers = {{}}
    if len(sys.argv) > 4:                  # local tiers; process 1's step 12 made unreadable
        import os, pathlib, time
        local = pathlib.Path(sys.argv[4])
        tiers = dict(local_checkpoint_dir=str(local), save_local_steps=3, save_local_secs=None,
                     max_to_keep_local=10)

        class Corrupt:
            done = False

            @loopkit.hookimpl
            def before_step(self, session, step):
                if me == 1 and step == 14 and not self.done:
                    self.done = True
                    ckpt = local / "process-1" / "model.ckpt-12"
                    while not ckpt.exists():  # published once committed
                        time.sleep(0.01)
                    for f in ckpt.rglob("*"):
                        if f.is_file() and f.stat().st_size and "metadata" not in f.name:
                            f.write_bytes(b"x" * f.stat().st_size)
                    print("CORRUPTED", flush=True)
        Rec.corrupt = Corrupt()

    r = loopkit.train(step, init=init, data=data, logdir=sys.argv[1], max_steps=N,
                      save_model_steps=5, save_model_secs=None, nan_guard="loss",
                      on_guard="rollback", progress=False,
                      plugins=[Rec()] + ([Rec.corrupt] if tiers else []), **tiers)
    print("W", np.asarray(r.state["w"]).tobytes().hex(), r.step, flush=True)
""")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tiers", ["durable", "local unreadable on one process"])
def test_two_processes_roll_back_together(tmp_path, tiers):
    """The poison on one process rolls both back at the same step. With local tiers
    whose newest step before the bad one (12) one process cannot read, both go back to
    the durable step (10) together, instead of one raising alone."""
    port = free_port()
    script = tmp_path / "two.py"
    script.write_text(TWO.format(tests=os.path.dirname(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    local = [str(tmp_path / "local")] if tiers != "durable" else []
    ran = run_processes(lambda i: [sys.executable, str(script), str(tmp_path / "run"), str(i),
                                   str(port), *local], tmp_path, env=env, timeout=240)
    texts = [t for _, t in ran]
    assert [rc for rc, _ in ran] == [0, 0], texts
    rolls = [re.findall(r"^ROLLBACK (\d+) (\d+) (\d+) (\d+)$", t, re.M) for t in texts]
    assert rolls[0] == rolls[1] and len(rolls[0]) == 1, texts  # together, once
    bad, restored, first, end = map(int, rolls[0][0])
    # the durable save at step 15 checks step 15's value and carries the verdict
    assert (bad, restored, first, end) == (15, 10, 10, 15)
    if local:
        assert "CORRUPTED" in texts[1]
        assert "model.ckpt-12 is unreadable on process 1" in texts[1], texts[1][-3000:]
        for i in range(2):  # passed over on both: neither resumes it after a crash
            assert f"process-{i}/model.ckpt-12: it holds steps after 10" in texts[i], texts[i]
    finals = [re.search(r"^W (\w+) (\d+)$", t, re.M).groups() for t in texts]
    clean = run(tmp_path / "clean", source(skip=(first, end)))
    assert finals[0] == finals[1] == (np.asarray(clean.state["w"]).tobytes().hex(), str(N))


def test_a_rollback_is_a_line_of_the_goodput_ledger(tmp_path):
    run(tmp_path, source(poison=(P,)))
    lines = [x for x in (tmp_path / "goodput.jsonl").read_text().splitlines()
             if '"event":"rollback"' in x]
    assert len(lines) == 1, lines
    assert '"step":15' in lines[0] and '"to_step":10' in lines[0]
    assert f"batches [{SKIPPED[0]}, {SKIPPED[1]}) skipped" in lines[0]
    assert loopkit.goodput(tmp_path).rollbacks == 1


def test_a_rollback_to_the_initial_state_keeps_typed_keys_and_weak_types(tmp_path):
    """Every NNX model holds a typed key (`nnx.Rngs`), and a Python scalar in a state is
    weakly typed: the initial state kept for a rollback keeps both, and the run that
    goes back to it ends bit for bit where a run without the skipped batches ends."""
    import jax

    def keyed_step(state, batch):
        key, sub = jax.random.split(state["key"])
        w = state["w"] * 0.9 + jax.random.normal(sub, state["w"].shape) * 0.01 + batch
        return ({"key": key, "w": w, "lr": state["lr"] * 0.99, "scale": state["scale"] * 0.5},
                {"loss": jnp.mean(w) * batch})

    def keyed_init():
        return {"key": jax.random.key(7), "w": jnp.zeros(4, jnp.float32),
                "lr": jnp.asarray(0.5),  # weakly typed, as a Python scalar through jit is
                "scale": 2.0}  # a Python scalar

    assert keyed_init()["lr"].weak_type
    fields = dict(max_steps=12, save_model_steps=None, save_model_secs=None, nan_guard="loss",
                  on_guard="rollback", progress=False)
    rec = Rollbacks()
    rolled = loopkit.train(keyed_step, init=keyed_init, data=source({3}), plugins=[rec],
                           logdir=str(tmp_path / "a"), **fields)
    clean = loopkit.train(keyed_step, init=keyed_init, data=source(skip=(0, 5)),
                          logdir=str(tmp_path / "b"), **fields)
    (record, at), = rec.records
    assert (record.restored_step, record.skipped, at) == (0, (0, 5), 0)  # the initial state
    assert rolled.step == clean.step == 12
    key = rolled.state["key"]
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    assert (jax.random.key_data(key).tobytes()
            == jax.random.key_data(clean.state["key"]).tobytes())
    assert rolled.state["lr"].weak_type and rolled.state["lr"].dtype == jnp.float32
    assert rolled.state["scale"].weak_type
    loopkit.testing.assert_same_state(rolled.state, clean.state)  # dtype, weak type, bits


@pytest.mark.parametrize("reduce", ["last", "mean"])
def test_tensorboard_after_a_rollback_shows_the_run_without_the_skipped_batches(
        tmp_path, reduce):
    """Summaries every 5 steps: step 15 (bad) is written, with its NaN, before the guard
    sees it. After the rollback to 10 the events from 11 on are hidden (a new event file
    purging from there, as after a restart), no step is shown twice, and the interval
    mean starts afresh: TensorBoard's reader shows what the clean run shows."""
    from loopkit.testing import read_events, scalars

    kw = dict(save_summaries_steps=5, save_summaries_secs=None, summary_reduce=reduce)
    run(tmp_path / "a", source({P}), **kw)
    run(tmp_path / "b", source(skip=SKIPPED), **kw)
    rolled, clean = read_events(tmp_path / "a"), read_events(tmp_path / "b")
    loss = scalars(rolled, "loss")
    assert [s for s, _ in loss] == list(range(5, N + 1, 5))  # each step once
    assert all(np.isfinite(v) for _, v in loss)  # no skipped bad value, alone or in a mean
    assert loss == scalars(clean, "loss")
    for tag in rolled.Tags()["scalars"]:
        points = [s for s, _ in scalars(rolled, tag)]
        assert len(points) == len(set(points)), (tag, points)
    assert scalars(rolled, "loopkit/rollbacks") == [(15, 1.0)]  # not hidden by the purge
    assert len(list((tmp_path / "a").glob("events.out.tfevents.*"))) == 2  # one more file


def _cases():
    """[bad_process, bad_step, save_steps, save_secs]: the bad step at a save step (its
    state saved before the guard reads its value), just before one (the verdict not yet
    agreed when the save comes), further before, just after, at the last step; saves by
    step count and by time (wherever the agreement puts them), on either process."""
    steps = [(p, b, 5, None) for p, b in [(1, 15), (0, 15), (1, 14), (0, 14), (1, 13),
                                         (0, 10), (1, 11), (0, 16), (1, 20), (0, 24),
                                         (1, 29), (0, 30), (1, 5), (0, 4)]]
    timed = [(p, b, None, 0.02) for p, b in [(1, 8), (0, 12), (1, 17), (0, 21), (1, 26),
                                            (0, 29)]]
    return steps + timed


def _two_processes(tmp_path, cases: list) -> list[str]:
    """Run `cases` (tests/workers/rollback_worker.py) on a two-process job: its outputs."""
    import json

    port = free_port()
    worker = os.path.join(os.path.dirname(__file__), "..", "workers", "rollback_worker.py")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    ran = run_processes(lambda i: [sys.executable, worker, str(tmp_path), str(i), str(port),
                                   json.dumps(cases)], tmp_path, env=env, timeout=200)
    texts = [t for _, t in ran]
    assert [rc for rc, _ in ran] == [0, 0], [t[-3000:] for t in texts]
    return texts


@pytest.mark.timeout(240)
def test_a_bad_value_on_one_of_two_processes_before_a_durable_save_rolls_both_back(tmp_path):
    """Twenty runs of a two-process job (one `jax.distributed` start, each run a few
    seconds at most): process p's batch goes NaN, its host-local state with it, at or
    just before a durable save. The save carries the guard's verdict: no save of the
    bad state, both processes roll back at the same step, every time, and each run ends
    bit for bit where a run whose data never held the skipped batches ends."""
    cases = _cases()
    assert len(cases) == 20
    texts = _two_processes(tmp_path, cases)
    clean = {}
    for k, (_, bad, save_steps, _) in enumerate(cases):
        rolls = [re.findall(rf"^ROLLBACK {k} (\d+) (\d+) (\d+) (\d+)$", t, re.M) for t in texts]
        assert rolls[0] == rolls[1] and len(rolls[0]) == 1, (k, rolls)  # together, once
        step, restored, first, end = map(int, rolls[0][0])
        assert step == bad and first == restored < bad <= end, (k, rolls)  # batch bad-1 skipped
        if save_steps:
            assert restored == (bad - 1) // save_steps * save_steps, (k, restored)
            for t in texts:  # never saved: no checkpoint of the bad state to delete
                assert f"run-{k}/model.ckpt-{bad}: it holds" not in t, k
        finals = [re.search(rf"^W {k} (\w+) (\d+)$", t, re.M).groups() for t in texts]
        if (first, end) not in clean:
            r = run(tmp_path / f"clean-{first}-{end}", source(skip=(first, end)))
            clean[first, end] = np.asarray(r.state["w"]).tobytes().hex()
        assert finals[0] == finals[1] == (clean[first, end], str(N)), k


@pytest.mark.timeout(240)
def test_a_bad_value_near_the_end_of_two_processes_data_rolls_back_and_trains_to_its_end(
        tmp_path):
    """Finite data (30 batches) on two processes, so the end is agreed ahead: a bad value
    at the last step is rolled back, not raised at the stop; and a replay near the end
    trains the batches again to the data's end, not `back` steps short of it."""
    # [bad process, bad step, saves every, secs, the data's end, on_guard]
    cases = [[1, 30, 5, None, 30, "rollback"], [1, 30, 5, None, 30, "replay"],
             [0, 27, 5, None, 30, "replay"], [1, 27, 5, None, 30, "rollback"]]
    texts = _two_processes(tmp_path, cases)
    for k, (_, bad, _, _, end, on_guard) in enumerate(cases):
        rolls = [re.findall(rf"^ROLLBACK {k} (\d+) (\d+) (\d+) (\d+)$", t, re.M) for t in texts]
        assert rolls[0] == rolls[1], (k, rolls)  # together
        got = [tuple(map(int, r)) for r in rolls[0]]
        replayed = [(bad, 25, 25, 25)] if on_guard == "replay" else []  # the replay first
        # then skipped: the batches from the checkpoint to the agreed step (the vote's)
        skip_end = got[-1][3]
        assert got == replayed + [(bad, 25, 25, skip_end)] and bad <= skip_end <= end, k
        steps = end - (skip_end - 25)  # the data, without the skipped batches, to its end
        finals = [re.search(rf"^W {k} (\w+) (\d+)$", t, re.M).groups() for t in texts]
        clean = run(tmp_path / f"clean-{k}", source(skip=(25, skip_end)), max_steps=steps)
        want = (np.asarray(clean.state["w"]).tobytes().hex(), str(steps))
        assert finals[0] == finals[1] == want, (k, finals)
