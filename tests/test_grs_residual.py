"""The GRS residual samplers (``specforest.residuals``): the fixed-cost inversion's accuracy, law
and cost, and the draw the sampler makes (rejection trials, then the inversion): its law and contract.

The accuracy reference is mpmath at 50 digits, not the 80-step bisection the
sampler replaces: that bisection inverts ``H(s) = u G`` with ``grs_levels``' ``G``
and a tail mass that both lose up to ~1e-9 relative for small ``delta``, and
forms ``G - H`` near ``tau``. Measured against mpmath it is off by up to ~2e5
times the tolerance ``1e-10 (1 + |s|)`` for ``u`` near 1, and by up to ~10 times
it for ``delta < 1e-4``. It is kept below as a cross-check where it is accurate.
"""

import math

import numpy as np
import pytest
import torch
from scipy import stats as sps
from torch.utils._python_dispatch import TorchDispatchMode

from specforest import residuals
from specforest.couplings import grs_levels
from specforest.residuals import TRIALS, draw_grs_residual, log_sf, sample_grs_residual, tail_mass

DELTAS = [float(d) for d in np.logspace(-6.0, math.log10(12.0), 10)]
KS = list(range(1, 17))
US = [
    1e-300,
    1e-100,
    1e-20,
    1e-8,
    1e-3,
    0.05,
    0.3,
    0.5,
    0.7,
    0.9,
    0.9000000000000001,
    0.97,
    0.999,
    1 - 1e-6,
    1 - 1e-10,
    1 - 1e-15,
    1 - 2**-53,
    1.0,
]


def _tol(s: torch.Tensor) -> torch.Tensor:
    return 1e-10 * (1.0 + s.abs())


def _grid() -> tuple[torch.Tensor, ...]:
    """``delta``, ``lam = lambda_K``, ``G = G_{K+1}`` and ``u`` on the accuracy grid, flattened."""
    rows = []
    for d in DELTAS:
        lam, G = grs_levels(torch.tensor(d, dtype=torch.float64), KS[-1])
        rows += [(d, float(lam[K]), float(G[K]), u) for K in KS for u in US]
    return tuple(torch.tensor(col, dtype=torch.float64) for col in zip(*rows, strict=True))


def _tau(delta: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    return torch.log(lam) / delta + delta / 2


def _bisection_reference(delta, lam, G, u):
    """The sampler this module replaces: 80 bisection steps on the plain tail formula."""
    log_lam = torch.log(lam)

    def log_tail(s):
        a = log_sf(s - delta)
        return a + torch.log(-torch.expm1((log_lam + log_sf(s) - a).clamp(max=0.0)))

    lo = log_lam / delta + delta / 2.0
    log_target = torch.log(u) + torch.log(G)
    hi = torch.maximum(delta - torch.special.ndtri(torch.exp(log_target)), lo)
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        above = log_tail(mid) > log_target
        lo = torch.where(above, mid, lo)
        hi = torch.where(above, hi, mid)
    return 0.5 * (lo + hi)


# -- accuracy ---------------------------------------------------------------------------------


def _mp_sf(mp, x):
    return mp.erfc(x / mp.sqrt(2)) / 2


def _mp_excess(mp, x, delta, lam, G, u):
    """``1 - H(x) / G - (1 - u)`` in mpmath: increasing in ``x``, zero at the root. Each form
    subtracts on the side where the difference is not small, so 50 digits are plenty."""
    H = _mp_sf(mp, x - delta) - lam * _mp_sf(mp, x)
    return u - H / G if u <= 0.5 else (G - H) / G - (1 - u)


def test_draws_are_within_tolerance_of_a_high_precision_root():
    """The exact root lies in [max(tau, s - tol), s + tol], checked by the sign of a monotone
    function at both ends in 50-digit arithmetic, over the whole (delta, K, u) grid."""
    mp = pytest.importorskip("mpmath")
    delta, lam, G, u = _grid()
    s = sample_grs_residual(delta, lam, G, u)
    assert torch.isfinite(s).all()
    assert (s >= _tau(delta, lam)).all()
    tol = _tol(s)
    bad = []
    levels = {}
    with mp.workdps(50):
        for d, lam_k, u_i, s_i, tol_i in zip(
            delta.tolist(), lam.tolist(), u.tolist(), s.tolist(), tol.tolist(), strict=True
        ):
            if (d, lam_k) not in levels:
                d_mp, lam_mp = mp.mpf(d), mp.mpf(lam_k)
                tau = mp.log(lam_mp) / d_mp + d_mp / 2
                levels[d, lam_k] = (d_mp, lam_mp, tau, _mp_sf(mp, tau - d_mp) - lam_mp * _mp_sf(mp, tau))
            d_mp, lam_mp, tau, G_mp = levels[d, lam_k]
            u_mp = mp.mpf(u_i)
            lo = max(tau, mp.mpf(s_i) - mp.mpf(tol_i))
            hi = mp.mpf(s_i) + mp.mpf(tol_i)
            if not _mp_excess(mp, lo, d_mp, lam_mp, G_mp, u_mp) <= 0 <= _mp_excess(mp, hi, d_mp, lam_mp, G_mp, u_mp):
                bad.append((d, lam_k, u_i, s_i))
    assert not bad, f"{len(bad)} draws off by more than 1e-10 (1 + |s|), e.g. {bad[:3]}"


def test_u_one_gives_tau_exactly():
    delta, lam, G, u = _grid()
    one = u == 1.0
    s = sample_grs_residual(delta[one], lam[one], G[one], u[one])
    assert torch.equal(s, _tau(delta[one], lam[one]))


def test_agrees_with_the_bisection_it_replaces_where_that_is_accurate():
    delta, lam, G, u = _grid()
    keep = (delta >= 1e-2) & (u <= 0.9)
    delta, lam, G, u = delta[keep], lam[keep], G[keep], u[keep]
    s = sample_grs_residual(delta, lam, G, u)
    assert ((s - _bisection_reference(delta, lam, G, u)).abs() <= _tol(s)).all()


def test_tail_mass_is_the_plain_formula_for_large_delta_and_exact_for_small():
    mp = pytest.importorskip("mpmath")
    s = torch.tensor([0.3, 1.0, 2.5, 8.0, 37.0], dtype=torch.float64)
    for d in [1e-2, 0.3, 4.0]:
        delta = torch.tensor(d, dtype=torch.float64)
        log_lam = torch.full_like(s, 0.01)
        a = log_sf(s - delta)
        plain = a + torch.log(-torch.expm1((log_lam + log_sf(s) - a).clamp(max=0.0)))
        assert torch.equal(tail_mass(s, delta, log_lam), plain)
    with mp.workdps(50):
        for d in [1e-6, 1e-4, 3e-3]:
            lam = 1.0 + 0.7 * d
            tau = math.log(lam) / d + d / 2
            x = torch.tensor([tau, tau + 1e-3, tau + 1.0, tau + 5.0, 30.0], dtype=torch.float64)
            got = tail_mass(x, d, torch.full_like(x, math.log(lam)))
            for x_i, got_i in zip(x.tolist(), got.tolist(), strict=True):
                H = _mp_sf(mp, mp.mpf(x_i) - mp.mpf(d)) - mp.mpf(lam) * _mp_sf(mp, mp.mpf(x_i))
                assert abs(got_i - float(mp.log(H))) < 1e-12


# -- the law ----------------------------------------------------------------------------------

KS_CASES = [(d, K) for d in (1e-3, 0.5, 2.0, 6.0) for K in (1, 2, 7)]
SEEDS = {case: 1000 + i for i, case in enumerate(KS_CASES)}
N_DRAWS = 100_000


def _residual_draws(sampler, delta: float, K: int, seed: int):
    lam, G = grs_levels(torch.tensor([delta], dtype=torch.float64), K)
    u = 1.0 - torch.rand(N_DRAWS, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    d = torch.full((N_DRAWS,), delta, dtype=torch.float64)
    s = sampler(d, lam[:, K].expand(N_DRAWS), G[:, K].expand(N_DRAWS), u)
    lam_k = float(lam[0, K])
    tau = math.log(lam_k) / delta + delta / 2

    def H(x):
        return sps.norm.sf(x - delta) - lam_k * sps.norm.sf(x)

    G_tau = H(tau)
    return s.numpy(), (lambda x: 1.0 - H(x) / G_tau)


def _centred_threshold(delta, lam, G, u):
    """ERRATA 2 broken: the residual's threshold taken as ln(lam)/delta, the centred coordinate's."""
    return sample_grs_residual(delta, lam, G, u) - delta / 2


def _no_lam_term(delta, lam, G, u):
    """The residual with its -lam p term dropped: q truncated to s > tau."""
    tau = torch.log(lam) / delta + delta / 2
    return delta - torch.special.ndtri(u * torch.exp(log_sf(tau - delta)))


@pytest.mark.parametrize("delta,K", KS_CASES)
def test_draws_follow_the_closed_form_residual_law(delta, K):
    s, cdf = _residual_draws(sample_grs_residual, delta, K, SEEDS[delta, K])
    assert sps.kstest(s, cdf).pvalue > 1e-4


@pytest.mark.parametrize(
    "wrong,delta,K",
    [(_centred_threshold, d, K) for d in (0.5, 2.0, 6.0) for K in (1, 2, 7)]
    + [(_no_lam_term, d, K) for d in (1e-3, 0.5, 2.0) for K in (1, 2, 7)],
)
def test_the_same_test_rejects_a_wrong_residual(wrong, delta, K):
    """Each case of the law test is failed by one of the two wrong samplers (the shift of
    the first is delta / 2, invisible at delta = 1e-3; the mass of the second's error is
    lam Phibar(tau), invisible at delta = 6)."""
    s, cdf = _residual_draws(wrong, delta, K, SEEDS[delta, K])
    assert sps.kstest(s, cdf).pvalue < 1e-4


# -- the sampler's draw: trials, then the inversion -------------------------------------------

# the cases of the law test, and 0.1 with K = 2 (M = 15: a third of the draws fall back on the inversion)
DRAW_CASES = KS_CASES + [(0.1, 2)]


def _trial_uniforms(n_trials: int, seed: int, N: int = N_DRAWS) -> torch.Tensor:
    return 1.0 - torch.rand(N, 1 + 2 * n_trials, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _draw_with(u: torch.Tensor):
    """``draw_grs_residual`` with the uniforms ``u`` (the inversion's ``u_0`` comes from ``_residual_draws``)."""

    def sampler(delta, lam, G, u0):
        return draw_grs_residual(delta, lam, G, torch.cat([u0[:, None], u[:, 1:]], 1))

    return sampler


@pytest.mark.parametrize("n_trials", [TRIALS, 1])
@pytest.mark.parametrize("delta,K", DRAW_CASES)
def test_the_sampler_s_draw_follows_the_closed_form_residual_law(delta, K, n_trials):
    """Trials where the envelope is tight, the inversion where it is not or every trial failed:
    the mixture must be the residual law. One trial leaves many draws to the inversion."""
    u = _trial_uniforms(n_trials, SEEDS.get((delta, K), 7) + 500)
    s, cdf = _residual_draws(_draw_with(u), delta, K, SEEDS.get((delta, K), 7))
    assert sps.kstest(s, cdf).pvalue > 1e-4


@pytest.mark.parametrize("delta,K", [(0.1, 2), (0.5, 2), (2.0, 7)])
def test_the_trials_give_most_draws_where_the_envelope_is_tight(delta, K):
    """The law test above covers both paths: where ``M = Phibar(tau - delta) / G`` is small the trials
    give (nearly) every draw, at ``M = 15`` some fall back; a trial is never returned below ``tau``."""
    lam, G = grs_levels(torch.tensor([delta], dtype=torch.float64), K)
    N = 20_000
    u = _trial_uniforms(TRIALS, 3, N)
    d = torch.full((N,), delta, dtype=torch.float64)
    args = (d, lam[:, K].expand(N), G[:, K].expand(N))
    s = draw_grs_residual(*args, u)
    by_inversion = s == sample_grs_residual(*args, u[:, 0])
    share = float(by_inversion.double().mean())
    assert (share > 0.2) if delta == 0.1 else (share < 0.02), share
    assert (s >= _tau(d, lam[:, K])).all()


@pytest.mark.parametrize("delta,K", [(0.5, 2), (2.0, 2), (2.0, 7)])
def test_the_same_test_rejects_trials_that_keep_every_candidate(delta, K):
    """Test uniforms of 0 keep the first candidate always: the truncated normal, not the residual."""
    u = _trial_uniforms(TRIALS, SEEDS[delta, K] + 500)
    u[:, 1 + TRIALS :] = 0.0
    s, cdf = _residual_draws(_draw_with(u), delta, K, SEEDS[delta, K])
    assert sps.kstest(s, cdf).pvalue < 1e-4


def test_the_sampler_s_draw_does_not_depend_on_its_batch_or_skipped_paths(monkeypatch):
    delta, lam, G, _ = _grid()
    delta = delta.clamp_min(1e-6)
    u = _trial_uniforms(TRIALS, 11, len(delta))
    s = draw_grs_residual(delta, lam, G, u)
    idx = range(0, len(u), 7)
    alone = torch.stack(
        [draw_grs_residual(delta[i : i + 1], lam[i : i + 1], G[i : i + 1], u[i : i + 1])[0] for i in idx]
    )
    assert torch.equal(alone, s[::7])
    assert torch.isfinite(s).all() and (s >= _tau(delta, lam)).all()
    # off the CPU both paths are computed for every draw: the same numbers
    monkeypatch.setattr(residuals, "_needed", lambda mask: True)
    assert torch.equal(draw_grs_residual(delta, lam, G, u), s)


def test_the_sampler_s_draw_is_a_fixed_number_of_ops_without_synchronization(monkeypatch):
    monkeypatch.setattr(residuals, "_needed", lambda mask: True)
    delta, lam, G, _ = _grid()
    counts = []
    for P in (1, 64):
        log = _OpLog()
        with log:
            draw_grs_residual(delta[:P], lam[:P], G[:P], _trial_uniforms(TRIALS, 0, P))
        assert not {str(op) for op in log.ops} & {"aten._local_scalar_dense.default", "aten.nonzero.default"}
        counts.append(len(log.ops))
    assert counts[0] == counts[1], counts


def test_the_sampler_s_draw_checks_its_arguments():
    d = torch.ones(3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"u must be a \(P, 1 \+ 2 n\) tensor"):
        draw_grs_residual(d, d, d, d)
    with pytest.raises(ValueError, match="u \\(3, 2\\)"):
        draw_grs_residual(d, d, d, torch.ones(3, 2, dtype=torch.float64))
    with pytest.raises(TypeError, match="u must be float64"):
        draw_grs_residual(d, d, d, torch.ones(3, 3))


# -- cost and contract ------------------------------------------------------------------------


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_cost_is_a_fixed_number_of_ops_without_synchronization(monkeypatch):
    # off the CPU every branch is computed (reading a mask would synchronize): the same path here
    monkeypatch.setattr(residuals, "_needed", lambda mask: True)
    delta, lam, G, u = _grid()
    sample_grs_residual(delta[:1], lam[:1], G[:1], u[:1])  # builds the cached quadrature rule
    counts = []
    for P in (1, 64, len(u)):
        args = (delta[:P], lam[:P], G[:P], u[:P])
        log = _OpLog()
        with log:
            sample_grs_residual(*args)
        names = {str(op) for op in log.ops}
        assert not names & {
            "aten._local_scalar_dense.default",
            "aten.item.default",
            "aten.nonzero.default",
            "aten.is_nonzero.default",
        }
        counts.append(len(log.ops))
    assert len(set(counts)) == 1 and counts[0] <= 240, counts


def test_skipping_branches_on_the_cpu_changes_no_bit(monkeypatch):
    """On the CPU the branches no draw takes are skipped; every draw equals the all-branches path's."""
    delta, lam, G, u = _grid()
    skipped = sample_grs_residual(delta, lam, G, u)
    one_by_one = torch.cat([sample_grs_residual(*(t[i : i + 1] for t in (delta, lam, G, u))) for i in range(len(u))])
    levels = grs_levels(delta, 3)
    monkeypatch.setattr(residuals, "_needed", lambda mask: True)
    assert torch.equal(sample_grs_residual(delta, lam, G, u), skipped)
    assert torch.equal(one_by_one, skipped)
    assert all(torch.equal(a, b) for a, b in zip(grs_levels(delta, 3), levels, strict=True))


def test_a_draw_does_not_depend_on_its_batch():
    delta, lam, G, u = _grid()
    s = sample_grs_residual(delta, lam, G, u)
    idx = range(0, len(u), 11)
    alone = torch.stack(
        [sample_grs_residual(delta[i : i + 1], lam[i : i + 1], G[i : i + 1], u[i : i + 1])[0] for i in idx]
    )
    assert torch.equal(alone, s[::11])


def test_arguments_are_checked():
    d = torch.ones(3, dtype=torch.float64)
    with pytest.raises(TypeError, match="u must be float64"):
        sample_grs_residual(d, d, d, d.float())
    with pytest.raises(TypeError, match="delta must be a torch.Tensor"):
        sample_grs_residual(1.0, d, d, d)
    with pytest.raises(ValueError, match="broadcastable"):
        sample_grs_residual(d, d, d, torch.ones(2, dtype=torch.float64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    delta, lam, G, u = _grid()
    s = sample_grs_residual(delta, lam, G, u)
    s_cuda = sample_grs_residual(delta.cuda(), lam.cuda(), G.cuda(), u.cuda()).cpu()
    assert ((s_cuda - s).abs() <= _tol(s)).all()
    assert (s_cuda >= _tau(delta, lam)).all()
