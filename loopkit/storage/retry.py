"""An error of the store, told apart from wrong content, and retried with backoff.

Reading or writing a checkpoint meets two kinds of failure. An error of the store
(an `OSError` other than a missing file, a timeout, a refused connection, a 5xx or
throttling answer from botocore, gcsfs or tensorstore) says nothing about the
checkpoint: it is retried with backoff for up to `retry_secs()` (a minute; the
environment variable `RETRY_SECS_ENV` overrides it) and then raised as `StoreFailure`,
a `CheckpointError` chained to the store's error. Content that is wrong (a missing or
truncated file, a failed parse) is not retried: the caller passes the checkpoint over
as corrupt. See docs/reliability.md.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from typing import Callable, TypeVar

from loopkit.errors import CheckpointError

__all__ = ["RETRY_SECS_ENV", "StoreFailure", "is_store_error", "retry_secs", "retrying"]

log = logging.getLogger("loopkit")

T = TypeVar("T")

#: the environment variable that bounds the retries of a store operation, in seconds
RETRY_SECS_ENV = "LOOPKIT_STORE_RETRY_SECS"
DEFAULT_RETRY_SECS = 60.0
#: the first wait between tries; each further wait doubles, up to `MAX_DELAY_SECS`
FIRST_DELAY_SECS = 0.25
MAX_DELAY_SECS = 10.0


class StoreFailure(CheckpointError):
    """The store kept failing for the whole retry bound (its error is the cause)."""


# tensorstore raises ValueError("<STATUS>: ..."): these statuses are the store's (a
# local file's OS error reads "[OS error: ...]"; its missing file is NOT_FOUND, content)
_TS_STORE = re.compile(r"\b(UNAVAILABLE|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED|ABORTED|"
                       r"PERMISSION_DENIED|UNAUTHENTICATED):")
_HTTP_STORE = re.compile(r"HTTP code (5\d\d|429)\b|CURL error|\[OS error: ")
_TS_NOT_FOUND = re.compile(r"\bNOT_FOUND:")
# clients' errors for an unreachable or overloaded store that are not OSError subclasses
# (aiohttp's, botocore's, urllib3's, requests'), matched by name: none of them need be
# installed, and importing one to test for it would cost every process the import
_NAMES = {"ClientConnectionError", "ServerDisconnectedError", "ServerTimeoutError",
          "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
          "ConnectionClosedError", "HTTPClientError", "ProtocolError", "ChunkedEncodingError",
          "ServiceUnavailable", "TooManyRequests", "InternalServerError", "GatewayTimeout",
          "TransportError", "RetryError", "RefreshError", "DefaultCredentialsError",
          "NoCredentialsError", "PartialCredentialsError"}
_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
          "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable", "503", "500",
          "RequestLimitExceeded", "TooManyRequests"}


def is_store_error(ex: BaseException) -> bool:
    """Whether `ex`, or an error it was raised from, is the store's rather than the content's."""
    seen: set[int] = set()
    while ex is not None and id(ex) not in seen:
        seen.add(id(ex))
        if _one_is_store_error(ex):
            return True
        ex = ex.__cause__ or ex.__context__
    return False


def _one_is_store_error(ex: BaseException) -> bool:
    if isinstance(ex, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return False  # a file that is not there, or not what it should be: content
    if isinstance(ex, (TimeoutError, ConnectionError)):
        return True
    if isinstance(ex, OSError):
        # a parser's OSError (gzip's BadGzipFile, a seek past a truncated file's end:
        # EINVAL) is about content; every other one is the disk's or the network's
        return type(ex).__name__ != "BadGzipFile" and ex.errno != 22
    if any(t.__name__ in _NAMES for t in type(ex).__mro__):
        return True
    status = getattr(ex, "code", None) or getattr(ex, "status", None)
    if _store_status(status):
        return True  # gcsfs's HttpError, aiohttp's and google.api_core's errors
    response = getattr(ex, "response", None)  # botocore's ClientError
    if isinstance(response, dict):
        error = response.get("Error") or {}
        http = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return str(error.get("Code")) in _CODES or _store_status(http)
    if isinstance(ex, ValueError):  # tensorstore's
        text = str(ex)
        if _TS_NOT_FOUND.search(text):
            return False
        return bool(_TS_STORE.search(text) or _HTTP_STORE.search(text))
    return False


def _store_status(status: object) -> bool:
    """Whether an HTTP status is the store's answer (a server error, throttling, a
    timeout, refused credentials) rather than one about the object (404: missing)."""
    return isinstance(status, int) and (status >= 500 or status in (401, 403, 408, 429))


def retry_secs() -> float:
    """How long a store operation is retried: `RETRY_SECS_ENV`, else a minute."""
    text = os.environ.get(RETRY_SECS_ENV)
    if text is None or text == "":
        return DEFAULT_RETRY_SECS
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{RETRY_SECS_ENV}={text!r} is not allowed: expected a number of "
                         "seconds >= 0 (how long a storage error is retried; default 60)")
    return value


def retrying(operation: Callable[[], T], what: str, advice: str = "") -> T:
    """`operation()`, tried again with backoff while it fails with an error of the store.

    After `retry_secs()` the last such error is raised as `StoreFailure` naming `what`
    (``"reading checkpoint /runs/a/model.ckpt-40"``), with `advice` after it, and chained
    to it. Any other error is raised at once, unchanged: wrong content is not retried.
    """
    bound = retry_secs()
    deadline = time.monotonic() + bound
    delay, tries = FIRST_DELAY_SECS, 0
    while True:
        tries += 1
        try:
            return operation()
        except Exception as ex:  # noqa: BLE001 - sorted below: the store's or not
            if not is_store_error(ex):
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreFailure(
                    f"{what} failed: the store kept failing for {bound:g} s ({tries} "
                    f"tries; {RETRY_SECS_ENV} sets how long): {type(ex).__name__}: {ex}"
                    + (f". {advice}" if advice else "")) from ex
            wait = min(delay, left)
            log.warning("loopkit: %s: %s: %s; trying again in %.2g s (for up to %g s)",
                        what, type(ex).__name__, ex, wait, bound)
            time.sleep(wait)
            delay = min(2 * delay, MAX_DELAY_SECS)
