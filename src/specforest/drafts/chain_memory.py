"""The memory of the drafts that read the previous chain round (``memory``, ``secant``, ``auto``,
``learned``, ``cached``): :class:`ChainMemory`, what it keeps per trajectory, and
:class:`RemembersChain`, the base that makes it and updates it after every chain round, with the
helpers that keep it (the width fit and the secant gain pairs of two rounds)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..sde import StepTables
from .base import DraftMemory, EvaluatedChain, Proposal

__all__ = ["ChainMemory", "RemembersChain"]


@dataclass(frozen=True)
class ChainMemory(DraftMemory):
    """Per trajectory, the previous speculative round's evaluated chain (``W`` nodes a trajectory).

    Attributes:
        x0: ``(batch, W, D)`` the clean-data predictions ``y - sigma v`` of the last speculative
            round's evaluated chain nodes, node ``j`` at step ``s0 + j`` (:class:`MemoryDraft`).
        s0: ``(batch,)`` long step of ``x0``'s first node.
        n: ``(batch,)`` long number of valid nodes in ``x0`` (0: no memory).
        y: ``(batch, W, D)`` the states of those nodes, for drafts that also correct for how far
            the drafted state is from the remembered one (:class:`SecantDraft`); ``None`` unless
            the draft :attr:`~specforest.drafts.base.Proposal.uses_states`.
        gain_num, gain_den: ``(batch, S)`` float64, per trajectory and step of a grid of ``S``,
            the running sums ``sum <x0' - x0, y' - y>`` and ``sum |y' - y|^2`` over pairs of
            evaluations that two successive rounds made at the same step (``None`` with ``y``);
            their ratio is :class:`SecantDraft`'s gain.
        features: ``(batch, W, F)`` the target's deep features at those nodes, kept by the round's
            verification call (``None`` unless the run keeps them; :class:`CachedDraft`).
    """

    x0: torch.Tensor
    s0: torch.Tensor
    n: torch.Tensor
    y: Optional[torch.Tensor] = None
    gain_num: Optional[torch.Tensor] = None
    gain_den: Optional[torch.Tensor] = None
    features: Optional[torch.Tensor] = None

    @classmethod
    def empty(
        cls,
        batch: int,
        width: int,
        D: int,
        dtype: torch.dtype,
        device: torch.device,
        states: bool = False,
        steps: int = 0,
        features: int = 0,
    ) -> "ChainMemory":
        """No memory yet for any of ``batch`` trajectories: room for ``width`` nodes, with their
        states and the gains of a grid of ``steps`` steps where ``states``, and ``features``
        numbers of deep features a node where ``features > 0``."""
        zi = torch.zeros(batch, dtype=torch.long, device=device)
        zm = lambda: torch.zeros(batch, width, D, dtype=dtype, device=device)  # noqa: E731
        zg = torch.zeros(batch, steps, dtype=torch.float64, device=device) if states else None
        return cls(
            x0=zm(),
            s0=zi,
            n=zi,
            y=zm() if states else None,
            gain_num=zg,
            gain_den=zg,
            features=torch.zeros(batch, width, features, dtype=dtype, device=device) if features else None,
        )

    @property
    def width(self) -> int:
        """``W``, the nodes a trajectory remembers."""
        return self.x0.shape[1]

    def replaced(
        self,
        x0: torch.Tensor,
        s0: torch.Tensor,
        n: torch.Tensor,
        y: Optional[torch.Tensor] = None,
        features: Optional[torch.Tensor] = None,
    ) -> "ChainMemory":
        """Every row remembers a round's chain: ``x0 (batch, W', D)`` clean-data predictions of its
        nodes from step ``s0 (batch,)`` on, the first ``n (batch,)`` of them valid (cut or padded
        to ``W``).

        Where the memory keeps states (``y`` not ``None``), ``y (batch, W', D)`` are the nodes'
        states: they are kept too, and every node at a step the remembered chain also evaluated
        adds its pair to the gain sums (``gain_num``, ``gain_den``) before the memory is replaced.
        Where it keeps deep features, ``features (batch, W', F)`` are the nodes'.

        Raises:
            ValueError: if the memory keeps states or features and they are not given.
        """
        W = self.width
        x0 = fit_width(x0, W)
        n = n.clamp(max=W)
        new = dict(x0=x0, s0=s0, n=n)
        if self.y is not None:
            if y is None:
                raise ValueError("this memory keeps the remembered states: replaced needs y")
            y = fit_width(y, W)
            at, num, den = _secant_pairs(x0, y, s0, n, self.x0, self.y, self.s0, self.n, self.gain_num.shape[1])
            new.update(
                y=y, gain_num=self.gain_num.scatter_add(1, at, num), gain_den=self.gain_den.scatter_add(1, at, den)
            )
        if self.features is not None:
            if features is None:
                raise ValueError("this memory keeps the nodes' deep features: replaced needs features")
            new.update(features=fit_width(features.to(self.features.dtype), W))
        return replace(self, **new)


class RemembersChain(Proposal):
    """Base of the drafts that read the previous round's evaluated chain (:class:`ChainMemory`):
    it declares :attr:`uses_memory` and step-keyed chain noise (:attr:`aligned_noise`), makes the
    memory (its states and gains where the draft :attr:`uses_states`, the deep features where the
    run keeps them) and, after every chain round, remembers the round's parents ``0 .. Lr - 1``:
    their clean-data predictions ``y - sigma v``, their states and their features."""

    uses_memory = True
    aligned_noise = True

    def init_memory(self, batch, D, width, steps, features, dtype, device) -> ChainMemory:
        return ChainMemory.empty(
            batch, width, D, dtype, device, states=self.uses_states, steps=steps, features=features
        )

    def remember(self, memory: ChainMemory, tab: StepTables, chain: EvaluatedChain) -> ChainMemory:
        x0 = chain.y - tab.sig[chain.steps][..., None] * chain.v.to(chain.y.dtype)
        return memory.replaced(x0, chain.s0, chain.n, y=chain.y, features=chain.features)


def fit_width(t: torch.Tensor, W: int) -> torch.Tensor:
    """``t (G, W', D)`` cut or zero-padded to ``(G, W, D)``."""
    if t.shape[1] < W:
        t = torch.cat([t, t.new_zeros(t.shape[0], W - t.shape[1], t.shape[2])], 1)
    return t[:, :W]


def _secant_pairs(
    x0: torch.Tensor,
    y: torch.Tensor,
    s0: torch.Tensor,
    n: torch.Tensor,
    old_x0: torch.Tensor,
    old_y: torch.Tensor,
    old_s0: torch.Tensor,
    old_n: torch.Tensor,
    S: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gain-sum increments of a new chain memory ``x0, y (G, W, D)`` (from step ``s0``, ``n``
    valid) against the one it replaces (``old_*``), on a grid of ``S`` steps.

    New node ``j < n`` (step ``s0 + j``) pairs with old node ``t = s0 + j - old_s0`` when
    ``0 <= t < old_n``: the two rounds' evaluations at one step. Returns ``(at, num, den)``, each
    ``(G, W)``: the long step of each node (clamped into the grid) and the float64 increments
    ``<dx0, dy>`` and ``|dy|^2`` (zero where a node has no pair), ready for ``scatter_add``.
    """
    W = x0.shape[1]
    j = torch.arange(W, device=x0.device)
    step = s0[:, None] + j  # (G, W)
    t = step - old_s0[:, None]
    ok = (j < n[:, None]) & (t >= 0) & (t < old_n[:, None])
    at = t.clamp(0, max(old_x0.shape[1] - 1, 0))[..., None].expand_as(x0)
    dx = (x0 - old_x0.gather(1, at)).double()
    dy = (y - old_y.gather(1, at)).double()
    zero = torch.zeros((), dtype=torch.float64, device=x0.device)
    num = torch.where(ok, (dx * dy).sum(-1), zero)
    den = torch.where(ok, (dy * dy).sum(-1), zero)
    return step.clamp(max=S - 1), num, den
