"""Proposals: how drafted states are drawn (paper eq. 7, Appendix C.1).

A proposal gives the draft transition mean ``m^p(y)`` at any state and step;
its scale is always the target's (eq. 37), which is what the couplings need.

* :class:`FrozenPrediction` -- the self-speculative *delayed drift*: one target
  evaluation, made at some earlier node ``(y*, sigma*)`` (the prefetched root
  drift), is frozen in a chosen parameterization and every exactly known part
  is recomputed at each drafted state and step.
* :class:`DraftModel` -- an independent cheap model with the target's
  signature, evaluated at every drafted parent.

Any proposal keeps the sampler exact: the couplings correct whatever mean the
draft uses. The proposal only moves the acceptance rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .sde import ReverseSDE

__all__ = ["DRAFT_KINDS", "FROZEN_KINDS", "AutoDraft", "DraftModel", "FrozenPrediction", "Prefetch", "Proposal", "get_proposal"]

DRAFT_KINDS = ("velocity", "drift", "x0", "eps", "x0_extrap", "auto")
"""Parameterizations a frozen prediction can be held fixed in; ``auto`` picks one
per draft offset from the mismatch observed in earlier rounds (:class:`AutoDraft`)."""

FROZEN_KINDS = DRAFT_KINDS[:5]

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Prefetch:
    """Per-trajectory target evaluation reused by the next round's draft.

    Attributes:
        y: ``(B, D)`` state at which the target was evaluated.
        v: ``(B, D)`` the target velocity there.
        step: ``(B,)`` long step index of that evaluation.
        prev_y, prev_v, prev_step: the evaluation prefetched before it (``None``
            when not tracked), for drafts that extrapolate in time.
        has_prev: ``(B,)`` bool, True where ``prev_*`` hold a real evaluation.
    """

    y: torch.Tensor
    v: torch.Tensor
    step: torch.Tensor
    prev_y: Optional[torch.Tensor] = None
    prev_v: Optional[torch.Tensor] = None
    prev_step: Optional[torch.Tensor] = None
    has_prev: Optional[torch.Tensor] = None

    def take(self, idx: torch.Tensor) -> "Prefetch":
        """The rows ``idx`` of every field."""
        pick = lambda t: None if t is None else t[idx]  # noqa: E731
        return Prefetch(pick(self.y), pick(self.v), pick(self.step), pick(self.prev_y), pick(self.prev_v),
                        pick(self.prev_step), pick(self.has_prev))

    def set(self, idx: torch.Tensor, y: torch.Tensor, v: torch.Tensor, step: torch.Tensor, keep_prev: bool) -> None:
        """Store a new evaluation at rows ``idx``; the old one becomes ``prev`` if ``keep_prev``."""
        if self.prev_y is not None:
            self.prev_y[idx], self.prev_v[idx], self.prev_step[idx] = self.y[idx], self.v[idx], self.step[idx]
            self.has_prev[idx] = keep_prev
        self.y[idx], self.v[idx], self.step[idx] = y, v, step


class Proposal:
    """Base class: ``mean(y, step)`` of the draft transition.

    Attributes:
        needs_prefetch: True if the proposal needs a target evaluation per
            round (then the sampler prefetches it, see ``prefetch`` in
            :func:`specforest.sample`).
        name: short name recorded in results.
    """

    needs_prefetch: bool = True
    name: str = "proposal"

    def mean(
        self,
        sde: ReverseSDE,
        y: torch.Tensor,
        step: torch.Tensor,
        pre: Optional[Prefetch],
        shape: tuple[int, ...],
        cond: Optional[dict] = None,
    ) -> torch.Tensor:
        """Draft means at drafted parents.

        Args:
            sde: the discretized reverse SDE.
            y: ``(n, Bs, D)`` parent states (flattened), ``n`` nodes of each of
                ``Bs`` trajectories (node-major).
            step: ``(Bs,)`` long step index of these parents.
            pre: the trajectories' prefetched evaluations (``Bs`` rows).
            shape: the per-sample state shape (``prod(shape) = D``).
            cond: the model's keyword arguments for these ``Bs`` trajectories
                (per-trajectory tensors already indexed, ``(Bs, ...)``).

        Returns:
            ``(n, Bs, D)`` draft transition means.
        """
        raise NotImplementedError

    def begin_round(self) -> None:
        """Called by the sampler before each round's drafting; the draft must not
        change between this call and the end of the round (the walk recomputes
        the draft means it verifies against)."""

    def observe(
        self,
        sde: ReverseSDE,
        y: torch.Tensor,
        mu_q: torch.Tensor,
        step: torch.Tensor,
        pre: Optional[Prefetch],
        scale: torch.Tensor,
    ) -> None:
        """Called after each verification with the exact target means it used.

        Args:
            y: ``(P, D)`` verified parents; mu_q: ``(P, D)`` their target means;
            step: ``(P,)`` their steps; pre: their trajectories' prefetch;
            scale: ``(P,)`` transition std. A proposal may learn from these for
            *later* rounds (never the current one, which keeps it exact).
        """


class FrozenPrediction(Proposal):
    """Delayed drift: freeze one target prediction and recompute the rest.

    With ``(y*, sigma*, v*)`` the prefetched evaluation and ``(y, sigma)`` the
    drafted parent, the draft velocity is, per ``kind``:

    * ``velocity``: ``v*`` (the paper's protocol, Sec. 5 and the authors' code);
    * ``drift``: the whole reverse drift ``b(y*)`` of eq. (35) (Appendix C.1),
      so ``m^p(y) = y + gamma b(y*)``;
    * ``x0``: the clean-data prediction ``x0* = y* - sigma* v*``, so
      ``v = (y - x0*) / sigma``;
    * ``eps``: the noise prediction ``xi* = y* + (1 - sigma*) v*``, so
      ``v = (xi* - y) / (1 - sigma)``;
    * ``x0_extrap``: the clean-data prediction extrapolated linearly in the noise
      level from the last two prefetched evaluations,
      ``x0(sigma) = x0* + (sigma - sigma*) (x0* - x0_prev) / (sigma* - sigma_prev)``
      (plain ``x0`` where there is no earlier evaluation).

    Args:
        kind: one of :data:`DRAFT_KINDS`.
    """

    def __init__(self, kind: str = "velocity") -> None:
        if kind not in FROZEN_KINDS:
            raise ValueError(f"draft must be one of {DRAFT_KINDS} or a callable, got {kind!r}")
        self.kind = kind
        self.name = kind

    def mean(self, sde, y, step, pre, shape, cond=None):
        if pre is None:
            raise ValueError("a frozen-prediction draft needs a prefetched evaluation")
        ys, vs = pre.y, pre.v
        if self.kind == "velocity":
            return sde.mean_from_velocity(y, vs, step)
        if self.kind == "drift":
            b = sde.drift(ys, vs, pre.step)
            return sde.mean_from_drift(y, b, step)
        sig_src = sde.sigmas.to(y.device, y.dtype)[pre.step][:, None]
        sig = sde.sigmas.to(y.device, y.dtype)[step][:, None]
        if self.kind in ("x0", "x0_extrap"):
            x0 = ys - sig_src * vs
            if self.kind == "x0_extrap" and pre.has_prev is not None:
                sig_prev = sde.sigmas.to(y.device, y.dtype)[pre.prev_step][:, None]
                x0_prev = pre.prev_y - sig_prev * pre.prev_v
                gap = sig_src - sig_prev
                ok = pre.has_prev[:, None] & (gap.abs() > 1e-12)
                slope = torch.where(ok, (x0 - x0_prev) / torch.where(ok, gap, torch.ones_like(gap)), torch.zeros_like(x0))
                x0 = x0 + (sig - sig_src) * slope
            v = (y - x0) / sig
        else:
            xi = ys + (1.0 - sig_src) * vs
            v = (xi - y) / (1.0 - sig)
        return sde.mean_from_velocity(y, v, step)

    def __repr__(self) -> str:
        return f"FrozenPrediction(kind={self.kind!r})"


class DraftModel(Proposal):
    """An independent draft model ``v_draft(x, sigma, **model_kwargs)`` with the target's signature.

    It is evaluated at every drafted parent (its calls are counted apart from the
    target's NFE) and receives the same conditioning as the target, per-trajectory
    tensors indexed per row; no prefetching is needed.

    Args:
        fn: callable ``(x: (M, *shape), sigma: (M,), **model_kwargs) -> (M, *shape)`` velocity.
    """

    needs_prefetch = False
    name = "model"

    def __init__(self, fn: VelocityFn) -> None:
        if not callable(fn):
            raise TypeError("draft model must be callable as fn(x, sigma)")
        self.fn = fn
        self.calls = 0

    def mean(self, sde, y, step, pre, shape, cond=None):
        n, Bs, D = y.shape
        sig = sde.sigmas.to(y.device)[step].repeat(n)
        # node-major rows: row i * Bs + b belongs to trajectory b
        kw = {
            k: (v.repeat(n, *([1] * (v.ndim - 1))) if isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == Bs else v)
            for k, v in (cond or {}).items()
        }
        v = self.fn(y.reshape(n * Bs, *shape), sig.to(y.dtype), **kw)
        self.calls += 1
        v = v.reshape(n, Bs, D).to(y.dtype)
        if not torch.isfinite(v).all():
            raise FloatingPointError("the draft model returned NaN or inf")
        return sde.mean_from_velocity(y, v, step)

    def __repr__(self) -> str:
        return f"DraftModel({self.fn!r})"


class AutoDraft(Proposal):
    """Frozen prediction whose parameterization is chosen online (``draft="auto"``).

    After every verification the sampler reports the exact target mean; for each
    kind in :data:`FROZEN_KINDS` the draft mean that kind *would* have used is a
    deterministic function of the same parent and prefetch, so the mismatch
    ``delta_kind = |m_q - m_p^kind| / sigma`` of every kind is observed at once.
    Rule: for a parent ``k`` steps after its prefetched evaluation (the draft
    offset), use the kind with the smallest running mean of ``delta`` at that
    offset over the rounds so far (an unseen offset takes the choice of the
    nearest smaller seen one; ``velocity`` before anything is seen).
    The choice only uses earlier rounds (observations are merged when the next
    round begins), so the draft of a round is fixed given the past and the
    sampler stays exact. State is per :func:`specforest.sample`
    call: a fresh instance is made for each run.
    """

    name = "auto"

    def __init__(self, max_offset: int = 64) -> None:
        self.kinds = [FrozenPrediction(k) for k in FROZEN_KINDS]
        self.sum = torch.zeros(max_offset + 1, len(self.kinds), dtype=torch.float64)
        self.count = torch.zeros(max_offset + 1, dtype=torch.float64)
        # observations of the current round, merged at the next round's start so
        # that a round's drafting and its verification use the same choice
        self._new_sum = torch.zeros_like(self.sum)
        self._new_count = torch.zeros_like(self.count)
        self._pick = self.choice()

    def begin_round(self) -> None:
        self.sum += self._new_sum
        self.count += self._new_count
        self._new_sum.zero_()
        self._new_count.zero_()
        self._pick = self.choice()

    def choice(self) -> torch.Tensor:
        """``(max_offset + 1,)`` index into :data:`FROZEN_KINDS` used at each offset.

        An offset never observed takes the choice of the nearest smaller observed
        offset (``velocity`` when there is none).
        """
        mean = self.sum / self.count.clamp_min(1.0)[:, None]
        pick = mean.argmin(1)
        out = torch.zeros_like(pick)
        last = 0
        for i in range(pick.numel()):
            if self.count[i] > 0:
                last = int(pick[i])
            out[i] = last
        return out

    def mean(self, sde, y, step, pre, shape, cond=None):
        offset = (step - pre.step).clamp(0, self.sum.shape[0] - 1).cpu()
        pick = self._pick[offset]  # (Bs,)
        out = torch.empty_like(y)
        for k in pick.unique().tolist():
            cols = (pick == k).nonzero()[:, 0].to(y.device)
            sub = pre.take(cols)
            out[:, cols] = self.kinds[k].mean(sde, y[:, cols], step[cols], sub, shape)
        return out

    def observe(self, sde, y, mu_q, step, pre, scale):
        offset = (step - pre.step).clamp(0, self.sum.shape[0] - 1).cpu()
        for i, kind in enumerate(self.kinds):
            m = kind.mean(sde, y[None], step, pre, ())[0]
            d = (torch.linalg.vector_norm((mu_q - m).double(), dim=-1) / scale.double()).cpu()
            self._new_sum[:, i].index_add_(0, offset, d)
        self._new_count.index_add_(0, offset, torch.ones_like(offset, dtype=torch.float64))

    def __repr__(self) -> str:
        return "AutoDraft()"


def get_proposal(draft: "str | Proposal | VelocityFn") -> Proposal:
    """Resolve ``draft``: a kind name, a :class:`Proposal`, or a draft-model callable."""
    if isinstance(draft, Proposal):
        return draft
    if draft == "auto":
        return AutoDraft()
    if isinstance(draft, str):
        return FrozenPrediction(draft)
    if callable(draft):
        return DraftModel(draft)
    raise TypeError(f"draft must be one of {DRAFT_KINDS}, a Proposal or a callable, got {draft!r}")
