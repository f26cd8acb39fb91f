"""Which family a diffusers pipeline object belongs to: :func:`is_sd3`, :func:`is_flux`, :func:`is_sdxl`, :func:`is_sd`.

The predicates read class names and components only (diffusers is not
imported), so they are cheap and safe on any object. They are disjoint: SD3 and
Flux key on their transformer's class, SDXL and SD on their UNet's added
embeddings and second text encoder; the class names of other tasks (img2img,
inpainting, ControlNet, ...) are excluded, because those pipelines take other
inputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

__all__ = ["is_flux", "is_sd", "is_sd3", "is_sdxl", "unet_family"]

# Pipelines with these words in their class name have the components of a
# text-to-image UNet pipeline but other inputs or another guidance.
_OTHER_TASKS = ("Img2Img", "Inpaint", "InstructPix2Pix", "ControlNet", "Adapter", "Upscale", "Depth2Img", "PAG")


def _class_names(obj: Any) -> set[str]:
    return {c.__name__ for c in type(obj).__mro__}


def is_sd3(pipe: Any) -> bool:
    """Whether ``pipe`` is a Stable Diffusion 3 pipeline: a ``StableDiffusion3*Pipeline`` or any
    object whose ``transformer`` is an ``SD3Transformer2DModel``."""
    if any(n.startswith("StableDiffusion3") and n.endswith("Pipeline") for n in _class_names(pipe)):
        return True
    return "SD3Transformer2DModel" in _class_names(getattr(pipe, "transformer", None))


def is_flux(pipe: Any) -> bool:
    """Whether ``pipe`` is a Flux text-to-image pipeline that :func:`~specforest.diffusers.pipeline_flux.sample` takes.

    True for a ``FluxPipeline`` (or a subclass), and for any other object whose
    ``transformer`` is a ``FluxTransformer2DModel`` and whose class is not one
    of diffusers' other ``Flux*Pipeline`` variants (img2img, fill, control,
    Kontext: they take other inputs).
    """
    names = _class_names(pipe)
    if "FluxPipeline" in names:
        return True
    if any(n.startswith("Flux") and n.endswith("Pipeline") for n in names):
        return False
    return "FluxTransformer2DModel" in _class_names(getattr(pipe, "transformer", None))


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


def unet_family(pipe: Any) -> str:
    """``"sdxl"`` or ``"sd"``: the UNet family of ``pipe``.

    Raises:
        TypeError: naming the supported pipelines, for a pipeline of neither.
    """
    if is_sdxl(pipe):
        return "sdxl"
    if is_sd(pipe):
        return "sd"
    raise TypeError(
        "pipe must be a StableDiffusionXLPipeline or a StableDiffusionPipeline (or one with the same components: "
        f"unet, vae, scheduler, text encoders, encode_prompt), got {type(pipe).__name__}"
    )
