"""CLIP scores of images against their captions, the study's quality measure (Table 1)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["clip_scores"]


def clip_scores(
    model_dir: str | os.PathLike[str],
    images: Sequence[Any],
    prompts: Sequence[str],
    *,
    device: str | torch.device = "cpu",
    batch_size: int = 16,
) -> torch.Tensor:
    """CLIP score of each image with its caption: ``100 max(cos(image, text), 0)``.

    Args:
        model_dir: a local CLIP model directory (model and processor), e.g. a
            download of ``openai/clip-vit-large-patch14``.
        images: PIL images.
        prompts: one caption per image.
        device: where CLIP runs.
        batch_size: images per forward pass.

    Returns:
        ``(n,)`` float64 scores.

    Raises:
        ValueError: if there are not as many captions as images.
    """
    from transformers import CLIPModel, CLIPProcessor

    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images but {len(prompts)} captions")
    model = CLIPModel.from_pretrained(str(model_dir), local_files_only=True).to(device).eval()
    proc = CLIPProcessor.from_pretrained(str(model_dir), local_files_only=True)
    max_len = getattr(model.config.text_config, "max_position_embeddings", 77)
    out = []
    with torch.no_grad():
        for i in range(0, len(images), batch_size):
            inputs = proc(
                text=list(prompts[i : i + batch_size]),
                images=list(images[i : i + batch_size]),
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=max_len,
            ).to(device)
            res = model(**inputs)
            img = torch.nn.functional.normalize(res.image_embeds.double(), dim=-1)
            txt = torch.nn.functional.normalize(res.text_embeds.double(), dim=-1)
            out.append(100.0 * (img * txt).sum(-1).clamp_min(0.0))
    return torch.cat(out).cpu()
