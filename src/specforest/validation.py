"""Argument checks at the public boundary: each error names the parameter and the accepted range.

Every check refuses ``bool`` where a number is meant (``True`` is an ``int`` to Python, never a
count or a level to a user) and raises ``TypeError`` for a value of the wrong kind, ``ValueError``
for one out of range. ``assert`` is never used for input checks (it vanishes under ``python -O``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real
from typing import Optional

import torch

__all__ = [
    "check_choice",
    "check_churn",
    "check_int",
    "check_ints",
    "check_number",
    "check_optional_int",
    "check_states",
    "is_int",
]


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer (Python's, NumPy's, ...) and not a ``bool``."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _int_range(lo: int, hi: float) -> str:
    return f">= {lo}" if hi == math.inf else f"in [{lo}, {hi}]"


def _int(name: str, value: object, lo: int, hi: float, kind: str) -> int:
    rng = _int_range(lo, hi)
    if not is_int(value):
        raise TypeError(f"{name} must be {kind} {rng}, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be {kind} {rng}, got {value}")
    return int(value)


def check_int(name: str, value: object, lo: int, hi: float = math.inf) -> int:
    """``value`` as an ``int`` in ``[lo, hi]``.

    Raises:
        TypeError: if ``value`` is not an integer (``bool`` is refused).
        ValueError: if it is out of range.
    """
    return _int(name, value, lo, hi, "an int")


def check_optional_int(name: str, value: object, lo: int, hi: float = math.inf) -> Optional[int]:
    """``None``, or ``value`` as an ``int`` in ``[lo, hi]``.

    Raises:
        TypeError: if ``value`` is neither ``None`` nor an integer (``bool`` is refused).
        ValueError: if it is out of range.
    """
    return None if value is None else _int(name, value, lo, hi, "None or an int")


def check_ints(
    name: str, values: object, lo: Optional[int] = None, hi: float = math.inf, *, nonempty: bool = False
) -> list[int]:
    """``values`` (a sequence of integers or a 1-D integer tensor) as a list of Python ints.

    Args:
        name: the parameter, named in errors (an element as ``name[i]``).
        values: the integers.
        lo, hi: the range of every element, ``[lo, hi]``; with ``lo=None`` only their type is checked
            (for a caller whose range depends on the element's place, e.g. a parent list).
        nonempty: refuse an empty sequence.

    Raises:
        TypeError: if ``values`` is not such a sequence, or holds a non-integer (``2.5`` is not truncated).
        ValueError: if an element is out of range, or ``values`` is empty with ``nonempty``.
    """
    if isinstance(values, torch.Tensor):
        if values.ndim != 1 or values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise TypeError(
                f"{name} must be a sequence of ints or a 1-D integer tensor, "
                f"got {values.dtype} tensor of shape {tuple(values.shape)}"
            )
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    if nonempty and not values:
        rng = "" if lo is None else f" {_int_range(lo, hi)}"
        raise ValueError(f"{name} must hold at least one int{rng}, got none")
    if lo is None:
        for i, v in enumerate(values):
            if not is_int(v):
                raise TypeError(f"{name}[{i}] must be an int, got {v!r}")
        return [int(v) for v in values]
    return [check_int(f"{name}[{i}]", v, lo, hi) for i, v in enumerate(values)]


def check_number(name: str, value: object, lo: float, hi: float = math.inf, lo_open: bool = False) -> float:
    """``value`` as a finite ``float`` in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``).

    Raises:
        TypeError: if ``value`` is not a real number (``bool`` is refused).
        ValueError: if it is not finite (NaN included) or out of range.
    """
    if hi == math.inf:
        rng = f"> {lo}" if lo_open else f">= {lo}"
    else:
        rng = f"in ({lo}, {hi}]" if lo_open else f"in [{lo}, {hi}]"
    if not _is_real(value):
        raise TypeError(f"{name} must be a finite number {rng}, got {type(value).__name__}")
    v = float(value)
    if not (math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi):
        raise ValueError(f"{name} must be a finite number {rng}, got {value}")
    return v


def check_churn(churn: object) -> float:
    """``churn`` as a ``float`` in ``(0, 1]``, the sampler's noise level ``eps`` (paper eq. 2).

    Raises:
        TypeError: if ``churn`` is not a real number (``bool`` is refused).
        ValueError: if it is outside ``(0, 1]`` (NaN and inf included), saying why that value is refused.
    """
    if not _is_real(churn):
        raise TypeError(f"churn must be a float in (0, 1], got {type(churn).__name__}")
    eps = float(churn)
    if 0.0 < eps <= 1.0:
        return eps
    if not math.isfinite(eps):
        why = "it scales every step's noise (eq. 37), so it must be a finite number"
    elif eps == 0.0:
        why = (
            "with churn 0 the transitions are point masses, draft and target never coincide and "
            "speculation accepts nothing (ERRATA 8)"
        )
    elif eps < 0.0:
        why = "it is a noise level, and one below 0 is none; 0 itself makes speculation accept nothing (ERRATA 8)"
    else:
        why = (
            "churn 1 is already the standard reverse-time SDE, the noisiest of the paper's family (eq. 2, "
            "eps in [0, 1]); more noise only widens the gap between draft and target"
        )
    raise ValueError(f"churn must be in (0, 1], got {churn}: {why}")


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
        example: a shape shown in the message, e.g. ``" (e.g. (batch, C, H, W))"``.

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


# -- the checks the sampler and generate share ---------------------------------------------------

__all__ += ["SEED_RANGE", "check_indices", "check_seed", "refuse_non_finite", "working_dtype"]


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the sampler's arithmetic for states of ``dtype``: float64 or float32 as given,
    float32 for anything else (half precision: the coupling's arithmetic needs more)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def refuse_non_finite(bad: bool) -> None:
    """Refuse to return samples with NaN or inf (``bad``: a host bool the caller read).

    Raises:
        FloatingPointError: if ``bad``.
    """
    if bad:
        raise FloatingPointError("sampling produced NaN or inf; refusing to return it")


SEED_RANGE = "[0, 2**64)"
"""The seeds a run takes: the run's key is the seed's 64 bits, so no two seeds in it give one run."""


def check_seed(seed: object, name: str = "seed") -> int:
    """``seed`` as an ``int`` in ``[0, 2**64)`` (``bool`` is refused).

    A seed outside the range would be taken modulo ``2**64``, silently the run of another seed
    (``-1`` that of ``2**64 - 1``): it is refused, as the command line refuses a negative ``--seed``.

    Raises:
        TypeError: if it is not an int.
        ValueError: if it is outside ``[0, 2**64)``.
    """
    if isinstance(seed, bool) or not isinstance(seed, Integral):
        raise TypeError(f"{name} must be an int in {SEED_RANGE}, got {type(seed).__name__}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"{name} must be an int in {SEED_RANGE}, got {seed}: it would be taken modulo 2**64")
    return int(seed)


def check_indices(
    name: str,
    value: object,
    *,
    length: "int | None" = None,
    unique: bool = False,
    device: "torch.device | None" = None,
    per: str = "",
) -> torch.Tensor:
    """``value`` as a ``(n,)`` long tensor of sample indices, integers in ``[0, 2**63)``.

    Args:
        name: the parameter, for the messages.
        value: a sequence or tensor of integers (an empty sequence is ``(0,)``).
        length: the ``n`` it must have (``None``: any).
        unique: refuse repeated indices (each index is one sample).
        device: where the tensor is made (``None``: the CPU, or ``value``'s device).
        per: what one index stands for, for the messages (``" (one per row of x)"``).

    Raises:
        ValueError: naming ``name``, if it is not 1-D, not integers, negative or repeats; checked
            with tensor ops and one host read, whatever its length.
    """
    count = "a 1-D sequence of" if length is None else f"{length}"
    try:
        idx = torch.as_tensor(value, device=device)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{name} must be {count} integers in [0, 2**63){per}") from err
    if idx.numel() == 0 and length is None:
        idx = idx.long().reshape(0)
    wrong = idx.ndim != 1 if length is None else idx.shape != (length,)
    if wrong or idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise ValueError(f"{name} must be {count} integers{per}, got shape {tuple(idx.shape)} {idx.dtype}")
    idx = idx.long()
    if idx.numel() == 0:
        return idx
    # sorted, a repeat sits next to its twin: both checks in one read
    ordered = idx.sort().values
    twins = ordered[1:] == ordered[:-1]
    negative, repeats = torch.stack([ordered[0] < 0, twins.any() if unique else twins[:0].any()]).tolist()
    if negative:
        at = int(torch.nonzero(idx < 0)[0, 0])
        raise ValueError(f"{name} must be non-negative integers in [0, 2**63){per}, got {name}[{at}] = {int(idx[at])}")
    if repeats:
        twin = int(ordered[1:][twins][0])
        raise ValueError(f"{name} must not repeat: each index is one sample, but {twin} appears more than once")
    return idx
