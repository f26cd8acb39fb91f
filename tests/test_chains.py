"""The chains (specforest.chains): each sampler's tables against the sampler itself.

A chain's tables ``(a, c, scale)`` on the linear path must reproduce the sampler's own step in its
own coordinates. k-diffusion's samplers are the real functions (``kdiff_reference``: its
``sampling.py`` from the registry's wheel, unchanged), fed the same noise; ComfyUI's (``ddpm``,
``lcm``, ``euler_ancestral_RF``) and DDIM are written here as their code computes them, in their
own (VE, VP or CONST) coordinates, independently of the chains' linear-path derivation.
"""

from __future__ import annotations

import math

import pytest
import torch
from comfy_reference import comfy_ddpm, comfy_euler_ancestral_rf, comfy_lcm, vp_ddim
from helpers import KeepFirst
from kdiff_reference import sampling

import specforest
from specforest import chains, testing, trees
from specforest.proposals import available_drafts, drafts_serving

MU, S0 = torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64), 0.3


def denoiser(x: torch.Tensor, sigma, **_) -> torch.Tensor:
    """``E[x_0 | x = x_0 + sigma xi]`` for data ``N(MU, S0^2 I)`` (a k-diffusion denoiser)."""
    s = sigma.reshape(-1, *[1] * (x.ndim - 1)) if torch.is_tensor(sigma) else sigma
    return MU + S0**2 / (S0**2 + s**2) * (x - MU)


def karras(n: int = 20, lo: float = 0.03, hi: float = 80.0) -> torch.Tensor:
    return sampling().get_sigmas_karras(n, lo, hi).to(torch.float64)


def run_tables(tr, y: torch.Tensor, noise) -> torch.Tensor:
    """The chain's standard sampler on its tables: ``y' = a y + c v + scale z``, ``v = (y - D) / t``."""
    for n in range(tr.steps):
        t = tr.sigmas[n]
        v = (y - denoiser(y / (1 - t), t / (1 - t))) / t
        y = tr.a[n] * y + tr.c[n] * v + tr.scale[n] * noise(n)
    return y


def test_registry_lists_every_chain_and_refuses_unknown_names_and_parameters():
    assert available_chains_are(["em", "euler_ancestral", "euler", "ddpm", "ddim", "lcm"])
    assert chains.get_chain("euler_ancestral", eta=0.5) == chains.EulerAncestral(eta=0.5)
    with pytest.raises(ValueError, match="chain must be a Chain or one of em, euler_ancestral"):
        chains.get_chain("bogus")
    with pytest.raises(TypeError, match="has no parameter 'churn'; its parameters"):
        chains.get_chain("euler_ancestral", churn=0.5)
    with pytest.raises(ValueError, match="eta"):
        chains.EulerAncestral(eta=-0.1)
    with pytest.raises(ValueError, match="s_noise"):
        chains.LCM(s_noise=float("nan"))
    with pytest.raises(ValueError, match="covariance depends on the model"):
        chains.DDPM(variance="learned")
    with pytest.raises(ValueError, match="variance must be one of fixed_small, fixed_large"):
        chains.DDPM(variance="fixed_large_log")


def available_chains_are(names: list) -> bool:
    return chains.available_chains()[: len(names)] == names


def test_a_ve_chain_refuses_a_grid_that_starts_at_sigma_infinity():
    with pytest.raises(ValueError, match="chain 'ddpm' is not defined on this grid at step 0"):
        chains.DDPM().build(torch.linspace(1.0, 0.0, 11, dtype=torch.float64))


@pytest.mark.parametrize("eta, s_noise", [(1.0, 1.0), (0.5, 1.1), (0.0, 1.0)])
def test_euler_ancestral_tables_equal_k_diffusions_sampler(eta, s_noise):
    sig = karras()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, dtype=torch.float64, generator=gen) * sig[0]
    z = [torch.randn(64, 3, dtype=torch.float64, generator=gen) for _ in sig]
    it = iter(z)
    ref = sampling().sample_euler_ancestral(
        denoiser, x, sig, eta=eta, s_noise=s_noise, noise_sampler=lambda a, b: next(it), disable=True
    )
    tr = chains.EulerAncestral(eta=eta, s_noise=s_noise).build(sig / (1 + sig))
    ours = run_tables(tr, x / (1 + sig[0]), lambda n: z[n])
    assert torch.allclose(ours, ref, rtol=0, atol=1e-12 * ref.abs().max())
    assert bool(tr.stochastic.any()) == (eta > 0)


@pytest.mark.parametrize("s_churn, s_tmin, s_tmax", [(10.0, 0.05, 50.0), (40.0, 0.0, float("inf")), (0.0, 0.0, 1.0)])
def test_euler_churn_chain_on_x_hat_equals_k_diffusions_sample_euler(s_churn, s_tmin, s_tmax):
    """k-diffusion draws ``randn_like`` at every step (churned or not); the chain's start takes the first
    draw, its step ``i`` the draw of step ``i + 1`` (the churn of the state it moves to)."""
    sig = karras()
    x = torch.randn(64, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * sig[0]
    torch.manual_seed(5)
    ref = sampling().sample_euler(denoiser, x, sig, s_churn=s_churn, s_tmin=s_tmin, s_tmax=s_tmax, disable=True)
    torch.manual_seed(5)
    draws = [torch.randn_like(x) for _ in range(len(sig) - 1)]
    tr = chains.EulerChurn(s_churn=s_churn, s_tmin=s_tmin, s_tmax=s_tmax).build(sig / (1 + sig))
    y0 = tr.init_a * x / (1 + sig[0]) + tr.init_scale * draws[0]
    ours = run_tables(tr, y0, lambda n: draws[n + 1] if n + 1 < len(draws) else torch.zeros_like(x))
    assert torch.allclose(ours, ref, rtol=0, atol=1e-12 * ref.abs().max())
    assert bool(tr.stochastic.any()) == (s_churn > 0)


def _noise(n: int, seed: int = 3) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 3, dtype=torch.float64, generator=gen) for _ in range(n)]


@pytest.mark.parametrize("variance", chains.VARIANCES)
def test_ddpm_tables_equal_comfys_ddpm_step(variance):
    t = chains.ddpm_linear_grid(50)
    sig = t / (1 - t)
    z = _noise(len(sig))
    x = z[-1] * sig[0]
    ref = comfy_ddpm(denoiser, x, sig, z, variance)
    ours = run_tables(chains.DDPM(variance=variance).build(t), x / (1 + sig[0]), lambda n: z[n])
    assert torch.allclose(ours, ref, rtol=0, atol=1e-10 * ref.abs().max())


def test_ddpm_linear_grid_is_ddpm_schedulers_default_betas():
    t = chains.ddpm_linear_grid(1000)
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    ab = torch.cumprod(1 - betas, 0)
    sig = t[:-1] / (1 - t[:-1])
    assert torch.allclose(1 / (1 + sig.flip(0) ** 2), ab, rtol=1e-12)
    assert t.shape == (1001,) and t[-1] == 0


def test_lcm_tables_equal_comfys_lcm_step():
    sig = karras(8, 0.03, 15.0)
    z = _noise(len(sig))
    x = z[-1] * sig[0]
    ref = comfy_lcm(denoiser, x, sig, z, s_noise=0.9)
    ours = run_tables(chains.LCM(s_noise=0.9).build(sig / (1 + sig)), x / (1 + sig[0]), lambda n: z[n])
    assert torch.allclose(ours, ref, rtol=0, atol=1e-12 * ref.abs().max())


@pytest.mark.parametrize("eta", [1.0, 0.3])
def test_ddim_tables_equal_ddim_with_eta_on_vp_states(eta):
    sig = karras(25, 0.03, 30.0)
    ab = (1 / (1 + sig**2)).tolist()
    z = _noise(len(sig))
    x_vp = z[-1]  # at ab_0 ~ 1e-3, nearly pure noise
    ref = vp_ddim(denoiser, x_vp, ab, z, eta)  # at ab = 1 the VP state is x_0
    t = sig / (1 + sig)
    # VP to the linear path: y = x_vp / (sqrt(ab) + sqrt(1 - ab))
    y0 = x_vp / (math.sqrt(ab[0]) + math.sqrt(1 - ab[0]))
    ours = run_tables(chains.DDIM(eta=eta).build(t), y0, lambda n: z[n])
    assert torch.allclose(ours, ref, rtol=0, atol=1e-10 * ref.abs().max())


@pytest.mark.parametrize("eta", [1.0, 0.5])
def test_euler_ancestral_linear_path_equals_comfys_rf_sampler(eta):
    t = torch.linspace(0.97, 0.0, 21, dtype=torch.float64)
    z = _noise(len(t))
    x = z[-1]
    ref = comfy_euler_ancestral_rf(denoiser, x, t, z, eta=eta, s_noise=1.05)
    ours = run_tables(chains.EulerAncestral(eta=eta, s_noise=1.05, path="linear").build(t), x, lambda n: z[n])
    assert torch.allclose(ours, ref, rtol=0, atol=1e-12 * ref.abs().max())


def test_em_chain_is_the_reverse_sde():
    from specforest.reverse_sde import ReverseSDE
    from specforest.sde import flow_match_grid

    g = flow_match_grid(12)
    built, ref = chains.EM(churn=0.4).build(g), ReverseSDE(g, 0.4)
    for name in ("a", "c", "scale", "drift_f", "drift_k"):
        assert torch.equal(getattr(built, name), getattr(ref, name))
    with pytest.raises(ValueError, match="churn must be in"):
        chains.EM(churn=0.0)


def test_euler_ancestral_ddpm_and_ddim_at_eta_one_are_one_chain():
    """All three sample the exact Gaussian posterior q(x' | x, x_0 = D): three independent derivations
    (VE ancestral step, VP posterior, DDIM's interpolation) must agree to rounding."""
    t = chains.ddpm_linear_grid(40)
    built = [chains.EulerAncestral().build(t), chains.DDPM().build(t), chains.DDIM(eta=1.0).build(t)]
    for other in built[1:]:
        for name in ("a", "c", "scale"):
            assert torch.allclose(getattr(other, name), getattr(built[0], name), rtol=1e-9, atol=1e-12), name
    assert not torch.allclose(chains.DDPM(variance="fixed_large").build(t).scale, built[0].scale)


def test_karras_linear_grid_is_k_diffusions_schedule_on_the_linear_path():
    ref = karras(12, 0.03, 80.0)
    assert torch.allclose(chains.karras_linear_grid(12, 0.03, 80.0), ref / (1 + ref), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="sigma_max"):
        chains.karras_linear_grid(12, 1.0, 0.5)


# -- the law of every registered chain, through the engine -------------------------------------------

LAW_GRID = chains.karras_linear_grid(12, 0.03, 20.0)
LAW_CONFIGS = {
    "grs_tree_x0": dict(tree=trees.uniform(2, 3), coupling="grs", draft="x0"),
    "rmc_chain_secant": dict(tree=trees.chain(6), coupling="rmc", draft="secant"),
    "rank_tree_lazy": dict(tree=trees.uniform(3, 2), coupling="rank", draft="velocity", lazy=True),
}


@pytest.mark.parametrize("chain", chains.available_chains())
@pytest.mark.parametrize("name", list(LAW_CONFIGS))
def test_every_chain_keeps_its_law_with_any_tree_coupling_and_draft(chain, name):
    ch = chains.get_chain(chain).example()
    rep = testing.check_chain_law(**LAW_CONFIGS[name], chain=ch, sigmas=LAW_GRID, churn=None, trajectories=4000)
    rep.assert_exact()
    # fewer sequential calls than the standard run's (a chain of two stages: two a step, one at the last)
    assert rep.nfe_mean < ch.build(LAW_GRID).standard_calls


@pytest.mark.parametrize("chain", chains.available_chains())
def test_the_law_check_rejects_a_wrong_coupling_on_every_chain(chain):
    ch = chains.get_chain(chain).example()
    rep = testing.check_chain_law(trees.uniform(2, 3), KeepFirst(), "x0", chain=ch, sigmas=LAW_GRID, churn=None)
    assert not rep.passed


MULTISTEP = [n for n in chains.available_chains() if chains.get_chain(n).example().build(LAW_GRID).history]


@pytest.mark.parametrize("chain", MULTISTEP)
@pytest.mark.parametrize("draft", drafts_serving(available_drafts(), None))
def test_every_draft_keeps_a_multistep_chains_law(chain, draft):
    """A chain whose mean reads the parent's prediction, with every draft: on a chain (the affine
    chain formula, Picard sweeps, memory) and on a tree (per-level means), full and lazy."""
    ch = chains.get_chain(chain).example()
    for tree, coupling, lazy in ((trees.chain(5), "rmc", False), (trees.uniform(2, 3), "grs", True)):
        rep = testing.check_chain_law(
            tree, coupling, draft, chain=ch, sigmas=LAW_GRID, churn=None, trajectories=3000, lazy=lazy
        )
        rep.assert_exact()


STAGED = [n for n in chains.available_chains() if chains.get_chain(n).stages > 1]


@pytest.mark.parametrize("chain", STAGED)
@pytest.mark.parametrize("draft", drafts_serving(available_drafts(), None))
def test_every_draft_keeps_a_staged_chains_law(chain, draft):
    """A chain of two model calls a step, with every draft: on a chain (Picard sweeps make two calls a
    sweep) and on a tree, full and lazy. Its target mean needs both stage calls at the node; the draft's none."""
    ch = chains.get_chain(chain).example()
    for tree, coupling, lazy in ((trees.chain(5), "rmc", False), (trees.uniform(2, 3), "grs", True)):
        rep = testing.check_chain_law(
            tree, coupling, draft, chain=ch, sigmas=LAW_GRID, churn=None, trajectories=3000, lazy=lazy
        )
        rep.assert_exact()


def test_a_staged_chain_declares_its_tableau_and_counts_its_calls():
    """``heun``: two stages; the second at ``sigma'`` from the Euler point; one call into 0; a standard
    run of ``T`` steps makes ``2 T - 1`` calls (NFE and ``stats.calls``), a speculative round two, and its
    last step into 0 one, so each trajectory's NFE is odd as the standard run's; the batch's last round,
    single rows into 0 only, makes one call."""
    assert chains.get_chain("heun").stages == 2 and chains.get_chain("euler").stages == 1
    tr = chains.HeunChurn(s_churn=5.0).build(LAW_GRID)
    T = tr.steps
    assert tr.stages == 2 and tr.standard_calls == 2 * T - 1 and tr.stage_tables.used == (2,) * (T - 1) + (1,)
    assert torch.equal(tr.stage_tables.level[:-1, 1], LAW_GRID[1:-1])
    assert chains.EulerChurn(s_churn=5.0).build(LAW_GRID).standard_calls == T
    from specforest.models.gmm import GaussianMixture

    model = GaussianMixture(MU[None], torch.tensor([S0], dtype=torch.float64))
    calls = [0]

    def counted(x, s, **kw):
        calls[0] += 1
        return model(x, s, **kw)

    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = specforest.sample(counted, x, sigmas=LAW_GRID, chain="heun", seed=1)
    assert calls[0] == out.stats.calls == 2 * T - 1 and bool((out.stats.nfe == 2 * T - 1).all())
    calls[0] = 0
    out = specforest.sample(
        counted, x, sigmas=LAW_GRID, chain=chains.HeunChurn(s_churn=5.0), tree=trees.chain(4), seed=1
    )
    assert calls[0] == out.stats.calls and out.stats.calls % 2 == 1 and out.stats.calls < 2 * T - 1
    assert bool((out.stats.nfe % 2 == 1).all()) and int(out.stats.nfe.max()) <= out.stats.calls


@pytest.mark.parametrize("chain", MULTISTEP)
def test_a_model_calling_draft_keeps_a_multistep_chains_law(chain):
    """The cached self-draft makes its mean by a call (no affine form): the engine adds the
    multistep term to it. Its features are the target's clean prediction (``testing.X0Features``)."""
    from specforest.models.gmm import GaussianMixture

    mu0 = torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64)
    model = testing.X0Features(GaussianMixture(mu0[None], torch.tensor([0.3], dtype=torch.float64)))
    x = torch.randn(3000, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ch = chains.get_chain(chain).example()
    for tree, coupling in ((trees.chain(5), "rmc"), (trees.uniform(2, 2), "grs")):
        out = specforest.sample(
            model, x, sigmas=LAW_GRID, chain=ch, tree=tree, coupling=coupling, draft="cached", seed=2
        )
        testing.check_law(out.samples, LAW_GRID, None, mu0, 0.3, chain=ch).assert_exact()


def test_the_em_chains_closed_form_is_the_papers():
    """testing.chain_law from the tables of chain='em' equals its independent transcription of eqs. 35-37."""
    from specforest.sde import flow_match_grid

    g = flow_match_grid(15)
    mu = torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64)
    m1, v1 = testing.chain_law(g, 0.7, mu, 0.3)
    m2, v2 = testing.chain_law(g, None, mu, 0.3, chain=chains.EM(churn=0.7))
    assert torch.allclose(m1, m2, rtol=1e-12) and abs(v1 - v2) < 1e-12 * v1


@pytest.mark.parametrize("old, new", [("karras_sigmas", "karras_linear_grid"), ("ddpm_sigmas", "ddpm_linear_grid")])
def test_the_old_schedule_names_are_refused_naming_the_linear_grid_and_the_ve_sigmas(old, new):
    """``chains.karras_linear_grid`` returned linear-path levels that a k-diffusion drop-in ran silently at sigma < 1."""
    with pytest.raises(AttributeError, match=rf"chains\.{new}.*specforest\.kdiffusion\.get_sigmas_karras"):
        getattr(chains, old)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        chains.no_such_name  # noqa: B018
