"""The target's batch-cost curve: seconds of one call against its rows, measured here."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["CURVE_PASSES", "DEFAULT_SIZES", "CostCurve", "measure_cost_curve"]

CURVE_PASSES = 3
"""Passes over the sizes that :func:`measure_cost_curve` spreads its calls over."""
DEFAULT_SIZES = tuple(2**k for k in range(10))
"""Row counts the cost curve is measured at: 1, 2, 4, ..., 512."""


@dataclass(frozen=True)
class CostCurve:
    """The target's measured time per call against its number of rows.

    Attributes:
        sizes: ascending row counts measured.
        seconds: median seconds of one call at each size.
    """

    sizes: tuple
    seconds: tuple

    def __call__(self, rows: float) -> float:
        """Seconds of one call of ``rows`` rows: piecewise linear in the rows, extended by the last slope."""
        s, t = self.sizes, self.seconds
        if rows <= s[0]:
            return t[0]
        for i in range(1, len(s)):
            if rows <= s[i]:
                w = (rows - s[i - 1]) / (s[i] - s[i - 1])
                return t[i - 1] + w * (t[i] - t[i - 1])
        slope = (t[-1] - t[-2]) / (s[-1] - s[-2]) if len(s) > 1 else t[-1] / s[-1]
        return t[-1] + slope * (rows - s[-1])

    def relative(self) -> list:
        """``time(b) / time(1)`` at each measured size."""
        return [x / self.seconds[0] for x in self.seconds]


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work, so that a clock read after it times the work (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Python's cyclic collector off for one timed stretch, as :mod:`timeit` does: a full collection
    landing in a short timed run would be taken for the sampler's or the network's time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@torch.no_grad()
def measure_cost_curve(
    model: Callable,
    x: torch.Tensor,
    *,
    cond: Optional[dict] = None,
    sigma: float = 0.5,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 7,
    progress: bool = False,
    model_kwargs: Optional[dict] = None,
) -> CostCurve:
    """Time the target at each row count: the median of about ``repeats`` calls, made in
    :data:`CURVE_PASSES` passes over the sizes, each after an untimed call at that size.

    Args:
        model: the velocity ``v(x, sigma, **cond)``.
        x: ``(1, *shape)`` one state (repeated to each size).
        cond: conditioning of that state, tensors ``(1, ...)``.
        sigma: the noise level of the calls.
        sizes: ascending row counts.
        repeats: calls timed per size, ``>= 1``.
        progress: a progress bar over the sizes.
        model_kwargs: keyword arguments of every call (as :func:`specforest.sample` passes them).

    Returns:
        A :class:`CostCurve` in seconds.

    Raises:
        ValueError: ``x`` is not one state, or ``sizes`` holds a size below 1.
        TypeError: ``model_kwargs`` is not a dict.
    """
    if x.ndim < 2 or x.shape[0] != 1:
        raise ValueError(f"x must be one state (1, *shape), got {tuple(x.shape)}")
    sizes = tuple(sorted({int(s) for s in sizes}))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"sizes must be integers >= 1, got {sizes}")
    cond = cond or {}
    if model_kwargs is not None and not isinstance(model_kwargs, dict):
        raise TypeError(f"model_kwargs must be a dict or None, got {type(model_kwargs).__name__}")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(sizes) * CURVE_PASSES, desc="cost curve", unit="size")
    inputs = []
    for b in sizes:
        xb = x.expand(b, *x.shape[1:]).contiguous()
        sb = torch.full((b,), float(sigma), dtype=x.dtype, device=x.device)
        cb = {k: v.expand(b, *v.shape[1:]).contiguous() for k, v in cond.items()}
        cb.update(model_kwargs or {})
        inputs.append((xb, sb, cb))
    # passes over the sizes, each timing a few calls after an untimed one at that size: a slow
    # moment of a shared machine then costs a few calls of several sizes, which the medians drop,
    # instead of bending the curve at one size; and no timed call follows a call of another size
    # (a call of one row right after one of 512 rows runs with cold caches: docs/latency.md)
    per_pass = -(-max(1, int(repeats)) // CURVE_PASSES)
    times: list = [[] for _ in sizes]
    with no_gc():
        for _ in range(CURVE_PASSES):
            for i, (xb, sb, cb) in enumerate(inputs):
                model(xb, sb, **cb)
                for _ in range(per_pass):
                    sync(x.device)
                    t0 = time.perf_counter()
                    model(xb, sb, **cb)
                    sync(x.device)
                    times[i].append(time.perf_counter() - t0)
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    return CostCurve(sizes, tuple(statistics.median(t) for t in times))
