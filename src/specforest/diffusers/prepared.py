"""A pipeline taken apart for :func:`specforest.sample` and :func:`specforest.generate`: :class:`Prepared`.

A family's ``sample`` runs a whole batch of images in one call. A job that
samples images one index at a time (``specforest generate diffusers``, with
continuous batching, per-index random streams and several processes) needs the
parts instead: the velocity, the grid, the latents' shape, one row of
conditioning per caption and the decoder. ``prepare(pipe, prompts, ...)`` of a
family returns them, built from the family module's own functions (the text
encoding, grid and decoding that its ``sample`` uses), so a chain run from a
:class:`Prepared` is the chain that ``sample`` runs. One function per family,
registered as :attr:`~specforest.diffusers.families.Family.prepare`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..validation import check_int
from . import pipeline_flux as _flux
from . import pipeline_sd3 as _sd3
from . import pipeline_sdxl as _sdxl
from .decoding import decode_flow_match, decode_unet
from .detection import unet_family
from .text import check_unet_text, cond_from_embeds

__all__ = ["Prepared", "prepare_flux", "prepare_sd3", "prepare_sdxl"]


@dataclass(frozen=True)
class Prepared:
    """What sampling a family's pipeline needs, for ``n`` captions.

    Attributes:
        velocity: ``v(x, sigma, **cond)`` on the linear path, the library's model contract.
        sigmas: ``(T + 1,)`` float64 grid, from the first level to 0.
        latent_shape: ``(C, h, w)`` of one image's state.
        device: where the velocity takes its states.
        cond: per-caption conditioning, ``(n, ...)`` tensors (row ``j``: caption ``j``).
        decode: ``decode(latents (N, C, h, w)) -> list of N PIL images``, as the pipeline decodes.
        noise_scale: the initial state is ``noise_scale x N(0, I)`` (1 for flow matching, where the
            grid starts at ``sigma = 1``; for a VP UNet, whose grid starts at ``t_0 < 1``, the
            scheduler's initial noise on the linear path, ``init_noise_sigma / (1 + s_0)``).
        config: the resolved options (image size, guidance, ...), for the record.
    """

    velocity: Any
    sigmas: torch.Tensor
    latent_shape: tuple
    device: torch.device
    cond: dict
    decode: Callable[[torch.Tensor], list]
    noise_scale: float = 1.0
    config: dict = field(default_factory=dict)


def _captions(prompts: Sequence[str]) -> list[str]:
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise TypeError("prompts must be a caption or a non-empty list of captions")
    return prompts


def _negatives(negative_prompt: Optional[str], n: int) -> Optional[list]:
    if negative_prompt is None:
        return None
    if not isinstance(negative_prompt, str):
        raise TypeError(f"negative_prompt must be a str or None, got {type(negative_prompt).__name__}")
    return [negative_prompt] * n


def prepare_sd3(
    pipe: Any,
    prompts: "str | Sequence[str]",
    *,
    num_inference_steps: int = 50,
    guidance_scale: float = 7.0,
    negative_prompt: Optional[str] = None,
    height: Optional[int] = None,
    width: Optional[int] = None,
    shift: Optional[float] = None,
    max_sequence_length: int = 256,
) -> Prepared:
    """The parts of a ``StableDiffusion3Pipeline`` run (:func:`~specforest.diffusers.pipeline_sd3.sample`'s
    grid, velocity, text encoding and decoding) for the captions ``prompts``.

    Args:
        pipe: a ``StableDiffusion3Pipeline``.
        prompts: ``n`` captions.
        negative_prompt: the unconditional branch's caption for every image (``None``: SD3's "").
        num_inference_steps, guidance_scale, height, width, shift, max_sequence_length: as in
            :func:`~specforest.diffusers.pipeline_sd3.sample`.

    Returns:
        A :class:`Prepared`.

    Raises:
        ValueError / TypeError: naming the parameter.
    """
    prompts = _captions(prompts)
    max_seq = check_int("max_sequence_length", max_sequence_length, 1, 512)
    velocity, sigmas, latent_shape, device = _sd3.velocity_and_grid(
        pipe,
        num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale,
        height=height,
        width=width,
        shift=shift,
    )
    pe, npe, ppe, nppe = _sd3.encode_text(
        pipe,
        prompts,
        _negatives(negative_prompt, len(prompts)),
        device=device,
        guidance=velocity.branches == 2,
        max_sequence_length=max_seq,
    )
    height, width = velocity.image_size
    return Prepared(
        velocity=velocity,
        sigmas=sigmas,
        latent_shape=latent_shape,
        device=device,
        cond=cond_from_embeds(pe, ppe, npe, nppe, velocity, device),
        decode=lambda latents: decode_flow_match(pipe, latents, "pil"),
        config=dict(
            family="sd3",
            num_inference_steps=len(sigmas) - 1,
            guidance_scale=float(guidance_scale),
            height=height,
            width=width,
            shift=shift,
            scheduler_shift=pipe.scheduler.config.get("shift"),
        ),
    )


def prepare_flux(
    pipe: Any,
    prompts: "str | Sequence[str]",
    *,
    num_inference_steps: int = 28,
    guidance_scale: float = 3.5,
    true_cfg_scale: float = 1.0,
    negative_prompt: Optional[str] = None,
    height: Optional[int] = None,
    width: Optional[int] = None,
    shift: Optional[float] = None,
    max_sequence_length: int = 512,
) -> Prepared:
    """The parts of a ``FluxPipeline`` run (:func:`~specforest.diffusers.pipeline_flux.sample`'s grid,
    packing velocity, text encoding and decoding) for the captions ``prompts``.

    Args:
        pipe: a ``FluxPipeline``.
        prompts: ``n`` captions.
        negative_prompt: the negative caption of true CFG for every image; required with
            ``true_cfg_scale > 1`` (``""`` is an empty one), unused otherwise.
        num_inference_steps, guidance_scale, true_cfg_scale, height, width, shift,
            max_sequence_length: as in :func:`~specforest.diffusers.pipeline_flux.sample`.

    Returns:
        A :class:`Prepared`; the state is the unpacked latents ``(C, h, w)``.

    Raises:
        ValueError / TypeError: naming the parameter.
    """
    prompts = _captions(prompts)
    max_seq = check_int("max_sequence_length", max_sequence_length, 1, 512)
    velocity, sigmas, latent_shape, device = _flux.velocity_and_grid(
        pipe,
        num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale,
        true_cfg_scale=true_cfg_scale,
        height=height,
        width=width,
        shift=shift,
    )
    if velocity.do_true_cfg and negative_prompt is None:
        # FluxPipeline would silently run without true CFG here
        raise ValueError(
            f'true_cfg_scale={true_cfg_scale} > 1 needs negative_prompt ("" for an empty one); or use true_cfg_scale=1'
        )
    pe, ppe, npe, nppe = _flux.encode_text(
        pipe,
        prompts,
        _negatives(negative_prompt, len(prompts)),
        device=device,
        true_cfg=velocity.do_true_cfg,
        max_sequence_length=max_seq,
    )
    height, width = velocity.image_size
    return Prepared(
        velocity=velocity,
        sigmas=sigmas,
        latent_shape=latent_shape,
        device=device,
        cond=cond_from_embeds(pe, ppe, npe, nppe, velocity, device),
        decode=lambda latents: decode_flow_match(pipe, latents, "pil"),
        config=dict(
            family="flux",
            num_inference_steps=len(sigmas) - 1,
            guidance_scale=float(guidance_scale),
            guidance_embeds=velocity.guidance_embeds,
            true_cfg_scale=float(true_cfg_scale),
            height=height,
            width=width,
            shift=shift,
            dynamic_shift=bool(pipe.scheduler.config.get("use_dynamic_shifting", False)) and shift is None,
        ),
    )


def prepare_sdxl(
    pipe: Any,
    prompts: "str | Sequence[str]",
    *,
    num_inference_steps: int = 50,
    guidance_scale: Optional[float] = None,
    negative_prompt: Optional[str] = None,
    height: Optional[int] = None,
    width: Optional[int] = None,
    original_size: Optional[tuple[int, int]] = None,
    crops_coords_top_left: tuple[int, int] = (0, 0),
    target_size: Optional[tuple[int, int]] = None,
    negative_original_size: Optional[tuple[int, int]] = None,
    negative_crops_coords_top_left: tuple[int, int] = (0, 0),
    negative_target_size: Optional[tuple[int, int]] = None,
    clip_skip: Optional[int] = None,
) -> Prepared:
    """The parts of a ``StableDiffusionXLPipeline`` or ``StableDiffusionPipeline`` run
    (:func:`~specforest.diffusers.pipeline_sdxl.sample`'s UNet velocity, VP grid, text
    encoding with SDXL's micro-conditioning, and decoding) for the captions ``prompts``.

    The grid starts below ``t = 1``, where the scheduler starts: the initial state is
    ``noise_scale x N(0, I)`` with ``noise_scale = init_noise_sigma / (1 + s_0)``, the
    scheduler's initial noise on the linear path, as ``sample`` draws it.

    Args:
        pipe: a ``StableDiffusionXLPipeline`` or ``StableDiffusionPipeline``.
        prompts: ``n`` captions.
        negative_prompt: the unconditional branch's caption for every image (``None``: the
            pipeline's, "" or SDXL's zero embeddings).
        num_inference_steps, guidance_scale, height, width, original_size,
            crops_coords_top_left, target_size, negative_original_size,
            negative_crops_coords_top_left, negative_target_size, clip_skip: as in
            :func:`~specforest.diffusers.pipeline_sdxl.sample` (``guidance_scale=None``: SDXL
            5.0, SD 7.5).

    Returns:
        A :class:`Prepared`; its ``cond`` holds the text embeddings and, for SDXL, the pooled
        ``text_embeds`` and ``time_ids`` of each caption (with their negatives under guidance).

    Raises:
        ValueError / TypeError: naming the parameter, or the supported pipelines.
    """
    prompts = _captions(prompts)
    velocity, schedule, latent_shape, device = _sdxl.velocity_and_grid(
        pipe,
        num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale,
        height=height,
        width=width,
    )
    family = unet_family(pipe)
    text, _ = check_unet_text(
        family, pipe.unet.config, prompt=prompts, negative_prompt=_negatives(negative_prompt, len(prompts))
    )
    height, width = velocity.image_size
    micro = _sdxl.micro_conditioning(
        pipe,
        height,
        width,
        original_size=original_size,
        crops_coords_top_left=crops_coords_top_left,
        target_size=target_size,
        negative_original_size=negative_original_size,
        negative_crops_coords_top_left=negative_crops_coords_top_left,
        negative_target_size=negative_target_size,
    )
    return Prepared(
        velocity=velocity,
        sigmas=schedule.sigmas,
        latent_shape=latent_shape,
        device=device,
        cond=_sdxl.encode_cond(pipe, velocity, text, micro=micro, clip_skip=clip_skip),
        decode=lambda latents: decode_unet(pipe, latents, "pil")[0],
        noise_scale=schedule.latent_scale,
        config=dict(
            family=family,
            num_inference_steps=schedule.steps,
            guidance_scale=velocity.guidance_scale,
            height=height,
            width=width,
            scheduler=schedule.scheduler,
            prediction_type=velocity.prediction_type,
            first_sigma=float(schedule.sigmas[0]),
            init_noise_sigma=schedule.init_noise_sigma,
            **micro,
        ),
    )
