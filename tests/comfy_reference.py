"""ComfyUI's samplers and DDIM with eta, written here as their code computes them, in their own coordinates.

ComfyUI is not on the package registries, so these are transcriptions of its
``comfy/k_diffusion/sampling.py`` (``sample_ddpm`` / ``DDPMSampler_step``, ``sample_lcm``,
``sample_euler_ancestral_RF``, ``sample_dpm_2_ancestral_RF``, ``sample_dpmpp_2s_ancestral_RF``, and the ``CONST`` branches of
``sample_dpmpp_sde``, ``sample_dpmpp_2m_sde`` and ``sample_dpmpp_3m_sde`` with their
``offset_first_sigma_for_snr``, read at 02159d814dee609acc27994c1bf25fc5b40e2aaa) at the commit
``../shared/research/samplers.md`` names (02159d8), step for step:
the chains' linear-path tables are checked against them, not derived from them. Each takes a
k-diffusion-style ``denoiser(x, sigma)`` and a list ``z`` of per-step standard normal draws (the ``CONST`` branches
of the DPM++ SDE samplers a noise sampler as ComfyUI's, called where their code calls it).
"""

from __future__ import annotations

import math

import torch


def comfy_ddpm(denoiser, x, sig, z, variance="fixed_small"):
    """ComfyUI's ``sample_ddpm`` step (``DDPMSampler_step``), in VE coordinates, per its code."""
    for i in range(len(sig) - 1):
        s, s1 = sig[i], sig[i + 1]
        D = denoiser(x, s)
        ab, ab1 = 1 / (1 + s**2), 1 / (1 + s1**2)
        alpha = ab / ab1
        eps = (x - D) / s
        xt = x / torch.sqrt(1 + s**2)
        mu = alpha**-0.5 * (xt - (1 - alpha) * eps / torch.sqrt(1 - ab))
        if s1 > 0:
            var = (1 - alpha) * (1 - ab1) / (1 - ab) if variance == "fixed_small" else 1 - alpha
            mu = mu + torch.sqrt(var) * z[i]
            x = mu * torch.sqrt(1 + s1**2)
        else:
            x = mu
    return x


def comfy_lcm(denoiser, x, sig, z, s_noise=1.0):
    """ComfyUI's ``sample_lcm`` (EPS model sampling): ``x = D``, then ``D + sigma' s_noise z``."""
    for i in range(len(sig) - 1):
        x = denoiser(x, sig[i])
        if sig[i + 1] > 0:
            x = x + sig[i + 1] * s_noise * z[i]
    return x


def vp_ddim(denoiser, x_vp, ab_list, z, eta):
    """DDIM with eta on VP states ``x = sqrt(ab) x0 + sqrt(1 - ab) xi``, ``ab`` decreasing noise to 1."""
    for i in range(len(ab_list) - 1):
        ab, ab1 = ab_list[i], ab_list[i + 1]
        sigma = math.sqrt((1 - ab) / ab)
        D = denoiser(x_vp / math.sqrt(ab), torch.tensor(sigma, dtype=torch.float64))
        eps = (x_vp - math.sqrt(ab) * D) / math.sqrt(1 - ab)
        st = eta * math.sqrt((1 - ab1) / (1 - ab)) * math.sqrt(1 - ab / ab1)
        x_vp = math.sqrt(ab1) * D + math.sqrt(max(1 - ab1 - st**2, 0.0)) * eps + st * z[i]
    return x_vp


def comfy_euler_ancestral_rf(denoiser, x, sig, z, eta=1.0, s_noise=1.0, noise_scale=1.0):
    """ComfyUI's ``sample_euler_ancestral_RF`` for CONST (linear-path) models, per its code."""
    s_noise = s_noise * noise_scale  # ComfyUI's _RF forms: times the model's model_sampling.noise_scale
    for i in range(len(sig) - 1):
        s, s1 = sig[i], sig[i + 1]
        D = denoiser(x / (1 - s), s / (1 - s))  # the linear-path denoiser is the VE one at the mapped level
        if s1 == 0:
            x = D
            continue
        down = s1 * (1 + (s1 / s - 1) * eta)
        a1, ad = 1 - s1, 1 - down
        x = (down / s) * x + (1 - down / s) * D
        x = (a1 / ad) * x + torch.sqrt(s1**2 - down**2 * a1**2 / ad**2) * s_noise * z[i]
    return x


def offset_first_sigma_for_snr(sig, percent_to_sigma=None):
    """ComfyUI's ``offset_first_sigma_for_snr`` of a ``CONST`` model, per its code: a first level ``>= 1`` (infinite
    half-log-SNR) becomes ``percent_to_sigma(1e-4)`` (default the shift-1 flow's ``1 - percent``)."""
    if len(sig) > 1 and sig[0] >= 1:
        sig = sig.clone()
        sig[0] = (percent_to_sigma or (lambda p: 1.0 - p))(1e-4)
    return sig


def comfy_dpmpp_2m_sde_const(
    model, x, sig, noise_sampler, eta=1.0, s_noise=1.0, solver_type="midpoint", percent_to_sigma=None, noise_scale=1.0
):
    """ComfyUI's ``sample_dpmpp_2m_sde`` for a CONST model, per its code: ``model(x, sigma)`` is the CONST denoiser at
    the linear-path level; half-log-SNR ``lambda = -logit(sigma)``, ``alpha_t = sigma' e^lambda'``; the first level
    offset (:func:`offset_first_sigma_for_snr`) and ``s_noise`` times the model's ``noise_scale``."""
    lambda_fn = lambda sigma: sigma.logit().neg()  # noqa: E731
    sig = offset_first_sigma_for_snr(sig, percent_to_sigma)
    s_noise = s_noise * noise_scale
    old = h = h_last = None
    for i in range(len(sig) - 1):
        D = model(x, sig[i])
        if sig[i + 1] == 0:
            x = D
        else:
            lambda_s, lambda_t = lambda_fn(sig[i]), lambda_fn(sig[i + 1])
            h = lambda_t - lambda_s
            h_eta = h * (eta + 1)
            alpha_t = sig[i + 1] * lambda_t.exp()
            x = sig[i + 1] / sig[i] * (-h * eta).exp() * x + alpha_t * (-h_eta).expm1().neg() * D
            if old is not None:
                r = h_last / h
                if solver_type == "heun":
                    x = x + alpha_t * ((-h_eta).expm1().neg() / (-h_eta) + 1) * (1 / r) * (D - old)
                else:
                    x = x + 0.5 * alpha_t * (-h_eta).expm1().neg() * (1 / r) * (D - old)
            if eta > 0 and s_noise > 0:
                x = x + noise_sampler(sig[i], sig[i + 1]) * sig[i + 1] * (-2 * h * eta).expm1().neg().sqrt() * s_noise
        old, h_last = D, h
    return x


def comfy_dpmpp_3m_sde_const(
    model, x, sig, noise_sampler, eta=1.0, s_noise=1.0, percent_to_sigma=None, noise_scale=1.0
):
    """ComfyUI's ``sample_dpmpp_3m_sde`` for a CONST model, per its code: ``model(x, sigma)`` is the CONST denoiser at
    the linear-path level; half-log-SNR ``lambda = -logit(sigma)``, ``alpha_t = sigma' e^lambda' = 1 - sigma'`` on the
    prediction's terms, the noise ``sigma' sqrt(1 - e^(-2 eta h))``; the first level offset
    (:func:`offset_first_sigma_for_snr`) and ``s_noise`` times the model's ``noise_scale``."""
    sig = offset_first_sigma_for_snr(sig, percent_to_sigma)
    s_noise = s_noise * noise_scale
    d_1 = d_2 = h = h_1 = h_2 = None
    for i in range(len(sig) - 1):
        s, s1 = sig[i], sig[i + 1]
        D = model(x, s)
        if s1 == 0:
            x = D
        else:
            lam, lam1 = -torch.logit(torch.as_tensor(s)), -torch.logit(torch.as_tensor(s1))
            h = lam1 - lam
            he = h * (eta + 1)
            alpha = s1 * lam1.exp()
            x = s1 / s * (-h * eta).exp() * x + alpha * (-he).expm1().neg() * D
            phi2 = he.neg().expm1() / he + 1
            if h_2 is not None:
                r0, r1 = h_1 / h, h_2 / h
                a0, a1 = (D - d_1) / r0, (d_1 - d_2) / r1
                x = (
                    x
                    + (alpha * phi2) * (a0 + (a0 - a1) * r0 / (r0 + r1))
                    - (alpha * (phi2 / he - 0.5)) * (a0 - a1) / (r0 + r1)
                )
            elif h_1 is not None:
                x = x + (alpha * phi2) * (D - d_1) / (h_1 / h)
            if eta > 0 and s_noise > 0:
                x = x + noise_sampler(s, s1) * s1 * (-2 * h * eta).expm1().neg().sqrt() * s_noise
        d_1, d_2 = D, d_1
        h_1, h_2 = h, h_1
    return x


def _rf_down(s, s1, eta):
    """ComfyUI's ``_RF`` samplers' ``sigma_down``, ``alpha_ip1 / alpha_down`` and ``renoise_coeff``, per its code."""
    down = s1 * (1 + (s1 / s - 1) * eta)
    a1, ad = 1 - s1, 1 - down
    return down, a1 / ad, (s1**2 - down**2 * a1**2 / ad**2) ** 0.5


def comfy_dpm_2_ancestral_rf(model, x, sig, z, eta=1.0, s_noise=1.0, noise_scale=1.0):
    """ComfyUI's ``sample_dpm_2_ancestral_RF`` for CONST models, per its code: ``model(x, sigma)`` is the CONST
    denoiser at the linear-path level; ``z[i]`` the draw of step ``i`` (taken in its two-call branch only)."""
    s_noise = s_noise * noise_scale  # ComfyUI's _RF forms: times the model's model_sampling.noise_scale
    for i in range(len(sig) - 1):
        s, s1 = sig[i], sig[i + 1]
        D = model(x, s)
        down, ratio, renoise = _rf_down(s, s1, eta)
        d = (x - D) / s
        if down == 0:
            x = x + d * (down - s)
        else:
            mid = s.log().lerp(down.log(), 0.5).exp()
            x_2 = x + d * (mid - s)
            d_2 = (x_2 - model(x_2, mid)) / mid
            x = x + d_2 * (down - s)
            x = ratio * x + z[i] * s_noise * renoise
    return x


def comfy_dpmpp_2s_ancestral_rf(model, x, sig, z, eta=1.0, s_noise=1.0, noise_scale=1.0):
    """ComfyUI's ``sample_dpmpp_2s_ancestral_RF`` for CONST models, per its code (the second call at the
    half-log-SNR midpoint ``lambda = log((1 - sigma) / sigma)``, at 0.9999 from a level of 1)."""
    s_noise = s_noise * noise_scale  # ComfyUI's _RF forms: times the model's model_sampling.noise_scale
    for i in range(len(sig) - 1):
        s, s1 = sig[i], sig[i + 1]
        D = model(x, s)
        down, ratio, renoise = _rf_down(s, s1, eta)
        if s1 == 0:
            x = x + (x - D) / s * (down - s)
        else:
            if s == 1.0:
                sigma_s = torch.as_tensor(0.9999, dtype=sig.dtype)
            else:
                lam, lam_down = ((1 - s) / s).log(), ((1 - down) / down).log()
                sigma_s = ((lam + 0.5 * (lam_down - lam)).exp() + 1) ** -1
            u = (sigma_s / s) * x + (1 - sigma_s / s) * D
            D_i = model(u, sigma_s)
            x = (down / s) * x + (1 - down / s) * D_i
        if s1 > 0 and eta > 0:
            x = ratio * x + z[i] * s_noise * renoise
    return x


def _ancestral_step(sigma_from, sigma_to, eta):
    """ComfyUI's ``get_ancestral_step``: ``(sigma_down, sigma_up)``, per its code."""
    if not eta:
        return sigma_to, 0.0
    sigma_up = min(sigma_to, eta * (sigma_to**2 * (sigma_from**2 - sigma_to**2) / sigma_from**2) ** 0.5)
    return (sigma_to**2 - sigma_up**2) ** 0.5, sigma_up


def comfy_dpmpp_sde_const(
    model, x, sig, noise_sampler=None, eta=1.0, s_noise=1.0, r=0.5, seed=None, percent_to_sigma=None, noise_scale=1.0
):
    """ComfyUI's ``sample_dpmpp_sde`` for a CONST model, per its code: ``model(x, sigma)`` is the CONST denoiser at the
    linear-path level; half-log-SNR ``lambda = -logit(sigma)``, ``sigma_fn(lambda) = sigmoid(-lambda)``, ``alpha =
    sigma e^lambda``; ``get_ancestral_step`` of ``e^(-lambda)``. Without a ``noise_sampler`` its default: a Brownian
    tree (torchsde, through k-diffusion's ``BrownianTreeNoiseSampler``, as ComfyUI's) over ``[min sigma > 0, max
    sigma]`` of the levels before the offset, queried at the linear levels. ``offset_first_sigma_for_snr``: a first
    level ``>= 1`` becomes ``percent_to_sigma(1e-4)`` (default the shift-1 flow's ``1 - percent``); ``s_noise`` is
    multiplied by the model's ``noise_scale``."""
    from kdiff_reference import sampling

    if noise_sampler is None:
        noise_sampler = sampling().BrownianTreeNoiseSampler(x, sig[sig > 0].min(), sig.max(), seed=seed)
    sigma_fn = lambda lam: lam.neg().sigmoid()  # noqa: E731
    lambda_fn = lambda sigma: sigma.logit().neg()  # noqa: E731
    sig = offset_first_sigma_for_snr(sig, percent_to_sigma)
    s_noise = s_noise * noise_scale
    for i in range(len(sig) - 1):
        D = model(x, sig[i])
        if sig[i + 1] == 0:
            x = D
            continue
        lambda_s, lambda_t = lambda_fn(sig[i]), lambda_fn(sig[i + 1])
        h = lambda_t - lambda_s
        lambda_s_1 = lambda_s + r * h
        fac = 1 / (2 * r)
        sigma_s_1 = sigma_fn(lambda_s_1)
        alpha_s = sig[i] * lambda_s.exp()
        alpha_s_1 = sigma_s_1 * lambda_s_1.exp()
        alpha_t = sig[i + 1] * lambda_t.exp()
        sd, su = _ancestral_step(lambda_s.neg().exp(), lambda_s_1.neg().exp(), eta)
        h_ = sd.log().neg() - lambda_s
        x_2 = (alpha_s_1 / alpha_s) * (-h_).exp() * x - alpha_s_1 * (-h_).expm1() * D
        if eta > 0 and s_noise > 0:
            x_2 = x_2 + alpha_s_1 * noise_sampler(sig[i], sigma_s_1) * s_noise * su
        D_2 = model(x_2, sigma_s_1)
        sd, su = _ancestral_step(lambda_s.neg().exp(), lambda_t.neg().exp(), eta)
        h_ = sd.log().neg() - lambda_s
        D_d = (1 - fac) * D + fac * D_2
        x = (alpha_t / alpha_s) * (-h_).exp() * x - alpha_t * (-h_).expm1() * D_d
        if eta > 0 and s_noise > 0:
            x = x + alpha_t * noise_sampler(sig[i], sig[i + 1]) * s_noise * su
    return x
