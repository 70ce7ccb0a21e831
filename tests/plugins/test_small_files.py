"""Small files are written whole; staging directories are owned by a lock; a local tier's
directory that is a file is named at start-up."""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from loopkit import storage
from loopkit.storage.local import atomic_write_bytes


def step_fn(state, batch):
    return {"w": state["w"] + batch}, {}


def init():
    return {"w": jnp.zeros((3,), jnp.float32)}


def data(start_step):
    return (np.full((3,), float(i), np.float32) for i in itertools.count(start_step))


# -- small files -------------------------------------------------------------------------------


def test_two_threads_writing_one_small_file_never_collide_and_leave_no_temporary(tmp_path):
    target = tmp_path / "checkpoint"
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def write(i: int) -> None:
        start.wait()
        try:
            for n in range(200):
                atomic_write_bytes(target, f"writer {i} write {n}\n".encode() * 50)
        except BaseException as ex:  # noqa: BLE001 - the test reports it
            errors.append(ex)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    lines = set(target.read_text().splitlines())
    assert len(lines) == 1 and re.fullmatch(r"writer \d write 199", lines.pop())
    assert os.listdir(tmp_path) == ["checkpoint"]


def test_a_failed_small_file_write_leaves_no_temporary(tmp_path):
    (tmp_path / "checkpoint").mkdir()  # a directory where the file goes: the rename fails
    with pytest.raises(IsADirectoryError):
        storage.write_atomic(tmp_path / "checkpoint", b"model_checkpoint_path: \"x\"\n")
    assert os.listdir(tmp_path) == ["checkpoint"]
    assert os.listdir(tmp_path / "checkpoint") == []


def test_a_small_file_keeps_the_usual_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "status.json", b"{}")
    finally:
        os.umask(old)
    assert (tmp_path / "status.json").stat().st_mode & 0o777 == 0o644


# -- staging directories -----------------------------------------------------------------------

OWNER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from loopkit.plugins.checkpoint.backends.temporaries import own_directory
    path, fd = own_directory(Path(sys.argv[1]), "loopkit-stage-1-")
    (path / "model.ckpt-5").mkdir()
    print(path, flush=True)
    time.sleep(600)
""")


def test_a_stage_is_removed_only_once_its_owner_is_gone(tmp_path, monkeypatch):
    """Judged by the lock its owner holds, not a process id: the stage of a live process
    (whatever its pid) is kept, a killed one's is removed, and so is one from before the
    lock (no lock file). The cleaner is the staged backend's start."""
    import tempfile

    from loopkit.plugins.checkpoint.backends.staged import StagedBackend
    from loopkit.plugins.checkpoint.backends.npz import NpzBackend

    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(root)], stdout=subprocess.PIPE,
                             text=True)
    try:
        live = Path(owner.stdout.readline().strip())
        assert live.parent == root and (live / "model.ckpt-5").is_dir()
        legacy = root / f"loopkit-stage-{os.getpid()}-old"  # this pid, yet no owner holds it
        (legacy / "model.ckpt-3").mkdir(parents=True)
        other = root / "unrelated"
        other.mkdir()
        url = f"memory://loopkit-test-stages-{os.getpid()}/run"
        backend = StagedBackend(url, "model.ckpt", NpzBackend)
        try:
            assert live.exists() and not legacy.exists() and other.exists()
            mine = backend._stage
            # a second backend (another process, or this one) keeps the first one's stage
            second = StagedBackend(url, "model.ckpt", NpzBackend)
            assert mine.exists() and live.exists()
            second.close()
        finally:
            backend.close()
        assert not mine.exists()
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
        StagedBackend(url, "model.ckpt", NpzBackend).close()
        assert sorted(p.name for p in root.iterdir()) == ["unrelated"]
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


# -- the local tier's directory ----------------------------------------------------------------


@pytest.mark.parametrize("inside", [False, True])
def test_a_local_checkpoint_dir_that_is_a_file_fails_naming_the_field(tmp_path, inside):
    file = tmp_path / "local"
    file.write_text("not a directory")
    local = file / "tier" if inside else file
    with pytest.raises(ValueError) as info:
        loopkit.train(step_fn, init=init, data=data, logdir=tmp_path / "run", max_steps=3,
                      local_checkpoint_dir=local, progress=False)
    message = str(info.value)
    assert f"Config.local_checkpoint_dir={str(local)!r}" in message, message
    assert "existing file" in message and "expected a directory" in message
    if inside:
        assert f"is inside {str(file)!r}" in message
