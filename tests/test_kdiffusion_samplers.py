"""The drop-in samplers of specforest.kdiffusion against the real functions.

k-diffusion's ``sample_euler_ancestral`` and ``sample_euler`` are its own code (``kdiff_reference``);
ComfyUI's ``sample_ddpm``, ``sample_lcm`` and ``sample_euler_ancestral_RF`` are transcribed
(``comfy_reference``). With ``tree=None`` and the same noise the outputs are equal (float64: 1e-5 of
the output's scale; float32: 1e-3). With a tree the law is the same: the closed form of the chain
on a Gaussian data law (means, variances, per-coordinate KS, the squared norm) and a two-sample
comparison with the real function's own samples; the same tests reject the EM chain against
Euler ancestral and eta 0.8 against eta 1.
"""

from __future__ import annotations

import pytest
import torch
from comfy_reference import comfy_ddpm, comfy_euler_ancestral_rf, comfy_lcm
from kdiff_reference import sampling
from scipy import stats

from specforest import chains, kdiffusion, testing, trees
from specforest.kdiffusion import linear_grid

D = 16
MU = torch.linspace(-2.0, 2.0, D, dtype=torch.float64)
S0 = 1.0


def denoiser(x: torch.Tensor, sigma, **_) -> torch.Tensor:
    """``E[x_0 | x = x_0 + sigma xi]`` for data ``N(MU, S0^2 I)``, in ``x``'s dtype."""
    s = sigma.reshape(-1, *[1] * (x.ndim - 1)).to(torch.float64) if torch.is_tensor(sigma) else sigma
    return (MU + S0**2 / (S0**2 + s**2) * (x.to(torch.float64) - MU)).to(x.dtype)


def karras(n: int = 20) -> torch.Tensor:
    return sampling().get_sigmas_karras(n, 0.03, 80.0).to(torch.float64)


def start(n: int, sig: torch.Tensor, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    return (torch.randn(n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * sig[0]).to(dtype)


def draws(n: int, count: int, seed: int = 1, dtype=torch.float64) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, D, dtype=torch.float64, generator=gen).to(dtype) for _ in range(count)]


def close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = 1e-5 if dtype == torch.float64 else 1e-3
    return float((ours.double() - ref.double()).abs().max()) <= tol * float(ref.double().abs().max())


# -- parity with no tree --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("eta, s_noise", [(1.0, 1.0), (0.6, 1.05)])
def test_euler_ancestral_with_a_noise_sampler_equals_k_diffusions(dtype, eta, s_noise):
    sig = karras().to(dtype)
    x, z = start(32, sig, dtype=dtype), draws(32, len(sig), dtype=dtype)
    it = iter(z)
    ref = sampling().sample_euler_ancestral(
        denoiser, x, sig, eta=eta, s_noise=s_noise, noise_sampler=lambda a, b: next(it), disable=True
    )
    it = iter(z)
    ours = kdiffusion.sample_euler_ancestral(
        denoiser, x, sig, eta=eta, s_noise=s_noise, noise_sampler=lambda a, b: next(it), disable=True
    )
    assert ours.dtype == dtype and close(ours, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "eta, s_noise, solver_type", [(1.0, 1.0, "midpoint"), (0.7, 1.05, "heun"), (0.0, 1.0, "midpoint")]
)
def test_dpmpp_2m_sde_with_a_noise_sampler_equals_k_diffusions(dtype, eta, s_noise, solver_type):
    sig = karras().to(dtype)
    x, z = start(32, sig, dtype=dtype), draws(32, len(sig), dtype=dtype)
    kw = dict(eta=eta, s_noise=s_noise, solver_type=solver_type, disable=True)
    it = iter(z)
    ref = sampling().sample_dpmpp_2m_sde(denoiser, x, sig, noise_sampler=lambda a, b: next(it), **kw)
    it = iter(z)
    ours = kdiffusion.sample_dpmpp_2m_sde(denoiser, x, sig, noise_sampler=lambda a, b: next(it), **kw)
    assert ours.dtype == dtype and close(ours, ref, dtype)


def test_dpmpp_2m_sde_parity_holds_with_a_nonlinear_denoiser():
    """The multistep term (``D - D_prev``) only shows when ``D`` is not affine along the path."""
    sig = karras(12)

    def bent(x, s, **_):
        return denoiser(x, s) + 0.3 * torch.tanh(x)

    x, z = start(16, sig), draws(16, len(sig))
    it = iter(z)
    ref = sampling().sample_dpmpp_2m_sde(bent, x, sig, noise_sampler=lambda a, b: next(it), disable=True)
    it = iter(z)
    ours = kdiffusion.sample_dpmpp_2m_sde(bent, x, sig, noise_sampler=lambda a, b: next(it), disable=True)
    assert close(ours, ref, torch.float64)


def test_euler_ancestral_default_noise_is_k_diffusions_global_generator():
    sig = karras()
    x = start(32, sig)
    torch.manual_seed(7)
    ref = sampling().sample_euler_ancestral(denoiser, x, sig, disable=True)
    torch.manual_seed(7)
    ours = kdiffusion.sample_euler_ancestral(denoiser, x, sig, disable=True)
    assert close(ours, ref, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "s_churn, s_tmin, s_tmax, s_noise", [(20.0, 0.1, 40.0, 1.0), (40.0, 0.0, float("inf"), 1.003), (0.0, 0.0, 1.0, 1.0)]
)
def test_euler_with_churn_equals_k_diffusions_sample_euler(dtype, s_churn, s_tmin, s_tmax, s_noise):
    sig = karras().to(dtype)
    x = start(32, sig, dtype=dtype)
    kw = dict(s_churn=s_churn, s_tmin=s_tmin, s_tmax=s_tmax, s_noise=s_noise, disable=True)
    torch.manual_seed(3)
    ref = sampling().sample_euler(denoiser, x, sig, **kw)
    torch.manual_seed(3)
    ours = kdiffusion.sample_euler(denoiser, x, sig, **kw)
    assert close(ours, ref, dtype)


def test_euler_ancestral_on_the_linear_path_is_comfys_rf_sampler():
    t = torch.linspace(0.98, 0.0, 16, dtype=torch.float64)
    x, z = draws(32, 1, seed=5)[0], draws(32, len(t))

    def linear_denoiser(y, s, **_):  # a CONST model: D at the linear-path level s
        s = s.reshape(-1, 1).to(torch.float64) if torch.is_tensor(s) else s
        return denoiser(y / (1 - s), s / (1 - s))

    ref = comfy_euler_ancestral_rf(denoiser, x, t, z, eta=0.8, s_noise=1.02)
    it = iter(z)
    ours = kdiffusion.sample_euler_ancestral(
        linear_denoiser, x, t, eta=0.8, s_noise=1.02, noise_sampler=lambda a, b: next(it), path="linear", disable=True
    )
    assert close(ours, ref, torch.float64)


def test_ddpm_and_lcm_equal_comfys_samplers():
    t = chains.ddpm_linear_grid(100)
    sig = t / (1 - t)
    x, z = start(32, sig), draws(32, len(sig))
    it = iter(z)
    ours = kdiffusion.sample_ddpm(denoiser, x, sig, noise_sampler=lambda a, b: next(it), disable=True)
    assert close(ours, comfy_ddpm(denoiser, x, sig, z), torch.float64)
    sig = karras(8)
    x = start(32, sig)
    it = iter(z)
    ours = kdiffusion.sample_lcm(denoiser, x, sig, noise_sampler=lambda a, b: next(it), disable=True)
    assert close(ours, comfy_lcm(denoiser, x, sig, z), torch.float64)


def test_comfys_extra_args_seed_is_the_run_seed():
    sig = karras(10)
    x = start(8, sig)
    a = kdiffusion.sample_euler_ancestral(denoiser, x, sig, extra_args={"seed": 11}, disable=True)
    b = kdiffusion.sample_euler_ancestral(denoiser, x, sig, seed=11, disable=True)
    c = kdiffusion.sample_euler_ancestral(denoiser, x, sig, seed=12, disable=True)
    assert torch.equal(a, b) and not torch.equal(a, c)


# -- the law with trees ---------------------------------------------------------------------------

N_LAW = 4000


def law(samples: torch.Tensor, sig: torch.Tensor, chain) -> testing.ChainReport:
    """``samples`` of a run from :func:`ve_start` against ``chain``'s closed form on the mapped grid."""
    return testing.check_law(samples, linear_grid(sig), None, MU, S0, chain=chain)


def ve_start(n: int, sig: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``N(0, I)`` on the linear path at ``t_0``, in k-diffusion's VE scale: ``(1 + sigma_0) N(0, I)``."""
    return torch.randn(n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * (1 + sig[0])


@pytest.mark.parametrize(
    "fn, kw, chain, tree, coupling",
    [
        (kdiffusion.sample_euler_ancestral, {}, "euler_ancestral", trees.uniform(2, 3), "grs"),
        (kdiffusion.sample_euler_ancestral, {"eta": 0.8}, chains.EulerAncestral(eta=0.8), trees.chain(4), "rmc"),
        (
            kdiffusion.sample_euler,
            {"s_churn": 20.0, "s_tmax": 40.0},
            chains.EulerChurn(20.0, 0.0, 40.0),
            trees.chain(4),
            "rmc",
        ),
        (kdiffusion.sample_ddpm, {}, "ddpm", trees.uniform(3, 2), "rank"),
        (kdiffusion.sample_lcm, {}, "lcm", trees.uniform(2, 2), "grs"),
        (kdiffusion.sample_dpmpp_2m_sde, {}, "dpmpp_2m_sde", trees.uniform(2, 3), "grs"),
        (
            kdiffusion.sample_dpmpp_2m_sde,
            {"eta": 0.7, "solver_type": "heun"},
            chains.DPMPP2MSDE(eta=0.7, solver_type="heun"),
            trees.chain(4),
            "rmc",
        ),
    ],
)
def test_speculated_drop_ins_keep_the_chains_law(fn, kw, chain, tree, coupling):
    sig = karras(20)
    out = fn(denoiser, ve_start(N_LAW, sig), sig, **kw, tree=tree, coupling=coupling, draft="x0", seed=4, disable=True)
    law(out, sig, chain).assert_exact()


def test_the_law_test_rejects_the_em_chain_and_a_wrong_eta_against_euler_ancestral():
    sig = karras(20)
    x = ve_start(N_LAW, sig)
    em = kdiffusion.sample_speculative(denoiser, x, sig, churn=1.0, tree=trees.uniform(2, 3), seed=4, disable=True)
    rep = law(em, sig, "euler_ancestral")
    assert not rep.passed and abs(rep.norm_z) > 10
    eta8 = kdiffusion.sample_euler_ancestral(denoiser, x, sig, eta=0.8, tree=trees.uniform(2, 3), seed=4, disable=True)
    rep = law(eta8, sig, "euler_ancestral")
    assert not rep.passed and abs(rep.norm_z) > 10


def _two_sample_p(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """KS p-values of a fixed projection and of the squared norm about ``MU``, two samples."""
    u = torch.ones(D, dtype=torch.float64) / D**0.5
    proj = stats.ks_2samp((a @ u).numpy(), (b @ u).numpy()).pvalue
    norm = stats.ks_2samp(((a - MU) ** 2).sum(1).numpy(), ((b - MU) ** 2).sum(1).numpy()).pvalue
    return float(proj), float(norm)


def test_speculated_euler_ancestral_matches_the_real_functions_samples():
    sig = karras(20)
    x = ve_start(N_LAW, sig, seed=1)
    torch.manual_seed(0)
    real = sampling().sample_euler_ancestral(denoiser, x, sig, disable=True)
    ours = kdiffusion.sample_euler_ancestral(denoiser, x, sig, tree=trees.uniform(2, 3), seed=9, disable=True)
    assert min(_two_sample_p(ours, real)) > 1e-4
    em = kdiffusion.sample_speculative(denoiser, x, sig, churn=1.0, tree=trees.uniform(2, 3), seed=9, disable=True)
    assert _two_sample_p(em, real)[1] < 1e-6


@pytest.mark.filterwarnings("ignore:Should have ta>=t0")
def test_speculated_dpmpp_2m_sde_matches_the_real_functions_samples():
    """Against k-diffusion's own run with its default Brownian-tree noise (torchsde)."""
    sig = karras(20)
    x = ve_start(N_LAW, sig, seed=2)
    torch.manual_seed(0)
    real = sampling().sample_dpmpp_2m_sde(denoiser, x, sig, disable=True)
    ours = kdiffusion.sample_dpmpp_2m_sde(denoiser, x, sig, tree=trees.uniform(2, 3), seed=9, disable=True)
    assert min(_two_sample_p(ours, real)) > 1e-4
    ea = kdiffusion.sample_euler_ancestral(denoiser, x, sig, tree=trees.uniform(2, 3), seed=9, disable=True)
    assert _two_sample_p(ea, real)[1] < 1e-6


# -- refusals -------------------------------------------------------------------------------------


def test_refusals_name_the_reason():
    sig = karras(10)
    x = start(4, sig)
    with pytest.raises(ValueError, match="noise_sampler was given with a tree"):
        kdiffusion.sample_euler_ancestral(
            denoiser, x, sig, noise_sampler=lambda a, b: torch.randn_like(x), tree=trees.chain(2), disable=True
        )
    with pytest.raises(ValueError, match="no stochastic step"):
        kdiffusion.sample_euler(denoiser, x, sig, tree=trees.chain(2), seed=0, disable=True)
    with pytest.raises(ValueError, match="no stochastic step"):
        kdiffusion.sample_euler_ancestral(denoiser, x, sig, eta=0.0, tree=trees.chain(2), seed=0, disable=True)
    with pytest.raises(ValueError, match="eta"):
        kdiffusion.sample_euler_ancestral(denoiser, x, sig, eta=-1.0, disable=True)
    with pytest.raises(TypeError, match="churn is set by this sampler's own arguments"):
        kdiffusion.sample_euler_ancestral(denoiser, x, sig, churn=0.5, disable=True)
    with pytest.raises(ValueError, match="no stochastic step"):
        kdiffusion.sample_dpmpp_2m_sde(denoiser, x, sig, eta=0.0, tree=trees.chain(2), seed=0, disable=True)
    with pytest.raises(ValueError, match="solver_type"):
        kdiffusion.sample_dpmpp_2m_sde(denoiser, x, sig, solver_type="euler", disable=True)
    with pytest.raises(NotImplementedError, match="two correlated noises per step"):
        kdiffusion.sample_dpmpp_sde(denoiser, x, sig, disable=True)
    with pytest.raises(ValueError, match="two correlated noises per step"):
        chains.get_chain("dpmpp_sde")
    with pytest.raises(ValueError, match="sample_ddpm is defined on VE noise levels"):
        kdiffusion.sample_ddpm(denoiser, x, sig / (1 + sig), path="linear", disable=True)
    # with no tree, the deterministic settings run
    assert kdiffusion.sample_euler(denoiser, x, sig, disable=True).shape == x.shape


# -- k-diffusion's schedule functions -------------------------------------------------------------

SCHEDULE_CALLS = [
    ("get_sigmas_karras", (12, 0.03, 80.0), {}),
    ("get_sigmas_karras", (7, 0.002, 14.6), {"rho": 5.0}),
    ("get_sigmas_karras", (1, 0.1, 10.0), {}),
    ("get_sigmas_exponential", (12, 0.03, 80.0), {}),
    ("get_sigmas_polyexponential", (12, 0.03, 80.0), {}),
    ("get_sigmas_polyexponential", (9, 0.1, 20.0), {"rho": 2.5}),
    ("get_sigmas_vp", (12,), {}),
    ("get_sigmas_vp", (10,), {"beta_d": 15.0, "beta_min": 0.2, "eps_s": 1e-2}),
]


@pytest.mark.parametrize("name, args, kw", SCHEDULE_CALLS)
def test_schedule_functions_equal_k_diffusions(name, args, kw):
    """Under k-diffusion's names, signatures and meaning: VE sigmas, a 0 appended, k-diffusion's dtype."""
    ours, ref = getattr(kdiffusion, name)(*args, **kw), getattr(sampling(), name)(*args, **kw)
    assert ours.dtype == ref.dtype and torch.equal(ours, ref) and ours[-1] == 0
    assert torch.equal(getattr(kdiffusion, name)(*args, **kw, device="cpu"), ref)


def test_schedule_functions_refuse_bad_values_naming_them():
    with pytest.raises(ValueError, match="sigma_max"):
        kdiffusion.get_sigmas_karras(10, 1.0, 0.5)
    with pytest.raises(ValueError, match="sigma_min"):
        kdiffusion.get_sigmas_exponential(10, 0.0, 10.0)
    with pytest.raises(ValueError, match="rho"):
        kdiffusion.get_sigmas_polyexponential(10, 0.1, 10.0, rho=0.0)
    with pytest.raises(ValueError, match="eps_s"):
        kdiffusion.get_sigmas_vp(10, eps_s=0.0)
    with pytest.raises(ValueError, match="n "):
        kdiffusion.get_sigmas_karras(0, 0.1, 10.0)


def test_a_drop_in_on_get_sigmas_karras_is_k_diffusions_run_on_its_own():
    """The obvious call (k-diffusion's schedule under its name) runs k-diffusion's sampler at its levels."""
    ours_sig = kdiffusion.get_sigmas_karras(16, 0.03, 80.0).to(torch.float64)
    ref_sig = sampling().get_sigmas_karras(16, 0.03, 80.0).to(torch.float64)
    x, z = start(32, ref_sig), draws(32, len(ref_sig))
    it = iter(z)
    ref = sampling().sample_euler_ancestral(denoiser, x, ref_sig, noise_sampler=lambda a, b: next(it), disable=True)
    it = iter(z)
    ours = kdiffusion.sample_euler_ancestral(denoiser, x, ours_sig, noise_sampler=lambda a, b: next(it), disable=True)
    assert close(ours, ref, torch.float64)
    assert float(ours_sig[0]) == pytest.approx(80.0)  # VE levels, not the linear path's t < 1
