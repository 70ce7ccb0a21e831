"""The transfer under peer copies of the local tier: a real server on 127.0.0.1, a real
sender process SIGKILLed in the middle of a copy."""

from __future__ import annotations

import json
import os
import signal
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
