"""Stable Diffusion XL and 1.5 / 2.x end to end with the exact speculative sampler.

``StableDiffusionXLPipeline`` and ``StableDiffusionPipeline`` share a VP UNet
(epsilon or v prediction): :class:`~specforest.diffusers.unet.UNetVelocity`
turns it into a velocity on the linear path and
:func:`~specforest.diffusers.unet.vp_schedule` reads the grid off the
pipeline's scheduler (with an EDM scheduler, Playground v2.5's, the UNet is
preconditioned as EDM's: :class:`~specforest.diffusers.unet.EDMUNetVelocity` on
:func:`~specforest.diffusers.unet.edm_schedule`'s grid). :func:`sample` then runs the churned SDE of eqs.
(35)-(37) on that grid with :func:`specforest.sample`; text encoding (the
pipeline's own ``encode_prompt``), latents and VAE decoding are as the
pipelines do them.

The grid never reaches ``t = 1``: it starts at the scheduler's first level
``t_0 = s_0 / (1 + s_0) < 1`` from the scheduler's initial noise, ``x_VE =
init_noise_sigma * xi``, i.e. the linear-path state ``x_VE / (1 + s_0)``.
:func:`specforest.sample` accepts such a grid as it is: every step but the
last (into ``t = 0``, a plain Euler step) is then a churned stochastic step,
the first one included, and the run's first speculative round fetches the
root's velocity (one call that commits nothing), as after SD3's deterministic
first step.

This module is the two families' part: the pipeline's checks,
:func:`velocity_and_grid`, SDXL's micro-conditioning (:func:`micro_conditioning`),
the text encoding (:func:`encode_cond`), :func:`row_bytes_of` and :func:`take_apart`,
gathered in :data:`PARTS`; :func:`sample` is the flow every family shares
(:func:`~specforest.diffusers.flow.sample_family`) on these parts, with every
option SD3's takes (``chain`` among them: SDXL's grid starts below ``t = 1``, so
the chains that refuse a grid from ``sigma = 1`` run here too). The UNet adapter, its
grid and its memory heuristic are :mod:`~specforest.diffusers.unet`; which family a
pipeline is, :func:`~specforest.diffusers.detection.is_sdxl` and
:func:`~specforest.diffusers.detection.is_sd`; the decoding,
:func:`~specforest.diffusers.decoding.decode_unet`. diffusers itself is not imported here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

import torch

from ..couplings import Coupling
from ..options import TunedFor
from ..trees import DraftTree
from ..validation import check_int as _check_int
from ..validation import check_number as _check_number
from .checks import image_size, vae_scale_factor
from .decoding import decode_unet as decode
from .decoding import unet_images
from .detection import is_sd, is_sdxl, unet_family
from .flow import DEFAULT_CHURN, FamilyParts, Prepared, sample_family
from .run import SD3Result, execution_device
from .text import UNET_TEXT, check_unet_text
from .unet import (
    PREDICTION_TYPES,
    EDMUNetVelocity,
    UNetVelocity,
    VPSchedule,
    edm_schedule,
    is_edm_scheduler,
    unet_row_bytes,
    vp_schedule,
)

__all__ = [
    "PARTS",
    "decode",
    "encode_cond",
    "is_sd",
    "is_sdxl",
    "micro_conditioning",
    "row_bytes_of",
    "sample",
    "take_apart",
    "unet_row_bytes",
    "velocity_and_grid",
]

_DEFAULT_GUIDANCE = {"sdxl": 5.0, "sd": 7.5}  # the pipelines' own defaults


def _check_pipeline(pipe: Any, family: str) -> Mapping:
    """The UNet config, after the checks that the adapter's assumptions hold."""
    ucfg = pipe.unet.config
    if ucfg.get("time_cond_proj_dim") is not None:
        raise ValueError(
            "the UNet takes a guidance embedding (time_cond_proj_dim, a latent-consistency model); "
            "only classifier-free-guided UNets are supported"
        )
    latent = pipe.vae.config.get("latent_channels")
    if latent is not None and ucfg.get("in_channels") != latent:
        raise ValueError(
            f"the UNet takes {ucfg.get('in_channels')} input channels but the VAE's latents have {latent} "
            "(an inpainting or depth UNet?); only text-to-image UNets are supported"
        )
    pred = pipe.scheduler.config.get("prediction_type", "epsilon")
    if pred not in PREDICTION_TYPES:
        raise ValueError(
            f"the scheduler's prediction_type is {pred!r}; supported: {', '.join(PREDICTION_TYPES)} "
            f"({family} UNets predict the noise or v)"
        )
    return ucfg


def _size(name: str, value: Any, default: Optional[tuple]) -> Optional[tuple]:
    """A ``(a, b)`` pair of non-negative ints (SDXL's micro-conditioning), or ``default``."""
    if value is None:
        return default
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        raise ValueError(f"{name} must be a pair of ints >= 0, got {value!r}")
    return tuple(value)


def _time_ids(pipe: Any, pooled: torch.Tensor, dtype: torch.dtype, **sizes: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """SDXL's ``(1, 6)`` time ids and their negatives, as the pipeline makes them (its own ``_get_add_time_ids``)."""
    te2 = getattr(pipe, "text_encoder_2", None)
    proj = int(pooled.shape[-1]) if te2 is None else te2.config.projection_dim
    pos = pipe._get_add_time_ids(
        sizes["original_size"],
        sizes["crops_coords_top_left"],
        sizes["target_size"],
        dtype=dtype,
        text_encoder_projection_dim=proj,
    )
    if sizes["negative_original_size"] is not None and sizes["negative_target_size"] is not None:
        neg = pipe._get_add_time_ids(
            sizes["negative_original_size"],
            sizes["negative_crops_coords_top_left"],
            sizes["negative_target_size"],
            dtype=dtype,
            text_encoder_projection_dim=proj,
        )
    else:
        neg = pos
    return pos, neg


def _guidance(family: str, guidance_scale: Optional[float]) -> float:
    """The guidance scale ``g >= 0``; ``None``: the pipeline's own default."""
    return _check_number("guidance_scale", _DEFAULT_GUIDANCE[family] if guidance_scale is None else guidance_scale, 0.0)


def velocity_and_grid(
    pipe: Any,
    *,
    num_inference_steps: int,
    guidance_scale: Optional[float] = None,
    height: Optional[int] = None,
    width: Optional[int] = None,
    cross_attention_kwargs: Optional[dict] = None,
) -> "tuple[UNetVelocity, VPSchedule, tuple, torch.device]":
    """What :func:`specforest.sample` needs of an SDXL / SD pipeline: the velocity, the grid, the latents' shape.

    Args:
        pipe: a ``StableDiffusionXLPipeline`` or ``StableDiffusionPipeline``.
        num_inference_steps: grid steps ``T >= 1``.
        guidance_scale: classifier-free guidance ``g >= 0`` (``None``: the pipeline's, SDXL 5.0, SD 7.5).
        height, width: image size in pixels, divisible by ``vae_scale_factor``
            (default: the UNet's ``sample_size x vae_scale_factor``).
        cross_attention_kwargs: passed to the UNet.

    Returns:
        ``(velocity, schedule, latent_shape (C, h, w), device)``: the
        :class:`~specforest.diffusers.unet.UNetVelocity` (its ``image_size`` is ``(height,
        width)``), the :class:`~specforest.diffusers.unet.VPSchedule` (the grid
        ``schedule.sigmas`` starts below 1; the initial state is ``schedule.latent_scale x
        N(0, I)``), one image's latent shape and where the UNet's inputs go.

    Raises:
        ValueError / TypeError: naming the parameter, or the supported pipelines.
    """
    family = unet_family(pipe)
    ucfg = _check_pipeline(pipe, family)
    steps = _check_int("num_inference_steps", num_inference_steps, 1)
    guidance = _guidance(family, guidance_scale)
    vsf = vae_scale_factor(pipe)
    sample_size = ucfg.get("sample_size", 64)
    sample_size = sample_size[0] if isinstance(sample_size, (list, tuple)) else int(sample_size)
    height, width = image_size(height, width, default=sample_size * vsf, multiple=vsf, what=f"vae_scale_factor = {vsf}")
    latent_shape = (int(ucfg.get("in_channels", 4)), height // vsf, width // vsf)
    schedule = _schedule(pipe.scheduler, steps)
    device = execution_device(pipe, pipe.unet)
    common = dict(
        prediction_type=pipe.scheduler.config.get("prediction_type", "epsilon"),
        guidance_scale=guidance,
        device=device,
        cross_attention_kwargs=cross_attention_kwargs,
    )
    if schedule.alphas_cumprod is None:
        # an EDM scheduler (Playground v2.5): the UNet is preconditioned as EDM's, its time input log(sigma) / 4
        cfg = pipe.scheduler.config
        velocity = EDMUNetVelocity(
            pipe.unet, sigma_data=cfg["sigma_data"], sigma_min=cfg["sigma_min"], sigma_max=cfg["sigma_max"], **common
        )
    else:
        velocity = UNetVelocity(pipe.unet, schedule.alphas_cumprod, **common)
    velocity.image_size = (height, width)
    return velocity, schedule, latent_shape, device


def _schedule(scheduler: Any, steps: int) -> VPSchedule:
    """The grid of the pipeline's scheduler: an EDM scheduler's own (:func:`edm_schedule`), else the VP one
    (:func:`vp_schedule`)."""
    return edm_schedule(scheduler, steps) if is_edm_scheduler(scheduler) else vp_schedule(scheduler, steps)


def micro_conditioning(
    pipe: Any,
    height: int,
    width: int,
    *,
    original_size: Optional[tuple[int, int]] = None,
    crops_coords_top_left: tuple[int, int] = (0, 0),
    target_size: Optional[tuple[int, int]] = None,
    negative_original_size: Optional[tuple[int, int]] = None,
    negative_crops_coords_top_left: tuple[int, int] = (0, 0),
    negative_target_size: Optional[tuple[int, int]] = None,
) -> dict:
    """SDXL's micro-conditioning with its defaults filled in (``original_size`` and ``target_size``:
    ``(height, width)``); ``{}`` for an SD pipeline, which has none.

    Raises:
        ValueError: on a value that is not a pair of ints ``>= 0``, or on any of them given for SD.
    """
    micro = dict(
        original_size=original_size,
        crops_coords_top_left=crops_coords_top_left,
        target_size=target_size,
        negative_original_size=negative_original_size,
        negative_crops_coords_top_left=negative_crops_coords_top_left,
        negative_target_size=negative_target_size,
    )
    if unet_family(pipe) == "sd":
        given = [k for k, v in micro.items() if v is not None and v != (0, 0)]
        if given:
            raise ValueError(f"{', '.join(given)} are SDXL's micro-conditioning; a StableDiffusionPipeline has none")
        return {}
    defaults = {"original_size": (height, width), "target_size": (height, width)}
    return {k: _size(k, v, defaults.get(k)) for k, v in micro.items()}


def encode_cond(pipe: Any, velocity: UNetVelocity, text: dict, *, micro: dict, clip_skip: Optional[int] = None) -> dict:
    """The conditioning ``velocity`` reads, one row per caption, as the pipeline encodes it.

    The pipeline's own ``encode_prompt`` (the negatives with guidance only, the LoRA
    scale from the velocity's ``cross_attention_kwargs``); for SDXL the pooled
    embeddings and the time ids of ``micro`` as per-row ``text_embeds`` and ``time_ids``.

    Args:
        pipe: the pipeline ``velocity`` was made from (:func:`velocity_and_grid`).
        velocity: its velocity.
        text: the checked text inputs, what ``encode_prompt`` gets (:func:`~specforest.diffusers.text.check_unet_text`).
        micro: SDXL's micro-conditioning (:func:`micro_conditioning`; ``{}`` for SD).
        clip_skip: text encoder layers to skip.

    Returns:
        ``{name: (n, ...)}`` on ``velocity.device`` in the UNet's dtype, row ``j`` caption ``j``.

    Raises:
        ValueError / TypeError: on a ``clip_skip`` that is not an int ``>= 0``.
    """
    family = unet_family(pipe)
    if clip_skip is not None:
        clip_skip = _check_int("clip_skip", clip_skip, 0)
    device, cfg = velocity.device, velocity.branches == 2
    cak = velocity.prediction.cross_attention_kwargs
    lora_scale = None if cak is None else cak.get("scale")
    with torch.no_grad():
        if family == "sdxl":
            pe, npe, ppe, nppe = pipe.encode_prompt(
                device=device,
                num_images_per_prompt=1,
                do_classifier_free_guidance=cfg,
                lora_scale=lora_scale,
                clip_skip=clip_skip,
                **text,
            )
        else:
            pe, npe = pipe.encode_prompt(
                text["prompt"],
                device,
                1,
                cfg,
                text["negative_prompt"],
                prompt_embeds=text["prompt_embeds"],
                negative_prompt_embeds=text["negative_prompt_embeds"],
                lora_scale=lora_scale,
                clip_skip=clip_skip,
            )
    n = pe.shape[0]
    conds = {"encoder_hidden_states": pe}
    if cfg:
        conds["negative_encoder_hidden_states"] = npe
    if family == "sdxl":
        ids, neg_ids = _time_ids(pipe, ppe, pe.dtype, **micro)
        conds["text_embeds"] = ppe
        conds["time_ids"] = ids.expand(n, -1)
        if cfg:
            conds["negative_text_embeds"] = nppe
            conds["negative_time_ids"] = neg_ids.expand(n, -1)
    return {k: v.to(device, velocity.dtype) for k, v in conds.items()}


def row_bytes_of(pipe: Any, velocity: UNetVelocity, latent_shape: tuple, cond: dict) -> int:
    """Bytes one sampler row adds inside a UNet call (:func:`unet_row_bytes`) with the per-row
    conditioning ``cond`` (:func:`encode_cond`)."""
    return unet_row_bytes(
        pipe.unet.config,
        latent_hw=tuple(latent_shape[1:]),
        text_tokens=cond["encoder_hidden_states"].shape[1],
        branches=velocity.branches,
        dtype=velocity.dtype,
        cond_numel=sum(v[0].numel() for k, v in cond.items() if not k.startswith("negative_")),
        latent_numel=math.prod(latent_shape),
    )


_MICRO = (
    "original_size",
    "crops_coords_top_left",
    "target_size",
    "negative_original_size",
    "negative_crops_coords_top_left",
    "negative_target_size",
)


def _check_parts(pipe: Any) -> None:
    """The pipeline is a supported SDXL or SD one (:attr:`FamilyParts.check_pipeline`)."""
    _check_pipeline(pipe, unet_family(pipe))


def _check_inputs(pipe: Any, text: dict, options: dict) -> tuple[dict, int, dict]:
    """The guidance and the text inputs of a run, checked (:attr:`FamilyParts.check_inputs`)."""
    family = unet_family(pipe)
    guidance = _guidance(family, options["guidance_scale"])
    text, n = check_unet_text(family, pipe.unet.config, **text)
    return text, n, {**options, "guidance_scale": guidance}


def take_apart(pipe: Any, text: dict, steps: int, options: dict) -> Prepared:
    """The parts of an SDXL or SD run (:class:`~specforest.diffusers.flow.Prepared`): the UNet velocity
    on the scheduler's VP grid (:func:`velocity_and_grid`), which starts below ``t = 1`` (the initial
    state is ``noise_scale x N(0, I)``, ``noise_scale = init_noise_sigma / (1 + s_0)``, the scheduler's
    initial noise on the linear path), and one row of conditioning per caption with SDXL's
    micro-conditioning (:func:`encode_cond`), from checked inputs (:attr:`FamilyParts.take_apart`)."""
    o = options
    velocity, schedule, latent_shape, device = velocity_and_grid(
        pipe,
        num_inference_steps=steps,
        guidance_scale=o["guidance_scale"],
        height=o.get("height"),
        width=o.get("width"),
        cross_attention_kwargs=o.get("cross_attention_kwargs"),
    )
    height, width = velocity.image_size
    micro = micro_conditioning(pipe, height, width, **{k: o[k] for k in _MICRO if k in o})
    return Prepared(
        velocity=velocity,
        sigmas=schedule.sigmas,
        latent_shape=latent_shape,
        device=device,
        cond=encode_cond(pipe, velocity, text, micro=micro, clip_skip=o.get("clip_skip")),
        decode=lambda latents: decode(pipe, latents, "pil")[0],
        noise_scale=schedule.latent_scale,
        config=dict(
            family=unet_family(pipe),
            scheduler=schedule.scheduler,
            prediction_type=velocity.prediction_type,
            first_timestep=float(schedule.timesteps[0]),
            first_sigma=float(schedule.sigmas[0]),
            init_noise_sigma=schedule.init_noise_sigma,
            num_inference_steps=steps,
            guidance_scale=o["guidance_scale"],
            height=height,
            width=width,
            **micro,
        ),
    )


PARTS = FamilyParts(
    network="unet",
    result=SD3Result,
    text_inputs=UNET_TEXT,
    check_pipeline=_check_parts,
    check_inputs=_check_inputs,
    take_apart=take_apart,
    # the tuner's timing runs: the scheduler's grid of their own number of steps
    sigmas=lambda pipe, steps, prepared: _schedule(pipe.scheduler, steps).sigmas,
    row_bytes=row_bytes_of,
    decode=unet_images,
)
"""SDXL's and SD's part of the flow every family shares (:mod:`~specforest.diffusers.flow`)."""


def sample(
    pipe: Any,
    prompt: str | list[str] | None = None,
    *,
    prompt_2: str | list[str] | None = None,
    prompt_embeds: torch.Tensor | None = None,
    negative_prompt: str | list[str] | None = None,
    negative_prompt_2: str | list[str] | None = None,
    negative_prompt_embeds: torch.Tensor | None = None,
    pooled_prompt_embeds: torch.Tensor | None = None,
    negative_pooled_prompt_embeds: torch.Tensor | None = None,
    num_inference_steps: int = 50,
    guidance_scale: float | None = None,
    height: int | None = None,
    width: int | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    num_images_per_prompt: int = 1,
    output_type: str = "pil",
    churn: float | None = DEFAULT_CHURN,
    chain: Any = "em",
    eta: float = 0.0,
    tree: DraftTree | None = None,
    K: int | None = None,
    L: int | None = None,
    coupling: str | Coupling = "grs",
    draft: Any = "velocity",
    prefetch: str = "nearest",
    verify: str = "internal",
    progress: bool = True,
    max_memory_gb: float | None = None,
    lazy: bool = False,
    original_size: tuple[int, int] | None = None,
    crops_coords_top_left: tuple[int, int] = (0, 0),
    target_size: tuple[int, int] | None = None,
    negative_original_size: tuple[int, int] | None = None,
    negative_crops_coords_top_left: tuple[int, int] = (0, 0),
    negative_target_size: tuple[int, int] | None = None,
    clip_skip: int | None = None,
    cross_attention_kwargs: dict | None = None,
    tuned_for: TunedFor | None = None,
    pad_rows: "Optional[str | list[int]]" = None,
    warmup: bool = False,
    record_deltas: bool = False,
    **options: Any,
) -> SD3Result:
    """Generate images with an SDXL or SD 1.5 / 2.x pipeline, sampling the churned SDE exactly.

    The pipeline's text encoders (``encode_prompt``), UNet and VAE are used as
    the pipeline uses them; only the sampling loop differs: the churned
    Euler-Maruyama chain of eqs. (35)-(37) on the linear path, on the grid of
    the pipeline's scheduler mapped by ``t = s / (1 + s)``
    (:func:`~specforest.diffusers.unet.vp_schedule`), from the scheduler's
    initial noise rescaled to the linear path, run by :func:`specforest.sample`
    with the UNet as a velocity (:class:`~specforest.diffusers.unet.UNetVelocity`).
    Any tree or coupling gives latents with the law of the standard chain
    (``tree=None``); they change only the number of sequential UNet calls
    (``stats.nfe``). As ``churn -> 0`` the standard chain becomes the Euler /
    DDIM sampler of the probability-flow ODE (the pipeline's
    ``EulerDiscreteScheduler`` on the same grid).

    Neither the pipeline nor its scheduler is modified.

    Args:
        pipe: a ``StableDiffusionXLPipeline`` or ``StableDiffusionPipeline`` (or
            one with the same components; see :func:`is_sdxl`, :func:`is_sd`).
        prompt: a caption or a list of ``n`` captions; or give ``prompt_embeds``.
        prompt_2: SDXL: caption(s) for the second text encoder (default ``prompt``).
        prompt_embeds: ``(n, seq, cross_attention_dim)`` precomputed embeddings.
        negative_prompt: caption(s) for the unconditional branch (default: ""
            or, for SDXL with ``force_zeros_for_empty_prompt``, zero embeddings).
        negative_prompt_2: SDXL: for the second text encoder.
        negative_prompt_embeds: same shape as ``prompt_embeds``.
        pooled_prompt_embeds: SDXL: ``(n, pooled_dim)``, required with ``prompt_embeds``.
        negative_pooled_prompt_embeds: SDXL: ``(n, pooled_dim)``, with ``negative_prompt_embeds``.
        num_inference_steps: grid steps ``T >= 1``.
        guidance_scale: classifier-free guidance ``g >= 0`` (``<= 1``: none);
            default the pipeline's (SDXL 5.0, SD 7.5).
        height, width: image size in pixels, divisible by ``vae_scale_factor``
            (default: the UNet's ``sample_size x vae_scale_factor``).
        generator: the only source of randomness (latents, then the sampler's
            seed); a list of one generator per image makes image ``i`` a function
            of ``generator[i]`` alone.
        num_images_per_prompt: images per caption; ``N = n x num_images_per_prompt`` images.
        output_type: ``pil``, ``np``, ``pt`` or ``latent``.
        churn: ``eps`` in (0, 1], the ``em`` chain's (unused with another ``chain``).
        chain, eta, tree, K, L, coupling, draft, prefetch, verify, lazy, pad_rows, warmup, record_deltas, options:
            as in :func:`specforest.diffusers.pipeline_sd3.sample` (``warmup``: the UNet called at
            every row count of the run first; padding and warm-up change no image). This grid starts
            below ``t = 1``, so a chain that refuses one from ``sigma = 1`` runs here.
        progress: show the sampler's progress bar.
        max_memory_gb: memory limit in GB (> 0); default the free CUDA memory, or 50% of RAM.
        original_size, crops_coords_top_left, target_size: SDXL's micro-conditioning
            (default ``(height, width)``, ``(0, 0)``, ``(height, width)``).
        negative_original_size, negative_crops_coords_top_left, negative_target_size:
            for the unconditional branch (default: the same as the conditional's).
        clip_skip: text encoder layers to skip, as in the pipelines.
        cross_attention_kwargs: passed to the UNet (its ``scale`` is the LoRA scale of the text encoders).
        tuned_for: the run a tuned configuration was chosen for, set by ``sample(pipe, ...,
            **tuned)`` with a :class:`~specforest.latency.Tuned`: a run whose
            ``num_inference_steps``, churn or images differ from it is refused
            (``**tuned.options()``: unchecked).

    Returns:
        :class:`~specforest.diffusers.pipeline_sd3.SD3Result`; ``config`` records
        the family, the scheduler, ``prediction_type``, the grid's first level
        and initial noise scale, and, with SD's safety checker,
        ``nsfw_content_detected``.

    Raises:
        ValueError / TypeError: on invalid arguments or an unsupported pipeline
            (naming the parameter, or the supported pipelines).
        MemoryError: if the run would not fit the memory limit.
        FloatingPointError: if the UNet returns NaN or inf.
    """
    # every parameter, as given, to the flow every family shares
    return sample_family(PARTS, **locals())
