"""Frozen predictions: one prefetched target evaluation held fixed in a parameterization
(``velocity``, ``drift``, ``x0``, ``eps``, ``x0_extrap``), every exactly known part recomputed."""

from __future__ import annotations

import torch

from ..sde import StepTables
from .base import FROZEN_KINDS, Proposal, available_drafts
from .prefetch import Prefetch

__all__ = ["FrozenPrediction"]


def _frozen_coefficients(kind: str, tab: StepTables, steps: torch.Tensor, pre: Prefetch):
    """``(A (G, n, 1), C (G, n, D))`` of one frozen parameterization (see :class:`FrozenPrediction`)."""
    ac = tab.ac[steps]  # (G, n, 2)
    a, c = ac[..., :1], ac[..., 1:]
    ys, vs = pre.y[:, None], pre.v[:, None]
    if kind == "velocity":
        return a, c * vs
    if kind == "drift":
        ps = pre.step[:, None]
        b = -tab.drift_f[ps][..., None] * vs - tab.drift_k[ps][..., None] * ys
        return torch.ones_like(a), tab.gamma[steps][..., None] * b
    sig = tab.sig[steps][..., None]
    sig_src = tab.sig[pre.step][:, None, None]
    if kind in ("x0", "x0_extrap"):
        x0 = ys - sig_src * vs
        if kind == "x0_extrap":
            sig_prev = tab.sig[pre.prev_step][:, None, None]
            x0_prev = pre.prev_y[:, None] - sig_prev * pre.prev_v[:, None]
            gap = sig_src - sig_prev
            ok = pre.has_prev[:, None, None] & (gap.abs() > 1e-12)
            slope = torch.where(ok, (x0 - x0_prev) / torch.where(ok, gap, torch.ones_like(gap)), torch.zeros_like(x0))
            x0 = x0 + (sig - sig_src) * slope
        # v = (y - x0) / sig
        k = c / sig
        return a + k, -k * x0
    # eps: v = (xi - y) / (1 - sig), xi = y* + (1 - sig*) v*; at sig = 1 (a grid that starts at pure
    # noise, where y is xi itself) the noise prediction says nothing of v, so the frozen velocity drafts there
    xi = ys + (1.0 - sig_src) * vs
    room = (1.0 - sig).expand_as(c)
    defined = room > 0
    k = torch.where(defined, c / torch.where(defined, room, torch.ones_like(room)), torch.zeros_like(c))
    return a - k, torch.where(defined, k * xi, c * vs)


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
      ``v = (xi* - y) / (1 - sigma)`` (``v*`` itself at ``sigma = 1``, where ``y`` is the noise);
    * ``x0_extrap``: the clean-data prediction extrapolated linearly in the noise
      level from the last two prefetched evaluations,
      ``x0(sigma) = x0* + (sigma - sigma*) (x0* - x0_prev) / (sigma* - sigma_prev)``
      (plain ``x0`` where there is no earlier evaluation).

    Each is affine in the parent ``y`` (:meth:`coefficients`).

    Args:
        kind: one of :data:`FROZEN_KINDS`.
    """

    affine = True

    def __init__(self, kind: str = "velocity") -> None:
        if kind not in FROZEN_KINDS:
            raise ValueError(f"draft must be one of {available_drafts()} or a callable, got {kind!r}")
        self.kind = kind
        self.name = kind
        self.uses_history = kind == "x0_extrap"

    def coefficients(self, tab, steps, pre, state, terms=None):
        if pre is None:
            raise ValueError("a frozen-prediction draft needs a prefetched evaluation")
        return _frozen_coefficients(self.kind, tab, steps, pre)

    def __repr__(self) -> str:
        return f"FrozenPrediction(kind={self.kind!r})"
