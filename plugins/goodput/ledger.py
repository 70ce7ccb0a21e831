"""The chief's writer of ``logdir/goodput.jsonl``, and the figures other plugins hand it.

`Ledger` is what a plugin uses to add a line: the goodput plugin puts the
session's one in the stash under `LEDGER`, so the watchdog (a hang) or a
rollback writes ``session.stash.get(LEDGER)`` ``.write(Rollback(...))`` with no
other coupling. The checkpoint plugin reports its saves under `loopkit.plugins.shared.SAVE_TIMES`.

On a local logdir each record is appended in place (one write, flush, fsync).
Under a URL an object cannot be appended to: the ledger is kept in a local
copy (started from the object's contents) and mirrored after each record,
off the caller's thread, as the event files are (`loopkit.plugins.mirror.Mirror`).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from loopkit import storage
from loopkit.plugins.mirror import Mirror
from loopkit.loop.stash import StashKey
from loopkit.plugins.goodput.records import (
    LEDGER_NAME, Record, Start, append_line, records_in,
)

if TYPE_CHECKING:
    from loopkit.plugins.goodput.report import GoodputReport

__all__ = ["LEDGER", "Ledger"]


class Ledger:
    """Appends records to one logdir's ledger and keeps the ones it holds in memory."""

    def __init__(self, logdir: Path | str) -> None:
        self.logdir = logdir
        self._lock = threading.Lock()
        self.mirror: Mirror | None = None
        if storage.is_url(logdir):
            local = Path(tempfile.mkdtemp(prefix="loopkit-ledger-"))
            try:
                data = storage.read_bytes(storage.join(logdir, LEDGER_NAME))
            except FileNotFoundError:
                data = b""
            (local / LEDGER_NAME).write_bytes(data)
            self.path = local / LEDGER_NAME
            self.mirror = Mirror(local, str(logdir))
        else:
            storage.makedirs(logdir)
            self.path = Path(logdir) / LEDGER_NAME
            data = self.path.read_bytes() if self.path.exists() else b""
        #: every whole record of the ledger: the earlier sessions' and this one's (a
        #: malformed line is skipped with a warning: the ledger never stops a run)
        self.records: list[Record] = list(records_in(
            data.decode("utf-8", errors="replace"), str(storage.join(logdir, LEDGER_NAME))))
        self._check_end = True  # the first append ends a torn last line
        #: the running session's start, until its record is written
        self.pending: Start | None = None

    def report(self, extra: list[Record] | None = None) -> GoodputReport:
        """The report of the records so far, the running session's start included, and
        `extra` records not written (the running session's window so far)."""
        from loopkit.plugins.goodput.report import summarise

        with self._lock:
            records = self.records + ([self.pending] if self.pending is not None else [])
        return summarise(records + (extra or []), running=True)  # the last is this one

    def write(self, record: Record, wait: bool = False) -> None:
        """Append `record` (any thread). `wait`: under a URL, return once it is uploaded."""
        with self._lock:
            append_line(self.path, record.to_line(), check_end=self._check_end)
            self._check_end = False
            self.records.append(record)
            if self.mirror is not None:
                if wait:
                    self.mirror.close()
                    self.mirror = Mirror(self.path.parent, str(self.logdir))
                else:
                    self.mirror.sync()

    def close(self) -> None:
        with self._lock:
            mirror, self.mirror = self.mirror, None
        if mirror is not None:
            try:
                mirror.close()
            finally:
                shutil.rmtree(mirror.local, ignore_errors=True)


#: the session's `Ledger` (chief only, while the goodput plugin runs)
LEDGER: StashKey[Ledger] = StashKey()
