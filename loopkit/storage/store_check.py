"""A URL logdir's store, tried once at start-up: missing credentials or an endpoint that
does not answer fail in one line naming what to set, within `PROBE_SECS`.

Left to themselves the client libraries print a 72-line botocore traceback for missing
AWS credentials, and take minutes to give up on an endpoint that never answers (gcsfs
without network: 84 s; botocore on a silent socket: 60 s a try, several tries). The
probe builds the store's filesystem and asks for one object, in a thread joined with a
bound, so neither a credential lookup nor a connection can hold start-up longer.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from loopkit import storage

__all__ = ["PROBE_SECS", "check_store", "endpoint_of"]

#: how long the store may take to answer the start-up probe
PROBE_SECS = 10.0

# the client libraries' own exception names (botocore, google-auth), matched by name
# so that none of them is imported here
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError",
                   "RefreshError", "CredentialRetrievalError"}
_UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                "ConnectionClosedError", "ClientConnectorError", "ServerTimeoutError",
                "ServerDisconnectedError", "TransportError"}

_CREDENTIALS_HELP = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE for a profile "
          "in ~/.aws), and AWS_ENDPOINT_URL for a private endpoint (MinIO, Ceph, ...)",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS to a service account's key file or run "
          "`gcloud auth application-default login` (STORAGE_EMULATOR_HOST for an emulator)",
}


def endpoint_of(url: str) -> str:
    """The endpoint `url` is reached through, and the variable that chose it."""
    scheme = _family(url)
    if scheme == "s3":
        for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
            if os.environ.get(var):
                return f"{os.environ[var]} ({var})"
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        return (f"AWS S3's public endpoint{' in ' + region if region else ''} "
                "(AWS_ENDPOINT_URL sets a private one)")
    if scheme == "gs":
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            return f"{os.environ['STORAGE_EMULATOR_HOST']} (STORAGE_EMULATOR_HOST)"
        return "https://storage.googleapis.com (STORAGE_EMULATOR_HOST sets an emulator)"
    return f"the {scheme}:// store"


def _family(url: str) -> str:
    scheme = storage.scheme_of(url) or "file"
    return {"s3a": "s3", "gcs": "gs"}.get(scheme, scheme)


def _names(ex: BaseException) -> set[str]:
    """The class names of `ex`, its bases and the exceptions it was raised from."""
    names: set[str] = set()
    seen: set[int] = set()
    while ex is not None and id(ex) not in seen:
        seen.add(id(ex))
        names.update(c.__name__ for c in type(ex).__mro__)
        ex = ex.__cause__ or ex.__context__  # type: ignore[assignment]
    return names


def check_store(url: str, interrupted: Callable[[], str | None] = lambda: None,
                bound: float = PROBE_SECS) -> None:
    """Reach the store behind `url` once, or raise in one line: `PermissionError` for
    missing credentials, `ConnectionError` for an endpoint that does not answer
    (within `bound` s). Any other answer (the object missing, even access denied to it)
    is left to the run's own reads. `interrupted()` (a signal) ends the wait early."""
    outcome: list[BaseException | None] = []

    def probe() -> None:
        try:
            fs, path = storage.filesystem(url)
            fs.exists(f"{path.rstrip('/')}/.loopkit-lease.json")
            outcome.append(None)
        except BaseException as ex:  # noqa: BLE001 - judged by the main thread
            outcome.append(ex)

    # a daemon thread: one that never returns is left behind, and the process exits
    thread = threading.Thread(target=probe, daemon=True, name="loopkit-store-check")
    thread.start()
    deadline = time.monotonic() + bound
    while thread.is_alive() and time.monotonic() < deadline:
        why = interrupted()
        if why:
            raise ConnectionError(f"stopped by {why} while reaching the logdir {url!r} "
                                  f"through {endpoint_of(url)}")
        thread.join(0.1)
    if not outcome:
        raise ConnectionError(
            f"the logdir {url!r}: {endpoint_of(url)} did not answer within {bound:.0f} s "
            "(no network, a wrong endpoint, or a store that is down)")
    ex = outcome[0]
    if ex is None:
        return
    if isinstance(ex, (ImportError, ValueError)):  # a missing extra, a bad URL: as they are
        raise ex
    names = _names(ex)
    what = f"{type(ex).__name__}: {str(ex).splitlines()[0] if str(ex) else ''}".rstrip(": ")
    if names & _NO_CREDENTIALS:
        help_ = _CREDENTIALS_HELP.get(_family(url), "set the store's credentials")
        raise PermissionError(f"the logdir {url!r} needs credentials, and none were found: "
                              f"{help_} ({what})") from None
    if names & _UNREACHABLE or {"ConnectionError", "TimeoutError", "gaierror"} & names:
        raise ConnectionError(f"the logdir {url!r}: cannot reach {endpoint_of(url)} "
                              f"({what})") from None
