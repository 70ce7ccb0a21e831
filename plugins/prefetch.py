"""Built-in `prefetch`: reads the input ahead of the step in threads and places it.

Producer threads read the source, run `Config.data_transform`, place each batch
(on the default device, or assembled into global arrays for
`Config.data_sharding`) and append it to a bounded buffer. The loop takes
everything ready at once and hands it to the step batch by batch, so it touches
the lock once per group and pays a generator resume per batch.

With several threads, each reads its next batch under a lock, which gives it a
ticket in the source's order, transforms it outside the lock and appends it when
its ticket comes up: batches reach the step in the source's order whatever
`prefetch_threads` is.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any, Iterator

import jax
import numpy as np

from loopkit.config import Config
from loopkit.coordinator import add_note, has_origin
from loopkit.hookspec import hookimpl

INACTIVE = "Config.prefetch is 0 and neither data_transform nor data_sharding is set"

#: Batches smaller than this go to the step as numpy arrays: the jitted step's own
#: call copies them for less than `jax.device_put` costs (on CPU, measured: 7 µs
#: per call against 40 µs for 16 KiB; 78 µs against 36 µs at 256 KiB).
PLACE_MIN_BYTES = 128 * 1024
#: Small batches are buffered at least this deep, whatever Config.prefetch says:
#: with two at a time the loop would wake a producer every second batch (tens of
#: µs each), while 64 small batches take under 8 MiB.
SMALL_BATCH_DEPTH = 64
#: How often a waiting thread looks at the stop flag.
POLL_SECS = 0.05

_END = object()  # the ticket after the source's last batch
# what a thread was doing, for the note on its exception
READING = "reading the data source"
TRANSFORMING = "running Config.data_transform"
PLACING = "placing batches on the device"
SHARDING = "placing batches with Config.data_sharding"


class PrefetchPlugin:
    """Replaces `session.input.iterator` (and `.position`) with a prefetching one."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.feed: Feed | None = None

    @hookimpl
    def session_create(self, session: Any) -> None:
        inp = session.input
        if inp is None:  # the Supervisor idiom: the user feeds run(batch)
            return
        if self.config.prefetch == 0:  # transform / placement only, in the loop's thread
            inp.iterator = _inline(inp.source, self.config)
            return
        self.feed = feed = Feed(session, self.config)
        inp.iterator = feed.batches()
        if inp.kind == "stateful":
            inp.position = feed.position


def plugin(config: Config) -> PrefetchPlugin | None:
    if config.prefetch == 0 and config.data_transform is None and config.data_sharding is None:
        return None
    return PrefetchPlugin(config)


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
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(batch) if isinstance(x, np.ndarray))


class Feed:
    """The producer threads, the buffer and the recorded source states of one session."""

    def __init__(self, session: Any, cfg: Config) -> None:
        inp = session.input
        self.session, self.source, self.start_step = session, inp.source, inp.start_step
        self.stateful = inp.kind == "stateful"
        self.transform, self.sharding = cfg.data_transform, cfg.data_sharding
        self.depth = cfg.prefetch  # deepened for small batches at the first one
        self.small: bool | None = None  # under PLACE_MIN_BYTES; the first batch decides
        self.cv = threading.Condition()  # guards everything below but `read` and `states`
        self.ready: list[Any] = []  # placed batches the loop has not taken yet
        self.put = 0  # batches appended to `ready` so far
        self.waiting = 0  # threads in cv.wait: only then does the other side notify
        self.finished = False  # every batch of the source is in `ready`
        self.read_lock = threading.Lock()  # guards `read`, `states` and the source
        self.read = 0  # batches read from the source so far
        self.exhausted = False
        # the source's state after k batches were read, for k from the loop's step on
        self.states: dict[int, Any] = {0: self._state()} if self.stateful else {}
        self.oldest = 0
        n = cfg.prefetch_threads if self.transform is not None else 1
        for name in ["reader"] if n == 1 else [f"transform-{i}" for i in range(n)]:
            thread = threading.Thread(target=self._produce, name=f"loopkit-prefetch-{name}",
                                      daemon=True)
            session.register_thread(thread)  # joined within stop_grace_secs, or named
            thread.start()

    # -- the loop's side -----------------------------------------------------------

    def batches(self) -> Iterator[Any]:
        while True:
            group = self._take()
            if not group:
                return
            yield from group

    def _take(self) -> list[Any]:
        """Everything ready; waits while nothing is; [] at the end or at a stop."""
        cv = self.cv
        with cv:
            if not self.ready:
                t0 = time.perf_counter()
                while not (self.ready or self.finished or self.session.should_stop()):
                    self._wait()
                self.session.stats.input_wait_secs += time.perf_counter() - t0
            group, self.ready = self.ready, []
            if self.waiting:
                cv.notify_all()
        return group

    def position(self, step: int) -> Any:
        """The source's state after the batch of global step `step` was consumed."""
        return self.states[step - self.start_step]  # not under read_lock: next() may block

    # -- the producers' side ---------------------------------------------------------

    def _produce(self) -> None:
        doing = READING
        try:
            while True:
                doing = READING
                ticket, item = self._next()
                if ticket is None:
                    return
                if item is not _END:
                    if self.transform is not None:
                        doing = TRANSFORMING
                        item = self.transform(item)
                    doing = PLACING if self.sharding is None else SHARDING
                    item = self._place(item)
                if not self._append(ticket, item) or item is _END:
                    return
        except BaseException as ex:  # noqa: BLE001 - handed to the main thread
            _note(ex, doing)
            self.session.request_stop(ex)
            with self.cv:
                self.cv.notify_all()

    def _next(self) -> tuple[int | None, Any]:
        """(ticket, the source's next batch or _END); (None, None) at a stop."""
        while not self.read_lock.acquire(timeout=POLL_SECS):
            if self.session.should_stop():
                return None, None
        try:
            if self.exhausted or self.session.should_stop():
                return None, None
            ticket = self.read
            try:
                item = next(self.source)
            except StopIteration:
                self.exhausted = True
                return ticket, _END
            self.read += 1
            if self.stateful:
                self.states[self.read] = self._state()
                done = self.session.step - self.start_step  # older states are not asked for
                while self.oldest < done:
                    self.states.pop(self.oldest, None)
                    self.oldest += 1
            return ticket, item
        finally:
            self.read_lock.release()

    def _place(self, item: Any) -> Any:
        if self.small is None:  # the first batch decides
            self.small = _nbytes(item) < PLACE_MIN_BYTES
            if self.small:
                with self.cv:
                    self.depth = max(self.depth, SMALL_BATCH_DEPTH)
        if self.sharding is not None:
            return jax.make_array_from_process_local_data(self.sharding, item)
        return item if self.small else jax.device_put(item)

    def _append(self, ticket: int, item: Any) -> bool:
        """Wait for `ticket`'s turn and for room, then append; False at a stop."""
        cv = self.cv
        with cv:
            while self.put != ticket or len(self.ready) >= self.depth:
                if self.session.should_stop():
                    return False
                self._wait()
            if item is _END:
                self.finished = True
            else:
                self.ready.append(item)
                self.put += 1
            if self.waiting:
                cv.notify_all()
        return True

    def _wait(self) -> None:
        self.waiting += 1
        try:
            self.cv.wait(POLL_SECS)
        finally:
            self.waiting -= 1

    def _state(self) -> Any:
        # a copy: an iterator may hand out its live state and change it on next()
        return copy.deepcopy(self.source.get_state())
