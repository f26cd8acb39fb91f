"""The shared exactness battery: every coupling runs these checks.

A coupling is exact if, for children drawn i.i.d. from ``P = N(mu_p, s^2 I)``,
its output has law ``Q = N(mu_q, s^2 I)``. In the rank-1 coordinates
(``e`` the unit mean displacement) that means: the projection
``e.(Y - mu_p)/s`` is ``N(delta, 1)``, the orthogonal part is
``N(0, I - e e^T)`` and independent of the projection. The acceptance rate is
checked against the rule's own closed form.

Tolerances come from standard errors: z-scores against 4.5 (mean/variance/
acceptance), KS p-values against 1e-4, with fixed seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from scipy import stats as sps

Z_TOL = 4.5
P_TOL = 1e-4


@dataclass
class Report:
    ks_p: float  # projection vs N(delta, 1)
    accept: float
    accept_expected: float
    accept_z: float
    perp_mean_z: float  # worst |z| of the orthogonal coordinates' means
    perp_norm_z: float  # z of E|Z_perp|^2 against d - 1
    corr_z: float  # worst |z| of corr(projection, orthogonal coordinate)

    def failures(self) -> list[str]:
        out = []
        if self.ks_p < P_TOL:
            out.append(f"projection KS p={self.ks_p:.2e}")
        if abs(self.accept_z) > Z_TOL:
            out.append(f"acceptance {self.accept:.5f} vs {self.accept_expected:.5f} (z={self.accept_z:.1f})")
        if self.perp_mean_z > Z_TOL:
            out.append(f"orthogonal mean z={self.perp_mean_z:.1f}")
        if abs(self.perp_norm_z) > Z_TOL:
            out.append(f"orthogonal norm z={self.perp_norm_z:.1f}")
        if self.corr_z > Z_TOL:
            out.append(f"projection/orthogonal correlation z={self.corr_z:.1f}")
        return out


def run_battery(coupling, delta: float, K: int, d: int, n: int = 100_000, seed: int = 0) -> Report:
    """Draw ``n`` problems with children from P and test the coupled outputs."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn(d, generator=g, dtype=torch.float64)
    direction /= direction.norm()
    scale = 0.37
    mu_p = torch.randn(d, generator=g, dtype=torch.float64)
    mu_q = mu_p + delta * scale * direction
    # children in float32, as the sampler's states usually are; the coupling's
    # scalar arithmetic runs in float64 regardless
    noise = coupling.structure_noise(torch.randn(n, K, d, generator=g, dtype=torch.float32))
    children = (mu_p.float() + float(scale) * noise)
    res = coupling(
        mu_p.float().expand(n, d), mu_q.float().expand(n, d), torch.full((n,), scale, dtype=torch.float64),
        children, torch.ones(n, K, dtype=torch.bool), g,
    )
    z = (res.state.double() - mu_p) / scale
    s = z @ direction
    perp = z - s[:, None] * direction
    ks_p = sps.kstest((s - delta).numpy(), "norm").pvalue
    expected = float(coupling.acceptance(torch.tensor(delta, dtype=torch.float64), K))
    k = int(res.accepted.sum())
    sd = math.sqrt(max(n * expected * (1 - expected), 0.0))
    # one count of slack so that a probability within 1/n of 0 or 1 is testable
    accept_z = 0.0 if abs(k - n * expected) <= 1 else (k - n * expected) / max(sd, 1e-12)
    # orthogonal coordinates in a basis orthogonal to e: project on a few random unit vectors
    basis = torch.randn(d, min(d - 1, 8), generator=g, dtype=torch.float64) if d > 1 else None
    perp_mean_z = corr_z = perp_norm_z = 0.0
    if basis is not None:
        basis -= direction[:, None] * (direction @ basis)[None]
        basis /= basis.norm(dim=0, keepdim=True)
        c = perp @ basis  # (n, m), each N(0, 1) if exact
        perp_mean_z = float((c.mean(0) / (c.std(0) / math.sqrt(n))).abs().max())
        sc = (s - s.mean()) / s.std()
        corr = (sc[:, None] * (c - c.mean(0)) / c.std(0)).mean(0)
        corr_z = float((corr * math.sqrt(n)).abs().max())
        sq = perp.square().sum(1)
        perp_norm_z = float((sq.mean() - (d - 1)) / math.sqrt(2 * (d - 1) / n))
    return Report(ks_p, k / n, expected, accept_z, perp_mean_z, perp_norm_z, corr_z)
