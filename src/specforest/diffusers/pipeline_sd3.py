"""Stable Diffusion 3 end to end with the exact speculative sampler (paper Sec. 5.3, App. C.3).

The native sampler integrates the probability-flow ODE, whose transitions are
point masses, so speculation would accept nothing; :func:`sample` samples the
same marginals with the churned SDE of eqs. (35)-(37), whose Euler-Maruyama
kernels share a variance and differ only in their means, the structure both
couplings need. Text encoding, latents and VAE decoding are the pipeline's own;
only the sampling loop is :func:`specforest.sample`.

diffusers itself is not imported here: everything goes through the pipeline
object that is passed in.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .. import memory as _memory
from ..couplings import Coupling
from ..planning import make_tree
from ..sampler import SampleStats, TunedFor, check_tuned_for
from ..sampler import sample as _engine_sample
from ..trees import VERIFY_MODES, DraftTree
from ..validation import check_int as _check_int
from ..validation import check_number as _check_number
from ..warmup import pad_rows_for, warm_up
from .flow_matching import FlowMatchVelocity, module_dtype_device, transformer_row_bytes
from .grid import scheduler_sigmas

__all__ = [
    "OUTPUT_TYPES",
    "SD3Result",
    "cond_from_embeds",
    "decode",
    "sample",
    "transformer_row_bytes",
    "velocity_and_grid",
]

logger = logging.getLogger(__name__)

OUTPUT_TYPES = ("pil", "np", "pt", "latent")

_DECODE_FACTOR = 16


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
        memory: the :class:`~specforest.memory.MemoryEstimate` the run was sized with.
        config: the options that produced the result.
        warmup_seconds: the time of the warm-up (``warmup=True``), 0 without; not in ``stats.wall_seconds``.
    """

    images: Any
    latents: torch.Tensor
    stats: SampleStats
    memory: _memory.MemoryEstimate
    config: dict = field(default_factory=dict)
    warmup_seconds: float = 0.0


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
            raise ValueError("negative_prompt_embeds goes with prompt_embeds; with prompt use negative_prompt")
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


def _initial_latents(shape: tuple, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``x_T ~ N(0, I)`` in float32, drawn on the generator's device and moved to ``device``."""
    return torch.randn(shape, generator=generator, dtype=torch.float32, device=generator.device).to(device)


def velocity_and_grid(
    pipe: Any,
    *,
    num_inference_steps: int,
    guidance_scale: float,
    height: Optional[int] = None,
    width: Optional[int] = None,
    shift: Optional[float] = None,
) -> "tuple[FlowMatchVelocity, torch.Tensor, tuple, torch.device]":
    """What :func:`specforest.sample` needs of an SD3 pipeline: the velocity, the grid, the latents' shape.

    Args:
        pipe: a ``StableDiffusion3Pipeline`` (or one with the same components).
        num_inference_steps: grid steps ``T >= 1``.
        guidance_scale: classifier-free guidance ``g >= 0``.
        height, width: image size in pixels (default: the transformer's native size).
        shift: static timestep shift overriding the scheduler's (``None``: its config).

    Returns:
        ``(velocity, sigmas (T + 1,) float64, latent_shape (C, h, w), device)``; the
        velocity's ``image_size`` is ``(height, width)``.

    Raises:
        ValueError / TypeError: naming the parameter.
    """
    _check_pipeline(pipe)
    tcfg = pipe.transformer.config
    sched_cfg = pipe.scheduler.config
    steps = _check_int("num_inference_steps", num_inference_steps, 1)
    guidance = _check_number("guidance_scale", guidance_scale, 0.0)
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
    sigmas = scheduler_sigmas(sched_cfg, steps, shift=shift, image_seq_len=(h // patch) * (w // patch))

    device = getattr(pipe, "_execution_device", None)
    t_dtype, t_device = module_dtype_device(pipe.transformer)
    device = torch.device(device) if device is not None else t_device
    velocity = FlowMatchVelocity(
        pipe.transformer,
        guidance_scale=guidance,
        num_train_timesteps=int(sched_cfg.get("num_train_timesteps", 1000)),
        device=device,
    )

    velocity.image_size = (height, width)
    return velocity, sigmas, (int(tcfg.get("in_channels", 16)), h, w), device


def encode_text(
    pipe: Any,
    prompts: Any,
    negatives: Any,
    *,
    device: torch.device,
    guidance: bool,
    max_sequence_length: int,
    **embeds: Optional[torch.Tensor],
) -> tuple:
    """``(prompt_embeds, negative_prompt_embeds, pooled, negative_pooled)`` as the SD3 pipeline encodes them.

    ``embeds``: precomputed ``prompt_embeds`` and the like, passed through to ``pipe.encode_prompt``.
    """
    with torch.no_grad():
        return pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=guidance,
            negative_prompt=negatives,
            max_sequence_length=max_sequence_length,
            **embeds,
        )


def row_bytes_of(
    pipe: Any, velocity: FlowMatchVelocity, latent_shape: tuple, pe: torch.Tensor, ppe: torch.Tensor
) -> int:
    """Bytes one transformer row needs (:meth:`FlowMatchVelocity.row_bytes`) with these embeddings.

    ``pipe`` is accepted for the callers' convenience; the velocity reads its transformer's config.
    """
    x_row = torch.zeros((1, *latent_shape))
    cond_row = {"encoder_hidden_states": pe[:1], "pooled_projections": ppe[:1]}
    declared = _memory.row_bytes_of(velocity, x_row, cond_row)
    return declared if declared is not None else _memory.DEFAULT_ROW_STATES * 4 * math.prod(latent_shape)


def cond_from_embeds(
    prompt_embeds: torch.Tensor,
    pooled_prompt_embeds: torch.Tensor,
    negative_prompt_embeds: Optional[torch.Tensor],
    negative_pooled_prompt_embeds: Optional[torch.Tensor],
    velocity: FlowMatchVelocity,
    device: torch.device,
) -> dict:
    """The per-trajectory conditioning :class:`FlowMatchVelocity` reads, one row per embedding row.

    The negative embeddings are used with guidance (``velocity.branches == 2``) only.
    """
    cond = {"encoder_hidden_states": prompt_embeds, "pooled_projections": pooled_prompt_embeds}
    if velocity.branches == 2:
        cond.update(
            negative_encoder_hidden_states=negative_prompt_embeds,
            negative_pooled_projections=negative_pooled_prompt_embeds,
        )
    return {k: v.to(device, velocity.dtype) for k, v in cond.items()}


def _check_run_options(
    *,
    num_inference_steps: Any,
    churn: Any,
    num_images_per_prompt: Any,
    output_type: Any,
    verify: Any,
    lazy: Any,
    generator: Any,
    max_memory_gb: Any,
) -> "tuple[int, float, int, Optional[float]]":
    """The checks every family's ``sample`` makes of its run options, naming the parameter.

    Returns:
        ``(steps, churn, num_images_per_prompt, max_memory_gb)`` as validated numbers.
    """
    steps = _check_int("num_inference_steps", num_inference_steps, 1)
    churn = _check_number("churn", churn, 0.0, 1.0, lo_open=True)
    n_img = _check_int("num_images_per_prompt", num_images_per_prompt, 1)
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
    return steps, churn, n_img, max_memory_gb


def _plan_memory(
    pipe: Any,
    *,
    max_memory_gb: Optional[float],
    device: torch.device,
    images: int,
    latent_shape: tuple,
    height: int,
    width: int,
    output_type: str,
    tree: Optional[DraftTree],
    verify: str,
    lazy: bool,
    steps: int,
    row_bytes: int,
    cond_bytes: int,
) -> "tuple[_memory.MemoryEstimate, int]":
    """The run's memory estimate and the images per VAE call, before anything is allocated.

    All images sample together: the limit splits the transformer calls, never the batch.

    Raises:
        MemoryError: if one image's decode, or the sampler's states, exceed the limit.
    """
    # the limit bounds the whole process: what it holds now (weights, embeddings) is fixed
    limit, source, fixed = _memory.resolve_limit(max_memory_gb, device, "max_memory_gb")
    decode_bytes = 0
    if output_type != "latent":
        vae_dtype, _ = module_dtype_device(pipe.vae)
        vb = torch.empty((), dtype=vae_dtype).element_size()
        decode_bytes = _DECODE_FACTOR * height * width * int(pipe.vae.config.block_out_channels[0]) * max(vb, 4)
    if decode_bytes and fixed + decode_bytes > limit:
        raise MemoryError(
            f"one image's VAE decode needs about {decode_bytes / 1e9:.3g} GB beside the {fixed / 1e9:.3g} GB "
            f"the process holds, but the memory limit is {limit / 1e9:.3g} GB ({source}); use a smaller "
            "height/width, output_type='latent', or raise max_memory_gb"
        )
    memory = _memory.estimate(
        trajectories=images,
        state_numel=math.prod(latent_shape),
        tree=tree,
        verify=verify,
        lazy=lazy,
        steps=steps,
        row_bytes=row_bytes,
        cond_bytes=cond_bytes,
        fixed_bytes=fixed,
        limit_bytes=limit,
        limit_source=source,
        device=device,
        chunked=False,
    )
    logger.info(memory.describe())
    return memory, (images if decode_bytes == 0 else max(1, min(images, (limit - fixed) // decode_bytes)))


def decode(pipe: Any, latents: torch.Tensor, output_type: str = "pil", batch: Optional[int] = None) -> Any:
    """Latents ``(B, C, h, w)`` to images, as the SD3 pipeline decodes them, ``batch`` images per VAE call.

    Returns:
        What the pipeline returns for ``output_type`` (``pil``, ``np`` or ``pt``).
    """
    if output_type not in OUTPUT_TYPES or output_type == "latent":
        raise ValueError(f"output_type must be one of pil, np, pt to decode, got {output_type!r}")
    vae_dtype, vae_device = module_dtype_device(pipe.vae)
    device = getattr(pipe, "_execution_device", None) or vae_device
    vcfg = pipe.vae.config
    B = latents.shape[0]
    batch = B if batch is None else max(1, int(batch))
    parts = []
    with torch.no_grad():
        for i in range(0, B, batch):
            z = latents[i : i + batch].to(device, vae_dtype)
            z = z / vcfg.scaling_factor + (vcfg.shift_factor or 0.0)
            parts.append(pipe.vae.decode(z, return_dict=False)[0])
    return pipe.image_processor.postprocess(torch.cat(parts), output_type=output_type)


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
    tuned_for: TunedFor | None = None,
    pad_rows: "Optional[str | list[int]]" = None,
    warmup: bool = False,
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
        tuned_for: the run a tuned configuration was chosen for, set by ``sample(pipe, ...,
            **tuned)`` with the :class:`~specforest.latency.Tuned` of
            :func:`specforest.diffusers.tune`: a run whose ``num_inference_steps``, churn or
            images differ from it is refused (``**tuned.options()``: unchecked).
        pad_rows: pad every transformer call's rows up to one of a few sizes (see
            :func:`specforest.sample`; same images).
        warmup: call the transformer at every row count of the run before it
            (:func:`specforest.warmup.warm_up`; same images), so that the run does not pay the
            first call at each shape (cuDNN autotuning, allocator growth); without ``pad_rows``,
            with many images on a tree, the calls are padded to
            :func:`specforest.warmup.pad_rows_for`'s sizes (``config["pad_rows"]`` says which).

    Returns:
        :class:`SD3Result` with ``images``, ``latents``, ``stats``, ``memory``, ``config``,
        ``warmup_seconds``.

    Raises:
        ValueError / TypeError: on invalid arguments (naming the parameter).
        MemoryError: if the run would not fit the memory limit (with the numbers
            and what to change; nothing is allocated for sampling in that case).
        FloatingPointError: if the transformer returns NaN or inf.
    """
    _check_pipeline(pipe)
    tcfg = pipe.transformer.config
    sched_cfg = pipe.scheduler.config
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
    guidance = _check_number("guidance_scale", guidance_scale, 0.0)
    max_seq = _check_int("max_sequence_length", max_sequence_length, 1)
    if max_seq > 512:
        raise ValueError(f"max_sequence_length must be <= 512, got {max_seq}")
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
    check_tuned_for(tuned_for, steps=steps, sigmas=None, churn=churn, batch=n * n_img, batch_name="images")
    tree = make_tree(K, L, coupling=coupling, tree=tree, steps=steps)
    velocity, sigmas, latent_shape, device = velocity_and_grid(
        pipe, num_inference_steps=steps, guidance_scale=guidance, height=height, width=width, shift=shift
    )
    t_dtype = velocity.dtype
    t_bytes = torch.empty((), dtype=t_dtype).element_size()
    height, width = velocity.image_size

    # -- text ---------------------------------------------------------------------------
    pe, npe, ppe, nppe = encode_text(
        pipe,
        prompts,
        negatives,
        device=device,
        guidance=cfg,
        max_sequence_length=max_seq,
        prompt_embeds=prompt_embeds,
        negative_prompt_embeds=negative_prompt_embeds,
        pooled_prompt_embeds=pooled_prompt_embeds,
        negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
    )
    # each caption's rows repeated consecutively, as diffusers repeats them
    conds = cond_from_embeds(pe, ppe, npe, nppe, velocity, device)
    cond = {k: v.repeat_interleave(n_img, dim=0) for k, v in conds.items()}
    B = n * n_img
    if isinstance(generator, (list, tuple)) and len(generator) != B:
        raise ValueError(
            f"a list of generators must hold one per image ({B} = prompts x num_images_per_prompt), "
            f"got {len(generator)}"
        )

    # -- memory -------------------------------------------------------------------------
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
        row_bytes=row_bytes_of(pipe, velocity, latent_shape, pe, ppe),
        cond_bytes=velocity.branches * (pe[0].numel() + ppe[0].numel()) * t_bytes,
    )

    # -- sampling -----------------------------------------------------------------------
    if generator is None:
        generator = torch.Generator(device="cpu")
        generator.seed()
    if isinstance(generator, (list, tuple)):
        # diffusers' convention: image i's latents (and here its sampling noise) from generator[i]
        x_T = torch.cat([_initial_latents((1, *latent_shape), g, device) for g in generator])
    else:
        x_T = _initial_latents((B, *latent_shape), generator, device)
    opts = dict(
        sigmas=sigmas,
        churn=churn,
        tree=tree,
        coupling=coupling,
        draft=draft,
        prefetch=prefetch,
        verify=verify,
        max_rows=memory.max_rows,
        lazy=lazy,
    )
    warmup_seconds = 0.0
    if warmup:
        pad_rows = pad_rows or pad_rows_for(B, **opts)
        warmup_seconds = warm_up(velocity, x_T, cond=cond, pad_rows=pad_rows, **opts)
    out = _engine_sample(velocity, x_T, generator=generator, progress=progress, cond=cond, pad_rows=pad_rows, **opts)
    latents = out.samples

    # -- decoding, as the SD3 pipeline does it ------------------------------------------------
    if output_type == "latent":
        images: Any = latents.to(t_dtype)
    else:
        images = decode(pipe, latents, output_type, decode_batch)

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
        pad_rows=pad_rows,
        decode_batch=decode_batch,
        transformer_dtype=str(t_dtype).replace("torch.", ""),
        device=str(device),
    )
    return SD3Result(
        images=images, latents=latents, stats=out.stats, memory=memory, config=config, warmup_seconds=warmup_seconds
    )
