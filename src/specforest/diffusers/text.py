"""The text inputs of every family's ``sample``, checked, and the conditioning the transformers read.

A family's ``sample`` takes captions (``prompt``, ``negative_prompt``) or
precomputed embeddings (``prompt_embeds`` and the like), never both, and hands
them to the pipeline's own ``encode_prompt``. :func:`check_prompts` (SD3, Flux)
and :func:`check_unet_text` (SDXL, SD: a second caption, and no pooled
embeddings for SD) refuse what the pipeline would misread, naming the
parameter, before any encoder runs. :func:`cond_from_embeds` turns the encoded
text into the per-trajectory conditioning of the flow-matching transformers'
velocities (:class:`~specforest.diffusers.flow_matching.FlowMatchVelocity`,
:class:`~specforest.diffusers.flux_velocity.FluxVelocity`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

__all__ = [
    "EMBEDS",
    "TRANSFORMER_TEXT",
    "UNET_TEXT",
    "check_embeds",
    "check_prompts",
    "check_transformer_text",
    "check_unet_text",
    "cond_from_embeds",
    "str_list",
]

EMBEDS = ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds")
"""The precomputed embeddings a family's ``sample`` takes instead of captions."""

TRANSFORMER_TEXT = ("negative_prompt", *EMBEDS)
"""SD3's and Flux's text inputs besides ``prompt``."""


def check_embeds(name: str, t: Any, ndim: int) -> None:
    """``t`` is a finite floating-point ``(batch, seq, dim)`` (``ndim=3``) or ``(batch, dim)`` tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim or t.shape[0] < 1:
        shape = "(batch, seq, dim)" if ndim == 3 else "(batch, dim)"
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if not t.is_floating_point() or not torch.isfinite(t).all():
        raise ValueError(f"{name} must be a finite floating-point tensor")


def _check_like(name: str, t: Any, ndim: int, ref_name: str, ref: torch.Tensor) -> None:
    """``t`` is embeddings (:func:`check_embeds`) of the shape of ``ref``, the tensor they pair with."""
    check_embeds(name, t, ndim)
    if t.shape != ref.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)} but {ref_name} has {tuple(ref.shape)}; they must match")


def _check_one_of(prompt: Any, prompt_embeds: Any) -> None:
    if (prompt is None) == (prompt_embeds is None):
        raise ValueError("give exactly one of prompt (str or list of str) and prompt_embeds")


def _check_pooled(pooled: Any, n: int) -> None:
    """The pooled embeddings that go with ``n`` rows of ``prompt_embeds``."""
    if pooled is None:
        raise ValueError("prompt_embeds needs pooled_prompt_embeds (from the same text encoders)")
    check_embeds("pooled_prompt_embeds", pooled, 2)
    if pooled.shape[0] != n:
        raise ValueError(f"pooled_prompt_embeds has {pooled.shape[0]} rows but prompt_embeds has {n}")


def check_prompts(
    prompt, prompt_embeds, negative_prompt, negative_prompt_embeds, pooled, neg_pooled, tcfg
) -> tuple[list[str] | None, list[str] | None, int]:
    """Validate the text inputs of SD3's or Flux's ``sample`` against the transformer's config ``tcfg``.

    Returns:
        ``(prompts, negative_prompts, n)``: the captions and negative captions as lists
        (``None`` where embeddings or nothing were given) and the number of captions.
    """
    _check_one_of(prompt, prompt_embeds)
    if prompt is not None:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not isinstance(prompt, (list, tuple)) or not prompt or not all(isinstance(p, str) for p in prompt):
            raise TypeError("prompt must be a str or a non-empty list of str")
        n = len(prompt)
        if pooled is not None or negative_prompt_embeds is not None or neg_pooled is not None:
            raise ValueError(
                "pooled_prompt_embeds / negative_prompt_embeds / negative_pooled_prompt_embeds go with "
                "prompt_embeds, not with prompt"
            )
    else:
        check_embeds("prompt_embeds", prompt_embeds, 3)
        n = prompt_embeds.shape[0]
        _check_pooled(pooled, n)
    if negative_prompt is not None and negative_prompt_embeds is not None:
        raise ValueError("give at most one of negative_prompt and negative_prompt_embeds")
    negs = None
    if negative_prompt is not None:
        negs = [negative_prompt] * n if isinstance(negative_prompt, str) else negative_prompt
        if not isinstance(negs, (list, tuple)) or not all(isinstance(p, str) for p in negs):
            raise TypeError("negative_prompt must be a str or a list of str")
        if len(negs) != n:
            raise ValueError(f"negative_prompt has {len(negs)} entries but there are {n} prompts")
        negs = list(negs)
    if negative_prompt_embeds is not None:
        if prompt_embeds is None:
            raise ValueError("negative_prompt_embeds goes with prompt_embeds; with prompt use negative_prompt")
        _check_like("negative_prompt_embeds", negative_prompt_embeds, 3, "prompt_embeds", prompt_embeds)
        if neg_pooled is None:
            raise ValueError("negative_prompt_embeds needs negative_pooled_prompt_embeds")
        _check_like("negative_pooled_prompt_embeds", neg_pooled, 2, "pooled_prompt_embeds", pooled)
    elif neg_pooled is not None:
        raise ValueError("negative_pooled_prompt_embeds goes with negative_prompt_embeds")
    if prompt_embeds is not None:
        jd, pd = tcfg.get("joint_attention_dim"), tcfg.get("pooled_projection_dim")
        if jd is not None and prompt_embeds.shape[-1] != jd:
            raise ValueError(
                f"prompt_embeds has last dimension {prompt_embeds.shape[-1]} but the transformer's "
                f"joint_attention_dim is {jd}"
            )
        if pd is not None and pooled.shape[-1] != pd:
            raise ValueError(
                f"pooled_prompt_embeds has last dimension {pooled.shape[-1]} but the transformer's "
                f"pooled_projection_dim is {pd}"
            )
    return (None if prompt is None else list(prompt)), negs, n


def check_transformer_text(text: Mapping, tcfg: Mapping) -> tuple[dict, int]:
    """:func:`check_prompts` of SD3's or Flux's text inputs by name (``prompt`` and
    :data:`TRANSFORMER_TEXT`; absent: ``None``).

    Returns:
        ``(text, n)``: the inputs with the captions and negative captions as lists, and the number of captions.
    """
    kw = {k: text.get(k) for k in ("prompt", *TRANSFORMER_TEXT)}
    prompts, negs, n = check_prompts(
        kw["prompt"],
        kw["prompt_embeds"],
        kw["negative_prompt"],
        kw["negative_prompt_embeds"],
        kw["pooled_prompt_embeds"],
        kw["negative_pooled_prompt_embeds"],
        tcfg,
    )
    return {**kw, "prompt": prompts, "negative_prompt": negs}, n


def str_list(name: str, value: Any, n: Optional[int]) -> Optional[list[str]]:
    """``value`` as a list of ``n`` captions (a str repeats), or ``None``."""
    if value is None:
        return None
    vals = [value] * (n or 1) if isinstance(value, str) else value
    if not isinstance(vals, (list, tuple)) or not vals or not all(isinstance(p, str) for p in vals):
        raise TypeError(f"{name} must be a str or a non-empty list of str")
    if n is not None and len(vals) != n:
        raise ValueError(f"{name} has {len(vals)} entries but there are {n} prompts")
    return list(vals)


UNET_TEXT = ("prompt_2", "negative_prompt", "negative_prompt_2", *EMBEDS)
"""SDXL's and SD's text inputs besides ``prompt``."""


def check_unet_text(family: str, ucfg: Mapping, **given: Any) -> tuple[dict, int]:
    """Validate the text inputs of SDXL's or SD's ``sample`` (by name; absent: ``None``).

    Args:
        family: ``"sdxl"`` or ``"sd"`` (one text encoder: no ``prompt_2``, no pooled embeddings).
        ucfg: the UNet's config (its ``cross_attention_dim``).
        given: ``prompt``, ``prompt_2``, ``prompt_embeds``, the negatives and the pooled embeddings.

    Returns:
        ``(text, n)``: what the pipeline's ``encode_prompt`` gets and the number of captions.
    """
    kw = {k: given.get(k) for k in ("prompt", *UNET_TEXT)}
    sdxl = family == "sdxl"
    prompt, pe = kw["prompt"], kw["prompt_embeds"]
    npe, ppe, nppe = kw["negative_prompt_embeds"], kw["pooled_prompt_embeds"], kw["negative_pooled_prompt_embeds"]
    if not sdxl:
        sdxl_only = ("prompt_2", "negative_prompt_2", "pooled_prompt_embeds", "negative_pooled_prompt_embeds")
        given = [k for k in sdxl_only if kw[k] is not None]
        if given:
            raise ValueError(f"{', '.join(given)} are SDXL inputs; a StableDiffusionPipeline has one text encoder")
    _check_one_of(prompt, pe)
    if prompt is not None:
        prompts = str_list("prompt", prompt, None)
        n = len(prompts)
        if any(t is not None for t in (npe, ppe, nppe)):
            raise ValueError(
                "negative_prompt_embeds / pooled_prompt_embeds / negative_pooled_prompt_embeds go with "
                "prompt_embeds, not with prompt"
            )
    else:
        prompts = None
        check_embeds("prompt_embeds", pe, 3)
        n = pe.shape[0]
        if kw["prompt_2"] is not None:
            raise ValueError("prompt_2 goes with prompt, not with prompt_embeds")
        if sdxl:
            _check_pooled(ppe, n)
        dim = ucfg.get("cross_attention_dim")
        if isinstance(dim, int) and pe.shape[-1] != dim:
            raise ValueError(
                f"prompt_embeds has last dimension {pe.shape[-1]} but the UNet's cross_attention_dim is {dim}"
            )
    negs = str_list("negative_prompt", kw["negative_prompt"], n)
    if negs is not None and npe is not None:
        raise ValueError("give at most one of negative_prompt and negative_prompt_embeds")
    if npe is not None:
        _check_like("negative_prompt_embeds", npe, 3, "prompt_embeds", pe)
        if sdxl and nppe is None:
            raise ValueError("negative_prompt_embeds needs negative_pooled_prompt_embeds")
    if nppe is not None:
        if npe is None:
            raise ValueError("negative_pooled_prompt_embeds goes with negative_prompt_embeds")
        _check_like("negative_pooled_prompt_embeds", nppe, 2, "pooled_prompt_embeds", ppe)
    text = {"prompt": prompts, "negative_prompt": negs, "prompt_embeds": pe, "negative_prompt_embeds": npe}
    if sdxl:
        text.update(
            prompt_2=str_list("prompt_2", kw["prompt_2"], n),
            negative_prompt_2=str_list("negative_prompt_2", kw["negative_prompt_2"], n),
            pooled_prompt_embeds=ppe,
            negative_pooled_prompt_embeds=nppe,
        )
    return text, n


def cond_from_embeds(
    prompt_embeds: torch.Tensor,
    pooled_prompt_embeds: torch.Tensor,
    negative_prompt_embeds: Optional[torch.Tensor],
    negative_pooled_prompt_embeds: Optional[torch.Tensor],
    velocity: Any,
    device: torch.device,
) -> dict:
    """The per-trajectory conditioning a flow-matching transformer's velocity reads, one row per embedding row.

    For :class:`~specforest.diffusers.flow_matching.FlowMatchVelocity` (SD3) and
    :class:`~specforest.diffusers.flux_velocity.FluxVelocity` alike: the negative
    embeddings are used with guidance (SD3) or true CFG (Flux), ``velocity.branches == 2``,
    only; Flux's positions are not conditioning, its velocity makes them.

    Returns:
        ``{name: (n, ...)}`` on ``device`` in the velocity's dtype.
    """
    cond = {"encoder_hidden_states": prompt_embeds, "pooled_projections": pooled_prompt_embeds}
    if velocity.branches == 2:
        cond.update(
            negative_encoder_hidden_states=negative_prompt_embeds,
            negative_pooled_projections=negative_pooled_prompt_embeds,
        )
    return {k: v.to(device, velocity.dtype) for k, v in cond.items()}
