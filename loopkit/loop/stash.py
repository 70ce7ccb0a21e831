"""A typed per-session store for plugin state (pytest's `Stash`)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

__all__ = ["Stash", "StashKey"]

T = TypeVar("T")


class StashKey(Generic[T]):
    """A typed key for `Session.stash` (pytest's `StashKey[T]`): one per kind of value.

    >>> COUNT = StashKey[int]()
    >>> stash = Stash(); stash[COUNT] = 3; stash[COUNT]
    3
    """

    __slots__ = ()


class Stash:
    """Per-session plugin state, keyed by `StashKey` objects, never by strings."""

    def __init__(self) -> None:
        self._data: dict[StashKey[Any], Any] = {}

    def __setitem__(self, key: StashKey[T], value: T) -> None:
        self._data[key] = value

    def __getitem__(self, key: StashKey[T]) -> T:
        return self._data[key]

    def get(self, key: StashKey[T], default: Any = None) -> T | Any:
        return self._data.get(key, default)

    def setdefault(self, key: StashKey[T], default: T) -> T:
        return self._data.setdefault(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __delitem__(self, key: StashKey[T]) -> None:
        del self._data[key]
