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

import math

import pytest
import torch
from comfy_reference import (
    comfy_ddpm,
    comfy_dpm_2_ancestral_rf,
    comfy_dpmpp_2s_ancestral_rf,
    comfy_dpmpp_3m_sde_const,
    comfy_dpmpp_sde_const,
    comfy_euler_ancestral_rf,
    comfy_lcm,
)
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


def bent(x: torch.Tensor, sigma, **_) -> torch.Tensor:
    """A denoiser not affine along the path, so a multistep sampler's history terms show."""
    return denoiser(x, sigma) + 0.3 * torch.tanh(x)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("eta, s_noise", [(1.0, 1.0), (0.5, 1.05), (1.7, 0.9), (0.0, 1.0)])
def test_dpmpp_3m_sde_with_a_noise_sampler_equals_k_diffusions(dtype, eta, s_noise):
    """k-diffusion 0.1.1.post1's own ``sample_dpmpp_3m_sde``: float64 to 1e-12 of the output's scale."""
    sig = karras().to(dtype)
    x, z = start(32, sig, dtype=dtype), draws(32, len(sig), dtype=dtype)
    kw = dict(eta=eta, s_noise=s_noise, disable=True)
    it = iter(z)
    ref = sampling().sample_dpmpp_3m_sde(bent, x, sig, noise_sampler=lambda a, b: next(it), **kw)
    it = iter(z)
    ours = kdiffusion.sample_dpmpp_3m_sde(bent, x, sig, noise_sampler=lambda a, b: next(it), **kw)
    tol = 1e-12 if dtype == torch.float64 else 1e-3
    assert ours.dtype == dtype
    assert float((ours.double() - ref.double()).abs().max()) <= tol * float(ref.double().abs().max())


class Counted:
    """A denoiser that counts its calls (each a batched call of the rows it is given)."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, x, sigma, **kw):
        self.calls += 1
        return self.fn(x, sigma, **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize(
    "s_churn, s_tmin, s_tmax, s_noise",
    [(20.0, 0.1, 40.0, 1.0), (40.0, 0.0, float("inf"), 1.003), (0.0, 0.0, float("inf"), 1.0), (100.0, 0.5, 10.0, 0.97)],
    ids=["window", "everywhere", "deterministic", "clipped"],
)
def test_heun_with_churn_equals_k_diffusions_sample_heun(dtype, s_churn, s_tmin, s_tmax, s_noise):
    """k-diffusion 0.1.1.post1's own ``sample_heun`` fed the same noise (its global generator): float64 to
    1e-12 of the output's scale, with k-diffusion's ``2 N - 1`` calls (one into 0), counted at the model."""
    sig = karras(15).to(dtype)
    x = start(32, sig, dtype=dtype)
    kw = dict(s_churn=s_churn, s_tmin=s_tmin, s_tmax=s_tmax, s_noise=s_noise, disable=True)
    real, ours_m = Counted(bent), Counted(bent)
    torch.manual_seed(3)
    ref = sampling().sample_heun(real, x, sig, **kw)
    torch.manual_seed(3)
    ours = kdiffusion.sample_heun(ours_m, x, sig, **kw)
    tol = 1e-12 if dtype == torch.float64 else 1e-3
    assert ours.dtype == dtype
    assert float((ours.double() - ref.double()).abs().max()) <= tol * float(ref.double().abs().max())
    assert ours_m.calls == real.calls == 2 * (len(sig) - 1) - 1


TWO_STAGE = [
    ("sample_dpm_2", {"s_churn": 20.0, "s_tmin": 0.1, "s_tmax": 40.0}),
    ("sample_dpm_2", {"s_churn": 100.0, "s_noise": 1.003}),
    ("sample_dpm_2", {}),
    ("sample_dpm_2_ancestral", {}),
    ("sample_dpm_2_ancestral", {"eta": 0.5, "s_noise": 1.05}),
    ("sample_dpm_2_ancestral", {"eta": 1.5}),
    ("sample_dpm_2_ancestral", {"eta": 0.0}),
    ("sample_dpmpp_2s_ancestral", {}),
    ("sample_dpmpp_2s_ancestral", {"eta": 0.5, "s_noise": 1.05}),
    ("sample_dpmpp_2s_ancestral", {"eta": 1.5}),
    ("sample_dpmpp_2s_ancestral", {"eta": 0.0}),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name, kw", TWO_STAGE, ids=[f"{n[7:]}-{i}" for i, (n, _) in enumerate(TWO_STAGE)])
def test_two_call_samplers_equal_k_diffusions(name, kw, dtype):
    """k-diffusion 0.1.1.post1's own ``sample_dpm_2`` (churn from its global generator), ``sample_dpm_2_ancestral``
    and ``sample_dpmpp_2s_ancestral`` (an injected noise sampler) fed the same noise: float64 to 1e-12 of the
    output's scale, with the real function's calls counted at the model (two a step, one where it steps to 0:
    every step with ``eta = 1.5``, where ``sigma_up`` clips to ``sigma'``)."""
    sig = karras(15).to(dtype)
    x = start(32, sig, dtype=dtype)
    real, ours_m = Counted(bent), Counted(bent)
    outs = []
    for fn, m in ((getattr(sampling(), name), real), (getattr(kdiffusion, name), ours_m)):
        extra = {}
        if "ancestral" in name:
            it = iter(draws(32, len(sig), dtype=dtype))
            extra["noise_sampler"] = lambda a, b, it=it: next(it)
        torch.manual_seed(3)
        outs.append(fn(m, x, sig, **kw, **extra, disable=True))
    ref, ours = outs
    tol = 1e-12 if dtype == torch.float64 else 1e-3
    assert ours.dtype == dtype
    assert float((ours.double() - ref.double()).abs().max()) <= tol * float(ref.double().abs().max())
    N = len(sig) - 1
    assert ours_m.calls == real.calls == (N if kw.get("eta") == 1.5 else 2 * N - 1)


@pytest.mark.parametrize("eta", [1.0, 1.5, 1.2])
def test_dpm_2_ancestral_draws_noise_only_where_its_code_steps_down(eta):
    """k-diffusion's ``sample_dpm_2_ancestral`` adds ``sigma_up`` noise in its two-call branch only (``sigma_down > 0``,
    from its own ``get_ancestral_step``): where ``eta > 1`` clips ``sigma_up`` to ``sigma'`` the step is ``x' = D``,
    a point mass. The chain's noise scale is positive exactly there, and its drop-in draws there."""
    sig = karras(15)
    down = torch.tensor([float(sampling().get_ancestral_step(sig[i], sig[i + 1], eta=eta)[0]) for i in range(15)])
    ch = chains.DPM2Ancestral(eta=eta)
    tr = ch.build(linear_grid(sig))
    assert torch.equal(tr.scale > 0, down > 0) and torch.equal(ch.draws_noise(sig), down > 0)
    if eta == 1.2:
        assert bool((down > 0).any()) and bool((down[:-1] == 0).any())  # both kinds of step on this grid


def test_heun_into_zero_is_one_euler_call_and_a_step_counts_two():
    """The stage tables: the second call at ``sigma'`` from the Euler point, weights ``1 - sigma-hat / (2 sigma')``
    and ``sigma-hat / (2 sigma')``; the last step a single call; NFE counts calls (``stats.nfe``, ``stats.calls``)."""
    sig = karras(6)
    tr = chains.HeunChurn().build(linear_grid(sig))
    st = tr.stage_tables
    assert tr.stages == 2 and st.used == (2, 2, 2, 2, 2, 1) and tr.standard_calls == 11
    torch.testing.assert_close(st.weight[:-1, 1], sig[:-2] / (2 * sig[1:-1]), rtol=1e-12, atol=0)
    assert float(st.weight[-1, 1]) == 0.0
    out = kdiffusion.sample(denoiser, start(4, sig), sig, chain="heun", seed=0, disable=True)
    assert out.stats.calls == 11 and bool((out.stats.nfe == 11).all())
    assert torch.equal(out.stats.speedup, torch.ones(4, dtype=torch.float64))


def test_dpmpp_3m_sde_declares_two_past_predictions_read_from_its_third_step():
    """Its tables: ``history = 2``; the prediction two steps back is read from the third step on (k-diffusion's
    ``h_2 is not None``), the one before from the second, neither by the step into 0 (``x' = D``)."""
    tables = chains.DPMPP3MSDE().build(linear_grid(karras(12)))
    assert chains.DPMPP3MSDE.history == tables.history == 2 and tables.past.shape == (12, 2)
    assert bool((tables.past[2:-1] != 0).all()) and bool((tables.past[1, 0] != 0).all())
    assert bool((tables.past[:2, 1] == 0).all()) and bool((tables.past[0] == 0).all())
    assert bool((tables.past[-1] == 0).all())


DPMPP_SDE = [(1.0, 1.0, 0.5), (0.5, 1.05, 0.5), (1.7, 0.9, 0.3), (1.0, 1.0, 0.8), (0.0, 1.0, 0.5)]
"""``(eta, s_noise, r)``: the default, a smaller eta, one that clips ``sigma_up`` to ``sigma'`` (``sigma_down = 0``),
other midpoints, and the deterministic DPM++ SDE."""


class BrownianPair:
    """k-diffusion's noise sampler for ``sample_dpmpp_sde`` built from the chain's own draws ``z`` (one a half-step):
    a step's first call ``(sigma, sigma_s)`` returns ``n_1 = z[2 i]``, its second ``(sigma, sigma')`` returns
    ``n_2 = rho z[2 i] + sqrt(1 - rho^2) z[2 i + 1]`` with ``rho = sqrt((sigma - sigma_s) / (sigma - sigma'))``, the
    correlation of k-diffusion's Brownian tree over the two intervals, computed here from the levels the real
    function passes (so the chain's ``rho`` is checked, not assumed)."""

    def __init__(self, z: list) -> None:
        self.z, self.calls, self.mid = z, 0, None

    def __call__(self, sigma, sigma_to):
        i, second = divmod(self.calls, 2)
        self.calls += 1
        if not second:
            self.mid = float(sigma_to)
            return self.z[2 * i]
        s, nxt = float(sigma), float(sigma_to)
        rho = math.sqrt((s - self.mid) / (s - nxt))
        return rho * self.z[2 * i] + math.sqrt(1.0 - rho * rho) * self.z[2 * i + 1]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("eta, s_noise, r", DPMPP_SDE)
def test_dpmpp_sde_chain_fed_its_draws_equals_k_diffusions_fed_their_brownian_pair(dtype, eta, s_noise, r):
    """k-diffusion 0.1.1.post1's own ``sample_dpmpp_sde`` fed the correlated pair the chain's own draws make
    (:class:`BrownianPair`) and the ``dpmpp_sde`` chain at ``tree=None`` fed those draws by half-step
    (``noise=``): float64 to 1e-12 of the output's scale, with the real function's ``2 N - 1`` calls counted
    at the model."""
    sig = karras(15).to(dtype)
    x, z = start(32, sig, dtype=dtype), draws(32, 2 * 15, dtype=dtype)
    real, ours_m = Counted(bent), Counted(bent)
    kw = dict(eta=eta, s_noise=s_noise, r=r)
    ref = sampling().sample_dpmpp_sde(real, x, sig, noise_sampler=BrownianPair(z), disable=True, **kw)
    out = kdiffusion.sample(ours_m, x, sig, chain=chains.DPMPPSDE(**kw), noise=lambda n: z[n], disable=True)
    tol = 1e-12 if dtype == torch.float64 else 1e-3
    assert out.samples.dtype == dtype
    assert float((out.samples.double() - ref.double()).abs().max()) <= tol * float(ref.double().abs().max())
    assert ours_m.calls == real.calls == out.stats.calls == 2 * 15 - 1


@pytest.mark.parametrize("eta, s_noise, r", DPMPP_SDE[:3])
def test_dpmpp_sde_drop_in_with_any_noise_sampler_equals_k_diffusions(eta, s_noise, r):
    """The drop-in called as k-diffusion's, with a noise sampler whose two draws a step are independent (not the
    Brownian tree's pair): the output is still the real function's (float64, 1e-12 of the scale), and so are its
    callbacks (one a step, at the step's start) and its calls."""
    sig = karras(12)
    x, z = start(16, sig), draws(16, 2 * 12)
    outs, seen, models = [], [], []
    for fn in (sampling().sample_dpmpp_sde, kdiffusion.sample_dpmpp_sde):
        it, got, m = iter(z), [], Counted(bent)
        outs.append(fn(m, x, sig, callback=got.append, noise_sampler=lambda a, b, it=it: next(it), eta=eta,
                       s_noise=s_noise, r=r, disable=True))  # fmt: skip
        seen.append(got)
        models.append(m)
    ref, ours = outs
    assert float((ours - ref).abs().max()) <= 1e-12 * float(ref.abs().max())
    _same_callbacks(_keys(seen[1]), seen[0])
    assert models[0].calls == models[1].calls == 2 * 12 - 1


def test_dpmpp_sde_is_a_chain_of_half_steps_carrying_its_steps_start():
    """Its tables: ``history = 1``; the states are each step's start and its midpoint ``sigma^(1 - r) sigma'^r``
    (k-diffusion's ``sigma_fn(t + r h)``), then 0; the start hands on a combination of the state and its
    prediction that only the end's half-step reads (the step into 0 is ``x' = D``); ``2 N - 1`` calls."""
    sig = karras(8)
    ch = chains.DPMPPSDE(r=0.3)
    tr = ch.build(linear_grid(sig))
    assert chains.DPMPPSDE.history == tr.history == 1 and tr.steps == 15 and tr.standard_calls == 15
    ve = tr.sigmas / (1 - tr.sigmas)
    torch.testing.assert_close(ve[0:-1:2], sig[:-1], rtol=1e-12, atol=0)
    torch.testing.assert_close(ve[1:-1:2], sig[:-2] ** 0.7 * sig[1:-1] ** 0.3, rtol=1e-12, atol=0)
    assert bool((tr.past[1::2, 0] > 0).all()) and bool((tr.past[0::2] == 0).all())
    assert bool((tr.carries[1::2] == 0).all()) and bool((tr.carries[0:-1:2] != 0).all())
    assert bool((tr.scale[:-1] > 0).all()) and float(tr.scale[-1]) == 0.0
    assert ch.grid_step(8).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7]
    for bad in (0.0, 1.0, 1.5, -0.5):
        with pytest.raises(ValueError, match="r must"):
            chains.DPMPPSDE(r=bad)


def test_dpmpp_3m_sde_on_the_linear_path_is_comfys_const_sampler():
    t = torch.linspace(0.98, 0.0, 16, dtype=torch.float64)
    x, z = draws(32, 1, seed=5)[0], draws(32, len(t))

    def linear_bent(y, s, **_):  # a CONST model: D at the linear-path level s
        s = s.reshape(-1, 1).to(torch.float64) if torch.is_tensor(s) else s
        return bent(y / (1 - s), s / (1 - s))

    it = iter(z)
    ref = comfy_dpmpp_3m_sde_const(linear_bent, x, t, lambda a, b: next(it), eta=0.8, s_noise=1.02)
    it = iter(z)
    ours = kdiffusion.sample_dpmpp_3m_sde(
        linear_bent, x, t, eta=0.8, s_noise=1.02, noise_sampler=lambda a, b: next(it), path="linear", disable=True
    )
    assert float((ours - ref).abs().max()) <= 1e-12 * float(ref.abs().max())


def const_denoiser(y: torch.Tensor, s, **_) -> torch.Tensor:
    """A CONST model's denoiser for data ``N(MU, S0^2 I)``: ``E[x_0 | y = (1 - s) x_0 + s xi]`` at the linear-path
    level ``s``, finite at ``s = 1`` (where it is ``MU``)."""
    s = s.reshape(-1, *[1] * (y.ndim - 1)).to(torch.float64) if torch.is_tensor(s) else s
    a = 1 - s
    return (MU + S0**2 * a / (a**2 * S0**2 + s**2) * (y.to(torch.float64) - a * MU)).to(y.dtype)


def const_bent(y: torch.Tensor, s, **_) -> torch.Tensor:
    """:func:`const_denoiser` made not affine along the path, so a second stage's point shows."""
    return const_denoiser(y, s) + 0.3 * torch.tanh(y)


RF_TWO_STAGE = [
    ("sample_dpm_2_ancestral", comfy_dpm_2_ancestral_rf, {}, 0.98),
    ("sample_dpm_2_ancestral", comfy_dpm_2_ancestral_rf, {"eta": 0.5, "s_noise": 1.05}, 1.0),
    ("sample_dpm_2_ancestral", comfy_dpm_2_ancestral_rf, {"eta": 1.5, "s_noise": 0.9}, 0.98),
    ("sample_dpm_2_ancestral", comfy_dpm_2_ancestral_rf, {"eta": 0.0}, 0.98),
    ("sample_dpmpp_2s_ancestral", comfy_dpmpp_2s_ancestral_rf, {}, 1.0),
    ("sample_dpmpp_2s_ancestral", comfy_dpmpp_2s_ancestral_rf, {"eta": 0.5, "s_noise": 1.05}, 0.98),
    ("sample_dpmpp_2s_ancestral", comfy_dpmpp_2s_ancestral_rf, {"eta": 1.5, "s_noise": 0.9}, 1.0),
    ("sample_dpmpp_2s_ancestral", comfy_dpmpp_2s_ancestral_rf, {"eta": 0.0}, 0.98),
]


@pytest.mark.parametrize(
    "name, ref_fn, kw, t0", RF_TWO_STAGE, ids=[f"{n[7:]}-{i}" for i, (n, *_) in enumerate(RF_TWO_STAGE)]
)
def test_two_call_ancestral_samplers_on_the_linear_path_are_comfys_rf_samplers(name, ref_fn, kw, t0):
    """``path="linear"`` (ComfyUI's ``CONST`` models) against ComfyUI's ``sample_dpm_2_ancestral_RF`` and
    ``sample_dpmpp_2s_ancestral_RF`` (``comfy_reference``), fed the same noise: float64 to 1e-12 of the
    output's scale, with the same calls at the model (two a step, one into 0), from ``t = 1`` too (where
    DPM++ 2S's second call is at ComfyUI's 0.9999)."""
    t = torch.linspace(t0, 0.0, 16, dtype=torch.float64)
    x, z = draws(32, 1, seed=5)[0], draws(32, len(t))
    real, ours_m = Counted(const_bent), Counted(const_bent)
    ref = ref_fn(real, x, t, z, **kw)
    it = iter(z)
    ours = getattr(kdiffusion, name)(
        ours_m, x, t, **kw, noise_sampler=lambda a, b: next(it), path="linear", disable=True
    )
    assert torch.isfinite(ref).all()
    assert float((ours - ref).abs().max()) <= 1e-12 * float(ref.abs().max())
    assert ours_m.calls == real.calls == 2 * (len(t) - 1) - 1


@pytest.mark.parametrize("chain", [chains.DPM2Ancestral, chains.DPMPP2SAncestral])
def test_an_eta_that_steps_below_zero_on_the_linear_path_is_refused(chain):
    """ComfyUI's ``_RF`` two-call samplers take the logarithm of ``sigma_down = t' (1 + eta (t' / t - 1))``: an
    ``eta`` that puts it below 0 before the last step (NaN there) is refused, naming the largest the grid allows;
    that one (DPM-Solver-2's: where ``sigma_down`` is 0, its Euler step) or one just below it builds."""
    t = torch.linspace(0.98, 0.0, 16, dtype=torch.float64)
    top = float((t[:-2] / (t[:-2] - t[1:-1])).min())
    chain(eta=top * (1 - 1e-9), path="linear").build(t)
    with pytest.raises(ValueError, match=r"eta=\S+ puts sigma_down below 0 at step \d+ .*eta must be"):
        chain(eta=1.01 * top, path="linear").build(t)
    with pytest.raises(ValueError, match="path must be one of"):
        chain(path="const")


def _offset(t: torch.Tensor) -> torch.Tensor:
    """``t`` with ComfyUI's ``offset_first_sigma_for_snr`` of a shift-1 flow model: a first level 1 becomes ``1 - 1e-4``."""
    if float(t[0]) < 1.0:
        return t
    t = t.clone()
    t[0] = 1.0 - 1e-4
    return t


@pytest.mark.parametrize("t0", [0.98, 1.0])
@pytest.mark.parametrize("eta, s_noise, r", DPMPP_SDE)
def test_dpmpp_sde_on_the_linear_path_is_comfys_const_sampler(eta, s_noise, r, t0):
    """``path="linear"`` against ComfyUI's ``sample_dpmpp_sde`` for a ``CONST`` model (``comfy_reference``): fed the
    correlated pair the chain's own draws make (:class:`BrownianPair`, its ``rho`` computed from the levels ComfyUI
    passes, the linear ones), the chain at ``tree=None`` fed those draws by half-step, and the drop-in called with
    that noise sampler, are ComfyUI's output: float64 to 1e-12 of the scale, ``2 N - 1`` calls. From ``t = 1``
    ComfyUI moves the first level to ``percent_to_sigma(1e-4)``, the grid specforest is given."""
    t = torch.linspace(t0, 0.0, 13, dtype=torch.float64)
    x, z = draws(32, 1, seed=5)[0], draws(32, 2 * 12)
    kw = dict(eta=eta, s_noise=s_noise, r=r)
    real, ours_m, drop_m = Counted(const_bent), Counted(const_bent), Counted(const_bent)
    ref = comfy_dpmpp_sde_const(real, x, t, BrownianPair(z), **kw)
    chain = chains.DPMPPSDE(**kw, path="linear")
    out = kdiffusion.sample(ours_m, x, _offset(t), chain=chain, path="linear", noise=lambda n: z[n], disable=True)
    drop = kdiffusion.sample_dpmpp_sde(drop_m, x, _offset(t), noise_sampler=BrownianPair(z), path="linear", **kw)
    assert torch.isfinite(ref).all()
    for ours in (out.samples, drop):
        assert float((ours - ref).abs().max()) <= 1e-12 * float(ref.abs().max())
    assert ours_m.calls == drop_m.calls == real.calls == out.stats.calls == 2 * 12 - 1


class VECorrelation(chains.DPMPPSDE):
    """A wrong ComfyUI DPM++ SDE for a ``CONST`` model: the two noises' correlation k-diffusion's, of the VE levels
    ``sigma = t / (1 - t)``, where ComfyUI queries its Brownian tree at the linear levels ``t``."""

    def noise_correlation(self, s, s_mid, s_next):
        ve = [v / (1.0 - v) for v in (s, s_mid, s_next)]
        return super().noise_correlation(*ve)


class IndependentHalves(chains.DPMPPSDE):
    """A wrong DPM++ SDE: the two noises of a step independent (``rho = 0``), as a noise sampler that draws afresh
    at each call would make them."""

    def noise_correlation(self, s, s_mid, s_next):
        return torch.zeros_like(s)


@pytest.mark.filterwarnings("ignore:Should have ta>=t0")
def test_speculated_dpmpp_sde_on_the_linear_path_matches_comfys_samples_and_rejects_the_ve_correlation():
    """Against ComfyUI's ``sample_dpmpp_sde`` for a ``CONST`` model (``comfy_reference``) with its default Brownian-tree
    noise (torchsde, queried at the linear levels), 4 steps from ``t = 1`` (its offset first level), where the
    correlation shows most: its samples pass the linear chain's closed form; a GRS tree and an RMC chain, each full
    and lazy, agree with its samples and with that closed form. The closed form rejects the chain with k-diffusion's VE
    correlation on these levels and with independent noises, and the two-sample comparison the latter."""
    pytest.importorskip("torchsde")
    t = torch.linspace(1.0, 0.0, 5, dtype=torch.float64)
    x = torch.randn(N_LAW, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    real = comfy_dpmpp_sde_const(const_denoiser, x, t, seed=7)
    right = chains.DPMPPSDE(path="linear")
    testing.check_law(real, _offset(t), None, MU, S0, chain=right).assert_exact()
    run = dict(path="linear", seed=9, disable=True)
    cases = ((trees.uniform(2, 3), "grs", False), (trees.uniform(2, 3), "grs", True), (trees.chain(4), "rmc", True))
    for tree, coupling, lazy in (*cases, (trees.chain(4), "rmc", False)):
        ours = kdiffusion.sample_dpmpp_sde(
            const_denoiser, x, _offset(t), tree=tree, coupling=coupling, lazy=lazy, draft="x0", **run
        )
        assert min(_two_sample_p(ours, real)) > 1e-4, (tree, coupling, lazy)
        testing.check_law(ours, _offset(t), None, MU, S0, chain=right).assert_exact()
    for wrong in (VECorrelation(path="linear"), IndependentHalves(path="linear")):
        out = kdiffusion.sample(const_denoiser, x, _offset(t), chain=wrong, tree=trees.uniform(2, 3), draft="x0", **run)
        assert not testing.check_law(out.samples, _offset(t), None, MU, S0, chain=right).passed, wrong
        if isinstance(wrong, IndependentHalves):
            assert min(_two_sample_p(out.samples, real)) < 1e-6


N_RF = 3000


@pytest.mark.parametrize(
    "name, chain, kw, tree, coupling",
    [
        ("sample_dpm_2_ancestral", chains.DPM2Ancestral(path="linear"), {}, trees.uniform(2, 3), "grs"),
        (
            "sample_dpm_2_ancestral",
            chains.DPM2Ancestral(eta=0.7, path="linear"),
            {"eta": 0.7, "lazy": True},
            trees.chain(4),
            "rmc",
        ),
        ("sample_dpmpp_2s_ancestral", chains.DPMPP2SAncestral(path="linear"), {}, trees.uniform(2, 3), "grs"),
        (
            "sample_dpmpp_2s_ancestral",
            chains.DPMPP2SAncestral(s_noise=1.05, path="linear"),
            {"s_noise": 1.05, "lazy": True},
            trees.chain(4),
            "rmc",
        ),
    ],
)
def test_speculated_rf_samplers_keep_the_chains_law(name, chain, kw, tree, coupling):
    """With a tree, on a CONST model (``path="linear"``), from ``N(0, I)`` at ``t = 1``: the closed form of the
    linear path's chain (which the parity test above ties to ComfyUI's ``_RF`` code); the chain with 10% more
    noise is rejected by the same test."""
    t = torch.linspace(1.0, 0.0, 21, dtype=torch.float64)
    x = torch.randn(N_RF, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = getattr(kdiffusion, name)(
        const_denoiser, x, t, **kw, path="linear", tree=tree, coupling=coupling, draft="x0", seed=4, disable=True
    )
    testing.check_law(out, t, None, MU, S0, chain=chain).assert_exact()
    rep = testing.check_law(out, t, None, MU, S0, chain=chain.replace(s_noise=1.1 * chain.s_noise))
    assert not rep.passed


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
        (kdiffusion.sample_dpmpp_3m_sde, {}, "dpmpp_3m_sde", trees.uniform(2, 3), "grs"),
        (kdiffusion.sample_dpmpp_3m_sde, {"eta": 0.7, "lazy": True}, chains.DPMPP3MSDE(eta=0.7), trees.chain(4), "rmc"),
        (kdiffusion.sample_dpmpp_3m_sde, {"lazy": True}, "dpmpp_3m_sde", trees.uniform(2, 3), "grs"),
        (kdiffusion.sample_heun, {"s_churn": 5.0}, chains.HeunChurn(s_churn=5.0), trees.uniform(2, 3), "grs"),
        (kdiffusion.sample_heun, {"s_churn": 5.0, "lazy": True}, chains.HeunChurn(s_churn=5.0), trees.chain(4), "rmc"),
        (kdiffusion.sample_dpm_2, {"s_churn": 5.0}, chains.DPM2Churn(s_churn=5.0), trees.uniform(2, 3), "grs"),
        (kdiffusion.sample_dpm_2_ancestral, {}, "dpm_2_ancestral", trees.uniform(2, 3), "grs"),
        (
            kdiffusion.sample_dpm_2_ancestral,
            {"eta": 0.7, "lazy": True},
            chains.DPM2Ancestral(eta=0.7),
            trees.chain(4),
            "rmc",
        ),
        (kdiffusion.sample_dpmpp_2s_ancestral, {}, "dpmpp_2s_ancestral", trees.uniform(2, 3), "grs"),
        (kdiffusion.sample_dpmpp_2s_ancestral, {"lazy": True}, "dpmpp_2s_ancestral", trees.chain(4), "rmc"),
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


@pytest.mark.filterwarnings("ignore:Should have ta>=t0")
def test_speculated_dpmpp_3m_sde_matches_the_real_functions_samples():
    """Against k-diffusion's own run with its default Brownian-tree noise (torchsde), with a GRS tree and
    an RMC chain, full and lazy; the same comparison rejects eta 0.5 for 1 (10 steps, where their laws differ
    most)."""
    sig = karras(10)
    x = ve_start(N_LAW, sig, seed=3)
    torch.manual_seed(0)
    real = sampling().sample_dpmpp_3m_sde(denoiser, x, sig, disable=True)
    run = dict(seed=9, disable=True)
    for tree, coupling, lazy in ((trees.uniform(2, 3), "grs", False), (trees.chain(4), "rmc", True)):
        ours = kdiffusion.sample_dpmpp_3m_sde(denoiser, x, sig, tree=tree, coupling=coupling, lazy=lazy, **run)
        assert min(_two_sample_p(ours, real)) > 1e-4
    wrong = kdiffusion.sample_dpmpp_3m_sde(denoiser, x, sig, eta=0.5, tree=trees.uniform(2, 3), **run)
    assert min(_two_sample_p(wrong, real)) < 1e-6


@pytest.mark.filterwarnings("ignore:Should have ta>=t0")
def test_speculated_dpmpp_sde_matches_the_real_functions_samples_and_rejects_independent_noises():
    """Against k-diffusion's own ``sample_dpmpp_sde`` with its default Brownian-tree noise (torchsde: its two draws a
    step correlated), 10 Karras steps: a GRS tree and an RMC chain, full and lazy, with the x0 and velocity drafts,
    agree with it; the same comparison rejects the chain with independent noises for the two halves, and the real
    function fed independent draws. The tree's run makes fewer sequential calls than the real function's ``2 N - 1``."""
    pytest.importorskip("torchsde")
    sig = karras(10)
    x = ve_start(N_LAW, sig, seed=3)
    torch.manual_seed(0)
    real = sampling().sample_dpmpp_sde(denoiser, x, sig, disable=True)
    run = dict(seed=9, disable=True)
    for tree, coupling, lazy, draft in (
        (trees.uniform(2, 3), "grs", False, "x0"),
        (trees.chain(4), "rmc", True, "x0"),
        (trees.chain(4), "rmc", False, "velocity"),
    ):
        ours = kdiffusion.sample_dpmpp_sde(
            denoiser, x, sig, tree=tree, coupling=coupling, lazy=lazy, draft=draft, **run
        )
        assert min(_two_sample_p(ours, real)) > 1e-4, (tree, coupling, lazy, draft)
    counted = Counted(denoiser)
    kdiffusion.sample_dpmpp_sde(counted, x, sig, tree=trees.uniform(2, 3), draft="x0", **run)
    assert counted.calls < 2 * 10 - 1
    wrong = kdiffusion.sample(denoiser, x, sig, chain=IndependentHalves(), tree=trees.uniform(2, 3), draft="x0", **run)
    assert min(_two_sample_p(wrong.samples, real)) < 1e-6
    assert not law(wrong.samples, sig, "dpmpp_sde").passed
    torch.manual_seed(0)
    fresh = sampling().sample_dpmpp_sde(denoiser, x, sig, noise_sampler=lambda a, b: torch.randn_like(x), disable=True)
    assert min(_two_sample_p(fresh, real)) < 1e-6


def test_speculated_heun_matches_the_real_functions_samples_and_rejects_a_wrong_churn():
    """Against k-diffusion's own ``sample_heun`` (``s_churn`` 5, its global generator), with a GRS tree and an
    RMC chain, full and lazy; the same comparison and the chain's closed form reject ``s_churn`` 1 for 5.
    The tree's run makes fewer sequential calls than the real function's ``2 N - 1``. 10 steps: Heun's
    discretization error, where the churn shows, is larger there."""
    sig = karras(10)
    x = ve_start(N_LAW, sig, seed=3)
    torch.manual_seed(0)
    real = sampling().sample_heun(denoiser, x, sig, s_churn=5.0, disable=True)
    run = dict(seed=9, disable=True, draft="x0")
    for tree, coupling, lazy in ((trees.uniform(2, 3), "grs", False), (trees.chain(4), "rmc", True)):
        ours = kdiffusion.sample_heun(denoiser, x, sig, s_churn=5.0, tree=tree, coupling=coupling, lazy=lazy, **run)
        assert min(_two_sample_p(ours, real)) > 1e-4
    out = kdiffusion.sample(denoiser, x, sig, chain=chains.HeunChurn(s_churn=5.0), tree=trees.uniform(2, 3), **run)
    assert out.stats.calls < 2 * 10 - 1 and float(out.stats.speedup.mean()) > 1.0
    wrong = kdiffusion.sample_heun(denoiser, x, sig, s_churn=1.0, tree=trees.uniform(2, 3), **run)
    assert min(_two_sample_p(wrong, real)) < 1e-6
    assert not law(wrong, sig, chains.HeunChurn(s_churn=5.0)).passed


@pytest.mark.parametrize(
    "name, right, wrong",
    [
        ("sample_dpm_2", {"s_churn": 5.0}, {"s_churn": 1.0}),
        ("sample_dpm_2_ancestral", {}, {"eta": 0.5}),
        ("sample_dpmpp_2s_ancestral", {}, {"eta": 0.5}),
    ],
    ids=["dpm_2", "dpm_2_ancestral", "dpmpp_2s_ancestral"],
)
def test_speculated_two_call_samplers_match_the_real_functions_samples(name, right, wrong):
    """Against k-diffusion's own function with its default noise (torch's global generator), with a GRS tree and
    an RMC chain, full and lazy, 10 Karras steps; the same comparison rejects the wrong setting (``s_churn`` 1
    for 5, ``eta`` 0.5 for 1). The tree's run makes fewer sequential calls than the real function's ``2 N - 1``."""
    sig = karras(10)
    x = ve_start(N_LAW, sig, seed=3)
    torch.manual_seed(0)
    real = getattr(sampling(), name)(denoiser, x, sig, **right, disable=True)
    run = dict(seed=9, disable=True, draft="x0")
    fn = getattr(kdiffusion, name)
    for tree, coupling, lazy in ((trees.uniform(2, 3), "grs", False), (trees.chain(4), "rmc", True)):
        ours = fn(denoiser, x, sig, **right, tree=tree, coupling=coupling, lazy=lazy, **run)
        assert min(_two_sample_p(ours, real)) > 1e-4
    counted = Counted(denoiser)
    fn(counted, x, sig, **right, tree=trees.uniform(2, 3), **run)
    assert counted.calls < 2 * 10 - 1
    bad = fn(denoiser, x, sig, **wrong, tree=trees.uniform(2, 3), **run)
    assert min(_two_sample_p(bad, real)) < 1e-6


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
    with pytest.raises(ValueError, match="no stochastic step"):
        kdiffusion.sample_dpmpp_3m_sde(denoiser, x, sig, eta=0.0, tree=trees.chain(2), seed=0, disable=True)
    with pytest.raises(ValueError, match="eta"):
        kdiffusion.sample_dpmpp_3m_sde(denoiser, x, sig, eta=-0.5, disable=True)
    with pytest.raises(ValueError, match="s_noise"):
        kdiffusion.sample_dpmpp_3m_sde(denoiser, x, sig, s_noise=0.0, disable=True)
    with pytest.raises(ValueError, match="no stochastic step"):
        kdiffusion.sample_dpmpp_sde(denoiser, x, sig, eta=0.0, tree=trees.chain(2), seed=0, disable=True)
    with pytest.raises(ValueError, match="r must be in"):
        kdiffusion.sample_dpmpp_sde(denoiser, x, sig, r=1.0, disable=True)
    with pytest.raises(ValueError, match=r"sigmas must start below 1 .*percent_to_sigma\(1e-4\)"):
        kdiffusion.sample_dpmpp_sde(const_denoiser, x, torch.linspace(1.0, 0.0, 5, dtype=x.dtype), path="linear")
    assert chains.get_chain("dpmpp_sde") == chains.DPMPPSDE()  # no longer refused
    with pytest.raises(ValueError, match="sample_ddpm is defined on VE noise levels"):
        kdiffusion.sample_ddpm(denoiser, x, sig / (1 + sig), path="linear", disable=True)
    # with no tree, the deterministic settings run
    assert kdiffusion.sample_euler(denoiser, x, sig, disable=True).shape == x.shape


# -- randomness: generator, seed and ComfyUI's extra_args["seed"] ---------------------------------

DROP_INS = [
    (kdiffusion.sample_euler_ancestral, {}),
    (kdiffusion.sample_euler, {"s_churn": 20.0}),
    (kdiffusion.sample_dpmpp_2m_sde, {}),
    (kdiffusion.sample_ddpm, {}),
    (kdiffusion.sample_lcm, {}),
    (kdiffusion.sample_dpmpp_3m_sde, {}),
    (kdiffusion.sample_heun, {"s_churn": 20.0}),
    (kdiffusion.sample_dpm_2, {"s_churn": 20.0}),
    (kdiffusion.sample_dpm_2_ancestral, {}),
    (kdiffusion.sample_dpmpp_2s_ancestral, {}),
    (kdiffusion.sample_dpmpp_sde, {}),
]
DROP_IN_IDS = [
    "euler_ancestral", "euler", "dpmpp_2m_sde", "ddpm", "lcm", "dpmpp_3m_sde", "heun", "dpm_2", "dpm_2_ancestral",
    "dpmpp_2s_ancestral", "dpmpp_sde",
]  # fmt: skip
CHURNED = (kdiffusion.sample_euler, kdiffusion.sample_heun, kdiffusion.sample_dpm_2)


@pytest.mark.parametrize("tree", [None, trees.chain(2)], ids=["standard", "tree"])
@pytest.mark.parametrize("fn, kw", DROP_INS, ids=DROP_IN_IDS)
def test_drop_ins_draw_from_the_generator(fn, kw, tree):
    """A generator's seed decides the samples, torch's global generator does not."""
    sig = karras(6)
    x = start(4, sig)

    def run(seed: int, global_seed: int) -> torch.Tensor:
        torch.manual_seed(global_seed)
        g = torch.Generator().manual_seed(seed)
        return fn(denoiser, x, sig, **kw, tree=tree, generator=g, draft="x0", disable=True)

    a, b, c = run(1, 0), run(1, 5), run(2, 0)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # the generator gives the run its seed, as specforest.sample takes it
    seed = int(torch.randint(0, 2**63 - 1, (), generator=torch.Generator().manual_seed(1)))
    assert torch.equal(a, fn(denoiser, x, sig, **kw, tree=tree, seed=seed, draft="x0", disable=True))


@pytest.mark.parametrize("fn, kw", DROP_INS, ids=DROP_IN_IDS)
def test_drop_ins_refuse_two_sources_of_randomness_naming_both(fn, kw):
    sig = karras(6)
    x = start(2, sig)
    g = torch.Generator().manual_seed(0)
    for tree in (None, trees.chain(2)):
        with pytest.raises(ValueError, match=r"seed=3 and generator"):
            fn(denoiser, x, sig, **kw, tree=tree, seed=3, generator=g, disable=True)
        with pytest.raises(ValueError, match=r"seed=3 and extra_args\['seed'\] = 4"):
            fn(denoiser, x, sig, {"seed": 4}, **kw, tree=tree, seed=3, disable=True)
        with pytest.raises(ValueError, match=r"generator and extra_args\['seed'\] = 4"):
            fn(denoiser, x, sig, {"seed": torch.tensor(4)}, **kw, tree=tree, generator=g, disable=True)
    if "noise_sampler" in fn.__code__.co_varnames:
        with pytest.raises(ValueError, match=r"noise_sampler and generator"):
            fn(denoiser, x, sig, **kw, noise_sampler=lambda a, b: torch.randn_like(x), generator=g, disable=True)
    # the same seed given twice is one seed
    same = fn(denoiser, x, sig, {"seed": torch.tensor(3)}, **kw, seed=3, disable=True)
    assert torch.equal(same, fn(denoiser, x, sig, **kw, seed=3, disable=True))


# -- the callback: k-diffusion's dict, as its own functions pass it -------------------------------


def _keys(seen: list) -> list:
    return [{k: d[k] for k in kdiffusion.KEYS} for d in seen]


def _same_callbacks(ours: list, ref: list) -> None:
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref, strict=True):
        assert list(a) == list(b) == list(kdiffusion.KEYS)
        assert a["i"] == b["i"] and type(a["i"]) is int
        for k in ("sigma", "sigma_hat"):
            assert a[k].ndim == 0 and a[k].dtype == b[k].dtype
            torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=0)
        for k in ("x", "denoised"):
            torch.testing.assert_close(a[k], b[k], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", ["sample_euler", "sample_heun", "sample_dpm_2"])
@pytest.mark.parametrize(
    "s_churn, s_tmin, s_tmax",
    [(20.0, 0.1, 40.0), (4.0, 0.0, float("inf")), (100.0, 0.5, 10.0)],
    ids=["window", "below-clip", "clipped"],
)
def test_euler_callback_is_k_diffusions_with_churn(s_churn, s_tmin, s_tmax, name):
    """``sigma_hat`` is the churned level the model was called at, ``x`` the churned state (Heun's: its
    first stage's, as k-diffusion reports it)."""
    sig = karras(12)
    x = start(8, sig)
    kw = dict(s_churn=s_churn, s_tmin=s_tmin, s_tmax=s_tmax, disable=True)
    ref, ours = [], []
    torch.manual_seed(3)
    getattr(sampling(), name)(denoiser, x, sig, callback=ref.append, **kw)
    torch.manual_seed(3)
    getattr(kdiffusion, name)(denoiser, x, sig, callback=ours.append, **kw)
    assert any(bool(d["sigma_hat"] > d["sigma"]) for d in ref)  # the churn binds somewhere
    if s_tmin > 0 or s_tmax < float("inf"):
        assert any(bool(d["sigma_hat"] == d["sigma"]) for d in ref[:-1])  # and the window binds somewhere
    _same_callbacks(_keys(ours), ref)


@pytest.mark.parametrize(
    "name",
    [
        "sample_euler_ancestral",
        "sample_dpmpp_2m_sde",
        "sample_dpmpp_3m_sde",
        "sample_dpm_2_ancestral",
        "sample_dpmpp_2s_ancestral",
    ],
)
def test_ancestral_callbacks_are_k_diffusions(name):
    sig = karras(10)
    x, z = start(8, sig), draws(8, len(sig))
    ref, ours = [], []
    it = iter(z)
    getattr(sampling(), name)(denoiser, x, sig, callback=ref.append, noise_sampler=lambda a, b: next(it), disable=True)
    it = iter(z)
    getattr(kdiffusion, name)(denoiser, x, sig, callback=ours.append, noise_sampler=lambda a, b: next(it), disable=True)
    _same_callbacks(_keys(ours), ref)
    assert all(d["sigma_hat"] is not None and bool(d["sigma_hat"] == d["sigma"]) for d in ours)


@pytest.mark.parametrize("fn, kw", DROP_INS, ids=DROP_IN_IDS)
def test_speculated_callbacks_report_the_level_the_model_saw(fn, kw):
    """With a tree, ``sigma_hat`` is the level of step ``i``'s state (EDM's churned level for ``euler``),
    the level the slowest trajectory's row was evaluated at."""
    sig = karras(10)
    seen = []
    fn(denoiser, start(6, sig), sig, **kw, callback=seen.append, tree=trees.chain(3), draft="x0", seed=2, disable=True)
    assert seen
    half = fn is kdiffusion.sample_dpmpp_sde  # a chain of half-steps: grid step i begins at its step 2 i
    for d in seen:
        slowest = d["step"] == (2 * d["i"] if half else d["i"])
        torch.testing.assert_close(
            d["row_sigma"][slowest], d["sigma_hat"].expand(int(slowest.sum())), rtol=1e-12, atol=0
        )
        assert bool(d["sigma_hat"] >= d["sigma"]) and bool(d["sigma"] == sig[d["i"]])
    churned = [bool(d["sigma_hat"] > d["sigma"]) for d in seen]
    assert any(churned) == (fn in CHURNED)


# -- the run's statistics: each drop-in is kdiffusion.sample with its chain -----------------------


def test_the_docs_stats_snippet_runs(capsys):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "kdiffusion.md").read_text()
    (block,) = [
        b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "chain=chains.EulerChurn(s_churn=10.0)" in b
    ]
    exec(compile(block, "docs/kdiffusion.md", "exec"), {})
    calls = int(capsys.readouterr().out.split()[0])
    assert 0 < calls < 16


@pytest.mark.parametrize("tree", [None, trees.chain(3)], ids=["standard", "tree"])
@pytest.mark.parametrize(
    "fn, kw, chain",
    [
        (
            kdiffusion.sample_euler_ancestral,
            {"eta": 0.8, "s_noise": 1.02},
            chains.EulerAncestral(eta=0.8, s_noise=1.02),
        ),
        (kdiffusion.sample_euler, {"s_churn": 20.0, "s_tmax": 40.0}, chains.EulerChurn(s_churn=20.0, s_tmax=40.0)),
        (kdiffusion.sample_dpmpp_2m_sde, {"solver_type": "heun"}, chains.DPMPP2MSDE(solver_type="heun")),
        (kdiffusion.sample_ddpm, {}, chains.DDPM()),
        (kdiffusion.sample_lcm, {}, chains.LCM()),
        (kdiffusion.sample_dpmpp_3m_sde, {"eta": 0.6, "s_noise": 1.1}, chains.DPMPP3MSDE(eta=0.6, s_noise=1.1)),
        (kdiffusion.sample_heun, {"s_churn": 20.0, "s_tmax": 40.0}, chains.HeunChurn(s_churn=20.0, s_tmax=40.0)),
        (kdiffusion.sample_dpm_2, {"s_churn": 20.0, "s_tmin": 0.5}, chains.DPM2Churn(s_churn=20.0, s_tmin=0.5)),
        (kdiffusion.sample_dpm_2_ancestral, {"eta": 0.7}, chains.DPM2Ancestral(eta=0.7)),
        (kdiffusion.sample_dpmpp_2s_ancestral, {"s_noise": 1.05}, chains.DPMPP2SAncestral(s_noise=1.05)),
        (kdiffusion.sample_dpmpp_sde, {"eta": 0.8, "r": 0.4}, chains.DPMPPSDE(eta=0.8, r=0.4)),
    ],
    ids=DROP_IN_IDS,
)
def test_a_drop_in_is_kdiffusion_sample_with_its_chain(fn, kw, chain, tree):
    """What ``docs/kdiffusion.md`` says to call for a drop-in's statistics gives its samples, bitwise."""
    sig = karras(8)
    x = start(4, sig)
    run = dict(tree=tree, draft="x0", seed=5, disable=True)
    out = kdiffusion.sample(denoiser, x, sig, chain=chain, **run)
    assert torch.equal(out.samples, fn(denoiser, x, sig, **kw, **run))
    assert out.stats.calls >= 1 and out.stats.speedup.shape == (4,)


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
