"""The fastest exact configuration of an SD3 (:func:`tune`), Flux (:func:`tune_flux`) or SDXL / SD
(:func:`tune_sdxl`) pipeline here.

The pipeline's transformer or UNet (with classifier-free guidance, one batched
call of both branches) is the target; its batch-cost curve, the acceptance of
the captions' chains and the sampler's own time per round are measured as
:func:`specforest.latency.tune` does for any velocity, on the pipeline's own
scheduler grid (:func:`~specforest.diffusers.grid.scheduler_sigmas`,
:func:`~specforest.diffusers.grid.flux_sigmas`,
:func:`~specforest.diffusers.unet.vp_schedule`). Calls
larger than the memory limit allows are split, as in
:func:`~specforest.diffusers.pipeline_sd3.sample`, and the cost curve is
measured up to that size and extended linearly beyond.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch

from .. import memory as _memory
from .. import streams
from ..drafts import get_proposal
from ..latency import Tuned
from ..latency import tune as _tune
from ..trees import chain
from ..validation import check_int, check_number
from . import pipeline_flux as _flux
from . import pipeline_sdxl as _sdxl
from .detection import is_flux, is_sd, is_sdxl
from .grid import flux_sigmas, scheduler_sigmas
from .pipeline_sd3 import _check_pipeline, encode_text, row_bytes_of, velocity_and_grid
from .prepared import prepare_sdxl
from .text import cond_from_embeds
from .unet import vp_schedule

__all__ = ["tune", "tune_flux", "tune_sdxl"]

_SET_HERE = {
    "steps": "num_inference_steps",
    "cond": "the captions' embeddings",
    "grid": "the scheduler's grid, with shift",
    "sigmas": "the scheduler's grid, with shift",
    "max_rows": "from max_memory_gb",
}


def tune(
    pipe: Any,
    prompt: "str | Sequence[str]",
    *,
    num_inference_steps: int = 50,
    guidance_scale: float = 7.0,
    height: Optional[int] = None,
    width: Optional[int] = None,
    churn: float = 0.8,
    shift: Optional[float] = None,
    batch: int = 1,
    budget_max: int = 62,
    drafts: Sequence[str] = ("velocity", "x0"),
    calibration_images: int = 4,
    max_sequence_length: int = 256,
    max_memory_gb: Optional[float] = None,
    seed: int = 0,
    progress: bool = False,
    **options: Any,
) -> Tuned:
    """Choose the tree, coupling, verification mode and draft that minimize predicted wall time for SD3 here.

    Args:
        pipe: a ``StableDiffusion3Pipeline`` (or one with the same components).
        prompt: captions to calibrate on (repeated to ``max(batch, calibration_images)`` images).
        num_inference_steps, guidance_scale, height, width, churn, shift,
            max_sequence_length: the run to tune for, as in
            :func:`~specforest.diffusers.pipeline_sd3.sample`.
        batch: images per run (``>= 1``).
        budget_max, drafts: the candidates, as in :func:`specforest.latency.tune`.
        calibration_images: images of the acceptance calibration chains (``>= 1``).
        max_memory_gb: memory limit in GB (default: the free CUDA memory, or 50% of RAM).
        seed: seed of the calibration latents and runs.
        progress: progress bars while measuring.
        options: further options of :func:`specforest.sample`, as
            :func:`specforest.latency.tune` takes them: constraints (``verify``, ``draft``,
            ``coupling``) and options passed to every run (``prefetch``, ``pad_rows``,
            ``model_kwargs``); ``prefetch`` is recorded in the result, give the others to
            :func:`~specforest.diffusers.pipeline_sd3.sample` again. Refused here, as set by
            this function: ``steps`` (``num_inference_steps``), ``cond`` (the captions),
            ``grid`` and ``sigmas`` (the scheduler's grid, ``shift``), ``max_rows``
            (``max_memory_gb``); the rest as :func:`specforest.latency.tune` refuses them.

    Returns:
        A :class:`~specforest.latency.Tuned`; ``sample(pipe, ..., **tuned)`` runs it and checks
        the run's steps, churn and images against it.

    Raises:
        ValueError / TypeError: naming the parameter.
    """
    if is_flux(pipe):
        raise TypeError("pipe is a FluxPipeline: tune it with specforest.diffusers.tuning.tune_flux")
    if is_sdxl(pipe) or is_sd(pipe):
        raise TypeError(
            f"pipe is a {type(pipe).__name__} (a UNet pipeline): tune it with specforest.diffusers.tuning.tune_sdxl"
        )
    set_here = [k for k in options if k in _SET_HERE]
    if set_here:
        raise ValueError(
            "; ".join(f"{k} is set by this function ({_SET_HERE[k]})" for k in set_here)
            + ": give those through specforest.diffusers.tune's own parameters"
        )
    _check_pipeline(pipe)
    _captions(prompt, 1)  # a bad prompt is named before any work
    batch = check_int("batch", batch, 1)
    calibration_images = check_int("calibration_images", calibration_images, 1)
    churn = check_number("churn", churn, 0.0, 1.0, lo_open=True)
    velocity, _, latent_shape, device = velocity_and_grid(
        pipe,
        num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale,
        height=height,
        width=width,
        shift=shift,
    )
    n = max(batch, calibration_images)
    pe, npe, ppe, nppe = encode_text(
        pipe,
        _captions(prompt, n),
        [""] * n,
        device=device,
        guidance=velocity.branches == 2,
        max_sequence_length=max_sequence_length,
    )
    cond = cond_from_embeds(pe, ppe, npe, nppe, velocity, device)
    patch = int(pipe.transformer.config.get("patch_size", 1) or 1)
    tokens = (latent_shape[1] // patch) * (latent_shape[2] // patch)

    def sigmas_for(steps: int) -> torch.Tensor:
        return scheduler_sigmas(pipe.scheduler.config, steps, shift=shift, image_seq_len=tokens)

    return _tune_sized(
        velocity,
        streams.randn(seed, torch.arange(n), latent_shape, device=device),
        cond,
        row_bytes=row_bytes_of(pipe, velocity, latent_shape, pe, ppe),
        max_memory_gb=max_memory_gb,
        steps=num_inference_steps,
        churn=churn,
        batch=batch,
        budget_max=budget_max,
        drafts=drafts,
        calibration_images=calibration_images,
        seed=seed,
        progress=progress,
        sigmas_for=sigmas_for,
        **options,
    )


def _tune_sized(
    velocity: Any,
    x: torch.Tensor,
    cond: dict,
    *,
    row_bytes: int,
    max_memory_gb: Optional[float],
    steps: int,
    churn: float,
    batch: int,
    budget_max: int,
    drafts: Sequence[str],
    calibration_images: int,
    seed: int,
    progress: bool,
    sigmas_for: Any,
    **options: Any,
) -> Tuned:
    """:func:`specforest.latency.tune` on a pipeline's network, its calls split as the memory limit needs.

    The largest run the tuner times is the batch on a tree of ``budget_max`` (any tree of that
    budget holds as many nodes and rows); calls above the memory model's ``max_rows`` are split.
    ``x``: the calibration states ``(n, *latent_shape)``; ``cond``: their conditioning.
    """
    if max_memory_gb is not None:
        max_memory_gb = check_number("max_memory_gb", max_memory_gb, 0.0, lo_open=True)
    limit, source, fixed = _memory.resolve_limit(max_memory_gb, x.device, "max_memory_gb")
    sized = _memory.estimate(
        trajectories=batch,
        state_numel=math.prod(x.shape[1:]),
        tree=chain(budget_max),
        verify="drafted",
        # the calibration chains of a draft that remembers run full (sized for the one keeping most)
        draft=max(
            (d for d in drafts if get_proposal(d).uses_memory),
            key=lambda d: get_proposal(d).uses_states,
            default=None,
        ),
        steps=steps,
        row_bytes=row_bytes,
        cond_bytes=sum(v[0].numel() * v.element_size() for v in cond.values()),
        fixed_bytes=fixed,
        limit_bytes=limit,
        limit_source=source,
        device=x.device,
        chunked=False,
    )
    return _tune(
        velocity,
        x,
        steps=steps,
        churn=churn,
        cond=cond,
        batch=batch,
        budget_max=budget_max,
        drafts=drafts,
        calibration_trajectories=calibration_images,
        seed=seed,
        progress=progress,
        sigmas_for=sigmas_for,
        max_rows=sized.max_rows or sized.rows_per_call,
        **options,
    )


def _captions(prompt: "str | Sequence[str]", n: int) -> list[str]:
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise TypeError("prompt must be a caption or a non-empty list of captions")
    return [prompts[i % len(prompts)] for i in range(n)]


def tune_flux(
    pipe: Any,
    prompt: "str | Sequence[str]",
    *,
    num_inference_steps: int = 28,
    guidance_scale: float = 3.5,
    true_cfg_scale: float = 1.0,
    negative_prompt: str = "",
    height: Optional[int] = None,
    width: Optional[int] = None,
    churn: float = 0.8,
    shift: Optional[float] = None,
    batch: int = 1,
    budget_max: int = 62,
    drafts: Sequence[str] = ("velocity", "x0"),
    calibration_images: int = 4,
    max_sequence_length: int = 512,
    max_memory_gb: Optional[float] = None,
    seed: int = 0,
    progress: bool = False,
) -> Tuned:
    """:func:`tune` for a ``FluxPipeline``: its transformer (one call per round, both true-CFG
    branches in it) on ``FluxPipeline``'s grid (:func:`~specforest.diffusers.grid.flux_sigmas`).

    Args:
        pipe: a ``FluxPipeline``.
        prompt: captions to calibrate on (repeated to ``max(batch, calibration_images)`` images).
        num_inference_steps, guidance_scale, true_cfg_scale, height, width, churn, shift,
            max_sequence_length: the run to tune for, as in
            :func:`~specforest.diffusers.pipeline_flux.sample`.
        negative_prompt: the negative caption of every image (used with ``true_cfg_scale > 1``).
        batch, budget_max, drafts, calibration_images, max_memory_gb, seed, progress: as in :func:`tune`.

    Returns:
        A :class:`~specforest.latency.Tuned`; ``pipeline_flux.sample(pipe, ..., **tuned)`` runs it.

    Raises:
        ValueError / TypeError: naming the parameter.
    """
    _flux._check_pipeline(pipe)
    batch = check_int("batch", batch, 1)
    calibration_images = check_int("calibration_images", calibration_images, 1)
    churn = check_number("churn", churn, 0.0, 1.0, lo_open=True)
    max_seq = check_int("max_sequence_length", max_sequence_length, 1, 512)
    if not isinstance(negative_prompt, str):
        raise TypeError(f"negative_prompt must be a str, got {type(negative_prompt).__name__}")
    velocity, _, latent_shape, device = _flux.velocity_and_grid(
        pipe,
        num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale,
        true_cfg_scale=true_cfg_scale,
        height=height,
        width=width,
        shift=shift,
    )
    n = max(batch, calibration_images)
    pe, ppe, npe, nppe = _flux.encode_text(
        pipe,
        _captions(prompt, n),
        [negative_prompt] * n,
        device=device,
        true_cfg=velocity.do_true_cfg,
        max_sequence_length=max_seq,
    )
    cond = cond_from_embeds(pe, ppe, npe, nppe, velocity, device)
    tokens = (latent_shape[1] // 2) * (latent_shape[2] // 2)

    def sigmas_for(steps: int) -> torch.Tensor:
        return flux_sigmas(pipe.scheduler.config, steps, tokens, shift=shift)

    return _tune_sized(
        velocity,
        streams.randn(seed, torch.arange(n), latent_shape, device=device),
        cond,
        row_bytes=_flux.row_bytes_of(pipe, velocity, latent_shape, pe, ppe),
        max_memory_gb=max_memory_gb,
        steps=num_inference_steps,
        churn=churn,
        batch=batch,
        budget_max=budget_max,
        drafts=drafts,
        calibration_images=calibration_images,
        seed=seed,
        progress=progress,
        sigmas_for=sigmas_for,
    )


def tune_sdxl(
    pipe: Any,
    prompt: "str | Sequence[str]",
    *,
    num_inference_steps: int = 50,
    guidance_scale: Optional[float] = None,
    negative_prompt: Optional[str] = None,
    height: Optional[int] = None,
    width: Optional[int] = None,
    churn: float = 0.8,
    batch: int = 1,
    budget_max: int = 62,
    drafts: Sequence[str] = ("velocity", "x0"),
    calibration_images: int = 4,
    max_memory_gb: Optional[float] = None,
    seed: int = 0,
    progress: bool = False,
) -> Tuned:
    """:func:`tune` for a ``StableDiffusionXLPipeline`` or ``StableDiffusionPipeline``: its UNet (one call
    per round, both guidance branches in it) on the scheduler's VP grid
    (:func:`~specforest.diffusers.unet.vp_schedule`), from the scheduler's initial noise.

    The velocity, grid and conditioning are :func:`~specforest.diffusers.prepared.prepare_sdxl`'s, the
    chain that :func:`~specforest.diffusers.pipeline_sdxl.sample` runs; the shorter timing runs use the
    scheduler's grid of their own number of steps.

    Args:
        pipe: a ``StableDiffusionXLPipeline`` or ``StableDiffusionPipeline``.
        prompt: captions to calibrate on (repeated to ``max(batch, calibration_images)`` images).
        num_inference_steps, guidance_scale, height, width, churn: the run to tune for, as in
            :func:`~specforest.diffusers.pipeline_sdxl.sample` (``guidance_scale=None``: SDXL 5.0, SD 7.5).
        negative_prompt: the negative caption of every image (``None``: the pipeline's).
        batch, budget_max, drafts, calibration_images, max_memory_gb, seed, progress: as in :func:`tune`.

    Returns:
        A :class:`~specforest.latency.Tuned`; ``pipeline_sdxl.sample(pipe, ..., **tuned)`` runs it and
        checks the run's steps, churn and images against it.

    Raises:
        ValueError / TypeError: naming the parameter, or the supported pipelines.
    """
    batch = check_int("batch", batch, 1)
    calibration_images = check_int("calibration_images", calibration_images, 1)
    churn = check_number("churn", churn, 0.0, 1.0, lo_open=True)
    n = max(batch, calibration_images)
    parts = prepare_sdxl(
        pipe,
        _captions(prompt, n),
        num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale,
        negative_prompt=negative_prompt,
        height=height,
        width=width,
    )

    def sigmas_for(steps: int) -> torch.Tensor:
        return vp_schedule(pipe.scheduler, steps).sigmas

    # the run's initial states: the scheduler's initial noise on the linear path
    x = parts.noise_scale * streams.randn(seed, torch.arange(n), parts.latent_shape, device=parts.device)
    return _tune_sized(
        parts.velocity,
        x,
        parts.cond,
        row_bytes=_sdxl.row_bytes_of(pipe, parts.velocity, parts.latent_shape, parts.cond),
        max_memory_gb=max_memory_gb,
        steps=num_inference_steps,
        churn=churn,
        batch=batch,
        budget_max=budget_max,
        drafts=drafts,
        calibration_images=calibration_images,
        seed=seed,
        progress=progress,
        sigmas_for=sigmas_for,
    )
