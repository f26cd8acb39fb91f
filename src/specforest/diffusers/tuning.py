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
measured up to that size and extended linearly beyond. The three tuners are
one flow (:func:`~specforest.diffusers.flow.tune_family`) on each family's
parts, and take the same sampler options.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from ..latency import Tuned
from . import pipeline_flux as _flux
from . import pipeline_sd3 as _sd3
from . import pipeline_sdxl as _sdxl
from .detection import is_flux, is_sd, is_sdxl
from .flow import DEFAULT_CHURN, tune_family

__all__ = ["tune", "tune_flux", "tune_sdxl"]


def tune(
    pipe: Any,
    prompt: "str | Sequence[str]",
    *,
    num_inference_steps: int = 50,
    guidance_scale: float = 7.0,
    height: Optional[int] = None,
    width: Optional[int] = None,
    churn: Optional[float] = DEFAULT_CHURN,
    shift: Optional[float] = None,
    batch: int = 1,
    budget_max: int = 62,
    drafts: Sequence[str] = ("velocity", "x0"),
    calibration_images: int = 4,
    max_sequence_length: int = 256,
    max_memory_gb: Optional[float] = None,
    seed: int = 0,
    progress: bool = False,
    eta: float = 0.0,
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
        eta: with ``chain="scheduler"``, the ``eta`` the pipeline passes to its scheduler's ``step``
            (DDIM, TCD), as in :func:`~specforest.diffusers.pipeline_sd3.sample`.
        options: further options of :func:`specforest.sample`, as
            :func:`specforest.latency.tune` takes them: the ``chain`` to tune for (``churn``, the
            ``em`` chain's, is left out with another at its default; ``"scheduler"``: the pipeline's own
            scheduler, recorded by its class and ``eta``), constraints (``verify``, ``draft``,
            ``coupling``) and options passed to every run (``prefetch``, ``pad_rows``,
            ``model_kwargs``); ``prefetch`` and the chain are recorded in the result, give the others to
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
    args = dict(locals())
    if is_flux(pipe):
        raise TypeError("pipe is a FluxPipeline: tune it with specforest.diffusers.tuning.tune_flux")
    if is_sdxl(pipe) or is_sd(pipe):
        raise TypeError(
            f"pipe is a {type(pipe).__name__} (a UNet pipeline): tune it with specforest.diffusers.tuning.tune_sdxl"
        )
    return tune_family(_sd3.PARTS, **args)


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
    churn: Optional[float] = DEFAULT_CHURN,
    shift: Optional[float] = None,
    batch: int = 1,
    budget_max: int = 62,
    drafts: Sequence[str] = ("velocity", "x0"),
    calibration_images: int = 4,
    max_sequence_length: int = 512,
    max_memory_gb: Optional[float] = None,
    seed: int = 0,
    progress: bool = False,
    eta: float = 0.0,
    **options: Any,
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
        batch, budget_max, drafts, calibration_images, max_memory_gb, seed, progress, eta, options: as in
            :func:`tune`.

    Returns:
        A :class:`~specforest.latency.Tuned`; ``pipeline_flux.sample(pipe, ..., **tuned)`` runs it.

    Raises:
        ValueError / TypeError: naming the parameter.
    """
    if not isinstance(negative_prompt, str):
        raise TypeError(f"negative_prompt must be a str, got {type(negative_prompt).__name__}")
    return tune_family(_flux.PARTS, **locals())


def tune_sdxl(
    pipe: Any,
    prompt: "str | Sequence[str]",
    *,
    num_inference_steps: int = 50,
    guidance_scale: Optional[float] = None,
    negative_prompt: Optional[str] = None,
    height: Optional[int] = None,
    width: Optional[int] = None,
    churn: Optional[float] = DEFAULT_CHURN,
    batch: int = 1,
    budget_max: int = 62,
    drafts: Sequence[str] = ("velocity", "x0"),
    calibration_images: int = 4,
    max_memory_gb: Optional[float] = None,
    seed: int = 0,
    progress: bool = False,
    eta: float = 0.0,
    **options: Any,
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
        batch, budget_max, drafts, calibration_images, max_memory_gb, seed, progress, eta, options: as in
            :func:`tune` (a chain that refuses a grid from ``sigma = 1`` runs on this one).

    Returns:
        A :class:`~specforest.latency.Tuned`; ``pipeline_sdxl.sample(pipe, ..., **tuned)`` runs it and
        checks the run's steps, churn and images against it.

    Raises:
        ValueError / TypeError: naming the parameter, or the supported pipelines.
    """
    return tune_family(_sdxl.PARTS, **locals())
