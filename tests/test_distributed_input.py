"""Real `jax.distributed` jobs on localhost: each process resumes its own input position.

Each process reads its own shard through a stateful iterator, so each has its own
position; the chief alone writes a durable checkpoint's metadata. Every checkpoint,
in every tier, holds every process's position, and each process resumes with its own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

from loopkit.testing import free_port, run_processes

WORKER = Path(__file__).parent / "workers" / "position_worker.py"
TIMEOUT = 150  # a deadlock fails the test instead of hanging CI


def job(tmp_path: Path, name: str, *args: str) -> list[str]:
    """Run both processes of one job to the end; their outputs."""
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # files, not pipes: a chatty process must never block on a full pipe
    ran = run_processes(lambda i: [sys.executable, str(WORKER), *args[:1], str(i), str(port),
                                   *args[1:]], tmp_path, env=env, timeout=TIMEOUT,
                        name=f"{name}.p")
    texts = [t for _, t in ran]
    assert [rc for rc, _ in ran] == [0, 0], [t[-3000:] for t in texts]
    return texts


def positions(checkpoint: Path) -> dict:
    """The input positions in a checkpoint's metadata (orbax's step metadata file)."""
    head = json.loads((checkpoint / "_CHECKPOINT_METADATA").read_text())
    metadata = head["custom_metadata"]["loopkit"]["metadata"]
    return {"own": metadata["data_position"], "every": metadata.get("data_positions")}


def test_a_durable_restore_gives_every_process_its_own_input_position(tmp_path):
    full = job(tmp_path, "full", str(tmp_path / "full"), "20")
    logdir, local = tmp_path / "run", tmp_path / "local"
    job(tmp_path, "first", str(logdir), "12", str(local))
    shards = [{"shard": 0, "next": 12}, {"shard": 1, "next": 12}]
    # every checkpoint, in every tier, holds every process's position
    assert positions(logdir / "model.ckpt-12") == {"own": shards[0], "every": shards}
    assert positions(logdir / "model.ckpt-5")["every"] == [{"shard": 0, "next": 5},
                                                          {"shard": 1, "next": 5}]
    for i in range(2):
        assert positions(local / f"process-{i}" / "model.ckpt-9") == {
            "own": {"shard": i, "next": 9},
            "every": [{"shard": 0, "next": 9}, {"shard": 1, "next": 9}]}
    shutil.rmtree(local)  # the local disks are gone (new machines): the durable tier serves
    resumed = job(tmp_path, "resumed", str(logdir), "20")
    for i, text in enumerate(resumed):
        assert "TIER durable" in text, text[-3000:]
        assert re.search(rf"^POS {i} 12$", text, re.M), text[-3000:]  # its own shard
    finals = [re.search(r"^W (\w+) (\d+)$", t, re.M).groups() for t in full + resumed]
    assert finals[0][1] == "20" and len(set(finals)) == 1  # bit for bit
