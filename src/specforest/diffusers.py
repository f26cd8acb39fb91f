"""Speculative sampling for diffusers' flow-matching pipelines (paper Sec. 5.3, App. C.3).

Stable Diffusion 3 is a rectified flow: its transformer predicts the velocity
``v = E[xi - x_0 | x_sigma]`` of the linear path ``x_sigma = (1 - sigma) x_0 +
sigma xi`` at ``timestep = 1000 sigma``, which is the library's model contract
as it stands. The native sampler integrates the probability-flow ODE, whose
transitions are point masses, so speculation would accept nothing; here the
same marginals are sampled with the churned SDE of eqs. (35)-(37), whose
Euler-Maruyama kernels share a variance and differ only in their means, the
structure both couplings need.

* :class:`FlowMatchVelocity` adapts the transformer (with classifier-free
  guidance in one batched call) to ``v(x, sigma, **cond)``.
* :func:`scheduler_sigmas` rebuilds the scheduler's grid as data, without
  touching the pipeline's scheduler.
* :func:`sample` runs a ``StableDiffusion3Pipeline`` end to end: text encoding,
  latents, :func:`specforest.sample`, VAE decoding.

diffusers itself is not imported here: everything goes through the pipeline
object that is passed in.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import trees
from .couplings import Coupling
from .sampler import SampleStats
from .sampler import sample as _engine_sample
from .trees import VERIFY_MODES, DraftTree

__all__ = [
    "OUTPUT_TYPES",
    "FlowMatchVelocity",
    "MemoryEstimate",
    "SD3Result",
    "default_memory_limit",
    "estimate_memory",
    "make_tree",
    "sample",
    "scheduler_sigmas",
]

logger = logging.getLogger(__name__)

OUTPUT_TYPES = ("pil", "np", "pt", "latent")

# Scheduler options that replace the shifted linspace by another family of grids.
_UNSUPPORTED_SCHEDULER_OPTIONS = (
    "use_karras_sigmas",
    "use_exponential_sigmas",
    "use_beta_sigmas",
    "invert_sigmas",
)

# Heuristic peak activation of one transformer row, in units of
# tokens x hidden x bytes: the joint blocks hold the two streams, q/k/v,
# the attention output and a 4x MLP at once. Attention probabilities are
# counted as if materialised (float32 scores and softmax), which overestimates
# fused kernels: the estimate errs towards smaller sub-batches, never towards OOM.
_ACTIVATION_FACTOR = 24
_DECODE_FACTOR = 16


def _module_dtype_device(module: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    dtype = getattr(module, "dtype", None)
    device = getattr(module, "device", None)
    if not isinstance(dtype, torch.dtype) or not isinstance(device, torch.device):
        p = next(module.parameters())
        dtype, device = p.dtype, p.device
    return dtype, device


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
        if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float)):
            raise TypeError(f"guidance_scale must be a number >= 0, got {type(guidance_scale).__name__}")
        if not (math.isfinite(guidance_scale) and guidance_scale >= 0):
            raise ValueError(f"guidance_scale must be a finite number >= 0, got {guidance_scale}")
        if isinstance(num_train_timesteps, bool) or not isinstance(num_train_timesteps, int):
            raise TypeError(
                f"num_train_timesteps must be an int >= 1, got {type(num_train_timesteps).__name__}"
            )
        if num_train_timesteps < 1:
            raise ValueError(f"num_train_timesteps must be >= 1, got {num_train_timesteps}")
        self.transformer = transformer
        self.guidance_scale = float(guidance_scale)
        self.num_train_timesteps = num_train_timesteps
        self.dtype, own = _module_dtype_device(transformer)
        self.device = torch.device(device) if device is not None else own
        self.joint_attention_kwargs = joint_attention_kwargs

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
        M = x.shape[0]
        cond = [encoder_hidden_states, pooled_projections]
        if self.do_classifier_free_guidance:
            if negative_encoder_hidden_states is None or negative_pooled_projections is None:
                raise ValueError(
                    f"guidance_scale={self.guidance_scale} > 1 needs negative_encoder_hidden_states "
                    "and negative_pooled_projections"
                )
            cond += [negative_encoder_hidden_states, negative_pooled_projections]
        if sigma.shape != (M,) or any(c.shape[0] != M for c in cond):
            raise ValueError(
                f"x has {M} rows but sigma has shape {tuple(sigma.shape)} and the embeddings have "
                f"{[c.shape[0] for c in cond]} rows"
            )
        dev, dt = self.device, self.dtype
        h = x.to(dev, dt)
        t = sigma.to(dev, torch.float32) * self.num_train_timesteps
        enc = encoder_hidden_states.to(dev, dt)
        pooled = pooled_projections.to(dev, dt)
        if self.do_classifier_free_guidance:
            h = torch.cat([h, h])
            t = torch.cat([t, t])
            enc = torch.cat([negative_encoder_hidden_states.to(dev, dt), enc])
            pooled = torch.cat([negative_pooled_projections.to(dev, dt), pooled])
        kwargs = (
            {}
            if self.joint_attention_kwargs is None
            else {"joint_attention_kwargs": self.joint_attention_kwargs}
        )
        out = self.transformer(
            hidden_states=h,
            timestep=t,
            encoder_hidden_states=enc,
            pooled_projections=pooled,
            return_dict=False,
            **kwargs,
        )[0].to(torch.float32)
        if self.do_classifier_free_guidance:
            v_uncond, v_cond = out.chunk(2)
            out = v_uncond + self.guidance_scale * (v_cond - v_uncond)
        return out.to(x.device)

    def __repr__(self) -> str:
        return (
            f"FlowMatchVelocity({type(self.transformer).__name__}, guidance_scale={self.guidance_scale}, "
            f"dtype={self.dtype}, device={self.device})"
        )


# -- the time grid ---------------------------------------------------------------------


def _calculate_shift(image_seq_len: int, config: Mapping) -> float:
    """``mu`` of dynamic shifting, as the SD3 pipeline computes it (linear in the sequence length)."""
    base_len = config.get("base_image_seq_len", 256)
    max_len = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.5)
    max_shift = config.get("max_shift", 1.16)
    m = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * m + base_shift - m * base_len


def scheduler_sigmas(
    config: Mapping,
    steps: int,
    *,
    shift: float | None = None,
    image_seq_len: int | None = None,
) -> torch.Tensor:
    """The grid of a ``FlowMatchEulerDiscreteScheduler`` with this config, in float64.

    Reproduces ``set_timesteps(steps)`` (``mu`` from ``image_seq_len`` under
    dynamic shifting, as the SD3 pipeline passes it) without touching any
    scheduler. With a static shift ``kappa`` (eq. 38) diffusers' grid is::

        s_min = kappa (1/N) / (1 + (kappa - 1) / N)          # N = num_train_timesteps
        sigmas = shift_kappa(linspace(1, s_min, T)), then 0

    i.e. the smallest level is shifted twice (the scheduler shifts its
    training levels at construction and the inference grid again); for
    ``kappa = 3``, ``T = 50`` this differs from ``shift_kappa(linspace(1, 1/N, T))``
    (:func:`specforest.flow_match_grid`) by up to 6e-3.

    Args:
        config: the scheduler's ``config`` (e.g. ``pipe.scheduler.config``).
        steps: number of steps ``T >= 1``.
        shift: a static shift ``kappa > 0`` that overrides the config (as a
            scheduler built with ``shift=kappa, use_dynamic_shifting=False``);
            ``None`` uses the config as it is.
        image_seq_len: image tokens ``(h / p) (w / p)``; needed only when the
            config uses dynamic shifting.

    Returns:
        ``(T + 1,)`` float64 noise levels, decreasing from 1 to 0. The first and
        last steps are deterministic Euler steps in the sampler.

    Raises:
        ValueError: on invalid arguments, or a config that uses Karras,
            exponential, beta or inverted sigmas (not a shifted linspace).
    """
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"num_inference_steps must be an int >= 1, got {type(steps).__name__}")
    if steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {steps}")
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping (scheduler.config), got {type(config).__name__}")
    bad = [k for k in _UNSUPPORTED_SCHEDULER_OPTIONS if config.get(k)]
    if bad:
        raise ValueError(
            f"scheduler config sets {', '.join(bad)}; only shifted linear grids (static or dynamic "
            "shift, shift_terminal) are supported"
        )
    N = int(config.get("num_train_timesteps", 1000))
    if N < 2:
        raise ValueError(f"scheduler num_train_timesteps must be >= 2, got {N}")
    dynamic = bool(config.get("use_dynamic_shifting", False)) and shift is None
    if shift is None:
        kappa = float(config.get("shift", 1.0))
    else:
        if isinstance(shift, bool) or not isinstance(shift, (int, float)):
            raise TypeError(f"shift must be a number > 0 or None, got {type(shift).__name__}")
        kappa = float(shift)
    if not (math.isfinite(kappa) and kappa > 0):
        raise ValueError(f"shift must be a finite number > 0, got {kappa}")

    def static(s: torch.Tensor) -> torch.Tensor:
        return kappa * s / (1.0 + (kappa - 1.0) * s)

    s_min = torch.tensor(1.0 / N, dtype=torch.float64)
    if dynamic:
        if image_seq_len is None:
            raise ValueError("the scheduler uses dynamic shifting: image_seq_len is required")
        mu = _calculate_shift(int(image_seq_len), config)
        kind = config.get("time_shift_type", "exponential")
        if kind not in ("exponential", "linear"):
            raise ValueError(f"scheduler time_shift_type must be 'exponential' or 'linear', got {kind!r}")
        scale = math.exp(mu) if kind == "exponential" else mu
        s = torch.linspace(1.0, float(s_min), steps, dtype=torch.float64)
        s = scale / (scale + (1.0 / s - 1.0))
    else:
        s = static(torch.linspace(1.0, float(static(s_min)), steps, dtype=torch.float64))
    terminal = config.get("shift_terminal")
    if terminal:
        if steps < 2:
            raise ValueError(
                "a scheduler with shift_terminal needs num_inference_steps >= 2 (diffusers gives NaN)"
            )
        one_minus = 1.0 - s
        s = 1.0 - one_minus / (one_minus[-1] / (1.0 - float(terminal)))
    return torch.cat([s, s.new_zeros(1)])


# -- trees and memory -------------------------------------------------------------------


def make_tree(
    tree: DraftTree | None = None,
    K: int | None = None,
    L: int | None = None,
    coupling: str | Coupling = "grs",
    steps: int | None = None,
) -> DraftTree | None:
    """The draft tree of :func:`sample`'s ``tree``/``K``/``L``/``coupling``.

    ``tree`` as given; else ``K`` and ``L`` give ``trees.uniform(K, L)``;
    ``coupling="rmc"`` with ``L`` gives ``trees.chain(L)`` (``L`` is the chain's
    budget ``B``, e.g. ``K + K^2`` to match a ``(K, 2)`` tree); nothing gives
    ``None``, the standard sampler. A chain longer than ``steps`` is cut to
    ``steps`` nodes: rounds never outrun the grid, so this changes nothing but
    memory.

    Raises:
        ValueError / TypeError: naming the offending parameter.
    """
    for name, v in (("K", K), ("L", L)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise TypeError(f"{name} must be None or an int >= 1, got {type(v).__name__}")
        if v is not None and v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    is_rmc = coupling == "rmc" or getattr(coupling, "name", None) == "rmc"
    if tree is not None:
        if not isinstance(tree, DraftTree):
            raise TypeError(
                f"tree must be a DraftTree (see specforest.trees) or None, got {type(tree).__name__}"
            )
        if K is not None or L is not None:
            raise ValueError("give either tree or K/L, not both")
        return tree
    if K is None and L is None:
        return None
    if is_rmc:
        if L is None:
            raise ValueError("coupling='rmc' drafts a chain: give L (its length B), e.g. L=K+K**2")
        if K not in (None, 1):
            raise ValueError(
                f"coupling='rmc' verifies one child per node, got K={K}; pass L=B (the chain length), "
                "e.g. the matched budget K + K**2 of a (K, 2) tree"
            )
        return trees.chain(min(L, steps) if steps is not None else L)
    if K is None or L is None:
        raise ValueError(f"give both K and L for a (K, L) tree, got K={K}, L={L}")
    return trees.uniform(K, L)


def default_memory_limit(device: str | torch.device) -> tuple[int, str]:
    """Bytes available for sampling and where the figure comes from.

    CUDA: the device's free memory now (after the pipeline was loaded). Other
    devices: 50% of physical RAM (8 GB where it cannot be read).
    """
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device}"
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        total = 0
    if total <= 0:
        return 8 * 10**9, "default of 8 GB (physical memory unknown)"
    return int(0.5 * total), "50% of physical RAM"


@dataclass
class MemoryEstimate:
    """What a run holds in memory, estimated before it starts. Sizes in bytes.

    Attributes:
        states_per_round: transformer rows of a full round, ``B x |I|`` (or
            ``B x |V|`` with ``verify="drafted"``, ``B`` for the standard sampler
            and per call with ``lazy``), times ``branches``.
        branches: transformer rows per state, 2 with guidance, else 1.
        latent_numel: elements of one latent ``C x h x w``.
        dtype_bytes: bytes per element of the transformer's dtype.
        round_bytes: ``states_per_round x latent_numel x dtype_bytes x 3``: the
            states of one round, their copies and velocities.
        sampler_bytes: float32 states the sampler holds (drafted tree, gathered
            rows, velocities, prefetch) and the images' text embeddings.
        state_bytes: peak bytes one state adds inside a transformer call
            (activations of all branches, conditioning copies), a heuristic upper bound.
        max_rows: states per transformer sub-batch that fit (``None``: the whole
            round at once). Sub-batches of one call still count as one NFE.
        decode_batch: images per VAE decode that fit.
        limit_bytes: the memory limit.
        limit_source: where the limit comes from.
    """

    states_per_round: int
    branches: int
    latent_numel: int
    dtype_bytes: int
    round_bytes: int
    sampler_bytes: int
    state_bytes: int
    max_rows: int | None
    decode_batch: int
    limit_bytes: int
    limit_source: str

    @property
    def total_bytes(self) -> int:
        """Estimated peak of the sampling phase: sampler states plus one sub-batch."""
        states = self.states_per_round // self.branches
        rows = states if self.max_rows is None else min(self.max_rows, states)
        return self.sampler_bytes + rows * self.state_bytes

    def describe(self) -> str:
        """One line for logs."""
        gb = 1e9
        chunk = "all at once" if self.max_rows is None else f"in sub-batches of {self.max_rows} states"
        return (
            f"memory per round: {self.states_per_round} states x {self.latent_numel} latent elements x "
            f"{self.dtype_bytes} B x 3 = {self.round_bytes / gb:.3g} GB; sampler states "
            f"{self.sampler_bytes / gb:.3g} GB; transformer {self.state_bytes / 1e6:.3g} MB per state, "
            f"{chunk}; peak ~{self.total_bytes / gb:.3g} GB of {self.limit_bytes / gb:.3g} GB "
            f"({self.limit_source})"
        )


def estimate_memory(
    *,
    batch: int,
    latent_shape: Sequence[int],
    tree: DraftTree | None,
    verify: str,
    lazy: bool,
    branches: int,
    dtype: torch.dtype,
    image_tokens: int,
    text_tokens: int,
    hidden: int,
    heads: int,
    cond_numel: int,
    image_pixels: int,
    vae_channels: int,
    vae_dtype: torch.dtype,
    limit_bytes: int,
    limit_source: str = "max_memory_gb",
    steps: int | None = None,
) -> MemoryEstimate:
    """Estimate a run's memory and pick sub-batch sizes that fit ``limit_bytes``.

    Args:
        batch: trajectories ``B`` (images).
        latent_shape: ``(C, h, w)``.
        tree: the draft tree (``None``: standard sampler).
        verify: ``internal`` or ``drafted``.
        lazy: the sampler's cost-simulation mode.
        branches: 2 with classifier-free guidance, else 1.
        dtype: the transformer's dtype.
        image_tokens, text_tokens: sequence lengths of the joint attention.
        hidden, heads: the transformer's width and attention heads.
        cond_numel: elements of one state's conditioning (all embeddings of one branch).
        image_pixels: ``H x W`` of a decoded image (0: no decoding).
        vae_channels: the VAE's channels at full resolution (``block_out_channels[0]``).
        vae_dtype: the VAE's dtype.
        limit_bytes: the memory limit.
        limit_source: where the limit comes from (for messages).
        steps: grid steps ``T``; rounds are at most ``T`` deep.

    Returns:
        A :class:`MemoryEstimate`.

    Raises:
        ValueError: if the sampler's states plus one state's transformer call, or
            one image's decode, do not fit ``limit_bytes``; the message gives the
            numbers and what to change.
    """
    D = math.prod(latent_shape)
    mb = torch.empty((), dtype=dtype).element_size()
    vb = torch.empty((), dtype=vae_dtype).element_size()
    f32 = 4
    if tree is None:
        evaluated, nodes, per_call = 1, 1, 1
    else:
        depth = tree.L if steps is None else min(tree.L, max(steps, 1))
        t = tree.truncate(depth)
        evaluated = t.verification_budget(verify)
        nodes = t.size
        per_call = evaluated
        if lazy:
            # lazy rounds call the target once per depth with one state per trajectory
            per_call, nodes = 1, 1 + tree.max_children
    states_per_round = batch * per_call * branches
    round_bytes = states_per_round * D * mb * 3
    # drafted nodes, gathered rows, velocities; plus x, prefetch (state, velocity) and scratch;
    # and every image's text embeddings
    sampler_bytes = batch * D * f32 * (nodes + 2 * per_call + 5) + batch * branches * cond_numel * mb
    tokens = image_tokens + text_tokens
    activation = mb * tokens * hidden * _ACTIVATION_FACTOR + 2 * f32 * heads * tokens * tokens
    # per branch: the activation, the gathered and concatenated conditioning, input and output
    state_bytes = branches * (activation + 2 * cond_numel * mb + 2 * D * mb) + 3 * D * f32
    decode_bytes = _DECODE_FACTOR * image_pixels * vae_channels * max(vb, f32)
    states = batch * per_call
    room = limit_bytes - sampler_bytes
    est = MemoryEstimate(
        states_per_round=states_per_round,
        branches=branches,
        latent_numel=D,
        dtype_bytes=mb,
        round_bytes=round_bytes,
        sampler_bytes=sampler_bytes,
        state_bytes=state_bytes,
        max_rows=None,
        decode_batch=batch if decode_bytes == 0 else max(1, min(batch, limit_bytes // decode_bytes)),
        limit_bytes=int(limit_bytes),
        limit_source=limit_source,
    )
    if room < state_bytes or decode_bytes > limit_bytes:
        gb = 1e9
        raise ValueError(
            f"this run does not fit the memory limit of {limit_bytes / gb:.3g} GB ({limit_source}): "
            f"a round evaluates {states_per_round} states x {D} latent elements x {mb} B x 3 = "
            f"{round_bytes / gb:.3g} GB, the sampler holds {sampler_bytes / gb:.3g} GB of float32 states "
            f"({batch} images x {nodes} drafted nodes), one state in the transformer needs about "
            f"{state_bytes / gb:.3g} GB and one image's VAE decode about {decode_bytes / gb:.3g} GB. "
            "Use a smaller K or L, fewer images (prompts or num_images_per_prompt), "
            "verify='internal', lazy=True, or raise max_memory_gb"
        )
    fit = int(room // state_bytes)
    est.max_rows = None if fit >= states else fit
    return est


# -- the pipeline --------------------------------------------------------------------------


@dataclass
class SD3Result:
    """What :func:`sample` returns.

    Attributes:
        images: as the pipeline returns them for ``output_type``: a list of PIL
            images (``pil``), a ``(B, H, W, 3)`` float array in [0, 1] (``np``),
            a ``(B, 3, H, W)`` tensor in [0, 1] (``pt``), or the ``(B, C, h, w)``
            latents in the transformer's dtype (``latent``).
        latents: ``(B, C, h, w)`` float32 final latents (the sampler's precision).
        stats: the sampler's :class:`~specforest.sampler.SampleStats`; ``nfe``
            ``(B,)`` counts sequential transformer calls per image (one call
            carries both guidance branches), ``speedup`` is ``T / nfe``.
        memory: the :class:`MemoryEstimate` the run was sized with.
        config: the options that produced the result.
    """

    images: Any
    latents: torch.Tensor
    stats: SampleStats
    memory: MemoryEstimate
    config: dict = field(default_factory=dict)


def _check_pipeline(pipe: Any) -> None:
    missing = [
        a
        for a in ("transformer", "vae", "scheduler", "encode_prompt", "image_processor")
        if getattr(pipe, a, None) is None
    ]
    if missing:
        raise TypeError(f"pipe must be a StableDiffusion3Pipeline-like object; it lacks {', '.join(missing)}")
    for name in ("transformer", "vae"):
        if not isinstance(getattr(getattr(pipe, name), "config", None), Mapping):
            raise TypeError(f"pipe.{name} must be a diffusers model with a config")
    config = getattr(pipe.scheduler, "config", None)
    if not isinstance(config, Mapping) or "num_train_timesteps" not in config:
        raise TypeError(
            f"pipe.scheduler must be a flow-matching scheduler (FlowMatchEulerDiscreteScheduler), "
            f"got {type(pipe.scheduler).__name__}"
        )
    if "FlowMatch" not in type(pipe.scheduler).__name__:
        raise TypeError(
            "pipe.scheduler must be a flow-matching scheduler (the transformer must predict the "
            f"flow-matching velocity), got {type(pipe.scheduler).__name__}"
        )


def _check_embeds(name: str, t: Any, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim or t.shape[0] < 1:
        shape = "(batch, seq, dim)" if ndim == 3 else "(batch, dim)"
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if not t.is_floating_point() or not torch.isfinite(t).all():
        raise ValueError(f"{name} must be a finite floating-point tensor")


def _check_prompts(
    prompt, prompt_embeds, negative_prompt, negative_prompt_embeds, pooled, neg_pooled, tcfg
) -> tuple[list[str] | None, list[str] | None, int]:
    """Validate the text inputs; return the prompts and negative prompts as lists, and their number."""
    if (prompt is None) == (prompt_embeds is None):
        raise ValueError("give exactly one of prompt (str or list of str) and prompt_embeds")
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
        _check_embeds("prompt_embeds", prompt_embeds, 3)
        if pooled is None:
            raise ValueError("prompt_embeds needs pooled_prompt_embeds (from the same text encoders)")
        _check_embeds("pooled_prompt_embeds", pooled, 2)
        n = prompt_embeds.shape[0]
        if pooled.shape[0] != n:
            raise ValueError(f"pooled_prompt_embeds has {pooled.shape[0]} rows but prompt_embeds has {n}")
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
            raise ValueError(
                "negative_prompt_embeds goes with prompt_embeds; with prompt use negative_prompt"
            )
        _check_embeds("negative_prompt_embeds", negative_prompt_embeds, 3)
        if negative_prompt_embeds.shape != prompt_embeds.shape:
            raise ValueError(
                f"negative_prompt_embeds has shape {tuple(negative_prompt_embeds.shape)} but prompt_embeds "
                f"has {tuple(prompt_embeds.shape)}; they must match"
            )
        if neg_pooled is None:
            raise ValueError("negative_prompt_embeds needs negative_pooled_prompt_embeds")
        _check_embeds("negative_pooled_prompt_embeds", neg_pooled, 2)
        if neg_pooled.shape != pooled.shape:
            raise ValueError(
                f"negative_pooled_prompt_embeds has shape {tuple(neg_pooled.shape)} but "
                f"pooled_prompt_embeds has {tuple(pooled.shape)}; they must match"
            )
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


def _check_number(name: str, v: Any, lo: float, hi: float = math.inf, lo_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise ValueError(f"{name} must be in {rng}, got {v}")
    return float(v)


def _check_int(name: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int >= {lo}, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return v


def _initial_latents(shape: tuple, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``x_T ~ N(0, I)`` in float32, drawn on the generator's device and moved to ``device``."""
    return torch.randn(shape, generator=generator, dtype=torch.float32, device=generator.device).to(device)


def sample(
    pipe: Any,
    prompt: str | list[str] | None = None,
    *,
    prompt_embeds: torch.Tensor | None = None,
    negative_prompt: str | list[str] | None = None,
    negative_prompt_embeds: torch.Tensor | None = None,
    pooled_prompt_embeds: torch.Tensor | None = None,
    negative_pooled_prompt_embeds: torch.Tensor | None = None,
    num_inference_steps: int = 50,
    guidance_scale: float = 7.0,
    height: int | None = None,
    width: int | None = None,
    generator: torch.Generator | None = None,
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
    max_sequence_length: int = 256,
) -> SD3Result:
    """Generate images with a Stable Diffusion 3 pipeline, sampling the churned SDE exactly.

    The pipeline's text encoders, transformer and VAE are used as the SD3
    pipeline uses them; only the sampling loop differs: the churned
    Euler-Maruyama chain of eqs. (35)-(37) on the scheduler's grid (the first
    step, from pure noise, and the last, into ``sigma = 0``, are plain Euler
    steps), run by :func:`specforest.sample`. Any tree or coupling gives
    latents with the law of the standard chain (``tree=None``); they change
    only the number of sequential transformer calls (``stats.nfe``).

    Neither the pipeline nor its scheduler is modified: the grid is computed
    from ``pipe.scheduler.config`` (:func:`scheduler_sigmas`).

    Args:
        pipe: a ``StableDiffusion3Pipeline`` (or one with the same components).
        prompt: a caption or a list of ``n`` captions; or give ``prompt_embeds``.
        prompt_embeds: ``(n, seq, joint_attention_dim)`` precomputed embeddings.
        negative_prompt: caption(s) for the unconditional branch (default "").
        negative_prompt_embeds: ``(n, seq, joint_attention_dim)``, same shape as ``prompt_embeds``.
        pooled_prompt_embeds: ``(n, pooled_projection_dim)``, required with ``prompt_embeds``.
        negative_pooled_prompt_embeds: ``(n, pooled_projection_dim)``, with ``negative_prompt_embeds``.
        num_inference_steps: grid steps ``T >= 1``.
        guidance_scale: classifier-free guidance ``g >= 0`` (``<= 1``: none).
        height, width: image size in pixels, divisible by ``vae_scale_factor x
            patch_size`` (default: the transformer's ``sample_size x vae_scale_factor``).
        generator: the only source of randomness (latents, then the sampler's
            seed). The same generator state gives the same images for the same
            inputs. A list of one generator per image (diffusers' convention)
            makes image ``i`` a function of ``generator[i]`` alone.
        num_images_per_prompt: images per caption (``>= 1``); ``B = n x num_images_per_prompt``.
        output_type: ``pil``, ``np``, ``pt`` or ``latent``.
        churn: ``eps`` in (0, 1] (0 makes speculation vacuous, ERRATA 8).
        tree: a draft tree; exclusive with ``K``/``L``.
        K, L: ``trees.uniform(K, L)``; with ``coupling="rmc"`` only ``L`` (the chain
            length ``B``). ``tree``, ``K`` and ``L`` all ``None``: the standard sampler.
        coupling: ``grs`` (D-GRS), ``rmc`` (chains) or a :class:`~specforest.couplings.Coupling`.
        draft: frozen-prediction kind or a draft velocity (see :func:`specforest.sample`).
        prefetch: ``nearest`` or ``parent`` (ERRATA 9).
        verify: ``internal`` or ``drafted`` (``drafted`` is the paper's protocol:
            ``B = |V|`` states per round).
        progress: show the sampler's progress bar.
        max_memory_gb: memory limit in GB (> 0). Default: the free memory of the
            CUDA device, or 50% of RAM on other devices.
        lazy: the sampler's cost simulation: draft only the visited nodes (same
            law of images and NFE, far less memory and compute).
        shift: static timestep shift ``kappa`` (eq. 38) overriding the scheduler's;
            ``None`` reads ``pipe.scheduler.config``.
        max_sequence_length: T5 tokens (<= 512), as in the SD3 pipeline.

    Returns:
        :class:`SD3Result` with ``images``, ``latents``, ``stats``, ``memory``, ``config``.

    Raises:
        ValueError / TypeError: on invalid arguments (naming the parameter), or
            if the run would not fit the memory limit (with the numbers and what
            to change; nothing is allocated for sampling in that case).
        FloatingPointError: if the transformer returns NaN or inf.
    """
    _check_pipeline(pipe)
    tcfg = pipe.transformer.config
    sched_cfg = pipe.scheduler.config
    steps = _check_int("num_inference_steps", num_inference_steps, 1)
    guidance = _check_number("guidance_scale", guidance_scale, 0.0)
    churn = _check_number("churn", churn, 0.0, 1.0, lo_open=True)
    n_img = _check_int("num_images_per_prompt", num_images_per_prompt, 1)
    max_seq = _check_int("max_sequence_length", max_sequence_length, 1)
    if max_seq > 512:
        raise ValueError(f"max_sequence_length must be <= 512, got {max_seq}")
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
        max_memory_gb = _check_number("max_memory_gb", max_memory_gb, 0.0, lo_open=True)
    cfg = guidance > 1.0
    prompts, negatives, n = _check_prompts(
        prompt,
        prompt_embeds,
        negative_prompt,
        negative_prompt_embeds,
        pooled_prompt_embeds,
        negative_pooled_prompt_embeds,
        tcfg,
    )
    vsf = int(getattr(pipe, "vae_scale_factor", 2 ** (len(pipe.vae.config.block_out_channels) - 1)))
    patch = int(tcfg.get("patch_size", 1) or 1)
    sample_size = int(tcfg.get("sample_size", 128))
    height = sample_size * vsf if height is None else _check_int("height", height, 1)
    width = sample_size * vsf if width is None else _check_int("width", width, 1)
    mult = vsf * patch
    for name, v in (("height", height), ("width", width)):
        if v % mult:
            raise ValueError(
                f"{name} must be divisible by vae_scale_factor x patch_size = {mult}, got {v} "
                f"(nearest below: {v - v % mult or mult})"
            )
    h, w = height // vsf, width // vsf
    max_pos = tcfg.get("pos_embed_max_size")
    if max_pos is not None and max(h, w) // patch > max_pos:
        raise ValueError(
            f"height={height}, width={width} give {h // patch} x {w // patch} patches but the transformer's "
            f"positional embedding covers at most {max_pos} per side (<= {max_pos * mult} pixels)"
        )
    tree = make_tree(tree, K, L, coupling, steps)
    sigmas = scheduler_sigmas(sched_cfg, steps, shift=shift, image_seq_len=(h // patch) * (w // patch))

    device = getattr(pipe, "_execution_device", None)
    t_dtype, t_device = _module_dtype_device(pipe.transformer)
    device = torch.device(device) if device is not None else t_device
    velocity = FlowMatchVelocity(
        pipe.transformer,
        guidance_scale=guidance,
        num_train_timesteps=int(sched_cfg.get("num_train_timesteps", 1000)),
        device=device,
    )

    # -- text ---------------------------------------------------------------------------
    with torch.no_grad():
        pe, npe, ppe, nppe = pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=cfg,
            negative_prompt=negatives,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds,
            negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
            max_sequence_length=max_seq,
        )
    # each caption's rows repeated consecutively, as diffusers repeats them
    conds = {"encoder_hidden_states": pe, "pooled_projections": ppe}
    if cfg:
        conds.update(negative_encoder_hidden_states=npe, negative_pooled_projections=nppe)
    cond = {k: v.to(device, t_dtype).repeat_interleave(n_img, dim=0) for k, v in conds.items()}
    B = n * n_img
    if isinstance(generator, (list, tuple)) and len(generator) != B:
        raise ValueError(f"a list of generators must hold one per image ({B} = prompts x num_images_per_prompt), "
                         f"got {len(generator)}")

    # -- memory -------------------------------------------------------------------------
    C = int(tcfg.get("in_channels", 16))
    latent_shape = (C, h, w)
    if max_memory_gb is not None:
        limit, source = int(max_memory_gb * 1e9), f"max_memory_gb={max_memory_gb:g}"
    else:
        limit, source = default_memory_limit(device)
    heads = int(tcfg.get("num_attention_heads", 1))
    hidden = heads * int(tcfg.get("attention_head_dim", 64))
    vae_dtype, _ = _module_dtype_device(pipe.vae)
    memory = estimate_memory(
        batch=B,
        latent_shape=latent_shape,
        tree=tree,
        verify=verify,
        lazy=lazy,
        branches=velocity.branches,
        dtype=t_dtype,
        image_tokens=(h // patch) * (w // patch),
        text_tokens=pe.shape[1],
        hidden=hidden,
        heads=heads,
        cond_numel=pe[0].numel() + ppe[0].numel(),
        image_pixels=0 if output_type == "latent" else height * width,
        vae_channels=int(pipe.vae.config.block_out_channels[0]),
        vae_dtype=vae_dtype,
        limit_bytes=limit,
        limit_source=source,
        steps=steps,
    )
    logger.info(memory.describe())

    # -- sampling -----------------------------------------------------------------------
    if generator is None:
        generator = torch.Generator(device="cpu")
        generator.seed()
    if isinstance(generator, (list, tuple)):
        # diffusers' convention: image i's latents (and here its sampling noise) from generator[i]
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

    # -- decoding, as the SD3 pipeline does it ------------------------------------------------
    if output_type == "latent":
        images: Any = latents.to(t_dtype)
    else:
        vcfg = pipe.vae.config
        parts = []
        with torch.no_grad():
            for i in range(0, B, memory.decode_batch):
                z = latents[i : i + memory.decode_batch].to(device, vae_dtype)
                z = z / vcfg.scaling_factor + (vcfg.shift_factor or 0.0)
                parts.append(pipe.vae.decode(z, return_dict=False)[0])
        decoded = torch.cat(parts)
        images = pipe.image_processor.postprocess(decoded, output_type=output_type)

    config = dict(
        out.config,
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=height,
        width=width,
        num_images=B,
        num_images_per_prompt=n_img,
        K=K,
        L=L,
        shift=shift,
        scheduler_shift=sched_cfg.get("shift"),
        lazy=lazy,
        max_rows=memory.max_rows,
        transformer_dtype=str(t_dtype).replace("torch.", ""),
        device=str(device),
    )
    return SD3Result(images=images, latents=latents, stats=out.stats, memory=memory, config=config)
