"""A storage error is not a corrupt checkpoint; small files are written whole; stages are owned.

The store that fails is a real filesystem reached as a URL: `FlakyFileSystem`, fsspec's
local filesystem under the scheme ``flaky://``, whose reads of checkpoint objects raise
`ConnectionError` (and its writes `TimeoutError`) a given number of times. Under a URL
the checkpoint plugin reads through the staged backend (its download, then the orbax
read of the staged copy) and saves through its upload, the path every object store takes.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import sys
import textwrap
import threading
import time
from pathlib import Path

import fsspec
import jax.numpy as jnp
import numpy as np
import pytest
from fsspec.implementations.local import LocalFileSystem

import loopkit
from loopkit import storage
from loopkit.storage.retry import RETRY_SECS_ENV, is_store_error
from loopkit.testing import free_port, run_processes

HERE = Path(__file__).parent


class FlakyFileSystem(LocalFileSystem):
    """Local files as ``flaky:///path``; the next `fails` reads of the objects whose path
    holds `target` (a checkpoint's) raise `ConnectionError` (-1: every one)."""

    protocol = ("flaky",)
    fails = 0
    target = "model.ckpt-"
    failed = 0  # how many reads failed so far

    def __init__(self, **kwargs):
        super().__init__(**{"auto_mkdir": True, **kwargs})  # as an object store: no mkdir

    def _check(self, path: str) -> None:
        if self.target in str(path) and self.fails != 0:
            type(self).fails -= 1 if self.fails > 0 else 0
            type(self).failed += 1
            raise ConnectionError(f"injected: connection reset reading {path}")

    def _open(self, path, mode="rb", **kwargs):
        if "r" in mode:
            self._check(path)
        else:
            self._check_write(path)
        return super()._open(path, mode, **kwargs)

    #: the next `write_fails` writes of objects whose path holds `write_target` fail
    write_fails = 0
    write_target = "model.ckpt-"

    def _check_write(self, path: str) -> None:
        if self.write_target in str(path) and self.write_fails != 0:
            type(self).write_fails -= 1 if self.write_fails > 0 else 0
            type(self).failed += 1
            raise TimeoutError(f"injected: timed out writing {path}")

    def put_file(self, path1, path2, callback=None, **kwargs):
        self._check_write(path2)
        return super().put_file(path1, path2, callback=callback, **kwargs)

    def get_file(self, path1, path2, callback=None, **kwargs):
        self._check(path1)
        return super().get_file(path1, path2, callback=callback, **kwargs)


def register(fails: int = 0) -> None:
    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
    FlakyFileSystem.fails, FlakyFileSystem.failed = fails, 0
    FlakyFileSystem.target = "model.ckpt-"
    FlakyFileSystem.write_fails, FlakyFileSystem.write_target = 0, "model.ckpt-"


def step_fn(state, batch):
    return {"w": state["w"] + batch, "n": state["n"] + 1}, {"loss": state["w"][0]}


def init():
    return {"w": jnp.zeros((3,), jnp.float32), "n": jnp.zeros((), jnp.int32)}


def data(start_step):
    return (np.full((3,), float(i), np.float32) for i in itertools.count(start_step))


class Seen:
    """The step the session started from, and the steps it trained."""

    def __init__(self):
        self.start, self.steps = None, []

    @loopkit.hookimpl
    def session_create(self, session):
        self.start = session.step

    @loopkit.hookimpl
    def after_step(self, step):
        self.steps.append(step)


def run(logdir, max_steps, plugins=()):
    return loopkit.train(step_fn, init=init, data=data, logdir=logdir, max_steps=max_steps,
                         save_model_steps=3, save_model_secs=None, progress=False,
                         disable=("summaries",), autoload=False, plugins=list(plugins))


@pytest.fixture
def flaky(tmp_path):
    """A `flaky://` logdir holding committed checkpoints of steps 3 and 6."""
    register()
    url = f"flaky://{tmp_path}/run"
    run(url, 6)
    assert loopkit.latest_checkpoint(url)[0] == 6
    yield url
    FlakyFileSystem.fails = 0


# -- reading at a restore ---------------------------------------------------------------------


def test_a_store_that_fails_a_few_reads_restores_the_newest_checkpoint(flaky, caplog):
    FlakyFileSystem.fails = 3
    seen = Seen()
    with caplog.at_level(logging.WARNING, logger="loopkit"):
        result = run(flaky, 8, [seen])
    assert FlakyFileSystem.failed == 3 and seen.start == 6 and result.step == 8
    np.testing.assert_array_equal(np.asarray(result.state["w"]), np.full(3, 28.0))
    retries = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
    assert len(retries) == 3 and "model.ckpt-6" in retries[0], retries
    assert "ConnectionError: injected" in retries[0]
    assert not any("unreadable" in r.getMessage() for r in caplog.records)


def test_a_store_that_keeps_failing_fails_the_run_and_never_trains_from_an_older_step(
        flaky, monkeypatch):
    monkeypatch.setenv(RETRY_SECS_ENV, "1")
    FlakyFileSystem.fails, FlakyFileSystem.target = -1, "model.ckpt-6/"  # step 3 reads
    listed = storage.read_bytes(f"{flaky}/checkpoint")
    seen = Seen()
    started = time.monotonic()
    with pytest.raises(loopkit.CheckpointError) as info:
        run(flaky, 8, [seen])
    message = str(info.value)
    assert "model.ckpt-6" in message and "ConnectionError: injected" in message, message
    assert "kept failing for 1 s" in message and RETRY_SECS_ENV in message
    assert isinstance(info.value.__cause__, ConnectionError)
    assert time.monotonic() - started < 60
    # the older checkpoint is there and readable, and was not restored: nothing trained
    assert seen.start is None and seen.steps == []
    assert loopkit.load_checkpoint(f"{flaky}/model.ckpt-3")["n"] == 3
    assert storage.read_bytes(f"{flaky}/checkpoint") == listed


@pytest.mark.parametrize("how", ["truncate", "garble"])
def test_a_corrupt_newest_checkpoint_on_a_store_still_falls_back_with_a_warning(
        flaky, tmp_path, how, caplog):
    """Wrong content is no storage error: passed over for the older one, as before."""
    files = [p for p in (tmp_path / "run" / "model.ckpt-6").rglob("*")
             if p.is_file() and p.stat().st_size]
    rng = np.random.default_rng(0)
    for f in files:
        if how == "truncate":
            os.truncate(f, f.stat().st_size // 2)
        else:
            f.write_bytes(rng.integers(0, 256, f.stat().st_size, dtype=np.uint8).tobytes())
    seen = Seen()
    with caplog.at_level(logging.WARNING, logger="loopkit"):
        result = run(flaky, 8, [seen])
    assert seen.start == 3 and result.step == 8
    assert any("model.ckpt-6 is unreadable" in r.getMessage() for r in caplog.records)


def test_a_bad_retry_bound_names_the_variable(flaky, monkeypatch):
    monkeypatch.setenv(RETRY_SECS_ENV, "soon")
    FlakyFileSystem.fails = 1
    with pytest.raises(ValueError, match=f"{RETRY_SECS_ENV}='soon' is not allowed"):
        run(flaky, 8)


def test_real_store_errors_are_told_from_wrong_content(tmp_path):
    """tensorstore's answers (its errors are ValueError with a status) from a real HTTP
    server: 503, 429 and a refused connection are the store's; a missing object, a
    corrupt checkpoint's error and a missing file are content."""
    import http.server

    import tensorstore as ts

    class Answer(http.server.BaseHTTPRequestHandler):
        code = 503

        def do_GET(self):
            self.send_response(Answer.code)
            self.end_headers()
            self.wfile.write(b"busy")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    quick = ts.Context({"http_request_retries": {"max_retries": 1, "initial_delay": "1ms",
                                                 "max_delay": "2ms"}})

    def read(port: int) -> Exception:
        kv = ts.KvStore.open({"driver": "http", "base_url": f"http://127.0.0.1:{port}/x"},
                             context=quick).result()
        with pytest.raises(Exception) as info:
            kv.read("a").result()
        return info.value

    try:
        for code in (503, 500, 429):
            Answer.code = code
            error = read(server.server_port)
            assert is_store_error(error), error
        Answer.code = 403
        assert is_store_error(read(server.server_port))
    finally:
        server.shutdown()
        server.server_close()
    refused = read(free_port())
    assert "CURL error" in str(refused) and is_store_error(refused)
    with pytest.raises(OSError) as info:
        __import__("socket").create_connection(("127.0.0.1", free_port()), timeout=5)
    assert is_store_error(info.value)  # ConnectionRefusedError
    try:
        try:
            raise TimeoutError("read timed out")
        except TimeoutError as inner:
            raise loopkit.CheckpointError("checkpoint x cannot be read") from inner
    except loopkit.CheckpointError as outer:
        assert is_store_error(outer)  # a backend's wrapper: the cause decides
    # the clients' own error classes, built as they build them from an answer
    from botocore.exceptions import ClientError, EndpointConnectionError
    from gcsfs.retry import HttpError

    def s3(code: str, http: int) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": "m"},
                            "ResponseMetadata": {"HTTPStatusCode": http}}, "GetObject")

    assert is_store_error(s3("SlowDown", 503)) and is_store_error(s3("InternalError", 500))
    assert is_store_error(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert not is_store_error(s3("NoSuchKey", 404))
    assert is_store_error(HttpError({"code": 503, "message": "backend error"}))
    assert is_store_error(HttpError({"code": 401, "message": "invalid credentials"}))
    assert not is_store_error(HttpError({"code": 400, "message": "bad request"}))
    # content: a file that is not there, a parse that failed, tensorstore's NOT_FOUND
    with pytest.raises(OSError) as info:
        open(tmp_path / "missing", "rb")
    assert not is_store_error(info.value)
    with pytest.raises(ValueError) as info:
        json.loads("{trunc")
    assert not is_store_error(info.value)
    kv = ts.KvStore.open({"driver": "file", "path": str(tmp_path / "ts/")}).result()
    kv.write("a", b"not zarr").result()
    with pytest.raises(ValueError) as info:
        ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "ts/")}},
                open=True).result()
    assert not is_store_error(info.value), info.value


def test_a_store_failing_at_a_rollback_fails_the_run_instead_of_an_older_checkpoint(
        tmp_path, monkeypatch):
    """The rollback's read is a restore too: the durable step 4 (on the failing store) is
    the newest before the bad step 5; the local tier's older step 3 is not read instead."""
    monkeypatch.setenv(RETRY_SECS_ENV, "1")
    register()

    def poisoned(start):
        return (np.full((3,), np.nan if i == 5 else float(i), np.float32)
                for i in itertools.count(start))

    class FailAfterTheSave:
        @loopkit.hookimpl
        def after_step(self, step):
            if step == 4:
                FlakyFileSystem.fails = -1  # reads only: the save of step 4 still uploads

    rolled = []

    class Rolled:
        @loopkit.hookimpl
        def on_rollback(self, record):
            rolled.append(record)

    url = f"flaky://{tmp_path}/run"
    try:
        with pytest.raises(loopkit.CheckpointError) as info:
            loopkit.train(lambda s, b: ({"w": s["w"] + b}, {"loss": jnp.sum(b)}),
                          init=lambda: {"w": jnp.zeros((3,), jnp.float32)}, data=poisoned,
                          logdir=url, max_steps=12, save_model_steps=4, save_model_secs=None,
                          local_checkpoint_dir=tmp_path / "local", save_local_steps=3,
                          save_local_secs=None, nan_guard="loss", on_guard="rollback",
                          progress=False, plugins=[FailAfterTheSave(), Rolled()])
    finally:
        FlakyFileSystem.fails = 0
    message = str(info.value)
    assert "model.ckpt-4 failed: the store kept failing" in message, message
    assert "ConnectionError: injected" in message
    assert rolled == []
    assert loopkit.latest_checkpoint(tmp_path / "local")[0] == 3  # there, and not read


# -- writing at a save ---------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["model.ckpt-", "/checkpoint"])
def test_a_save_retries_an_upload_that_fails_a_few_times(tmp_path, target, caplog):
    """The staged backend's upload of a checkpoint's objects, and the `checkpoint` file
    written on a URL: a few timeouts, and the save still commits."""
    register()
    FlakyFileSystem.write_fails, FlakyFileSystem.write_target = 2, target
    url = f"flaky://{tmp_path}/run"
    with caplog.at_level(logging.WARNING, logger="loopkit"):
        result = run(url, 6)
    assert result.step == 6 and FlakyFileSystem.failed == 2
    retries = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
    assert len(retries) == 2 and "TimeoutError: injected" in retries[0], retries
    assert loopkit.latest_checkpoint(url)[0] == 6
    assert loopkit.load_checkpoint(url)["n"] == 6


def test_a_save_whose_upload_keeps_failing_fails_the_run_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv(RETRY_SECS_ENV, "1")
    register()
    FlakyFileSystem.write_fails, FlakyFileSystem.write_target = -1, "model.ckpt-6/"
    url = f"flaky://{tmp_path}/run"
    with pytest.raises(loopkit.CheckpointError) as info:
        run(url, 8)
    message = str(info.value)
    assert re.search(r"uploading \S+/model\.ckpt-6 failed: the store kept failing for 1 s",
                     message), message
    assert "TimeoutError: injected" in message
    assert loopkit.latest_checkpoint(url)[0] == 3  # step 6 was never named


# -- several processes -------------------------------------------------------------------------

TWO = textwrap.dedent("""
    import os, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    me = int(sys.argv[2])
    jax.distributed.initialize(f"127.0.0.1:{sys.argv[3]}", 2, me, initialization_timeout=60)
    sys.path.insert(0, HERE)
    from test_store_errors import FlakyFileSystem, register, run, Seen
    fails = sys.argv[4].split(",")[me]
    register(int(fails))
    FlakyFileSystem.target = sys.argv[6]

    class Say(Seen):
        def after_step(self, step):
            print("STEP", step, flush=True)

    seen = Say()
    try:
        result = run(sys.argv[1], int(sys.argv[5]), [seen])
    except Exception as ex:
        import loopkit
        kind = "CheckpointError" if isinstance(ex, loopkit.CheckpointError) else "other"
        print("RAISED", kind, ex, flush=True)
        raise
    print("RESULT", seen.start, result.step, flush=True)
    jax.distributed.shutdown()
""")


def _two(tmp_path, url, fails, max_steps, target="model.ckpt-"):
    """Run a two-process job on `url`; each process's exit code and output."""
    script = tmp_path / "two.py"
    script.write_text(TWO.replace("HERE", repr(str(HERE))))
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", RETRY_SECS_ENV: "2"}
    ran = run_processes(lambda i: [sys.executable, str(script), url, str(i), str(port), fails,
                                   str(max_steps), target], tmp_path, env=env, timeout=200,
                        name=f"{port}-p")
    return [rc for rc, _ in ran], [t for _, t in ran]


@pytest.mark.timeout(420)
def test_a_store_failing_on_one_process_fails_every_process_and_none_falls_back(tmp_path):
    """Process 1's reads of step 6 keep failing: both raise CheckpointError (each saying
    what it knows), neither restores the older step 3 nor trains, and no collective
    hangs."""
    url = f"flaky://{tmp_path}/run"
    codes, texts = _two(tmp_path, url, "0,0", 6)
    assert codes == [0, 0], texts
    codes, texts = _two(tmp_path, url, "0,-1", 9, "model.ckpt-6/")  # step 3 reads
    assert 0 not in codes, texts
    assert re.search(r"RAISED CheckpointError \w+ checkpoint .*model\.ckpt-6 failed: the store "
                     "kept failing for 2 s", texts[1]), texts[1][-3000:]
    assert "ConnectionError: injected" in texts[1]
    assert re.search(r"RAISED CheckpointError .*model\.ckpt-6 failed on another process",
                     texts[0]), texts[0][-3000:]
    for text in texts:
        assert "STEP" not in text and "RESULT" not in text, text[-3000:]
        assert "unreadable" not in text, text[-3000:]
    register()
    assert loopkit.latest_checkpoint(url)[0] == 6
