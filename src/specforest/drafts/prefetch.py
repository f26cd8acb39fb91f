"""The per-trajectory target evaluations a draft reads (:class:`Prefetch`) and the helpers that
keep its chain memory: the width fit and the secant gain pairs of two rounds."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import torch

__all__ = ["Prefetch"]


@dataclass(frozen=True)
class Prefetch:
    """Per-trajectory target evaluation reused by the next round's draft.

    Attributes:
        y: ``(batch, D)`` state at which the target was evaluated.
        v: ``(batch, D)`` the target velocity there.
        step: ``(batch,)`` long step index of that evaluation.
        prev_y, prev_v, prev_step: the evaluation prefetched before it, for
            drafts that extrapolate in time.
        has_prev: ``(batch,)`` bool, True where ``prev_*`` hold a real evaluation.
        valid: ``(batch,)`` bool, True where ``y, v, step`` hold an evaluation.
        mem_x0: ``(batch, W, D)`` the clean-data predictions ``y - sigma v`` of the last
            speculative round's evaluated chain nodes, node ``j`` at step ``mem_s0 + j``, for
            drafts that read the previous round at the same step (:class:`MemoryDraft`);
            ``W = 0`` when the proposal keeps no memory.
        mem_s0: ``(batch,)`` long step of ``mem_x0``'s first node.
        mem_n: ``(batch,)`` long number of valid nodes in ``mem_x0`` (0: no memory).
        mem_y: ``(batch, W, D)`` the states of those nodes, for drafts that also correct for how
            far the drafted state is from the remembered one (:class:`SecantDraft`); ``W = 0``
            unless the proposal :attr:`~Proposal.uses_states`.
        gain_num, gain_den: ``(batch, S)`` per trajectory and step, the running sums
            ``sum <x0' - x0, y' - y>`` and ``sum |y' - y|^2`` over pairs of evaluations that two
            successive rounds made at the same step (``S = 0`` unless the proposal
            :attr:`~Proposal.uses_states`); their ratio is :class:`SecantDraft`'s gain.
        mem_f: ``(batch, W, F)`` the target's deep features at those nodes, kept by the round's
            verification call (``W = F = 0`` unless the proposal :attr:`~Proposal.uses_features`;
            :class:`CachedDraft`).
    """

    y: torch.Tensor
    v: torch.Tensor
    step: torch.Tensor
    prev_y: torch.Tensor
    prev_v: torch.Tensor
    prev_step: torch.Tensor
    has_prev: torch.Tensor
    valid: torch.Tensor
    mem_x0: Optional[torch.Tensor] = None
    mem_s0: Optional[torch.Tensor] = None
    mem_n: Optional[torch.Tensor] = None
    mem_y: Optional[torch.Tensor] = None
    gain_num: Optional[torch.Tensor] = None
    gain_den: Optional[torch.Tensor] = None
    mem_f: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        # no memory given: none kept (W = 0, S = 0)
        batch, D = self.y.shape
        for name in ("mem_x0", "mem_y"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.y.new_zeros(batch, 0, D))
        for name in ("mem_s0", "mem_n"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, torch.zeros_like(self.step))
        for name in ("gain_num", "gain_den"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.y.new_zeros(batch, 0, dtype=torch.float64))
        if self.mem_f is None:
            object.__setattr__(self, "mem_f", self.y.new_zeros(batch, 0, 0))

    @classmethod
    def empty(
        cls,
        batch: int,
        D: int,
        dtype: torch.dtype,
        device: torch.device,
        memory: int = 0,
        states: bool = False,
        steps: int = 0,
        features: int = 0,
    ) -> "Prefetch":
        """No evaluation yet for any of ``batch`` trajectories (room for ``memory`` nodes of memory,
        with ``states`` for their states and the gains of a grid of ``steps`` steps, and for
        ``features`` numbers of deep features a node)."""
        z = torch.zeros(batch, D, dtype=dtype, device=device)
        zi = torch.zeros(batch, dtype=torch.long, device=device)
        zb = torch.zeros(batch, dtype=torch.bool, device=device)
        zm = torch.zeros(batch, memory, D, dtype=dtype, device=device)
        zy = torch.zeros(batch, memory if states else 0, D, dtype=dtype, device=device)
        zg = torch.zeros(batch, steps if states else 0, dtype=torch.float64, device=device)
        zf = torch.zeros(batch, memory if features else 0, features, dtype=dtype, device=device)
        return cls(
            **dict(y=z, v=z, step=zi, prev_y=z, prev_v=z, prev_step=zi, has_prev=zb, valid=zb),
            **dict(mem_x0=zm, mem_s0=zi, mem_n=zi, mem_y=zy, gain_num=zg, gain_den=zg, mem_f=zf),
        )

    def restart(self, rows: torch.Tensor) -> "Prefetch":
        """Rows ``rows`` as :meth:`empty` makes them (no evaluation), the others unchanged."""
        return Prefetch(**{f.name: getattr(self, f.name).index_fill(0, rows, 0) for f in fields(self)})

    def take(self, idx: torch.Tensor, history: bool = True) -> "Prefetch":
        """The rows ``idx`` of every field (of ``y, v, step, valid`` only unless ``history``)."""
        if history:
            return Prefetch(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})
        return replace(
            self,
            y=self.y[idx],
            v=self.v[idx],
            step=self.step[idx],
            valid=self.valid[idx],
            mem_x0=self.mem_x0[idx],
            mem_s0=self.mem_s0[idx],
            mem_n=self.mem_n[idx],
            mem_y=self.mem_y[idx],
            gain_num=self.gain_num[idx],
            gain_den=self.gain_den[idx],
            mem_f=self.mem_f[idx],
        )

    def replaced(self, y: torch.Tensor, v: torch.Tensor, step: torch.Tensor, history: bool = True) -> "Prefetch":
        """Every row replaced by a new evaluation, the old one kept as ``prev`` (``with_rows`` of all rows)."""
        valid = torch.ones_like(self.valid)
        if not history:
            return replace(self, y=y, v=v, step=step, valid=valid)
        return replace(
            self,
            y=y,
            v=v,
            step=step,
            prev_y=self.y,
            prev_v=self.v,
            prev_step=self.step,
            has_prev=self.valid,
            valid=valid,
        )

    def with_rows(
        self,
        idx: torch.Tensor,
        y: torch.Tensor,
        v: torch.Tensor,
        step: torch.Tensor,
        keep_prev: bool,
        history: bool = True,
    ) -> "Prefetch":
        """A new prefetch with rows ``idx`` replaced by an evaluation; the old one becomes ``prev`` if
        ``keep_prev`` (``prev`` is only tracked with ``history``)."""
        put = lambda t, val: t.index_put((idx,), val)  # noqa: E731
        valid = self.valid.index_fill(0, idx, True)
        if not history:
            return replace(self, y=put(self.y, y), v=put(self.v, v), step=put(self.step, step), valid=valid)
        keep = torch.full_like(idx, keep_prev, dtype=torch.bool) & self.valid[idx]
        return replace(
            self,
            y=put(self.y, y),
            v=put(self.v, v),
            step=put(self.step, step),
            prev_y=put(self.prev_y, self.y[idx]),
            prev_v=put(self.prev_v, self.v[idx]),
            prev_step=put(self.prev_step, self.step[idx]),
            has_prev=put(self.has_prev, keep),
            valid=valid,
        )

    def with_memory(
        self,
        idx: Optional[torch.Tensor],
        x0: torch.Tensor,
        s0: torch.Tensor,
        n: torch.Tensor,
        y: Optional[torch.Tensor] = None,
        f: Optional[torch.Tensor] = None,
    ) -> "Prefetch":
        """Rows ``idx`` (every row if ``None``) remember a round's chain: ``x0 (G, W', D)`` clean-data
        predictions of its nodes from step ``s0 (G,)`` on, the first ``n (G,)`` of them valid.

        Where the prefetch keeps states (``mem_y`` not empty), ``y (G, W', D)`` are the nodes'
        states: they are kept too, and every node at a step the remembered chain also evaluated
        adds its pair to the gain sums (``gain_num``, ``gain_den``) before the memory is replaced.
        Where it keeps deep features (``mem_f`` not empty), ``f (G, W', F)`` are the nodes'.
        """
        W = self.mem_x0.shape[1]
        x0 = _fit_width(x0, W)
        n = n.clamp(max=W)
        rows = slice(None) if idx is None else idx
        new = dict(mem_x0=x0, mem_s0=s0, mem_n=n)
        if self.mem_y.shape[1]:
            if y is None:
                raise ValueError("this prefetch keeps the remembered states: with_memory needs y")
            y = _fit_width(y, W)
            old = (self.mem_x0[rows], self.mem_y[rows], self.mem_s0[rows], self.mem_n[rows])
            at, num, den = _secant_pairs(x0, y, s0, n, *old, self.gain_num.shape[1])
            new.update(
                mem_y=y,
                gain_num=self.gain_num[rows].scatter_add(1, at, num),
                gain_den=self.gain_den[rows].scatter_add(1, at, den),
            )
        if self.mem_f.shape[1]:
            if f is None:
                raise ValueError("this prefetch keeps the nodes' deep features: with_memory needs f")
            new.update(mem_f=_fit_width(f.to(self.mem_f.dtype), W))
        if idx is None:
            return replace(self, **new)
        return replace(self, **{k: getattr(self, k).index_put((idx,), v) for k, v in new.items()})


def _fit_width(t: torch.Tensor, W: int) -> torch.Tensor:
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
