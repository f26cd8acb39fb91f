"""Acceptance models: the probability that a verification accepts, from recorded mismatches.

:func:`acceptance_model` turns observed mismatches ``delta`` per depth (from a run with
``record_deltas=True``) into ``a(l, k)``: the mean, over the ``delta`` observed at depth
``l``, of the coupling's closed-form acceptance with ``k`` children. Tree planning
(:mod:`specforest.planning`) and the wall-clock tuner (:mod:`specforest.latency`) both
read acceptance through it.
"""

from __future__ import annotations

from typing import Callable

import torch

from .couplings import Coupling, get_coupling

__all__ = ["acceptance_model"]

_GRID = torch.linspace(0.0, 12.0, 241, dtype=torch.float64)
"""The mismatches at which a coupling's closed-form acceptance is tabulated (steps of 0.05)."""

_ACC_GRID: dict = {}


def _acceptance_on_grid(cp: Coupling, k: int) -> torch.Tensor:
    """``(len(_GRID),)`` closed-form acceptance of ``cp`` with ``k`` children, cached per process."""
    key = (type(cp), k)
    if key not in _ACC_GRID:
        _ACC_GRID[key] = cp.model_acceptance(_GRID, k).reshape(-1).to(torch.float64)
    return _ACC_GRID[key]


def acceptance_model(
    deltas: torch.Tensor, coupling: "str | Coupling" = "grs", kmax: int = 16
) -> Callable[[int, int], float]:
    """``a(l, k)``: mean closed-form acceptance over the ``delta`` observed at depth ``l``.

    Args:
        deltas: ``(n, 2)`` rows ``(depth, delta)`` (columns 0 and 2 of ``stats.deltas``).
        coupling: the coupling whose closed form is averaged; for couplings with a
            limit on children (RMC) ``k`` is capped.
        kmax: largest number of children modelled (larger ``k`` get ``a(l, kmax)``).

    Returns:
        ``a(l, k)`` for ``l >= 1``, ``k >= 1``; depths deeper than any observed use
        the deepest observed depth's mismatches.

    Raises:
        ValueError: ``deltas`` is not a non-empty ``(n, 2)`` tensor.
    """
    cp = get_coupling(coupling)
    if deltas.ndim != 2 or deltas.shape[1] != 2 or deltas.shape[0] == 0:
        raise ValueError("deltas must be a non-empty (n, 2) tensor of (depth, delta) rows")
    depth = deltas[:, 0].long()
    d = deltas[:, 1].clamp(0.0, float(_GRID[-1]))
    # histogram of delta per depth on a grid, each delta split between its two grid points in
    # proportion to its distance (the model averages the closed form over it, so that is the
    # closed form interpolated linearly at every delta; counting a delta at the grid point above
    # it priced it half a grid step, 0.025, too high on average, and the acceptance low at every
    # depth: docs/latency.md)
    hi = torch.bucketize(d, _GRID).clamp(1, len(_GRID) - 1)
    w_hi = ((d - _GRID[hi - 1]) / (_GRID[hi] - _GRID[hi - 1])).clamp(0.0, 1.0)
    top = int(depth.max())
    hist = torch.zeros(top + 1, len(_GRID), dtype=torch.float64)
    hist.index_put_((depth, hi - 1), 1.0 - w_hi, accumulate=True)
    hist.index_put_((depth, hi), w_hi, accumulate=True)
    seen = [lvl for lvl in range(top + 1) if hist[lvl].sum() > 0]
    weights = hist / hist.sum(1, keepdim=True).clamp_min(1.0)
    cap = min(kmax, cp.max_children or kmax)

    def a(level: int, k: int) -> float:
        lvl = max([s for s in seen if s <= min(level, top)] or [seen[0]])
        return min(max(float(weights[lvl] @ _acceptance_on_grid(cp, min(k, cap))), 0.0), 1.0)

    return a
