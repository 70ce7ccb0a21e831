"""`Config`: the Supervisor-equivalent settings every plugin reads."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import operator
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

if TYPE_CHECKING:
    import jax

__all__ = ["Config"]

PyTree = Any


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and v == v


def _rule(ok: Callable[[Any], bool], allowed: str, optional: bool = False):
    """A field check: a value passes when `ok(value)` (or it is None and `optional`)."""

    def check(v: Any) -> str | None:
        if (v is None and optional) or ok(v):
            return None
        return allowed + (" or None" if optional else "")

    return check


def _number(what: str, op: str, bound: int, optional: bool = False, is_type=_is_num):
    """A check for `what` `op` `bound`, e.g. ``_number("a number of seconds", ">=", 0)``."""
    compare = operator.ge if op == ">=" else operator.gt
    return _rule(lambda v: is_type(v) and compare(v, bound), f"{what} {op} {bound}", optional)


def _secs(optional: bool, op: str = ">="):
    return _number("a number of seconds", op, 0, optional)


def _count(minimum: int, optional: bool):
    return _number("an int", ">=", minimum, optional, _is_int)


def _choice(*choices: str):
    allowed = " or ".join(f'"{c}"' for c in choices)
    return _rule(lambda v: isinstance(v, str) and v in choices, allowed)


def _save_secs(v: Any) -> str | None:
    if v is None or (isinstance(v, str) and v == "auto") or (_is_num(v) and v >= 0):
        return None
    return 'a number of seconds >= 0, None, or "auto" (set from the measured save cost and ' \
        'interruption rate)'


_bool = _rule(lambda v: isinstance(v, bool), "True or False")
_optional_bool = _rule(lambda v: isinstance(v, bool), "True, False", optional=True)
_optional_callable = _rule(callable, "a callable", optional=True)
_hours = _number("a number of hours", ">", 0, optional=True)
_metric_name = _rule(lambda v: isinstance(v, str) and v != "", "a metric name (str)", True)
_basename = _rule(lambda v: isinstance(v, str) and v != "" and "/" not in v and os.sep not in v,
                  "a non-empty file name without a directory separator")


def _logdir(v: Any) -> str | None:
    if v is None or (isinstance(v, (str, os.PathLike)) and str(os.fspath(v)) != ""):
        from loopkit.storage import check_url

        check_url(v, "Config.logdir")  # an unknown scheme or a missing extra fails now
        return None
    return "a non-empty path (str or os.PathLike) or None"


def _local_dir(v: Any) -> str | None:
    from loopkit.storage import is_url

    if v is None or (isinstance(v, (str, os.PathLike)) and str(os.fspath(v)) != ""
                     and not is_url(v)):
        return None
    return ("a local path (str or os.PathLike: a local SSD, /dev/shm) or None; "
            "not a URL: the durable tier is logdir")


def _backend(v: Any) -> str | None:
    if v is None or (isinstance(v, str) and v):
        return None
    needed = ("save", "restore", "steps", "delete", "wait", "close")
    if all(callable(getattr(v, m, None)) for m in needed):
        return None
    return 'a backend name such as "orbax" or "npz", a CheckpointBackend instance, or None'


def _profile_steps(v: Any) -> str | None:
    if v is None:
        return None
    if (
        isinstance(v, (tuple, list))
        and len(v) == 2
        and all(_is_int(x) and x >= 1 for x in v)
        and v[0] <= v[1]
    ):
        return None
    return "None or (first, last) global steps with 1 <= first <= last"


def _patterns(v: Any) -> str | None:
    if v is None:
        return None
    items = (v,) if isinstance(v, str) else v
    if isinstance(items, (tuple, list)) and items and all(
        isinstance(p, str) and p and p.count("[") <= p.count("]") for p in items
    ):
        return None
    return ('None (every metric) or a non-empty tuple of fnmatch patterns over metric '
            'names, e.g. ("loss", "acc*"); each a non-empty str with balanced [ ]')


def _hparams(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, Mapping):
        return "None or a dict of name (str) -> bool, int, float or str"
    for key, value in v.items():
        if not isinstance(key, str) or not key:
            return f"names that are non-empty str; got the name {key!r}"
        if not isinstance(value, (bool, int, float, str)):
            return (f"values that are bool, int, float or str; {key!r} is "
                    f"{type(value).__name__} {value!r}")
    return None


def _disable(v: Any) -> str | None:
    if isinstance(v, (tuple, list, set, frozenset)) and all(isinstance(x, str) for x in v):
        return None
    return 'a tuple of plugin names, e.g. ("progress",)'


def _sharding(v: Any) -> str | None:
    if v is None:
        return None
    import jax

    return None if isinstance(v, jax.sharding.Sharding) else "a jax.sharding.Sharding or None"


def _field(default: Any, check: Callable[[Any], str | None]) -> Any:
    """A Config field with its check beside it: `check(value)` says what is allowed,
    or returns None when `value` is fine."""
    return dataclasses.field(default=default, metadata={"check": check})


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a run can be told, with `tf.train.Supervisor`'s defaults.

    Validated on construction: a bad value raises `ValueError` naming the field,
    the value and what is allowed.

    >>> Config(logdir="runs/a", save_model_secs=30).save_model_secs
    30
    """

    logdir: str | os.PathLike[str] | None = _field(None, _logdir)
    is_chief: bool | None = _field(None, _optional_bool)
    save_model_secs: float | str | None = _field(600, _save_secs)
    save_model_steps: int | None = _field(None, _count(0, True))
    save_summaries_secs: float | None = _field(120, _secs(True))
    save_summaries_steps: int | None = _field(None, _count(0, True))
    checkpoint_basename: str = _field("model.ckpt", _basename)
    checkpoint_backend: Any = _field("orbax", _backend)
    max_to_keep: int | None = _field(5, _count(0, True))
    keep_checkpoint_every_n_hours: float | None = _field(None, _hours)
    init_fn: Callable[[PyTree], PyTree] | None = _field(None, _optional_callable)
    local_init_fn: Callable[[Any], None] | None = _field(None, _optional_callable)
    summary_fn: Callable[[PyTree], dict] | None = _field(None, _optional_callable)
    max_steps: int | None = _field(None, _count(0, True))
    recovery_wait_secs: float = _field(30, _secs(False))
    stop_grace_secs: float = _field(120, _secs(False))
    prefetch: int = _field(2, _count(0, False))
    prefetch_threads: int = _field(1, _count(1, False))
    data_transform: Callable[[Any], Any] | None = _field(None, _optional_callable)
    data_sharding: jax.sharding.Sharding | None = _field(None, _sharding)
    jit: bool = _field(True, _bool)
    donate: bool = _field(True, _bool)
    progress: bool = _field(True, _bool)
    nan_guard: str | None = _field(None, _metric_name)
    profile_steps: tuple[int, int] | None = _field(None, _profile_steps)
    profile_every_secs: float | None = _field(None, _secs(True, ">"))
    profile_min_secs: float = _field(3, _secs(False))
    profile_min_steps: int = _field(5, _count(1, False))
    disable: tuple[str, ...] = _field((), _disable)
    autoload: bool = _field(True, _bool)
    summary_metrics: tuple[str, ...] | None = _field(None, _patterns)
    summary_reduce: str = _field("last", _choice("last", "mean"))
    hparams: Mapping[str, bool | int | float | str] | None = _field(None, _hparams)
    progress_secs: float = _field(10, _secs(False, ">"))
    compilation_cache: bool = _field(True, _bool)
    hang_timeout_secs: float | None = _field(None, _secs(True, ">"))
    startup_timeout_secs: float | None = _field(None, _secs(True, ">"))
    spike_threshold: float | None = _field(None, _number("a number", ">", 1, True))
    spike_window: int = _field(100, _count(2, False))
    on_guard: str = _field("raise", _choice("raise", "rollback", "replay"))
    max_rollbacks: int = _field(3, _count(0, False))
    replica_check_steps: int | None = _field(None, _count(1, True))
    straggler_threshold: float | None = _field(None, _number("a number", ">", 1, True))
    straggler_windows: int = _field(3, _count(1, False))
    local_checkpoint_dir: str | os.PathLike[str] | None = _field(None, _local_dir)
    save_local_secs: float | str | None = _field(60, _save_secs)
    save_local_steps: int | None = _field(None, _count(0, True))
    max_to_keep_local: int | None = _field(2, _count(0, True))
    local_replicas: int = _field(0, _count(0, False))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
                # np.int64(1000) from arithmetic is the number it holds: kept as a Python
                # one (the ledger and event files write these as JSON)
                value = value.item()
                object.__setattr__(self, f.name, value)
            allowed = f.metadata["check"](value)
            if allowed is not None:
                raise ValueError(f"Config.{f.name}={value!r} is not allowed: expected {allowed}")
        if self.nan_guard is None and self.spike_threshold is not None:
            raise ValueError(f"Config.spike_threshold={self.spike_threshold!r} needs "
                             "Config.nan_guard to name the metric to watch (it is None)")
        if self.on_guard != "raise" and self.nan_guard is None and not self.replica_check_steps:
            # what the guard does needs a guard: a metric, or the replica check
            raise ValueError(f"Config.on_guard={self.on_guard!r} needs Config.nan_guard to "
                             "name the metric to watch, or Config.replica_check_steps (both "
                             "are None)")
        if self.straggler_threshold is not None and not (self.save_summaries_secs
                                                         or self.save_summaries_steps):
            raise ValueError(f"Config.straggler_threshold={self.straggler_threshold!r} "
                             "compares the processes at each summary window, and there is "
                             "none: set Config.save_summaries_secs or save_summaries_steps")
        if self.startup_timeout_secs is not None and self.hang_timeout_secs is None:
            raise ValueError(f"Config.startup_timeout_secs={self.startup_timeout_secs!r} needs "
                             "Config.hang_timeout_secs: the watchdog that watches the start-up "
                             "is off (it is None)")
        if self.local_checkpoint_dir is not None:
            self._check_local_dir()
        elif self.local_replicas:
            raise ValueError(f"Config.local_replicas={self.local_replicas!r} needs "
                             "Config.local_checkpoint_dir: peers keep copies of the local "
                             "tier, which is off (it is None)")
        object.__setattr__(self, "disable", tuple(self.disable))
        metrics = self.summary_metrics
        if metrics is not None:
            metrics = (metrics,) if isinstance(metrics, str) else tuple(metrics)
            object.__setattr__(self, "summary_metrics", metrics)

    def _check_local_dir(self) -> None:
        from loopkit.storage import normalise

        local = normalise(self.local_checkpoint_dir, "Config.local_checkpoint_dir")
        logdir = self.logdir_path
        if logdir is None:
            raise ValueError(f"Config.local_checkpoint_dir={self.local_checkpoint_dir!r} "
                             "needs Config.logdir (the durable tier) as well")
        if local == logdir:
            raise ValueError(f"Config.local_checkpoint_dir={self.local_checkpoint_dir!r} is "
                             "Config.logdir: expected a directory of its own for the local tier")

    @property
    def logdir_path(self) -> Path | str | None:
        """`logdir` as an absolute `Path`, a URL string (``s3://bucket/run``), or None."""
        from loopkit.storage import normalise

        return None if self.logdir is None else normalise(self.logdir, "Config.logdir")

    def replace(self, **changes: Any) -> Config:
        """A copy with `changes` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}


def check_field_names(names: Iterable[str]) -> None:
    """Raise `TypeError` for names that are no Config field, suggesting the closest."""
    known = Config.field_names()
    unknown = sorted(set(names) - set(known))
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hints.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    raise TypeError(
        f"unknown Config field{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; "
        f"the fields are listed in loopkit.Config (docs/migrating-from-supervisor.md)")


def _checked_init(init: Callable[..., None]) -> Callable[..., None]:
    """The dataclass's `__init__`, naming the field a misspelt keyword was meant to be
    (`Config(save_model_sec=10)` says "did you mean 'save_model_secs'?", as `train` does)."""

    @functools.wraps(init)
    def __init__(self: Config, *args: Any, **fields: Any) -> None:
        check_field_names(fields)
        init(self, *args, **fields)

    return __init__


Config.__init__ = _checked_init(Config.__init__)  # type: ignore[method-assign]
