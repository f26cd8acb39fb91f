"""Every regime of a sampler's parameters that a user can reach, against the sampler's own code.

The batteries of ``test_chains.py`` and ``test_kdiffusion_samplers.py`` run each chain at a few
settings, and a ``min``, ``max`` or window of a step that never binds there could be written wrong
unseen. Here each is reached on its binding side and on the other:

* EDM's churn (k-diffusion's ``sample_euler``): ``s_churn / N`` below its clip ``sqrt 2 - 1``, an
  ``s_tmin`` / ``s_tmax`` window with steps inside and outside it, and window edges at grid levels;
* ``eta > 1`` on Euler ancestral, where ``get_ancestral_step``'s ``min(sigma_to, ...)`` binds;
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
    number of draws. ``sample_euler`` draws ``torch.randn_like`` itself: it is patched for the call."""
    count = [0]

    def draw(*_, **__) -> torch.Tensor:
        count[0] += 1
        return torch.full((1, D), 1.0 if count[0] - 1 == unit else 0.0, dtype=torch.float64)

    if fn is sampling().sample_euler:
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


def test_churn_settings_reach_below_the_clip_and_both_sides_of_the_window():
    """The settings below are what they claim: gamma is ``s_churn / N``, not the clip, and the window
    leaves levels out above and below."""
    sig = karras()
    N = len(sig) - 1
    assert CHURN["s_churn"] / N < math.sqrt(2.0) - 1.0
    inside = (sig[:-1] >= CHURN["s_tmin"]) & (sig[:-1] <= CHURN["s_tmax"])
    assert bool(inside.any()) and bool((sig[:-1] > CHURN["s_tmax"]).any()) and bool((sig[:-1] < CHURN["s_tmin"]).any())


@pytest.mark.parametrize("s_noise", [1.0, 1.4])
def test_euler_below_the_clip_in_a_window_equals_k_diffusions_sample_euler(s_noise):
    sig = karras()
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
