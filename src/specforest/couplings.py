"""Verification rules: exact couplings of drafted children with the target.

Every rule works on the rank-1 reduction of paper Sec. 3.1: proposal
``P = N(mu_p, s^2 I)`` and target ``Q = N(mu_q, s^2 I)`` differ only along
``e = (mu_q - mu_p) / |mu_q - mu_p|``. With ``delta = |mu_q - mu_p| / s`` and the
projection ``S = e.(Y - mu_p) / s`` (ERRATA 2), ``S ~ N(0, 1)`` under P and
``N(delta, 1)`` under Q, and ``rho(S) = dQ/dP = exp(delta S - delta^2 / 2)``. A
rule only replaces the projection of a child; the orthogonal part is kept.

A rule is called on a batch of ``P`` independent verification problems at once
(one per trajectory whose round reached that depth), each with up to ``K``
children. The scalar work is done in float64 whatever the states' dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .rank_rules import cell_of, log_rule_pdf, n_cells, rule_acceptance, table_acceptance, table_rule
from .registry import Registry
from .residuals import log_sf, sample_grs_residual, tail_mass
from .streams import Stream

__all__ = [
    "Coupling",
    "CouplingResult",
    "AntitheticCoupling",
    "GRS",
    "RMC",
    "RankCoupling",
    "available_couplings",
    "get_coupling",
    "project",
    "register_coupling",
    "grs_acceptance",
    "grs_levels",
    "log_sf",
    "rmc_acceptance",
    "sample_grs_residual",
]

def rmc_acceptance(delta: torch.Tensor | float) -> torch.Tensor:
    """Acceptance of the maximal coupling, ``2 Phibar(delta / 2)`` (eq. 20)."""
    d = torch.as_tensor(delta, dtype=torch.float64)
    return 2.0 * torch.exp(log_sf(d / 2.0))


def grs_levels(delta: torch.Tensor | float, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Levels ``lambda_k`` and remaining masses ``G_k`` of greedy rejection sampling.

    With the ERRATA 1 fix: ``G_1 = 1``, ``lambda_0 = 0``, ``lambda_k = lambda_{k-1} + G_k``
    and ``G_{k+1} = Q(H_k) - lambda_k P(H_k)`` over the super-level set
    ``H_k = {S >= ln(lambda_k) / delta + delta / 2}`` (eqs. 19, 25, ERRATA 2, 3).

    Args:
        delta: ``(*batch)`` normalized mean mismatch, >= 0.
        K: number of proposals, >= 1.

    Returns:
        ``lam`` of shape ``(*batch, K + 1)`` holding ``lambda_0 .. lambda_K`` and
        ``G`` of shape ``(*batch, K + 1)`` holding ``G_1 .. G_{K+1}``, float64.
    """
    d = torch.as_tensor(delta, dtype=torch.float64)
    pos = d > 0
    dd = torch.where(pos, d, 1.0)
    one = torch.ones_like(d)
    # the first level in closed form: lambda_1 = 1, tau_1 = delta / 2, G_2 = 1 - 2 Phibar(delta / 2)
    lam = [torch.zeros_like(d), one]
    G = [one, torch.where(pos, torch.erf(d * (0.5 / math.sqrt(2.0))), 0.0)]
    for _ in range(K - 1):
        lam_k = lam[-1] + G[-1]
        log_lam = torch.log(lam_k)
        tau = log_lam / dd + dd / 2.0
        g = torch.exp(tail_mass(tau, dd, log_lam))
        lam.append(lam_k)
        G.append(torch.where(pos, g.clamp(0.0, 1.0), torch.zeros_like(g)))
    return torch.stack(lam, -1), torch.stack(G, -1)


def grs_acceptance(delta: torch.Tensor | float, K: int) -> torch.Tensor:
    """Probability that GRS accepts one of ``K`` i.i.d. proposals, ``1 - G_{K+1}`` (Thm. 2).

    Evaluated as ``Phi(tau_K - delta) + lambda_K Phibar(tau_K)``, a sum of positive
    terms, so that it keeps full relative precision when it is tiny (large ``delta``).
    """
    d = torch.as_tensor(delta, dtype=torch.float64)
    lam = grs_levels(d, K)[0][..., K]
    pos = d > 0
    dd = torch.where(pos, d, torch.ones_like(d))
    tau = torch.log(lam) / dd + dd / 2.0
    acc = torch.exp(torch.special.log_ndtr(tau - dd)) + lam * torch.exp(log_sf(tau))
    return torch.where(pos, acc.clamp(max=1.0), torch.ones_like(acc))


@dataclass
class CouplingResult:
    """Outcome of one batch of verification problems.

    Attributes:
        state: ``(P, D)`` the exact target draws ``Y ~ Q``.
        accepted: ``(P,)`` bool, True if ``Y`` is one of the drafted children.
        index: ``(P,)`` long, which child was accepted (-1 if none).
        delta: ``(P,)`` float64 normalized mean mismatch of each problem.
    """

    state: torch.Tensor
    accepted: torch.Tensor
    index: torch.Tensor
    delta: torch.Tensor


def project(
    z: torch.Tensor, diff: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rank-1 reduction of paper Sec. 3.1 (eqs. 12-13) for a batch of problems.

    Args:
        z: ``(..., K, D)`` the children's standardized offsets ``(Y - mu_p) / s``.
        diff: ``(..., D)`` the mean displacement ``mu_q - mu_p``.
        scale: ``(...)`` float64 transition std ``s > 0``.

    Returns:
        ``(s_hat, delta, e)``: ``(..., K)`` float64 projections ``e . z``,
        ``(...)`` float64 ``delta = |diff| / s`` and ``(..., D)`` the unit
        direction ``e`` in ``diff``'s dtype (zero where ``diff = 0``). Only
        elementwise ops and reductions over the last axis: every problem's
        numbers are independent of the batch it is in.
    """
    norm = torch.linalg.vector_norm(diff, dim=-1, keepdim=True)
    # diff / max(norm, tiny) is the zero vector where diff is
    e = diff / norm.clamp_min(torch.finfo(diff.dtype).tiny)
    s_hat = (z * e[..., None, :]).sum(-1).to(torch.float64)
    return s_hat, norm[..., 0].to(torch.float64) / scale, e


class Coupling:
    """Base class of verification rules (the ``Verify`` of Algorithm 1).

    A rule works on the scalar projections of the rank-1 reduction (eqs.
    12-15, which live here, as does the reconstruction): :meth:`select` decides
    whether a child is accepted and which one; :meth:`residual` draws the
    target projection of a rejected problem. The sampler calls :meth:`select`
    on every verification problem of a round's tree at once and
    :meth:`residual` only where its walk stopped, so a new rule touches neither
    the reduction nor the sampler loop.

    Randomness comes from a :class:`~specforest.streams.Stream` (one key per
    problem); draw with ``rng.uniform(slot, n)`` / ``rng.normal(slot, n)``,
    one slot per distinct draw of the rule, the same slots in :meth:`select`
    and :meth:`residual` for a draw they share.

    Declared needs (class attributes, read by the sampler):
        name: registry name, recorded in results.
        max_children: largest number of children of a node (``None``: any).
        structured_siblings: the rule draws a node's children jointly through
            :meth:`structure_noise` (then every internal node needs the same
            number of children, and adaptive trees, which assume i.i.d.
            children, are refused).
    """

    name: str = "coupling"
    max_children: Optional[int] = None
    structured_siblings: bool = False

    def __call__(
        self,
        mu_p: torch.Tensor,
        mu_q: torch.Tensor,
        scale: torch.Tensor,
        children: torch.Tensor,
        valid: torch.Tensor,
        generator: "Optional[torch.Generator] | Stream" = None,
    ) -> CouplingResult:
        """Couple each problem's children with its target (the whole rule, for direct use and tests).

        Args:
            mu_p: ``(P, D)`` proposal means.
            mu_q: ``(P, D)`` target means.
            scale: ``(P,)`` shared transition std, > 0.
            children: ``(P, K, D)`` drafted children, i.i.d. from ``N(mu_p, scale^2 I)``
                (or jointly by :meth:`structure_noise`).
            valid: ``(P, K)`` bool, a prefix of True per row (at least one).
            generator: a :class:`~specforest.streams.Stream` with ``P`` keys, or a
                ``torch.Generator`` from which one is keyed.

        Returns:
            A :class:`CouplingResult`.
        """
        P, K, _ = children.shape
        self.check_children(K)
        work = children.dtype if children.dtype in (torch.float32, torch.float64) else torch.float32
        rng = generator if isinstance(generator, Stream) else Stream.from_generator(P, generator, children.device)
        s64 = scale.to(torch.float64)
        mu_p = mu_p.to(work)
        z = (children.to(work) - mu_p[:, None]) / s64.to(work)[:, None, None]
        s_hat, delta, e = project(z, mu_q.to(work) - mu_p, s64)
        accepted, index = self.select(s_hat, delta, valid, rng)
        children = children.to(work)
        state = children[torch.arange(P, device=children.device), index]
        rej = (~accepted).nonzero()[:, 0]
        if rej.numel():
            state[rej] = self.rejected_state(s_hat[rej], delta[rej], valid[rej], index[rej], rng.take(rej),
                                             children[rej], s64[rej], e[rej])
        return CouplingResult(state, accepted, torch.where(accepted, index, -1), delta)

    def rejected_state(
        self, s_hat: torch.Tensor, delta: torch.Tensor, valid: torch.Tensor, index: torch.Tensor, rng: Stream,
        children: torch.Tensor, scale: torch.Tensor, e: torch.Tensor,
    ) -> torch.Tensor:
        """The target states ``(P, D)`` of rejected problems (eq. 15): the kept child ``index``
        with its projection replaced by the :meth:`residual` draw, along ``e``.

        Args:
            s_hat, delta, valid, index, rng: as for :meth:`residual`.
            children: ``(P, K, D)`` the problems' children.
            scale: ``(P,)`` float64 transition std.
            e: ``(P, D)`` unit mean displacement (``children``' dtype).
        """
        rows = torch.arange(s_hat.shape[0], device=s_hat.device)
        s_new = self.residual(s_hat, delta, valid, index, rng)
        shift = ((s_new - s_hat[rows, index]) * scale).to(children.dtype)
        return torch.addcmul(children[rows, index], shift[:, None], e)

    def select(
        self, s_hat: torch.Tensor, delta: torch.Tensor, valid: torch.Tensor, rng: Stream
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decide each problem: is a child accepted, and which.

        Args:
            s_hat: ``(P, K)`` float64 projections, i.i.d. ``N(0, 1)`` (or as
                :meth:`structure_noise` makes them).
            delta: ``(P,)`` float64 mismatch ``>= 0``.
            valid: ``(P, K)`` bool prefix mask of real children.
            rng: the problems' random stream.

        Returns:
            ``(accepted, index)``: ``(P,)`` bool and ``(P,)`` long, the accepted
            child, or when rejected the child whose orthogonal part is kept.
        """
        raise NotImplementedError

    def residual(
        self, s_hat: torch.Tensor, delta: torch.Tensor, valid: torch.Tensor, index: torch.Tensor, rng: Stream
    ) -> torch.Tensor:
        """The target projection of rejected problems (the same rows' inputs as :meth:`select`).

        Returns:
            ``(P,)`` float64: together with the accepted children's projections,
            exactly ``N(delta, 1)``.
        """
        raise NotImplementedError

    def acceptance(self, delta: torch.Tensor | float, K: int) -> torch.Tensor:
        """Closed-form probability of accepting a child, given ``delta`` and ``K``."""
        raise NotImplementedError

    def model_acceptance(self, delta: torch.Tensor | float, K: int) -> torch.Tensor:
        """A fast approximation of :meth:`acceptance` for planning models (default: the exact one)."""
        return self.acceptance(delta, K)

    def check_children(self, K: int) -> None:
        """Raise ``ValueError`` if a node cannot have ``K`` children under this rule."""
        if self.max_children is not None and K > self.max_children:
            raise ValueError(
                f"coupling {self.name!r} takes at most {self.max_children} child per node, "
                f"got {K}; use a tree with K <= {self.max_children} or another coupling"
            )

    def structure_noise(self, z: torch.Tensor) -> torch.Tensor:
        """Joint law of siblings: map i.i.d. standard noise ``(n, K, ...)`` of each
        node's ``K`` children to the noise the rule expects (identity: i.i.d.).

        Only used when :attr:`structured_siblings` is True. Every sibling must
        stay marginally standard normal, so each child (and the subtree drafted
        below it) keeps the proposal's law.
        """
        return z

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class RMC(Coupling):
    """Reflection maximal coupling for a single proposal (Algorithm 2).

    Accept with probability ``min(1, rho(S))``, else reflect ``S -> delta - S``.
    Acceptance ``2 Phibar(delta / 2)`` (eq. 20), the optimum for one proposal.
    """

    name = "rmc"
    max_children = 1

    def select(self, s_hat, delta, valid, rng):
        log_u = torch.log(rng.uniform(0, 1)[:, 0])
        accepted = log_u <= (delta * s_hat[:, 0] - 0.5 * delta * delta).clamp(max=0.0)
        return accepted, torch.zeros_like(accepted, dtype=torch.long)

    def residual(self, s_hat, delta, valid, index, rng):
        return delta - s_hat[:, 0]

    def acceptance(self, delta, K=1):
        return rmc_acceptance(delta)


class GRS(Coupling):
    """Greedy rejection sampling over ``K`` ordered i.i.d. proposals (Algorithm 3).

    With the ERRATA fixes: the denominator of ``beta_k`` is the remaining mass
    ``G_k`` (not the projection), the super-level threshold is taken in the
    ``S`` coordinate, and the residual is sampled exactly by
    :func:`sample_grs_residual`. Acceptance ``1 - G_{K+1}`` (Theorem 2). With
    ``K = 1`` it has the same law as :class:`RMC`.
    """

    name = "grs"

    def acceptance_weights(
        self, rho: torch.Tensor, lam_prev: torch.Tensor, G: torch.Tensor, s_hat: torch.Tensor
    ) -> torch.Tensor:
        """``beta_k = min(1, (rho_k - lambda_{k-1})_+ / G_k)``, all ``(P, K)`` float64.

        ``G_k = 0`` only at ``delta = 0`` past the first proposal, which is then accepted surely.
        """
        return ((rho - lam_prev).clamp_min(0.0) / G.clamp_min(1e-300)).clamp(max=1.0)

    def select(self, s_hat, delta, valid, rng):
        K = s_hat.shape[1]
        lam, G = grs_levels(delta, K)  # (P, K+1) each
        d = delta[:, None]
        rho = torch.exp((d * (s_hat - 0.5 * d)).clamp(max=700.0))
        beta = self.acceptance_weights(rho, lam[:, :K], G[:, :K], s_hat)
        hit = (rng.uniform(0, K) < beta) & valid
        # the first hit; argmax of a row without one is 0, the child whose orthogonal part is kept
        return hit.any(1), torch.argmax(hit.to(torch.int8), dim=1)

    def residual(self, s_hat, delta, valid, index, rng):
        # below delta = 1e-6 (the range the residual sampler is validated on) the residual is
        # reached with probability G < 1e-6 and its law moves by O(delta): drawing it at 1e-6
        # changes the chain's law by less than 1e-12 per verification, where the exact inversion
        # would be NaN at delta ~ 1e-16
        delta = delta.clamp_min(1e-6)
        lam, G = grs_levels(delta, s_hat.shape[1])
        k_eff = valid.sum(1, keepdim=True)
        return sample_grs_residual(delta, lam.gather(1, k_eff)[:, 0], G.gather(1, k_eff)[:, 0], rng.uniform(1, 1)[:, 0])

    def acceptance(self, delta, K):
        return grs_acceptance(delta, K)





# -- list couplings beyond GRS ---------------------------------------------------------

def _log_normal_pdf(s: torch.Tensor) -> torch.Tensor:
    return -0.5 * s * s - 0.5 * math.log(2 * math.pi)


_REJECTION_SLOT = 8


def _sample_residual_by_rejection(
    delta: torch.Tensor, log_f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    rng: Stream, max_batch: int = 4096,
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
    j = torch.searchsorted(torch.cumsum(w, 1), u[:, None]).clamp(max=M - 1)[:, 0]
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
        index = torch.zeros(P, dtype=torch.long, device=s_hat.device)
        groups = [Kmax] if bool((k_eff == Kmax).all()) else k_eff.unique().tolist()
        weights: dict = {}
        for k in groups:
            sel = torch.arange(P, device=s_hat.device) if len(groups) == 1 else (k_eff == k).nonzero()[:, 0]
            W = _rule(delta[sel], int(k), "normal")
            index[sel] = _pick_by_rule(s_hat[sel, :k], W, "normal", u[sel])
            weights[k] = (sel, W)

        # position of each problem within its group's weights
        pos = torch.empty(P, dtype=torch.long, device=s_hat.device)
        for sel, _ in weights.values():
            pos[sel] = torch.arange(sel.numel(), device=s_hat.device)

        def log_f(s, rows):
            out = torch.empty_like(s)
            for k, (_, W) in weights.items():
                m = slice(None) if len(groups) == 1 else k_eff[rows] == k
                out[m] = log_rule_pdf(s[m], W[pos[rows[m]]][:, None], int(k), "normal")
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

    def structure_noise(self, z: torch.Tensor) -> torch.Tensor:
        self.check_children(z.shape[1])
        out = z.clone()
        out[:, 1::2] = -z[:, 0::2]
        return out

    @staticmethod
    def _log_f(s: torch.Tensor, delta: torch.Tensor, W: torch.Tensor, M: int) -> torch.Tensor:
        r = s.abs()
        log_g = log_rule_pdf(r, W, M, "halfnormal")
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
        log_g = log_rule_pdf(r, W, M, "halfnormal")
        pi = torch.exp((_log_normal_pdf(r - delta) - log_g).clamp(max=0.0))
        take_pos = rng.uniform(2, 1)[:, 0] < pi
        # the member at +r is child 2 * pair iff its projection is >= 0; its mirror is the other one
        pos_child = torch.where(s_hat[rows, 2 * pair] >= 0, 2 * pair, 2 * pair + 1)
        index = torch.where(take_pos, pos_child, pos_child ^ 1)

        def log_f(s, rws):
            return self._log_f(s, delta[rws][:, None], W[rws][:, None], M)

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


_COUPLINGS: Registry[Coupling] = Registry("coupling", {
    "rmc": RMC, "grs": GRS, "dgrs": GRS, "rank": RankCoupling, "antithetic": AntitheticCoupling,
}, case_insensitive=True)


def register_coupling(name: str, factory: Callable[[], Coupling], *, replace: bool = False) -> None:
    """Make ``coupling=name`` resolve to ``factory()`` everywhere (sampler, CLI, planners).

    Args:
        name: the registry name (case-insensitive).
        factory: a zero-argument callable returning a fresh :class:`Coupling` (a subclass works).
        replace: allow overriding an existing name.

    Raises:
        ValueError: if ``name`` is taken and ``replace`` is False.
        TypeError: if ``factory`` is not callable.
    """
    _COUPLINGS.register(name, factory, replace=replace)


def available_couplings() -> list[str]:
    """The registered coupling names."""
    return sorted(_COUPLINGS.names())


def get_coupling(coupling: "str | Coupling") -> Coupling:
    """Resolve a registered coupling name (``rmc``, ``grs``/``dgrs``, ``rank``, ``antithetic``, or one
    added by :func:`register_coupling`) or pass an instance through."""
    if isinstance(coupling, Coupling):
        return coupling
    if coupling in _COUPLINGS:
        cp = _COUPLINGS.make(coupling)
        if not isinstance(cp, Coupling):
            raise TypeError(f"the factory registered for {coupling!r} returned {type(cp).__name__}, not a Coupling")
        return cp
    raise ValueError(
        f"coupling must be one of {available_couplings()} or a Coupling instance, got {coupling!r}"
    )
