"""The paper's rules: RMC (Algorithm 2, one child) and GRS (Algorithm 3, ``K`` i.i.d. children), with closed forms.

``rmc_acceptance`` is ``2 Phibar(delta / 2)``, the reflection maximal coupling's
acceptance; ``grs_levels`` and ``grs_acceptance`` are GRS's thresholds and
acceptance (Theorem 2, with ERRATA 1's denominator).
"""

from __future__ import annotations

import math

import torch

from ..residuals import TRIALS, draw_grs_residual, log_sf, tail_mass
from .base import Coupling

__all__ = ["GRS", "RMC", "grs_acceptance", "grs_levels", "rmc_acceptance"]


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
    one = torch.ones_like(d)
    # the first level in closed form: lambda_1 = 1, tau_1 = delta / 2, G_2 = 1 - 2 Phibar(delta / 2)
    lam = [torch.zeros_like(d), one]
    G = [one, torch.erf(d * (0.5 / math.sqrt(2.0)))]  # 0 at delta = 0
    if K <= 1:
        # (what GRS's acceptance tests at two children read: no level needs the tail mass)
        return torch.stack(lam, -1), torch.stack(G, -1)
    pos = d > 0
    dd = torch.where(pos, d, 1.0)
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

    def uniform_draws(self, K):
        return ((0, 1),)

    def acceptance(self, delta, K=1):
        return rmc_acceptance(delta)


class GRS(Coupling):
    """Greedy rejection sampling over ``K`` ordered i.i.d. proposals (Algorithm 3).

    With the ERRATA fixes: the denominator of ``beta_k`` is the remaining mass
    ``G_k`` (not the projection), the super-level threshold is taken in the
    ``S`` coordinate, and the residual is sampled exactly by
    :func:`~specforest.residuals.draw_grs_residual` (rejection trials, then
    the inversion). Acceptance ``1 - G_{K+1}`` (Theorem 2). With ``K = 1`` it
    has the same law as :class:`RMC`.
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
        # the tests need lambda_0 .. lambda_{K-1} and G_1 .. G_K only, the levels of K - 1 proposals
        # (the same numbers as the first K columns of ``grs_levels(delta, K)``): G_{K+1} is the
        # residual's, computed where a problem is rejected
        lam, G = grs_levels(delta, max(K - 1, 1))
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
        # slot 1: the inversion's uniform (column 0, the only one before trials), then the trials'
        u = rng.uniform(1, 1 + 2 * TRIALS)
        return draw_grs_residual(delta, lam.gather(1, k_eff)[:, 0], G.gather(1, k_eff)[:, 0], u)

    def uniform_draws(self, K):
        return ((0, K), (1, 1 + 2 * TRIALS))

    def acceptance(self, delta, K):
        return grs_acceptance(delta, K)
