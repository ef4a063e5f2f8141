"""One registry helper for every pluggable part (policies, backends, formats, generators).

Registering a name twice is a programming error; asking for an unknown name is a user
error that lists what exists, so a typo in a hypothesis file reads as a clear message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from btb_lab.errors import UserError

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection of implementations of one kind (e.g. "policy")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, *, aliases: tuple[str, ...] = ()) -> Callable[[T], T]:
        """Decorator: `@POLICIES.register("least_load")`."""

        def deco(obj: T) -> T:
            self.add(name, obj, aliases=aliases)
            return obj

        return deco

    def add(self, name: str, obj: T, *, aliases: tuple[str, ...] = ()) -> None:
        for key in (name, *aliases):
            if key in self._items or key in self._aliases:
                raise ValueError(f"{self.kind} {key!r} is registered twice")
        self._items[name] = obj
        for alias in aliases:
            self._aliases[alias] = name

    def canonical(self, name: str) -> str:
        """The registered name for `name` or one of its aliases."""
        if name in self._items:
            return name
        if name in self._aliases:
            return self._aliases[name]
        raise UserError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}")

    def get(self, name: str) -> T:
        return self._items[self.canonical(name)]

    def names(self) -> list[str]:
        """Registered names and aliases, sorted."""
        return sorted([*self._items, *self._aliases])

    def __contains__(self, name: object) -> bool:
        return name in self._items or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
