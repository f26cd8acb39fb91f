"""Drafts that read the previous round's evaluated chain: time-aligned memory (``memory``) and its
secant-gain correction (``secant``), with the rules, shared by other drafts, of which remembered
node a parent reads. What they remember is :class:`~specforest.drafts.chain_memory.ChainMemory`."""

from __future__ import annotations

from typing import Optional

import torch

from .chain_memory import ChainMemory, RemembersChain
from .prefetch import Prefetch

__all__ = ["MemoryDraft", "SecantDraft"]


class MemoryDraft(RemembersChain):
    """Time-aligned memory (``draft="memory"``): a parent at step ``s`` is drafted from the target's
    clean-data prediction at step ``s`` made by the previous round's verification call.

    What it reads, all made before the round's verification call:

    * its memory's ``x0``: ``x0_j = y_j - sigma_j v_j`` at the previous speculative round's
      evaluated chain nodes ``j`` (steps ``s0 + j``, ``j < n``; :class:`ChainMemory`);
    * the prefetched evaluation ``(y*, v*, step*)``, as the ``x0`` kind does.

    Rule: at a parent of step ``s``, with ``j = min(s - s0, n - 1)``, the draft velocity is
    ``v = (y - x0_j) / sigma_s`` when ``s >= s0`` and node ``j`` is not older than the
    prefetch (``s0 + j >= step*``), else the ``x0`` kind's ``(y - x0*) / sigma_s``. Past the
    previous round's chain it freezes its last node's prediction, the latest the run has.

    With :attr:`aligned_noise`, a chain redrafts the steps the previous round evaluated but did
    not accept with the noise they had then (those draws made no decision: the walk stopped
    before them), so the redrafted nodes lie near the evaluated ones and the memory's error is
    the prediction's change over that small distance, not over a whole step's noise. The draft
    is exact for any memory: it only moves the acceptance. Memory is kept for chain trees (one
    node a depth); on a wider tree the rule falls back to the ``x0`` kind.
    """

    affine = True
    name = "memory"

    def coefficients(self, tab, steps, pre, state, terms=None, memory=None):
        if pre is None:
            raise ValueError("the memory draft needs a prefetched evaluation")
        ac = tab.ac[steps]  # (G, n, 2)
        a, c = ac[..., :1], ac[..., 1:]
        k = c / tab.sig[steps][..., None]
        x0 = (pre.y - tab.sig[pre.step][:, None] * pre.v)[:, None]  # (G, 1, D)
        mem, use = memory_at(steps, pre, memory)
        if mem is not None:
            x0 = torch.where(use[..., None], mem, x0)
        return a + k, -k * x0

    def __repr__(self) -> str:
        return "MemoryDraft()"


class SecantDraft(MemoryDraft):
    """Local linear memory (``draft="secant"``): :class:`MemoryDraft`'s remembered prediction
    moved to the drafted state by a secant (Broyden-style) gain fitted from the run's own pairs.

    What it reads, all made before the round's verification call:

    * what :class:`MemoryDraft` reads, and the remembered nodes' states (its memory's ``y``);
    * the trajectory's gain sums (its memory's ``gain_num``, ``gain_den``) at each step: each
      time a chain round evaluates a step the previous round evaluated too, the two evaluations
      ``(y, x0)`` and ``(y', x0')`` add ``<x0' - x0, y' - y>`` and ``|y' - y|^2`` (when the draft
      remembers the new chain, :meth:`ChainMemory.replaced`).

    Rule: at a parent ``y`` of step ``s`` that reads memory node ``j`` at the same step (``s =
    s0 + j``, ``j < n``), the clean-data prediction is ``x0_j + g_s (y - y_j)`` with the
    least-squares scalar gain ``g_s = gain_num / gain_den`` of the trajectory's own pairs at
    ``s``, or at the nearest earlier step that has pairs (``g = 0``, which is :class:`MemoryDraft`,
    before any). Everywhere else it is :class:`MemoryDraft`. ``g_s`` estimates how the target's
    prediction moves with the state near the trajectory (a scalar multiple of the identity for
    the Jacobian ``d x0 / d y``); the mean stays affine in ``y``: ``A = a + (c / sigma)(1 - g)``,
    ``C = -(c / sigma)(x0_j - g y_j)``.

    Each trajectory fits its own gain from its own evaluations, so a sample does not depend on
    its batch companions. The draft is exact for any gain: it only moves the acceptance. It
    keeps twice :class:`MemoryDraft`'s remembered states (the nodes' states as well) and two
    numbers per trajectory and step.
    """

    uses_states = True
    name = "secant"

    def coefficients(self, tab, steps, pre, state, terms=None, memory=None):
        if pre is None:
            raise ValueError("the secant draft needs a prefetched evaluation")
        A, C = super().coefficients(tab, steps, pre, state, memory=memory)
        if memory is None or memory.y is None:
            return A, C
        # the memory draft's mean plus (c / sigma) g (y_j - y)
        g, ym = secant_at(steps, pre, memory)
        kg = tab.ac[steps][..., 1:] / tab.sig[steps][..., None] * g.to(C.dtype)[..., None]
        return A - kg, torch.addcmul(C, kg, ym)

    def __repr__(self) -> str:
        return "SecantDraft()"


def memory_at(
    steps: torch.Tensor, pre: Prefetch, memory: Optional[ChainMemory]
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The memory node a parent at ``steps (G, n)`` reads (:class:`MemoryDraft`'s rule):
    ``x0_mem (G, n, D)`` and ``use (G, n)`` bool (False: fall back to the prefetch's ``x0``);
    ``(None, None)`` when the run keeps no memory."""
    if memory is None:
        return None, None
    j, use = memory_node(steps, pre, memory)
    return memory.x0.gather(1, j[..., None].expand(-1, -1, memory.x0.shape[2])), use


def memory_node(steps: torch.Tensor, pre: Prefetch, memory: ChainMemory) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`MemoryDraft`'s node index ``j (G, n)`` long for parents of ``steps (G, n)``: the
    remembered node at the parent's step, or the last one past the remembered chain; and ``use
    (G, n)`` bool, False where there is none not older than the prefetch."""
    n, s0 = memory.n[:, None], memory.s0[:, None]
    t = steps - s0
    j = torch.minimum(t, n - 1).clamp(min=0)
    return j, (n > 0) & (t >= 0) & (s0 + j >= pre.step[:, None])


def same_step(steps: torch.Tensor, pre: Prefetch, memory: ChainMemory) -> tuple[torch.Tensor, torch.Tensor]:
    """Where parents of ``steps (G, n)`` have a remembered node at their own step (not older than
    the prefetch), for the drafts that read the remembered states (:attr:`Proposal.uses_states`):
    ``same (G, n)`` bool and the node's index ``(G, n, D)`` into the memory's ``y`` / ``x0``
    for ``gather`` along dim 1 (meaningless where ``same`` is False)."""
    n, s0 = memory.n[:, None], memory.s0[:, None]
    t = steps - s0
    same = (n > 0) & (t >= 0) & (t < n) & (steps >= pre.step[:, None])
    return same, t.clamp(0, memory.y.shape[1] - 1)[..., None].expand(-1, -1, memory.y.shape[2])


def secant_at(steps: torch.Tensor, pre: Prefetch, memory: ChainMemory) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`SecantDraft`'s gain ``g (G, n)`` float64 and remembered state ``y_j (G, n, D)`` at
    parents of ``steps (G, n)``: ``g`` is 0 where the parent does not read a memory node at its
    own step or the trajectory has no pair at or before it."""
    same, j = same_step(steps, pre, memory)
    ym = memory.y.gather(1, j)
    num, den = memory.gain_num, memory.gain_den  # (G, S)
    S = num.shape[1]
    has = den > 0
    ratio = torch.where(has, num / torch.where(has, den, torch.ones_like(den)), torch.zeros_like(den))
    # the nearest step at or before each one that has pairs (-1: none)
    ar = torch.arange(S, device=num.device)
    last = torch.cummax(torch.where(has, ar, -1), 1).values
    filled = torch.where(last >= 0, ratio.gather(1, last.clamp(min=0)), torch.zeros_like(ratio))
    g = filled.gather(1, steps.clamp(0, S - 1))
    return torch.where(same, g, torch.zeros_like(g)), ym
