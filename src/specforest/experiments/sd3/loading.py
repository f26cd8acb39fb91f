"""The study's inputs: captions from a file, the pipeline from a local directory, text embeddings."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..common import check_choice, check_int
from .setting import SD3Setting

__all__ = ["DTYPES", "encode_prompts", "load_pipeline", "load_prompts"]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
"""The transformer dtypes a pipeline can be loaded in."""


def load_prompts(path: str | os.PathLike[str], num_prompts: int | None = None) -> list[str]:
    """Captions of a text file, one per non-empty line (surrounding spaces stripped).

    Args:
        path: the file (UTF-8).
        num_prompts: keep the first ``N >= 1`` (``None``: all).

    Raises:
        ValueError: if the file holds no caption or fewer than ``num_prompts``.
    """
    lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines()]
    prompts = [ln for ln in lines if ln]
    if not prompts:
        raise ValueError(f"{path} holds no caption (one per line expected)")
    if num_prompts is not None:
        num_prompts = check_int("num_prompts", num_prompts, 1)
        if num_prompts > len(prompts):
            raise ValueError(f"num_prompts={num_prompts} but {path} holds only {len(prompts)} captions")
        prompts = prompts[:num_prompts]
    return prompts


def load_pipeline(path: str | os.PathLike[str], *, device: str = "cuda", dtype: str = "float16") -> Any:
    """``StableDiffusion3Pipeline.from_pretrained(path, torch_dtype=..., local_files_only=True)`` on ``device``.

    Raises:
        ImportError: without diffusers (``pip install 'specforest[diffusers]'``).
        ValueError: on an unknown dtype.
    """
    check_choice("dtype", dtype, tuple(DTYPES))
    try:
        from diffusers import StableDiffusion3Pipeline
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the sd3 experiment needs diffusers: pip install 'specforest[diffusers]'") from e
    from diffusers.pipelines import pipeline_utils

    # newer diffusers renamed torch_dtype to dtype (the old name warns)
    key = "dtype" if hasattr(pipeline_utils, "_resolve_dtype") else "torch_dtype"
    pipe = StableDiffusion3Pipeline.from_pretrained(str(path), local_files_only=True, **{key: DTYPES[dtype]})
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def encode_prompts(pipe: Any, prompts: Sequence[str], setting: SD3Setting) -> dict[str, torch.Tensor]:
    """Text embeddings of the captions, computed once for every configuration.

    Returns:
        ``prompt_embeds`` ``(n, seq, dim)`` and ``pooled_prompt_embeds`` ``(n, pooled)``,
        with guidance (``guidance_scale > 1``) also their ``negative_`` counterparts:
        keyword arguments of :func:`specforest.diffusers.sample`.
    """
    cfg = setting.guidance_scale > 1
    with torch.no_grad():
        pe, npe, ppe, nppe = pipe.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            prompt_3=None,
            do_classifier_free_guidance=cfg,
            max_sequence_length=setting.max_sequence_length,
        )
    out = {"prompt_embeds": pe, "pooled_prompt_embeds": ppe}
    if cfg:
        out.update(negative_prompt_embeds=npe, negative_pooled_prompt_embeds=nppe)
    return out
