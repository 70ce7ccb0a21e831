"""The transfer under peer copies of the local tier: a real server on 127.0.0.1, a real
sender process SIGKILLed in the middle of a copy."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from loopkit.plugins.checkpoint.peer_transfer import (
    PartServer, fetch_part, push_part, remove_incoming,
)

SENDER = """
import json, sys
from pathlib import Path
from loopkit.plugins.checkpoint import peer_transfer as t
print(t.push_part(json.loads(sys.argv[1]), Path(sys.argv[2]), 0, 5))
"""


def make_part(where: Path, big: int) -> Path:
    part = where / "model.ckpt-5"
    (part / "d").mkdir(parents=True)
    (part / "a.json").write_text('{"step": 5}')
    (part / "d" / "big").write_bytes(os.urandom(big))
    return part


def tree(part: Path) -> dict[str, bytes]:
    return {p.relative_to(part).as_posix(): p.read_bytes()
            for p in sorted(part.rglob("*")) if p.is_file()}


@pytest.fixture
def server(tmp_path):
    held, received = tmp_path / "held", []
    s = PartServer("127.0.0.1", lambda owner, step: held / f"peer-{owner}" / f"model.ckpt-{step}",
                   lambda owner, step: received.append((owner, step)))
    s.held, s.got = held, received
    yield s
    s.close()


def test_a_sender_killed_mid_copy_leaves_nothing_counted_and_a_full_copy_lands(tmp_path,
                                                                               server):
    part = make_part(tmp_path / "own", 64 << 20)
    sender = subprocess.Popen([sys.executable, "-c", SENDER, json.dumps(server.address),
                               str(part)], stdout=subprocess.PIPE, text=True)
    peer = server.held / "peer-0"
    deadline = time.monotonic() + 60
    while not any(p.is_file() and p.stat().st_size > 0 for p in peer.rglob("big")):
        assert time.monotonic() < deadline and sender.poll() is None, "no copy began"
        time.sleep(0.01)
    sender.send_signal(signal.SIGKILL)
    sender.wait()
    # the half-sent copy is under a temporary name only: no step listed, nothing received
    assert next(p.name for p in peer.iterdir()).startswith(".model.ckpt-5.incoming-")
    assert not (peer / "model.ckpt-5").exists() and server.got == []
    remove_incoming(peer)  # as the next start does
    assert list(peer.iterdir()) == []

    assert push_part(server.address, part, 0, 5) == (64 << 20) + len('{"step": 5}')
    assert tree(peer / "model.ckpt-5") == tree(part) and server.got == [(0, 5)]
    back = tmp_path / "replaced" / "model.ckpt-5"  # a replaced machine takes it back
    back.parent.mkdir()
    fetch_part(server.address, 0, 5, back)
    assert tree(back) == tree(part)
    assert [p.name for p in back.parent.iterdir()] == ["model.ckpt-5"]


def test_the_server_answers_only_the_job_and_only_inside_its_parts(tmp_path, server):
    part = make_part(tmp_path / "own", 10)
    push_part(server.address, part, 0, 5)
    url = f"http://127.0.0.1:{server.address['port']}"

    def get(query, token=server.token):
        request = urllib.request.Request(f"{url}/file?{query}",
                                         headers={"X-Loopkit-Token": token})
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.status
        except urllib.error.HTTPError as ex:
            return ex.code

    assert get("owner=0&step=5&path=a.json") == 200
    assert get("owner=0&step=5&path=a.json", token="guess") == 403
    assert get("owner=0&step=5&path=../../own/model.ckpt-5/a.json") == 500
    assert get("owner=0&step=6&path=a.json") == 404
    # a copy that does not add up to what the sender counted is refused, and removed
    with pytest.raises(OSError, match="the sender sent 3 files"):
        from loopkit.plugins.checkpoint import peer_transfer

        conn = peer_transfer._Connection(server.address)
        conn.send("PUT", "/file", {"owner": 0, "step": 7, "tag": "ab", "path": "x"},
                  b"12", 2).read()
        conn.send("POST", "/commit", {"owner": 0, "step": 7, "tag": "ab", "files": 3,
                                      "bytes": 2}).read()
    assert sorted(p.name for p in (server.held / "peer-0").iterdir()) == ["model.ckpt-5"]


def test_the_published_address_is_one_other_hosts_reach(tmp_path, monkeypatch):
    """The server's address comes from the coordinator's: loopback only when the
    coordinator is given as loopback (every process on this host); a name that resolves
    to loopback here only (the coordinator's own host, its name mapped to 127.0.1.1 in
    /etc/hosts) is published as that name, which other hosts resolve to this host's real
    address, with the server on every interface; `LOOPKIT_PEER_HOST` overrides."""
    from loopkit.plugins.checkpoint.peers import HOST_ENV, server_host

    monkeypatch.delenv(HOST_ENV, raising=False)
    assert server_host("127.0.0.1:1234") == ("127.0.0.1", "127.0.0.1")
    assert server_host("localhost:1234") == ("localhost", "localhost")
    assert server_host("[::1]:1234") == ("::1", "::1")
    # "127.1" is no loopback literal, yet resolves to 127.0.0.1: a name loopback here,
    # as the hostname of a Debian host is (and this host's own name, where it is)
    names = ["127.1"] + [n for n in {socket.gethostname()}
                         if ipaddress.ip_address(socket.gethostbyname(n)).is_loopback]
    for name in names:
        assert server_host(f"{name}:1234") == ("0.0.0.0", name), name
    # the routed case: the address of the interface toward the coordinator (a TEST-NET
    # address, nothing sent), never a loopback one; no route at all: this host's name
    listen, host = server_host("192.0.2.1:1234")
    assert listen in (host, "0.0.0.0") and not host.startswith("127."), (listen, host)

    monkeypatch.setenv(HOST_ENV, "node-7.cluster")
    assert server_host("127.0.0.1:1234") == ("0.0.0.0", "node-7.cluster")

    # a server on every interface, published by a name: reached through it
    s = PartServer("localhost", lambda owner, step: tmp_path / "held" / f"model.ckpt-{step}",
                   lambda owner, step: None, listen="0.0.0.0")
    try:
        assert s.address["host"] == "localhost"
        part = make_part(tmp_path / "own", 1000)
        push_part(s.address, part, 0, 5)
        assert tree(tmp_path / "held" / "model.ckpt-5") == tree(part)
    finally:
        s.close()
