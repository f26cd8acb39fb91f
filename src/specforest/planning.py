"""Draft trees shaped by the budget: calibrate an acceptance model, then optimize.

:func:`acceptance_model` turns observed mismatches ``delta`` per depth (from a
calibration run with ``record_deltas=True``) into ``a(l, k)``: the mean, over
the observed ``delta`` at depth ``l``, of the coupling's closed-form acceptance
with ``k`` children. :func:`plan_tree` calibrates on a short lazy run of a chain
(independent randomness) and returns :func:`specforest.trees.optimal` for the
budget. The plan is fixed before sampling, so the sampler stays exact.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .couplings import Coupling, get_coupling
from .sampler import sample
from .trees import DraftTree, chain, optimal

__all__ = ["acceptance_model", "plan_tree"]

_GRID = torch.linspace(0.0, 12.0, 241, dtype=torch.float64)


def acceptance_model(
    deltas: torch.Tensor, coupling: "str | Coupling" = "grs", kmax: int = 16
) -> Callable[[int, int], float]:
    """``a(l, k)``: mean closed-form acceptance over the ``delta`` observed at depth ``l``.

    Args:
        deltas: ``(n, 2)`` rows ``(depth, delta)`` (columns 0 and 2 of ``stats.deltas``).
        coupling: the coupling whose closed form is averaged; for couplings with a
            sibling structure or a limit on children (antithetic, RMC) ``k`` is capped.
        kmax: largest number of children modelled (larger ``k`` get ``a(l, kmax)``).

    Returns:
        ``a(l, k)`` for ``l >= 1``, ``k >= 1``; depths deeper than any observed use
        the deepest observed depth's mismatches.
    """
    cp = get_coupling(coupling)
    if deltas.ndim != 2 or deltas.shape[1] != 2 or deltas.shape[0] == 0:
        raise ValueError("deltas must be a non-empty (n, 2) tensor of (depth, delta) rows")
    depth = deltas[:, 0].long()
    d = deltas[:, 1].clamp(0.0, float(_GRID[-1]))
    # histogram of delta per depth on a grid, then the closed forms on the grid
    idx = torch.bucketize(d, _GRID).clamp(max=len(_GRID) - 1)
    top = int(depth.max())
    hist = torch.zeros(top + 1, len(_GRID), dtype=torch.float64)
    hist.index_put_((depth, idx), torch.ones_like(d), accumulate=True)
    cap = min(kmax, cp.max_children or kmax)
    table = {}

    def a(level: int, k: int) -> float:
        k = min(k, cap)
        level = min(level, top)
        while level > 1 and hist[level].sum() == 0:
            level -= 1
        if (level, k) not in table:
            h = hist[level]
            w = h / h.sum().clamp_min(1.0)
            acc = torch.stack([cp.acceptance(g, k).reshape(()) for g in _GRID[w > 0]])
            table[level, k] = float((w[w > 0] * acc).sum())
        return table[level, k]

    return a


def plan_tree(
    model: Callable,
    x: torch.Tensor,
    *,
    budget: int,
    steps: int,
    churn: float,
    coupling: "str | Coupling" = "grs",
    calibration_trajectories: int = 16,
    generator: Optional[torch.Generator] = None,
    kmax: int = 16,
    **sample_kwargs,
) -> DraftTree:
    """Calibrate on a short lazy chain run, then return the optimal tree for ``budget``.

    Args:
        model, x: the target and initial states (the first ``calibration_trajectories``
            rows of ``x`` are used).
        budget: drafted states per round ``B >= 1``.
        steps, churn: as in :func:`specforest.sample`.
        coupling: the coupling the planned tree will be verified with.
        generator: randomness of the calibration run (independent of the real run).
        sample_kwargs: further options of :func:`specforest.sample` (grid, draft,
            prefetch, verify, model_kwargs, ...), used as in the real run.

    Returns:
        The :func:`specforest.trees.optimal` tree with at most ``budget`` drafted states.
    """
    depth = min(budget, steps)
    cal = sample(
        model, x[:calibration_trajectories], steps=steps, churn=churn, tree=chain(depth), coupling="grs",
        lazy=True, record_deltas=True, generator=generator, **sample_kwargs,
    )
    acc = acceptance_model(cal.stats.deltas[:, [0, 2]], coupling, kmax)
    return optimal(acc, budget, depth)
