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
from typing import Optional

import torch

__all__ = [
    "Coupling",
    "CouplingResult",
    "GRS",
    "RMC",
    "get_coupling",
    "grs_acceptance",
    "grs_levels",
    "log_sf",
    "rmc_acceptance",
    "sample_grs_residual",
]

_BISECT_ITERS = 80


def log_sf(x: torch.Tensor) -> torch.Tensor:
    """``log Phibar(x)``, the log standard-normal survival function, stable in both tails."""
    return torch.special.log_ndtr(-x)


def rmc_acceptance(delta: torch.Tensor | float) -> torch.Tensor:
    """Acceptance of the maximal coupling, ``2 Phibar(delta / 2)`` (eq. 20)."""
    d = torch.as_tensor(delta, dtype=torch.float64)
    return 2.0 * torch.exp(log_sf(d / 2.0))


def _tail_mass(s: torch.Tensor, delta: torch.Tensor, log_lam: torch.Tensor) -> torch.Tensor:
    """``log [Phibar(s - delta) - lam Phibar(s)]`` for ``s`` in the super-level set.

    Written as ``log Phibar(s - delta) + log(1 - lam Phibar(s) / Phibar(s - delta))``
    so that neither tail nor a small ``delta`` loses precision.
    """
    a = log_sf(s - delta)
    inner = (log_lam + log_sf(s) - a).clamp(max=0.0)
    return a + torch.log(-torch.expm1(inner))


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
    dd = torch.where(pos, d, torch.ones_like(d))
    lam = [torch.zeros_like(d)]
    G = [torch.ones_like(d)]
    for _ in range(K):
        lam_k = lam[-1] + G[-1]
        log_lam = torch.log(lam_k)
        tau = log_lam / dd + dd / 2.0
        g = torch.exp(_tail_mass(tau, dd, log_lam))
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


def sample_grs_residual(
    delta: torch.Tensor, lam: torch.Tensor, G: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """Exact draw of ``S`` from the GRS residual ``(q - lam p)_+ / G`` (eq. 17, ERRATA 4).

    Inverts the closed-form tail ``H(s) = Phibar(s - delta) - lam Phibar(s)`` on the
    half-line ``s > tau = ln(lam) / delta + delta / 2`` by bisection in log space to
    float64 resolution: ``H(s) = u G`` with ``H(tau) = G``.

    Args:
        delta: ``(P,)`` float64, > 0.
        lam: ``(P,)`` float64 level ``lambda_K >= 1``.
        G: ``(P,)`` float64 remaining mass ``G_{K+1} > 0``.
        u: ``(P,)`` float64 uniforms in (0, 1].

    Returns:
        ``(P,)`` float64 residual draws in the projection coordinate.
    """
    log_lam = torch.log(lam)
    lo = log_lam / delta + delta / 2.0
    log_target = torch.log(u) + torch.log(G)
    # Phibar(hi - delta) = u G bounds H(hi) <= u G from above, so [lo, hi] brackets.
    hi = torch.maximum(delta - torch.special.ndtri(torch.exp(log_target)), lo)
    for _ in range(_BISECT_ITERS):
        mid = 0.5 * (lo + hi)
        above = _tail_mass(mid, delta, log_lam) > log_target
        lo = torch.where(above, mid, lo)
        hi = torch.where(above, hi, mid)
    return 0.5 * (lo + hi)


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


class Coupling:
    """Base class of verification rules (the ``Verify`` of Algorithm 1).

    Subclasses implement :meth:`couple_projections` on the scalar projections;
    the rank-1 reduction and reconstruction (eqs. 12-15) live here, so a new
    rule touches neither them nor the sampler loop.
    """

    name: str = "coupling"
    max_children: Optional[int] = None

    def __call__(
        self,
        mu_p: torch.Tensor,
        mu_q: torch.Tensor,
        scale: torch.Tensor,
        children: torch.Tensor,
        valid: torch.Tensor,
        generator: Optional[torch.Generator] = None,
    ) -> CouplingResult:
        """Couple each problem's children with its target.

        Args:
            mu_p: ``(P, D)`` proposal means.
            mu_q: ``(P, D)`` target means.
            scale: ``(P,)`` shared transition std, > 0.
            children: ``(P, K, D)`` drafted children, i.i.d. from ``N(mu_p, scale^2 I)``.
            valid: ``(P, K)`` bool, a prefix of True per row (at least one).
            generator: source of the rule's uniforms.

        Returns:
            A :class:`CouplingResult`.
        """
        P, K, _ = children.shape
        if self.max_children is not None and K > self.max_children:
            raise ValueError(
                f"coupling {self.name!r} takes at most {self.max_children} child per node, "
                f"got {K}; use a tree with K <= {self.max_children} or another coupling"
            )
        work = children.dtype if children.dtype in (torch.float32, torch.float64) else torch.float32
        mu_p = mu_p.to(work)
        diff = mu_q.to(work) - mu_p
        norm = torch.linalg.vector_norm(diff, dim=-1).to(torch.float64)
        s64 = scale.to(torch.float64)
        delta = norm / s64
        safe = torch.where(norm > 0, norm, torch.ones_like(norm)).to(work)
        e = diff / safe[:, None]  # the zero vector when delta = 0: nothing to move
        s_hat = torch.einsum("pkd,pd->pk", children.to(work) - mu_p[:, None], e).to(torch.float64)
        s_hat = s_hat / s64[:, None]
        s_new, accepted, index = self.couple_projections(s_hat, delta, valid, generator)
        base = torch.where(accepted, index, torch.zeros_like(index))
        chosen = children.to(work)[torch.arange(P, device=children.device), base]
        s_chosen = s_hat.gather(1, base[:, None])[:, 0]
        shift = ((s_new - s_chosen) * s64).to(work)
        state = chosen + shift[:, None] * e
        return CouplingResult(state, accepted, torch.where(accepted, index, -1), delta)

    def couple_projections(
        self,
        s_hat: torch.Tensor,
        delta: torch.Tensor,
        valid: torch.Tensor,
        generator: Optional[torch.Generator],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Map the children's projections to one exact target projection.

        Args:
            s_hat: ``(P, K)`` float64 projections, i.i.d. ``N(0, 1)``.
            delta: ``(P,)`` float64.
            valid: ``(P, K)`` bool prefix mask.
            generator: source of uniforms.

        Returns:
            ``(s, accepted, index)``: ``(P,)`` float64 target projection
            (``N(delta, 1)``), ``(P,)`` bool, ``(P,)`` long accepted child (or, when
            rejected, the child whose orthogonal part is kept).
        """
        raise NotImplementedError

    def acceptance(self, delta: torch.Tensor | float, K: int) -> torch.Tensor:
        """Closed-form probability of accepting a child, given ``delta`` and ``K``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _uniform(shape, generator, device) -> torch.Tensor:
    gdev = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(shape, generator=generator, dtype=torch.float64, device=gdev).to(device)


class RMC(Coupling):
    """Reflection maximal coupling for a single proposal (Algorithm 2).

    Accept with probability ``min(1, rho(S))``, else reflect ``S -> delta - S``.
    Acceptance ``2 Phibar(delta / 2)`` (eq. 20), the optimum for one proposal.
    """

    name = "rmc"
    max_children = 1

    def couple_projections(self, s_hat, delta, valid, generator):
        s = s_hat[:, 0]
        log_u = torch.log(_uniform(s.shape, generator, s.device))
        accepted = log_u <= (delta * s - 0.5 * delta * delta).clamp(max=0.0)
        s_new = torch.where(accepted, s, delta - s)
        return s_new, accepted, torch.zeros_like(s, dtype=torch.long)

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
        """``beta_k = min(1, (rho_k - lambda_{k-1})_+ / G_k)``, all ``(P, K)`` float64."""
        excess = (rho - lam_prev).clamp_min(0.0)
        ratio = torch.where(G > 0, excess / G.clamp_min(1e-300), (excess > 0).to(rho.dtype))
        return ratio.clamp(max=1.0)

    def couple_projections(self, s_hat, delta, valid, generator):
        P, K = s_hat.shape
        lam, G = grs_levels(delta, K)  # (P, K+1) each
        log_rho = delta[:, None] * s_hat - 0.5 * (delta * delta)[:, None]
        rho = torch.exp(log_rho.clamp(max=700.0))
        beta = self.acceptance_weights(rho, lam[:, :K], G[:, :K], s_hat)
        u = _uniform((P, K + 1), generator, s_hat.device)
        hit = (u[:, :K] < beta) & valid
        accepted = hit.any(1)
        first = torch.argmax(hit.to(torch.int8), dim=1)
        k_eff = valid.sum(1)
        rows = torch.arange(P, device=s_hat.device)
        lam_k, G_k = lam[rows, k_eff], G[rows, k_eff]
        need = ~accepted
        s_res = s_hat[:, 0].clone()
        if need.any():
            s_res[need] = sample_grs_residual(
                delta[need], lam_k[need], G_k[need], 1.0 - u[need, K]
            )
        s_new = torch.where(accepted, s_hat[rows, first], s_res)
        index = torch.where(accepted, first, torch.zeros_like(first))
        return s_new, accepted, index

    def acceptance(self, delta, K):
        return grs_acceptance(delta, K)


_COUPLINGS = {"rmc": RMC, "grs": GRS, "dgrs": GRS}


def get_coupling(coupling: "str | Coupling") -> Coupling:
    """Resolve a coupling name (``rmc``, ``grs``/``dgrs``) or pass an instance through."""
    if isinstance(coupling, Coupling):
        return coupling
    if isinstance(coupling, str) and coupling.lower() in _COUPLINGS:
        return _COUPLINGS[coupling.lower()]()
    raise ValueError(
        f"coupling must be one of {sorted(_COUPLINGS)} or a Coupling instance, got {coupling!r}"
    )
