"""Latents to images, as each pipeline decodes them, a bounded number of images per VAE call.

:func:`decode_flow_match` is SD3's and Flux's decoding (``/ scaling_factor +
shift_factor``, then the VAE and the image processor); :func:`decode_unet` is
SDXL's and SD's (``latents_mean``/``latents_std`` where the VAE has them, the
watermark or the safety checker where the pipeline has one).
:func:`flow_match_images` and :func:`unet_images` are the same as a family's decoding in the
flow (:class:`~specforest.diffusers.flow.FamilyParts`): the images and what the record adds.
:func:`decode_bytes` is what one image's decode needs, which sizes the number of
images per VAE call before anything is allocated.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch

from .detection import unet_family
from .flow_matching import module_dtype_device

__all__ = ["OUTPUT_TYPES", "decode_bytes", "decode_flow_match", "decode_unet", "flow_match_images", "unet_images"]

OUTPUT_TYPES = ("pil", "np", "pt", "latent")
"""What a family's ``sample`` returns as ``images``: the image processor's three kinds, or the latents."""

# peak bytes of one image's VAE decode per pixel, per channel of the VAE's first block and per
# byte of its elements (at least 4)
_DECODE_FACTOR = 16


def decode_bytes(pipe: Any, height: int, width: int) -> int:
    """Peak bytes of one ``height x width`` image's VAE decode: ``16 x pixels x
    block_out_channels[0] x max(element size, 4)``."""
    vae_dtype, _ = module_dtype_device(pipe.vae)
    vb = torch.empty((), dtype=vae_dtype).element_size()
    return _DECODE_FACTOR * height * width * int(pipe.vae.config.block_out_channels[0]) * max(vb, 4)


def _check_output_type(output_type: str) -> None:
    if output_type not in OUTPUT_TYPES or output_type == "latent":
        raise ValueError(f"output_type must be one of pil, np, pt to decode, got {output_type!r}")


def decode_flow_match(pipe: Any, latents: torch.Tensor, output_type: str = "pil", batch: Optional[int] = None) -> Any:
    """Latents ``(n, C, h, w)`` to images as the SD3 and Flux pipelines decode them, ``batch`` images per VAE call.

    Returns:
        What the pipeline returns for ``output_type`` (``pil``, ``np`` or ``pt``).
    """
    _check_output_type(output_type)
    vae_dtype, vae_device = module_dtype_device(pipe.vae)
    device = getattr(pipe, "_execution_device", None) or vae_device
    vcfg = pipe.vae.config
    n = latents.shape[0]
    batch = n if batch is None else max(1, int(batch))
    parts = []
    with torch.no_grad():
        for i in range(0, n, batch):
            z = latents[i : i + batch].to(device, vae_dtype)
            z = z / vcfg.scaling_factor + (vcfg.shift_factor or 0.0)
            parts.append(pipe.vae.decode(z, return_dict=False)[0])
    return pipe.image_processor.postprocess(torch.cat(parts), output_type=output_type)


def decode_unet(pipe: Any, latents: torch.Tensor, output_type: str = "pil", batch: Optional[int] = None) -> tuple:
    """Latents ``(n, C, h, w)`` to images as the SDXL / SD pipeline decodes them, ``batch`` images per VAE call.

    ``latents / scaling_factor`` (SDXL: ``latents * latents_std / scaling_factor +
    latents_mean`` where the VAE config has them), ``vae.decode``, then SDXL's
    watermark or SD's safety checker where the pipeline has one, and the image
    processor. An SDXL float16 VAE with ``force_upcast`` decodes in a float32
    copy (the pipeline upcasts its own VAE in place; this one is left as it is).

    Returns:
        ``(images, nsfw)``: what the pipeline returns for ``output_type`` (``pil``,
        ``np`` or ``pt``) and its safety checker's flags (``None`` without one).
    """
    _check_output_type(output_type)
    family = unet_family(pipe)
    vae = pipe.vae
    vae_dtype, vae_device = module_dtype_device(vae)
    if family == "sdxl" and vae_dtype == torch.float16 and vae.config.get("force_upcast"):
        vae, vae_dtype = copy.deepcopy(vae).to(torch.float32), torch.float32
    device = getattr(pipe, "_execution_device", None) or vae_device
    vcfg = vae.config
    mean, std = vcfg.get("latents_mean"), vcfg.get("latents_std")
    n = latents.shape[0]
    batch = n if batch is None else max(1, int(batch))
    parts, flags = [], []
    with torch.no_grad():
        for i in range(0, n, batch):
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


def flow_match_images(pipe: Any, latents: torch.Tensor, output_type: str, batch: Optional[int] = None) -> tuple:
    """``(images, {})``: :func:`decode_flow_match` as a family's decoding (SD3, Flux)."""
    return decode_flow_match(pipe, latents, output_type, batch), {}


def unet_images(pipe: Any, latents: torch.Tensor, output_type: str, batch: Optional[int] = None) -> tuple:
    """``(images, record)``: :func:`decode_unet` as a family's decoding (SDXL, SD); the record holds
    ``nsfw_content_detected`` where the pipeline has a safety checker."""
    images, nsfw = decode_unet(pipe, latents, output_type, batch)
    return images, ({} if nsfw is None else {"nsfw_content_detected": nsfw})
