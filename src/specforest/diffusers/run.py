"""What every family's ``sample`` does around its own text encoding and decoding: memory, latents, the sampler.

The flow every family shares (:func:`~specforest.diffusers.flow.sample_family`)
checks the inputs, takes the pipeline apart (the family's velocity, grid and
per-image conditioning), makes the sampler's options (:func:`sampler_options`),
then calls :func:`run_sampler`: the memory plan (:func:`plan_memory`, before
anything is allocated), the initial latents drawn from the caller's
generator(s) as diffusers draws them, the warm-up, and one run of
:func:`specforest.sample`. It decodes the latents with the family's decoding and
returns an :class:`SD3Result`, the result type of every family.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .. import memory as _memory
from ..options import SamplerOptions
from ..sampler import SampleResult, SampleStats
from ..sampler import sample as _engine_sample
from ..warmup import pad_rows_for, warm_up
from .checks import check_generators
from .decoding import decode_bytes
from .flow_matching import module_dtype_device

__all__ = ["Run", "SD3Result", "execution_device", "plan_memory", "run_sampler", "sampler_options"]

logger = logging.getLogger(__name__)


@dataclass
class SD3Result:
    """What a family's ``sample`` returns (SD3's, the first family's, name; :class:`~specforest.diffusers.FluxResult`
    is the same record).

    Attributes:
        images: as the pipeline returns them for ``output_type``: a list of PIL
            images (``pil``), a ``(N, H, W, 3)`` float array in [0, 1] (``np``),
            a ``(N, 3, H, W)`` tensor in [0, 1] (``pt``), or the ``(N, C, h, w)``
            latents in the network's dtype (``latent``), for ``N`` images.
        latents: ``(N, C, h, w)`` float32 final latents (the sampler's precision).
        stats: the sampler's :class:`~specforest.sampler.SampleStats`; ``nfe``
            ``(N,)`` counts sequential network calls per image (one call
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


def execution_device(pipe: Any, network: torch.nn.Module) -> torch.device:
    """Where the network's inputs go: the pipeline's ``_execution_device`` (set when it offloads
    models), else the network's own device."""
    device = getattr(pipe, "_execution_device", None)
    _, own = module_dtype_device(network)
    return torch.device(device) if device is not None else own


def plan_memory(
    pipe: Any,
    *,
    max_memory_gb: Optional[float],
    device: torch.device,
    images: int,
    latent_shape: tuple,
    height: int,
    width: int,
    output_type: str,
    options: SamplerOptions,
    row_bytes: int,
    cond_bytes: int,
) -> "tuple[_memory.MemoryEstimate, int]":
    """The run's memory estimate and the images per VAE call, before anything is allocated.

    All images sample together: the limit splits the network calls, never the images. What the
    sampler's ``options`` decide (tree, verification, lazy, draft, the chain's carried prediction) is
    read from them (:func:`specforest.memory.run_shape`).

    Raises:
        MemoryError: if one image's decode, or the sampler's states, exceed the limit.
    """
    # the limit bounds the whole process: what it holds now (weights, embeddings) is fixed
    limit, source, fixed = _memory.resolve_limit(max_memory_gb, device, "max_memory_gb")
    one_decode = 0 if output_type == "latent" else decode_bytes(pipe, height, width)
    if one_decode and fixed + one_decode > limit:
        raise MemoryError(
            f"one image's VAE decode needs about {one_decode / 1e9:.3g} GB beside the {fixed / 1e9:.3g} GB "
            f"the process holds, but the memory limit is {limit / 1e9:.3g} GB ({source}); use a smaller "
            "height/width, output_type='latent', or raise max_memory_gb"
        )
    memory = _memory.estimate(
        trajectories=images,
        state_numel=math.prod(latent_shape),
        **_memory.run_shape(options),
        row_bytes=row_bytes,
        cond_bytes=cond_bytes,
        fixed_bytes=fixed,
        limit_bytes=limit,
        limit_source=source,
        device=device,
        chunked=False,
    )
    logger.info(memory.describe())
    return memory, (images if one_decode == 0 else max(1, min(images, (limit - fixed) // one_decode)))


def _initial_latents(shape: tuple, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``x_T ~ N(0, I)`` in float32, drawn on the generator's device and moved to ``device``."""
    return torch.randn(shape, generator=generator, dtype=torch.float32, device=generator.device).to(device)


@dataclass(frozen=True)
class Run:
    """What :func:`run_sampler` returns.

    Attributes:
        out: the sampler's result; ``out.samples`` ``(N, C, h, w)`` float32 latents.
        memory: the estimate the run was sized with.
        decode_batch: images per VAE call.
        pad_rows: the padding the run used (``warmup`` fills it in when it was ``None``).
        warmup_seconds: the warm-up's time, 0 without.
    """

    out: SampleResult
    memory: _memory.MemoryEstimate
    decode_batch: int
    pad_rows: Any
    warmup_seconds: float


def sampler_options(*, sigmas: torch.Tensor, **options: Any) -> SamplerOptions:
    """The sampler's options of a family's run, made here for every family: its grid ``sigmas``
    ``(T + 1,)`` and the sampler's options of its ``sample`` (every field of
    :class:`~specforest.options.SamplerOptions` but the grid's: ``churn``, ``chain``, ``tree``,
    ``coupling``, ``draft``, ``prefetch``, ``verify``, ``lazy``, ``pad_rows``, ...).

    Raises:
        ValueError / TypeError: naming the option (a chain that refuses the grid says so).
    """
    return SamplerOptions(sigmas=sigmas, **options)


def run_sampler(
    pipe: Any,
    velocity: Any,
    *,
    options: SamplerOptions,
    latent_shape: tuple,
    device: torch.device,
    cond: dict,
    images: int,
    generator: "torch.Generator | list[torch.Generator] | None",
    progress: bool,
    max_memory_gb: Optional[float],
    output_type: str,
    height: int,
    width: int,
    row_bytes: int,
    cond_bytes: int,
    noise_scale: Optional[float] = None,
    warmup: bool = False,
    noise_from: Optional[Callable[[Any], Callable[[int], torch.Tensor]]] = None,
) -> Run:
    """Size, draw and sample ``images`` images of a family's run (:func:`specforest.sample` on the churned SDE).

    The memory is planned first (:func:`plan_memory`; a run that cannot fit allocates
    nothing). The initial latents are ``N(0, I)`` in float32 from ``generator``, or
    image ``i``'s from ``generator[i]`` (diffusers' convention), scaled by
    ``noise_scale`` when the grid starts below 1; the same generator(s) then seed the
    sampler. ``generator=None``: a fresh CPU generator from the OS's entropy.

    Args:
        pipe: the pipeline (its VAE sizes the decode).
        velocity: the family's velocity ``v(x, sigma, **cond)``.
        options: the sampler's options (:func:`sampler_options`: the grid ``sigmas`` among them);
            the memory plan sets their ``max_rows``.
        latent_shape: ``(C, h, w)`` of one image.
        device: where the states live.
        cond: per-image conditioning, ``(images, ...)`` tensors.
        images: the number of images ``N``.
        generator: a generator, one per image, or ``None``.
        progress: as in :func:`specforest.sample`.
        max_memory_gb, output_type, height, width: as in the family's ``sample``.
        row_bytes: bytes one row adds inside a network call.
        cond_bytes: bytes of one image's conditioning (all branches).
        noise_scale: the initial state's scale (``None``: 1, the grid starts at ``sigma = 1``).
        warmup: call the network at every row count of the run first
            (:func:`specforest.warmup.warm_up`; same images).
        noise_from: ``noise_from(generator) -> noise``: the standard sampler's draws from the
            generator(s) after the latents, as the pipeline's scheduler draws them
            (``chain="scheduler"`` with no tree); the sampler's seed is then not drawn from them.

    Raises:
        ValueError: if a list of generators does not hold one per image.
        MemoryError: as :func:`plan_memory`.
    """
    check_generators(generator, images)
    memory, decode_batch = plan_memory(
        pipe,
        max_memory_gb=max_memory_gb,
        device=device,
        images=images,
        latent_shape=latent_shape,
        height=height,
        width=width,
        output_type=output_type,
        options=options,
        row_bytes=row_bytes,
        cond_bytes=cond_bytes,
    )
    if generator is None:
        generator = torch.Generator(device="cpu")
        generator.seed()
    if isinstance(generator, (list, tuple)):
        # diffusers' convention: image i's latents (and here its sampling noise) from generator[i]
        x_T = torch.cat([_initial_latents((1, *latent_shape), g, device) for g in generator])
    else:
        x_T = _initial_latents((images, *latent_shape), generator, device)
    if noise_scale is not None:
        x_T = x_T * noise_scale
    options = dataclasses.replace(options, max_rows=memory.max_rows)
    warmup_seconds = 0.0
    if warmup:
        # the warm-up takes the options that shape a call (a pipeline passes no model_kwargs)
        shaping = {k: v for k, v in options.as_dict().items() if k not in ("model_kwargs", "pad_rows")}
        options = dataclasses.replace(options, pad_rows=options.pad_rows or pad_rows_for(images, **shaping))
        warmup_seconds = warm_up(velocity, x_T, cond=cond, pad_rows=options.pad_rows, **shaping)
    if noise_from is not None:
        # the generator's next draws are the scheduler's noise: nothing else may read it
        out = _engine_sample(velocity, x_T, options, seed=0, noise=noise_from(generator), progress=progress, cond=cond)
    else:
        out = _engine_sample(velocity, x_T, options, generator=generator, progress=progress, cond=cond)
    return Run(
        out=out, memory=memory, decode_batch=decode_batch, pad_rows=options.pad_rows, warmup_seconds=warmup_seconds
    )
