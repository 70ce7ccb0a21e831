"""Built-in `prefetch`: reads the input ahead of the step in threads and places it.

One reader thread pulls batches from the source in order (recording the
source's state after each batch, for an exact resume); `Config.data_transform`
runs on `prefetch_threads` threads with the results put back in order; batches
are placed on the device (or assembled into global arrays for
`Config.data_sharding`) and handed to the loop in groups, so the loop pays a
generator resume per batch and a lock only per group or when it must wait.

A source that costs next to nothing per batch (a list in memory) gains nothing
from a thread: after the first `PROBE_READS` batches such a source is read by
the loop itself ("direct" mode), and every `SAMPLE_EVERY`-th read is timed so a
source that turns slow goes back to the reader thread.
"""

from __future__ import annotations

import collections
import copy
import itertools
import queue
import statistics
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
#: The most batches handed to the loop at once.
GROUP_MAX = 64
#: Small batches (under PLACE_MIN_BYTES) are buffered at least this deep, whatever
#: Config.prefetch says: handing them over two at a time costs a thread wake-up per
#: group (+32 µs/step measured here for a trivial step fed by a generator, against
#: +2 µs with groups of up to 64), while 64 small batches take under 8 MiB.
SMALL_BATCH_DEPTH = 64
#: Reads timed before deciding whether the source is cheap enough to read inline.
PROBE_READS = 32
#: A source whose median read costs less is read by the loop itself.
CHEAP_READ_SECS = 20e-6
#: In direct mode, a sampled read slower than this sends reading back to a thread.
SLOW_READ_SECS = 250e-6
SAMPLE_EVERY = 64
#: How often a waiting thread looks at the stop flag.
POLL_SECS = 0.05

_END = "end"  # sentinels in the hand-off deque (groups are lists)
_DIRECT = "direct"
# what a thread was doing, for the note on its exception
READING = "reading the data source"
TRANSFORMING = "running Config.data_transform"
SHARDING = "placing batches with Config.data_sharding"


def _nbytes(batch: Any) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(batch) if isinstance(x, np.ndarray))


class PrefetchPlugin:
    """Replaces `session.input.iterator` (and `.position`) with a prefetching one."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.feed: _Feed | None = None

    @hookimpl(tryfirst=True)  # built-in services start before other plugins'
    def session_create(self, session: Any) -> None:
        inp = session.input
        if inp is None:  # the Supervisor idiom: the user feeds run(batch)
            return
        cfg = self.config
        if cfg.prefetch == 0:  # transform / placement only, in the loop's thread
            inp.iterator = _inline(inp.source, cfg)
            return
        self.feed = feed = _Feed(session, cfg)
        inp.iterator = feed.start()
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
        if transform is not None:
            item = _doing(TRANSFORMING, transform, item)
        if sharding is not None:
            item = _doing(SHARDING, jax.make_array_from_process_local_data, sharding, item)
        yield item


def _doing(doing: str, fn: Any, *args: Any) -> Any:
    """`fn(*args)`; an exception gets a note naming this thread and what it was doing."""
    try:
        return fn(*args)
    except Exception as ex:
        _note(ex, doing)
        raise


def _note(ex: BaseException, doing: str) -> None:
    if has_origin(ex):
        return
    name = threading.current_thread().name
    if name.startswith("loopkit-prefetch"):
        add_note(ex, f"raised in loopkit thread {name!r} ({doing})")
    else:
        add_note(ex, f"raised in loopkit's prefetch plugin {doing} in the loop's thread")


class _Feed:
    """The threads, the hand-off deque and the recorded source states of one session."""

    def __init__(self, session: Any, cfg: Config) -> None:
        inp = session.input
        self.session, self.coord = session, session.coord
        self.source, self.start_step = inp.source, inp.start_step
        self.stateful = inp.kind == "stateful"
        self.transform, self.sharding = cfg.data_transform, cfg.data_sharding
        self.cap = cfg.prefetch
        self.group_max = max(1, min(self.cap, GROUP_MAX))
        self.nworkers = cfg.prefetch_threads if self.transform is not None else 0
        # `read` and `taken` are each written by one thread only; `delivered` by the
        # delivering thread and by the loop when it takes a group in the making,
        # both under `cv`.
        self.read = 0  # batches read from the source (by one reader at a time)
        self.delivered = 0  # batches handed to the loop
        self.taken = 0  # batches the loop took
        self.ready: collections.deque[Any] = collections.deque()
        self.partial: list[Any] = []  # the reader's group in the making (under cv)
        self.cv = threading.Condition()
        self.waiting = 0  # threads in cv.wait: only then does the other side notify
        #: every mode the feed was in, "threaded" or "direct" (for tests and debugging)
        self.modes = ["threaded"]
        self.direct_from: int | None = None
        # source state after k batches were read, k in a window around the loop's step
        self.states: dict[int, Any] = {}
        self.oldest = 0
        if self.stateful:
            self.states[0] = self._state()

    # -- the loop's side ----------------------------------------------------------

    def start(self) -> Iterator[Any]:
        # The loop may read the source itself only when reading cannot block: an
        # in-memory sequence. A generator may wait on I/O, and a loop blocked in
        # next() could not see a stop request.
        self._start_threads(probe=self.transform is None and self.sharding is None
                            and getattr(self.session.input, "in_memory", False))
        return self._consume()

    def _consume(self) -> Iterator[Any]:
        pop = self.ready.popleft
        while True:
            try:
                group = pop()
            except IndexError:
                group = self._wait_ready()
            if group.__class__ is not list:
                if group == _DIRECT:
                    yield from self._direct()
                return
            self.taken += len(group)
            if self.waiting:
                self._notify()
            yield from group

    def _wait_ready(self) -> Any:
        """The slow path: block until a group (or a sentinel) is ready or a stop."""
        t0 = time.perf_counter()
        stolen = False
        with self.cv:
            self.waiting += 1
            try:
                while not self.ready and not self.coord.stopped:
                    if self.partial:  # the reader's group in the making: take it now
                        group, self.partial = self.partial, []
                        self.delivered += len(group)
                        stolen = True
                        break
                    self.cv.wait(POLL_SECS)
                if not stolen:
                    group = self.ready.popleft() if self.ready else _END
            finally:
                self.waiting -= 1
        if stolen:
            group = self._place(group)
        self.session.stats.input_wait_secs += time.perf_counter() - t0
        return group

    def _direct(self) -> Iterator[Any]:
        """Read the source in the loop's thread, timing one read in SAMPLE_EVERY."""
        self.modes.append("direct")
        src, clock = self.source, time.perf_counter
        try:
            while True:
                t0 = clock()
                item = next(src)
                if clock() - t0 > SLOW_READ_SECS:
                    break
                yield item
                for item in itertools.islice(src, SAMPLE_EVERY - 1):
                    yield item
        except StopIteration:
            return
        except Exception as ex:  # noqa: BLE001 - handed to the main thread's stop
            _note(ex, READING)
            self.coord.request_stop(ex)
            return
        # The source turned slow: back to a reader thread, for good. The loop has
        # consumed every batch read so far but `item`.
        self.read = self.session.step - self.start_step + 1
        if self.stateful:
            self.states[self.read] = self._state()
        self.direct_from = None
        self.modes.append("threaded")
        self._start_threads(probe=False)
        yield item
        yield from self._consume()

    def position(self, step: int) -> Any:
        """The source's state after the batch of global step `step` was consumed."""
        k = step - self.start_step
        if k in self.states:
            return self.states[k]
        if self.direct_from is not None and k >= self.direct_from:
            return self._state()  # direct mode: the loop read exactly k batches
        raise LookupError(f"prefetch: no input position recorded for step {step}; "
                          f"recorded: batches {sorted(self.states)} of this session")

    # -- threads --------------------------------------------------------------------

    def _start_threads(self, probe: bool) -> None:
        if self.nworkers > 1:
            self.work: queue.Queue[Any] = queue.Queue()
            self.pending: queue.Queue[Any] = queue.Queue()
            targets = [("reader", self._read_for_workers, READING),
                       ("collector", self._collect, "collecting transformed batches")]
            targets += [(f"transform-{i}", self._transform_worker, TRANSFORMING)
                        for i in range(self.nworkers)]
        else:
            targets = [("reader", lambda: self._produce(probe), READING)]
        for name, target, doing in targets:
            t = threading.Thread(target=self._guard, args=(target, doing),
                                 name=f"loopkit-prefetch-{name}", daemon=True)
            self.coord.register_thread(t)  # joined within stop_grace_secs, or named
            t.start()

    def _guard(self, target: Any, doing: str) -> None:
        try:
            target()
        except BaseException as ex:  # noqa: BLE001 - handed to the main thread
            _note(ex, doing)  # unless a stage already named itself
            self.coord.request_stop(ex)
            self._notify()

    def _produce(self, probe: bool) -> None:
        """One thread: read, transform, place, hand over in groups of what is ready."""
        src, transform, cv = self.source, self.transform, self.cv
        probed: list[tuple[float, int]] | None = [] if probe else None
        while not self.coord.stopped:
            t0 = time.perf_counter()
            try:
                item = next(src)
            except StopIteration:
                with cv:
                    group, self.partial = self.partial, []
                if group:
                    self._deliver(group)
                self._append(_END)
                return
            if probed is not None:
                probed.append((time.perf_counter() - t0, _nbytes(item)))
            if self.read == 0 and _nbytes(item) < PLACE_MIN_BYTES:
                self.cap = max(self.cap, SMALL_BATCH_DEPTH)
                self.group_max = min(self.cap, GROUP_MAX)
            self.read += 1
            if self.stateful:
                self._record()
            if probed is not None and len(probed) == PROBE_READS:
                if self._cheap(probed):
                    with cv:
                        group, self.partial = self.partial, []
                    group.append(item)
                    if self._deliver(group):
                        self.direct_from = self.read
                        self._append(_DIRECT)
                    return  # the loop reads the source from here on
                probed = None
            if transform is not None:
                item = _doing(TRANSFORMING, transform, item)
            # The group being built is shared: a loop that runs dry takes it as it
            # is, so batches read before the source stalls are never held back.
            with cv:
                self.partial.append(item)
                full = len(self.partial) >= self.group_max or not self.ready
                if full:
                    group, self.partial = self.partial, []
                elif self.waiting:
                    cv.notify_all()
            if full and not self._deliver(group):
                return

    @staticmethod
    def _cheap(probed: list[tuple[float, int]]) -> bool:
        return (statistics.median(t for t, _ in probed) <= CHEAP_READ_SECS
                and max(n for _, n in probed) < PLACE_MIN_BYTES)

    def _read_for_workers(self) -> None:
        """With several transform threads: read in order, queue the work and its slot."""
        src, limit = self.source, self.cap + 2 * self.nworkers
        while True:
            if not self._wait(lambda: self.read - self.taken < limit):
                return
            try:
                item = next(src)
            except StopIteration:
                self.pending.put(None)
                for _ in range(self.nworkers):
                    self.work.put(None)
                return
            self.read += 1
            if self.stateful:
                self._record()
            slot = _Slot(item)
            self.pending.put(slot)
            self.work.put(slot)

    def _transform_worker(self) -> None:
        transform = self.transform
        while not self.coord.stopped:
            try:
                slot = self.work.get(timeout=POLL_SECS)
            except queue.Empty:
                continue
            if slot is None:
                return
            slot.value = _doing(TRANSFORMING, transform, slot.value)
            slot.done.set()

    def _collect(self) -> None:
        """Take the transformed batches in the source's order and hand them over."""
        group: list[Any] = []
        while not self.coord.stopped:
            try:
                slot = self.pending.get(timeout=POLL_SECS)
            except queue.Empty:
                continue
            if slot is None:
                if group:
                    self._deliver(group)
                self._append(_END)
                return
            while not slot.done.wait(POLL_SECS):
                if self.coord.stopped:
                    return
            group.append(slot.value)
            nxt = self.pending.queue[0] if self.pending.queue else None
            if (len(group) >= self.group_max or not self.ready
                    or nxt is None or not nxt.done.is_set()):
                if not self._deliver(group):
                    return
                group = []

    # -- shared helpers ---------------------------------------------------------------

    def _deliver(self, group: list[Any]) -> bool:
        """Wait for room, place `group`, hand it to the loop; False on a stop."""
        n = len(group)
        if not self._wait(lambda: self.delivered == self.taken
                          or self.delivered - self.taken + n <= self.cap):
            return False
        placed = self._place(group)
        with self.cv:
            self.delivered += n
            self.ready.append(placed)
            if self.waiting:
                self.cv.notify_all()
        return True

    def _place(self, group: list[Any]) -> list[Any]:
        if self.sharding is not None:
            return _doing(SHARDING, jax.make_array_from_process_local_data, self.sharding, group)
        if _nbytes(group[0]) >= PLACE_MIN_BYTES:
            return _doing("placing batches on the device", jax.device_put, group)
        return group

    def _append(self, entry: Any) -> None:
        self.ready.append(entry)
        if self.waiting:
            self._notify()

    def _notify(self) -> None:
        with self.cv:
            self.cv.notify_all()

    def _wait(self, room: Any) -> bool:
        """Block until `room()` or a stop; True when there is room."""
        if room():
            return True
        with self.cv:
            self.waiting += 1
            try:
                while not room():
                    if self.coord.stopped:
                        return False
                    self.cv.wait(POLL_SECS)
            finally:
                self.waiting -= 1
        return not self.coord.stopped

    def _state(self) -> Any:
        # a copy: an iterator may hand out its live state and change it on next()
        return copy.deepcopy(self.source.get_state())

    def _record(self) -> None:
        self.states[self.read] = self._state()
        lo = self.session.step - self.start_step  # older states can no longer be asked for
        while self.oldest < lo:
            self.states.pop(self.oldest, None)
            self.oldest += 1


class _Slot:
    __slots__ = ("value", "done")

    def __init__(self, value: Any) -> None:
        self.value = value
        self.done = threading.Event()

