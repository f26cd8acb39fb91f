"""A pipeline taken apart for :func:`specforest.sample` and :func:`specforest.generate`: :class:`Prepared`.

A family's ``sample`` runs a whole batch of images in one call. A job that
samples images one index at a time (``specforest generate diffusers``, with
continuous batching, per-index random streams and several processes) needs the
parts instead: the velocity, the grid, the latents' shape, one row of
conditioning per caption and the decoder. ``prepare(pipe, prompts, ...)`` of a
family returns them: the flow every family shares
(:func:`~specforest.diffusers.flow.prepare_family`) on the family's parts, the
very ones its ``sample`` takes apart, so a chain run from a :class:`Prepared`
is the chain that ``sample`` runs. One function per family, registered as
:attr:`~specforest.diffusers.families.Family.prepare`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from . import pipeline_flux as _flux
from . import pipeline_sd3 as _sd3
from . import pipeline_sdxl as _sdxl
from .flow import Prepared, prepare_family

__all__ = ["Prepared", "prepare_flux", "prepare_sd3", "prepare_sdxl"]


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
    return prepare_family(_sd3.PARTS, **locals())


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
    return prepare_family(_flux.PARTS, **locals())


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
    return prepare_family(_sdxl.PARTS, **locals())
