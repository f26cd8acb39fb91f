"""Unit tests of the pieces of exactness that the end-to-end batteries resolve too weakly.

The coupling battery (``tests/test_couplings.py``) and the whole-chain law tests compare a rule with
the library's own closed forms at a few hundred thousand draws, so a bug in a closed form, or a law
error below about 1 %, goes through them. Each test here checks one piece against a reference
computed from scratch in the test (scipy quadrature and root finding, the paper's formulas), or
against fixed uniforms, and each kills one mutant of ``mutants/`` on its own (``make mutants``):

* ``grs_levels``: GRS's levels and remaining masses against the recursion (ERRATA 1) by quadrature;
* ``GRS.residual``: its draws against the residual's CDF, with the levels from scratch;
* the drafted children's noise scale (``engine.tree_steps``, ``walk.OnDemand.level``): a recorded
  child minus its parent's draft mean, over the transition's scale, is ``N(0, I)``, full and lazy;
* ``lists._pick_by_rule``: fixed uniforms on either side of each rank's boundary pick that rank;
* ``RMC.select``: acceptance is exactly ``u <= min(1, rho(s))`` at fixed uniforms.

Statistical thresholds are the suite's: ``|z| <= testing.Z_TOL`` and KS ``p >= testing.P_TOL``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, optimize, stats

import specforest
from specforest import testing, trees
from specforest.couplings import GRS, RMC, grs_acceptance, grs_levels
from specforest.couplings.lists import _pick_by_rule
from specforest.proposals import Proposal
from specforest.rank_rules import EDGES, n_cells
from specforest.streams import Stream

# -- GRS's levels ------------------------------------------------------------------------------------


def reference_levels(delta: float, K: int) -> tuple[list[float], list[float], list[float]]:
    """GRS's levels from the definition (ERRATA 1), by root finding and quadrature.

    ``lambda_0 = 0``, ``G_1 = 1``; ``lambda_k = lambda_{k-1} + G_k``; ``tau_k`` solves
    ``q(s) = lambda_k p(s)`` for ``p = N(0, 1)``, ``q = N(delta, 1)``, and the remaining mass is
    ``G_{k+1} = int (q - lambda_k p)_+ = int_{tau_k}^inf (q - lambda_k p)``.

    Returns:
        ``lam`` (``lambda_0 .. lambda_K``), ``G`` (``G_1 .. G_{K+1}``) and ``tau`` (``tau_1 .. tau_K``).
    """
    lam, G, tau = [0.0], [1.0], []
    for _ in range(K):
        lam_k = lam[-1] + G[-1]
        t = optimize.brentq(
            lambda s, lk=lam_k: stats.norm.logpdf(s, loc=delta) - stats.norm.logpdf(s) - math.log(lk),
            -60.0,
            60.0,
            xtol=1e-14,
            rtol=1e-15,
        )
        g, _ = integrate.quad(
            lambda s, lk=lam_k: stats.norm.pdf(s, loc=delta) - lk * stats.norm.pdf(s),
            t,
            np.inf,
            epsabs=0.0,
            epsrel=1e-12,
            limit=200,
        )
        lam.append(lam_k)
        G.append(g)
        tau.append(t)
    return lam, G, tau


LEVEL_CASES = [(delta, 6) for delta in (0.05, 0.1, 0.5, 1.0, 2.0, 3.0)]


@pytest.mark.parametrize("delta,K", LEVEL_CASES)
def test_grs_levels_and_acceptance_match_the_recursion_by_quadrature(delta, K):
    """``grs_levels`` and ``grs_acceptance`` against :func:`reference_levels` (relative error
    1e-9, far above the 2e-14 measured and far below what a wrong recursion moves: levels
    ``lambda_k = lambda_{k-1} + 0.98 G_k`` move ``lambda_2`` by 2 % of ``G_2``, 4e-4 of it at
    ``delta = 0.1``), and each level's step is the mass before it, ``lambda_k - lambda_{k-1} = G_k``."""
    lam_ref, G_ref, _ = reference_levels(delta, K)
    lam, G = grs_levels(torch.tensor([delta], dtype=torch.float64), K)
    np.testing.assert_allclose(lam[0].numpy(), lam_ref, rtol=1e-9, atol=0.0)
    np.testing.assert_allclose(G[0].numpy(), G_ref, rtol=1e-9, atol=1e-15)
    # tensor column k - 1 of G holds G_k
    np.testing.assert_allclose((lam[0, 1:] - lam[0, :-1]).numpy(), G[0, :-1].numpy(), rtol=1e-12, atol=0.0)
    for k in range(1, K + 1):
        acc = float(grs_acceptance(torch.tensor(delta, dtype=torch.float64), k))
        assert acc == pytest.approx(1.0 - G_ref[k], rel=1e-9, abs=1e-15), (k, acc, 1.0 - G_ref[k])


# -- GRS's residual ----------------------------------------------------------------------------------


def residual_sf(s: np.ndarray, delta: float, lam: float, G: float, tau: float) -> np.ndarray:
    """Survival function of the residual ``(q - lam p)_+ / G``, supported on ``s >= tau``."""
    s = np.maximum(s, tau)
    return (stats.norm.sf(s - delta) - lam * stats.norm.sf(s)) / G


@pytest.mark.parametrize("delta,K", [(0.1, 1), (0.05, 1), (1.0, 3)])
def test_grs_residual_draws_have_the_residual_law(delta, K):
    """``GRS().residual`` on ``n`` problems of ``K`` valid children: its draws against the CDF of
    ``(q - lambda_K p)_+ / G_{K+1}`` with the levels from scratch (KS ``p >= P_TOL``).

    Only the draws that fall back to the inversion read ``G``. With ``K = 1`` the rejection trials
    fail for 28 % of the draws at ``delta = 0.1`` and are not tried at ``0.05`` (their envelope's
    mass is over 16), so a residual normalised with ``G_K`` instead of ``G_{K+1}`` fails with
    ``p = 0`` in float64. Calling the residual directly gives every problem a residual draw; in the
    sampler one is drawn only after a rejection, about 4 % of the problems at ``delta = 0.1``."""
    n = 20_000
    lam_ref, G_ref, tau_ref = reference_levels(delta, K)
    s_hat = torch.randn(n, K, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    valid = torch.ones(n, K, dtype=torch.bool)
    rng = Stream.from_generator(n, torch.Generator().manual_seed(6), "cpu")
    d = torch.full((n,), delta, dtype=torch.float64)
    draws = GRS().residual(s_hat, d, valid, torch.zeros(n, dtype=torch.long), rng).numpy()
    lam, G, tau = lam_ref[K], G_ref[K], tau_ref[K - 1]
    assert np.isfinite(draws).all() and draws.min() >= tau - 1e-9
    p = stats.kstest(draws, lambda s: 1.0 - residual_sf(s, delta, lam, G, tau)).pvalue
    assert p >= testing.P_TOL, (delta, K, p)


# -- the drafted children's noise scale --------------------------------------------------------------


def zero_velocity(x: torch.Tensor, sigma: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """A target whose transition mean is ``a y`` at every step: a draft can match it exactly."""
    return torch.zeros_like(x)


class RecordingExactDraft(Proposal):
    """The target's own transition mean (``delta = 0``, so every drafted child is accepted and a
    lazy walk visits the same children as the full tree), recording each call's parents, their
    steps and trajectories, and the means it returns."""

    needs_prefetch = False
    name = "recording-exact"

    def __init__(self) -> None:
        self.calls: list = []

    def mean(self, tab, y, steps, pre, cond, shape, state):
        m = tab.mean(y, torch.zeros_like(y), steps)
        self.calls.append((cond["row"].clone(), steps.clone(), y.clone(), m.clone()))
        return m


def transition_scales(steps: int, churn: float) -> np.ndarray:
    """``(T,)`` transition std of eq. (37) on the uniform grid ``sigma_n = 1 - n / T``:
    ``eps sqrt(2 gamma_n sigma_n / (1 - sigma_n))``, 0 on the first and last (deterministic) steps."""
    s = 1.0 - np.arange(steps + 1) / steps
    out = np.zeros(steps)
    for n in range(1, steps - 1):
        gamma = s[n] - s[n + 1]
        out[n] = churn * math.sqrt(2.0 * gamma * s[n] / (1.0 - s[n]))
    return out


@pytest.mark.parametrize("lazy", [False, True], ids=["full", "lazy"])
def test_drafted_children_are_the_draft_mean_plus_the_transition_scale_times_standard_noise(lazy):
    """Every drafted child ``Y`` of a parent at step ``n`` with draft mean ``m`` satisfies
    ``(Y - m) / scale_n ~ N(0, I)`` with ``scale_n`` from eq. (37), in full and lazy mode.

    The draft is exact (``delta = 0``), so every child is accepted and becomes the parent of the
    next draft call, which records it; the records of (trajectory, step ``n``) and (trajectory,
    ``n + 1``) give a child and its parent's mean. The coupling reads the standard noise, not the
    child, so a child drafted with a wrong scale keeps every acceptance test and the lazy = full
    identity. Here 1024 trajectories x 5 steps x 24 coordinates = 122,880 values make a scale 1.02
    times too large a variance z-score of 10 (9.8 measured); the mean and KS tests catch a shifted
    or non-Gaussian child."""
    steps, churn, D, N = 8, 0.7, 24, 1024
    draft = RecordingExactDraft()
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    rows = torch.arange(N)
    specforest.sample(
        zero_velocity,
        x,
        steps=steps,
        churn=churn,
        grid="uniform",
        tree=trees.chain(3),
        coupling="rmc",
        draft=draft,
        lazy=lazy,
        cond={"row": rows},
        seed=4,
    )
    at: dict = {}
    for row, st, y, m in draft.calls:
        assert st.shape[1] == 1, "a chain has one parent a call"
        for r, s, yy, mm in zip(row.tolist(), st[:, 0].tolist(), y[:, 0], m[:, 0], strict=True):
            assert (r, s) not in at, f"trajectory {r} drafted from step {s} twice: a child was rejected"
            at[r, s] = (yy, mm)
    scale = transition_scales(steps, churn)
    z = [(at[r, s + 1][0] - mm) / scale[s] for (r, s), (_, mm) in at.items() if (r, s + 1) in at]
    z = torch.stack(z).reshape(-1).double()
    # every stochastic step but the last drafts a child that is drafted from again
    assert z.numel() == N * (steps - 3) * D
    n = z.numel()
    mean_z = float(z.mean()) / math.sqrt(1.0 / n)
    var_z = (float(z.var()) - 1.0) / math.sqrt(2.0 / (n - 1))
    p = stats.kstest(z.numpy(), "norm").pvalue
    assert abs(mean_z) <= testing.Z_TOL, mean_z
    assert abs(var_z) <= testing.Z_TOL, var_z
    assert p >= testing.P_TOL, p


# -- the rank rules' choice --------------------------------------------------------------------------


@pytest.mark.parametrize("base,M", [("normal", 4), ("normal", 7), ("halfnormal", 3)])
def test_pick_by_rule_takes_the_rank_whose_cumulative_weight_interval_holds_u(base, M):
    """``_pick_by_rule`` at fixed uniforms just below and just above each boundary of the
    cumulative weights of the cell of the maximum: the rank on each side, mapped to the child
    holding the ``j``-th smallest value, exactly. The uniforms are 1e-9 from the boundaries, so
    weights moved by more than that (a 2 % tilt moves the boundaries by 1e-3 and more) change
    some pick."""
    P = 600
    g = torch.Generator().manual_seed(11)
    values = torch.randn(P, M, generator=g, dtype=torch.float64)
    if base == "halfnormal":
        values = values.abs()
    C = n_cells(base)
    W = torch.rand(P, C, M, generator=g, dtype=torch.float64) + 0.05
    W = W / W.sum(-1, keepdim=True)
    # the cell of the maximum: the number of interior edges at or below it
    cell = np.searchsorted(EDGES[base].numpy(), values.max(1).values.numpy(), side="right")
    assert len(set(cell.tolist())) > 1, "the rows' maxima should fall in several cells"
    w = W[torch.arange(P), torch.from_numpy(cell)]
    bounds = torch.cumsum(w, 1)[:, :-1]  # (P, M - 1) the boundaries between ranks
    order = np.argsort(values.numpy(), axis=1)
    for j in range(M - 1):
        for side, rank in ((-1e-9, j), (1e-9, j + 1)):
            u = bounds[:, j] + side
            got = _pick_by_rule(values, W, base, u).numpy()
            np.testing.assert_array_equal(got, order[:, rank], err_msg=f"rank {rank}, u {side:+g} from a boundary")


# -- RMC's acceptance --------------------------------------------------------------------------------


def test_rmc_select_accepts_exactly_when_u_is_at_most_min_1_rho():
    """``RMC.select`` at fixed uniforms against ``u <= min(1, rho(s))``, ``rho(s) = exp(delta s -
    delta^2 / 2)``: uniforms 0.5 % below and above ``rho`` on either side of the threshold, and a grid,
    at each (s, delta) of a grid. A rule accepting with ``min(1, 1.01 rho)`` accepts the rows 0.5 %
    above."""
    s = torch.linspace(-3.0, 3.0, 41, dtype=torch.float64)
    delta = torch.tensor([0.01, 0.3, 1.0, 2.5], dtype=torch.float64)
    rel = torch.tensor([0.995, 1.005], dtype=torch.float64)
    grid_u = torch.tensor([0.01, 0.2, 0.5, 0.9, 0.999], dtype=torch.float64)
    S, Dl = torch.meshgrid(s, delta, indexing="ij")
    S, Dl = S.reshape(-1), Dl.reshape(-1)
    rho = torch.exp(Dl * S - 0.5 * Dl * Dl)
    near = (rho[:, None] * rel).clamp(max=1.0 - 1e-12)
    u = torch.cat([near, grid_u.expand(rho.numel(), -1)], 1)  # (n, 7) uniforms for each (s, delta)
    n_u = u.shape[1]
    S, Dl, rho, u = S.repeat_interleave(n_u), Dl.repeat_interleave(n_u), rho.repeat_interleave(n_u), u.reshape(-1)
    P = u.numel()
    rng = Stream(torch.arange(P), drawn=u[:, None], layout=((0, 1),))
    accepted, index = RMC().select(S[:, None], Dl, torch.ones(P, 1, dtype=torch.bool), rng)
    expected = u <= torch.clamp(rho, max=1.0)
    assert torch.equal(index, torch.zeros(P, dtype=torch.long))
    # both outcomes at the threshold occur, so the comparison is not vacuous
    assert 0 < int(expected.sum()) < P
    assert torch.equal(accepted, expected), int((accepted != expected).sum())
