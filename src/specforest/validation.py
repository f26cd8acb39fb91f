"""Argument checks at the public boundary: each error names the parameter and the accepted range.

``assert`` is never used for input checks (it vanishes under ``python -O``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real

__all__ = ["check_choice", "check_int", "check_number"]


def check_int(name: str, value: object, lo: int, hi: float = math.inf) -> int:
    """``value`` as an ``int`` in ``[lo, hi]``.

    Raises:
        TypeError: if ``value`` is not an integer (``bool`` is refused).
        ValueError: if it is out of range.
    """
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int >= {lo}, got {type(value).__name__}")
    if not lo <= value <= hi:
        rng = f">= {lo}" if hi == math.inf else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be an int {rng}, got {value}")
    return int(value)


def check_number(name: str, value: object, lo: float, hi: float = math.inf, lo_open: bool = False) -> float:
    """``value`` as a finite ``float`` in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``).

    Raises:
        TypeError: if ``value`` is not a real number (``bool`` is refused).
        ValueError: if it is not finite or out of range.
    """
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    v = float(value)
    if not (math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi):
        if hi == math.inf:
            rng = f"> {lo}" if lo_open else f">= {lo}"
        else:
            rng = f"in ({lo}, {hi}]" if lo_open else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be a finite number {rng}, got {value}")
    return v


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``.

    Raises:
        ValueError: listing the choices.
    """
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return str(value)
