"""Moving a process's part of a local checkpoint between processes, over the job's network.

Each process of a job with `Config.local_replicas` runs a `PartServer`: a small HTTP
server on an ephemeral port of an address the other hosts reach (`peers.server_host`),
answering only requests that carry the job's random
token (published with the address in `jax.distributed`'s key-value store, which only
the job's processes read). It serves the parts this process holds (its own, and its
peer copies) and receives the peer copies others push to it. Files move in chunks
(`CHUNK`): neither side ever holds a whole part in memory.

A part is a directory (``<basename>-<step>/``, the backend's own files). It arrives
under a temporary name (``.<basename>-<step>.incoming-<tag>``), is fsynced, checked
against the sender's count of files and bytes, and only then renamed to its name: a
sender that dies mid-copy leaves a temporary that no listing counts, removed at the
next start (`remove_incoming`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import socket
import threading
import uuid
from http.client import HTTPConnection
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from typing import Any, Callable
from urllib.parse import parse_qs, urlencode, urlparse

from loopkit.storage.local import fsync_dir, fsync_tree

__all__ = ["CHUNK", "PartServer", "fetch_part", "push_part", "remove_incoming"]

log = logging.getLogger("loopkit")

#: bytes read or written at a time, on either side
CHUNK = 1 << 20
#: the seconds a request may stall before it fails
TIMEOUT_SECS = 60
_TOKEN = "X-Loopkit-Token"
_INCOMING = re.compile(r"\..+\.incoming-[0-9a-f]+")


def files_of(part: Path) -> list[tuple[str, int]]:
    """The files of the directory `part`: (path relative to it, in posix form; size)."""
    found = []
    for dirpath, _dirs, names in os.walk(part):
        for name in names:
            p = Path(dirpath, name)
            found.append((p.relative_to(part).as_posix(), p.stat().st_size))
    return sorted(found)


def remove_incoming(directory: Path) -> None:
    """Remove what copies that never completed left in `directory`."""
    if directory.is_dir():
        for p in directory.iterdir():
            if _INCOMING.fullmatch(p.name):
                shutil.rmtree(p, ignore_errors=True)


def publish_dir(incoming: Path, final: Path, files: int, size: int) -> None:
    """Make the copy `incoming` durable and rename it to `final` once it holds `files`
    files of `size` bytes in all (else remove it and raise)."""
    got = files_of(incoming) if incoming.is_dir() else []
    if (len(got), sum(s for _, s in got)) != (files, size):
        shutil.rmtree(incoming, ignore_errors=True)
        raise OSError(f"copy {incoming} holds {len(got)} files, {sum(s for _, s in got)} "
                      f"bytes; the sender sent {files} files, {size} bytes")
    fsync_tree(incoming)
    if final.exists():  # the same step saved again (after a restart): the new one wins
        trash = final.with_name(f".{final.name}.incoming-{uuid.uuid4().hex}")
        os.rename(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(incoming, final)
    fsync_dir(final.parent)


def _inside(base: Path, rel: str) -> Path:
    """`base / rel` for a relative path that stays inside `base`."""
    parts = PurePosixPath(rel).parts
    if not parts or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"not a relative path inside the part: {rel!r}")
    return base.joinpath(*parts)


def _copy(source: Any, length: int, out: Path) -> None:
    """Write `length` bytes read from `source` (`readinto`) to the file `out`, a chunk at
    a time into one buffer (no allocation per chunk: the copy competes with the loop)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    buffer = memoryview(bytearray(min(CHUNK, max(length, 1))))
    with open(out, "wb") as f:
        left = length
        while left:
            got = source.readinto(buffer[:min(len(buffer), left)])
            if not got:
                raise OSError(f"the connection ended {left} bytes short of {out}")
            f.write(buffer[:got])
            left -= got


def background() -> None:
    """Lower this thread's CPU priority (Linux: niceness is per thread): a copy gives
    way to the training loop on a busy machine."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class PartServer:
    """Serves the parts under `root` and receives peer copies into it, listening on
    `listen` (default `host`), reached by its peers at `host` (`address`).

    `locate(owner, step)`: the directory of owner `owner`'s part of `step` here (its own
    or a peer copy); `received(owner, step)`: called once a peer copy is in place
    (retention)."""

    def __init__(self, host: str, locate: Callable[[int, int], Path],
                 received: Callable[[int, int], None], listen: str | None = None) -> None:
        self.token = secrets.token_hex(16)
        self.locate, self.received = locate, received
        listen = host if listen is None else listen
        family = socket.AF_INET6 if ":" in listen else socket.AF_INET
        server_class = type("Server", (ThreadingHTTPServer,),
                            {"address_family": family, "daemon_threads": True})
        self.httpd = server_class((listen, 0), _handler(self))
        self.address = {"host": host, "port": self.httpd.server_address[1],
                        "token": self.token}
        self._thread = threading.Thread(target=self.httpd.serve_forever,
                                        name="loopkit-peer-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler(server: PartServer) -> type[BaseHTTPRequestHandler]:
    # long: the request handler of the part server's routes, kept beside the server state it
    # closes over
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # one connection for every file of a part
        # the header and a small file's body go in two writes: with Nagle's algorithm the
        # second waits for the client's delayed ACK, ~40 ms per file (measured)
        disable_nagle_algorithm = True

        def log_message(self, *args: object) -> None:  # the run's log is not an access log
            pass

        def _args(self) -> tuple[str, dict[str, str], Path]:
            url = urlparse(self.path)
            q = {k: v[0] for k, v in parse_qs(url.query).items()}
            if not secrets.compare_digest(self.headers.get(_TOKEN, ""), server.token):
                raise PermissionError("wrong token")
            return url.path, q, server.locate(int(q["owner"]), int(q["step"]))

        def _answer(self, code: int, body: bytes = b"") -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _run(self, action: Callable[[str, dict[str, str], Path], None]) -> None:
            if self.command != "GET":  # a copy in the background of training gives way;
                background()  # a part fetched is a restore every process waits for
            try:
                action(*self._args())
                return
            except PermissionError as ex:
                self._answer(403, str(ex).encode())
            except FileNotFoundError as ex:
                self._answer(404, str(ex).encode())
            except Exception as ex:  # noqa: BLE001 - told to the other side
                self._answer(500, f"{type(ex).__name__}: {ex}".encode())
            self.close_connection = True  # a body may be left unread: no next request

        def do_GET(self) -> None:
            self._run(self._get)

        def _get(self, path: str, q: dict[str, str], part: Path) -> None:
            if path == "/list":
                if not part.is_dir():
                    raise FileNotFoundError(f"no part {part}")
                return self._answer(200, json.dumps(files_of(part)).encode())
            with open(_inside(part, q["path"]), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self.send_response(200)
                self.send_header("Content-Length", str(size))
                self.end_headers()
                self.wfile.flush()
                self.connection.sendfile(f)  # by the kernel, without the GIL

        def do_PUT(self) -> None:
            self._run(self._put)

        def _put(self, path: str, q: dict[str, str], part: Path) -> None:
            incoming = part.with_name(f".{part.name}.incoming-{int(q['tag'], 16):x}")
            _copy(self.rfile, int(self.headers["Content-Length"]), _inside(incoming, q["path"]))
            self._answer(200)

        def do_POST(self) -> None:
            self._run(self._commit)

        def _commit(self, path: str, q: dict[str, str], part: Path) -> None:
            incoming = part.with_name(f".{part.name}.incoming-{int(q['tag'], 16):x}")
            publish_dir(incoming, part, int(q["files"]), int(q["bytes"]))
            server.received(int(q["owner"]), int(q["step"]))
            self._answer(200)

    return Handler


class _Connection:
    """Requests to one process's `PartServer`."""

    def __init__(self, address: dict) -> None:
        self.conn = HTTPConnection(address["host"], address["port"], timeout=TIMEOUT_SECS,
                                   blocksize=CHUNK)
        self.token = address["token"]

    def send(self, method: str, path: str, query: dict, body: Any = None,
             length: int = 0) -> Any:
        """One request; `body`: bytes, or a file sent by the kernel (`sendfile`)."""
        self.conn.putrequest(method, f"{path}?{urlencode(query)}")
        self.conn.putheader(_TOKEN, self.token)
        self.conn.putheader("Content-Length", str(length))
        self.conn.endheaders()
        if isinstance(body, bytes):
            self.conn.send(body)
        elif body is not None:
            self.conn.sock.sendfile(body, 0, length)
        answer = self.conn.getresponse()
        if answer.status != 200:
            raise OSError(f"{method} {path} {query}: {answer.status} "
                          f"{answer.read().decode(errors='replace')}")
        return answer

    def close(self) -> None:
        self.conn.close()


def push_part(address: dict, part: Path, owner: int, step: int) -> int:
    """Copy this process's part `part` (owner `owner`'s, of `step`) to the server at
    `address`; the bytes sent."""
    files = files_of(part)
    query = {"owner": owner, "step": step, "tag": uuid.uuid4().hex}
    conn = _Connection(address)
    try:
        for rel, size in files:
            with open(part / rel, "rb") as f:
                conn.send("PUT", "/file", {**query, "path": rel}, f, size).read()
        size = sum(s for _, s in files)
        conn.send("POST", "/commit", {**query, "files": len(files), "bytes": size}).read()
        return size
    finally:
        conn.close()


def fetch_part(address: dict, owner: int, step: int, part: Path) -> int:
    """Receive owner `owner`'s part of `step` from the server at `address` into the
    directory `part` (through a temporary name); the bytes received."""
    query = {"owner": owner, "step": step}
    incoming = part.with_name(f".{part.name}.incoming-{uuid.uuid4().hex}")
    conn = _Connection(address)
    try:
        files = json.loads(conn.send("GET", "/list", query).read())
        for rel, size in files:
            answer = conn.send("GET", "/file", {**query, "path": rel})
            _copy(answer, size, _inside(incoming, rel))
        total = sum(s for _, s in files)
        publish_dir(incoming, part, len(files), total)
        return total
    except BaseException:
        shutil.rmtree(incoming, ignore_errors=True)
        raise
    finally:
        conn.close()
