"""Stable Diffusion 3 end to end with the exact speculative sampler (paper Sec. 5.3, App. C.3).

The native sampler integrates the probability-flow ODE, whose transitions are
point masses, so speculation would accept nothing; :func:`sample` samples the
same marginals with the churned SDE of eqs. (35)-(37), whose Euler-Maruyama
kernels share a variance and differ only in their means, the structure both
couplings need (or with any other chain of :mod:`specforest.chains`, ``chain=``).
Text encoding, latents and VAE decoding are the pipeline's own; only the
sampling loop is :func:`specforest.sample`.

This module is SD3's part: the pipeline's checks, :func:`velocity_and_grid`
(:class:`FlowMatchVelocity` on the scheduler's grid), :func:`encode_text`,
:func:`row_bytes_of` and :func:`take_apart`, gathered in :data:`PARTS`.
:func:`sample` is the flow every family shares
(:func:`~specforest.diffusers.flow.sample_family`) on these parts: the result
(:class:`~specforest.diffusers.run.SD3Result`), the run
(:mod:`~specforest.diffusers.run`), the checks (:mod:`~specforest.diffusers.checks`,
:mod:`~specforest.diffusers.text`) and the decoding (:mod:`~specforest.diffusers.decoding`)
live beside it. diffusers itself is not imported here: everything goes through
the pipeline object that is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

import torch

from .. import memory as _memory
from ..couplings import Coupling
from ..options import TunedFor
from ..trees import DraftTree
from ..validation import check_int as _check_int
from ..validation import check_number as _check_number
from .checks import check_components, image_size, vae_scale_factor
from .decoding import OUTPUT_TYPES, flow_match_images
from .decoding import decode_flow_match as decode
from .flow import DEFAULT_CHURN, FamilyParts, Prepared, sample_family
from .flow_matching import FlowMatchVelocity, transformer_row_bytes
from .grid import scheduler_sigmas
from .run import SD3Result, execution_device
from .text import EMBEDS, TRANSFORMER_TEXT, check_transformer_text, cond_from_embeds

__all__ = [
    "OUTPUT_TYPES",
    "PARTS",
    "SD3Result",
    "cond_from_embeds",
    "decode",
    "encode_text",
    "row_bytes_of",
    "sample",
    "take_apart",
    "transformer_row_bytes",
    "velocity_and_grid",
]


def _check_pipeline(pipe: Any) -> None:
    check_components(pipe, "StableDiffusion3Pipeline")
    config = getattr(pipe.scheduler, "config", None)
    if not isinstance(config, Mapping) or "num_train_timesteps" not in config:
        raise TypeError(
            f"pipe.scheduler must be a flow-matching scheduler (FlowMatchEulerDiscreteScheduler), "
            f"got {type(pipe.scheduler).__name__}"
        )
    if "FlowMatch" not in type(pipe.scheduler).__name__:
        raise TypeError(
            "pipe.scheduler must be a flow-matching scheduler (the transformer must predict the "
            f"flow-matching velocity), got {type(pipe.scheduler).__name__}"
        )


def _sigmas(pipe: Any, steps: int, latent_shape: tuple, shift: Optional[float]) -> torch.Tensor:
    """The scheduler's grid of ``steps`` for latents ``(C, h, w)`` (its dynamic shift reads their patches)."""
    patch = int(pipe.transformer.config.get("patch_size", 1) or 1)
    _, h, w = latent_shape
    return scheduler_sigmas(pipe.scheduler.config, steps, shift=shift, image_seq_len=(h // patch) * (w // patch))


def velocity_and_grid(
    pipe: Any,
    *,
    num_inference_steps: int,
    guidance_scale: float,
    height: Optional[int] = None,
    width: Optional[int] = None,
    shift: Optional[float] = None,
) -> "tuple[FlowMatchVelocity, torch.Tensor, tuple, torch.device]":
    """What :func:`specforest.sample` needs of an SD3 pipeline: the velocity, the grid, the latents' shape.

    Args:
        pipe: a ``StableDiffusion3Pipeline`` (or one with the same components).
        num_inference_steps: grid steps ``T >= 1``.
        guidance_scale: classifier-free guidance ``g >= 0``.
        height, width: image size in pixels (default: the transformer's native size).
        shift: static timestep shift overriding the scheduler's (``None``: its config).

    Returns:
        ``(velocity, sigmas (T + 1,) float64, latent_shape (C, h, w), device)``; the
        velocity's ``image_size`` is ``(height, width)``.

    Raises:
        ValueError / TypeError: naming the parameter.
    """
    _check_pipeline(pipe)
    tcfg = pipe.transformer.config
    sched_cfg = pipe.scheduler.config
    steps = _check_int("num_inference_steps", num_inference_steps, 1)
    guidance = _check_number("guidance_scale", guidance_scale, 0.0)
    vsf = vae_scale_factor(pipe)
    patch = int(tcfg.get("patch_size", 1) or 1)
    mult = vsf * patch
    height, width = image_size(
        height,
        width,
        default=int(tcfg.get("sample_size", 128)) * vsf,
        multiple=mult,
        what=f"vae_scale_factor x patch_size = {mult}",
    )
    h, w = height // vsf, width // vsf
    max_pos = tcfg.get("pos_embed_max_size")
    if max_pos is not None and max(h, w) // patch > max_pos:
        raise ValueError(
            f"height={height}, width={width} give {h // patch} x {w // patch} patches but the transformer's "
            f"positional embedding covers at most {max_pos} per side (<= {max_pos * mult} pixels)"
        )
    sigmas = _sigmas(pipe, steps, (None, h, w), shift)
    device = execution_device(pipe, pipe.transformer)
    velocity = FlowMatchVelocity(
        pipe.transformer,
        guidance_scale=guidance,
        num_train_timesteps=int(sched_cfg.get("num_train_timesteps", 1000)),
        device=device,
    )
    velocity.image_size = (height, width)
    return velocity, sigmas, (int(tcfg.get("in_channels", 16)), h, w), device


def encode_text(
    pipe: Any,
    prompts: Any,
    negatives: Any,
    *,
    device: torch.device,
    guidance: bool,
    max_sequence_length: int,
    **embeds: Optional[torch.Tensor],
) -> tuple:
    """``(prompt_embeds, negative_prompt_embeds, pooled, negative_pooled)`` as the SD3 pipeline encodes them.

    ``embeds``: precomputed ``prompt_embeds`` and the like, passed through to ``pipe.encode_prompt``.
    """
    with torch.no_grad():
        return pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=guidance,
            negative_prompt=negatives,
            max_sequence_length=max_sequence_length,
            **embeds,
        )


def row_bytes_of(pipe: Any, velocity: FlowMatchVelocity, latent_shape: tuple, cond: dict) -> int:
    """Bytes one transformer row needs (:meth:`FlowMatchVelocity.row_bytes`) with the per-caption
    conditioning ``cond`` (:func:`cond_from_embeds`).

    ``pipe`` is accepted for the callers' convenience; the velocity reads its transformer's config.
    """
    x_row = torch.zeros((1, *latent_shape))
    declared = _memory.row_bytes_of(velocity, x_row, {k: v[:1] for k, v in cond.items()})
    return declared if declared is not None else _memory.DEFAULT_ROW_STATES * 4 * math.prod(latent_shape)


def _check_inputs(pipe: Any, text: dict, options: dict) -> tuple[dict, int, dict]:
    """The family options and the text inputs of a run, checked (:attr:`FamilyParts.check_inputs`)."""
    guidance = _check_number("guidance_scale", options["guidance_scale"], 0.0)
    max_seq = _check_int("max_sequence_length", options["max_sequence_length"], 1, 512)
    text, n = check_transformer_text(text, pipe.transformer.config)
    return text, n, {**options, "guidance_scale": guidance, "max_sequence_length": max_seq}


def take_apart(pipe: Any, text: dict, steps: int, options: dict) -> Prepared:
    """The parts of an SD3 run (:class:`~specforest.diffusers.flow.Prepared`): the velocity on the
    scheduler's grid (:func:`velocity_and_grid`) and one row of conditioning per caption
    (:func:`encode_text`), from checked inputs (:attr:`FamilyParts.take_apart`)."""
    o = options
    velocity, sigmas, latent_shape, device = velocity_and_grid(
        pipe,
        num_inference_steps=steps,
        guidance_scale=o["guidance_scale"],
        height=o.get("height"),
        width=o.get("width"),
        shift=o.get("shift"),
    )
    pe, npe, ppe, nppe = encode_text(
        pipe,
        text["prompt"],
        text["negative_prompt"],
        device=device,
        guidance=velocity.branches == 2,
        max_sequence_length=o["max_sequence_length"],
        **{k: text[k] for k in EMBEDS},
    )
    height, width = velocity.image_size
    return Prepared(
        velocity=velocity,
        sigmas=sigmas,
        latent_shape=latent_shape,
        device=device,
        cond=cond_from_embeds(pe, ppe, npe, nppe, velocity, device),
        decode=lambda latents: decode(pipe, latents, "pil"),
        config=dict(
            family="sd3",
            num_inference_steps=steps,
            guidance_scale=o["guidance_scale"],
            height=height,
            width=width,
            shift=o.get("shift"),
            scheduler_shift=pipe.scheduler.config.get("shift"),
        ),
    )


PARTS = FamilyParts(
    network="transformer",
    result=SD3Result,
    text_inputs=TRANSFORMER_TEXT,
    check_pipeline=_check_pipeline,
    check_inputs=_check_inputs,
    take_apart=take_apart,
    sigmas=lambda pipe, steps, prepared: _sigmas(pipe, steps, prepared.latent_shape, prepared.config["shift"]),
    row_bytes=row_bytes_of,
    decode=flow_match_images,
)
"""SD3's part of the flow every family shares (:mod:`~specforest.diffusers.flow`)."""


def sample(
    pipe: Any,
    prompt: str | list[str] | None = None,
    *,
    prompt_embeds: torch.Tensor | None = None,
    negative_prompt: str | list[str] | None = None,
    negative_prompt_embeds: torch.Tensor | None = None,
    pooled_prompt_embeds: torch.Tensor | None = None,
    negative_pooled_prompt_embeds: torch.Tensor | None = None,
    num_inference_steps: int = 50,
    guidance_scale: float = 7.0,
    height: int | None = None,
    width: int | None = None,
    generator: torch.Generator | None = None,
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
    shift: float | None = None,
    max_sequence_length: int = 256,
    tuned_for: TunedFor | None = None,
    pad_rows: "Optional[str | list[int]]" = None,
    warmup: bool = False,
    record_deltas: bool = False,
    **options: Any,
) -> SD3Result:
    """Generate images with a Stable Diffusion 3 pipeline, sampling the churned SDE exactly.

    The pipeline's text encoders, transformer and VAE are used as the SD3
    pipeline uses them; only the sampling loop differs: the churned
    Euler-Maruyama chain of eqs. (35)-(37) on the scheduler's grid (the first
    step, from pure noise, and the last, into ``sigma = 0``, are plain Euler
    steps), run by :func:`specforest.sample`. Any tree or coupling gives
    latents with the law of the standard chain (``tree=None``); they change
    only the number of sequential transformer calls (``stats.nfe``).

    Neither the pipeline nor its scheduler is modified: the grid is computed
    from ``pipe.scheduler.config`` (:func:`scheduler_sigmas`).

    Args:
        pipe: a ``StableDiffusion3Pipeline`` (or one with the same components).
        prompt: a caption or a list of ``n`` captions; or give ``prompt_embeds``.
        prompt_embeds: ``(n, seq, joint_attention_dim)`` precomputed embeddings.
        negative_prompt: caption(s) for the unconditional branch (default "").
        negative_prompt_embeds: ``(n, seq, joint_attention_dim)``, same shape as ``prompt_embeds``.
        pooled_prompt_embeds: ``(n, pooled_projection_dim)``, required with ``prompt_embeds``.
        negative_pooled_prompt_embeds: ``(n, pooled_projection_dim)``, with ``negative_prompt_embeds``.
        num_inference_steps: grid steps ``T >= 1``.
        guidance_scale: classifier-free guidance ``g >= 0`` (``<= 1``: none).
        height, width: image size in pixels, divisible by ``vae_scale_factor x
            patch_size`` (default: the transformer's ``sample_size x vae_scale_factor``).
        generator: the only source of randomness (latents, then the sampler's
            seed). The same generator state gives the same images for the same
            inputs. A list of one generator per image (diffusers' convention)
            makes image ``i`` a function of ``generator[i]`` alone.
        num_images_per_prompt: images per caption (``>= 1``); ``N = n x num_images_per_prompt`` images.
        output_type: ``pil``, ``np``, ``pt`` or ``latent``.
        churn: ``eps`` in (0, 1] (0 makes speculation vacuous, ERRATA 8), the ``em`` chain's
            parameter; with another ``chain`` leave it at its default (or ``None``): it is unused.
        chain: the chain whose law the images have (:class:`~specforest.options.SamplerOptions`):
            ``"em"`` (the churned SDE, the default), another registered name
            (``"euler_ancestral"``, ...) or a :class:`~specforest.chains.Chain` with its
            parameters; a chain that refuses the grid (one starting at ``sigma = 1``) says so.
            ``"scheduler"``: the pipeline's own scheduler's chain, as its ``step`` computes it
            (:mod:`specforest.diffusers.schedulers`: DDPM, DDIM with ``eta``, Euler ancestral,
            ``sde-dpmsolver++``, LCM, TCD with ``eta``, flow matching with
            ``stochastic_sampling=True``); with no tree the latents are the pipeline's for the same
            generator, with a tree they have the same law. A deterministic scheduler is refused with a tree.
        eta: the scheduler's ``eta``, passed to its ``step`` as pipelines pass it (DDIM, TCD; with
            ``chain="scheduler"`` only).
        tree: a draft tree; exclusive with ``K``/``L``.
        K, L: ``trees.uniform(K, L)``; with ``coupling="rmc"`` only ``L`` (the chain
            length ``B``). ``tree``, ``K`` and ``L`` all ``None``: the standard sampler.
        coupling: ``grs`` (D-GRS), ``rmc`` (chains) or a :class:`~specforest.couplings.Coupling`.
        draft: frozen-prediction kind or a draft velocity (see :func:`specforest.sample`).
        prefetch: ``nearest`` or ``parent`` (ERRATA 9).
        verify: ``internal`` or ``drafted`` (``drafted`` is the paper's protocol:
            ``B = |V|`` states per round).
        progress: show the sampler's progress bar.
        max_memory_gb: memory limit in GB (> 0). Default: the free memory of the
            CUDA device, or 50% of RAM on other devices.
        lazy: the sampler's cost simulation: draft only the visited nodes (same
            law of images and NFE, far less memory and compute).
        shift: static timestep shift ``kappa`` (eq. 38) overriding the scheduler's;
            ``None`` reads ``pipe.scheduler.config``.
        max_sequence_length: T5 tokens (<= 512), as in the SD3 pipeline.
        tuned_for: the run a tuned configuration was chosen for, set by ``sample(pipe, ...,
            **tuned)`` with the :class:`~specforest.latency.Tuned` of
            :func:`specforest.diffusers.tune`: a run whose ``num_inference_steps``, churn or
            images differ from it is refused (``**tuned.options()``: unchecked).
        pad_rows: pad every transformer call's rows up to one of a few sizes (see
            :func:`specforest.sample`; same images).
        warmup: call the transformer at every row count of the run before it
            (:func:`specforest.warmup.warm_up`; same images), so that the run does not pay the
            first call at each shape (cuDNN autotuning, allocator growth); without ``pad_rows``,
            with many images on a tree, the calls are padded to
            :func:`specforest.warmup.pad_rows_for`'s sizes (``config["pad_rows"]`` says which).
        record_deltas: keep every verification in ``stats.deltas`` (as in :func:`specforest.sample`).
        options: further options of :func:`specforest.sample` (a field of
            :class:`~specforest.options.SamplerOptions` this function has no parameter for), passed to
            the sampler as they are; one the pipeline sets (its grid, ``max_rows``, ``model_kwargs``) is refused.

    Returns:
        :class:`SD3Result` with ``images``, ``latents``, ``stats``, ``memory``, ``config`` (the
        sampler's record, ``chain`` and its parameters among it, the family's and the run's),
        ``warmup_seconds``.

    Raises:
        ValueError / TypeError: on invalid arguments (naming the parameter).
        MemoryError: if the run would not fit the memory limit (with the numbers
            and what to change; nothing is allocated for sampling in that case).
        FloatingPointError: if the transformer returns NaN or inf.
    """
    # every parameter, as given, to the flow every family shares
    return sample_family(PARTS, **locals())
