"""Flux end to end with the exact speculative sampler (``FluxPipeline``, FLUX.1-dev and -schnell).

Flux is a rectified flow like SD3, with four differences an adapter must get
right, all handled here:

* **Packing.** The transformer reads the latents as a sequence of 2 x 2 patches,
  ``(B, C, h, w) -> (B, hw/4, 4C)``. Packing is a permutation of coordinates,
  so the sampler keeps the state unpacked, ``(C, h, w)``, and
  :class:`FluxVelocity` packs on the way in and unpacks on the way out: the law
  of the chain is that of the packed one, and the initial noise is drawn
  unpacked from the generator as ``FluxPipeline`` draws it.
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
  (:func:`~specforest.diffusers.grid.scheduler_sigmas` with ``sigmas=``).

Text encoding (CLIP pooled + T5) and VAE decoding (``/ scaling_factor +
shift_factor``) are the pipeline's own; only the sampling loop is
:func:`specforest.sample`, on the churned SDE as for SD3
(:mod:`~specforest.diffusers.pipeline_sd3`). diffusers itself is not imported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..couplings import Coupling
from ..planning import make_tree
from ..sampler import TunedFor, check_tuned_for
from ..sampler import sample as _engine_sample
from ..trees import DraftTree
from ..validation import check_int as _check_int
from ..validation import check_number as _check_number
from .flow_matching import module_dtype_device
from .grid import scheduler_sigmas
from .pipeline_sd3 import (
    SD3Result,
    _check_prompts,
    _check_run_options,
    _initial_latents,
    _plan_memory,
    decode,
    transformer_row_bytes,
)

__all__ = [
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
    "unpack_latents",
    "velocity_and_grid",
]


def _class_names(obj: Any) -> set[str]:
    return {c.__name__ for c in type(obj).__mro__}


def is_flux(pipe: Any) -> bool:
    """Whether ``pipe`` is a Flux text-to-image pipeline that :func:`sample` takes.

    True for a ``FluxPipeline`` (or a subclass), and for any other object whose
    ``transformer`` is a ``FluxTransformer2DModel`` and whose class is not one
    of diffusers' other ``Flux*Pipeline`` variants (img2img, fill, control,
    Kontext: they take other inputs). Only class names are read: diffusers is
    not imported.
    """
    names = _class_names(pipe)
    if "FluxPipeline" in names:
        return True
    if any(n.startswith("Flux") and n.endswith("Pipeline") for n in names):
        return False
    return "FluxTransformer2DModel" in _class_names(getattr(pipe, "transformer", None))


# -- packing and positions ----------------------------------------------------------------------------


def pack_latents(x: torch.Tensor) -> torch.Tensor:
    """``(M, C, h, w)`` latents to Flux's sequence of 2 x 2 patches ``(M, hw/4, 4C)``.

    Patch ``(i, j)`` is token ``i (w/2) + j``; its features are ordered
    ``(channel, row in patch, column in patch)``, as ``FluxPipeline._pack_latents``.
    A permutation of coordinates: :func:`unpack_latents` inverts it exactly.
    """
    M, C, h, w = x.shape
    return x.view(M, C, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(M, (h // 2) * (w // 2), 4 * C)


def unpack_latents(p: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of :func:`pack_latents`: ``(M, hw/4, 4C)`` to ``(M, C, h, w)``."""
    M, _, F = p.shape
    return p.view(M, h // 2, w // 2, F // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(M, F // 4, h, w)


def latent_image_ids(h: int, w: int, *, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``(hw/4, 3)`` positions of the packed tokens: ``(0, row, column)`` of each 2 x 2 patch."""
    rows = torch.arange(h // 2, device=device).repeat_interleave(w // 2)
    cols = torch.arange(w // 2, device=device).repeat(h // 2)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=1).to(dtype)


# -- the velocity --------------------------------------------------------------------------------------


class FluxVelocity:
    """A ``FluxTransformer2DModel`` as a velocity ``v(x, sigma, **cond)`` on unpacked latents.

    The state ``x`` is ``(M, C, h, w)``; each call packs it (:func:`pack_latents`),
    runs the transformer at ``timestep = sigma`` (it multiplies by 1000 itself)
    with the shared positions ``img_ids`` ``(hw/4, 3)`` and ``txt_ids`` ``(seq,
    3)`` (zeros, as ``FluxPipeline.encode_prompt`` makes them), and unpacks the
    velocity. Embedded guidance: with ``guidance_embeds`` in the transformer's
    config every row gets ``guidance = guidance_scale``; without it (schnell)
    none is passed and ``guidance_scale`` is unused.

    True classifier-free guidance (``true_cfg_scale > 1``): the negative and
    positive branches of every row go through **one** batched call (rows
    ``[negative; positive]``) and ``v = v_neg + s (v_pos - v_neg)`` in float32,
    ``FluxPipeline``'s formula.

    The transformer runs in its own dtype on ``device``; the velocity is
    returned in float32 on the states' device.

    Args:
        transformer: the network, called as ``transformer(hidden_states=,
            timestep=, guidance=, pooled_projections=, encoder_hidden_states=,
            txt_ids=, img_ids=, return_dict=False)[0]``.
        guidance_scale: the embedded guidance ``g >= 0`` (FLUX.1-dev: 3.5).
        true_cfg_scale: ``s >= 0``; ``s <= 1`` runs the positive branch only.
        device: where inputs are sent (default: the transformer's device; pass
            ``pipe._execution_device`` when the pipeline offloads models).
    """

    def __init__(
        self,
        transformer: torch.nn.Module,
        *,
        guidance_scale: float = 3.5,
        true_cfg_scale: float = 1.0,
        device: str | torch.device | None = None,
    ) -> None:
        if not callable(transformer):
            raise TypeError("transformer must be a callable torch module")
        config = getattr(transformer, "config", None)
        if not isinstance(config, Mapping):
            raise TypeError("transformer must be a diffusers FluxTransformer2DModel (with a config)")
        if getattr(transformer, "is_cache_enabled", False):
            # a cache keyed on the step would mix the sigmas of a speculative call's rows
            raise ValueError("the transformer has a cache enabled (transformer.disable_cache() first)")
        self.transformer = transformer
        self.guidance_scale = _check_number("guidance_scale", guidance_scale, 0.0)
        self.true_cfg_scale = _check_number("true_cfg_scale", true_cfg_scale, 0.0)
        self.guidance_embeds = bool(config.get("guidance_embeds", False))
        self.dtype, own = module_dtype_device(transformer)
        self.device = torch.device(device) if device is not None else own
        self._ids: dict = {}

    @property
    def do_true_cfg(self) -> bool:
        """True when ``true_cfg_scale > 1``: two branches per state."""
        return self.true_cfg_scale > 1.0

    @property
    def branches(self) -> int:
        """Transformer rows per state: 2 with true CFG, 1 otherwise (embedded guidance adds none)."""
        return 2 if self.do_true_cfg else 1

    def ids(self, h: int, w: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(img_ids (hw/4, 3), txt_ids (seq, 3))`` on the device, made once per shape."""
        key = (h, w, seq)
        if key not in self._ids:
            img = latent_image_ids(h, w, device=self.device, dtype=self.dtype)
            self._ids[key] = (img, torch.zeros(seq, 3, device=self.device, dtype=self.dtype))
        return self._ids[key]

    @torch.no_grad()
    def __call__(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        *,
        encoder_hidden_states: torch.Tensor,
        pooled_projections: torch.Tensor,
        negative_encoder_hidden_states: torch.Tensor | None = None,
        negative_pooled_projections: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The (guided) velocity.

        Args:
            x: ``(M, C, h, w)`` unpacked latents at noise levels ``sigma`` (``h``, ``w`` even).
            sigma: ``(M,)`` noise levels in ``[0, 1]``.
            encoder_hidden_states: ``(M, seq, joint_attention_dim)`` T5 embeddings.
            pooled_projections: ``(M, pooled_projection_dim)`` pooled CLIP embeddings.
            negative_encoder_hidden_states: ``(M, seq, joint_attention_dim)``, required with true CFG.
            negative_pooled_projections: ``(M, pooled_projection_dim)``, required with true CFG.

        Returns:
            ``(M, C, h, w)`` float32 velocity on ``x``'s device.

        Raises:
            ValueError: on missing negative embeddings, mismatched rows or odd sizes.
        """
        if x.ndim != 4 or x.shape[2] % 2 or x.shape[3] % 2:
            raise ValueError(f"x must be (M, C, h, w) latents with even h and w, got {tuple(x.shape)}")
        M, _, h, w = x.shape
        cond = [encoder_hidden_states, pooled_projections]
        if self.do_true_cfg:
            if negative_encoder_hidden_states is None or negative_pooled_projections is None:
                raise ValueError(
                    f"true_cfg_scale={self.true_cfg_scale} > 1 needs negative_encoder_hidden_states "
                    "and negative_pooled_projections"
                )
            if negative_encoder_hidden_states.shape[1:] != encoder_hidden_states.shape[1:]:
                raise ValueError(
                    "negative_encoder_hidden_states must have the shape of encoder_hidden_states "
                    "(one call carries both branches)"
                )
            cond += [negative_encoder_hidden_states, negative_pooled_projections]
        if sigma.shape != (M,) or any(c.shape[0] != M for c in cond):
            raise ValueError(
                f"x has {M} rows but sigma has shape {tuple(sigma.shape)} and the embeddings have "
                f"{[c.shape[0] for c in cond]} rows"
            )
        dev, dt = self.device, self.dtype
        img_ids, txt_ids = self.ids(h, w, encoder_hidden_states.shape[1])
        hidden = pack_latents(x.to(dev, dt))
        t = sigma.to(dev, torch.float32)
        enc = encoder_hidden_states.to(dev, dt)
        pooled = pooled_projections.to(dev, dt)
        if self.do_true_cfg:
            hidden = torch.cat([hidden, hidden])
            t = torch.cat([t, t])
            enc = torch.cat([negative_encoder_hidden_states.to(dev, dt), enc])
            pooled = torch.cat([negative_pooled_projections.to(dev, dt), pooled])
        guidance = torch.full_like(t, self.guidance_scale) if self.guidance_embeds else None
        out = self.transformer(
            hidden_states=hidden,
            timestep=t,
            guidance=guidance,
            pooled_projections=pooled,
            encoder_hidden_states=enc,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0].to(torch.float32)
        if self.do_true_cfg:
            v_neg, v_pos = out.chunk(2)
            out = v_neg + self.true_cfg_scale * (v_pos - v_neg)
        return unpack_latents(out, h, w).to(x.device)

    def __repr__(self) -> str:
        return (
            f"FluxVelocity({type(self.transformer).__name__}, guidance_scale={self.guidance_scale}, "
            f"guidance_embeds={self.guidance_embeds}, true_cfg_scale={self.true_cfg_scale}, "
            f"dtype={self.dtype}, device={self.device})"
        )


# -- the pipeline ------------------------------------------------------------------------------------


@dataclass
class FluxResult(SD3Result):
    """What :func:`sample` returns: the fields of :class:`~specforest.diffusers.SD3Result`.

    ``images`` with ``output_type="latent"`` and ``latents`` are **unpacked**,
    ``(B, C, h, w)`` (``FluxPipeline`` returns packed ``(B, hw/4, 4C)`` latents);
    :func:`pack_latents` packs them. ``stats.nfe`` counts sequential transformer
    calls per image (one call carries both true-CFG branches).
    """


def _check_pipeline(pipe: Any) -> None:
    if not is_flux(pipe):
        raise TypeError(
            f"pipe must be a FluxPipeline (or an object whose transformer is a FluxTransformer2DModel), "
            f"got {type(pipe).__name__}"
        )
    missing = [
        a
        for a in ("transformer", "vae", "scheduler", "encode_prompt", "image_processor")
        if getattr(pipe, a, None) is None
    ]
    if missing:
        raise TypeError(f"pipe must be a FluxPipeline-like object; it lacks {', '.join(missing)}")
    for name in ("transformer", "vae"):
        if not isinstance(getattr(getattr(pipe, name), "config", None), Mapping):
            raise TypeError(f"pipe.{name} must be a diffusers model with a config")
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


def flux_sigmas(config: Mapping, steps: int, image_seq_len: int, *, shift: Optional[float] = None) -> torch.Tensor:
    """``FluxPipeline``'s grid: ``set_timesteps(sigmas=linspace(1, 1/T, T), mu=calculate_shift(seq))``.

    Args:
        config: the scheduler's config (``use_dynamic_shifting`` for dev, a static
            shift for schnell).
        steps: ``T >= 1``.
        image_seq_len: the packed sequence length ``(h/2) (w/2)`` (``mu`` under dynamic shifting).
        shift: a static shift overriding the config, as in :func:`scheduler_sigmas`.

    Returns:
        ``(T + 1,)`` float64 levels from 1 to 0.
    """
    steps = _check_int("num_inference_steps", steps, 1)
    base = torch.linspace(1.0, 1.0 / steps, steps, dtype=torch.float64)
    return scheduler_sigmas(config, steps, shift=shift, image_seq_len=image_seq_len, sigmas=base)


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
    vsf = int(getattr(pipe, "vae_scale_factor", 2 ** (len(pipe.vae.config.block_out_channels) - 1)))
    default = int(getattr(pipe, "default_sample_size", 128)) * vsf
    height = default if height is None else _check_int("height", height, 1)
    width = default if width is None else _check_int("width", width, 1)
    mult = 2 * vsf
    for name, v in (("height", height), ("width", width)):
        if v % mult:
            raise ValueError(
                f"{name} must be divisible by 2 x vae_scale_factor = {mult} (Flux packs 2 x 2 latent "
                f"patches), got {v} (nearest below: {v - v % mult or mult})"
            )
    h, w = height // vsf, width // vsf
    sigmas = flux_sigmas(pipe.scheduler.config, steps, (h // 2) * (w // 2), shift=shift)
    device = getattr(pipe, "_execution_device", None)
    _, t_device = module_dtype_device(pipe.transformer)
    device = torch.device(device) if device is not None else t_device
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


def row_bytes_of(pipe: Any, velocity: FluxVelocity, latent_shape: tuple, pe: torch.Tensor, ppe: torch.Tensor) -> int:
    """Bytes one transformer row needs (:func:`~specforest.diffusers.pipeline_sd3.transformer_row_bytes`)
    for these embeddings: ``hw/4`` image tokens and ``seq`` text tokens per branch."""
    tcfg = pipe.transformer.config
    _, h, w = latent_shape
    heads = int(tcfg.get("num_attention_heads", 24))
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


def cond_from_embeds(
    prompt_embeds: torch.Tensor,
    pooled_prompt_embeds: torch.Tensor,
    negative_prompt_embeds: Optional[torch.Tensor],
    negative_pooled_prompt_embeds: Optional[torch.Tensor],
    velocity: FluxVelocity,
    device: torch.device,
) -> dict:
    """The per-trajectory conditioning :class:`FluxVelocity` reads, one row per embedding row.

    The negative embeddings are used with true CFG (``velocity.branches == 2``)
    only. The positions are not conditioning: the velocity makes them.
    """
    cond = {"encoder_hidden_states": prompt_embeds, "pooled_projections": pooled_prompt_embeds}
    if velocity.branches == 2:
        cond.update(
            negative_encoder_hidden_states=negative_prompt_embeds,
            negative_pooled_projections=negative_pooled_prompt_embeds,
        )
    return {k: v.to(device, velocity.dtype) for k, v in cond.items()}


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
    churn: float = 0.8,
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
        generator: the only source of randomness: the initial latents ``(B, C, h,
            w)`` are drawn from it first, unpacked and in float32, as
            ``FluxPipeline`` draws them (the same noise for a float32 pipeline;
            one in half precision draws in that dtype, see ``docs/diffusers.md``),
            then the sampler's seed. A list of one generator per image makes image ``i`` a
            function of ``generator[i]`` alone.
        num_images_per_prompt: images per caption (``>= 1``); ``B = n x num_images_per_prompt``.
        output_type: ``pil``, ``np``, ``pt`` or ``latent`` (unpacked ``(B, C, h, w)``).
        churn, tree, K, L, coupling, draft, prefetch, verify, progress, lazy:
            as in :func:`specforest.diffusers.pipeline_sd3.sample`.
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
        :class:`FluxResult` with ``images``, ``latents``, ``stats``, ``memory``, ``config``.

    Raises:
        ValueError / TypeError: on invalid arguments (naming the parameter).
        MemoryError: if the run would not fit the memory limit (with the numbers
            and what to change; nothing is allocated for sampling in that case).
        FloatingPointError: if the transformer returns NaN or inf.
    """
    _check_pipeline(pipe)
    tcfg = pipe.transformer.config
    steps, churn, n_img, max_memory_gb = _check_run_options(
        num_inference_steps=num_inference_steps,
        churn=churn,
        num_images_per_prompt=num_images_per_prompt,
        output_type=output_type,
        verify=verify,
        lazy=lazy,
        generator=generator,
        max_memory_gb=max_memory_gb,
    )
    guidance = _check_number("guidance_scale", guidance_scale, 0.0)
    true_cfg = _check_number("true_cfg_scale", true_cfg_scale, 0.0)
    max_seq = _check_int("max_sequence_length", max_sequence_length, 1)
    if max_seq > 512:
        raise ValueError(f"max_sequence_length must be <= 512, got {max_seq}")
    do_true_cfg = true_cfg > 1.0
    if do_true_cfg and negative_prompt is None and negative_prompt_embeds is None:
        # FluxPipeline would silently run without true CFG here
        raise ValueError(
            f'true_cfg_scale={true_cfg} > 1 needs negative_prompt ("" for an empty one) or '
            "negative_prompt_embeds; or use true_cfg_scale=1"
        )
    prompts, negatives, n = _check_prompts(
        prompt,
        prompt_embeds,
        negative_prompt,
        negative_prompt_embeds,
        pooled_prompt_embeds,
        negative_pooled_prompt_embeds,
        tcfg,
    )
    check_tuned_for(tuned_for, steps=steps, sigmas=None, churn=churn, batch=n * n_img, batch_name="images")
    tree = make_tree(K, L, coupling=coupling, tree=tree, steps=steps)
    velocity, sigmas, latent_shape, device = velocity_and_grid(
        pipe,
        num_inference_steps=steps,
        guidance_scale=guidance,
        true_cfg_scale=true_cfg,
        height=height,
        width=width,
        shift=shift,
    )
    t_dtype = velocity.dtype
    height, width = velocity.image_size

    # -- text ---------------------------------------------------------------------------
    pe, ppe, npe, nppe = encode_text(
        pipe,
        prompts,
        negatives,
        device=device,
        true_cfg=do_true_cfg,
        max_sequence_length=max_seq,
        prompt_embeds=prompt_embeds,
        pooled_prompt_embeds=pooled_prompt_embeds,
        negative_prompt_embeds=negative_prompt_embeds,
        negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
    )
    # each caption's rows repeated consecutively, as diffusers repeats them
    conds = cond_from_embeds(pe, ppe, npe, nppe, velocity, device)
    cond = {k: v.repeat_interleave(n_img, dim=0) for k, v in conds.items()}
    B = n * n_img
    if isinstance(generator, (list, tuple)) and len(generator) != B:
        raise ValueError(
            f"a list of generators must hold one per image ({B} = prompts x num_images_per_prompt), "
            f"got {len(generator)}"
        )

    # -- memory -------------------------------------------------------------------------
    cond_numel = pe[0].numel() + ppe[0].numel()
    memory, decode_batch = _plan_memory(
        pipe,
        max_memory_gb=max_memory_gb,
        device=device,
        images=B,
        latent_shape=latent_shape,
        height=height,
        width=width,
        output_type=output_type,
        tree=tree,
        verify=verify,
        lazy=lazy,
        steps=steps,
        row_bytes=row_bytes_of(pipe, velocity, latent_shape, pe, ppe),
        cond_bytes=velocity.branches * cond_numel * torch.empty((), dtype=t_dtype).element_size(),
    )

    # -- sampling -----------------------------------------------------------------------
    if generator is None:
        generator = torch.Generator(device="cpu")
        generator.seed()
    if isinstance(generator, (list, tuple)):
        x_T = torch.cat([_initial_latents((1, *latent_shape), g, device) for g in generator])
    else:
        x_T = _initial_latents((B, *latent_shape), generator, device)
    out = _engine_sample(
        velocity,
        x_T,
        sigmas=sigmas,
        churn=churn,
        tree=tree,
        coupling=coupling,
        draft=draft,
        prefetch=prefetch,
        verify=verify,
        generator=generator,
        progress=progress,
        max_rows=memory.max_rows,
        cond=cond,
        lazy=lazy,
    )
    latents = out.samples

    # -- decoding: unpacked latents, then / scaling_factor + shift_factor, as FluxPipeline ----------
    images: Any = latents.to(t_dtype) if output_type == "latent" else decode(pipe, latents, output_type, decode_batch)
    config = dict(
        out.config,
        family="flux",
        num_inference_steps=steps,
        guidance_scale=guidance,
        guidance_embeds=velocity.guidance_embeds,
        true_cfg_scale=true_cfg,
        height=height,
        width=width,
        num_images=B,
        num_images_per_prompt=n_img,
        K=K,
        L=L,
        shift=shift,
        dynamic_shift=bool(pipe.scheduler.config.get("use_dynamic_shifting", False)) and shift is None,
        lazy=lazy,
        max_rows=memory.max_rows,
        decode_batch=decode_batch,
        transformer_dtype=str(t_dtype).replace("torch.", ""),
        device=str(device),
    )
    return FluxResult(images=images, latents=latents, stats=out.stats, memory=memory, config=config)
