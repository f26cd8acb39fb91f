"""A ``FluxTransformer2DModel`` as the library's model contract, ``v(x, sigma, **cond)``, on unpacked latents.

Flux's transformer reads the latents as a sequence of 2 x 2 patches,
``(batch, C, h, w) -> (batch, hw/4, 4C)``. Packing is a permutation of
coordinates, so the sampler keeps the state unpacked, ``(C, h, w)``, and
:class:`FluxVelocity` packs on the way in (:func:`pack_latents`) and unpacks on
the way out (:func:`unpack_latents`): the law of the chain is that of the packed
one. The positions ``img_ids`` and ``txt_ids`` are 2-D and shared by every row of
a call (:func:`latent_image_ids`), so they are never per-row conditioning.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..validation import check_number as _check_number
from .flow_matching import branch_inputs, check_rows, guide, module_dtype_device

__all__ = ["FluxVelocity", "latent_image_ids", "pack_latents", "unpack_latents"]


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
        check_rows(M, sigma, cond)
        dev, dt = self.device, self.dtype
        img_ids, txt_ids = self.ids(h, w, encoder_hidden_states.shape[1])
        hidden, t, enc, pooled = branch_inputs(
            pack_latents(x.to(dev, dt)),
            sigma.to(dev, torch.float32),
            encoder_hidden_states,
            pooled_projections,
            negative_encoder_hidden_states,
            negative_pooled_projections,
            guided=self.do_true_cfg,
            device=dev,
            dtype=dt,
        )
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
            out = guide(out, self.true_cfg_scale)
        return unpack_latents(out, h, w).to(x.device)

    def __repr__(self) -> str:
        return (
            f"FluxVelocity({type(self.transformer).__name__}, guidance_scale={self.guidance_scale}, "
            f"guidance_embeds={self.guidance_embeds}, true_cfg_scale={self.true_cfg_scale}, "
            f"dtype={self.dtype}, device={self.device})"
        )
