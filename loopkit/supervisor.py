"""`Supervisor`: tf.train.Supervisor's names over `Session`, for people who write their loop."""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Iterable, Mapping

import jax

from loopkit.config import Config, check_field_names
from loopkit.loop.coordinator import Coordinator, LooperThread
from loopkit.loop.data import is_callable_source
from loopkit.plugin.manager import make_plugin_manager
from loopkit.loop.session import Session

__all__ = ["Supervisor", "make_config"]


def make_config(config: Config | None, fields: Mapping[str, Any]) -> Config:
    """`config` with `fields` applied; unknown field names are a `TypeError`."""
    check_field_names(fields)
    if config is None:
        return Config(**fields)
    if not isinstance(config, Config):
        raise TypeError(f"config={config!r} must be a loopkit.Config or None")
    return config.replace(**fields) if fields else config


class Supervisor:
    """Checkpoints, summaries, recovery and clean stopping around a loop you write.

    >>> import jax.numpy as jnp
    >>> sv = Supervisor(save_model_secs=0, save_summaries_secs=0, progress=False)
    >>> with sv.managed_session(lambda s: (s + 1, {}), init=jnp.zeros(())) as sess:
    ...     for _ in range(3):
    ...         _ = sess.run()
    >>> int(sess.state), sess.step
    (3, 3)
    """

    def __init__(self, config: Config | None = None, *, plugins: Iterable[Any] = (),
                 clock: Callable[[], float] | None = None, **fields: Any) -> None:
        self.config = make_config(config, fields)
        self._plugins = list(plugins)
        self._clock = clock
        self._coord = Coordinator()
        self._session: Session | None = None
        self._active = False

    # -- properties of the Supervisor --------------------------------------------------

    @property
    def coord(self) -> Coordinator:
        """The Coordinator of the current (or last) session."""
        return self._coord

    @property
    def is_chief(self) -> bool:
        chief = self.config.is_chief
        return chief if chief is not None else jax.process_index() == 0

    @property
    def save_path(self) -> str | None:
        """``logdir/<checkpoint_basename>``: the prefix of checkpoint names."""
        logdir = self.config.logdir_path
        return None if logdir is None else os.path.join(logdir, self.config.checkpoint_basename)

    @property
    def summary_writer(self) -> Any:
        return self._session.summary_writer if self._session is not None else None

    @property
    def save_model_secs(self) -> float | None:
        return self.config.save_model_secs

    @property
    def save_summaries_secs(self) -> float | None:
        return self.config.save_summaries_secs

    @property
    def session(self) -> Session | None:
        """The current (or last) `Session`."""
        return self._session

    # -- the Coordinator's methods -----------------------------------------------------

    def should_stop(self) -> bool:
        return self._coord.should_stop()

    def request_stop(self, ex: BaseException | None = None) -> None:
        self._coord.request_stop(ex)

    def stop(self, threads: Any = None, close_summary_writer: bool = True) -> None:
        """Request a stop. The session's services finish when its `with` block exits."""
        self._coord.request_stop()

    def stop_on_exception(self):
        """Context manager: an exception in the block is recorded and stops the session."""
        return self._coord.stop_on_exception()

    def wait_for_stop(self, timeout: float | None = None) -> bool:
        return self._coord.wait_for_stop(timeout)

    def loop(self, interval_secs: float | None, target: Callable[..., Any],
             args: tuple | None = None, kwargs: dict | None = None) -> LooperThread:
        """Start a thread calling `target` every `interval_secs` until the stop."""
        thread = LooperThread(self._coord, interval_secs, target, args or (), kwargs)
        self._coord.register_thread(thread)
        thread.start()
        return thread

    def summary_computed(self, values: Mapping[str, Any], step: int | None = None) -> None:
        """Write user-computed summaries (tag -> value) to the session's event file."""
        if self._session is not None:
            self._session.summary_computed(values, step)
        elif self.is_chief:
            raise RuntimeError(
                "summary_computed needs a summary writer: call it inside managed_session "
                "with Config.logdir set"
            )

    # -- the session -------------------------------------------------------------------

    def managed_session(self, step_fn: Callable[..., Any], init: Any, *,
                        data: Any = None) -> _ManagedSession:
        """A context manager that starts a session and yields its `Session`.

        Start-up follows `prepare_or_wait_for_session`: recover from the latest
        checkpoint, else `init` then `init_fn`; then `local_init_fn`; then the
        ready check. Leaving the block stops the session: a final checkpoint on a
        normal exit, none after an error, which is re-raised.

        `data` is how `train` hands over its input (`session.input`, read through
        the `input_reader` hook's reader, e.g. the prefetch plugin's threads,
        and whose position checkpoints record). In
        your own loop, leave it None and pass each batch to `sess.run(batch)`;
        with `data` set, read batches from `session.input.iterator`, or the
        saved input position will not match what the steps consumed.
        """
        _check_data_takes_start_step(data)
        return _ManagedSession(self, step_fn, init, data)


def _check_data_takes_start_step(data: Any) -> None:
    """Refuse a callable `data` that cannot be called as `data(start_step)`, saying so:
    a generator function of no argument (`def data(): yield ...`) is the usual one,
    and calling it gave a bare "takes 0 positional arguments but 1 was given"."""
    if not is_callable_source(data):
        return
    try:
        inspect.signature(data).bind(0)
    except ValueError:  # no signature to read (a builtin): the call will tell
        return
    except TypeError:
        name = getattr(data, "__name__", type(data).__name__)
        raise TypeError(
            f"data={name} is called as data(start_step) (the step to resume from), but "
            f"its signature {inspect.signature(data)} takes no such argument: give it a "
            f"start_step parameter, or pass data={name}() (an iterable; then a resume "
            "does not restore its position)") from None


class _ManagedSession:
    """The `with` block of `managed_session`: opens a `Session`, closes it on exit.

    A class, not a generator: a generator turns a `StopIteration` raised in the
    start-up or in an `on_stop` into "RuntimeError: generator raised StopIteration"
    (PEP 479), and the user's error must come out as it was raised.
    """

    def __init__(self, sv: Supervisor, step_fn: Callable[..., Any], init: Any, data: Any) -> None:
        self.sv, self.step_fn, self.init, self.data = sv, step_fn, init, data

    def __enter__(self) -> Session:
        sv = self.sv
        if sv._active:
            raise RuntimeError("this Supervisor already runs a session: leave its `with` "
                               "block first (or use another Supervisor)")
        if sv._coord.stopped:  # a used coordinator; a fresh one keeps threads from loop()
            sv._coord = Coordinator()
        sv._active = True
        try:
            pm = make_plugin_manager(sv.config, sv._plugins)
            session = Session(sv.config, pm, self.step_fn, sv._coord, sv._clock)
            sv._session = session
            session.open(self.init, self.data)
        except BaseException:
            sv._active = False
            raise
        return session

    def __exit__(self, exc_type, exc, tb) -> bool:
        # A StopIteration from the user's code is exhausted input: a normal stop,
        # as OutOfRangeError was (the session records it as "data_exhausted").
        try:
            self.sv._session.close(exc)
        finally:
            self.sv._active = False
        return True  # close() raised whatever must be raised
