"""A diffusers flow-matching transformer as the library's model contract, ``v(x, sigma, **cond)``.

Stable Diffusion 3 is a rectified flow: its transformer predicts the velocity
``v = E[xi - x_0 | x_sigma]`` of the linear path ``x_sigma = (1 - sigma) x_0 +
sigma xi`` at ``timestep = 1000 sigma``. :class:`FlowMatchVelocity` adapts it,
classifier-free guidance included, in one batched call per round. The parts of a
guided call, :func:`check_rows`, :func:`branch_inputs` (both branches in one
batch) and :func:`guide` (their combination), serve Flux's adapter
(:class:`~specforest.diffusers.flux_velocity.FluxVelocity`) too, and :func:`guide`
the UNet's.
"""

from __future__ import annotations

import torch

from ..validation import check_int, check_number

__all__ = ["FlowMatchVelocity", "branch_inputs", "check_rows", "guide", "module_dtype_device", "transformer_row_bytes"]


# peak activation of one transformer row per branch, in tokens x hidden x the transformer's
# element size: a bound on what benchmarks/memory.py measures on SD3 transformers (docs/diffusers.md,
# "Memory"). The layers run one after another, so their number does not add; PyTorch's fused
# attention never materializes the attention weights, so the head count does not enter.
_ACTIVATION_FACTOR = 12


def transformer_row_bytes(
    *,
    branches: int,
    dtype: torch.dtype,
    image_tokens: int,
    text_tokens: int,
    hidden: int,
    heads: int,
    cond_numel: int,
    latent_numel: int,
) -> int:
    """Peak bytes one sampler row adds inside a transformer call (all its guidance branches).

    Per branch ``12 x tokens x hidden`` in the transformer's dtype (a bound on
    what ``benchmarks/memory.py`` measures, see ``docs/diffusers.md``), the gathered conditioning and the input and output
    latents; plus the float32 guided velocity. ``heads`` is accepted for the
    callers' convenience and does not enter (fused attention).
    """
    mb = torch.empty((), dtype=dtype).element_size()
    tokens = image_tokens + text_tokens
    activation = mb * tokens * hidden * _ACTIVATION_FACTOR
    return branches * (activation + 2 * cond_numel * mb + 2 * latent_numel * mb) + 3 * latent_numel * 4


def module_dtype_device(module: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    """The ``(dtype, device)`` of a diffusers model (its attributes, else its first parameter)."""
    dtype = getattr(module, "dtype", None)
    device = getattr(module, "device", None)
    if not isinstance(dtype, torch.dtype) or not isinstance(device, torch.device):
        p = next(module.parameters())
        dtype, device = p.dtype, p.device
    return dtype, device


def check_rows(rows: int, sigma: torch.Tensor, cond: list) -> None:
    """A call's ``sigma`` is ``(rows,)`` and each of its conditioning tensors has ``rows`` rows, as ``x``.

    Raises:
        ValueError: with the shapes seen.
    """
    if sigma.shape != (rows,) or any(c.shape[0] != rows for c in cond):
        raise ValueError(
            f"x has {rows} rows but sigma has shape {tuple(sigma.shape)} and the embeddings have "
            f"{[c.shape[0] for c in cond]} rows"
        )


def branch_inputs(
    hidden: torch.Tensor,
    t: torch.Tensor,
    enc: torch.Tensor,
    pooled: torch.Tensor,
    negative_enc: torch.Tensor | None,
    negative_pooled: torch.Tensor | None,
    *,
    guided: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One transformer call's ``(hidden, t, enc, pooled)`` for ``M`` states: the embeddings in the
    transformer's dtype on ``device``; ``guided``: ``2M`` rows, the negative branch first
    (``[negative; positive]``, as the diffusers pipelines order them).

    Args:
        hidden: ``(M, ...)`` the states, already in the transformer's layout, dtype and device.
        t: ``(M,)`` float32 timesteps on ``device``.
        enc, pooled: ``(M, ...)`` the positive branch's embeddings.
        negative_enc, negative_pooled: ``(M, ...)`` the negative branch's, read when ``guided``.
    """
    enc = enc.to(device, dtype)
    pooled = pooled.to(device, dtype)
    if not guided:
        return hidden, t, enc, pooled
    return (
        torch.cat([hidden, hidden]),
        torch.cat([t, t]),
        torch.cat([negative_enc.to(device, dtype), enc]),
        torch.cat([negative_pooled.to(device, dtype), pooled]),
    )


def guide(out: torch.Tensor, scale: float) -> torch.Tensor:
    """``v_neg + scale (v_pos - v_neg)`` of a ``[negative; positive]`` call's float32 output ``(2M, ...)``."""
    v_neg, v_pos = out.chunk(2)
    return v_neg + scale * (v_pos - v_neg)


class FlowMatchVelocity:
    """A diffusers flow-matching transformer as a velocity ``v(x, sigma, **cond)``.

    Wraps ``SD3Transformer2DModel`` (and any transformer with its call signature
    that is used with ``FlowMatchEulerDiscreteScheduler``): the network is
    called at ``timestep = num_train_timesteps * sigma``, the scheduler's
    convention, and its output is the velocity of the linear path.

    Classifier-free guidance: with ``guidance_scale > 1`` the unconditional and
    conditional branches of every row go through **one** batched transformer
    call (rows ``[uncond; cond]``, as the SD3 pipeline orders them) and
    ``v = v_uncond + g (v_cond - v_uncond)``, computed in float32. The guided
    velocity is the target; the sampler treats it like any other model.

    The transformer runs in its own dtype on ``device``; states are cast in and
    the velocity is returned in float32 on the states' device.

    Args:
        transformer: the network, called as ``transformer(hidden_states=,
            timestep=, encoder_hidden_states=, pooled_projections=,
            return_dict=False)[0]``.
        guidance_scale: ``g >= 0``; ``g <= 1`` runs the conditional branch only.
        num_train_timesteps: the scheduler's ``num_train_timesteps`` (1000 for SD3).
        device: where inputs are sent (default: the transformer's device; pass
            ``pipe._execution_device`` when the pipeline offloads models).
        joint_attention_kwargs: passed to the transformer unchanged.
    """

    def __init__(
        self,
        transformer: torch.nn.Module,
        *,
        guidance_scale: float = 1.0,
        num_train_timesteps: int = 1000,
        device: str | torch.device | None = None,
        joint_attention_kwargs: dict | None = None,
    ) -> None:
        if not callable(transformer):
            raise TypeError("transformer must be a callable torch module")
        self.transformer = transformer
        self.guidance_scale = check_number("guidance_scale", guidance_scale, 0.0)
        self.num_train_timesteps = check_int("num_train_timesteps", num_train_timesteps, 1)
        self.dtype, own = module_dtype_device(transformer)
        self.device = torch.device(device) if device is not None else own
        self.joint_attention_kwargs = joint_attention_kwargs

    def row_bytes(
        self,
        x: torch.Tensor,
        *,
        encoder_hidden_states: torch.Tensor | None = None,
        pooled_projections: torch.Tensor | None = None,
        **cond: torch.Tensor,
    ) -> int | None:
        """Peak bytes one row adds inside a call (:func:`transformer_row_bytes`), for
        :func:`specforest.memory.row_bytes_of`; ``None`` for a transformer without an SD3-style config.

        Args:
            x: ``(1, C, h, w)`` one latent.
            encoder_hidden_states: ``(1, seq, joint_attention_dim)`` one row's prompt embeddings.
            pooled_projections: ``(1, pooled_projection_dim)``.
        """
        cfg = getattr(self.transformer, "config", None)
        if cfg is None or "num_attention_heads" not in cfg:
            return None
        _, _, h, w = x.shape
        patch = int(cfg.get("patch_size", 1) or 1)
        heads = int(cfg.get("num_attention_heads", 1))
        text = 0 if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        cond_numel = sum(c[0].numel() for c in (encoder_hidden_states, pooled_projections) if c is not None)
        return transformer_row_bytes(
            branches=self.branches,
            dtype=self.dtype,
            image_tokens=(h // patch) * (w // patch),
            text_tokens=text,
            hidden=heads * int(cfg.get("attention_head_dim", 64)),
            heads=heads,
            cond_numel=cond_numel,
            latent_numel=x[0].numel(),
        )

    @property
    def do_classifier_free_guidance(self) -> bool:
        """True when ``guidance_scale > 1`` (diffusers' convention)."""
        return self.guidance_scale > 1.0

    @property
    def branches(self) -> int:
        """Transformer rows per state: 2 with guidance, 1 without."""
        return 2 if self.do_classifier_free_guidance else 1

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
            x: ``(M, C, h, w)`` latents at noise levels ``sigma``.
            sigma: ``(M,)`` noise levels in ``[0, 1]``.
            encoder_hidden_states: ``(M, seq, joint_attention_dim)`` prompt embeddings.
            pooled_projections: ``(M, pooled_projection_dim)`` pooled embeddings.
            negative_encoder_hidden_states: ``(M, seq, joint_attention_dim)``,
                required with guidance.
            negative_pooled_projections: ``(M, pooled_projection_dim)``, required
                with guidance.

        Returns:
            ``(M, C, h, w)`` float32 velocity on ``x``'s device.

        Raises:
            ValueError: on missing negative embeddings or mismatched row counts.
        """
        cfg = self.do_classifier_free_guidance
        cond = [encoder_hidden_states, pooled_projections]
        if cfg:
            if negative_encoder_hidden_states is None or negative_pooled_projections is None:
                raise ValueError(
                    f"guidance_scale={self.guidance_scale} > 1 needs negative_encoder_hidden_states "
                    "and negative_pooled_projections"
                )
            cond += [negative_encoder_hidden_states, negative_pooled_projections]
        check_rows(x.shape[0], sigma, cond)
        dev, dt = self.device, self.dtype
        h, t, enc, pooled = branch_inputs(
            x.to(dev, dt),
            sigma.to(dev, torch.float32) * self.num_train_timesteps,
            encoder_hidden_states,
            pooled_projections,
            negative_encoder_hidden_states,
            negative_pooled_projections,
            guided=cfg,
            device=dev,
            dtype=dt,
        )
        kwargs = {} if self.joint_attention_kwargs is None else {"joint_attention_kwargs": self.joint_attention_kwargs}
        out = self.transformer(
            hidden_states=h,
            timestep=t,
            encoder_hidden_states=enc,
            pooled_projections=pooled,
            return_dict=False,
            **kwargs,
        )[0].to(torch.float32)
        if cfg:
            out = guide(out, self.guidance_scale)
        return out.to(x.device)

    def __repr__(self) -> str:
        return (
            f"FlowMatchVelocity({type(self.transformer).__name__}, guidance_scale={self.guidance_scale}, "
            f"dtype={self.dtype}, device={self.device})"
        )
