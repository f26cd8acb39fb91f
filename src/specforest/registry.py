"""Name registries of plug-ins (couplings, drafts) that user code can extend."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Names that resolve to zero-argument factories of one kind of plug-in.

    Args:
        kind: what the entries are, for error messages (``"coupling"``).
        entries: the built-in ``{name: factory}``.
        case_insensitive: names are matched in lower case.
    """

    def __init__(self, kind: str, entries: dict[str, Callable[[], T]], *, case_insensitive: bool = False) -> None:
        self.kind, self.case_insensitive = kind, case_insensitive
        self._entries = {self._key(k): v for k, v in entries.items()}

    def _key(self, name: str) -> str:
        return name.lower() if self.case_insensitive else name

    def register(self, name: str, factory: Callable[[], T], *, replace: bool = False) -> None:
        """Make ``name`` resolve to ``factory()``.

        Raises:
            ValueError: if ``name`` is not a non-empty str, or is taken and ``replace`` is False.
            TypeError: if ``factory`` is not callable.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        if not callable(factory):
            raise TypeError(f"factory must be callable, got {type(factory).__name__}")
        if self._key(name) in self._entries and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered; pass replace=True to override it")
        self._entries[self._key(name)] = factory

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a plug-in a test or a session registered for a while).

        Raises:
            ValueError: if ``name`` is not registered.
        """
        if name not in self:
            raise ValueError(f"{self.kind} {name!r} is not registered; registered: {self.names()}")
        del self._entries[self._key(name)]

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._key(name) in self._entries

    def make(self, name: str) -> T:
        """A fresh instance from the factory registered for ``name`` (which must be registered)."""
        return self._entries[self._key(name)]()
