"""The three data protocols `train` accepts, behind one small `Input` object."""

from __future__ import annotations

import collections
import copy
import logging
from typing import Any, Callable, Iterator, NamedTuple

__all__ = ["Input", "Lookahead", "Reader", "is_callable_source", "make_input",
           "snapshot_state"]

log = logging.getLogger("loopkit")


def snapshot_state(source: Any) -> Any:
    """A stateful iterator's position now: a copy, since an iterator may hand out its
    live state and change it on the next `next()`."""
    return copy.deepcopy(source.get_state())


def is_stateful(obj: Any) -> bool:
    """grain's protocol: an iterator with `get_state()` / `set_state(state)`."""
    return callable(getattr(obj, "get_state", None)) and callable(getattr(obj, "set_state", None))


class Reader(NamedTuple):
    """How the loop reads an `Input`: what an `input_reader` hook returns.

    `batches` is what the loop consumes; `position(step)` is the input position
    after the batch of global step `step` (None: the source's own, read from it).
    """

    batches: Iterator[Any]
    position: Callable[[int], Any] | None = None


class Input:
    """What the loop reads batches from, and where the input stands for a checkpoint.

    `source` is the raw iterator of the user's data. `iterator` is what the loop
    consumes: `source` itself (or its batches placed with `Config.data_sharding`),
    or the batches of the `Reader` the session opened it with (`read_with`: the
    `input_reader` hook's, e.g. the `prefetch` plugin's threads).
    """

    def __init__(self, source: Iterator[Any], kind: str, start_step: int) -> None:
        self.source = source
        self.kind = kind  # "iterable" | "callable" | "stateful"
        #: batches the source had consumed when it was opened (`data(start_step)`)
        self.start_step = start_step
        self._reader = Reader(source)
        #: batches consumed minus the global step: batches rollbacks skipped
        #: (`Config.on_guard`); a checkpoint of step s records s + offset consumed
        self.offset = 0
        #: the batch ranges ``(first, end)`` skipped so far, oldest first (an empty one:
        #: a rollback that skipped none, trained its batches again)
        self.skipped: list[tuple[int, int]] = []
        #: a callable source: ``data(start)``, to open it again at another batch
        self.reopen: Callable[[int], Any] | None = None
        #: set by a plugin before the loop reads: batches to train again, read in front
        #: of the loop's own (`loopkit.plugins.rewind.Replay`: `main`, `side`, `end`,
        #: `positions`); costs the loop a method call a batch
        self.replay: Any = None

    @property
    def reader(self) -> Reader:
        """How the loop reads it now."""
        return self._reader

    @property
    def iterator(self) -> Iterator[Any]:
        """The batches the loop consumes."""
        return self._reader.batches

    @property
    def reads_source(self) -> bool:
        """Whether `position` reads the source's own state (a stateful source, its
        reader keeping no positions of its own)."""
        return self.kind == "stateful" and self._reader.position is None

    def read_with(self, reader: Reader) -> None:
        """Read the input through `reader` from now on (the session's choice, once)."""
        self._reader = reader

    def consumed(self, step: int) -> int:
        """Batches the loop's own input has consumed at global step `step`: a replay
        under way reads in front of it, and it stands at the replay's end."""
        replay = self.replay
        if replay is not None and replay.side is not None:
            return replay.end
        return step + self.offset

    def position(self, step: int) -> Any:
        """The input position after the batch of global step `step` was consumed.

        JSON-able; None when the source cannot say (a plain iterable), or when
        the batch count alone says it (a callable `data(start_step)`).
        """
        if self.replay is not None and step in self.replay.positions:  # trained again
            return self.replay.positions[step]
        if self._reader.position is not None:
            return self._reader.position(step)
        return self.source.get_state() if self.kind == "stateful" else None


class Lookahead:
    """The loop's batches in a multi-process run, read ahead up to the next agreement.

    `fill(n)` (the agreement's `supply`) reads until `n` batches wait here or the
    data ends, and returns how many wait: every process then knows, at the
    agreement, whether each of them has a batch for every step until the next
    one. When the position comes from the source itself (no prefetch plugin),
    the source's state is recorded with each batch read ahead.
    """

    def __init__(self, inp: Input) -> None:
        self._inp = inp
        self._it = inp.iterator
        self._buf: collections.deque[Any] = collections.deque()
        self._ended = False
        self._source = None
        if inp.reads_source:  # read ahead, the source's state is recorded with each batch
            self._source = inp.source
            self._last = snapshot_state(inp.source)

    def reader(self, inp: Input) -> Reader:
        """How `inp` is read through this lookahead."""
        return Reader(self, inp.reader.position if self._source is None else self.position)

    def __iter__(self) -> Lookahead:
        return self

    def __next__(self) -> Any:
        if not self._buf and not self.fill(1):
            raise StopIteration
        if self._source is None:
            return self._buf.popleft()
        batch, self._last = self._buf.popleft()
        return batch

    def fill(self, n: int) -> int:
        buf, it, source = self._buf, self._it, self._source
        while len(buf) < n and not self._ended:
            try:
                batch = next(it)
            except StopIteration:
                self._ended = True
                break
            buf.append(batch if source is None else (batch, snapshot_state(source)))
        return len(buf)

    def supply(self, n: int) -> int:
        """`fill`, counting the batches a plugin set to be trained again in front
        (`Input.replay`'s ``left``): the agreement's view of the batches held."""
        replay = self._inp.replay
        front = 0 if replay is None else replay.left
        return front + self.fill(max(0, n - front))

    def position(self, step: int) -> Any:
        """The source's state after the last batch the loop took."""
        return self._last


def make_input(data: Any, step: int, restored: Any = None, sharding: Any = None) -> Input:
    """Open `data` at global step `step`, or where `restored` (a `loopkit.Restored`) left it.

    A callable gets the batches consumed so far (`step`, unless a rollback skipped
    some); a stateful iterator gets the restored position. With `sharding`
    (`Config.data_sharding`) each batch is this process's part of a global batch,
    assembled with `jax.make_array_from_process_local_data` (the `prefetch`
    plugin does this ahead of the step; without it, here).
    """
    consumed = step if restored is None or restored.consumed is None else restored.consumed
    position = None if restored is None else restored.data_position
    inp = _open(data, consumed, position, restored is not None)
    if restored is not None:
        inp.skipped, inp.offset = list(restored.skipped), consumed - step
    if sharding is not None:
        inp.read_with(Reader(global_batch(sharding, b) for b in inp.source))
    return inp


def global_batch(sharding: Any, batch: Any) -> Any:
    """This process's `batch` (a pytree) as part of a global array laid out by `sharding`."""
    import jax

    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)


def is_callable_source(data: Any) -> bool:
    """Whether `data` is read as ``data(start_step)`` (a callable, not an iterable)."""
    return callable(data) and not hasattr(data, "__iter__") and not hasattr(data, "__next__")


def _open(data: Any, start_step: int, position: Any, restored: bool) -> Input:
    if is_callable_source(data):
        inp = Input(iter(data(start_step)), "callable", start_step)
        inp.reopen = data
        return inp
    try:
        it = iter(data)
    except TypeError:
        raise TypeError(
            f"data={data!r} is not supported: pass an iterable of batches, a callable "
            "data(start_step) returning one, an iterator with get_state()/set_state(), or None"
        ) from None
    if is_stateful(it):
        if restored and position is not None:
            it.set_state(position)
        elif restored and start_step > 0:
            log.warning(
                "loopkit: the checkpoint holds no input position; the data iterator "
                "starts where it stands"
            )
        return Input(it, "stateful", start_step)
    if restored and start_step > 0:
        log.warning(
            "loopkit: resumed at step %d but the input position was not restored: data is a "
            "plain iterable, used as given. Pass a callable data(start_step) or an iterator "
            "with get_state()/set_state() for an exact resume.", start_step,
        )
    return Input(it, "iterable", start_step)
