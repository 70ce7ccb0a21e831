"""A local directory's files kept copied under a URL, off the caller's thread.

The summaries plugin writes its event files locally and mirrors them to a URL
logdir (tensorboardX would re-upload the whole event file on every flush to
``s3://``); other plugins that append small local files (reports, ledgers) can do
the same.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from loopkit.storage import filesystem

__all__ = ["Mirror"]


class Mirror:
    """Keeps copies of a local directory's files under a URL, uploaded off the caller's thread.

    `sync()` asks for an upload of every file that changed since the last one and
    returns at once; `close()` uploads what is left and waits. An error in the
    background is re-raised by the next `sync` or by `close`.
    """

    def __init__(self, local: Path, url: str) -> None:
        self.local, self.url = Path(local), url
        self._sent: dict[str, tuple[int, int]] = {}
        self._wanted = threading.Event()
        self._closing = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="loopkit-mirror", daemon=True)
        self._thread.start()

    def sync(self) -> None:
        self._raise()
        self._wanted.set()

    def close(self) -> None:
        self._closing = True
        self._wanted.set()
        self._thread.join()
        self._upload()  # whatever arrived after the thread's last pass
        self._raise()

    def _raise(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise OSError(f"copying {self.local} to {self.url} failed: {error}") from error

    def _run(self) -> None:
        while not self._closing:
            self._wanted.wait()
            self._wanted.clear()
            try:
                self._upload()
            except Exception as e:  # noqa: BLE001 - handed to the caller's thread
                self._error = e

    def _upload(self) -> None:
        fs, base = filesystem(self.url)
        for name in sorted(os.listdir(self.local)):
            src = self.local / name
            st = src.stat()
            if not src.is_file() or self._sent.get(name) == (st.st_size, st.st_mtime_ns):
                continue
            fs.put_file(str(src), f"{base}/{name}")
            self._sent[name] = (st.st_size, st.st_mtime_ns)
