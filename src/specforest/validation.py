"""Argument checks at the public boundary: each error names the parameter and the accepted range.

``assert`` is never used for input checks (it vanishes under ``python -O``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real

import torch

__all__ = ["check_choice", "check_int", "check_number", "check_states"]


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


def check_states(x: object, *, example: str = "") -> None:
    """Check that ``x`` is a finite floating-point ``(batch, *shape)`` tensor with ``batch >= 1``.

    Args:
        x: the initial states a sampler is given.
        example: a shape shown in the message, e.g. ``" (e.g. (B, C, H, W))"``.

    Raises:
        TypeError: if ``x`` is not a floating-point tensor.
        ValueError: if it has no batch dimension, no elements, or NaN or inf.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor of shape (batch, *shape), got {type(x).__name__}")
    if x.ndim < 2 or x.shape[0] < 1 or x.numel() == 0:
        raise ValueError(f"x must have shape (batch, *shape) with batch >= 1{example}, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if not torch.isfinite(x).all():
        raise ValueError("x contains NaN or inf")
