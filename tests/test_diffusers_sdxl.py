"""Stable Diffusion XL and 1.5 / 2.x through diffusers, offline: tiny pipelines built in code.

A ``StableDiffusionXLPipeline`` (two CLIP text encoders, the micro-conditioned
UNet) and a ``StableDiffusionPipeline`` (one CLIP encoder, SD 1.5's default
PNDM scheduler config), each with a UNet and a VAE of a few ten thousand
parameters and a CLIP tokenizer built in memory, so nothing is downloaded.

What coincides with what:

* the grid: :func:`vp_schedule` against the schedulers' own ``set_timesteps``
  (PNDM's and DDIM's timesteps are Euler's; Euler's sigmas and initial noise);
* the chain: as ``churn -> 0`` the churned Euler-Maruyama chain on the linear
  path becomes the Euler step of the probability-flow ODE, and Euler on the
  linear path, Euler in the VE variable (``EulerDiscreteScheduler``) and DDIM
  take the same step for the same ``E[x_0 | x]``. So ``sample(churn=1e-7)``
  must reproduce the pipeline itself run with ``EulerDiscreteScheduler`` (same
  generator, same latents), for epsilon, v and sample prediction, both
  families, ``leading`` and ``trailing`` spacing; a missing ``1 / (1 + s)``
  rescale fails this;
* the law: a "UNet" that returns the exact noise (or v) of Gaussian data makes
  the standard chain linear-Gaussian, whose law after ``T`` steps is computed
  in closed form here from the scheduler's timesteps; the standard and the
  speculative samplers must match it (z-scores of projections sized by their
  standard errors), and a wrong ``t(s)`` map, a missing rescale and an
  unverified coupling must not.

They say nothing about image quality, which needs real weights.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import diffusers
import numpy as np
import pytest
import torch

from specforest.couplings import GRS
from specforest.diffusers import pipeline_sdxl as px
from specforest.diffusers import unet as vpu

WORDS = ["a", "photo", "of", "cat", "dog", "red", "blue", "car", "on", "the", "street", "tree", "green", "house"]
PROMPTS = ["a photo of a cat", "a red car"]
SEQ = 8
BETAS = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
# SD 1.5's scheduler config (PNDM) and SDXL's (Euler, leading spacing)
SD15_SCHEDULER = dict(**BETAS, steps_offset=1, skip_prk_steps=True, set_alpha_to_one=False)
SDXL_SCHEDULER = dict(**BETAS, steps_offset=1, timestep_spacing="leading")
BASE = dict(height=8, width=8, progress=False, output_type="latent")


def clip_tokenizer():
    """A byte-pair CLIP tokenizer whose merges spell WORDS, built in memory."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in sorted(set("".join(WORDS))):
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    merges = []
    for w in WORDS:
        cur = w[0]
        for i, ch in enumerate(w[1:]):
            nxt = ch + ("</w>" if i == len(w) - 2 else "")
            if (cur, nxt) not in merges:
                merges.append((cur, nxt))
            cur += nxt
            vocab.setdefault(cur, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=SEQ), len(vocab)


def build_tiny_pipeline(kind: str):
    """A ``StableDiffusionXLPipeline`` (``"sdxl"``) or ``StableDiffusionPipeline`` (``"sd"``) with tiny models.

    VAE scale factor 2 (8 x 8 images, 4 x 4 x 4 latents); a two-level UNet with
    cross-attention at its lower level; SDXL's added embedding takes six time ids
    of 4 features and the 8-dimensional pooled projection.
    """
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    tok, n_vocab = clip_tokenizer()
    text = dict(
        vocab_size=n_vocab,
        hidden_size=8,
        intermediate_size=16,
        num_attention_heads=2,
        num_hidden_layers=2,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    unet = dict(
        sample_size=4,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
        attention_head_dim=(2, 4),
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        vae = diffusers.AutoencoderKL(
            block_out_channels=(4, 8),
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            latent_channels=4,
            norm_num_groups=2,
            layers_per_block=1,
            sample_size=16,
            scaling_factor=0.13025,
        )
        if kind == "sdxl":
            pipe = diffusers.StableDiffusionXLPipeline(
                vae=vae,
                text_encoder=CLIPTextModel(CLIPTextConfig(**text)),
                text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**text, projection_dim=8)),
                tokenizer=tok,
                tokenizer_2=tok,
                unet=diffusers.UNet2DConditionModel(
                    **unet,
                    cross_attention_dim=16,  # both encoders' hidden states side by side
                    addition_embed_type="text_time",
                    addition_time_embed_dim=4,
                    projection_class_embeddings_input_dim=6 * 4 + 8,
                    use_linear_projection=True,
                ),
                scheduler=diffusers.EulerDiscreteScheduler(**SDXL_SCHEDULER),
                force_zeros_for_empty_prompt=True,
            )
        else:
            pipe = diffusers.StableDiffusionPipeline(
                vae=vae,
                text_encoder=CLIPTextModel(CLIPTextConfig(**text)),
                tokenizer=tok,
                unet=diffusers.UNet2DConditionModel(**unet, cross_attention_dim=8),
                scheduler=diffusers.PNDMScheduler(**SD15_SCHEDULER),
                safety_checker=None,
                feature_extractor=None,
                requires_safety_checker=False,
            )
    for m in pipe.components.values():
        if isinstance(m, torch.nn.Module):
            m.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny matmuls on shared cores: one thread is many times faster than two contended ones
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sdxl():
    return build_tiny_pipeline("sdxl")


@pytest.fixture(scope="module")
def sd():
    return build_tiny_pipeline("sd")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def with_scheduler(pipe, scheduler):
    """A shallow copy of ``pipe`` (same models) with another scheduler."""
    other = copy.copy(pipe)
    object.__setattr__(other, "scheduler", scheduler)
    return other


class _Calls:
    """Records the UNet's inputs, one dict per call."""

    def __init__(self, unet):
        self.calls = []
        self.handle = unet.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        added = kwargs.get("added_cond_kwargs") or {}
        self.calls.append(
            {
                "sample": args[0].detach().clone(),
                "timestep": args[1].detach().clone(),
                "encoder_hidden_states": kwargs["encoder_hidden_states"].detach().clone(),
                **{k: v.detach().clone() for k, v in added.items()},
            }
        )

    def __enter__(self):
        return self.calls

    def __exit__(self, *exc):
        self.handle.remove()


# -- (a) which pipeline is which ------------------------------------------------------------------


def test_predicates_tell_the_families_apart(sdxl, sd):
    assert px.is_sdxl(sdxl) and not px.is_sd(sdxl)
    assert px.is_sd(sd) and not px.is_sdxl(sd)
    for other in (object(), None, sdxl.unet, sdxl.scheduler):
        assert not px.is_sdxl(other) and not px.is_sd(other)
    # same components, another task: not this module's
    img2img = copy.copy(sdxl)
    img2img.__class__ = type("StableDiffusionXLImg2ImgPipeline", (type(sdxl),), {})
    assert not px.is_sdxl(img2img) and px.is_sdxl(copy.copy(sdxl))


# -- (b) the grid ----------------------------------------------------------------------------------


@pytest.mark.parametrize("spacing", ["leading", "trailing", "linspace"])
@pytest.mark.parametrize("steps", [1, 7, 50])
def test_grid_is_the_euler_schedulers(spacing, steps):
    cfg = dict(**BETAS, steps_offset=1 if spacing == "leading" else 0, timestep_spacing=spacing)
    ref = diffusers.EulerDiscreteScheduler(**cfg)
    ref.set_timesteps(steps)
    g = vpu.vp_schedule(diffusers.EulerDiscreteScheduler(**cfg), steps)
    assert g.sigmas.dtype == torch.float64 and g.sigmas.shape == (steps + 1,) and g.sigmas[-1] == 0
    torch.testing.assert_close(g.timesteps, ref.timesteps.double())
    # fractional (linspace) timesteps: diffusers interpolates s linearly, vp_schedule log s (up to 7e-5 apart at T = 50)
    rtol = 1e-4 if spacing == "linspace" else 1e-6
    torch.testing.assert_close(g.edm_sigmas, ref.sigmas[:-1].double(), rtol=rtol, atol=0)
    torch.testing.assert_close(g.sigmas[:-1], g.edm_sigmas / (1 + g.edm_sigmas))
    assert g.init_noise_sigma == pytest.approx(float(ref.init_noise_sigma), rel=1e-6)
    assert g.latent_scale == pytest.approx(g.init_noise_sigma / (1 + float(g.edm_sigmas[0])))
    assert g.sigmas[0] < 0.94  # never t = 1: SD's s_max = 14.6 is t = 0.936


def test_grid_of_pndm_and_ddim_is_eulers_on_the_same_config():
    euler = vpu.vp_schedule(diffusers.EulerDiscreteScheduler(**BETAS, steps_offset=1, timestep_spacing="leading"), 10)
    for sched in (diffusers.PNDMScheduler(**SD15_SCHEDULER), diffusers.DDIMScheduler(**BETAS, steps_offset=1)):
        g = vpu.vp_schedule(sched, 10)
        assert g.timesteps.tolist() == [901.0, 801.0, 701.0, 601.0, 501.0, 401.0, 301.0, 201.0, 101.0, 1.0]
        torch.testing.assert_close(g.sigmas, euler.sigmas, rtol=1e-12, atol=0)
        # a VP-state scheduler starts from x_k = xi, i.e. x_VE = sqrt(1 + s_0^2) xi: Euler "leading"'s noise
        assert g.init_noise_sigma == pytest.approx(euler.init_noise_sigma, rel=1e-6)


def test_grid_refuses_other_schedulers():
    with pytest.raises(ValueError, match="distinct decreasing levels"):
        vpu.vp_schedule(diffusers.KDPM2DiscreteScheduler(**BETAS), 5)
    with pytest.raises(TypeError, match="VP scheduler"):
        vpu.vp_schedule(diffusers.FlowMatchEulerDiscreteScheduler(), 5)
    with pytest.raises(ValueError, match="num_inference_steps"):
        vpu.vp_schedule(diffusers.EulerDiscreteScheduler(**BETAS), 0)


# -- (c) parity with the pipeline's own Euler sampler -----------------------------------------------


def euler_from(config, **overrides):
    """An ``EulerDiscreteScheduler`` from ``config`` with ``overrides`` (keywords: entries of a config dict that
    its ``_use_default_values`` lists would be ignored by ``from_config``)."""
    sched = diffusers.EulerDiscreteScheduler.from_config(config, **overrides)
    assert all(sched.config[k] == v for k, v in overrides.items())
    return sched


def _euler(pipe, prediction_type, spacing):
    sched = euler_from(
        pipe.scheduler.config,
        prediction_type=prediction_type,
        timestep_spacing=spacing,
        steps_offset=int(spacing == "leading"),
    )
    return with_scheduler(pipe, sched)


@pytest.mark.parametrize(
    "kind,prediction_type,spacing",
    [
        ("sdxl", "epsilon", "leading"),
        ("sdxl", "v_prediction", "trailing"),
        ("sdxl", "sample", "leading"),
        ("sd", "epsilon", "trailing"),
        ("sd", "v_prediction", "leading"),
    ],
)
def test_vanishing_churn_reproduces_the_pipelines_euler_sampler(sdxl, sd, kind, prediction_type, spacing):
    pipe = _euler(sdxl if kind == "sdxl" else sd, prediction_type, spacing)
    kw = dict(num_inference_steps=6, guidance_scale=4.0, height=8, width=8, output_type="latent")
    ours = px.sample(pipe, PROMPTS, churn=1e-7, generator=gen(1), progress=False, **kw)
    ref = pipe(PROMPTS, generator=gen(1), **kw).images
    scale = ref.abs().max()
    torch.testing.assert_close(ours.latents, ref, atol=1e-5 * scale, rtol=0)
    assert ours.stats.nfe.tolist() == [6, 6]


def test_parity_fails_without_the_rescale(sdxl, monkeypatch):
    """The same comparison with the initial state left in VE units (no ``1 / (1 + s_0)``) is far off."""
    pipe = _euler(sdxl, "epsilon", "leading")
    kw = dict(num_inference_steps=6, guidance_scale=4.0, height=8, width=8, output_type="latent")
    ref = pipe(PROMPTS, generator=gen(1), **kw).images
    monkeypatch.setattr(vpu.VPSchedule, "latent_scale", property(lambda self: self.init_noise_sigma))
    wrong = px.sample(pipe, PROMPTS, churn=1e-7, generator=gen(1), progress=False, **kw)
    assert (wrong.latents - ref).abs().max() > 0.1 * ref.abs().max()


def test_decoded_images_are_the_pipelines(sdxl, sd):
    for pipe in (_euler(sdxl, "epsilon", "leading"), _euler(sd, "v_prediction", "leading")):
        kw = dict(num_inference_steps=3, guidance_scale=3.0, height=8, width=8, output_type="np")
        ours = px.sample(pipe, PROMPTS[0], churn=1e-7, generator=gen(2), progress=False, **kw)
        ref = pipe(PROMPTS[0], generator=gen(2), **kw).images
        assert ours.images.shape == ref.shape == (1, 8, 8, 3)
        np.testing.assert_allclose(ours.images, ref, atol=1e-5)


# -- (d) the law, against the closed form of a linear-Gaussian chain ------------------------------------

C, H, W = 4, 4, 4
MU = torch.linspace(-1.5, 1.5, C * H * W, dtype=torch.float64).reshape(C, H, W)
TAU = 0.3


TEXT_DIRECTION = torch.randn(8, generator=torch.Generator().manual_seed(99), dtype=torch.float64) / 2


def text_shift(embeds: torch.Tensor) -> torch.Tensor:
    """``(M,)`` the data mean's shift a text embedding ``(M, seq, 8)`` gives :class:`GaussianUNet`."""
    return (embeds.double() @ TEXT_DIRECTION).mean(1)


class GaussianUNet(torch.nn.Module):
    """A "UNet" returning the exact epsilon (or v) of data ``x_0 ~ N(MU + text_shift, TAU^2 I)``.

    Its config is a real UNet's, so the pipeline takes it as one; ``abar`` of a
    fractional timestep is the log-sigma interpolation of the table. Guided, its
    prediction is that of data ``N(MU + (1 - g) shift_u + g shift_c, TAU^2 I)``
    (the exact prediction is affine in the data mean).
    """

    def __init__(self, config, alphas_cumprod, prediction_type="epsilon"):
        super().__init__()
        self.config = config
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # gives the module a dtype and a device
        self.register_buffer("log_sigmas", ((1 - alphas_cumprod.double()) / alphas_cumprod.double()).sqrt().log())
        self.prediction_type = prediction_type

    def forward(self, sample, timestep, encoder_hidden_states=None, return_dict=True, **_):
        n = self.log_sigmas.numel()
        k = timestep.double().clamp(0, n - 1)
        i = k.floor().long().clamp(0, n - 2)
        s = ((1 - (k - i)) * self.log_sigmas[i] + (k - i) * self.log_sigmas[i + 1]).exp()[:, None, None, None]
        a, b = 1 / (1 + s * s).sqrt(), s / (1 + s * s).sqrt()  # sqrt(abar), sqrt(1 - abar)
        x = sample.double()
        mu = MU + text_shift(encoder_hidden_states).reshape(-1, 1, 1, 1)
        x0 = mu + a * TAU**2 / (a * a * TAU**2 + b * b) * (x - a * mu)
        eps = (x - a * x0) / b
        out = eps if self.prediction_type == "epsilon" else a * eps - b * x0
        return (out.to(sample.dtype),)


def exact_law(alphas_cumprod, timesteps, init_noise_sigma, churn, mu=MU):
    """Mean and variance per coordinate of the churned Euler-Maruyama chain with the exact Gaussian velocity.

    Written from the definitions, not the library's tables: ``s_n`` of the
    scheduler's (integer) timesteps, ``t_n = s_n / (1 + s_n)``, the initial state
    ``init_noise_sigma xi / (1 + s_0)``; the step ``y + g b + e sqrt(2 g t / (1 - t)) z``
    with ``b = -(1 + e^2) v - e^2 y / (1 - t)`` (plain Euler into ``t = 0``); and
    ``v = (y - E[x_0 | y]) / t`` with ``E[x_0 | y] = mu + (1 - t) TAU^2 (y - (1 - t) mu) / ((1 - t)^2 TAU^2 + t^2)``.
    """
    ac = alphas_cumprod.double()
    s = ((1 - ac[timesteps.long()]) / ac[timesteps.long()]).sqrt()
    t = torch.cat([s / (1 + s), torch.zeros(1, dtype=torch.float64)])
    m = torch.zeros_like(MU)
    var = torch.full_like(MU, (init_noise_sigma / (1 + s[0].item())) ** 2)
    e2 = churn**2
    for n in range(len(s)):
        tn, g = t[n].item(), (t[n] - t[n + 1]).item()
        k = (1 - tn) * TAU**2 / ((1 - tn) ** 2 * TAU**2 + tn**2)
        alpha, beta = (1 - k) / tn, -(1 - k * (1 - tn)) * mu / tn  # v(y) = alpha y + beta
        if t[n + 1] > 0:
            a_y = 1 - g * (1 + e2) * alpha - g * e2 / (1 - tn)
            m, var = a_y * m - g * (1 + e2) * beta, a_y**2 * var + e2 * 2 * g * tn / (1 - tn)
        else:
            m, var = (1 - g * alpha) * m - g * beta, (1 - g * alpha) ** 2 * var
    return m, var


def _z_scores(x, mean, var):
    """z-scores of the mean and variance of fixed projections (and of single coordinates) against the law."""
    N = x.shape[0]
    x, mean, var = x.reshape(N, -1).double(), mean.reshape(-1), var.reshape(-1)
    P = torch.cat([torch.eye(x.shape[1])[:, ::9], torch.randn(x.shape[1], 6, generator=gen(7), dtype=torch.float64)], 1)
    P = P.double() / P.double().norm(dim=0)
    y, mu, sig2 = x @ P, mean @ P, var @ P.square()
    z_mean = (y.mean(0) - mu) / (sig2 / N).sqrt()
    z_var = (y.var(0) - sig2) / (sig2 * math.sqrt(2 / (N - 1)))
    return torch.cat([z_mean, z_var]).abs().max().item()


class _AlwaysAccept(GRS):
    """A deliberately wrong rule: takes the first drafted child without verification."""

    name = "always-accept"

    def select(self, s_hat, delta, valid, rng):
        P = s_hat.shape[0]
        return torch.ones(P, dtype=torch.bool), torch.zeros(P, dtype=torch.long)


def _vp_path_grid(scheduler, steps):
    g = vpu.vp_schedule(scheduler, steps)
    t = g.edm_sigmas / (1 + g.edm_sigmas**2).sqrt()
    return dataclasses.replace(g, sigmas=torch.cat([t, t.new_zeros(1)]))


def _vp_path_scale(schedule):
    return schedule.init_noise_sigma / math.sqrt(1 + float(schedule.edm_sigmas[0]) ** 2)


class _VPPathVelocity(vpu.UNetVelocity):
    def __call__(self, x, sigma, **cond):
        t = sigma.double().reshape(-1, 1, 1, 1)
        s = t / (1 - t * t).sqrt()
        d = self.denoiser((x.double() * (1 + s * s).sqrt()).float(), s.reshape(-1).float(), **cond)
        return ((x.double() - d.double()) / t).float()


@pytest.fixture(scope="module")
def gaussian_sd(sd):
    """The SD pipeline with the exact Gaussian "UNet" (epsilon) and an Euler scheduler, trailing spacing."""
    sched = diffusers.EulerDiscreteScheduler(**BETAS, timestep_spacing="trailing")
    pipe = with_scheduler(sd, sched)
    object.__setattr__(pipe, "unet", GaussianUNet(sd.unet.config, sched.alphas_cumprod))
    return pipe


def test_standard_and_speculative_chains_have_the_closed_form_law(gaussian_sd, monkeypatch):
    """Two captions, guidance 3: each caption's images against its own closed-form law."""
    N, T, churn, g = 2000, 10, 0.8, 3.0
    pipe = gaussian_sd
    grid = vpu.vp_schedule(pipe.scheduler, T)
    with torch.no_grad():
        pe, npe = pipe.encode_prompt(PROMPTS, "cpu", 1, True)
    shift = (1 - g) * text_shift(npe) + g * text_shift(pe)
    assert (shift[0] - shift[1]).abs() > 0.1  # the captions give different laws
    laws = [
        exact_law(pipe.scheduler.alphas_cumprod, grid.timesteps, grid.init_noise_sigma, churn, MU + d) for d in shift
    ]
    mean, var = laws[0]
    assert (mean - MU - shift[0]).abs().max() < 0.2 and (var.sqrt() - TAU).abs().max() < 0.2  # near the data law

    def z(**kw):
        r = px.sample(
            pipe,
            PROMPTS,
            num_inference_steps=T,
            guidance_scale=g,
            num_images_per_prompt=N,
            churn=churn,
            generator=gen(kw.pop("seed", 3)),
            **BASE,
            **kw,
        )
        return max(_z_scores(r.latents[i * N : (i + 1) * N], *laws[i]) for i in range(2)), r.stats

    zs, st = z()
    assert zs < 5 and st.nfe.tolist() == [T] * 2 * N
    for kw in (dict(K=2, L=2), dict(coupling="rmc", L=4)):
        zk, st = z(seed=4, **kw)
        assert zk < 5, kw
        assert st.nfe.double().mean() < T - 1  # speculation saved calls
    # the same test rejects an unverified coupling ...
    assert z(seed=4, K=2, L=2, coupling=_AlwaysAccept())[0] > 8
    # ... the VP path taken for the linear one (t = s / sqrt(1 + s^2), the state x_VE / sqrt(1 + s^2), the
    # velocity (x - D) / t of that state): a consistent but wrong change of variables ...
    monkeypatch.setattr(px, "vp_schedule", _vp_path_grid)
    monkeypatch.setattr(px, "UNetVelocity", _VPPathVelocity)
    monkeypatch.setattr(vpu.VPSchedule, "latent_scale", property(_vp_path_scale))
    assert z()[0] > 30
    # ... and the initial noise left in VE units
    monkeypatch.undo()
    monkeypatch.setattr(vpu.VPSchedule, "latent_scale", property(lambda self: self.init_noise_sigma))
    assert z()[0] > 8


def test_v_prediction_has_the_closed_form_law_too(gaussian_sd):
    N, T, churn = 4000, 8, 0.5
    sched = euler_from(
        gaussian_sd.scheduler.config, prediction_type="v_prediction", timestep_spacing="leading", steps_offset=1
    )
    pipe = with_scheduler(gaussian_sd, sched)
    object.__setattr__(pipe, "unet", GaussianUNet(gaussian_sd.unet.config, sched.alphas_cumprod, "v_prediction"))
    grid = vpu.vp_schedule(sched, T)
    with torch.no_grad():
        pe, _ = pipe.encode_prompt("a cat", "cpu", 1, False)
    mean, var = exact_law(sched.alphas_cumprod, grid.timesteps, grid.init_noise_sigma, churn, MU + text_shift(pe))
    r = px.sample(
        pipe,
        "a cat",
        num_inference_steps=T,
        guidance_scale=1.0,
        num_images_per_prompt=N,
        churn=churn,
        generator=gen(5),
        K=3,
        L=2,
        **BASE,
    )
    assert _z_scores(r.latents, mean, var) < 5
    assert r.stats.nfe.double().mean() < T


# -- (e) conditioning, guidance, dtype -------------------------------------------------------------------


def test_both_branches_and_sdxl_time_ids_go_per_row_in_one_call(sdxl):
    with _Calls(sdxl.unet) as calls:
        res = px.sample(
            sdxl,
            PROMPTS,
            num_inference_steps=4,
            guidance_scale=5.0,
            num_images_per_prompt=2,
            generator=gen(6),
            original_size=(32, 24),
            crops_coords_top_left=(2, 1),
            negative_original_size=(16, 16),
            negative_target_size=(8, 8),
            **BASE,
        )
    assert len(calls) == 4 and res.stats.nfe.tolist() == [4] * 4
    for c in calls:
        M = c["sample"].shape[0] // 2
        assert M == 4 and c["time_ids"].shape == (8, 6) and c["text_embeds"].shape == (8, 8)
        # rows [uncond; cond], one call
        assert c["time_ids"][:M].tolist() == [[16, 16, 0, 0, 8, 8]] * M
        assert c["time_ids"][M:].tolist() == [[32, 24, 2, 1, 8, 8]] * M
        assert torch.equal(c["sample"][:M], c["sample"][M:]) and torch.equal(c["timestep"][:M], c["timestep"][M:])
        # force_zeros_for_empty_prompt: no negative prompt, zero negatives
        assert not c["encoder_hidden_states"][:M].any() and not c["text_embeds"][:M].any()
        # each caption's rows consecutively: images 0, 1 of caption 0, then 2, 3 of caption 1
        cond = c["encoder_hidden_states"][M:]
        assert torch.equal(cond[0], cond[1]) and torch.equal(cond[2], cond[3]) and not torch.equal(cond[1], cond[2])
    assert res.config["original_size"] == (32, 24) and res.config["target_size"] == (8, 8)


def test_guided_velocity_is_the_pipelines_guided_prediction(sdxl):
    """One step's model output: our guided velocity against the UNet called as the pipeline calls it."""
    sched = diffusers.EulerDiscreteScheduler.from_config(sdxl.scheduler.config)
    sched.set_timesteps(5)
    g = 5.0
    with torch.no_grad():
        pe, npe, ppe, nppe = sdxl.encode_prompt(PROMPTS, negative_prompt=["a dog", "a tree"])
    ids = torch.tensor([[8.0, 8, 0, 0, 8, 8]] * 2)
    x_ve = torch.randn(2, 4, 4, 4, generator=gen(8)) * float(sched.init_noise_sigma)
    k = sched.timesteps[1]
    s = sched.sigmas[1].double()
    with torch.no_grad():
        out = sdxl.unet(
            torch.cat([x_ve, x_ve]) / (s**2 + 1).sqrt().float(),
            k,
            encoder_hidden_states=torch.cat([npe, pe]),
            added_cond_kwargs={"text_embeds": torch.cat([nppe, ppe]), "time_ids": torch.cat([ids, ids])},
            return_dict=False,
        )[0]
    u, c = out.chunk(2)
    x0 = x_ve - s.float() * (u + g * (c - u))
    t = (s / (1 + s)).float()
    ref = (x_ve / (1 + s.float()) - x0) / t  # v = (x_lin - x0) / t
    v = vpu.UNetVelocity(sdxl.unet, sched.alphas_cumprod, guidance_scale=g)
    ours = v(
        x_ve / (1 + s.float()),
        t.expand(2),
        encoder_hidden_states=pe,
        negative_encoder_hidden_states=npe,
        text_embeds=ppe,
        negative_text_embeds=nppe,
        time_ids=ids,
        negative_time_ids=ids,
    )
    torch.testing.assert_close(ours, ref, atol=2e-4 * ref.abs().max().item(), rtol=0)


def test_half_precision_unet_is_fed_in_its_dtype(sdxl):
    pipe = copy.copy(sdxl)
    object.__setattr__(pipe, "unet", copy.deepcopy(sdxl.unet).to(torch.bfloat16))
    with _Calls(pipe.unet) as calls:
        res = px.sample(
            pipe,
            PROMPTS[0],
            num_inference_steps=4,
            guidance_scale=5.0,
            generator=gen(9),
            K=2,
            L=2,
            num_images_per_prompt=2,
            **BASE,
        )
    assert calls
    for c in calls:
        for key in ("sample", "encoder_hidden_states", "text_embeds", "time_ids"):
            assert c[key].dtype == torch.bfloat16, key
        assert c["timestep"].dtype == torch.float32
    assert res.latents.dtype == torch.float32 and torch.isfinite(res.latents).all()
    assert res.images.dtype == torch.bfloat16 and res.config["unet_dtype"] == "bfloat16"


# -- (f) speculation, outputs, side effects ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sdxl", "sd"])
def test_speculative_runs_take_fewer_unet_calls_than_steps(sdxl, sd, kind):
    from specforest import diffusers as sdiff

    pipe = sdxl if kind == "sdxl" else sd
    assert sdiff.family_of(pipe).name == kind
    T = 10
    with _Calls(pipe.unet) as calls:
        # through the package's one entry point, which dispatches on the family
        res = sdiff.sample(
            pipe,
            PROMPTS,
            num_inference_steps=T,
            num_images_per_prompt=3,
            generator=gen(10),
            K=2,
            L=2,
            **{**BASE, "output_type": "np"},
        )
    assert res.images.shape == (6, 8, 8, 3) and 0 <= res.images.min() and res.images.max() <= 1
    assert len(calls) == res.stats.calls < T
    assert (res.stats.nfe < T).all() and (res.stats.speedup > 1).all()
    assert res.config["family"] == kind and res.config["first_sigma"] < 1


def test_pipeline_and_scheduler_are_left_as_they_were(sd):
    sched = sd.scheduler
    sched.set_timesteps(3)
    before = (dict(sched.config), sched.timesteps.clone(), sched.num_inference_steps, sched.counter)
    state = {k: v.clone() for k, v in sd.unet.state_dict().items()}
    px.sample(sd, PROMPTS[0], num_inference_steps=5, generator=gen(11), K=2, L=2, **{**BASE, "output_type": "pt"})
    assert (dict(sched.config), sched.num_inference_steps, sched.counter) == (before[0], before[2], before[3])
    assert torch.equal(sched.timesteps, before[1])
    assert all(torch.equal(v, sd.unet.state_dict()[k]) for k, v in state.items())


def test_memory_sizing_splits_unet_calls_without_changing_results(sd, monkeypatch):
    import specforest.memory

    # the process's own memory taken out of the arithmetic: it drifts from call to call
    monkeypatch.setattr(specforest.memory, "held_bytes", lambda device="cpu": 0)
    kw = dict(num_inference_steps=5, num_images_per_prompt=6, K=2, L=2, guidance_scale=3.0, **BASE)
    whole = px.sample(sd, PROMPTS[0], generator=gen(12), **kw)
    m = whole.memory
    dyn = m.sampler_bytes + int(4.5 * m.row_bytes)
    limit = (m.fixed_bytes + dyn + specforest.memory.allocator_slack(dyn)) / 1e9
    with _Calls(sd.unet) as calls:
        split = px.sample(sd, PROMPTS[0], generator=gen(12), max_memory_gb=limit, **kw)
    assert whole.memory.max_rows is None and split.memory.max_rows == 4
    assert max(c["sample"].shape[0] for c in calls) <= 8  # 4 states, 2 branches each
    torch.testing.assert_close(split.latents, whole.latents, atol=1e-4, rtol=1e-4)
    assert torch.equal(split.stats.nfe, whole.stats.nfe)


# -- (g) errors -------------------------------------------------------------------------------------------


def test_argument_errors_name_the_parameter(sdxl, sd):
    with torch.no_grad():
        pe, npe, ppe, nppe = sdxl.encode_prompt(PROMPTS)
    base = {**BASE, "num_inference_steps": 3}
    cases = [
        (sdxl, dict(prompt="a cat", height=9), r"height must be divisible by vae_scale_factor = 2, got 9"),
        (sd, dict(prompt="a cat", width=7), "width must be divisible"),
        (sdxl, dict(), "exactly one of prompt"),
        (sd, dict(prompt="a cat", prompt_embeds=pe), "exactly one of prompt"),
        (sdxl, dict(prompt_embeds=pe), "pooled_prompt_embeds"),
        (sdxl, dict(prompt_embeds=pe[..., :8], pooled_prompt_embeds=ppe), "cross_attention_dim is 16"),
        (sdxl, dict(prompt_embeds=pe, pooled_prompt_embeds=ppe[:1]), "pooled_prompt_embeds has 1 rows"),
        (
            sdxl,
            dict(prompt_embeds=pe, pooled_prompt_embeds=ppe, negative_prompt_embeds=npe[:1]),
            "negative_prompt_embeds has shape",
        ),
        (sdxl, dict(prompt=PROMPTS, negative_prompt=["x"] * 3), "negative_prompt has 3"),
        (sd, dict(prompt="a cat", prompt_2="a dog"), "SDXL inputs"),
        (sd, dict(prompt="a cat", original_size=(8, 8)), "micro-conditioning"),
        (sdxl, dict(prompt="a cat", original_size=(8,)), "original_size must be a pair"),
        (sdxl, dict(prompt="a cat", churn=0.0), "churn"),
        (sdxl, dict(prompt="a cat", guidance_scale=-1.0), "guidance_scale"),
        (sdxl, dict(prompt="a cat", output_type="jpg"), "output_type"),
        (sdxl, dict(prompt="a cat", K=2), "both K and L"),
        (sdxl, dict(prompt="a cat", max_memory_gb=0.0), "max_memory_gb"),
        (sdxl, dict(prompt="a cat", num_inference_steps=0), "num_inference_steps"),
    ]
    for pipe, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            px.sample(pipe, **{**base, **kw})
            pytest.fail(f"no error for {sorted(kw)}, expected {match!r}")
    with pytest.raises(TypeError, match="prompt must be a str"):
        px.sample(sd, prompt=3, **base)
    with pytest.raises(TypeError, match="generator"):
        px.sample(sd, "a cat", generator="seed", **base)
    with pytest.raises(ValueError, match="one per image"):
        px.sample(sd, "a cat", generator=[gen(0), gen(1)], **base)


def test_wrong_pipelines_and_models_are_refused_clearly(sdxl, sd):
    from specforest import diffusers as sdiff

    base = {**BASE, "num_inference_steps": 3}
    with pytest.raises(
        TypeError, match=r"StableDiffusion3Pipeline \(sd3\), FluxPipeline \(flux\), StableDiffusionXLPipeline"
    ):
        sdiff.sample(object(), "a cat", **base)
    # an SD3-only option given to a UNet family is refused naming the family
    with pytest.raises(TypeError, match="shift: not an option of the sdxl family"):
        sdiff.sample(sdxl, "a cat", shift=3.0, **base)
    assert sdiff.family_of_class_name("StableDiffusionPipeline").name == "sd"
    for bad in (object(), sdxl.unet):
        with pytest.raises(TypeError, match="StableDiffusionXLPipeline or a StableDiffusionPipeline"):
            px.sample(bad, "a cat", **base)
    flow = with_scheduler(sd, diffusers.EulerDiscreteScheduler(**BETAS, prediction_type="flow_prediction"))
    with pytest.raises(ValueError, match=r"prediction_type is 'flow_prediction'; supported: epsilon, sample"):
        px.sample(flow, "a cat", **base)
    lcm = copy.copy(sd)
    object.__setattr__(lcm, "unet", GaussianUNet({**sd.unet.config, "time_cond_proj_dim": 8}, torch.rand(10)))
    with pytest.raises(ValueError, match="time_cond_proj_dim"):
        px.sample(lcm, "a cat", **base)
    kdpm = with_scheduler(sd, diffusers.KDPM2DiscreteScheduler(**BETAS))
    with pytest.raises(ValueError, match="distinct decreasing levels"):
        px.sample(kdpm, "a cat", **base)


def test_a_tuned_configuration_is_checked_against_the_run(sd):
    from specforest import trees
    from specforest.latency import CostCurve, Tuned

    tuned = Tuned(
        label="chain",
        tree=trees.chain(2),
        coupling="rmc",
        verify="internal",
        draft="velocity",
        batch=2,
        steps=5,
        churn=0.8,
        predicted_seconds_per_image=1.0,
        predicted_speedup=1.0,
        standard_seconds_per_image=1.0,
        predicted_calls=3.0,
        curve=CostCurve((1,), (1.0,)),
    )
    res = px.sample(sd, PROMPTS, num_inference_steps=5, generator=gen(3), **BASE, **tuned)
    assert res.latents.shape[0] == 2
    with pytest.raises(ValueError, match=r"steps 6 \(tuned for 5\); 4 images \(tuned for 2\)"):
        px.sample(sd, PROMPTS, num_inference_steps=6, num_images_per_prompt=2, **BASE, **tuned)


# -- (h) tuning and the parts that generate samples -------------------------------------------------------


@pytest.mark.slow
def test_tune_sdxl_measures_the_unet_and_its_choice_runs(sdxl, sd, monkeypatch):
    import specforest.memory
    from specforest import diffusers as sdiff
    from specforest.diffusers.prepared import prepare_sdxl
    from specforest.latency import Tuned

    # a limit of a few rows keeps the measured cost curve short; the process's own memory (which the
    # limit bounds, and which drifts from call to call) taken out of the arithmetic
    monkeypatch.setattr(specforest.memory, "held_bytes", lambda device="cpu": 0)
    tuned = sdiff.tune_sdxl(
        sdxl,
        PROMPTS,
        num_inference_steps=8,
        height=8,
        width=8,
        budget_max=4,
        drafts=("velocity",),
        calibration_images=2,
        max_memory_gb=0.001,
    )
    assert isinstance(tuned, Tuned) and tuned.steps == 8 and tuned.batch == 1
    assert tuned.predicted_seconds_per_image > 0 and {c["label"] for c in tuned.candidates} >= {"standard"}
    res = px.sample(sdxl, PROMPTS[0], num_inference_steps=8, generator=gen(5), **BASE, **tuned)
    assert res.latents.shape == (1, 4, 4, 4) and torch.isfinite(res.latents).all()
    # the tuned run is checked: other steps or churn are refused, listing both
    with pytest.raises(ValueError, match=r"steps 6 \(tuned for 8\).*churn 0.5"):
        px.sample(sdxl, PROMPTS[0], num_inference_steps=6, churn=0.5, **BASE, **tuned)
    # both UNet families tune and prepare through these; SD3's tuner points to this one
    for pipe in (sdxl, sd):
        fam = sdiff.family_of(pipe)
        assert fam.tune is sdiff.tune_sdxl and fam.prepare is prepare_sdxl
    with pytest.raises(TypeError, match="tune_sdxl"):
        sdiff.tune(sd, PROMPTS, num_inference_steps=4)
    with pytest.raises(ValueError, match="batch"):
        sdiff.tune_sdxl(sd, PROMPTS, batch=0)


def test_prepare_sdxl_refuses_bad_input_naming_it(sdxl, sd):
    from specforest.diffusers.prepared import prepare_sdxl

    kw = dict(num_inference_steps=3, height=8, width=8)
    with pytest.raises(ValueError, match="micro-conditioning"):
        prepare_sdxl(sd, PROMPTS, original_size=(8, 8), **kw)
    with pytest.raises(ValueError, match="original_size must be a pair"):
        prepare_sdxl(sdxl, PROMPTS, original_size=(8,), **kw)
    with pytest.raises(ValueError, match="height must be divisible by vae_scale_factor = 2"):
        prepare_sdxl(sdxl, PROMPTS, num_inference_steps=3, height=9, width=8)
    with pytest.raises(TypeError, match="prompts must be a caption"):
        prepare_sdxl(sdxl, [], **kw)
    with pytest.raises(TypeError, match="negative_prompt must be a str"):
        prepare_sdxl(sdxl, PROMPTS, negative_prompt=3, **kw)
    with pytest.raises(ValueError, match="clip_skip"):
        prepare_sdxl(sd, PROMPTS, clip_skip=-1, **kw)
    with pytest.raises(TypeError, match="StableDiffusionXLPipeline or a StableDiffusionPipeline"):
        prepare_sdxl(object(), PROMPTS, **kw)


# -- (i) every option of the sampler, as SD3's sample takes them (issue 39) ------------------------------


@pytest.mark.parametrize("kind", ["sdxl", "sd"])
def test_pad_rows_and_warmup_keep_the_latents(sdxl, sd, kind):
    """SDXL and SD take pad_rows and warmup: the warm-up only calls the UNet first (bit-equal latents, the
    same through the dispatching sample); padding rows are dropped, so the latents differ only by the
    rounding of calls with other row counts, with the same calls per image."""
    from specforest import diffusers as sdiff

    pipe = {"sdxl": sdxl, "sd": sd}[kind]
    kw = dict(num_inference_steps=6, num_images_per_prompt=3, K=2, L=2, **BASE)
    ref = px.sample(pipe, PROMPTS, generator=gen(1), **kw)
    warm = sdiff.sample(pipe, PROMPTS, generator=gen(1), warmup=True, **kw)
    assert torch.equal(warm.latents, ref.latents) and torch.equal(warm.stats.nfe, ref.stats.nfe)
    assert warm.warmup_seconds > 0 and ref.warmup_seconds == 0.0 and ref.config["pad_rows"] is None
    for pad in ("pow2", [5, 64]):
        padded = px.sample(pipe, PROMPTS, generator=gen(1), pad_rows=pad, warmup=True, **kw)
        torch.testing.assert_close(padded.latents, ref.latents, rtol=0, atol=1e-4)
        assert torch.equal(padded.stats.nfe, ref.stats.nfe) and padded.config["pad_rows"] == pad


def test_chain_reaches_the_sampler(sdxl, sd):
    """chain= is the sampler's: another law than the em chain's, recorded with its parameters; churn, the em
    chain's, is refused at another value than its default. The grid starts below t = 1, so the chains that
    need VE levels (ddpm, dpmpp_2m_sde), which Flux's and SD3's grids refuse, run here too."""
    kw = dict(num_inference_steps=6, K=2, L=2, **BASE)
    em = px.sample(sdxl, PROMPTS, generator=gen(2), **kw)
    for chain in ("euler_ancestral", "ddpm", "dpmpp_2m_sde"):
        other = px.sample(sdxl, PROMPTS, generator=gen(2), chain=chain, **kw)
        assert other.config["chain"] == chain and "churn" not in other.config, chain
        assert not torch.allclose(other.latents, em.latents), chain
    assert em.config["chain"] == "em" and em.config["churn"] == 0.8
    std = px.sample(sd, PROMPTS, generator=gen(2), chain="ddpm", num_inference_steps=6, **BASE)
    assert std.config["family"] == "sd" and std.stats.nfe.tolist() == [6, 6]
    with pytest.raises(ValueError, match="churn=0.5 is the em chain's parameter"):
        px.sample(sd, PROMPTS, chain="euler_ancestral", churn=0.5, **kw)


def test_tune_sdxl_takes_the_samplers_options(sd, monkeypatch):
    """tune_sdxl forwards the sampler's options as the SD3 tuner does, the chain to tune for among them."""
    import specforest.memory
    from specforest import diffusers as sdiff

    monkeypatch.setattr(specforest.memory, "held_bytes", lambda device="cpu": 0)
    kw = dict(num_inference_steps=6, height=8, width=8, budget_max=3, drafts=("velocity",), calibration_images=1)
    with pytest.raises(ValueError, match="max_rows is set by this function"):
        sdiff.tune_sdxl(sd, PROMPTS[0], max_rows=2, **kw)
    tuned = sdiff.tune_sdxl(sd, PROMPTS[0], chain="euler_ancestral", prefetch="parent", max_memory_gb=1.0, **kw)
    assert tuned.chain == "euler_ancestral" and tuned.churn is None and tuned.prefetch == "parent"
    res = px.sample(sd, PROMPTS[0], num_inference_steps=6, generator=gen(0), **BASE, **tuned)
    assert res.config["chain"] == "euler_ancestral" and res.config["prefetch"] == "parent"


def test_a_familys_sample_takes_the_samplers_further_options_and_refuses_its_own(sd):
    """A family's sample passes a field of SamplerOptions it has no parameter for to the sampler (a new
    option reaches every family: tests/test_option_declarations.py), refuses one its run sets, naming
    what sets it, and names a keyword that is no option."""
    kw = dict(num_inference_steps=4, **BASE)
    with pytest.raises(ValueError, match=r"shift is set by the pipeline's run \(the scheduler's grid"):
        px.sample(sd, PROMPTS, shift=2.0, **kw)
    with pytest.raises(ValueError, match=r"max_rows is set by the pipeline's run \(from max_memory_gb\)"):
        px.sample(sd, PROMPTS, max_rows=2, **kw)
    with pytest.raises(TypeError, match="unexpected option.*boosted"):
        px.sample(sd, PROMPTS, boosted=1, **kw)


def test_the_tiny_pipeline_recipe_of_the_docs_runs(tmp_path, monkeypatch):
    """docs/diffusers.md's recipe (a tiny SD 1.5 pipeline with random weights, built in code) runs as written:
    the standard run takes one call per step, the tree fewer, and the image is saved."""
    import contextlib
    import io
    import pathlib
    import re

    from PIL import Image

    text = (pathlib.Path(__file__).parent.parent / "docs" / "diffusers.md").read_text()
    section = text.split("## Try it without weights: a tiny SD 1.5 pipeline built in code", 1)[1]
    block = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(block, "docs/diffusers.md", "exec"), scope)
    assert scope["standard"].stats.nfe.tolist() == [20, 20]
    assert float(scope["fast"].stats.nfe.float().mean()) < 20
    assert scope["fast"].config["chain"] == "scheduler" and scope["fast"].config["scheduler"] == "DDPMScheduler"
    assert Image.open(tmp_path / "cat.png").size == (8, 8)
