"""Stable Diffusion XL and 1.5 / 2.x end to end with the exact speculative sampler.

``StableDiffusionXLPipeline`` and ``StableDiffusionPipeline`` share a VP UNet
(epsilon or v prediction): :class:`~specforest.diffusers.unet.UNetVelocity`
turns it into a velocity on the linear path and
:func:`~specforest.diffusers.unet.vp_schedule` reads the grid off the
pipeline's scheduler. :func:`sample` then runs the churned SDE of eqs.
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

:func:`is_sdxl` and :func:`is_sd` tell the two families apart from a
pipeline's components. diffusers itself is not imported here.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping, Sequence
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
from .pipeline_sd3 import OUTPUT_TYPES, SD3Result, _check_embeds, _check_run_options, _initial_latents, _plan_memory
from .unet import PREDICTION_TYPES, UNetVelocity, VPSchedule, vp_schedule

__all__ = [
    "decode",
    "encode_cond",
    "is_sd",
    "is_sdxl",
    "micro_conditioning",
    "row_bytes_of",
    "sample",
    "unet_row_bytes",
    "velocity_and_grid",
]

logger = logging.getLogger(__name__)

# Pipelines with these words in their class name have the components of a
# text-to-image pipeline but other inputs or another guidance: not this module's.
_OTHER_TASKS = ("Img2Img", "Inpaint", "InstructPix2Pix", "ControlNet", "Adapter", "Upscale", "Depth2Img", "PAG")

# Heuristic peak activation of one UNet row at each resolution level, in units of
# tokens x channels x bytes: skip connections kept for the up path, resnet
# temporaries, q/k/v and the GEGLU feed-forward (8x) of the transformer blocks.
# Attention probabilities are counted as if materialised (float32 scores and
# softmax), which overestimates fused kernels: the estimate errs towards
# smaller sub-batches, never towards OOM.
_UNET_ACTIVATION_FACTOR = 24

_DEFAULT_GUIDANCE = {"sdxl": 5.0, "sd": 7.5}  # the pipelines' own defaults


def _unet_config(pipe: Any) -> Optional[Mapping]:
    cfg = getattr(getattr(pipe, "unet", None), "config", None)
    return cfg if isinstance(cfg, Mapping) else None


def _has_text_to_image_parts(pipe: Any) -> bool:
    if any(tag in type(pipe).__name__ for tag in _OTHER_TASKS):
        return False
    vae_cfg = getattr(getattr(pipe, "vae", None), "config", None)
    return (
        isinstance(vae_cfg, Mapping)
        and getattr(pipe, "scheduler", None) is not None
        and callable(getattr(pipe, "encode_prompt", None))
        and getattr(pipe, "image_processor", None) is not None
    )


def is_sdxl(pipe: Any) -> bool:
    """Whether ``pipe`` is a Stable Diffusion XL text-to-image pipeline (base model).

    Decided from its components, not its class alone: a UNet whose
    ``addition_embed_type`` is ``"text_time"`` (the micro-conditioning), a second
    text encoder slot (``text_encoder_2``, ``tokenizer_2``), a VAE, a scheduler
    and ``encode_prompt``; class names of other tasks (img2img, inpainting,
    ControlNet, PAG, ...) are excluded.
    """
    cfg = _unet_config(pipe)
    return (
        cfg is not None
        and cfg.get("addition_embed_type") == "text_time"
        and hasattr(pipe, "text_encoder_2")
        and hasattr(pipe, "tokenizer_2")
        and _has_text_to_image_parts(pipe)
    )


def is_sd(pipe: Any) -> bool:
    """Whether ``pipe`` is a Stable Diffusion 1.x / 2.x text-to-image pipeline.

    A UNet without added embeddings (``addition_embed_type`` unset), one CLIP
    text encoder and tokenizer (no ``text_encoder_2``), a VAE, a scheduler and
    ``encode_prompt``; class names of other tasks are excluded.
    """
    cfg = _unet_config(pipe)
    return (
        cfg is not None
        and cfg.get("addition_embed_type") is None
        and hasattr(pipe, "text_encoder")
        and hasattr(pipe, "tokenizer")
        and not hasattr(pipe, "text_encoder_2")
        and _has_text_to_image_parts(pipe)
    )


def _family(pipe: Any) -> str:
    if is_sdxl(pipe):
        return "sdxl"
    if is_sd(pipe):
        return "sd"
    raise TypeError(
        "pipe must be a StableDiffusionXLPipeline or a StableDiffusionPipeline (or one with the same components: "
        f"unet, vae, scheduler, text encoders, encode_prompt), got {type(pipe).__name__}"
    )


def unet_row_bytes(
    config: Mapping,
    *,
    latent_hw: tuple[int, int],
    text_tokens: int,
    branches: int,
    dtype: torch.dtype,
    cond_numel: int,
    latent_numel: int,
) -> int:
    """Peak bytes one sampler row adds inside a UNet call (all its guidance branches).

    A heuristic upper bound: per branch and resolution level ``l`` (``h w / 4^l``
    tokens, ``block_out_channels[l]`` channels) ``24 x tokens x channels`` in the
    UNet's dtype, plus float32 self- and cross-attention scores ``2 x heads x
    tokens x (tokens + text_tokens)`` at levels with attention; plus the gathered
    conditioning, the input and output latents and the float32 velocity.
    """
    mb = torch.empty((), dtype=dtype).element_size()
    h, w = latent_hw
    heads_cfg = config.get("num_attention_heads") or config.get("attention_head_dim") or 8
    per_branch = 0
    for level, (chans, kind) in enumerate(zip(config["block_out_channels"], config["down_block_types"], strict=True)):
        tokens = math.ceil(h / 2**level) * math.ceil(w / 2**level)
        per_branch += _UNET_ACTIVATION_FACTOR * tokens * int(chans) * mb
        if "CrossAttn" in kind:
            heads = heads_cfg[level] if isinstance(heads_cfg, Sequence) else heads_cfg
            per_branch += 2 * 4 * int(heads) * tokens * (tokens + text_tokens)
    return branches * (per_branch + 2 * cond_numel * mb + 2 * latent_numel * mb) + 3 * latent_numel * 4


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


def _str_list(name: str, value: Any, n: Optional[int]) -> Optional[list[str]]:
    """``value`` as a list of ``n`` captions (a str repeats), or ``None``."""
    if value is None:
        return None
    vals = [value] * (n or 1) if isinstance(value, str) else value
    if not isinstance(vals, (list, tuple)) or not vals or not all(isinstance(p, str) for p in vals):
        raise TypeError(f"{name} must be a str or a non-empty list of str")
    if n is not None and len(vals) != n:
        raise ValueError(f"{name} has {len(vals)} entries but there are {n} prompts")
    return list(vals)


_TEXT_INPUTS = (
    "prompt",
    "prompt_2",
    "prompt_embeds",
    "negative_prompt",
    "negative_prompt_2",
    "negative_prompt_embeds",
    "pooled_prompt_embeds",
    "negative_pooled_prompt_embeds",
)


def _check_text(family: str, ucfg: Mapping, **given: Any) -> tuple[dict, int]:
    """Validate the text inputs of :func:`sample` (by name; absent: ``None``); return what
    ``encode_prompt`` gets and the number of captions ``n``."""
    kw = {k: given.get(k) for k in _TEXT_INPUTS}
    sdxl = family == "sdxl"
    prompt, pe = kw["prompt"], kw["prompt_embeds"]
    npe, ppe, nppe = kw["negative_prompt_embeds"], kw["pooled_prompt_embeds"], kw["negative_pooled_prompt_embeds"]
    if not sdxl:
        sdxl_only = ("prompt_2", "negative_prompt_2", "pooled_prompt_embeds", "negative_pooled_prompt_embeds")
        given = [k for k in sdxl_only if kw[k] is not None]
        if given:
            raise ValueError(f"{', '.join(given)} are SDXL inputs; a StableDiffusionPipeline has one text encoder")
    if (prompt is None) == (pe is None):
        raise ValueError("give exactly one of prompt (str or list of str) and prompt_embeds")
    if prompt is not None:
        prompts = _str_list("prompt", prompt, None)
        n = len(prompts)
        if any(t is not None for t in (npe, ppe, nppe)):
            raise ValueError(
                "negative_prompt_embeds / pooled_prompt_embeds / negative_pooled_prompt_embeds go with "
                "prompt_embeds, not with prompt"
            )
    else:
        prompts = None
        _check_embeds("prompt_embeds", pe, 3)
        n = pe.shape[0]
        if kw["prompt_2"] is not None:
            raise ValueError("prompt_2 goes with prompt, not with prompt_embeds")
        if sdxl:
            if ppe is None:
                raise ValueError("prompt_embeds needs pooled_prompt_embeds (from the same text encoders)")
            _check_embeds("pooled_prompt_embeds", ppe, 2)
            if ppe.shape[0] != n:
                raise ValueError(f"pooled_prompt_embeds has {ppe.shape[0]} rows but prompt_embeds has {n}")
        dim = ucfg.get("cross_attention_dim")
        if isinstance(dim, int) and pe.shape[-1] != dim:
            raise ValueError(
                f"prompt_embeds has last dimension {pe.shape[-1]} but the UNet's cross_attention_dim is {dim}"
            )
    negs = _str_list("negative_prompt", kw["negative_prompt"], n)
    if negs is not None and npe is not None:
        raise ValueError("give at most one of negative_prompt and negative_prompt_embeds")
    if npe is not None:
        _check_embeds("negative_prompt_embeds", npe, 3)
        if npe.shape != pe.shape:
            raise ValueError(
                f"negative_prompt_embeds has shape {tuple(npe.shape)} but prompt_embeds has {tuple(pe.shape)}; "
                "they must match"
            )
        if sdxl and nppe is None:
            raise ValueError("negative_prompt_embeds needs negative_pooled_prompt_embeds")
    if nppe is not None:
        if npe is None:
            raise ValueError("negative_pooled_prompt_embeds goes with negative_prompt_embeds")
        _check_embeds("negative_pooled_prompt_embeds", nppe, 2)
        if nppe.shape != ppe.shape:
            raise ValueError(
                f"negative_pooled_prompt_embeds has shape {tuple(nppe.shape)} but pooled_prompt_embeds has "
                f"{tuple(ppe.shape)}; they must match"
            )
    text = {"prompt": prompts, "negative_prompt": negs, "prompt_embeds": pe, "negative_prompt_embeds": npe}
    if sdxl:
        text.update(
            prompt_2=_str_list("prompt_2", kw["prompt_2"], n),
            negative_prompt_2=_str_list("negative_prompt_2", kw["negative_prompt_2"], n),
            pooled_prompt_embeds=ppe,
            negative_pooled_prompt_embeds=nppe,
        )
    return text, n


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
    family = _family(pipe)
    ucfg = _check_pipeline(pipe, family)
    steps = _check_int("num_inference_steps", num_inference_steps, 1)
    guidance = _guidance(family, guidance_scale)
    vsf = int(getattr(pipe, "vae_scale_factor", 2 ** (len(pipe.vae.config.block_out_channels) - 1)))
    sample_size = ucfg.get("sample_size", 64)
    sample_size = sample_size[0] if isinstance(sample_size, (list, tuple)) else int(sample_size)
    height = sample_size * vsf if height is None else _check_int("height", height, 1)
    width = sample_size * vsf if width is None else _check_int("width", width, 1)
    for name, v in (("height", height), ("width", width)):
        if v % vsf:
            raise ValueError(
                f"{name} must be divisible by vae_scale_factor = {vsf}, got {v} (nearest below: {v - v % vsf or vsf})"
            )
    latent_shape = (int(ucfg.get("in_channels", 4)), height // vsf, width // vsf)
    schedule = vp_schedule(pipe.scheduler, steps)
    device = getattr(pipe, "_execution_device", None)
    _, u_device = module_dtype_device(pipe.unet)
    device = torch.device(device) if device is not None else u_device
    velocity = UNetVelocity(
        pipe.unet,
        schedule.alphas_cumprod,
        prediction_type=pipe.scheduler.config.get("prediction_type", "epsilon"),
        guidance_scale=guidance,
        device=device,
        cross_attention_kwargs=cross_attention_kwargs,
    )
    velocity.image_size = (height, width)
    return velocity, schedule, latent_shape, device


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
    if _family(pipe) == "sd":
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
        text: the checked text inputs, what ``encode_prompt`` gets (``_check_text``).
        micro: SDXL's micro-conditioning (:func:`micro_conditioning`; ``{}`` for SD).
        clip_skip: text encoder layers to skip.

    Returns:
        ``{name: (n, ...)}`` on ``velocity.device`` in the UNet's dtype, row ``j`` caption ``j``.

    Raises:
        ValueError / TypeError: on a ``clip_skip`` that is not an int ``>= 0``.
    """
    family = _family(pipe)
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


def decode(pipe: Any, latents: torch.Tensor, output_type: str = "pil", batch: Optional[int] = None) -> tuple:
    """Latents ``(B, C, h, w)`` to images as the SDXL / SD pipeline decodes them, ``batch`` images per VAE call.

    ``latents / scaling_factor`` (SDXL: ``latents * latents_std / scaling_factor +
    latents_mean`` where the VAE config has them), ``vae.decode``, then SDXL's
    watermark or SD's safety checker where the pipeline has one, and the image
    processor. An SDXL float16 VAE with ``force_upcast`` decodes in a float32
    copy (the pipeline upcasts its own VAE in place; this one is left as it is).

    Returns:
        ``(images, nsfw)``: what the pipeline returns for ``output_type`` (``pil``,
        ``np`` or ``pt``) and its safety checker's flags (``None`` without one).
    """
    if output_type not in OUTPUT_TYPES or output_type == "latent":
        raise ValueError(f"output_type must be one of pil, np, pt to decode, got {output_type!r}")
    family = _family(pipe)
    vae = pipe.vae
    vae_dtype, vae_device = module_dtype_device(vae)
    if family == "sdxl" and vae_dtype == torch.float16 and vae.config.get("force_upcast"):
        vae, vae_dtype = copy.deepcopy(vae).to(torch.float32), torch.float32
    device = getattr(pipe, "_execution_device", None) or vae_device
    vcfg = vae.config
    mean, std = vcfg.get("latents_mean"), vcfg.get("latents_std")
    B = latents.shape[0]
    batch = B if batch is None else max(1, int(batch))
    parts, flags = [], []
    with torch.no_grad():
        for i in range(0, B, batch):
            z = latents[i : i + batch].to(device, vae_dtype)
            if family == "sdxl" and mean is not None and std is not None:
                m = torch.tensor(mean).view(1, -1, 1, 1).to(z)
                sd = torch.tensor(std).view(1, -1, 1, 1).to(z)
                z = z * sd / vcfg.scaling_factor + m
            else:
                z = z / vcfg.scaling_factor
            image = vae.decode(z, return_dict=False)[0]
            if family == "sd" and getattr(pipe, "safety_checker", None) is not None:
                image, nsfw = pipe.run_safety_checker(image, device, image.dtype)
                flags.extend(bool(f) for f in nsfw)
            parts.append(image)
        image = torch.cat(parts)
        if family == "sdxl" and getattr(pipe, "watermark", None) is not None:
            image = pipe.watermark.apply_watermark(image)
    nsfw = flags or None
    denorm = None if nsfw is None else [not f for f in nsfw]
    return pipe.image_processor.postprocess(image, output_type=output_type, do_denormalize=denorm), nsfw


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
    original_size: tuple[int, int] | None = None,
    crops_coords_top_left: tuple[int, int] = (0, 0),
    target_size: tuple[int, int] | None = None,
    negative_original_size: tuple[int, int] | None = None,
    negative_crops_coords_top_left: tuple[int, int] = (0, 0),
    negative_target_size: tuple[int, int] | None = None,
    clip_skip: int | None = None,
    cross_attention_kwargs: dict | None = None,
    tuned_for: TunedFor | None = None,
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
        num_images_per_prompt: images per caption; ``B = n x num_images_per_prompt``.
        output_type: ``pil``, ``np``, ``pt`` or ``latent``.
        churn: ``eps`` in (0, 1].
        tree, K, L, coupling, draft, prefetch, verify, lazy: as in
            :func:`specforest.diffusers.pipeline_sd3.sample`.
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
    family = _family(pipe)
    ucfg = _check_pipeline(pipe, family)
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
    guidance = _guidance(family, guidance_scale)
    text, n = _check_text(
        family,
        ucfg,
        prompt=prompt,
        prompt_2=prompt_2,
        prompt_embeds=prompt_embeds,
        negative_prompt=negative_prompt,
        negative_prompt_2=negative_prompt_2,
        negative_prompt_embeds=negative_prompt_embeds,
        pooled_prompt_embeds=pooled_prompt_embeds,
        negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
    )
    check_tuned_for(tuned_for, steps=steps, sigmas=None, churn=churn, batch=n * n_img, batch_name="images")
    tree = make_tree(K, L, coupling=coupling, tree=tree, steps=steps)

    # -- velocity, grid and conditioning: the calls prepared.prepare_sdxl makes --------------------
    velocity, schedule, latent_shape, device = velocity_and_grid(
        pipe,
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=height,
        width=width,
        cross_attention_kwargs=cross_attention_kwargs,
    )
    height, width = velocity.image_size
    micro = micro_conditioning(
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
    u_dtype = velocity.dtype
    # one row per trajectory: each caption's rows repeated consecutively, as diffusers repeats them
    cond = {
        k: v.repeat_interleave(n_img, dim=0)
        for k, v in encode_cond(pipe, velocity, text, micro=micro, clip_skip=clip_skip).items()
    }
    B = n * n_img
    if isinstance(generator, (list, tuple)) and len(generator) != B:
        raise ValueError(
            f"a list of generators must hold one per image ({B} = prompts x num_images_per_prompt), "
            f"got {len(generator)}"
        )

    # -- memory -------------------------------------------------------------------------------
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
        row_bytes=row_bytes_of(pipe, velocity, latent_shape, cond),
        cond_bytes=sum(v[0].numel() * v.element_size() for v in cond.values()),
    )

    # -- sampling: from the scheduler's initial noise, x_lin = x_VE / (1 + s_0) ----------------------
    if generator is None:
        generator = torch.Generator(device="cpu")
        generator.seed()
    if isinstance(generator, (list, tuple)):
        xi = torch.cat([_initial_latents((1, *latent_shape), g, device) for g in generator])
    else:
        xi = _initial_latents((B, *latent_shape), generator, device)
    out = _engine_sample(
        velocity,
        xi * schedule.latent_scale,
        sigmas=schedule.sigmas,
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

    # -- decoding, as the pipelines do it ---------------------------------------------------------
    nsfw = None
    if output_type == "latent":
        images: Any = latents.to(u_dtype)
    else:
        images, nsfw = decode(pipe, latents, output_type, decode_batch)

    config = dict(
        out.config,
        family=family,
        scheduler=schedule.scheduler,
        prediction_type=velocity.prediction_type,
        first_timestep=float(schedule.timesteps[0]),
        first_sigma=float(schedule.sigmas[0]),
        init_noise_sigma=schedule.init_noise_sigma,
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=height,
        width=width,
        num_images=B,
        num_images_per_prompt=n_img,
        K=K,
        L=L,
        lazy=lazy,
        max_rows=memory.max_rows,
        decode_batch=decode_batch,
        unet_dtype=str(u_dtype).replace("torch.", ""),
        device=str(device),
    )
    config.update(micro)
    if nsfw is not None:
        config["nsfw_content_detected"] = nsfw
    return SD3Result(images=images, latents=latents, stats=out.stats, memory=memory, config=config)
