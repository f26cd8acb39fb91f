"""Draft trees shaped by the budget: calibrate an acceptance model, then optimize.

:func:`plan_tree` calibrates on a short lazy run of a chain (independent
randomness), fits :func:`specforest.acceptance.acceptance_model` to its
mismatches and returns :func:`specforest.trees.optimal` for the budget. The plan
is fixed before sampling, so the sampler stays exact. :func:`make_tree` is the
one place where every command turns its ``K``/``L`` options into a tree.

The tree that minimizes wall time rather than calls is the wall-clock tuner's:
:func:`specforest.latency.tune` (re-exported here as :func:`tune`) chooses tree,
coupling, verification and draft; ``plan_tree(..., objective="latency")`` asks it
for one coupling's tree. The dependency goes one way: this module uses the tuner,
and the tuner reads acceptance from :mod:`specforest.acceptance`, not from here.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .acceptance import acceptance_model
from .couplings import Coupling, get_coupling
from .latency import tune
from .sampler import sample
from .trees import DraftTree, TreePolicy, chain, check_budget, optimal, uniform
from .validation import check_int, check_optional_int

__all__ = ["OBJECTIVES", "TREE_MODES", "AdaptiveTree", "acceptance_model", "make_tree", "plan_tree", "tune"]

OBJECTIVES = ("calls", "latency")
"""What :func:`plan_tree` optimizes: expected steps per target call, or per second on this hardware."""

TREE_MODES = ("uniform", "optimal", "adaptive")
"""How a command's tree is chosen. ``uniform``: the ``(K, L)`` tree of
:func:`make_tree` (a chain for couplings with one child per node); ``optimal``:
:func:`plan_tree` for a budget, from an acceptance model calibrated on a
separate short run; ``adaptive``: :class:`AdaptiveTree`, re-planned every round
from the run's own statistics."""


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
    check_optional_int("K", K, 1)
    check_optional_int("L", L, 1)
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

    Raises:
        ValueError / TypeError: naming the parameter (``budget`` past the node cap among them),
            before the calibration run.
    """
    check_budget(budget)
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

    Raises:
        ValueError / TypeError: naming the parameter: ``budget`` below 1 or past the node cap of
            :mod:`specforest.trees`, ``kmax``, ``initial`` or ``max_depth`` out of range.
    """

    def __init__(
        self, budget: int, kmax: int = 16, initial: Optional[DraftTree] = None, max_depth: Optional[int] = None
    ) -> None:
        check_budget(budget)
        check_int("kmax", kmax, 1)
        if initial is not None and (not isinstance(initial, DraftTree) or initial.budget > budget or initial.L < 1):
            raise ValueError("initial must be a DraftTree of depth >= 1 within the budget")
        self.budget, self.kmax = budget, kmax
        self.max_depth = budget if max_depth is None else check_int("max_depth", max_depth, 1)
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
