"""A state staged for a background reader while the loop goes on, and CPU's spare buffers.

`CompiledStep.stage` hands a saver the state in a form the next steps cannot
overwrite (see loopkit/loop/step.py for which form, where). This module holds the
parts: host copies, host views, and `Spare`, the CPU bookkeeping of buffers a
finished save gave back for a later step to write into.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from loopkit.process.background_compile import compile_in_background
from loopkit.state.pytree import is_key, sharding_of

__all__ = ["Spare", "Staged", "aval", "copied", "copied_arrays", "swap_leaves", "to_host",
           "views", "views_protect"]

log = logging.getLogger("loopkit")


def views_protect() -> bool:
    """Whether holding numpy views of buffers keeps XLA from donating them (CPU)."""
    return jax.default_backend() == "cpu"


def _release_nothing() -> None:
    return None


class Staged(NamedTuple):
    """A state a background thread may read while the loop goes on (`Session.stage_state`)."""

    #: the state to read: the session's, or with the leaves the next step
    #: rewrites copied to host memory
    state: Any
    #: keep this referenced until the reading is done (None when nothing needs it)
    hold: Any
    #: call once the reading is done (the data written): on CPU the buffers then
    #: serve as the spare the step after the next save writes into
    release: Callable[[], None] = _release_nothing


def aval(x: Any) -> Any:
    """What `jit.lower` needs of an argument: its type and placement, not its buffer."""
    if isinstance(x, (jax.Array, np.ndarray)):
        committed = isinstance(x, jax.Array) and x.committed
        return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                    sharding=sharding_of(x) if committed else None,
                                    weak_type=getattr(x, "weak_type", False))
    return x


def views(leaves: Sequence[Any]) -> list[np.ndarray]:
    """Zero-copy host views of every addressable shard of the jax arrays in `leaves`."""
    out = []
    for x in leaves:
        if isinstance(x, jax.Array):
            if is_key(x.dtype):
                x = jax.random.key_data(x)  # the key's own buffer
            out.extend(np.asarray(s.data) for s in x.addressable_shards)
    return out


def copied(arrays: Sequence[jax.Array]) -> list[jax.Array]:
    """Copies of ``arrays`` where they are, committed as they are, in one batch."""
    return jax.device_put(list(arrays), may_alias=False)


def to_host(x: Any) -> Any:
    """`x` copied to host memory, keeping its sharding where the platform can."""
    if not isinstance(x, jax.Array):
        return x
    try:
        return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
    except Exception:  # noqa: BLE001 - no host memory kinds here: a numpy copy
        return np.array(x)


class Spare:
    """CPU: the buffers a finished save gave back, for the step after the next save.

    `jit` is the step's variant that takes ``(frozen,) live, spare, *batch`` and
    donates `spare`, so its outputs land there while a saver reads `live`. It is
    lowered at the first save and compiled in the background (`compile_ahead`), which
    neither a stop nor the process's exit waits for, then used from the first save whose predecessor has given its buffers back.
    Buffers staged by several readers at once are given back by the last of them.
    """

    def __init__(self, jit: Any) -> None:
        self.jit = jit
        #: the buffers the next call writes into (None: a normal call)
        self.next: tuple | None = None
        self._lock = threading.Lock()  # release() comes from readers' threads
        self._given: tuple | None = None  # given back by every reader, not yet taken
        self._readers: dict[tuple[int, ...], list] = {}  # staged buffers: [part, readers]
        self._compiled = threading.Event()
        #: whether `compile_ahead` was called (the compile may be under way, done or failed)
        self.compiling = False
        self._generation = 0  # buffers given back from an older state are not taken

    def take(self, part: tuple) -> bool:
        """Write the next call's outputs into the given-back buffers, if they can be."""
        with self._lock:
            given = self._given
            # given back after a step that donated them (its save had finished
            # before it ran), or still the state the next step takes
            if (given is None or not self._compiled.is_set()
                    or any(a is b or a.is_deleted() for a, b in zip(given, part))):
                return False
            self._given, self.next = None, given
            return True

    def releaser(self, part: tuple) -> Callable[[], None]:
        """What a reader calls (from any thread, once) when done reading `part`."""
        key = tuple(id(x) for x in part)
        with self._lock:
            generation = self._generation
            entry = self._readers.setdefault(key, [part, 0])
            entry[1] += 1
        done = [False]

        def release() -> None:
            with self._lock:
                if done[0]:
                    return
                done[0] = True
                entry[1] -= 1
                if entry[1] == 0 and self._readers.get(key) is entry:
                    del self._readers[key]
                    if generation == self._generation:
                        self._given = part

        return release

    def compile_ahead(self, args: tuple) -> None:
        """Lower `jit` for `args` (avals) here, compile it in a background thread, once.

        Lowering traces the step, so it runs in the caller's thread, inside the
        caller's JAX context (a mesh set with `jax.set_mesh`, x64, ...).
        """
        if self.compiling:
            return
        self.compiling = True
        try:
            lowered = self.jit.lower(*args)
        except Exception:  # noqa: BLE001 - saves then go on without spare buffers
            log.warning("loopkit: could not lower the step's save variant; saves go on "
                        "without spare buffers", exc_info=True)
            return

        def compile_() -> None:
            try:
                lowered.compile()
            except Exception:  # noqa: BLE001 - saves then go on without spare buffers
                log.warning("loopkit: could not compile the step's save variant; saves "
                            "go on without spare buffers", exc_info=True)
                return
            self._compiled.set()

        # nobody waits for it: a stop, `train` returning, the process's exit (see
        # loopkit/process/background_compile.py)
        compile_in_background(compile_, name="loopkit-compile-save-variant")

    def forget(self) -> None:
        """Drop every buffer held or given back until now (a new state, or the end)."""
        with self._lock:
            self._generation += 1
            self._given = self.next = None
            self._readers.clear()

    def close(self) -> None:
        """The session is over. A compile still under way is not waited for: its
        variant serves no later step, and a restart compiles it again if needed."""
        self.forget()


def swap_leaves(state: Any, part: Sequence[Any], new: Sequence[Any]) -> Any:
    """`state` with each leaf of `part` replaced by the same place of `new`."""
    by_id = {id(x): y for x, y in zip(part, new)}
    return jax.tree.map(lambda x: by_id.get(id(x), x), state)


def copied_arrays(tree: Any) -> Any:
    """`tree` with its jax arrays copied where they are, in one batch; its other leaves
    (which a library's jit may treat as static: a string) as they are."""
    leaves, treedef = jax.tree.flatten(tree)
    at = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    for i, x in zip(at, copied([leaves[i] for i in at])):
        leaves[i] = x
    return treedef.unflatten(leaves)
