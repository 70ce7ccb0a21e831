"""Built-in `summaries`: the run's TensorBoard event file, written on the summary timer.

On the chief only, one tensorboardX `SummaryWriter` in `logdir` becomes
`session.summary_writer`; every built-in and `session.summary_computed` write
through it. It opens in a background thread (`OpeningWriter`: its first use waits),
so importing tensorboardX runs beside the training, from the first step's end. On the summary timer (`save_summaries_secs` / `save_summaries_steps`)
it writes the metrics that `Config.summary_metrics` chooses under their own
names (the latest step's values, or with ``summary_reduce="mean"`` their mean
since the last summary, summed on device inside the jitted step),
`summary_fn(state)`, and loopkit's own cost (`loopkit/overhead_frac`; the
checkpoint plugin writes `loopkit/checkpoint_blocking_secs` at each save through
the same writer). `Config.hparams` goes to TensorBoard's
HParams dashboard at the start. A normal stop writes the final step unless the
timer already did. After a rollback (`on_rollback`) it starts a new event file that
purges from the step after the restored one, as a restart does, and restarts the
interval mean. See docs/summaries.md.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import jax

from loopkit import storage
from loopkit.config import Config
from loopkit.loop.coordinator import add_note
from loopkit.plugin.hookspec import hookimpl
from loopkit.plugins.mirror import Mirror
from loopkit.plugins.summary_values import IntervalMean, chosen
from loopkit.loop.writer import write_values

if TYPE_CHECKING:
    from loopkit.loop.carry import StepCarry
    from loopkit.loop.session import Session

__all__ = ["FLUSH_SECS", "OpeningWriter", "SummariesPlugin", "config_markdown", "event_file_suffix",
           "plugin", "write_hparams"]

INACTIVE = "needs Config.logdir"

#: How soon (seconds) tensorboardX's writer thread flushes events it was handed.
#: The writer queues events to a thread; `flush()` only flushes what that thread
#: has already written, so this bounds what a SIGKILL loses beyond the last summary.
FLUSH_SECS = 1


def event_file_suffix() -> str:
    """A filename suffix that makes event-file names unique and sort in creation order.

    tensorboardX names files ``events.out.tfevents.<secs>.<host><suffix>``. Two
    writers started in the same second on one host differ only by the suffix,
    and TensorBoard reads (and purges) a directory's files in name order, so
    the suffix is the creation time in zero-padded nanoseconds (then the pid).
    """
    return f".{time.time_ns():020d}.{os.getpid()}"


def config_markdown(config: Config) -> str:
    """The run's Config as a Markdown table of field reprs (TensorBoard's Text tab)."""
    rows = ["| field | value |", "|---|---|"]
    for f in dataclasses.fields(config):
        text = repr(getattr(config, f.name)).replace("|", "\\|").replace("`", "'")
        rows.append(f"| {f.name} | `{text}` |")
    return "\n".join(rows)


def write_hparams(writer: Any, hparams: Mapping[str, Any], step: int) -> None:
    """Write `hparams` as the run's session in TensorBoard's HParams dashboard.

    Only the session-start record: TensorBoard then builds the experiment from
    every run's record, and the metrics columns from the runs' scalar tags, so
    runs started with different hparams compare side by side.
    """
    from tensorboardX.summary import hparams as hparams_summary

    _, session_start, _ = hparams_summary(dict(hparams), {})
    writer.file_writer.add_summary(session_start, step)


class OpeningWriter:
    """A tensorboardX `SummaryWriter` opened in a background thread, used as the writer
    itself: its first use waits until it is open, and re-raises what failed.

    Importing tensorboardX (0.3-0.8 s) then runs beside the training, not before it;
    a session's first writer opens from its first step's end (`start`), or at its
    first use if that comes earlier.
    """

    def __init__(self, open_writer: Callable[[], Any], where: str, start: bool = True) -> None:
        self._writer: Any = None
        self._error: BaseException | None = None
        self._where = where
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._open, args=(open_writer,), daemon=True,
                                        name="loopkit-summary-writer-open")
        if start:
            self.start()

    def start(self, *_: Any) -> None:
        """Start opening it (once; a timer's action takes the session)."""
        with self._lock:
            if self._thread.ident is None:
                self._thread.start()

    def _open(self, open_writer: Callable[[], Any]) -> None:
        try:
            self._writer = open_writer()
        except BaseException as ex:  # noqa: BLE001 - re-raised at the writer's first use
            add_note(ex, f"raised in loopkit's summaries plugin opening its event file in "
                         f"{self._where}")
            self._error = ex

    def opened(self) -> Any:
        """The tensorboardX writer, once it is open."""
        if self._writer is None:
            self.start()
            self._thread.join()
            if self._error is not None:
                raise self._error
        return self._writer

    def __getattr__(self, name: str) -> Any:  # everything a SummaryWriter offers
        if name.startswith("__") or name in ("_writer", "_error", "_where", "_thread", "_lock"):
            raise AttributeError(name)
        return getattr(self.opened(), name)

    def close(self) -> None:
        """Close the writer once it is open; nothing when it could not be opened (its
        first use raised that already, or the session failed before using it)."""
        self.start()  # a session that ended before its first step still leaves its file
        self._thread.join()
        if self._writer is not None:
            self._writer.close()


class SummariesPlugin:
    """Writes metrics, `summary_fn` output and loopkit's own cost to TensorBoard (chief only)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.writer: Any = None
        self.mirror: Mirror | None = None  # the events' copy under a URL logdir
        self._where = ""  # the directory of the event files (a local one under a URL)
        self._written_step: int | None = None
        self._last_time = 0.0
        self._last_busy = 0.0
        self.mean = IntervalMean(config.summary_metrics) if config.summary_reduce == "mean" else None

    @hookimpl
    def import_ahead(self, session: Session) -> list[str]:
        return ["tensorboardX"] if session.is_chief else []  # only the chief writes

    @hookimpl
    def step_carry(self) -> StepCarry | None:
        # on every process, so that every process compiles the same step
        return None if self.mean is None else self.mean.carry

    @hookimpl(tryfirst=True)  # built-in services start before other plugins'
    def session_create(self, session: Session) -> None:
        if not session.is_chief:
            return  # every process runs the same program; only the chief writes
        cfg = self.config
        restored = session.restored
        # Every session starts with a SessionLog.START event (as the Supervisor's
        # did): TensorBoard drops what earlier files hold at or past its step. A
        # resumed run puts it just past the recovered step, hiding what a crashed
        # run wrote after its checkpoint; a fresh run puts it at its start step.
        # The server ignores a run's first START, so a fresh run must write one
        # too, or the first restart would purge nothing. Purging reaches earlier
        # files only: hence file names that sort in creation order.
        purge_step = session.step if restored is None else int(restored.step) + 1
        where = session.logdir
        if storage.is_url(where):
            # tensorboardX would re-upload the whole file on every flush: write it
            # locally and mirror it on the summary timer, off the main thread.
            where = tempfile.mkdtemp(prefix="loopkit-events-")
            self.mirror = Mirror(Path(where), str(session.logdir))
        self._where = str(where)

        def first_events(writer: Any) -> None:
            # At the purge step on a resume (one config per session even when several
            # sessions resume at the same step, e.g. at max_steps: each purges the last).
            writer.add_text("loopkit/config", config_markdown(cfg), purge_step)
            if cfg.hparams:
                write_hparams(writer, cfg.hparams, purge_step)
            writer.flush()

        # opened from the first step's end: its import does not share the cores of
        # `init` and the first compile
        self.writer = self._open(purge_step, first_events, start=False)
        session.at_step(session.step + 1, self.writer.start, name="summary writer")
        session.summary_writer = self.writer
        self._written_step = session.step  # nothing to write before a step runs
        self._last_time = session.clock()
        self._last_busy = session.stats.overhead_secs()
        secs, steps = cfg.save_summaries_secs, cfg.save_summaries_steps
        if secs or steps:
            session.every(self._write, secs=secs, steps=steps, name="summaries")

    def _open(self, purge_step: int, then: Callable[[Any], None] | None = None,
              start: bool = True) -> OpeningWriter:
        """A new event file whose first events hide what earlier files hold from
        `purge_step` on (its name sorts after theirs: `event_file_suffix`), opened in the
        background; `then(writer)` writes its first events there."""

        def open_writer() -> Any:
            from tensorboardX import SummaryWriter

            writer = SummaryWriter(self._where, purge_step=purge_step, flush_secs=FLUSH_SECS,
                                   max_queue=1024, filename_suffix=event_file_suffix())
            if then is not None:
                then(writer)
            return writer

        return OpeningWriter(open_writer, self._where, start)

    @hookimpl(tryfirst=True)  # the fresh file first: other plugins' on_rollback may write
    def on_rollback(self, session: Session, record: Any) -> None:
        """As after a restart from the restored step: the events of the abandoned steps
        hidden (a new file purging from the step after it), the interval mean restarted."""
        if self.mean is not None:
            self.mean.restart()  # its sums hold abandoned steps, the bad one among them
        old = self.writer
        if old is None:
            return
        self.writer = self._open(record.restored_step + 1)
        if session.summary_writer is old:  # unless a plugin set a writer of its own
            session.summary_writer = self.writer
        old.close()
        self._written_step = record.restored_step  # written before, never twice

    def _write(self, session: Session) -> None:
        writer, step, stats = self.writer, session.step, session.stats
        if step == self._written_step:  # a time trigger at the step a rollback went to
            return
        # Windows run from the start of one write to the start of the next: the
        # time of the timer actions at a boundary lands in `stats` once they all
        # returned, so it belongs to the window that starts at that boundary.
        now, busy = session.clock(), stats.overhead_secs()
        values = self._metrics(session)
        fn = self.config.summary_fn
        if fn is not None:
            extra = fn(session.state)
            if not isinstance(extra, Mapping):
                raise TypeError(
                    f"Config.summary_fn={fn!r} returned {type(extra).__name__}: it must "
                    "return a dict of tag -> value (scalar, array or str)"
                )
            # Fetch now, explicitly: the next step may donate the state these came from.
            values.update(jax.device_get(dict(extra)))
        write_values(writer, values, step)

        if now > self._last_time:
            frac = (busy - self._last_busy) / (now - self._last_time)
            writer.add_scalar("loopkit/overhead_frac", frac, step)
        self._last_time, self._last_busy = now, busy
        writer.flush()
        if self.mirror is not None:
            self.mirror.sync()
        self._written_step = step

    def _metrics(self, session: Session) -> dict[str, Any]:
        patterns, mean = self.config.summary_metrics, self.mean
        if mean is None:
            # the one cached conversion of this step, shared with progress and nan_guard
            return chosen(session.host_metrics(), patterns)
        values = mean.take()
        names = chosen(session.metrics or {}, patterns)
        if any(k not in values for k in names):  # not averaged (e.g. not a number)
            host = session.host_metrics()
            values.update({k: host[k] for k in names if k not in values})
        return values

    @hookimpl
    def on_stop(self, session: Session, error: BaseException | None) -> None:
        writer = self.writer
        if writer is None:
            return
        try:
            # A normal stop owes the final step, unless the timer just wrote it
            # (at most one summary of a tag per step).
            if error is None and session.step != self._written_step:
                self._write(session)
        finally:
            writer.close()  # drains tensorboardX's queue and flushes
            mirror, self.mirror = self.mirror, None
            if mirror is not None:
                try:
                    mirror.close()
                finally:
                    shutil.rmtree(mirror.local, ignore_errors=True)


def plugin(config: Config) -> SummariesPlugin | None:
    return SummariesPlugin(config) if config.logdir is not None else None
