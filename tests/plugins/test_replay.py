"""`on_guard="replay"`: a bad value rolls back and the same batches are trained again; the
bad value again at the same step is the data (skipped, as "rollback" does), not again
the machine (the re-run stands, nothing skipped, a "compute" fault in the ledger)."""

from __future__ import annotations

import logging
import socket

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import loopkit
from loopkit.plugins.goodput.records import Fault, read_records

N = 30  # steps of every run here
P = 14  # the bad batch (0-based): step 15 consumes it
# saves every 5: step 15 (bad) is saved before the guard sees it at step 16; the
# rollback restores step 10 and trains batches [10, 16) again
SKIPPED = (10, 16)


def value(i: int) -> np.float32:
    return np.float32((i * 37 % 11 + 1) / 11)


def source(poison=(), skip=(0, 0)):
    """A callable data(start): batch i is (i, `value(i)`), NaN at `poison`; the batches
    in `skip` ([first, end)) are not in the data at all."""
    kept = lambda i: i if i < skip[0] else i + skip[1] - skip[0]

    def data(start):
        i = start
        while True:
            j = kept(i)
            yield np.int32(j), np.float32("nan") if j in poison else value(j)
            i += 1
    return data


class Stateful:
    """An iterator with get_state()/set_state(): batch i is (i, `value(i)`)."""

    def __init__(self):
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.i += 1
        return np.int32(self.i - 1), value(self.i - 1)

    def get_state(self):
        return {"i": self.i}

    def set_state(self, state):
        self.i = state["i"]


class FlakyStep:
    """The step, whose output is NaN the first time it trains batch `bad` (a host counter
    behind an `io_callback`): the same batch gives a good value when trained again."""

    def __init__(self, bad=None):
        self.bad, self.runs = bad, {}

    def flag(self, i):
        i = int(i)
        self.runs[i] = self.runs.get(i, 0) + 1
        return np.float32("nan" if i == self.bad and self.runs[i] == 1 else 0.0)

    def __call__(self, state, batch):
        i, x = batch
        flag = io_callback(self.flag, jax.ShapeDtypeStruct((), jnp.float32), i)
        w = state["w"] * 0.9 + jnp.sin(state["w"] * x) * 0.1 + x + flag
        return {"w": w, "n": state["n"] + 1}, {"loss": jnp.mean(w) * x}


def init():
    return {"w": jnp.linspace(0.0, 1.0, 8, dtype=jnp.float32), "n": jnp.zeros((), jnp.int32)}


class Rollbacks:
    def __init__(self):
        self.records = []

    @loopkit.hookimpl
    def on_rollback(self, session, record):
        self.records.append((record.step, record.restored_step, record.skipped))


def run(logdir, data, step=None, plugins=(), **kw):
    fields = dict(max_steps=N, save_model_steps=5, save_model_secs=None,
                  nan_guard="loss", on_guard="replay", progress=False)
    return loopkit.train(step or FlakyStep(), init=init, data=data, logdir=str(logdir),
                         plugins=plugins, **{**fields, **kw})


def same_bits(a, b):
    assert a.step == b.step
    for k in a.state:
        x, y = np.asarray(a.state[k]), np.asarray(b.state[k])
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), k


def faults(logdir):
    return [(f.cause, f.step, f.process, f.host, f.detail) for f in read_records(str(logdir))
            if isinstance(f, Fault)]


def test_a_batch_bad_every_time_is_skipped_and_equals_a_clean_run_without_it(tmp_path, caplog):
    rec = Rollbacks()
    with caplog.at_level(logging.WARNING, logger="loopkit"):
        # one rollback allowed: the replay and the data fault's skip count as one
        replayed = run(tmp_path / "a", source({P}), plugins=[rec], max_rollbacks=1)
    clean = run(tmp_path / "b", source(skip=SKIPPED), on_guard="raise")
    same_bits(replayed, clean)
    assert int(replayed.state["n"]) == N
    assert rec.records == [(15, 10, (10, 10)), (15, 10, SKIPPED)]  # replayed, then skipped
    assert "again when trained again: the batch is at fault" in caplog.text
    assert faults(tmp_path / "a") == []  # not the machine
    assert [r.levelno for r in caplog.records].count(logging.ERROR) == 0


@pytest.mark.parametrize("kind", ["callable", "stateful"])
def test_a_bad_value_only_the_first_time_keeps_the_rerun_and_names_the_host(
        tmp_path, caplog, kind):
    rec = Rollbacks()
    data = source() if kind == "callable" else Stateful()
    with caplog.at_level(logging.WARNING, logger="loopkit"):
        replayed = run(tmp_path / "a", data, step=FlakyStep(bad=P), plugins=[rec])
    clean = run(tmp_path / "b", source() if kind == "callable" else Stateful(),
                on_guard="raise")
    same_bits(replayed, clean)  # bit for bit an uninterrupted run's: nothing skipped
    assert rec.records == [(15, 10, (10, 10))]
    host = socket.gethostname()
    assert faults(tmp_path / "a") == [("compute", 15, 0, host, "loss=nan")]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and f"compute fault on process 0 (host {host})" in errors[0]
    assert "at step 15 did not come back" in errors[0]
    # the save of step 15, among the steps trained again, holds their input position
    # (a resume from it reads on where the uninterrupted run reads), and the replay,
    # an empty skipped range: it counts as a rollback across restarts
    from loopkit.plugins.checkpoint.backends.orbax import OrbaxBackend

    backend = OrbaxBackend(tmp_path / "a")
    try:
        meta = backend.restore(15, None)[1]
    finally:
        backend.close()
    assert meta["consumed"] == 15 and meta["skipped"] == [[10, 10]]
    if kind == "stateful":
        assert meta["data_position"] == {"i": 15}


def test_replays_count_against_max_rollbacks(tmp_path):
    # two compute faults, one rollback allowed: the second raises
    step = FlakyStep(bad=P)
    step.flag = lambda i, f=step.flag: np.float32("nan") if int(i) == 22 and \
        step.runs.setdefault("late", 0) == 0 and not step.runs.update(late=1) else f(i)
    with pytest.raises(loopkit.NonFiniteError, match="step 23") as info:
        run(tmp_path, source(), step=step, max_rollbacks=1)
    assert "rolled back 1 times already (Config.max_rollbacks=1)" in str(info.value.__notes__)


def test_replay_with_a_plain_list_is_refused_at_start_up(tmp_path):
    with pytest.raises(ValueError, match=r"Config.on_guard='replay' cannot be used with a "
                                         r"plain iterable"):
        run(tmp_path, [(np.int32(i), value(i)) for i in range(N)])


def finite(end=N, poison=(), skip=(0, 0)):
    """`source`, ending after batch `end` - 1 (the run stops when its data runs out)."""
    whole = source(poison, skip)

    def data(start):
        for _, batch in zip(range(start, end - (skip[1] - skip[0])), whole(start)):
            yield batch
    return data


class FiniteStateful(Stateful):
    def __next__(self):
        if self.i >= N:
            raise StopIteration
        return super().__next__()


@pytest.mark.parametrize("kind", ["callable", "stateful"])
def test_a_machine_fault_at_the_last_batch_of_the_data_is_replayed_not_raised(tmp_path, kind):
    # the data ends at batch N - 1, whose first run gives NaN: the guard sees it only when
    # the data has run out, which must not be too late to go back (nor save the bad state)
    data = finite() if kind == "callable" else FiniteStateful()
    replayed = run(tmp_path / "a", data, step=FlakyStep(bad=N - 1), max_steps=None)
    clean = run(tmp_path / "b", finite() if kind == "callable" else FiniteStateful(),
                on_guard="raise", max_steps=None)
    assert (replayed.stop_reason, clean.stop_reason) == ("data_exhausted", "data_exhausted")
    same_bits(replayed, clean)
    assert [f[:2] for f in faults(tmp_path / "a")] == [("compute", N)]
    assert loopkit.latest_checkpoint(tmp_path / "a")[0] == N


@pytest.mark.parametrize("on_guard", ["rollback", "replay"])
def test_a_bad_last_batch_of_the_data_is_skipped_and_equals_a_run_without_it(tmp_path, on_guard):
    rec = Rollbacks()
    got = run(tmp_path / "a", finite(poison={N - 1}), plugins=[rec], on_guard=on_guard,
              max_steps=None)
    # saves every 5: back to step 25, batches [25, 30) skipped; the data has no more
    clean = run(tmp_path / "b", finite(skip=(N - 5, N)), on_guard="raise", max_steps=None)
    assert got.stop_reason == "data_exhausted" and clean.step == N - 5
    same_bits(got, clean)
    assert rec.records[-1] == (N, N - 5, (N - 5, N))
    # the checkpoint of the bad step is gone: a restart resumes from a good state
    assert loopkit.latest_checkpoint(tmp_path / "a")[0] == N - 5
    again = run(tmp_path / "a", finite(poison={N - 1}), on_guard=on_guard, max_steps=None)
    same_bits(again, clean)
