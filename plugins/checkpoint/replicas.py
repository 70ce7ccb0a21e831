"""Many processes: host-local leaves are replicas, checked at every save.

A leaf that each process holds on its own -- a numpy array, a Python scalar, a jax
array on this process's devices only (pmap-era data parallelism, a small script's
replicated model) -- is a replica of one value. orbax refuses host-local jax arrays
in a multi-process save, and one copy is all a checkpoint needs: they are handed to
the backend as this host's numpy values, which orbax writes from process 0 (the
chief's copy, as flax's old checkpointing kept), and a restore places them like
`init`'s leaves, host-local again.

At each save, every process sends one fingerprint per replica (a CRC-32 of its
bytes), whether its previous save committed, and whether it vetoes the save, in one
gather at the step every process saves (the save is itself agreed): nothing runs per
step. A leaf whose replicas differ fails the save on every process, naming the leaf
and the processes. A veto (`SAVE_VETO`: the rollback guard holds a bad value on that
process, its state perhaps no longer a replica of the others') replaces the save on
every process by the veto's `vetoed` (a rollback), before the replicas are compared.
"""

from __future__ import annotations

import zlib
from typing import Any, Optional, Protocol

import jax
import numpy as np

from loopkit.errors import CheckpointError
from loopkit.plugins.checkpoint.collectives import gather_rows
from loopkit.state.pytree import is_key, leaf_path
from loopkit.loop.stash import StashKey

__all__ = ["SAVE_VETO", "SaveVeto", "agree_to_save", "host_copies"]


class SaveVeto(Protocol):
    """What a plugin puts in `SAVE_VETO` to stop a multi-process durable save."""

    def vetoes(self, session: Any) -> bool:
        """This process's view, just before the save's agreement: True to stop it."""

    def vetoed(self, session: Any, final: bool) -> None:
        """Some process vetoed: called on every process at the same step instead of the
        save (`final`: the save at a normal stop)."""


#: many processes: the session's `SaveVeto`, if a plugin (the rollback guard) set one
SAVE_VETO = StashKey[Optional[SaveVeto]]()


def _fingerprint(value: Any) -> int:
    if isinstance(value, (bool, int, float, str)):
        return zlib.crc32(repr((type(value).__name__, value)).encode())
    arr = np.ascontiguousarray(value)
    head = zlib.crc32(f"{arr.dtype.str}{arr.shape}".encode())
    return zlib.crc32(arr.reshape(-1).view(np.uint8), head)


def host_copies(state: Any) -> tuple[Any, list[str], list[int]]:
    """`state` with host-local jax arrays as host numpy values; replica paths and prints.

    Global arrays (spanning processes) stay as they are: orbax writes each
    process's shards of those.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: x is None)
    leaves, names, prints = [], [], []
    for keypath, leaf in flat:
        if leaf is None or (isinstance(leaf, jax.Array) and not leaf.is_fully_addressable):
            leaves.append(leaf)
            continue
        if isinstance(leaf, jax.Array):
            if is_key(leaf.dtype):
                host = np.asarray(jax.random.key_data(leaf))  # kept typed for the backend
            else:
                leaf = host = np.asarray(leaf)  # on CPU a view; the backend copies it
        else:
            host = leaf
        leaves.append(leaf)
        names.append(leaf_path(keypath))
        prints.append(_fingerprint(host))
    return jax.tree_util.tree_unflatten(treedef, leaves), names, prints


def agree_to_save(where: str, names: list[str], prints: list[int],
                  failed: BaseException | None, local_due: bool = False,
                  veto: SaveVeto | None = None, session: Any = None) -> tuple[bool, bool]:
    """Gather every process's fingerprints, last-commit status and veto; raise on all alike.

    `failed` is this process's error from its previous save, if any: every
    process then raises (this one its own error), so none enters a save alone.
    `local_due`: this process's local-tier timer is due too (by its own clock).
    `veto`: asked whether this process stops the save (`SaveVeto.vetoes(session)`).
    Returns whether the local tier is due on any process, so all save it at this
    step or none does, and whether any process vetoed (then the replicas are not
    compared: no save).
    """
    vetoes = veto is not None and veto.vetoes(session)
    mine = np.asarray([int(failed is not None), int(local_due), int(vetoes), *prints],
                      np.uint32)
    table = gather_rows(mine)
    broken = [int(p) for p in np.flatnonzero(table[:, 0])]
    if broken:
        if failed is not None:
            raise failed
        raise CheckpointError(f"not saving {where}: the previous checkpoint save failed on "
                              f"process{'es' if len(broken) > 1 else ''} "
                              f"{', '.join(map(str, broken))} (its own output has the error)")
    if table[:, 2].any():
        if veto is None:  # every process runs the same plugins, the same Config
            raise CheckpointError(f"not saving {where}: another process vetoed it (a bad "
                                  "value), and this one has no Config.on_guard='rollback'")
        return False, True
    for col, name in enumerate(names, start=3):
        column = table[:, col]
        odd = [int(p) for p in np.flatnonzero(column != column[0])]
        if odd:
            raise CheckpointError(
                f"not saving {where}: the host-local leaf {name!r} differs between processes "
                f"(process 0 and process{'es' if len(odd) > 1 else ''} "
                f"{', '.join(map(str, odd))} hold different values). A leaf that each process "
                "holds on its own is a replica and must be the same everywhere; a value that "
                "differs per process belongs in a global jax.Array (sharded over the processes)")
    return bool(table[:, 1].any()), False
