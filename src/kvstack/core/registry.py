"""``Registry[T]``: one small name → implementation table for every extension point.

mini-sglang registers each cache and backend by name in a typed table; kvstack does
the same for prefix caches, eviction policies, KV layouts, codecs, presses, offload
tiers and routing policies. Each table lives next to the protocol it serves::

    EVICTION_POLICIES: Registry[type[EvictionPolicy]] = Registry("eviction policy")

    @EVICTION_POLICIES.register("lru", help="least recently used")
    class LRUPolicy: ...

    EVICTION_POLICIES.get("lru")        # the class; an unknown name raises ConfigError
    EVICTION_POLICIES.names()           # ("lru", ...) -- CLI choices= and config checks

Invariants: names are unique within a registry and kept in registration order (the
first one registered is listed first in ``--help``); ``get`` never returns a default
for an unknown name, it raises ``ConfigError`` naming every valid choice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from kvstack.core.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Named implementations of one extension point (``kind`` names it in errors)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._help: dict[str, str] = {}

    def add(self, name: str, item: T, help: str = "") -> T:
        """Register ``item`` under ``name``; a name may be registered once."""
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = item
        self._help[name] = help
        return item

    def register(self, name: str, help: str = "") -> Callable[[T], T]:
        """Decorator form of ``add``."""

        def deco(item: T) -> T:
            return self.add(name, item, help)

        return deco

    def get(self, name: str) -> T:
        """The implementation called ``name``; ``ConfigError`` listing the choices if none."""
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise ConfigError(
                f"unknown {self.kind} {name!r}; choose one of: {', '.join(self._items)}"
            ) from None

    def check(self, name: str) -> str:
        """``name`` itself when registered, else the ``ConfigError`` of ``get``."""
        self.get(name)
        return name

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def help(self, name: str) -> str:
        return self._help[name]

    def describe(self) -> str:
        """``name = help; ...`` for ``--help`` texts (names without help are listed bare)."""
        return "; ".join(f"{n} = {h}" if h else n for n, h in self._help.items())

    def items(self) -> list[tuple[str, T]]:
        return list(self._items.items())

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, name: str) -> T:
        return self.get(name)
