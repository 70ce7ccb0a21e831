"""`train`: the whole loop in one call, built on `Supervisor.managed_session`."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable

from loopkit.config import Config
from loopkit.loop.coordinator import add_note, has_origin
from loopkit.loop.scheduler import end_of_data
from loopkit.loop.session import Session
from loopkit.supervisor import Supervisor

__all__ = ["TrainResult", "train"]

PyTree = Any


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What `train` returns after a normal stop."""

    state: PyTree
    step: int
    #: "max_steps" | "data_exhausted" | "requested" | "signal"
    stop_reason: str


def train(step_fn: Callable[..., Any], *, init: Any, data: Any = None,
          plugins: Iterable[Any] = (), config: Config | None = None,
          clock: Callable[[], float] | None = None, **fields: Any) -> TrainResult:
    """Train `step_fn` from `init` on `data` until a stop; return the final state.

    `step_fn(state, batch) -> (state, metrics)` (or `step_fn(state)` when `data`
    is None). `init` is a pytree or a zero-argument callable returning one.
    `data` is an iterable of batches, a callable `data(start_step)` returning
    one (for an exact resume), or an iterator with `get_state()/set_state()`.
    Any `Config` field may be passed as a keyword.

    >>> import jax.numpy as jnp
    >>> r = train(lambda s: (s + 1, {}), init=jnp.zeros(()), max_steps=5, progress=False)
    >>> (int(r.state), r.step, r.stop_reason)
    (5, 5, 'max_steps')
    """
    sv = Supervisor(config, plugins=plugins, clock=clock, **fields)
    with sv.managed_session(step_fn, init=init, data=data) as session:
        _loop(session)
    return TrainResult(session.state, session.step, sv.coord.reason or "requested")


def _loop(session: Session) -> None:
    coord = session.coord
    run = session.run
    if session.input is None:
        while not coord.stopped:
            run()
        return
    it = session.batches()
    if coord.stopped:
        return
    # the wait for the first batch is timed (the goodput ledger books it as input, not
    # as the first step's compile) outside the loop: the steps after it run nothing more
    t0 = time.perf_counter()
    batch = _first_batch(session, it)
    if batch is _NO_BATCH:
        return
    session.stats.first_batch_secs = time.perf_counter() - t0
    run(batch)
    while not coord.stopped:
        try:
            batch = next(it)
        except StopIteration:
            if end_of_data(session):  # a plugin went back: the batches it set come next
                it = session.batches()
                continue
            break
        except BaseException as ex:
            _name_the_step(session, ex)
            raise
        run(batch)


_NO_BATCH = object()


def _first_batch(session: Session, it: Any) -> Any:
    """The first batch, or `_NO_BATCH` (the data ended: the stop is requested)."""
    try:
        return next(it)
    except StopIteration:
        session.coord.request_stop(reason="data_exhausted")
        return _NO_BATCH
    except BaseException as ex:
        _name_the_step(session, ex)
        raise


def _name_the_step(session: Session, ex: BaseException) -> None:
    if not has_origin(ex):
        add_note(ex, f"raised in loopkit reading the data source, for step {session.step + 1}")
