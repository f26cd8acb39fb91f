"""Adapters of pixel-space parameterizations to the linear-path velocity.

Round trips: for a Gaussian data law ``x_0 ~ N(mu, tau^2 I)`` the posterior mean
under any Gaussian corruption is affine and known exactly, so an exact EDM
denoiser, an exact VP noise predictor and an exact VP data predictor can be
written down; each adapter must then return the closed-form velocity of
:class:`specforest.models.GaussianMixture` with one component (whose formula is
derived independently, on the linear path itself).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specforest.models import GaussianMixture
from specforest.models.edm import (
    EDMDenoiserVelocity,
    EpsilonPredictionVelocity,
    VPDenoiser,
    X0PredictionVelocity,
    vp_sigmas,
)

D = 6
MU = torch.linspace(-0.8, 0.6, D, dtype=torch.float64)
TAU = 0.4
GAUSS = GaussianMixture(MU[None], torch.tensor([TAU], dtype=torch.float64))


def exact_denoiser(y: torch.Tensor, s: torch.Tensor, class_labels=None) -> torch.Tensor:
    """``E[x_0 | y = x_0 + s xi]`` for ``x_0 ~ N(MU (+ label shift), TAU^2 I)``."""
    mu = MU if class_labels is None else MU + class_labels.to(y.dtype)[:, None]
    s2 = s.to(y.dtype)[:, None] ** 2
    return mu + TAU**2 / (TAU**2 + s2) * (y - mu)


def ddpm_alphas_cumprod(n: int = 1000) -> torch.Tensor:
    """diffusers' DDPMScheduler default: linear betas 1e-4..0.02."""
    betas = torch.linspace(1e-4, 0.02, n, dtype=torch.float64)
    return torch.cumprod(1.0 - betas, 0)


AC = ddpm_alphas_cumprod()


def abar_of_timestep(k: torch.Tensor) -> torch.Tensor:
    """The documented convention for fractional timesteps: log s interpolated linearly."""
    ls = vp_sigmas(AC).log().numpy()
    s = np.exp(np.interp(k.double().numpy(), np.arange(ls.size), ls))
    return torch.as_tensor(1.0 / (1.0 + s**2))


def exact_eps(x_k: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``E[xi | x_k = sqrt(abar) x_0 + sqrt(1 - abar) xi]``."""
    ab = abar_of_timestep(k)[:, None].to(x_k.dtype)
    a, b = ab.sqrt(), (1 - ab).sqrt()
    return b * (x_k - a * MU) / (a * a * TAU**2 + b * b)


def exact_x0(x_k: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    ab = abar_of_timestep(k)[:, None].to(x_k.dtype)
    a, b = ab.sqrt(), (1 - ab).sqrt()
    return MU + a * TAU**2 / (a * a * TAU**2 + b * b) * (x_k - a * MU)


def exact_v(x_k: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``E[sqrt(abar) xi - sqrt(1 - abar) x_0 | x_k]`` (diffusers' ``v_prediction``)."""
    ab = abar_of_timestep(k)[:, None].to(x_k.dtype)
    return ab.sqrt() * exact_eps(x_k, k) - (1 - ab).sqrt() * exact_x0(x_k, k)


def _states(sig: torch.Tensor, n_per: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s = sig.repeat_interleave(n_per)
    x0 = MU + TAU * torch.randn(s.numel(), D, generator=g, dtype=torch.float64)
    xi = torch.randn(s.numel(), D, generator=g, dtype=torch.float64)
    return (1 - s[:, None]) * x0 + s[:, None] * xi, s


def test_edm_denoiser_round_trip_is_exact_inside_the_range():
    # s = t / (1 - t) in [1e-3, 80]  <=>  t in [~1e-3, ~0.9877]
    sig = torch.tensor([0.0011, 0.01, 0.05, 0.2, 0.5, 0.8, 0.95, 0.98, 0.987], dtype=torch.float64)
    x, s = _states(sig)
    v = EDMDenoiserVelocity(exact_denoiser)(x, s)
    torch.testing.assert_close(v, GAUSS(x, s), rtol=1e-10, atol=1e-10)


def test_edm_wrong_printed_formula_differs():
    """The printed ``x/t - D`` (ERRATA 5) is not the velocity: the test above would catch it."""
    x, s = _states(torch.tensor([0.3], dtype=torch.float64))
    y = x / (1 - s[:, None])
    printed = x / s[:, None] - exact_denoiser(y, s / (1 - s))
    assert (printed - GAUSS(x, s)).abs().max() > 0.1


def test_edm_endpoints_are_finite_and_close_to_the_limits():
    x, s = _states(torch.tensor([0.0, 1e-6, 0.999999, 1.0], dtype=torch.float64), n_per=8)
    v = EDMDenoiserVelocity(exact_denoiser)(x, s)
    assert torch.isfinite(v).all()
    ref = GAUSS(x, s)
    # clipping at s = 80 keeps a small dependence on x: |error| <= tau^2/80 |x| + O(1/80^2)
    err = (v - ref).abs().max(1).values
    assert err[s < 0.5].max() < 1e-2
    assert err[s > 0.5].max() < 0.02 * (1 + x[s > 0.5].abs().max())
    # t = 0: the exact velocity is -x; the noise estimate frozen at sigma_min adds
    # (sigma_min + sigma_min^2) / (tau^2 + sigma_min^2) (x - mu) for this law
    z, lo = s == 0, 1e-3
    assert ((v[z] + x[z]).abs() <= lo * (1 + lo) / TAU**2 * (x[z] - MU).abs() + 1e-12).all()


def test_edm_float32_and_scalar_sigma():
    x, _ = _states(torch.tensor([0.4], dtype=torch.float64))
    v32 = EDMDenoiserVelocity(exact_denoiser)(x.float(), 0.4)
    assert v32.dtype == torch.float32
    ends = EDMDenoiserVelocity(exact_denoiser)(x.float()[:2], torch.tensor([0.0, 1.0]))
    assert torch.isfinite(ends).all()
    torch.testing.assert_close(v32.double(), GAUSS(x, 0.4), atol=1e-5, rtol=1e-5)


def test_edm_passes_conditioning_per_row():
    x, s = _states(torch.tensor([0.3, 0.6], dtype=torch.float64))
    labels = torch.arange(x.shape[0]) % 3
    v = EDMDenoiserVelocity(exact_denoiser)(x, s, class_labels=labels)
    for c in range(3):
        gm = GaussianMixture((MU + c)[None], torch.tensor([TAU], dtype=torch.float64))
        m = labels == c
        torch.testing.assert_close(v[m], gm(x[m], s[m]), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("cls,net", [(EpsilonPredictionVelocity, exact_eps), (X0PredictionVelocity, exact_x0)])
def test_vp_round_trip_is_exact_inside_the_schedule(cls, net):
    adapter = cls(net, AC)
    lo, hi = adapter.sigma_min, adapter.sigma_max  # ~0.01 and ~157 for DDPM's linear schedule
    assert 0.005 < lo < 0.02 and 100 < hi < 200
    sig = torch.tensor([0.011, 0.05, 0.3, 0.5, 0.7, 0.9, 0.99, 0.993], dtype=torch.float64)
    assert (sig / (1 - sig) > lo).all() and (sig / (1 - sig) < hi).all()
    x, s = _states(sig)
    torch.testing.assert_close(adapter(x, s), GAUSS(x, s), rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("cls,net", [(EpsilonPredictionVelocity, exact_eps), (X0PredictionVelocity, exact_x0)])
def test_vp_endpoints_finite(cls, net):
    x, s = _states(torch.tensor([0.0, 1e-5, 1.0], dtype=torch.float64))
    v = cls(net, AC)(x, s)
    assert torch.isfinite(v).all()
    z, lo = s == 0, VPDenoiser(net, AC).sigma_min
    assert ((v[z] + x[z]).abs() <= lo * (1 + lo) / TAU**2 * (x[z] - MU).abs() + 1e-9).all()
    # t = 1: v = x - E[x_0] up to the clip at sigma_max ~ 157
    torch.testing.assert_close(v[s == 1], GAUSS(x[s == 1], s[s == 1]), atol=0.01, rtol=0)


def test_vp_timestep_matches_schedule_at_integers():
    vp = VPDenoiser(exact_eps, AC)
    k = torch.tensor([0, 1, 17, 500, 998, 999])
    torch.testing.assert_close(vp.timestep(vp_sigmas(AC)[k]), k.double(), atol=1e-9, rtol=0)
    q = VPDenoiser(exact_eps, AC, quantize=True).timestep(vp_sigmas(AC)[[10, 11]].mean()[None])
    assert q.item() in (10.0, 11.0)


def test_vp_v_prediction_round_trip_is_exact_and_a_wrong_conversion_is_not():
    sig = torch.tensor([0.011, 0.3, 0.7, 0.99], dtype=torch.float64)
    x, s = _states(sig)
    vp = VPDenoiser(exact_v, AC, "v_prediction")
    adapter = EDMDenoiserVelocity(vp, sigma_min=vp.sigma_min, sigma_max=vp.sigma_max)
    torch.testing.assert_close(adapter(x, s), GAUSS(x, s), rtol=1e-8, atol=1e-8)
    # reading v as if it were the noise misses by O(1)
    wrong = EDMDenoiserVelocity(VPDenoiser(exact_v, AC, "epsilon"), sigma_min=vp.sigma_min, sigma_max=vp.sigma_max)
    assert (wrong(x, s) - GAUSS(x, s)).abs().max() > 0.1


class _Output:
    def __init__(self, sample):
        self.sample = sample


def test_vp_accepts_diffusers_style_output():
    adapter = EpsilonPredictionVelocity(lambda x, k: _Output(exact_eps(x, k)), AC)
    x, s = _states(torch.tensor([0.4], dtype=torch.float64))
    torch.testing.assert_close(adapter(x, s), GAUSS(x, s), rtol=1e-8, atol=1e-8)


def test_bad_arguments():
    with pytest.raises(ValueError, match="sigma_min"):
        EDMDenoiserVelocity(exact_denoiser, sigma_min=0.0)
    with pytest.raises(ValueError, match="sigma_min < sigma_max"):
        EDMDenoiserVelocity(exact_denoiser, sigma_min=2.0, sigma_max=1.0)
    with pytest.raises(TypeError, match="denoiser"):
        EDMDenoiserVelocity(3)
    with pytest.raises(ValueError, match="prediction"):
        VPDenoiser(exact_eps, AC, "flow_prediction")
    with pytest.raises(ValueError, match="decrease"):
        VPDenoiser(exact_eps, AC.flip(0))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        EDMDenoiserVelocity(exact_denoiser)(torch.zeros(2, D, dtype=torch.float64), torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match="shape"):
        EDMDenoiserVelocity(exact_denoiser)(torch.zeros(2, D, dtype=torch.float64), torch.tensor([0.5, 0.2, 0.1]))
