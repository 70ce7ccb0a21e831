"""Peer copies of the local tier (`Config.local_replicas`): a lost machine's part survives.

In a job of ``n`` processes each keeps its own local tier in
``<local_checkpoint_dir>/process-<i>``. With ``local_replicas=k`` process ``i``'s part
of each local checkpoint is also kept by processes ``i+1 … i+k`` (mod ``n``), each in
its own ``process-<j>/peer-<i>/``, under the same names as the owner's (the backend's
own files, so the same backend reads them), and with the same retention
(`max_to_keep_local`).

Copying: after each local commit (`Tier._committed`) the owner's copier thread pushes
the part to its successors' servers (`peer_transfer`), newest commit first: a commit
that comes while a copy runs replaces any that waits. The loop never waits for it.

Recovery (`recovery.find_local`): one gather of which steps every process holds, its
own and its peer copies (`plan`); a step counts when every process's part is held by
its owner or a peer. For the newest such step, a process whose own part is gone
receives it from the nearest peer that holds it into its own directory (`fetch`), then
every process reads its own part as without peers. Nothing of the durable tier is read.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Collection

import jax
import numpy as np

from loopkit.plugins.checkpoint.collectives import COMPARED_STEPS, gather_rows
from loopkit.process.job import coordinator_address, kv_client
from loopkit.plugins.checkpoint.peer_transfer import (
    PartServer, background, fetch_part, push_part, remove_incoming,
)

__all__ = ["Peers", "open_peers"]

log = logging.getLogger("loopkit")

#: where process i's server address is published in jax.distributed's key-value store
KEY = "loopkit/peers/{}"
#: how long a process waits for another's address to be published
ADDRESS_WAIT_SECS = 120

def open_peers(config: Any, own_dir: Path) -> Peers | None:
    """The session's `Peers`, or None when `Config.local_replicas` is 0 or there is one
    process; `ValueError` naming the field when it is not less than the process count."""
    k, n = config.local_replicas, jax.process_count()
    if not k:
        return None
    if n == 1:
        log.info("loopkit: Config.local_replicas=%d is ignored: this job has one process, "
                 "no peers to keep copies", k)
        return None
    if k >= n:
        raise ValueError(f"Config.local_replicas={k!r} is not allowed with {n} processes: "
                         f"expected less than the process count (at most {n - 1} others "
                         "can keep a copy of each process's local checkpoints)")
    return Peers(own_dir, config.checkpoint_basename, k,
                 config.max_to_keep_local or None)


#: the host name or address other processes reach this process's part server by, where
#: the one found from the coordinator's address is wrong (a NAT, several networks)
HOST_ENV = "LOOPKIT_PEER_HOST"
_LOOPBACK = ("localhost", "localhost.localdomain")


def server_host(coordinator: str | None) -> tuple[str, str]:
    """(the address this process's part server listens on, the host its peers are told).

    `HOST_ENV` when set (listening on every interface: the published name may be a NAT's).
    Else the address this host reaches the coordinator (``host:port``) from, which its
    peers reach it by, found by connecting a datagram socket (nothing is sent). That is a
    loopback address when the coordinator is given as one (every process is on this
    host), and also on the coordinator's own host when the name it is given by resolves
    to loopback here (a hostname mapped to 127.0.1.1 in /etc/hosts, as Debian does, or
    SLURM's node name): the other hosts resolve that name to the host's real address, so
    that name is published and the server listens on every interface. Likewise when the
    route cannot be found: this host's fully qualified name, every interface.
    """
    override = os.environ.get(HOST_ENV, "").strip()
    if override:
        return _every(override), override
    host, _, port = str(coordinator or "127.0.0.1:0").rpartition(":")
    host = host.strip("[]")
    if _is_loopback(host) or host.lower() in _LOOPBACK:
        return host, host
    try:
        family, kind, _, _, where = socket.getaddrinfo(host, int(port or 0),
                                                       type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as s:
            s.connect(where)  # a datagram socket: nothing is sent
            own = str(s.getsockname()[0])
    except OSError:
        name = socket.getfqdn()
        return _every(name), name
    if _is_loopback(own):  # the coordinator's host, by a name that is loopback here
        return _every(own), host
    return own, own


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def _every(host: str) -> str:
    """The wildcard address of `host`'s family: every interface."""
    return "::" if ":" in host else "0.0.0.0"


def _client() -> Any:
    return kv_client()


class Peers:
    """This process's peer copies: its server, its copier thread, and recovery's plan."""

    def __init__(self, own_dir: Path, basename: str, k: int, keep: int | None) -> None:
        self.me, self.n, self.k = jax.process_index(), jax.process_count(), k
        self.own_dir, self.basename, self.keep = Path(own_dir), basename, keep
        self._name = re.compile(re.escape(basename) + r"-(0|[1-9][0-9]*)")
        #: whether the step restored last (`fetch`) had a part that came from a peer
        self.from_peer = False
        #: (step, seconds, bytes) of each completed copy to a peer, for benchmarks
        self.copies: list[tuple[int, float, int]] = []
        #: (seconds, bytes) of this process's part received from a peer (`fetch`), or None
        self.received: tuple[float, int] | None = None
        self._sources: dict[int, list[int]] = {}
        self._addresses: dict[int, dict] = {}
        self._lock = threading.Condition()
        self._wanted: int | None = None  # the newest commit not yet copied
        self._busy: int | None = None  # the step being copied
        self._closing = False
        for d in [self.own_dir, *self._peer_dirs()]:
            remove_incoming(d)
        listen, host = server_host(coordinator_address())
        self.server = PartServer(host, self.part, self._received, listen=listen)
        _client().key_value_set(KEY.format(self.me), json.dumps(self.server.address),
                                allow_overwrite=True)
        self._thread = threading.Thread(target=self._copy_loop, daemon=True,
                                        name="loopkit-peer-copies")
        self._thread.start()

    # -- where parts live ----------------------------------------------------------

    def part(self, owner: int, step: int) -> Path:
        """Owner `owner`'s part of `step` on this process: its own, or a peer copy."""
        base = self.own_dir if owner == self.me else self.own_dir / f"peer-{owner}"
        return base / f"{self.basename}-{int(step)}"

    def _peer_dirs(self) -> list[Path]:
        return sorted(self.own_dir.glob("peer-*")) if self.own_dir.is_dir() else []

    def held(self) -> dict[int, list[int]]:
        """The peer copies this process holds: owner -> steps, newest first."""
        found: dict[int, list[int]] = {}
        for d in self._peer_dirs():
            owner = d.name.removeprefix("peer-")
            if owner.isdigit():
                steps = [int(m.group(1)) for p in d.iterdir()
                         if p.is_dir() and (m := self._name.fullmatch(p.name))]
                found[int(owner)] = sorted(steps, reverse=True)
        return found

    def _received(self, owner: int, step: int) -> None:
        """A copy of `owner`'s part of `step` is in place: keep its newest `keep`."""
        if self.keep is None:
            return
        for old in self.held().get(owner, [])[self.keep:]:
            shutil.rmtree(self.part(owner, old), ignore_errors=True)

    # -- copying after each local commit ---------------------------------------------

    def committed(self, step: int) -> None:
        """The local tier committed `step` (in its commit thread): copy it to the peers."""
        with self._lock:
            self._wanted = step
            self._lock.notify_all()

    def _copy_loop(self) -> None:
        background()
        while True:
            with self._lock:
                while self._wanted is None and not self._closing:
                    self._lock.wait()
                if self._wanted is None:
                    return
                step, self._wanted, self._busy = self._wanted, None, self._wanted
            try:
                for j in range(1, self.k + 1):
                    self._push(step, (self.me + j) % self.n)
            finally:
                with self._lock:
                    self._busy = None
                    self._lock.notify_all()

    def _push(self, step: int, to: int) -> None:
        part = self.part(self.me, step)
        t0 = time.perf_counter()
        try:
            size = push_part(self._address(to), part, self.me, step)
        except Exception as ex:  # noqa: BLE001 - a copy lost is a step that may not count
            if not part.is_dir():  # retention removed it meanwhile: a newer one follows
                log.debug("loopkit: %s went before it was copied to process %d", part, to)
            elif isinstance(ex, ConnectionError):
                log.info("loopkit: no peer copy of %s on process %d: it does not answer "
                         "(stopped?): %s", part, to, ex)
            else:
                log.warning("loopkit: copying %s to process %d failed (%s: %s); that copy "
                            "is missing until the next local save", part, to,
                            type(ex).__name__, ex)
            return
        secs = time.perf_counter() - t0
        self.copies.append((step, secs, size))
        log.debug("loopkit: copied %s to process %d: %d bytes in %.3f s", part, to, size, secs)

    def _address(self, process: int) -> dict:
        if process not in self._addresses:
            text = _client().blocking_key_value_get(KEY.format(process),
                                                    ADDRESS_WAIT_SECS * 1000)
            self._addresses[process] = json.loads(text)
        return self._addresses[process]

    def wait(self, timeout: float) -> bool:
        """Wait until no copy runs or waits (at most `timeout` s); False if one still does."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._wanted is not None or self._busy is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def drop_after(self, first: int, grace_secs: float) -> None:
        """A rollback abandoned steps `first` and later: copy none of them any more, and
        delete the copies of them this process holds, so that no restart resumes them
        (the local commits were joined first: none of those steps is copied after)."""
        with self._lock:
            if self._wanted is not None and self._wanted >= first:
                self._wanted = None
        self.wait(grace_secs)
        for owner, steps in self.held().items():
            for s in steps:
                if s >= first:
                    shutil.rmtree(self.part(owner, s), ignore_errors=True)

    def close(self, grace_secs: float) -> None:
        """Finish the copy in flight (at most `grace_secs`), then stop serving."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._thread.join(grace_secs)
        self.server.close()

    # -- recovery --------------------------------------------------------------------

    def plan(self, own: Collection[int]) -> list[int]:
        """The steps whose every part is held by its owner or a peer, newest first (a
        collective: every process offers its `own` local steps and its peer copies)."""
        offers = [(self.me, s) for s in sorted(own, reverse=True)[:COMPARED_STEPS]]
        held = self.held()
        for owner in sorted(held, key=lambda o: (self.me - o) % self.n):  # nearest first
            offers += [(owner, s) for s in held[owner][:COMPARED_STEPS]]
        width = COMPARED_STEPS * (self.k + 1)
        row = np.full((width, 2), -1, np.int32)
        if offers:
            row[:min(width, len(offers))] = offers[:width]
        rows = gather_rows(row)
        holders: dict[tuple[int, int], list[int]] = defaultdict(list)
        for p in range(self.n):
            for owner, step in rows[p].tolist():
                if step >= 0 and 0 <= owner < self.n:
                    holders[(owner, step)].append(p)
        found = []
        for step in sorted({s for _, s in holders}, reverse=True):
            where = [holders.get((o, step)) for o in range(self.n)]
            if all(where):  # every part somewhere: from its owner, else the nearest peer
                self._sources[step] = [o if o in ps else min(ps, key=lambda p: (p - o) % self.n)
                                       for o, ps in enumerate(where)]
                found.append(step)
        return found

    def fetch(self, step: int) -> None:
        """Before reading `step` (one of `plan`'s): receive this process's part from the
        peer that holds it, when it is not here."""
        sources = self._sources[step]
        self.from_peer = any(src != owner for owner, src in enumerate(sources))
        source = sources[self.me]
        if source == self.me:
            return
        t0 = time.perf_counter()
        size = fetch_part(self._address(source), self.me, step, self.part(self.me, step))
        self.received = (time.perf_counter() - t0, size)
        log.info("loopkit: received this process's part of local step %d from process %d "
                 "(%d bytes in %.2f s)", step, source, size, self.received[0])
