"""The checks every family's ``sample`` makes before any work: the pipeline's parts, the run options, the image size.

Each raises ``TypeError`` / ``ValueError`` naming the parameter and what it
accepts. The family modules add what is their own (the scheduler a transformer
needs, the UNet's parameterization, the text inputs of
:mod:`~specforest.diffusers.text`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from ..trees import VERIFY_MODES
from ..validation import check_int, check_number
from .decoding import OUTPUT_TYPES

__all__ = ["check_components", "check_generators", "check_run_options", "image_size", "vae_scale_factor"]

_COMPONENTS = ("transformer", "vae", "scheduler", "encode_prompt", "image_processor")


def check_components(pipe: Any, like: str) -> None:
    """A transformer pipeline (``like``: its class, for the message) has the parts ``sample`` uses,
    its transformer and VAE with configs."""
    missing = [a for a in _COMPONENTS if getattr(pipe, a, None) is None]
    if missing:
        raise TypeError(f"pipe must be a {like}-like object; it lacks {', '.join(missing)}")
    for name in ("transformer", "vae"):
        if not isinstance(getattr(getattr(pipe, name), "config", None), Mapping):
            raise TypeError(f"pipe.{name} must be a diffusers model with a config")


def check_run_options(
    *,
    num_inference_steps: Any,
    churn: Any,
    num_images_per_prompt: Any,
    output_type: Any,
    verify: Any,
    lazy: Any,
    generator: Any,
    max_memory_gb: Any,
) -> "tuple[int, Optional[float], int, Optional[float]]":
    """The checks every family's ``sample`` makes of its run options, naming the parameter.

    Returns:
        ``(steps, churn, num_images_per_prompt, max_memory_gb)`` as validated numbers (``churn``
        ``None`` where given so: another chain than ``em`` takes none, and the sampler requires it with ``em``).
    """
    steps = check_int("num_inference_steps", num_inference_steps, 1)
    if churn is not None:
        churn = check_number("churn", churn, 0.0, 1.0, lo_open=True)
    n_img = check_int("num_images_per_prompt", num_images_per_prompt, 1)
    if output_type not in OUTPUT_TYPES:
        raise ValueError(f"output_type must be one of {OUTPUT_TYPES}, got {output_type!r}")
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    if not isinstance(lazy, bool):
        raise TypeError(f"lazy must be a bool, got {type(lazy).__name__}")
    if isinstance(generator, (list, tuple)):
        if not generator or not all(isinstance(g, torch.Generator) for g in generator):
            raise TypeError("generator must be a torch.Generator, a list of them (one per image) or None")
    elif generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator, a list of them (one per image) or None, "
            f"got {type(generator).__name__}"
        )
    if max_memory_gb is not None:
        max_memory_gb = check_number("max_memory_gb", max_memory_gb, 0.0, lo_open=True)
    return steps, churn, n_img, max_memory_gb


def check_generators(generator: Any, images: int) -> None:
    """A list of generators holds one per image (checked once the number of captions is known)."""
    if isinstance(generator, (list, tuple)) and len(generator) != images:
        raise ValueError(
            f"a list of generators must hold one per image ({images} = prompts x num_images_per_prompt), "
            f"got {len(generator)}"
        )


def vae_scale_factor(pipe: Any) -> int:
    """Pixels per latent along a side: the pipeline's ``vae_scale_factor``, else ``2 ** (VAE blocks - 1)``."""
    return int(getattr(pipe, "vae_scale_factor", 2 ** (len(pipe.vae.config.block_out_channels) - 1)))


def image_size(height: Any, width: Any, *, default: int, multiple: int, what: str) -> tuple[int, int]:
    """``(height, width)`` in pixels, ``default`` where ``None``, each divisible by ``multiple``.

    Args:
        height, width: the requested size (ints ``>= 1``) or ``None``.
        default: the pipeline's native size.
        multiple: what both must divide by.
        what: how the message names ``multiple`` (``"vae_scale_factor = 8"``).

    Raises:
        ValueError / TypeError: naming ``height`` or ``width``, and the nearest size below that fits.
    """
    height = default if height is None else check_int("height", height, 1)
    width = default if width is None else check_int("width", width, 1)
    for name, v in (("height", height), ("width", width)):
        if v % multiple:
            raise ValueError(
                f"{name} must be divisible by {what}, got {v} (nearest below: {v - v % multiple or multiple})"
            )
    return height, width
