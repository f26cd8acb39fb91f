"""The cached self-draft corrected by what it missed in the last round (``corrected``): a rank-one
secant (Broyden) estimate of the cached draft's own error, from the residual the last verification
call measured at the remembered node and the node the round before evaluated at the same step."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..sde import StepTables
from .base import EvaluatedChain
from .chain_memory import ChainMemory, fit_width
from .memory import memory_node
from .model import CachedDraft

__all__ = ["CorrectedDraft", "PairedChainMemory"]

GAIN_LIMIT = 1.0
"""The largest ``|c|`` of :class:`CorrectedDraft`'s secant coefficient: past the pair's own offset
the rank-one line is an extrapolation of a nonlinear network's error, so it is cut there."""


@dataclass(frozen=True)
class PairedChainMemory(ChainMemory):
    """A :class:`ChainMemory` whose every remembered node also keeps its pair: the node the round
    before evaluated at the same step (of the same trajectory), for :class:`CorrectedDraft`.

    Attributes:
        pair_features: ``(batch, W, F)`` the pair's deep features (zeros where node ``j`` has none);
            ``None`` where the run keeps no features.
        pair_dy: ``(batch, W, D)`` the node's state minus its pair's, ``y_j - y'_j`` (zeros where none).
        paired: ``(batch, W)`` bool, True where node ``j`` has a pair.
    """

    pair_features: Optional[torch.Tensor] = None
    pair_dy: Optional[torch.Tensor] = None
    paired: Optional[torch.Tensor] = None


class CorrectedDraft(CachedDraft):
    """The cached self-draft plus a secant correction of its own error (``draft="corrected"``).

    What it reads, all made before the round's verification call:

    * what :class:`CachedDraft` reads (the remembered nodes' deep features, the prefetch), and the
      remembered nodes' states and clean-data predictions ``x0_j`` (its memory's ``y``, ``x0``);
    * per remembered node ``j``, its pair (:class:`PairedChainMemory`): the node that the round
      before the last evaluated at the same step, its deep features ``f'_j`` and the offset
      ``dy_j = y_j - y'_j`` of the two states, kept by :meth:`remember` when the last round's
      chain is remembered.

    Rule: at a parent ``y`` of step ``s`` that reads node ``j`` at its own step (the cached draft's
    node, ``s = s0 + j``) and whose node has a pair, the clean-data prediction is

        x0 = x0_c(y; f_j) + c r_j,    r_j = x0_j - x0_c(y_j; f'_j),    c = <dy_j, y - y_j> / |dy_j|^2,

    with ``x0_c(y; f) = y - sigma_s from_features(y, sigma_s, f)`` the cached evaluation and ``c``
    cut to ``[-1, 1]`` (:data:`GAIN_LIMIT`). ``r_j`` is what the cached draft missed at node ``j``
    when it read its pair's features: the target's prediction there, made by the last
    verification call, less the cached one. The cached draft's error ``x0_t(y) - x0_c(y; f_j)`` is
    zero at ``y_j`` and, to first order, ``E (y - y_j)`` for the Jacobian ``E`` of the deep path it
    freezes; ``r_j ~ E dy_j`` is one secant of it, and ``r_j dy_j^T / |dy_j|^2`` is Broyden's
    rank-one estimate of ``E`` from it. Chains draw their noise by step (:attr:`aligned_noise`), so
    the offsets of successive rounds at one step are the coupled samples' shifts after a
    rejection, along the error the draft made there: ``y - y_j`` lies largely along ``dy_j`` and
    the error along ``r_j`` (on ``natural32``, ``docs/drafts-and-planning.md``). Every other parent
    drafts as :class:`CachedDraft` does (a node without a pair, a parent past the remembered chain,
    a tree, the first rounds).

    On a chain of several stages each cheap evaluation, at the parent and at the node with its
    pair's features, is run through the stages (:meth:`~specforest.drafts.Proposal.stage_velocity`),
    as the target's ``x0_j`` was.

    Cost: the residuals are evaluated in the same batched call as the drafted level's cheap
    evaluations (twice its rows, no more calls, counted in ``draft_calls``); the memory keeps, per
    remembered node, a second row of deep features and a second state (the offset) beside the
    cached draft's (and the node's state, :attr:`uses_states`). The draft is exact for any
    correction: it reads only what earlier rounds evaluated, and the couplings correct its mean.
    """

    uses_states = True
    keeps_pairs = True
    name = "corrected"

    def init_memory(self, batch, D, width, steps, features, dtype, device) -> PairedChainMemory:
        base = super().init_memory(batch, D, width, steps, features, dtype, device)
        kept = {f: getattr(base, f) for f in ("x0", "s0", "n", "y", "gain_num", "gain_den", "features")}
        if features <= 0:
            return PairedChainMemory(**kept)
        return PairedChainMemory(
            **kept,
            pair_features=torch.zeros_like(base.features),
            pair_dy=torch.zeros_like(base.x0),
            paired=torch.zeros(batch, width, dtype=torch.bool, device=device),
        )

    def remember(self, memory: PairedChainMemory, tab: StepTables, chain: EvaluatedChain) -> PairedChainMemory:
        new = super().remember(memory, tab, chain)
        if memory.pair_features is None:
            return new
        # node i of the round (step s0 + i) pairs with the node the memory held at that step
        G, L, D = chain.y.shape
        t = chain.steps - memory.s0[:, None]
        own = torch.arange(L, device=t.device)[None] < chain.n[:, None]
        paired = own & (t >= 0) & (t < memory.n[:, None])
        at = t.clamp(0, memory.width - 1)[..., None]
        dy = torch.where(paired[..., None], chain.y - memory.y.gather(1, at.expand(-1, -1, D)), 0.0)
        F = memory.features.shape[2]
        feat = torch.where(paired[..., None], memory.features.gather(1, at.expand(-1, -1, F)), 0.0)
        W = memory.width
        return replace(
            new,
            pair_features=fit_width(feat, W),
            pair_dy=fit_width(dy, W),
            paired=fit_width(paired[..., None], W)[..., 0],
        )

    def mean(self, tab, y, steps, pre, cond, shape, state, memory=None):
        if memory is None or memory.features is None or memory.pair_features is None:
            return super().mean(tab, y, steps, pre, cond, shape, state, memory=memory)
        if pre is None:
            raise ValueError(f"draft={self.name!r} needs a prefetched evaluation")
        G, n, D = y.shape
        sig = tab.sig[steps]  # (G, n)
        j, use = memory_node(steps, pre, memory)
        at = lambda t: t.gather(1, j[..., None].expand(-1, -1, t.shape[2]))  # noqa: E731 (node j's rows)
        y_j, dy = at(memory.y), at(memory.pair_dy)
        # one call a stage: the parents with their node's features, then the nodes with their pairs'
        # (x0_j is the target's prediction from its stages at the node's step, the parent's)
        feat = torch.cat([at(memory.features), at(memory.pair_features)], 1)
        network = self.stage_network(tab, feat, cond, shape)
        rows = torch.cat([y, y_j], 1)
        v = self.stage_velocity(
            tab, network, rows, torch.cat([steps, steps], 1), network(rows, torch.cat([sig, sig], 1))
        )
        v_c, v_pair = v[:, :n], v[:, n:]
        # r_j = x0_j - x0_c(y_j; f'_j), as a velocity: (r_j / sigma) = v_c(y_j; f'_j) - (y_j - x0_j) / sigma
        r = v_pair - (y_j - at(memory.x0)) / sig[..., None]
        off = y - y_j
        num, den = (dy * off).sum(-1), (dy * dy).sum(-1)
        c = (num / den.clamp_min(torch.finfo(den.dtype).tiny)).clamp(-GAIN_LIMIT, GAIN_LIMIT)
        same = use & (steps - memory.s0[:, None] < memory.n[:, None]) & memory.paired.gather(1, j)
        # x0 = x0_c + c r_j is the velocity v_c - c r_j / sigma
        v = torch.where(same[..., None], v_c - c[..., None] * r, v_c)
        x0 = (pre.y - tab.sig[pre.step][:, None] * pre.v)[:, None]  # (G, 1, D): the x0 kind where no node
        v = torch.where(use[..., None], v, (y - x0) / sig[..., None])
        return tab.mean(y, v, steps)

    def __repr__(self) -> str:
        return "CorrectedDraft()"
