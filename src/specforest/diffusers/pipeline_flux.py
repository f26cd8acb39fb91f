"""Flux end to end with the exact speculative sampler (``FluxPipeline``, FLUX.1-dev and -schnell).

Flux is a rectified flow like SD3, with four differences an adapter must get
right:

* **Packing.** The transformer reads the latents as a sequence of 2 x 2 patches,
  ``(batch, C, h, w) -> (batch, hw/4, 4C)``. Packing is a permutation of coordinates,
  so the sampler keeps the state unpacked, ``(C, h, w)``, and
  :class:`~specforest.diffusers.flux_velocity.FluxVelocity` packs on the way in
  and unpacks on the way out: the law of the chain is that of the packed one,
  and the initial noise is drawn unpacked from the generator as
  ``FluxPipeline`` draws it.
* **Positions.** ``img_ids`` ``(hw/4, 3)`` and ``txt_ids`` ``(seq, 3)`` are 2-D
  and shared by every row of a call; the adapter builds them from the shapes
  it is called with, so they are never per-row conditioning.
* **Guidance.** FLUX.1-dev is guidance-distilled: ``guidance_scale`` is an input
  of the network (one branch, one row per state), present only when the
  transformer's config has ``guidance_embeds``. True classifier-free guidance
  (``true_cfg_scale > 1`` with a negative prompt) runs both branches in **one**
  call, where ``FluxPipeline`` makes two.
* **Time.** The transformer multiplies ``timestep`` (and ``guidance``) by 1000
  inside, so it is called at ``timestep = sigma``; the grid is
  ``FluxPipeline``'s, the shifted ``linspace(1, 1/T, T)`` with ``mu`` from the
  packed sequence length under dynamic shifting
  (:func:`~specforest.diffusers.grid.flux_sigmas`).

The velocity (packing and positions included) is
:mod:`~specforest.diffusers.flux_velocity`, the grid
:mod:`~specforest.diffusers.grid`; this module is the pipeline's part: its
checks, :func:`velocity_and_grid`, :func:`encode_text`, :func:`row_bytes_of`
and :func:`take_apart`, gathered in :data:`PARTS`. :func:`sample` is the flow
every family shares (:func:`~specforest.diffusers.flow.sample_family`) on these
parts, with every option SD3's takes. Text encoding (CLIP pooled + T5) and VAE
decoding (``/ scaling_factor + shift_factor``) are the pipeline's own; only the
sampling loop is :func:`specforest.sample`, on the churned SDE as for SD3
(:mod:`~specforest.diffusers.pipeline_sd3`) or another ``chain``. diffusers
itself is not imported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..couplings import Coupling
from ..options import TunedFor
from ..trees import DraftTree
from ..validation import check_int as _check_int
from ..validation import check_number as _check_number
from .checks import check_components, image_size, vae_scale_factor
from .decoding import decode_flow_match as decode
from .decoding import flow_match_images
from .detection import is_flux
from .flow import DEFAULT_CHURN, FamilyParts, Prepared, sample_family
from .flow_matching import transformer_row_bytes
from .flux_velocity import FluxVelocity, latent_image_ids, pack_latents, unpack_latents
from .grid import flux_sigmas
from .run import SD3Result, execution_device
from .text import EMBEDS, TRANSFORMER_TEXT, check_transformer_text, cond_from_embeds

__all__ = [
    "PARTS",
    "FluxResult",
    "FluxVelocity",
    "cond_from_embeds",
    "encode_text",
    "flux_sigmas",
    "is_flux",
    "latent_image_ids",
    "pack_latents",
    "row_bytes_of",
    "sample",
    "take_apart",
    "unpack_latents",
    "velocity_and_grid",
]


@dataclass
class FluxResult(SD3Result):
    """What :func:`sample` returns: the fields of :class:`~specforest.diffusers.SD3Result`.

    ``images`` with ``output_type="latent"`` and ``latents`` are **unpacked**,
    ``(N, C, h, w)`` for ``N`` images (``FluxPipeline`` returns packed ``(N, hw/4, 4C)`` latents);
    :func:`pack_latents` packs them. ``stats.nfe`` counts sequential transformer
    calls per image (one call carries both true-CFG branches).
    """


def _check_pipeline(pipe: Any) -> None:
    if not is_flux(pipe):
        raise TypeError(
            f"pipe must be a FluxPipeline (or an object whose transformer is a FluxTransformer2DModel), "
            f"got {type(pipe).__name__}"
        )
    check_components(pipe, "FluxPipeline")
    config = getattr(pipe.scheduler, "config", None)
    if "FlowMatch" not in type(pipe.scheduler).__name__ or not isinstance(config, Mapping):
        raise TypeError(
            f"pipe.scheduler must be a FlowMatchEulerDiscreteScheduler, got {type(pipe.scheduler).__name__}"
        )
    tin = int(pipe.transformer.config.get("in_channels", 64))
    lat = int(pipe.vae.config.get("latent_channels", 16))
    if tin != 4 * lat:
        raise TypeError(
            f"pipe.transformer takes in_channels={tin}, not 4 x the VAE's latent_channels={lat}: a "
            "fill, control or inpainting transformer (extra input channels) is not supported"
        )


def _sigmas(pipe: Any, steps: int, latent_shape: tuple, shift: Optional[float]) -> torch.Tensor:
    """``FluxPipeline``'s grid of ``steps`` for latents ``(C, h, w)`` (``mu`` from the packed sequence length)."""
    _, h, w = latent_shape
    return flux_sigmas(pipe.scheduler.config, steps, (h // 2) * (w // 2), shift=shift)


def velocity_and_grid(
    pipe: Any,
    *,
    num_inference_steps: int,
    guidance_scale: float,
    true_cfg_scale: float = 1.0,
    height: Optional[int] = None,
    width: Optional[int] = None,
    shift: Optional[float] = None,
) -> "tuple[FluxVelocity, torch.Tensor, tuple, torch.device]":
    """What :func:`specforest.sample` needs of a Flux pipeline: the velocity, the grid, the latents' shape.

    Args:
        pipe: a ``FluxPipeline``.
        num_inference_steps: grid steps ``T >= 1``.
        guidance_scale: embedded guidance ``g >= 0`` (unused without ``guidance_embeds``).
        true_cfg_scale: true classifier-free guidance ``s >= 0`` (``<= 1``: none).
        height, width: image size in pixels, divisible by ``2 x vae_scale_factor``
            (default: ``default_sample_size x vae_scale_factor``, 1024 for FLUX.1).
        shift: static timestep shift overriding the scheduler's (``None``: its config).

    Returns:
        ``(velocity, sigmas (T + 1,) float64, latent_shape (C, h, w), device)``; the
        velocity's ``image_size`` is ``(height, width)``.

    Raises:
        ValueError / TypeError: naming the parameter.
    """
    _check_pipeline(pipe)
    steps = _check_int("num_inference_steps", num_inference_steps, 1)
    vsf = vae_scale_factor(pipe)
    mult = 2 * vsf
    height, width = image_size(
        height,
        width,
        default=int(getattr(pipe, "default_sample_size", 128)) * vsf,
        multiple=mult,
        what=f"2 x vae_scale_factor = {mult} (Flux packs 2 x 2 latent patches)",
    )
    h, w = height // vsf, width // vsf
    sigmas = _sigmas(pipe, steps, (None, h, w), shift)
    device = execution_device(pipe, pipe.transformer)
    velocity = FluxVelocity(
        pipe.transformer, guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale, device=device
    )
    velocity.image_size = (height, width)
    return velocity, sigmas, (int(pipe.transformer.config.get("in_channels", 64)) // 4, h, w), device


def encode_text(
    pipe: Any,
    prompts: Optional[list],
    negatives: Optional[list],
    *,
    device: torch.device,
    true_cfg: bool,
    max_sequence_length: int,
    prompt_embeds: Optional[torch.Tensor] = None,
    pooled_prompt_embeds: Optional[torch.Tensor] = None,
    negative_prompt_embeds: Optional[torch.Tensor] = None,
    negative_pooled_prompt_embeds: Optional[torch.Tensor] = None,
) -> tuple:
    """``(prompt_embeds, pooled, negative_prompt_embeds, negative_pooled)`` as ``FluxPipeline`` encodes them.

    The negatives are encoded (or passed through) with true CFG only, else ``None``.

    Raises:
        ValueError: with true CFG, if the negative embeddings' shape is not the prompts'
            (both branches go in one call).
    """
    with torch.no_grad():
        pe, ppe, _ = pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=device,
            num_images_per_prompt=1,
            prompt_embeds=prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds,
            max_sequence_length=max_sequence_length,
        )
        if not true_cfg:
            return pe, ppe, None, None
        npe, nppe, _ = pipe.encode_prompt(
            prompt=negatives,
            prompt_2=None,
            device=device,
            num_images_per_prompt=1,
            prompt_embeds=negative_prompt_embeds,
            pooled_prompt_embeds=negative_pooled_prompt_embeds,
            max_sequence_length=max_sequence_length,
        )
    if npe.shape != pe.shape:
        raise ValueError(
            f"the negative prompt embeddings have shape {tuple(npe.shape)} but the prompts' have "
            f"{tuple(pe.shape)}; true CFG puts both in one call, so they must match"
        )
    return pe, ppe, npe, nppe


def row_bytes_of(pipe: Any, velocity: FluxVelocity, latent_shape: tuple, cond: dict) -> int:
    """Bytes one transformer row needs (:func:`~specforest.diffusers.flow_matching.transformer_row_bytes`)
    with the per-caption conditioning ``cond`` (:func:`cond_from_embeds`): ``hw/4`` image tokens and
    ``seq`` text tokens per branch."""
    tcfg = pipe.transformer.config
    _, h, w = latent_shape
    heads = int(tcfg.get("num_attention_heads", 24))
    pe, ppe = cond["encoder_hidden_states"], cond["pooled_projections"]
    return transformer_row_bytes(
        branches=velocity.branches,
        dtype=velocity.dtype,
        image_tokens=(h // 2) * (w // 2),
        text_tokens=pe.shape[1],
        hidden=heads * int(tcfg.get("attention_head_dim", 128)),
        heads=heads,
        cond_numel=pe[0].numel() + ppe[0].numel(),
        latent_numel=math.prod(latent_shape),
    )


def _check_inputs(pipe: Any, text: dict, options: dict) -> tuple[dict, int, dict]:
    """The family options and the text inputs of a run, checked (:attr:`FamilyParts.check_inputs`)."""
    guidance = _check_number("guidance_scale", options["guidance_scale"], 0.0)
    true_cfg = _check_number("true_cfg_scale", options["true_cfg_scale"], 0.0)
    max_seq = _check_int("max_sequence_length", options["max_sequence_length"], 1, 512)
    if true_cfg > 1.0 and text.get("negative_prompt") is None and text.get("negative_prompt_embeds") is None:
        # FluxPipeline would silently run without true CFG here
        raise ValueError(
            f'true_cfg_scale={true_cfg} > 1 needs negative_prompt ("" for an empty one) or '
            "negative_prompt_embeds; or use true_cfg_scale=1"
        )
    text, n = check_transformer_text(text, pipe.transformer.config)
    return text, n, {**options, "guidance_scale": guidance, "true_cfg_scale": true_cfg, "max_sequence_length": max_seq}


def take_apart(pipe: Any, text: dict, steps: int, options: dict) -> Prepared:
    """The parts of a Flux run (:class:`~specforest.diffusers.flow.Prepared`; the state is the
    unpacked latents ``(C, h, w)``): the packing velocity on ``FluxPipeline``'s grid
    (:func:`velocity_and_grid`) and one row of conditioning per caption (:func:`encode_text`),
    from checked inputs (:attr:`FamilyParts.take_apart`)."""
    o = options
    velocity, sigmas, latent_shape, device = velocity_and_grid(
        pipe,
        num_inference_steps=steps,
        guidance_scale=o["guidance_scale"],
        true_cfg_scale=o["true_cfg_scale"],
        height=o.get("height"),
        width=o.get("width"),
        shift=o.get("shift"),
    )
    pe, ppe, npe, nppe = encode_text(
        pipe,
        text["prompt"],
        text["negative_prompt"],
        device=device,
        true_cfg=velocity.do_true_cfg,
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
            family="flux",
            num_inference_steps=steps,
            guidance_scale=o["guidance_scale"],
            guidance_embeds=velocity.guidance_embeds,
            true_cfg_scale=o["true_cfg_scale"],
            height=height,
            width=width,
            shift=o.get("shift"),
            dynamic_shift=bool(pipe.scheduler.config.get("use_dynamic_shifting", False)) and o.get("shift") is None,
        ),
    )


PARTS = FamilyParts(
    network="transformer",
    result=FluxResult,
    text_inputs=TRANSFORMER_TEXT,
    check_pipeline=_check_pipeline,
    check_inputs=_check_inputs,
    take_apart=take_apart,
    sigmas=lambda pipe, steps, prepared: _sigmas(pipe, steps, prepared.latent_shape, prepared.config["shift"]),
    row_bytes=row_bytes_of,
    decode=flow_match_images,
)
"""Flux's part of the flow every family shares (:mod:`~specforest.diffusers.flow`)."""


def sample(
    pipe: Any,
    prompt: str | list[str] | None = None,
    *,
    prompt_embeds: torch.Tensor | None = None,
    negative_prompt: str | list[str] | None = None,
    negative_prompt_embeds: torch.Tensor | None = None,
    pooled_prompt_embeds: torch.Tensor | None = None,
    negative_pooled_prompt_embeds: torch.Tensor | None = None,
    num_inference_steps: int = 28,
    guidance_scale: float = 3.5,
    true_cfg_scale: float = 1.0,
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
    shift: float | None = None,
    max_sequence_length: int = 512,
    tuned_for: TunedFor | None = None,
    pad_rows: "Optional[str | list[int]]" = None,
    warmup: bool = False,
    record_deltas: bool = False,
    **options: Any,
) -> FluxResult:
    """Generate images with a Flux pipeline, sampling the churned SDE exactly.

    The pipeline's text encoders, transformer and VAE are used as
    ``FluxPipeline`` uses them; only the sampling loop differs: the churned
    Euler-Maruyama chain of eqs. (35)-(37) on ``FluxPipeline``'s grid
    (:func:`flux_sigmas`; the first step, from pure noise, and the last, into
    ``sigma = 0``, are plain Euler steps, so ``T = 2`` is the pipeline's own
    sampler), run by :func:`specforest.sample` on unpacked latents
    (:class:`FluxVelocity` packs them for the transformer). Any tree or coupling
    gives latents with the law of the standard chain (``tree=None``); they
    change only the number of sequential transformer calls (``stats.nfe``).

    The arguments are those of :func:`specforest.diffusers.pipeline_sd3.sample`
    with ``FluxPipeline``'s defaults and meanings; the differences are listed
    here. Neither the pipeline nor its scheduler is modified.

    Args:
        pipe: a ``FluxPipeline`` (:func:`is_flux`).
        prompt: a caption or a list of ``n`` captions (T5 and CLIP both get it);
            or give ``prompt_embeds``.
        prompt_embeds: ``(n, seq, joint_attention_dim)`` precomputed T5 embeddings.
        negative_prompt: caption(s) of the negative branch of true CFG; used only
            with ``true_cfg_scale > 1`` (``""`` is a valid, empty, negative).
        negative_prompt_embeds: ``(n, seq, joint_attention_dim)``, same shape as ``prompt_embeds``.
        pooled_prompt_embeds: ``(n, pooled_projection_dim)``, required with ``prompt_embeds``.
        negative_pooled_prompt_embeds: ``(n, pooled_projection_dim)``, with ``negative_prompt_embeds``.
        num_inference_steps: grid steps ``T >= 1`` (FLUX.1-dev: 28; schnell is
            distilled to 1-4 steps, which leaves little to speculate on).
        guidance_scale: embedded guidance ``g >= 0``, an input of the network when
            its config has ``guidance_embeds`` (dev); ignored otherwise (schnell),
            as ``FluxPipeline`` ignores it.
        true_cfg_scale: true classifier-free guidance ``s >= 0``; ``s > 1`` needs a
            negative prompt and puts both branches in one call per round.
        height, width: image size in pixels, divisible by ``2 x vae_scale_factor``
            (default: 1024 for FLUX.1).
        generator: the only source of randomness: the initial latents ``(N, C, h,
            w)`` are drawn from it first, unpacked and in float32, as
            ``FluxPipeline`` draws them (the same noise for a float32 pipeline;
            one in half precision draws in that dtype, see ``docs/diffusers.md``),
            then the sampler's seed. A list of one generator per image makes image ``i`` a
            function of ``generator[i]`` alone.
        num_images_per_prompt: images per caption (``>= 1``); ``N = n x num_images_per_prompt`` images.
        output_type: ``pil``, ``np``, ``pt`` or ``latent`` (unpacked ``(N, C, h, w)``).
        churn, chain, eta, tree, K, L, coupling, draft, prefetch, verify, progress, lazy, pad_rows,
            warmup, record_deltas, options: as in :func:`specforest.diffusers.pipeline_sd3.sample`
            (``warmup``: the transformer called at every row count of the run first; padding and
            warm-up change no image).
        max_memory_gb: memory limit in GB (> 0). Default: the free memory of the
            CUDA device, or 50% of RAM on other devices.
        shift: a static timestep shift overriding the scheduler's (dynamic)
            shift; ``None`` reads ``pipe.scheduler.config``.
        max_sequence_length: T5 tokens (<= 512), as in ``FluxPipeline``.
        tuned_for: the run a tuned configuration was chosen for, set by ``sample(pipe, ...,
            **tuned)`` with a :class:`~specforest.latency.Tuned`: a run whose
            ``num_inference_steps``, churn or images differ from it is refused
            (``**tuned.options()``: unchecked).

    Returns:
        :class:`FluxResult` with ``images``, ``latents``, ``stats``, ``memory``, ``config`` (``chain``
        and its parameters among it), ``warmup_seconds``.

    Raises:
        ValueError / TypeError: on invalid arguments (naming the parameter).
        MemoryError: if the run would not fit the memory limit (with the numbers
            and what to change; nothing is allocated for sampling in that case).
        FloatingPointError: if the transformer returns NaN or inf.
    """
    # every parameter, as given, to the flow every family shares
    return sample_family(PARTS, **locals())
