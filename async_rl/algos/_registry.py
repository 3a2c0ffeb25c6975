"""A named registry shared by the estimator, loss and KL modules (style of verl/EasyR1 ``core_algos``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to entries; unknown names raise ``ValueError`` listing the valid ones."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> None:
        """Register ``entry`` under ``name``; a name can be registered once."""
        if name in self._entries:
            raise ValueError(f"{self._kind} {name!r} is already registered")
        self._entries[name] = entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of :meth:`add` that returns the decorated object unchanged."""

        def decorator(entry: T) -> T:
            self.add(name, entry)
            return entry

        return decorator

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def get(self, name: str) -> T:
        """The entry registered as ``name``."""
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self._kind} {name!r}; valid names: {', '.join(self.names())}") from None
