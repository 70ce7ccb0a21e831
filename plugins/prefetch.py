"""Built-in `prefetch`: reads the input ahead of the step in threads and places it.

Producer threads read the source, run `Config.data_transform`, place each batch
(on the default device, or assembled into global arrays for
`Config.data_sharding`) and append it to a bounded deque; the loop pops from it.
Neither side takes a lock per batch: a lock is taken only to wait (the loop for
a batch, a producer for room, until the loop has taken half the buffer) and to
wake a waiter.

With several threads, each reads its next batch under a lock, which gives it a
ticket in the source's order, transforms it outside the lock and appends it when
its ticket comes up: batches reach the step in the source's order whatever
`prefetch_threads` is. `Feed.position` gives the source's state recorded after
the last batch the step consumed, not the producers' state.

The plugin implements the `input_reader` hook: the session reads its input through
the `Reader` it returns. Small batches from a list, tuple or range with nothing to do
to them (no transform, no `data_sharding`) are left to the loop: see `_in_memory`.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any, Callable, Iterator

import jax
import numpy as np

from loopkit.config import Config
from loopkit.loop.coordinator import add_note, has_origin
from loopkit.loop.data import Input, Reader, snapshot_state
from loopkit.plugin.hookspec import hookimpl

INACTIVE = "Config.prefetch is 0 and neither data_transform nor data_sharding is set"

#: Batches smaller than this go to the step as numpy arrays: the jitted step's own
#: call copies them for less than `jax.device_put` costs (on CPU, measured: 7 µs
#: per call against 40 µs for 16 KiB; 78 µs against 36 µs at 256 KiB).
PLACE_MIN_BYTES = 128 * 1024
#: Small host (numpy) batches are buffered up to this many bytes (at most
#: SMALL_BATCH_DEPTH of them), whatever Config.prefetch says: the producer sleeps while the buffer is
#: full and is woken when the loop has taken half of it, and each wake-up costs the
#: loop tens of µs (measured: +6.2 µs/step with 64 batches of 32 bytes, +4.2 with 1024).
SMALL_BUFFER_BYTES = 8 << 20
SMALL_BATCH_DEPTH = 1024
#: How often a waiting thread looks at the stop flag.
POLL_SECS = 0.05

_SEQUENCE_ITERATORS = (type(iter([])), type(iter(())), type(iter(range(0))))
_END = object()  # what a producer "reads" once the source is exhausted
# what a thread was doing, for the note on its exception
READING = "reading the data source"
TRANSFORMING = "running Config.data_transform"
PLACING = "placing batches on the device"
SHARDING = "placing batches with Config.data_sharding"


class PrefetchPlugin:
    """Reads the session's input ahead: the `Reader` its `input_reader` hook returns."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.feed: Feed | None = None

    @hookimpl(trylast=True)  # a user's reader wins
    def input_reader(self, session: Any, input: Input) -> Reader | None:
        cfg = self.config
        if cfg.prefetch == 0:  # transform / placement only, in the loop's thread
            return Reader(_inline(input.source, cfg))
        source = input.source
        if cfg.data_transform is None and cfg.data_sharding is None:
            source, small = _in_memory(source)
            if small:
                return Reader(source)  # the loop reads it itself
        self.feed = feed = Feed(session, input, source, self.config)
        return Reader(feed.batches(), feed.position if input.kind == "stateful" else None)


def plugin(config: Config) -> PrefetchPlugin | None:
    if config.prefetch == 0 and config.data_transform is None and config.data_sharding is None:
        return None
    return PrefetchPlugin(config)


def _in_memory(source: Iterator[Any]) -> tuple[Iterator[Any], bool]:
    """Whether `source` has small batches from a list, tuple or range: nothing to do
    ahead. Returns the source to read from then (its first batch looked at), and that.

    Their `next()` cannot block and costs less than any hand-off from a thread,
    and the step's own call places a small batch for less than `jax.device_put`.
    Large batches still go through a thread, to be placed ahead of the step.
    """
    if type(source) not in _SEQUENCE_ITERATORS:
        return source, False
    first = list(itertools.islice(source, 1))
    return itertools.chain(first, source), not first or _nbytes(first[0]) < PLACE_MIN_BYTES


def _inline(source: Iterator[Any], cfg: Config) -> Iterator[Any]:
    """prefetch=0: transform and place each batch in the loop's own thread."""
    transform, sharding = cfg.data_transform, cfg.data_sharding
    for item in source:
        try:
            doing = TRANSFORMING
            if transform is not None:
                item = transform(item)
            doing = SHARDING
            if sharding is not None:
                item = jax.make_array_from_process_local_data(sharding, item)
        except Exception as ex:
            _note(ex, doing)
            raise
        yield item


def _note(ex: BaseException, doing: str) -> None:
    """Name this thread and what it was doing, unless a loopkit note already does."""
    if has_origin(ex):
        return
    name = threading.current_thread().name
    if name.startswith("loopkit-prefetch"):
        add_note(ex, f"raised in loopkit thread {name!r} ({doing})")
    else:
        add_note(ex, f"raised in loopkit's prefetch plugin {doing} in the loop's thread")


def _nbytes(batch: Any) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(batch)
               if isinstance(x, (np.ndarray, jax.Array)))


def _on_host(batch: Any) -> bool:
    """Whether no leaf of `batch` is a jax array (which holds device memory)."""
    return not any(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(batch))


class Feed:
    """The producer threads, the buffer and the recorded source states of one session.

    A batch costs the loop one `popleft` and a producer one `append` (deque
    operations are atomic). The condition variable is taken only by a side that
    must wait (the loop for a batch, a producer for room or for its turn) and by
    the other side when it sees the waiter's flag.
    """

    def __init__(self, session: Any, inp: Input, source: Iterator[Any], cfg: Config) -> None:
        self.session, self.source, self.start_step = session, source, inp.start_step
        self.input = inp
        self.stateful = inp.kind == "stateful"
        self.transform, self.sharding = cfg.data_transform, cfg.data_sharding
        self.depth = cfg.prefetch  # deepened for small batches at the first one
        self.small: bool | None = None  # under PLACE_MIN_BYTES; the first batch decides
        self.ready: collections.deque[Any] = collections.deque()  # placed, not yet taken
        self.put = 0  # batches appended to `ready` so far: the ticket whose turn it is
        self.finished = False  # every batch of the source is in `ready`
        self.cv = threading.Condition()
        self.wants_batch = False  # the loop waits for a batch
        self.wants_room = False  # the producer whose turn it is waits for room
        self.read_lock = threading.Lock()  # the source, `read`, `exhausted`, `states`
        self.read = 0  # batches read from the source so far
        self.exhausted = False
        # the source's state after k batches were read, for k from the loop's step on
        self.states: dict[int, Any] = {0: self._state()} if self.stateful else {}
        self.oldest = 0
        # the readers' own work, for a straggler's "in input": a wait in the loop is
        # not it, since with a collective in the step the slightly slower process waits
        # for input while the others wait in the step
        self.timed = cfg.straggler_threshold is not None and jax.process_count() > 1
        n = cfg.prefetch_threads if self.transform is not None else 1
        self.several = n > 1  # then producers may wait for their turn
        for name in ["reader"] if n == 1 else [f"transform-{i}" for i in range(n)]:
            thread = threading.Thread(target=self._produce, name=f"loopkit-prefetch-{name}",
                                      daemon=True)
            session.register_thread(thread)  # joined within stop_grace_secs, or named
            thread.start()

    # -- the loop's side -----------------------------------------------------------

    def batches(self) -> Iterator[Any]:
        ready, pop = self.ready, self.ready.popleft
        while True:
            try:
                batch = pop()
            except IndexError:
                if self._wait_for_batch():
                    continue
                return
            if self.wants_room and len(ready) <= self.depth // 2:
                self.wants_room = False
                self._notify()
            yield batch

    def _wait_for_batch(self) -> bool:
        """Wait until a batch is ready (True), or for the end or a stop (False)."""
        t0 = time.perf_counter()
        self.wants_batch = True
        self._wait(lambda: self.ready or self.finished)
        self.wants_batch = False
        self.session.stats.input_wait_secs += time.perf_counter() - t0
        return bool(self.ready)

    def position(self, step: int) -> Any:
        """The source's state after the batch of global step `step` was consumed
        (`input.offset` more batches than `step` after a rollback skipped some)."""
        # not under read_lock: next() may block
        return self.states[step + self.input.offset - self.start_step]

    # -- the producers' side ---------------------------------------------------------

    def _produce(self) -> None:
        ready, transform, sharding = self.ready, self.transform, self.sharding
        try:
            while True:
                doing = READING
                t0 = time.perf_counter() if self.timed else 0.0
                with self.read_lock:  # one reader at a time, in the source's order
                    if self.exhausted or self.session.should_stop():
                        return
                    ticket = self.read
                    try:
                        item = next(self.source)
                    except StopIteration:
                        self.exhausted = True
                        item = _END
                    else:
                        self.read += 1
                        if self.stateful:
                            self._record()
                if item is not _END:
                    if transform is not None:
                        doing = TRANSFORMING
                        item = transform(item)
                    if self.small is None:
                        self._first(item)
                    if sharding is not None:
                        doing = SHARDING
                        item = jax.make_array_from_process_local_data(sharding, item)
                    elif not self.small:
                        doing = PLACING
                        item = jax.device_put(item)
                if self.timed:
                    stats = self.session.stats
                    stats.input_read_secs += time.perf_counter() - t0
                    stats.input_read_batches += 1
                if self.put != ticket and not self._wait(lambda: self.put == ticket):
                    return
                if item is _END:
                    self.finished = True
                    self._notify()
                    return
                if len(ready) >= self.depth and not self._wait_for_room():
                    return
                ready.append(item)
                self.put += 1
                if self.wants_batch or self.several:
                    self.wants_batch = False
                    self._notify()
        except BaseException as ex:  # noqa: BLE001 - handed to the main thread
            _note(ex, doing)
            self.session.request_stop(ex)
            self._notify()

    def _first(self, item: Any) -> None:
        nbytes = _nbytes(item)
        self.small = nbytes < PLACE_MIN_BYTES
        # only small host batches are buffered deeper: batches already on the device
        # (a grain pipeline ending in make_array_from_process_local_data) hold device
        # memory, so Config.prefetch bounds them whatever their size
        if self.small and _on_host(item):
            fits = SMALL_BUFFER_BYTES // max(nbytes, 1)
            self.depth = max(self.depth, min(SMALL_BATCH_DEPTH, fits))

    def _record(self) -> None:
        self.states[self.read] = self._state()
        # older states are not asked for (the batches consumed only grow)
        # the offset before the step: a rollback writes the step (smaller) first, then
        # the offset, so this never counts more batches consumed than there are
        offset = self.input.offset
        done = self.session.step + offset - self.start_step
        while self.oldest < done:
            self.states.pop(self.oldest, None)
            self.oldest += 1

    def _wait_for_room(self) -> bool:
        """Wait until the loop has taken half the buffer (True) or a stop (False).

        Half, not one: a producer woken for every batch would cost the loop a
        thread wake-up per step.
        """
        self.wants_room = True
        try:
            return self._wait(lambda: len(self.ready) <= self.depth // 2)
        finally:
            self.wants_room = False

    def _wait(self, done: Callable[[], Any]) -> bool:
        """Wait until `done()` (True) or a stop (False).

        The caller raises its flag first and the other side checks the flag after
        its own change, so one of the two always sees the other: no lost wake-up.
        """
        stop = self.session.should_stop
        with self.cv:
            while not done():
                if stop():
                    return False
                self.cv.wait(POLL_SECS)
        return True

    def _notify(self) -> None:
        with self.cv:
            self.cv.notify_all()

    def _state(self) -> Any:
        return snapshot_state(self.source)
