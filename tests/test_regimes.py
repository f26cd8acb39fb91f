"""Every regime of a sampler's parameters that a user can reach, against the sampler's own code.

The batteries of ``test_chains.py`` and ``test_kdiffusion_samplers.py`` run each chain at a few
settings, and a ``min``, ``max`` or window of a step that never binds there could be written wrong
unseen. Here each is reached on its binding side and on the other:

* EDM's churn (k-diffusion's ``sample_euler``): ``s_churn / N`` below its clip ``sqrt 2 - 1``, an
  ``s_tmin`` / ``s_tmax`` window with steps inside and outside it, and window edges at grid levels;
* ``eta > 1`` on Euler ancestral, where ``get_ancestral_step``'s ``min(sigma_to, ...)`` binds, and on ComfyUI's
  ``sample_euler_ancestral_RF``, whose ``sigma_down`` falls below 0 and whose re-noising variance turns negative
  (refused) for a large enough ``eta``;
* the other parameters at their boundaries (``s_noise`` above 1, ``eta`` 0 and above 1 on DPM++ 2M SDE,
  one- and two-step schedules, the last step into sigma 0);
* GRS at a small mismatch (``delta`` from 1e-4 to 1e-2): its levels, acceptance weights and
  residual against the closed forms in 50-digit arithmetic;
* initial states from ``specforest.streams.randn(seed, i)`` with the same ``seed`` for the run.

Parity is with k-diffusion's own ``sampling.py`` (``kdiff_reference``) or ComfyUI's transcribed
samplers (``comfy_reference``), in float64 to ``1e-12`` of the output's scale. The law with a tree is
checked against k-diffusion's own sampler too: with a Gaussian data law its denoiser is affine, so
its final state is an affine function of the initial state and of its draws, whose coefficients
running its function on unit inputs gives exactly (:func:`reference_law`); the samples' mean,
variance, per-coordinate KS and squared norm are tested against that law (``|z| <= 4.5``, KS
``p >= 1e-4``, as ``specforest.testing`` does). Each test kills a mutant of ``mutants/``.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from comfy_reference import comfy_euler_ancestral_rf, comfy_lcm
from kdiff_reference import sampling
from scipy import stats

import specforest
from specforest import chains, kdiffusion, streams, testing, trees
from specforest.couplings import GRS, grs_acceptance, grs_levels
from specforest.kdiffusion import linear_grid
from specforest.streams import Stream

D = 16
MU = torch.linspace(-2.0, 2.0, D, dtype=torch.float64)
S0 = 0.5


def denoiser(x: torch.Tensor, sigma, **_) -> torch.Tensor:
    """``E[x_0 | x = x_0 + sigma xi]`` for data ``N(MU, S0^2 I)`` (affine in ``x``), float64."""
    s = sigma.reshape(-1, *[1] * (x.ndim - 1)).to(torch.float64) if torch.is_tensor(sigma) else sigma
    return MU + S0**2 / (S0**2 + s**2) * (x.to(torch.float64) - MU)


def karras(n: int = 20, lo: float = 0.03, hi: float = 80.0) -> torch.Tensor:
    """k-diffusion's own Karras schedule, in float64."""
    return sampling().get_sigmas_karras(n, lo, hi).to(torch.float64)


def start(n: int, sig: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``(n, D)`` k-diffusion initial states ``sigma_0 N(0, I)``."""
    return torch.randn(n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * sig[0]


def draws(n: int, count: int, seed: int = 1) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, D, dtype=torch.float64, generator=gen) for _ in range(count)]


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal to ``1e-12`` of the reference's scale (float64 rounding, far below any wrong coefficient)."""
    err = float((ours - ref).abs().max())
    assert err <= 1e-12 * float(ref.abs().max()), err


# -- k-diffusion's own law, and the samples against it ---------------------------------------------


def _run_unit(fn, x: torch.Tensor, sig: torch.Tensor, unit: int, kw: dict) -> tuple[torch.Tensor, int]:
    """``fn``'s final state from ``x (1, D)`` with every draw 0 but draw ``unit`` (all ones); and the
    number of draws. ``sample_euler`` and ``sample_heun`` draw ``torch.randn_like`` themselves: it is
    patched for the call."""
    count = [0]

    def draw(*_, **__) -> torch.Tensor:
        count[0] += 1
        return torch.full((1, D), 1.0 if count[0] - 1 == unit else 0.0, dtype=torch.float64)

    if fn in (sampling().sample_euler, sampling().sample_heun):
        with mock.patch.object(torch, "randn_like", draw):
            out = fn(denoiser, x, sig, disable=True, **kw)
    else:
        out = fn(denoiser, x, sig, disable=True, noise_sampler=draw, **kw)
    return out[0], count[0]


def reference_law(fn, sig: torch.Tensor, **kw) -> tuple[torch.Tensor, float]:
    """Mean ``(D,)`` and per-coordinate variance of k-diffusion's ``fn``'s final state from
    ``x = (1 + sigma_0) N(0, I)`` (:func:`ve_start`), by its own code.

    The denoiser is affine with a slope the same in every coordinate, so the final state is
    ``A x + sum_k B_k z_k + c`` with scalars ``A``, ``B_k``: ``c`` is the run from 0 without noise,
    ``A`` and ``B_k`` the runs from a unit state or a unit draw, minus ``c``."""
    zero, one = torch.zeros(1, D, dtype=torch.float64), torch.ones(1, D, dtype=torch.float64)
    c, n = _run_unit(fn, zero, sig, -1, kw)
    A = _run_unit(fn, one, sig, -1, kw)[0] - c
    var = (A * (1.0 + sig[0])) ** 2
    for k in range(n):
        var = var + (_run_unit(fn, zero, sig, k, kw)[0] - c) ** 2
    assert torch.allclose(var, var[0].expand(D), rtol=1e-12)  # isotropic, as the slope is
    return c, float(var[0])


def ve_start(n: int, sig: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``N(0, I)`` on the linear path at ``t_0``, in k-diffusion's VE scale: ``(1 + sigma_0) N(0, I)``."""
    return torch.randn(n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * (1 + sig[0])


def law_failures(samples: torch.Tensor, mean: torch.Tensor, var: float) -> list:
    """What of ``samples (n, D)`` departs from ``N(mean, var I)``: mean and variance z-scores and KS per
    coordinate, and the standardized squared norm's mean z-score and KS against chi-square(D)."""
    n = samples.shape[0]
    x = samples.double()
    zm = (x.mean(0) - mean) / math.sqrt(var / n)
    zv = (x.var(0) - var) / (var * math.sqrt(2.0 / (n - 1)))
    fails = []
    if zm.abs().max() > testing.Z_TOL:
        fails.append(f"mean z {zm.abs().max():.2f}")
    if zv.abs().max() > testing.Z_TOL:
        fails.append(f"variance z {zv.abs().max():.2f}")
    for j in range(D):
        p = stats.kstest(((x[:, j] - mean[j]) / math.sqrt(var)).numpy(), "norm").pvalue
        if p < testing.P_TOL:
            fails.append(f"KS coordinate {j} p={p:.1e}")
    q = ((x - mean) ** 2).sum(1) / var
    zq = (float(q.mean()) - D) / math.sqrt(2.0 * D / n)
    if abs(zq) > testing.Z_TOL:
        fails.append(f"squared norm z {zq:.2f}")
    pq = stats.kstest(q.numpy(), stats.chi2(D).cdf).pvalue
    if pq < testing.P_TOL:
        fails.append(f"KS squared norm p={pq:.1e}")
    return fails


N_LAW = 4000
"""Trajectories of a law test: the squared norm's z-score sees a relative variance error of
``4.5 sqrt(2 / (N_LAW D)) = 2.5 %``, a mean z-score a shift of ``4.5 / sqrt(N_LAW) = 0.07`` standard deviations."""

# -- EDM's churn: below the clip, and a window that binds --------------------------------------------

# 20 steps: s_churn / N = 0.25 < sqrt 2 - 1; the window [0.1, 10] churns 9 of the 20 levels
CHURN = dict(s_churn=5.0, s_tmin=0.1, s_tmax=10.0)


@pytest.mark.parametrize("s_noise", [1.0, 1.4])
def test_euler_below_the_clip_in_a_window_equals_k_diffusions_sample_euler(s_noise):
    sig = karras()
    # the setting is what it claims: gamma is s_churn / N, not the clip, and the window leaves levels out
    # above and below it
    assert CHURN["s_churn"] / (len(sig) - 1) < math.sqrt(2.0) - 1.0
    inside = (sig[:-1] >= CHURN["s_tmin"]) & (sig[:-1] <= CHURN["s_tmax"])
    assert bool(inside.any()) and bool((sig[:-1] > CHURN["s_tmax"]).any()) and bool((sig[:-1] < CHURN["s_tmin"]).any())
    x = start(32, sig)
    kw = dict(CHURN, s_noise=s_noise, disable=True)
    torch.manual_seed(3)
    ref = sampling().sample_euler(denoiser, x, sig, **kw)
    torch.manual_seed(3)
    assert_close(kdiffusion.sample_euler(denoiser, x, sig, **kw), ref)


@pytest.mark.parametrize("edges", [(3, 12), (0, 19), (7, 7)], ids=["inner", "ends", "one-level"])
def test_euler_window_edges_at_grid_levels_are_inclusive_as_k_diffusions(edges):
    """``s_tmin <= sigma_i <= s_tmax`` in k-diffusion: a window whose edges are the schedule's own levels
    (``s_tmax=sigmas[i]``) churns them. The chain reads the levels back from its linear-path grid
    (``t / (1 - t)``, off by an ulp), so an edge decided there could leave a level out."""
    sig = karras()
    top, bottom = edges
    kw = dict(s_churn=5.0, s_tmin=float(sig[bottom]), s_tmax=float(sig[top]), disable=True)
    x = start(32, sig)
    torch.manual_seed(4)
    ref = sampling().sample_euler(denoiser, x, sig, **kw)
    torch.manual_seed(4)
    assert_close(kdiffusion.sample_euler(denoiser, x, sig, **kw), ref)


LAW_TREES = [(trees.uniform(2, 3), "grs"), (trees.chain(4), "rmc")]


@pytest.mark.parametrize("tree, coupling", LAW_TREES, ids=["grs", "rmc"])
def test_speculated_euler_below_the_clip_in_a_window_has_k_diffusions_law(tree, coupling):
    sig = karras()
    mean, var = reference_law(sampling().sample_euler, sig, **CHURN)
    out = kdiffusion.sample_euler(
        denoiser, ve_start(N_LAW, sig), sig, **CHURN, tree=tree, coupling=coupling, draft="x0", seed=5, disable=True
    )
    assert not law_failures(out, mean, var), law_failures(out, mean, var)


@pytest.mark.parametrize("tree, coupling", LAW_TREES, ids=["grs", "rmc"])
def test_speculated_heun_in_a_window_has_k_diffusions_law(tree, coupling):
    """Heun's steps outside EDM's window add no noise: each is a round of single rows, which makes both of
    its calls (only the last step, into 0, makes one), between the rounds its trees speculate."""
    sig = karras()
    window = dict(CHURN, s_tmax=1.0)  # (the large steps above it without noise: Euler's error there is seen)
    churned = ((sig[:-1] >= window["s_tmin"]) & (sig[:-1] <= window["s_tmax"])).tolist()
    assert not churned[0] and churned[-4] and not churned[-2]  # noise-free steps around the window
    mean, var = reference_law(sampling().sample_heun, sig, **window)
    out = kdiffusion.sample_heun(
        denoiser, ve_start(N_LAW, sig), sig, **window, tree=tree, coupling=coupling, draft="x0", seed=5, disable=True
    )
    assert not law_failures(out, mean, var), law_failures(out, mean, var)


def test_the_law_test_rejects_churn_at_the_clip():
    """The same test, on samples of the clip's gamma (``s_churn / N = 0.5``): 5 % more variance."""
    sig = karras()
    mean, var = reference_law(sampling().sample_euler, sig, **CHURN)
    clipped = dict(CHURN, s_churn=10.0)
    out = kdiffusion.sample_euler(
        denoiser, ve_start(N_LAW, sig), sig, **clipped, tree=trees.chain(4), seed=5, disable=True
    )
    assert law_failures(out, mean, var)


# -- Euler ancestral with eta > 1: get_ancestral_step's min binds --------------------------------------


def _binds(sig: torch.Tensor, eta: float) -> torch.Tensor:
    """``(T - 1,)`` whether ``min(sigma', eta sqrt(sigma'^2 (sigma^2 - sigma'^2) / sigma^2))`` takes ``sigma'``."""
    s, s1 = sig[:-2], sig[1:-1]
    return eta * (s1**2 * (s**2 - s1**2) / s**2).sqrt() > s1


@pytest.mark.parametrize("eta, s_noise", [(1.5, 1.0), (1.3, 1.4)])
def test_euler_ancestral_above_eta_one_equals_k_diffusions(eta, s_noise):
    sig = karras()
    binds = _binds(sig, eta)
    assert bool(binds.any()) and bool((~binds).any())  # both sides of the min
    x, z = start(32, sig), draws(32, len(sig))
    kw = dict(eta=eta, s_noise=s_noise, disable=True)
    it = iter(z)
    ref = sampling().sample_euler_ancestral(denoiser, x, sig, noise_sampler=lambda a, b: next(it), **kw)
    it = iter(z)
    assert_close(kdiffusion.sample_euler_ancestral(denoiser, x, sig, noise_sampler=lambda a, b: next(it), **kw), ref)


@pytest.mark.parametrize("tree, coupling", LAW_TREES, ids=["grs", "rmc"])
def test_speculated_euler_ancestral_above_eta_one_has_k_diffusions_law(tree, coupling):
    sig = karras()
    mean, var = reference_law(sampling().sample_euler_ancestral, sig, eta=1.5)
    out = kdiffusion.sample_euler_ancestral(
        denoiser, ve_start(N_LAW, sig), sig, eta=1.5, tree=tree, coupling=coupling, draft="x0", seed=6, disable=True
    )
    assert not law_failures(out, mean, var), law_failures(out, mean, var)


def linear_denoiser(y: torch.Tensor, s, **_) -> torch.Tensor:
    """A ``CONST`` model (ComfyUI's SD3, Flux): ``D`` at the linear-path level ``s``."""
    s = s.reshape(-1, 1).to(torch.float64) if torch.is_tensor(s) else s
    return denoiser(y / (1 - s), s / (1 - s))


LINEAR_GRID = torch.linspace(0.98, 0.0, 16, dtype=torch.float64)


@pytest.mark.parametrize("eta", [1.5, 3.0])
def test_euler_ancestral_rf_above_eta_one_equals_comfys(eta):
    """ComfyUI's ``sample_euler_ancestral_RF`` above ``eta = 1``: at 3 its ``sigma_down`` falls below 0 on the
    last steps (an Euler step past the clean prediction), where the re-noising is still defined."""
    t = LINEAR_GRID
    down = t[1:-1] * (1 + eta * (t[1:-1] / t[:-2] - 1))
    assert eta < 2 or bool((down < 0).any())
    x, z = draws(32, 1, seed=5)[0], draws(32, len(t))
    ref = comfy_euler_ancestral_rf(denoiser, x, t, z, eta=eta, s_noise=1.3)
    it = iter(z)
    ours = kdiffusion.sample_euler_ancestral(
        linear_denoiser, x, t, eta=eta, s_noise=1.3, noise_sampler=lambda a, b: next(it), path="linear", disable=True
    )
    assert_close(ours, ref)


def test_euler_ancestral_rf_refuses_an_eta_whose_renoising_variance_is_negative():
    """Above ``2 (1 - t') / ((1 - 2 t') (1 - t' / t))`` at some step ComfyUI's re-noising coefficient is the square
    root of a negative number (NaN); the chain refuses it, naming the step and the bound, rather than
    clamping it to another chain. At the bound itself it builds."""
    t = LINEAR_GRID
    tn, tp = t[1:-1], t[:-2]
    top = float((2 * (1 - tn) / ((1 - 2 * tn) * (1 - tn / tp)))[tn < 0.5].min())
    x, z = draws(4, 1, seed=5)[0], draws(4, len(t))
    assert torch.isnan(comfy_euler_ancestral_rf(denoiser, x, t, z, eta=1.01 * top)).all()
    chains.EulerAncestral(eta=top * (1 - 1e-9), path="linear").build(t)
    with pytest.raises(ValueError, match=rf"eta=.* gives a negative variance at step 13 .* at most {top:.6g}"):
        chains.EulerAncestral(eta=1.01 * top, path="linear").build(t)
    with pytest.raises(ValueError, match="negative variance at step 13"):
        kdiffusion.sample_euler_ancestral(linear_denoiser, x, t, eta=1.01 * top, path="linear", disable=True)


# -- the other parameters at their boundaries -------------------------------------------------------


def bent(x: torch.Tensor, sigma, **_) -> torch.Tensor:
    """A denoiser not affine along the path, so that DPM++ 2M's multistep term ``D - D_prev`` shows."""
    return denoiser(x, sigma) + 0.3 * torch.tanh(x)


SHORT = {
    "one": torch.tensor([14.6, 0.0], dtype=torch.float64),
    "two": torch.tensor([14.6, 1.2, 0.0], dtype=torch.float64),
}
BOUNDARY_CASES = {
    # name: (ours, the sampler's own code, its keywords, the schedule)
    "dpmpp-eta1.5-heun-s_noise1.4": ("dpmpp_2m_sde", dict(eta=1.5, s_noise=1.4, solver_type="heun"), None),
    "dpmpp-eta2.5-midpoint": ("dpmpp_2m_sde", dict(eta=2.5), None),
    "dpmpp-eta1.5-two-steps": ("dpmpp_2m_sde", dict(eta=1.5, solver_type="heun"), "two"),
    "ancestral-s_noise1.5": ("euler_ancestral", dict(s_noise=1.5), None),
    "ancestral-eta1.5-one-step": ("euler_ancestral", dict(eta=1.5), "one"),
    "ancestral-eta1.5-two-steps": ("euler_ancestral", dict(eta=1.5), "two"),
    "lcm-s_noise1.5": ("lcm", dict(s_noise=1.5), None),
    "lcm-two-steps": ("lcm", {}, "two"),
    "euler-churn-one-step": ("euler", dict(s_churn=0.3, s_noise=1.2), "one"),
    "euler-churn-two-steps": ("euler", dict(s_churn=0.5), "two"),
}


@pytest.mark.parametrize("case", list(BOUNDARY_CASES))
def test_drop_ins_at_their_boundaries_equal_the_samplers_own_code(case):
    """``eta`` above 1 and ``s_noise`` above 1 on DPM++ 2M SDE, Euler ancestral and LCM, and one- and two-step
    schedules (the first step is the last, into sigma 0; the multistep term's first use is the step into 0).
    k-diffusion's ``sample_dpmpp_2m_sde`` fails on a one-step schedule (its ``h_last`` is never set), so that
    case is not compared."""
    name, kw, short = BOUNDARY_CASES[case]
    sig = karras(12) if short is None else SHORT[short]
    model = bent if name == "dpmpp_2m_sde" else denoiser
    ours = getattr(kdiffusion, f"sample_{name}")
    x = start(32, sig)
    if name == "euler":
        torch.manual_seed(8)
        ref = sampling().sample_euler(model, x, sig, disable=True, **kw)
        torch.manual_seed(8)
        assert_close(ours(model, x, sig, disable=True, **kw), ref)
        return
    z = draws(32, len(sig))
    if name == "lcm":  # ComfyUI's sample_lcm (k-diffusion has none), its s_noise through the drop-in
        ref = comfy_lcm(model, x, sig, z, **kw)
        it = iter(z)
        assert_close(ours(model, x, sig, noise_sampler=lambda a, b: next(it), disable=True, **kw), ref)
        return
    it = iter(z)
    ref = getattr(sampling(), f"sample_{name}")(model, x, sig, noise_sampler=lambda a, b: next(it), disable=True, **kw)
    it = iter(z)
    assert_close(ours(model, x, sig, noise_sampler=lambda a, b: next(it), disable=True, **kw), ref)


# -- GRS at a small mismatch ------------------------------------------------------------------------

SMALL_DELTAS = [1e-4, 1e-3, 3e-3, 1e-2]


@pytest.fixture(scope="module")
def mpmath():
    """mpmath (with sympy, which torch requires), for the 50-digit references."""
    return pytest.importorskip("mpmath")


def _mp_sf(mpmath, x):
    return mpmath.erfc(x / mpmath.sqrt(2)) / 2


def mp_levels(mpmath, delta: float, K: int) -> tuple[list, list]:
    """``lambda_0 .. lambda_K`` and ``G_1 .. G_{K+1}`` in 50 digits from the closed form (ERRATA 1-3):
    ``tau_k = ln(lambda_k) / delta + delta / 2``, ``G_{k+1} = Phibar(tau_k - delta) - lambda_k Phibar(tau_k)``."""
    with mpmath.workdps(50):
        d = mpmath.mpf(delta)
        lam, G = [mpmath.mpf(0)], [mpmath.mpf(1)]
        for _ in range(K):
            lam_k = lam[-1] + G[-1]
            tau = mpmath.log(lam_k) / d + d / 2
            lam.append(lam_k)
            G.append(_mp_sf(mpmath, tau - d) - lam_k * _mp_sf(mpmath, tau))
        return lam, G


@pytest.mark.parametrize("delta", SMALL_DELTAS)
def test_grs_levels_and_acceptance_at_a_small_mismatch_are_the_closed_form(delta, mpmath):
    """At ``delta`` from 1e-4 to 1e-2 the remaining masses ``G_k`` are of order ``delta``, differences of masses
    near 1/2: ``grs_levels`` and ``1 - grs_acceptance`` must still hold them to 1e-9 relative (the midpoint form
    of the tail mass below 1e-2; without its second-order term ``G`` is 4e-8 off at 1e-3)."""
    K = 6
    lam_ref, G_ref = mp_levels(mpmath, delta, K)
    lam, G = grs_levels(torch.tensor([delta], dtype=torch.float64), K)
    for k in range(K + 1):
        assert float(lam[0, k]) == pytest.approx(float(lam_ref[k]), rel=1e-12, abs=0.0), k
        assert float(G[0, k]) == pytest.approx(float(G_ref[k]), rel=1e-9, abs=0.0), k
    for k in range(1, K + 1):
        rejected = 1.0 - float(grs_acceptance(torch.tensor(delta, dtype=torch.float64), k))
        assert rejected == pytest.approx(float(G_ref[k]), rel=1e-9, abs=0.0), k


@pytest.mark.parametrize("delta", SMALL_DELTAS)
def test_grs_acceptance_weights_at_a_small_mismatch_are_the_closed_form(delta, mpmath):
    """``GRS.select`` at fixed uniforms: child ``k`` is taken exactly when the children before it are not and
    ``u_k < beta_k = min(1, (rho_k - lambda_{k-1})_+ / G_k)``, ``rho = exp(delta s - delta^2 / 2)``, with the
    levels in 50 digits. Uniforms 0.5 % either side of ``beta_k`` at a grid of ``s``; ``G_k`` is of order ``delta``
    there, so a floor on it (against a division by 0) above 1e-300 moves the rule."""
    K = 4
    lam_ref, G_ref = mp_levels(mpmath, delta, K)
    s = torch.linspace(-1.0, 3.0, 21, dtype=torch.float64)
    rows, expected_hit = [], []
    for k in range(K):
        with mpmath.workdps(50):
            beta = [
                float(
                    min(
                        1,
                        max(0, mpmath.exp(delta * mpmath.mpf(v) - mpmath.mpf(delta) ** 2 / 2) - lam_ref[k]) / G_ref[k],
                    )
                )
                for v in s.tolist()
            ]
        for v, b in zip(s.tolist(), beta, strict=True):
            for rel in (0.995, 1.005):
                if b * rel > 1.0 or b == 0.0:
                    continue
                u = torch.ones(K, dtype=torch.float64)  # the children before k: never taken
                u[k] = b * rel
                s_hat = torch.full((K,), 5.0, dtype=torch.float64)
                s_hat[k] = v
                rows.append((s_hat, u))
                expected_hit.append(rel < 1.0)
    s_hat = torch.stack([r[0] for r in rows])
    u = torch.stack([r[1] for r in rows])
    P = u.shape[0]
    rng = Stream(torch.arange(P), drawn=u, layout=((0, K),))
    d = torch.full((P,), delta, dtype=torch.float64)
    accepted, index = GRS().select(s_hat, d, torch.ones(P, K, dtype=torch.bool), rng)
    k_of = (u < 1.0).to(torch.int8).argmax(1)
    hit = torch.tensor(expected_hit)
    assert 0 < int(hit.sum()) < P  # both outcomes occur
    # a row whose child k is not taken accepts none of them (its children after k get u = 1)
    assert torch.equal(accepted, hit), int((accepted != hit).sum())
    assert torch.equal(index[hit], k_of[hit])


def _mp_excess(mpmath, x, u, delta, lam, G):
    """``u G - H(x)`` with ``H(x) = Phibar(x - delta) - lam Phibar(x)``: increasing in ``x``, 0 at the quantile."""
    return u * G - (_mp_sf(mpmath, x - delta) - lam * _mp_sf(mpmath, x))


@pytest.mark.parametrize("delta", SMALL_DELTAS)
def test_grs_residual_at_a_small_mismatch_is_the_closed_form_quantile(delta, mpmath):
    """``GRS.residual`` with fixed uniforms: with ``G_{K+1}`` of order ``delta`` no rejection trial is made, and a
    draw is the residual's quantile, the root of ``H(s) = u G_{K+1}`` with
    ``H(s) = Phibar(s - delta) - lambda_K Phibar(s)``. Checked in 50 digits by the sign of ``H - u G`` at the draw
    plus and minus ``1e-9 (1 + |s|)``, for ``K`` 1, 3 and 6 and ``u`` from 1e-6 to ``1 - 1e-9``."""
    from specforest.residuals import TRIALS

    us = [1e-6, 0.02, 0.3, 0.5, 0.8, 0.99, 1 - 1e-9]
    for K in (1, 3, 6):
        lam_ref, G_ref = mp_levels(mpmath, delta, K)
        P = len(us)
        drawn = torch.ones(P, 1 + 2 * TRIALS, dtype=torch.float64)  # trial tests at 1: never kept
        drawn[:, 0] = torch.tensor(us, dtype=torch.float64)
        rng = Stream(torch.arange(P), drawn=drawn, layout=((1, 1 + 2 * TRIALS),))
        d = torch.full((P,), delta, dtype=torch.float64)
        s = GRS().residual(torch.zeros(P, K, dtype=torch.float64), d, torch.ones(P, K, dtype=torch.bool), None, rng)
        with mpmath.workdps(50):
            dm, lam, G = mpmath.mpf(delta), lam_ref[K], G_ref[K]  # lambda_K, G_{K+1}
            tau = mpmath.log(lam) / dm + dm / 2

            for s_i, u_i in zip(s.tolist(), us, strict=True):
                tol = 1e-9 * (1 + abs(s_i))
                lo, hi = max(tau, mpmath.mpf(s_i) - tol), mpmath.mpf(s_i) + tol
                u_mp = mpmath.mpf(u_i)
                assert _mp_excess(mpmath, lo, u_mp, dm, lam, G) <= 0 <= _mp_excess(mpmath, hi, u_mp, dm, lam, G), (
                    K,
                    u_i,
                    s_i,
                )


# -- initial states from streams.randn(seed, i) with the run's own seed ------------------------------

# from sigma 1.5, where the final state still depends on the initial one (from sigma 80 it hardly does)
RECIPE_GRID = linear_grid(karras(12, 0.03, 1.5))


@pytest.mark.parametrize("chain", chains.available_chains())
def test_initial_states_from_the_runs_own_seed_keep_the_law(chain):
    """The README's recipe: ``x = streams.randn(seed, i)`` and ``sample(..., seed=seed)``. The run's draws (its
    chain's start, EDM's churn of ``x``, its transitions, drafts and couplings) are keyed apart from the initial
    noise, so reusing the seed leaves the law the standard sampler's from ``N(0, I)``: a start noise keyed as
    ``randn``'s would be ``x`` itself and scale its variance."""
    seed = 7
    ch = chains.get_chain(chain).example()
    model = specforest.models.GaussianMixture(MU[None], torch.tensor([S0], dtype=torch.float64))
    x = streams.randn(seed, torch.arange(N_LAW), (D,), dtype=torch.float64)
    out = specforest.sample(
        model, x, sigmas=RECIPE_GRID, chain=ch, tree=trees.uniform(2, 3), coupling="grs", draft="x0", seed=seed
    )
    testing.check_law(out.samples, RECIPE_GRID, None, MU, S0, chain=ch).assert_exact()


def test_euler_drop_in_from_the_runs_own_seed_has_k_diffusions_law():
    """The same recipe through ``sample_euler`` with churn from the first level (its start adds noise to ``x``)."""
    seed, sig = 11, karras(20, 0.03, 1.5)
    mean, var = reference_law(sampling().sample_euler, sig, s_churn=5.0)
    x = streams.randn(seed, torch.arange(N_LAW), (D,), dtype=torch.float64) * (1 + sig[0])
    out = kdiffusion.sample_euler(
        denoiser, x, sig, s_churn=5.0, tree=trees.chain(4), coupling="rmc", seed=seed, disable=True
    )
    assert not law_failures(out, mean, var), law_failures(out, mean, var)
