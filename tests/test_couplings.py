"""Exactness and acceptance of every coupling, and closed forms (Theorem 2)."""

import math

import pytest
import torch
from scipy import integrate
from scipy import stats as sps

from specforest.couplings import (
    GRS,
    RMC,
    AntitheticCoupling,
    RankCoupling,
    available_couplings,
    get_coupling,
    grs_acceptance,
    grs_levels,
    rmc_acceptance,
    sample_grs_residual,
)
from specforest.rank_rules import log_rule_pdf, n_cells, table_rule
from specforest.testing import P_TOL, Z_TOL, _ks_normal_p
from specforest.testing import run_case as run_battery

DELTAS = [0.0, 1e-6, 0.5, 1.0, 2.0, 4.0, 8.0]
DIMS = [1, 3, 64]
# the fast tier's covering subset: every coupling at every K, in one dimension, at a few deltas
# (equality, a moderate and a large mismatch); the other dimensions and deltas are slow
FAST_DIM, FAST_DELTAS = 3, (0.0, 1.0, 4.0)

# Every coupling and the K it supports: a new coupling adds one line here and
# inherits the whole battery.
COUPLINGS = [(RMC, [1]), (GRS, [1, 2, 3, 7]), (RankCoupling, [1, 2, 3, 7]), (AntitheticCoupling, [2, 4])]
CASES = [
    pytest.param(cls, K, delta, d, marks=() if d == FAST_DIM and delta in FAST_DELTAS else pytest.mark.slow)
    for cls, ks in COUPLINGS
    for K in ks
    for delta in DELTAS
    for d in DIMS
]


class UnfixedGRS(GRS):
    """Algorithm 3 as printed: the projection S_k in beta's denominator (ERRATA 1)."""

    def acceptance_weights(self, rho, lam_prev, G, s_hat):
        excess = (rho - lam_prev).clamp_min(0.0)
        return (excess / s_hat).clamp(max=1.0)


class NoResidualGRS(GRS):
    """Keeps the first child's projection on rejection instead of sampling the residual."""

    def residual(self, s_hat, delta, valid, index, rng):
        return s_hat[:, 0]


class WrongThresholdGRS(GRS):
    """Samples the residual above ln(lambda)/delta (the centred-coordinate threshold, ERRATA 2)."""

    def residual(self, s_hat, delta, valid, index, rng):
        return super().residual(s_hat, delta, valid, index, rng) - delta / 2


class MinDensityRank(RankCoupling):
    """Selects by the rank rule but tests acceptance against the minimum's density."""

    def choose(self, s_hat, delta, valid, rng):
        index, _ = super().choose(s_hat, delta, valid, rng)
        K = s_hat.shape[1]
        W = torch.zeros(n_cells("normal"), K, dtype=torch.float64)
        W[:, 0] = 1.0

        def log_f(s, rows):
            return log_rule_pdf(s, W, K)

        return index, log_f


class CellBlindRank(RankCoupling):
    """Selects by the max-conditioned rule but tests acceptance as if the weights
    did not depend on the maximum's cell (the cell-averaged weights)."""

    def choose(self, s_hat, delta, valid, rng):
        index, _ = super().choose(s_hat, delta, valid, rng)
        K = s_hat.shape[1]
        W = table_rule(delta, K).mean(1, keepdim=True).expand(-1, n_cells("normal"), -1)

        def log_f(s, rows):
            return log_rule_pdf(s, W[rows][:, None], K)

        return index, log_f


class GreedyAntithetic(AntitheticCoupling):
    """Always picks the positive member of the pair but keeps the randomized rule's density."""

    def choose(self, s_hat, delta, valid, rng):
        _, log_f = super().choose(s_hat, delta, valid, rng)
        return torch.where(s_hat[:, 0] >= 0, 0, 1), log_f


class IidAntithetic(AntitheticCoupling):
    """The antithetic rule fed i.i.d. children (its sibling structure switched off)."""

    def structure_noise(self, z):
        return z


@pytest.mark.parametrize("cls,K,delta,d", CASES, ids=lambda v: getattr(v, "__name__", repr(v)))
def test_coupling_exact_and_acceptance_matches_closed_form(cls, K, delta, d):
    rep = run_battery(cls(), delta, K, d, n=100_000, seed=hash((K, delta, d)) % 2**31)
    assert not rep.failures(), rep.failures()


@pytest.mark.parametrize(
    "broken", [UnfixedGRS, NoResidualGRS, WrongThresholdGRS, MinDensityRank, GreedyAntithetic, IidAntithetic]
)
def test_battery_rejects_broken_couplings(broken):
    failed = []
    for K in [2, 4] if issubclass(broken, AntitheticCoupling) else [2, 3]:
        for delta in [1.0, 2.0]:
            rep = run_battery(broken(), delta, K, 3, n=100_000, seed=7)
            failed.append(bool(rep.failures()))
    assert all(failed), "a deliberately broken coupling passed the exactness battery"


def test_battery_rejects_a_rank_rule_blind_to_the_maximum_cell():
    # where the table's weights differ across cells: K = 2 at delta = 0.5, K = 3 at delta = 1
    for K, delta in [(2, 0.5), (3, 1.0)]:
        W = table_rule(torch.tensor([delta], dtype=torch.float64), K)[0]
        assert float((W - W.mean(0)).abs().max()) > 0.2
        rep = run_battery(CellBlindRank(), delta, K, 3, n=100_000, seed=11)
        assert rep.failures(), f"a cell-blind density passed at K={K}, delta={delta}"


def test_antithetic_needs_even_children():
    with pytest.raises(ValueError, match="even number"):
        AntitheticCoupling().structure_noise(torch.zeros(4, 3, 2))
    with pytest.raises(ValueError, match="even number"):
        AntitheticCoupling().acceptance(1.0, 3)


def test_antithetic_pairs_mirror_and_keep_marginals():
    z = torch.randn(20_000, 4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = AntitheticCoupling().structure_noise(z)
    assert torch.equal(out[:, 1::2], -out[:, 0::2]) and torch.equal(out[:, 0::2], z[:, 0::2])
    # pairs are independent of each other: correlation of child 0 and child 2 is 0
    c = torch.corrcoef(torch.stack([out[:, 0, 0], out[:, 2, 0]]))[0, 1]
    assert abs(float(c)) < 4.5 / math.sqrt(20_000)


def test_rmc_closed_form_is_twice_survival_at_half_delta():
    d = torch.linspace(0, 10, 41, dtype=torch.float64)
    ref = torch.tensor([2 * sps.norm.sf(x / 2) for x in d.tolist()], dtype=torch.float64)
    assert torch.allclose(rmc_acceptance(d), ref, rtol=1e-12, atol=1e-300)
    assert torch.allclose(grs_acceptance(d, 1), ref, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("delta", [0.3, 1.0, 2.5, 6.0])
@pytest.mark.parametrize("K", [1, 2, 4, 8])
def test_grs_remaining_mass_matches_quadrature(delta, K):
    """G_{k+1} = int (rho - lambda_k)_+ dP (eq. 26), computed independently by quadrature."""
    lam, G = grs_levels(torch.tensor(delta, dtype=torch.float64), K)
    for k in range(1, K + 1):
        lk = float(lam[k])

        def f(s, lk=lk):
            return max(math.exp(delta * s - delta * delta / 2) - lk, 0.0) * sps.norm.pdf(s)

        ref, _ = integrate.quad(f, -40, 40, points=[math.log(lk) / delta + delta / 2], limit=200)
        assert float(G[k]) == pytest.approx(ref, rel=1e-8, abs=1e-14)


def test_grs_acceptance_increases_with_K_and_decreases_with_delta():
    d = torch.linspace(0.05, 6, 60, dtype=torch.float64)
    prev = grs_acceptance(d, 1)
    for K in [2, 3, 4, 8, 16]:
        cur = grs_acceptance(d, K)
        assert (cur >= prev - 1e-12).all()
        assert (cur[1:] <= cur[:-1] + 1e-12).all()
        prev = cur


@pytest.mark.parametrize("delta", [0.0, 1e-12, 1e-6, 1e-3, 10.0, 30.0, 60.0])
def test_closed_forms_finite_across_delta(delta):
    for K in [1, 2, 7, 32]:
        lam, G = grs_levels(torch.tensor(delta, dtype=torch.float64), K)
        assert torch.isfinite(lam).all() and torch.isfinite(G).all()
        assert ((G >= 0) & (G <= 1)).all()
        acc = float(grs_acceptance(torch.tensor(delta, dtype=torch.float64), K))
        assert 0.0 <= acc <= 1.0
    if delta > 0:
        # small delta: 1 - acceptance ~ delta * phi(0) for K = 1
        acc1 = float(grs_acceptance(torch.tensor(delta, dtype=torch.float64), 1))
        assert acc1 == pytest.approx(2 * sps.norm.sf(delta / 2), rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("delta", [1e-6, 0.2, 1.0, 3.0, 12.0])
@pytest.mark.parametrize("K", [1, 3])
def test_residual_sampler_matches_residual_law(delta, K):
    """KS against the residual CDF (Phi(s-d) - Phi(tau-d) - lam (Phi(s) - Phi(tau))) / G."""
    dd = torch.tensor([delta], dtype=torch.float64)
    lam, G = grs_levels(dd, K)
    lk, gk = float(lam[0, K]), float(G[0, K])
    n = 20_000
    u = 1.0 - torch.rand(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    s = sample_grs_residual(dd.expand(n), lam[:, K].expand(n), G[:, K].expand(n), u).numpy()
    tau = math.log(lk) / delta + delta / 2
    assert (s >= tau - 1e-9).all()

    def cdf(x):
        top = sps.norm.sf(tau - delta) - sps.norm.sf(x - delta) - lk * (sps.norm.sf(tau) - sps.norm.sf(x))
        return top / gk

    assert sps.kstest(s, cdf).pvalue > 1e-4


def test_residual_is_finite_for_extreme_uniforms():
    d = torch.tensor([1e-6, 1.0, 15.0], dtype=torch.float64)
    lam, G = grs_levels(d, 3)
    for u in [1e-300, 1e-12, 0.5, 1.0]:
        s = sample_grs_residual(d, lam[:, 3], G[:, 3], torch.full((3,), u, dtype=torch.float64))
        assert torch.isfinite(s).all()


def test_rmc_refuses_more_than_one_child():
    with pytest.raises(ValueError, match="at most 1 child"):
        RMC()(
            torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2), torch.zeros(2, 2, 3), torch.ones(2, 2, dtype=torch.bool)
        )


def test_get_coupling_names_and_errors():
    assert isinstance(get_coupling("dgrs"), GRS)
    assert isinstance(get_coupling("RMC"), RMC)
    with pytest.raises(ValueError, match="coupling must be one of"):
        get_coupling("nope")


def test_grs_with_padded_children_uses_only_valid_ones():
    """A node with fewer children than the padding width couples as GRS with its own K."""
    n, d, delta = 100_000, 3, 1.5
    g = torch.Generator().manual_seed(11)
    mu_p = torch.zeros(n, d, dtype=torch.float64)
    mu_q = torch.zeros(n, d, dtype=torch.float64)
    mu_q[:, 0] = delta
    children = torch.randn(n, 4, d, generator=g, dtype=torch.float64)
    children[:, 2:] = 1e6  # padding that must never be chosen
    valid = torch.zeros(n, 4, dtype=torch.bool)
    valid[:, :2] = True
    res = GRS()(mu_p, mu_q, torch.ones(n, dtype=torch.float64), children, valid, g)
    assert (res.index < 2).all()
    p = float(grs_acceptance(torch.tensor(delta), 2))
    assert abs(res.accepted.double().mean() - p) < 4.5 * math.sqrt(p * (1 - p) / n)
    assert sps.kstest((res.state[:, 0] - delta).numpy(), "norm").pvalue > 1e-4


# -- direct use: Coupling.__call__ as a user calls it ---------------------------------------


class UncheckedAntithetic(AntitheticCoupling):
    """The old ``__call__``: takes any children, i.i.d. ones included, without a word."""

    def structure_defect(self, z):
        return torch.zeros_like(z)


def _direct_use_failures(cp, K: int, delta: float, d: int = 3, n: int = 4000, seed: int = 0) -> list:
    """Call ``cp`` the way its docstring says: i.i.d. children from ``N(mu_p, s^2 I)``; if it refuses
    them naming ``structure_noise``, the structured children the error describes. Returns what is
    wrong with the law of the output (empty if nothing).

    Power at n = 4000: the KS test at p < 1e-4 sees a CDF gap of about 0.035 (antithetic fed
    i.i.d. children is off by 0.1); the moment z-scores a mean shift of 0.07 and a variance error of
    10 %.
    """
    g = torch.Generator().manual_seed(seed)
    mu_p = 2.0 * torch.randn(n, d, generator=g)
    scale = 0.05 + torch.rand(n, generator=g, dtype=torch.float64)
    e = torch.randn(n, d, generator=g, dtype=torch.float64)
    e /= e.norm(dim=1, keepdim=True)
    mu_q = mu_p + (delta * scale[:, None] * e).float()
    valid = torch.ones(n, K, dtype=torch.bool)
    z = torch.randn(n, K, d, generator=g)
    kids = mu_p[:, None] + scale.float()[:, None, None] * z
    try:
        res = cp(mu_p, mu_q, scale, kids, valid, g)
    except ValueError as err:
        if not cp.structured_siblings or "structure_noise" not in str(err):
            raise
        kids = mu_p[:, None] + scale.float()[:, None, None] * cp.structure_noise(z)
        res = cp(mu_p, mu_q, scale, kids, valid, g)
    y = (res.state.double() - mu_p.double()) / scale[:, None]
    s = (y * e).sum(1)
    perp2 = (y - s[:, None] * e).square().sum(1)
    checks = {
        "projection KS": _ks_normal_p(s - delta) >= P_TOL,
        "projection mean": abs(float(s.mean()) - delta) <= Z_TOL / math.sqrt(n),
        "projection variance": abs(float(s.var()) - 1.0) <= Z_TOL * math.sqrt(2.0 / (n - 1)),
        # |perp|^2 ~ chi^2_{d-1}: mean d - 1, variance 2 (d - 1)
        "orthogonal norm": abs(float(perp2.mean()) - (d - 1)) <= Z_TOL * math.sqrt(2.0 * (d - 1) / n),
    }
    return [f"K={K}, delta={delta}: {name}" for name, ok in checks.items() if not ok]


def _ks_of(cp) -> list:
    """The numbers of children to try: even ones for structured siblings, else 1-3 within the rule's limit."""
    out = []
    for k in (2, 4) if cp.structured_siblings else (1, 2, 3):
        try:
            cp.check_children(k)
            out.append(k)
        except ValueError:
            pass
    return out


@pytest.mark.parametrize("name", available_couplings())
def test_every_registered_coupling_used_directly_keeps_the_target_law(name):
    cp = get_coupling(name)
    ks = _ks_of(cp)
    assert ks, f"coupling {name!r} takes none of the numbers of children tried"
    failures = [
        f
        for i, K in enumerate(ks)
        for j, delta in enumerate((0.5, 2.0))
        for f in _direct_use_failures(cp, K, delta, seed=10 * i + j)
    ]
    assert not failures, f"coupling {name!r} called directly: {failures}"


def test_direct_use_check_rejects_antithetic_fed_iid_children():
    """The same check on the old behaviour: antithetic taking i.i.d. children returns the wrong law."""
    for i, K in enumerate((2, 4)):
        for j, delta in enumerate((0.5, 2.0)):
            failures = _direct_use_failures(UncheckedAntithetic(), K, delta, seed=10 * i + j)
            assert any("KS" in f for f in failures), f"K={K}, delta={delta}: the wrong law passed"


def test_antithetic_refuses_iid_children_and_says_how_to_draw_them():
    cp = AntitheticCoupling()
    g = torch.Generator().manual_seed(5)
    mu_p, scale = torch.randn(8, 3, generator=g), torch.full((8,), 0.3, dtype=torch.float64)
    z = torch.randn(8, 4, 3, generator=g)
    valid = torch.ones(8, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"structure_noise\(z\)") as err:
        cp(mu_p, mu_p + 0.1, scale, mu_p[:, None] + 0.3 * z, valid, g)
    assert "8 of 8 problems" in str(err.value)
    # one problem broken among structured ones is named
    kids = mu_p[:, None] + 0.3 * cp.structure_noise(z)
    kids[5, 3] += 0.01
    with pytest.raises(ValueError, match="1 of 8 problems, the first problem 5"):
        cp(mu_p, mu_p + 0.1, scale, kids, valid, g)
    # structured children made in float32 and handed over in float64 are taken
    kids = (mu_p[:, None] + 0.3 * cp.structure_noise(z)).double()
    res = cp(mu_p.double(), mu_p.double() + 0.1, scale, kids, valid, g)
    assert torch.isfinite(res.state).all()
