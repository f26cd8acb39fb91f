"""List couplings beyond GRS: select a child by rank, then couple it (``rank``, ``antithetic``).

A select-then-couple rule picks one child from the order statistics of the
children's projections by a rule of :mod:`specforest.rank_rules`, then couples
that child's law with the target; the residual is drawn by rejection. The
``rank`` rule conditions on the maximum of ``K`` i.i.d. children;
``antithetic`` drafts ``K/2`` mirrored pairs and conditions on the largest
magnitude.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..rank_rules import cell_of, n_cells, rule_acceptance, rule_log_density, table_acceptance, table_rule
from ..streams import Stream
from .base import Coupling
from .maximal import rmc_acceptance

__all__ = ["AntitheticCoupling", "RankCoupling"]


def _log_normal_pdf(s: torch.Tensor) -> torch.Tensor:
    return -0.5 * s * s - 0.5 * math.log(2 * math.pi)


_REJECTION_SLOT = 8


def _sample_residual_by_rejection(
    delta: torch.Tensor,
    log_f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    rng: Stream,
    max_batch: int = 4096,
) -> torch.Tensor:
    """Exact draws from ``(q - f)_+ / (1 - alpha)`` with ``q = N(delta, 1)``, ``alpha = int min(q, f)``.

    Rejection from ``q``: a candidate ``s`` is kept with probability
    ``(1 - f(s) / q(s))_+``, so a candidate succeeds with probability
    ``1 - alpha``. Problems still pending draw twice as many candidates on each
    pass, starting from one (up to ``max_batch``); pass ``t`` draws at its own
    slots, so a problem's draws do not depend on the others in the batch. The
    residual is only needed after a rejection, which happens with probability
    ``1 - alpha``, so the expected number of candidates per rejected problem is
    bounded (about 2) whatever ``alpha``. One host synchronization per pass.

    Args:
        delta: ``(P,)`` float64.
        log_f: ``log_f(s (n, m), rows (n,)) -> (n, m)`` log density of the selected child.
        rng: the problems' stream (``P`` keys).
    """
    P = delta.numel()
    out = torch.empty(P, dtype=torch.float64, device=delta.device)
    todo = torch.arange(P, device=delta.device)
    m, t = 1, 0
    while todo.numel():
        d = delta[todo]
        sub = rng.take(todo)
        s = d[:, None] + sub.normal(_REJECTION_SLOT + 2 * t, m)
        log_ratio = log_f(s, todo) - _log_normal_pdf(s - d[:, None])
        keep_p = -torch.expm1(log_ratio.clamp(max=0.0))
        hit = sub.uniform(_REJECTION_SLOT + 2 * t + 1, m) < keep_p
        ok = hit.any(1)
        first = torch.argmax(hit.to(torch.int8), dim=1)
        out[todo[ok]] = s[ok, first[ok]]
        todo = todo[~ok]
        m, t = min(2 * m, max_batch), t + 1
    return out


class _SelectThenCouple(Coupling):
    """Select one child by a rule that uses only the projections, then maximally couple.

    If the selected projection ``X`` has a known density ``f`` (by construction
    of the rule), accepting ``X`` with probability ``min(1, q(X) / f(X))`` and
    otherwise drawing from ``(q - f)_+ / (1 - alpha)`` outputs exactly ``q``; the
    selected child's orthogonal part is independent of every projection, hence
    of ``X`` and of the selection, and keeps its law. Acceptance
    ``alpha = int min(q, f)``.

    Slots: 0 for the rule's choice, 1 for the acceptance test, 2 for a
    subclass's second choice draw, 8 and up for the residual's rejection passes.
    """

    def choose(self, s_hat, delta, valid, rng):
        """Return ``(index (P,), log_f)`` where ``log_f(s, rows)`` is the selected law's log density."""
        raise NotImplementedError

    def select(self, s_hat, delta, valid, rng):
        P = s_hat.shape[0]
        rows = torch.arange(P, device=s_hat.device)
        index, log_f = self.choose(s_hat, delta, valid, rng)
        x = s_hat[rows, index]
        log_acc = (_log_normal_pdf(x - delta) - log_f(x[:, None], rows)[:, 0]).clamp(max=0.0)
        accepted = torch.log(rng.uniform(1, 1)[:, 0]) <= log_acc
        return accepted, index

    def uniform_draws(self, K):
        return ((0, 1), (1, 1))

    def residual(self, s_hat, delta, valid, index, rng):
        # the choice is a function of the keyed draws: recomputing it gives the same index and density
        _, log_f = self.choose(s_hat, delta, valid, rng)
        return _sample_residual_by_rejection(delta, log_f, rng)


def _rule(delta: torch.Tensor, M: int, base: str) -> torch.Tensor:
    """``(P, C, M)`` table weights (all ones for a single value)."""
    if M == 1:
        return torch.ones(delta.numel(), n_cells(base), 1, dtype=torch.float64, device=delta.device)
    return table_rule(delta, M, base)


def _pick_by_rule(values: torch.Tensor, W: torch.Tensor, base: str, u: torch.Tensor) -> torch.Tensor:
    """Index ``(P,)`` of the value chosen by the max-conditioned rank rule with weights ``W (P, C, M)``."""
    P, M = values.shape
    rows = torch.arange(P, device=values.device)
    w = W[rows, cell_of(values.max(1).values, base)]
    j = torch.searchsorted(torch.cumsum(w, 1), u[:, None].contiguous()).clamp(max=M - 1)[:, 0]
    return torch.argsort(values, dim=1).gather(1, j[:, None])[:, 0]


class RankCoupling(_SelectThenCouple):
    """Rank-aware list coupling: select a child by its rank in the projection,
    with rank weights that depend on where the largest projection fell.

    The max-conditioned rank rule of :mod:`specforest.rank_rules`: find the cell
    of the largest projection, then select the ``j``-th smallest child with
    probability ``W[c, j](delta)``. The weights are tabulated per ``delta``
    (shipped, interpolated). The selected projection has a closed-form density
    ``f`` (order statistics of ``K`` i.i.d. ``N(0, 1)`` jointly with the cell of
    the maximum). It is maximally coupled with ``N(delta, 1)``, and the residual
    is drawn exactly by rejection.

    The selection uses the projections only, so the selected child's orthogonal
    part keeps its law. Children must be i.i.d. from the proposal. With
    ``K = 1`` it is the maximal coupling (RMC's acceptance). The acceptance is
    within 0.6 % of the i.i.d. list bound (:func:`specforest.landscape.list_bound`)
    at every tabulated ``delta`` for ``K <= 16``.
    """

    name = "rank"

    def choose(self, s_hat, delta, valid, rng):
        P, Kmax = s_hat.shape
        u = rng.uniform(0, 1)[:, 0]
        k_eff = valid.sum(1)
        if bool((k_eff == Kmax).all()):
            # every problem has all its children (a uniform tree): one rule, no grouping
            W = _rule(delta, Kmax, "normal")
            return _pick_by_rule(s_hat, W, "normal", u), rule_log_density(W, Kmax, "normal")
        index = torch.zeros(P, dtype=torch.long, device=s_hat.device)
        groups = k_eff.unique().tolist()
        weights: dict = {}
        for k in groups:
            sel = torch.arange(P, device=s_hat.device) if len(groups) == 1 else (k_eff == k).nonzero()[:, 0]
            W = _rule(delta[sel], int(k), "normal")
            index[sel] = _pick_by_rule(s_hat[sel, :k], W, "normal", u[sel])
            weights[k] = (sel, rule_log_density(W, int(k), "normal"))

        # position of each problem within its group's weights
        pos = torch.empty(P, dtype=torch.long, device=s_hat.device)
        for sel, _ in weights.values():
            pos[sel] = torch.arange(sel.numel(), device=s_hat.device)

        def log_f(s, rows):
            out = torch.empty_like(s)
            for k, (_, density) in weights.items():
                m = slice(None) if len(groups) == 1 else k_eff[rows] == k
                out[m] = density(s[m], pos[rows[m]])
            return out

        return index, log_f

    def acceptance(self, delta, K):
        d = torch.as_tensor(delta, dtype=torch.float64)
        flat = d.reshape(-1)
        return rule_acceptance(flat, _rule(flat, int(K), "normal"), "normal").reshape(d.shape)

    def model_acceptance(self, delta, K):
        if K == 1:
            return rmc_acceptance(delta)
        d = torch.as_tensor(delta, dtype=torch.float64)
        return table_acceptance(d.reshape(-1), int(K), "normal").reshape(d.shape)


class AntitheticCoupling(_SelectThenCouple):
    """Antithetic pairs of children (each pair mirrored through the proposal mean)
    with their best exact rank coupling. ``K`` must be even.

    Children ``2i`` and ``2i + 1`` are ``mu_p + s Z_i`` and ``mu_p - s Z_i`` with
    ``Z_1, ..., Z_{K/2}`` i.i.d. ``N(0, I)``: each child is marginally
    ``N(mu_p, s^2 I)``, and its subtree is drafted from it with fresh noise, so
    every node keeps the proposal's law. In any direction the pair's
    projections are ``+R_i`` and ``-R_i`` with magnitudes ``R_i = |S_i|`` i.i.d.
    half-normal, whatever the direction (the pair covers both sides of the
    mean, which i.i.d. children cannot).

    Rule: pick a pair by the max-conditioned rank rule on the magnitudes
    (:mod:`specforest.rank_rules`, ``halfnormal`` base; the selected magnitude has
    density ``g``), then the member at ``+r`` with probability
    ``pi(r) = min(1, q(r) / g(r))``, else the one at ``-r``. The selected
    projection has density ``f(r) = min(q(r), g(r))`` and
    ``f(-r) = g(r) - f(r)``, known in closed form, and is maximally coupled
    with ``q``; the residual is drawn exactly. Acceptance
    ``int_0^inf min(g(r), q(r) + q(-r)) dr``: for ``K = 2`` (``g = 2 phi``) it
    exceeds the i.i.d. bound for ``delta >= 1``. Nodes must all have the same
    even number of children.
    """

    name = "antithetic"
    structured_siblings = True

    def check_children(self, K: int) -> None:
        if K % 2:
            raise ValueError(
                f"coupling 'antithetic' draws mirrored pairs: every node needs an even number of "
                f"children (2, 4, ...), got {K}"
            )

    def uniform_draws(self, K):
        return ((0, 1), (1, 1), (2, 1))

    def structure_noise(self, z: torch.Tensor) -> torch.Tensor:
        self.check_children(z.shape[1])
        out = z.clone()
        out[:, 1::2] = -z[:, 0::2]
        return out

    @staticmethod
    def _log_f(s: torch.Tensor, r: torch.Tensor, delta: torch.Tensor, log_g: torch.Tensor) -> torch.Tensor:
        """Log density of the selected projection ``s (n, m)``, given ``r = |s|`` and the magnitude's
        ``log_g`` there."""
        log_qr = _log_normal_pdf(r - delta)
        log_pos = torch.minimum(log_qr, log_g)
        # g(r) - min(q(r), g(r)) = g(r) (1 - min(1, q(r) / g(r)))
        log_neg = log_g + torch.log(-torch.expm1((log_qr - log_g).clamp(max=0.0)))
        return torch.where(s >= 0, log_pos, log_neg)

    def choose(self, s_hat, delta, valid, rng):
        P, K = s_hat.shape
        self.check_children(K)
        if not bool(valid.all()):
            raise ValueError("antithetic coupling needs every node's pairs complete (a uniform tree)")
        M = K // 2
        rows = torch.arange(P, device=s_hat.device)
        mag = s_hat[:, 0::2].abs()
        W = _rule(delta, M, "halfnormal")
        pair = _pick_by_rule(mag, W, "halfnormal", rng.uniform(0, 1)[:, 0])
        r = mag[rows, pair]
        density = rule_log_density(W, M, "halfnormal")
        log_g = density(r[:, None], rows)[:, 0]
        pi = torch.exp((_log_normal_pdf(r - delta) - log_g).clamp(max=0.0))
        take_pos = rng.uniform(2, 1)[:, 0] < pi
        # the member at +r is child 2 * pair iff its projection is >= 0; its mirror is the other one
        pos_child = torch.where(s_hat[rows, 2 * pair] >= 0, 2 * pair, 2 * pair + 1)
        index = torch.where(take_pos, pos_child, pos_child ^ 1)

        def log_f(s, rws):
            r = s.abs()
            return self._log_f(s, r, delta[rws][:, None], density(r, rws))

        return index, log_f

    def acceptance(self, delta, K=2):
        self.check_children(int(K))
        d = torch.as_tensor(delta, dtype=torch.float64)
        flat = d.reshape(-1)
        return rule_acceptance(flat, _rule(flat, int(K) // 2, "halfnormal"), "halfnormal").reshape(d.shape)

    def model_acceptance(self, delta, K=2):
        self.check_children(int(K))
        if K == 2:
            return self.acceptance(delta, 2)
        d = torch.as_tensor(delta, dtype=torch.float64)
        return table_acceptance(d.reshape(-1), int(K) // 2, "halfnormal").reshape(d.shape)
