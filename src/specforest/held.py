"""What a run holds whole, whatever its chunking: :class:`Held`, and the refusal of a run whose
whole-run arrays exceed its memory limit (:func:`check_held`), before any of them is allocated."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Held", "check_held"]


@dataclass(frozen=True)
class Held:
    """Bytes a run holds whole, whatever its chunking (a model's parameters, every trajectory's
    initial state, the samples it returns), with the options that size them.

    Attributes:
        what: what they are, for messages (``"the mixture's parameters"``).
        sizes: ``(option, value)`` pairs whose product they grow with, for messages
            (``(("components", 5), ("dim", 500))``).
        nbytes: their bytes at the run's peak.
    """

    what: str
    sizes: tuple[tuple[str, int], ...]
    nbytes: int

    def describe(self) -> str:
        """``what (option=value x ...) N GB``."""
        sizes = " x ".join(f"{name}={value}" for name, value in self.sizes)
        return f"{self.what} ({sizes}) {self.nbytes / 1e9:.3g} GB"


def check_held(held: Sequence[Held], *, limit_bytes: int, limit_source: str, fixed_bytes: int = 0) -> int:
    """Refuse a run whose whole-run arrays do not fit its limit, before any of them is allocated.

    Args:
        held: what the run holds whole (:class:`Held`).
        limit_bytes: the limit; limit_source: where it comes from (for messages).
        fixed_bytes: what the process holds already (:func:`resolve_limit`).

    Returns:
        The bytes of ``held`` together.

    Raises:
        MemoryError: if ``fixed_bytes`` and ``held`` exceed ``limit_bytes``: the message gives
            each part with the options that size it, the limit and where it comes from, and names
            the options of the largest part to lower, the largest value first.
    """
    total = sum(int(h.nbytes) for h in held)
    if int(fixed_bytes) + total <= int(limit_bytes):
        return total
    gb = 1e9
    largest = max(held, key=lambda h: h.nbytes) if held else Held("", (), 0)
    names = [name for name, _ in sorted(largest.sizes, key=lambda kv: -kv[1])]
    raise MemoryError(
        f"this run does not fit the memory limit of {limit_bytes / gb:.3g} GB ({limit_source}): what it holds "
        f"whatever its chunking needs about {total / gb:.3g} GB: {'; '.join(h.describe() for h in held)}; "
        f"and the process already holds {fixed_bytes / gb:.3g} GB. "
        + (f"Lower {' or '.join(names)}, or raise the memory limit" if names else "Raise the memory limit")
    )
