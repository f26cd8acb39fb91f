"""Draft trees shaped by the budget: calibrate an acceptance model, then optimize.

:func:`acceptance_model` turns observed mismatches ``delta`` per depth (from a
calibration run with ``record_deltas=True``) into ``a(l, k)``: the mean, over
the observed ``delta`` at depth ``l``, of the coupling's closed-form acceptance
with ``k`` children. :func:`plan_tree` calibrates on a short lazy run of a chain
(independent randomness) and returns :func:`specforest.trees.optimal` for the
budget. The plan is fixed before sampling, so the sampler stays exact.
:func:`make_tree` is the one place where every command turns its ``K``/``L``
options into a tree.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .couplings import Coupling, get_coupling
from .sampler import sample
from .trees import DraftTree, TreePolicy, chain, optimal, uniform

__all__ = ["OBJECTIVES", "TREE_MODES", "AdaptiveTree", "acceptance_model", "make_tree", "plan_tree", "tune"]

OBJECTIVES = ("calls", "latency")
"""What :func:`plan_tree` optimizes: expected steps per target call, or per second on this hardware."""

TREE_MODES = ("uniform", "optimal", "adaptive")
"""How a command's tree is chosen. ``uniform``: the ``(K, L)`` tree of
:func:`make_tree` (a chain for couplings with one child per node); ``optimal``:
:func:`plan_tree` for a budget, from an acceptance model calibrated on a
separate short run; ``adaptive``: :class:`AdaptiveTree`, re-planned every round
from the run's own statistics."""

_GRID = torch.linspace(0.0, 12.0, 241, dtype=torch.float64)


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
    """
    cp = get_coupling(coupling)
    if deltas.ndim != 2 or deltas.shape[1] != 2 or deltas.shape[0] == 0:
        raise ValueError("deltas must be a non-empty (n, 2) tensor of (depth, delta) rows")
    depth = deltas[:, 0].long()
    d = deltas[:, 1].clamp(0.0, float(_GRID[-1]))
    # histogram of delta per depth on a grid, each delta split between its two grid points in
    # proportion to its distance (the model averages the closed form over it, so that is the
    # closed form interpolated linearly at every delta; counting a delta at the grid point above
    # it priced it 0.025 too high on average, and the acceptance 0.01 low at every depth)
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


def _check_size(name: str, v: object) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise TypeError(f"{name} must be None or an int >= 1, got {type(v).__name__}")
    if v is not None and v < 1:
        raise ValueError(f"{name} must be None or an int >= 1, got {v}")


def make_tree(
    K: Optional[int] = None,
    L: Optional[int] = None,
    *,
    coupling: "str | Coupling" = "grs",
    tree: Optional[DraftTree] = None,
    steps: Optional[int] = None,
) -> Optional[DraftTree]:
    """The draft tree a command's ``tree``/``K``/``L``/``coupling`` options ask for.

    ``tree`` is returned as given. Otherwise ``K`` and ``L`` give
    ``trees.uniform(K, L)``; a coupling that verifies one child per node
    (``max_children == 1``, e.g. ``rmc``) drafts a chain, and then ``L`` is its
    budget ``B`` (e.g. ``K + K**2`` to match a ``(K, 2)`` tree) and ``K`` must be
    ``None`` or 1. Nothing gives ``None``, the standard sampler. A chain longer
    than ``steps`` is cut to ``steps`` nodes: rounds never outrun the grid, so
    this changes nothing but memory.

    Args:
        K: children per node, ``>= 1`` (or ``None``).
        L: depth, or the chain's length for one-child couplings, ``>= 1`` (or ``None``).
        coupling: a registered coupling name or a :class:`~specforest.couplings.Coupling`.
        tree: an explicit :class:`~specforest.trees.DraftTree`; exclusive with ``K``/``L``.
        steps: grid steps ``T`` (caps a chain's length).

    Returns:
        A :class:`~specforest.trees.DraftTree`, or ``None`` for the standard sampler.

    Raises:
        ValueError / TypeError: naming the offending parameter.
    """
    _check_size("K", K)
    _check_size("L", L)
    if tree is not None:
        if not isinstance(tree, DraftTree):
            raise TypeError(f"tree must be a DraftTree (see specforest.trees) or None, got {type(tree).__name__}")
        if K is not None or L is not None:
            raise ValueError("give either tree or K/L, not both")
        return tree
    if K is None and L is None:
        return None
    cp = get_coupling(coupling)
    if cp.max_children == 1:
        if L is None:
            raise ValueError(f"coupling={cp.name!r} drafts a chain: give L (its length B), e.g. L=K+K**2")
        if K not in (None, 1):
            raise ValueError(
                f"coupling={cp.name!r} verifies one child per node, got K={K}; pass L=B (the chain length), "
                "e.g. the matched budget K + K**2 of a (K, 2) tree"
            )
        return chain(min(L, steps) if steps is not None else L)
    if K is None or L is None:
        raise ValueError(f"give both K and L for a (K, L) tree, got K={K}, L={L}")
    return uniform(K, L)


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
    objective: str = "calls",
    **sample_kwargs,
) -> Optional[DraftTree]:
    """Calibrate on a short lazy chain run, then return the optimal tree for ``budget``.

    With ``objective="latency"`` the tree minimizes the predicted wall time on
    this hardware instead (:func:`tune` restricted to ``coupling`` and the run's
    draft, with budgets up to ``budget``); that may be ``None``, the standard
    sampler, when no tree pays.

    Args:
        model, x: the target and initial states (the first ``calibration_trajectories``
            rows of ``x`` are used).
        budget: drafted states per round ``B >= 1``.
        steps, churn: as in :func:`specforest.sample`.
        coupling: the coupling the planned tree will be verified with.
        generator: randomness of the calibration run (independent of the real run).
        sample_kwargs: further options of :func:`specforest.sample` (grid, draft,
            prefetch, verify, cond, model_kwargs, ...), used as in the real run
            (``cond`` rows are taken for the calibration trajectories).

    Returns:
        The :func:`specforest.trees.optimal` tree with at most ``budget`` drafted states
        (``objective="calls"``), or the latency-optimal tree or ``None``.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if objective == "latency":
        name = get_coupling(coupling).name
        seed = sample_kwargs.pop("seed", None)
        if seed is None:
            seed = 0 if generator is None else int(torch.randint(0, 2**62, (), generator=generator))
        tuned = tune(
            model,
            x,
            steps=steps,
            churn=churn,
            budget_max=budget,
            drafts=(sample_kwargs.pop("draft", "velocity"),),
            calibration_trajectories=calibration_trajectories,
            seed=seed,
            couplings=(name,),
            **sample_kwargs,
        )
        return tuned.tree
    depth = min(budget, steps)
    cond = sample_kwargs.pop("cond", None)
    if cond is not None:
        if not isinstance(cond, dict):
            raise TypeError(f"cond must be a dict of tensors with one row per trajectory, got {type(cond).__name__}")
        cond = {k: v[:calibration_trajectories] for k, v in cond.items()}
    cal = sample(
        model,
        x[:calibration_trajectories],
        steps=steps,
        churn=churn,
        tree=chain(depth),
        coupling="grs",
        cond=cond,
        lazy=True,
        record_deltas=True,
        generator=generator,
        **sample_kwargs,
    )
    acc = acceptance_model(cal.stats.deltas[:, [0, 2]], coupling, kmax)
    return optimal(acc, budget, depth, kmax=kmax)


class AdaptiveTree(TreePolicy):
    """A draft tree re-planned every round from the statistics gathered so far.

    Pass an instance as ``tree`` to :func:`specforest.sample`. Each round, the
    mismatches recorded in the earlier rounds of the same run give the
    acceptance model of :func:`acceptance_model`, and :func:`specforest.trees.optimal`
    gives the tree for ``budget``. The first speculative round uses ``initial``
    (default: a chain of ``min(budget, 8)``), which also gathers the first
    statistics at depth. Near the end of the chain, trajectories whose remaining
    horizon is shorter than the plan's depth get a plan re-optimized for that
    horizon (drafted in the same target call). A round's trees depend only on
    earlier rounds, so the sampler stays exact.

    Args:
        budget: drafted states per round ``B >= 1``.
        kmax: largest number of children per node considered (>= 1).
        initial: the tree of the rounds before any statistics exist.
        max_depth: deepest tree considered (default ``budget``; the sampler caps
            it at the number of steps).
    """

    def __init__(
        self, budget: int, kmax: int = 16, initial: Optional[DraftTree] = None, max_depth: Optional[int] = None
    ) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget must be an int >= 1, got {budget!r}")
        if isinstance(kmax, bool) or not isinstance(kmax, int) or kmax < 1:
            raise ValueError(f"kmax must be an int >= 1, got {kmax!r}")
        if initial is not None and (not isinstance(initial, DraftTree) or initial.budget > budget or initial.L < 1):
            raise ValueError("initial must be a DraftTree of depth >= 1 within the budget")
        self.budget, self.kmax = budget, kmax
        self.max_depth = budget if max_depth is None else int(max_depth)
        self.initial = initial if initial is not None else chain(min(budget, 8))

    def plan(self, deltas: Optional[torch.Tensor], coupling: Coupling, max_depth: int) -> DraftTree:
        """The tree for the next round, from ``(n, 4)`` recorded verifications (or ``None``)."""
        depth = max(1, min(self.max_depth, max_depth))
        if deltas is None or deltas.shape[0] == 0:
            return self.initial.truncate(depth)
        acc = acceptance_model(deltas[:, [0, 2]], coupling, self.kmax)
        return optimal(acc, self.budget, depth, kmax=self.kmax)

    def __repr__(self) -> str:
        return f"AdaptiveTree(budget={self.budget}, kmax={self.kmax})"


def tune(model: Callable, x: torch.Tensor, **kwargs):
    """The latency-optimal configuration on this hardware: :func:`specforest.latency.tune`.

    Returns a :class:`specforest.latency.Tuned`, a mapping that ``sample(model, x, **tuned)`` accepts.
    """
    from .latency import tune as _tune

    return _tune(model, x, **kwargs)
