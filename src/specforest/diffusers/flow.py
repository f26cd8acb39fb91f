"""One flow for every family: a pipeline's ``sample``, ``prepare`` and tuner, written once.

A family (:class:`FamilyParts`) is what is its own: its pipeline checks, its text inputs and
their encoding, its velocity and grid (the :class:`Prepared` parts of a run), its row-bytes
estimate and its decoding. Everything around them is here, once, for every family:

* :func:`prepare_family`: captions to :class:`Prepared`, one row of conditioning per caption
  (``specforest generate diffusers`` samples index by index from it);
* :func:`sample_family`: a family's ``sample``: the checks before any work, the prepared parts
  with one row per image, one :class:`~specforest.options.SamplerOptions` on the family's grid
  (every sampler option: ``chain``, ``pad_rows``, ``record_deltas``, ...), the run
  (:func:`~specforest.diffusers.run.run_sampler`: memory plan, latents, ``warmup``), the
  decoding and the record;
* :func:`tune_family`: a family's tuner: :func:`specforest.latency.tune` on the prepared parts
  and the family's grid, calls split as the memory limit needs.

The family modules' public functions (``pipeline_sd3.sample``, ``prepared.prepare_flux``,
``tuning.tune_sdxl``, ...) keep their signatures and documentation and call these.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .. import memory as _memory
from .. import streams
from ..drafts import get_proposal
from ..latency import tune as latency_tune
from ..options import check_names, check_tuned_for, declared_options, make_sde
from ..planning import make_tree
from ..trees import chain as chain_tree
from ..validation import check_int, check_number
from .checks import check_run_options
from .run import run_sampler, sampler_options
from .schedulers import SchedulerChain, check_scheduler, for_pipeline, scheduler_eta

__all__ = [
    "DEFAULT_CHURN",
    "FamilyParts",
    "Prepared",
    "SAMPLER_INPUTS",
    "captions",
    "negatives",
    "prepare_family",
    "run_churn",
    "sample_family",
    "tune_family",
]

DEFAULT_CHURN = 0.8
"""The ``churn`` of every family's ``sample`` and tuner (the ``em`` chain's ``eps``)."""


@dataclass(frozen=True)
class Prepared:
    """What sampling a family's pipeline needs, for ``n`` captions.

    Attributes:
        velocity: ``v(x, sigma, **cond)`` on the linear path, the library's model contract.
        sigmas: ``(T + 1,)`` float64 grid, from the first level to 0.
        latent_shape: ``(C, h, w)`` of one image's state.
        device: where the velocity takes its states.
        cond: per-caption conditioning, ``(n, ...)`` tensors (row ``j``: caption ``j``).
        decode: ``decode(latents (N, C, h, w)) -> list of N PIL images``, as the pipeline decodes.
        noise_scale: the initial state is ``noise_scale x N(0, I)`` (1 for flow matching, where the
            grid starts at ``sigma = 1``; for a VP UNet, whose grid starts at ``t_0 < 1``, the
            scheduler's initial noise on the linear path, ``init_noise_sigma / (1 + s_0)``).
        config: the resolved options (image size, guidance, ...), for the record.
    """

    velocity: Any
    sigmas: torch.Tensor
    latent_shape: tuple
    device: torch.device
    cond: dict
    decode: Callable[[torch.Tensor], list]
    noise_scale: float = 1.0
    config: dict = field(default_factory=dict)


@dataclass(frozen=True)
class FamilyParts:
    """A family's own part of the flow: what :func:`sample_family`, :func:`prepare_family` and
    :func:`tune_family` call.

    Attributes:
        network: ``transformer`` or ``unet``: the record's ``config[f"{network}_dtype"]``.
        result: the record type its ``sample`` returns (a :class:`~specforest.diffusers.SD3Result`).
        text_inputs: the text inputs of its ``sample`` besides ``prompt`` (``negative_prompt``,
            ``prompt_embeds``, ...).
        check_pipeline: ``check_pipeline(pipe)``: the pipeline has what the family needs.
        check_inputs: ``check_inputs(pipe, text, options) -> (text, n, options)``: the text inputs
            (``prompt`` and ``text_inputs``, absent ones ``None``) and the family options
            (``guidance_scale``, ``height``, ...) checked, ``n`` the number of captions.
        take_apart: ``take_apart(pipe, text, steps, options) -> Prepared`` of checked inputs: the
            velocity, the grid, one row of conditioning per caption, the decoder, and the record
            (``family``, ``height`` and ``width`` among it: the run's memory plan reads the size).
        sigmas: ``sigmas(pipe, steps, prepared) -> (steps + 1,)``: its grid of another number of
            steps, for the same run otherwise (the tuner's timing runs).
        row_bytes: ``row_bytes(pipe, velocity, latent_shape, cond) -> int``: what one state adds
            inside a network call, with the per-caption conditioning ``cond``.
        decode: ``decode(pipe, latents, output_type, batch) -> (images, record)``: the images as the
            pipeline returns them, ``batch`` per VAE call, and what the record adds (SD's
            ``nsfw_content_detected``).
    """

    network: str
    result: type
    text_inputs: tuple[str, ...]
    check_pipeline: Callable[[Any], None]
    check_inputs: Callable[[Any, dict, dict], "tuple[dict, int, dict]"]
    take_apart: Callable[[Any, dict, int, dict], Prepared]
    sigmas: Callable[[Any, int, Prepared], torch.Tensor]
    row_bytes: Callable[[Any, Any, tuple, dict], int]
    decode: Callable[[Any, torch.Tensor, str, Optional[int]], "tuple[Any, dict]"]


def captions(prompts: "str | Sequence[str]", n: Optional[int] = None, name: str = "prompts") -> list[str]:
    """``prompts`` as a list of captions (``n``: repeated to ``n``).

    Raises:
        TypeError: naming ``name``, if it is neither a caption nor a non-empty list of them.
    """
    given = [prompts] if isinstance(prompts, str) else list(prompts)
    if not given or not all(isinstance(p, str) for p in given):
        raise TypeError(f"{name} must be a caption or a non-empty list of captions")
    return given if n is None else [given[i % len(given)] for i in range(n)]


def negatives(negative_prompt: Optional[str], n: int) -> Optional[list]:
    """One negative caption for each of ``n`` captions, or ``None`` (the pipeline's)."""
    if negative_prompt is None:
        return None
    if not isinstance(negative_prompt, str):
        raise TypeError(f"negative_prompt must be a str or None, got {type(negative_prompt).__name__}")
    return [negative_prompt] * n


def run_churn(churn: Any, chain: Any) -> Any:
    """The ``churn`` a run gives the sampler: as given with the ``em`` chain (the default); with another
    chain (an :class:`~specforest.chains.EM` object included, which carries its own) ``None`` where it is
    :data:`DEFAULT_CHURN` or ``None``, else as given, for :class:`~specforest.options.SamplerOptions`
    to refuse naming the chain and its parameters."""
    if isinstance(chain, str) and chain.lower() == "em":
        return churn
    return None if churn is None or (isinstance(churn, float) and churn == DEFAULT_CHURN) else churn


_SET_BY_FAMILY = {
    "steps": "num_inference_steps",
    "grid": "the scheduler's grid",
    "sigmas": "the scheduler's grid",
    "shift": "the scheduler's grid (SD3's and Flux's shift parameter)",
    "max_rows": "from max_memory_gb",
    "model_kwargs": "the captions' conditioning",
    **{name: "the scheduler's grid" for name, decl in declared_options().items() if decl.grid},
}
"""The sampler's options a family's run sets itself, with what sets them (an option declared as making the
grid, ``Option.grid``, among them)."""


def further_options(options: dict) -> dict:
    """The sampler's options a family's ``sample`` takes beyond its parameters (``**options``): fields of
    :class:`~specforest.options.SamplerOptions`, passed to it as they are (a new field reaches every family).

    Raises:
        TypeError: naming a keyword that is not an option (listing the options).
        ValueError: naming an option the family's run sets itself, and what sets it.
    """
    check_names(options)
    set_here = [k for k in options if k in _SET_BY_FAMILY]
    if set_here:
        raise ValueError(
            "; ".join(f"{k} is set by the pipeline's run ({_SET_BY_FAMILY[k]})" for k in set_here)
            + ": give those through the sample function's own parameters"
        )
    return dict(options)


def follows_scheduler(pipe: Any, chain: Any, eta: Any, steps: Optional[int] = None) -> "tuple[bool, float]":
    """``(scheduled, eta)``: whether ``chain`` is ``"scheduler"`` (the pipeline's own scheduler's chain),
    its scheduler checked, and ``eta`` checked (>= 0; the scheduler's step argument, so 0 with another chain
    and with a scheduler whose step takes none; with ``steps``, no step's variance negative).

    Raises:
        ValueError: a scheduler ``chain="scheduler"`` does not follow, or ``eta`` out of range or given
            with another chain or a scheduler that does not read it, naming it.
    """
    eta = check_number("eta", eta, 0.0)
    scheduled = isinstance(chain, str) and chain.lower() == "scheduler"
    if eta != 0.0 and not scheduled:
        raise ValueError(
            f"eta={eta} is the scheduler's step argument (DDIM, TCD): it applies with chain='scheduler'; "
            "another chain takes its own (specforest.chains.get_chain(name, eta=...))"
        )
    if scheduled:
        check_scheduler(pipe.scheduler, eta, steps)
    return scheduled, eta


def prepare_family(
    parts: FamilyParts,
    pipe: Any,
    prompts: "str | Sequence[str]",
    *,
    num_inference_steps: int,
    negative_prompt: Optional[str] = None,
    **options: Any,
) -> Prepared:
    """A family's ``prepare``: the :class:`Prepared` parts of a run for the captions ``prompts``.

    Args:
        parts: the family.
        pipe: its pipeline.
        prompts: ``n`` captions.
        num_inference_steps: grid steps ``T >= 1``.
        negative_prompt: the unconditional branch's caption for every image (``None``: the pipeline's).
        options: the family options (``guidance_scale``, ``height``, ...).

    Raises:
        ValueError / TypeError: naming the parameter.
    """
    prompts = captions(prompts)
    parts.check_pipeline(pipe)
    steps = check_int("num_inference_steps", num_inference_steps, 1)
    text = {"prompt": prompts, "negative_prompt": negatives(negative_prompt, len(prompts))}
    text, _, options = parts.check_inputs(pipe, text, options)
    return parts.take_apart(pipe, text, steps, options)


SAMPLER_INPUTS = ("coupling", "draft", "prefetch", "verify", "lazy", "record_deltas", "pad_rows")
"""The sampler's options a family's ``sample`` passes to :class:`~specforest.options.SamplerOptions` as
they are (beside ``churn``, ``chain`` and the tree that ``tree``/``K``/``L`` make)."""


def sample_family(
    parts: FamilyParts,
    pipe: Any,
    prompt: "str | list[str] | None",
    *,
    num_inference_steps: int,
    generator: "torch.Generator | list[torch.Generator] | None",
    num_images_per_prompt: int,
    output_type: str,
    progress: bool,
    max_memory_gb: Optional[float],
    tuned_for: Any,
    warmup: bool,
    churn: "float | None",
    chain: Any,
    tree: Any,
    K: Optional[int],
    L: Optional[int],
    **inputs: Any,
) -> Any:
    """A family's ``sample``: images of ``pipe`` sampled exactly with :func:`specforest.sample`.

    The arguments are those of the family's ``sample``, which passes every one of its parameters
    (:func:`~specforest.diffusers.pipeline_sd3.sample` documents them; their defaults are the family's);
    ``inputs`` holds the sampler's options of :data:`SAMPLER_INPUTS`, the text inputs
    (``parts.text_inputs``) and the family options. The sampler's options, ``churn``, ``chain`` and the
    tree make one :class:`~specforest.options.SamplerOptions` on the family's grid; ``churn`` at its
    default (or ``None``) is left out with another chain than ``em`` (:func:`run_churn`).

    Returns:
        ``parts.result``: ``images``, ``latents`` ``(N, C, h, w)``, ``stats``, ``memory``, ``config``
        (the sampler's record, the family's and the run's), ``warmup_seconds``.

    Raises:
        ValueError / TypeError: naming the parameter. MemoryError: if the run cannot fit the memory
        limit (nothing is allocated for sampling then). FloatingPointError: if the network returns NaN or inf.
    """
    parts.check_pipeline(pipe)
    sampler = {k: inputs.pop(k) for k in SAMPLER_INPUTS}
    sampler.update(further_options(inputs.pop("options", None) or {}))
    eta = inputs.pop("eta", 0.0)
    churn = run_churn(churn, chain)
    steps, churn, n_img, max_memory_gb = check_run_options(
        num_inference_steps=num_inference_steps,
        churn=churn,
        num_images_per_prompt=num_images_per_prompt,
        output_type=output_type,
        verify=sampler["verify"],
        lazy=sampler["lazy"],
        generator=generator,
        max_memory_gb=max_memory_gb,
    )
    scheduled, eta = follows_scheduler(pipe, chain, eta, steps)
    text = {"prompt": prompt, **{k: inputs.pop(k, None) for k in parts.text_inputs}}
    text, n, options = parts.check_inputs(pipe, text, inputs)
    images = n * n_img
    # (the scheduler's chain by what a tuned configuration records of it: its class and eta)
    name = type(pipe.scheduler).__name__
    ran = SchedulerChain(scheduler=name, eta=scheduler_eta(name, eta)) if scheduled else chain
    check_tuned_for(tuned_for, steps=steps, sigmas=None, churn=churn, batch=images, batch_name="images", chain=ran)
    tree = make_tree(K, L, coupling=sampler["coupling"], tree=tree, steps=steps)
    prepared = parts.take_apart(pipe, text, steps, options)
    velocity, latent_shape = prepared.velocity, prepared.latent_shape
    sigmas, noise_scale, noise_from = prepared.sigmas, prepared.noise_scale, None
    if scheduled:
        # the pipeline's own scheduler, as its step computes it (specforest.diffusers.schedulers)
        plan = for_pipeline(pipe, steps, eta, velocity, prepared.sigmas)
        chain, sigmas, velocity, noise_scale = plan.chain, plan.chain.grid, plan.velocity, plan.noise_scale
        if tree is None:
            shape = (images, *latent_shape)
            layout = None
            if prepared.config.get("family") == "flux":
                # Flux's scheduler draws its noise in the packed layout of the pipeline's latents
                h, w = prepared.config["height"], prepared.config["width"]
                packed = pipe._pack_latents(torch.zeros(shape), *shape).shape
                layout = (packed, lambda z: pipe._unpack_latents(z, h, w, pipe.vae_scale_factor))
            noise_from = lambda g: plan.noise_from(g, shape, prepared.device, velocity.dtype, layout)  # noqa: E731
    # each caption's rows repeated consecutively, as diffusers repeats them
    cond = {k: v.repeat_interleave(n_img, dim=0) for k, v in prepared.cond.items()}
    run = run_sampler(
        pipe,
        velocity,
        options=sampler_options(sigmas=sigmas, churn=churn, chain=chain, tree=tree, **sampler),
        latent_shape=latent_shape,
        device=prepared.device,
        cond=cond,
        images=images,
        generator=generator,
        progress=progress,
        max_memory_gb=max_memory_gb,
        output_type=output_type,
        height=prepared.config["height"],
        width=prepared.config["width"],
        row_bytes=parts.row_bytes(pipe, velocity, latent_shape, prepared.cond),
        cond_bytes=sum(v[0].numel() * v.element_size() for v in cond.values()),
        noise_scale=None if noise_scale == 1.0 else noise_scale,
        warmup=warmup,
        noise_from=noise_from,
    )
    latents = run.out.samples
    if output_type == "latent":
        out_images, record = latents.to(velocity.dtype), {}
    else:
        out_images, record = parts.decode(pipe, latents, output_type, run.decode_batch)
    config = {
        **run.out.config,
        **prepared.config,
        "num_images": images,
        "num_images_per_prompt": n_img,
        "K": K,
        "L": L,
        "lazy": sampler["lazy"],
        "max_rows": run.memory.max_rows,
        "pad_rows": run.pad_rows,
        "decode_batch": run.decode_batch,
        f"{parts.network}_dtype": str(velocity.dtype).replace("torch.", ""),
        "device": str(prepared.device),
        **record,
    }
    return parts.result(
        images=out_images,
        latents=latents,
        stats=run.out.stats,
        memory=run.memory,
        config=config,
        warmup_seconds=run.warmup_seconds,
    )


_SET_HERE = {
    "steps": "num_inference_steps",
    "cond": "the captions' embeddings",
    "grid": "the scheduler's grid, with shift",
    "sigmas": "the scheduler's grid, with shift",
    "max_rows": "from max_memory_gb",
}


def tune_family(
    parts: FamilyParts,
    pipe: Any,
    prompt: "str | Sequence[str]",
    *,
    num_inference_steps: int,
    churn: "float | None",
    batch: int,
    budget_max: int,
    drafts: Sequence[str],
    calibration_images: int,
    max_memory_gb: Optional[float],
    seed: int,
    progress: bool,
    options: dict,
    negative_prompt: Optional[str] = None,
    eta: float = 0.0,
    **family_options: Any,
) -> Any:
    """A family's tuner: :func:`specforest.latency.tune` on the pipeline's network, its grid and the
    captions' conditioning (:func:`prepare_family`), from the run's initial noise.

    The arguments are those of the family's tuner, which passes every one of its parameters
    (:func:`~specforest.diffusers.tuning.tune` documents them; their defaults are the family's);
    ``family_options`` are its family options (``guidance_scale``, ``height``, ...), ``options``
    the sampler's options for :func:`specforest.latency.tune` (``chain``, ``verify``, ``prefetch``,
    ``pad_rows``, ...; refused: those set here, ``steps``, ``cond``, ``grid``, ``sigmas``, ``max_rows``).
    The shorter timing runs use the family's grid of their own number of steps. ``chain="scheduler"``
    (with ``eta``) tunes for the pipeline's own scheduler, as :func:`sample_family` runs it: its chain,
    its clip inside the velocity, its initial noise; the timing runs take its chain at their own step
    count (:meth:`~specforest.diffusers.schedulers.SchedulerChain.for_steps`).

    Returns:
        A :class:`~specforest.latency.Tuned`; the family's ``sample(pipe, ..., **tuned)`` runs it and
        checks the run's steps, churn and images against it.

    Raises:
        ValueError / TypeError: naming the parameter.
    """
    options = dict(options)
    set_here = [k for k in options if k in _SET_HERE]
    if set_here:
        raise ValueError(
            "; ".join(f"{k} is set by this function ({_SET_HERE[k]})" for k in set_here)
            + ": give those through the tuner's own parameters"
        )
    parts.check_pipeline(pipe)
    captions(prompt, name="prompt")  # a bad prompt is named before any work
    batch = check_int("batch", batch, 1)
    calibration_images = check_int("calibration_images", calibration_images, 1)
    steps = check_int("num_inference_steps", num_inference_steps, 1)
    scheduled, eta = follows_scheduler(pipe, options.get("chain", "em"), eta, steps)
    churn = run_churn(churn, options.get("chain", "em"))
    if churn is not None:
        churn = check_number("churn", churn, 0.0, 1.0, lo_open=True)
    if max_memory_gb is not None:
        max_memory_gb = check_number("max_memory_gb", max_memory_gb, 0.0, lo_open=True)
    n = max(batch, calibration_images)
    prepared = prepare_family(
        parts,
        pipe,
        captions(prompt, n, name="prompt"),
        num_inference_steps=num_inference_steps,
        negative_prompt=negative_prompt,
        **family_options,
    )
    velocity, noise_scale, sigmas = prepared.velocity, prepared.noise_scale, prepared.sigmas
    sigmas_for = lambda k: parts.sigmas(pipe, k, prepared)  # noqa: E731
    if scheduled:
        # the pipeline's own scheduler, as sample_family runs it; each timing run on its chain of that many steps
        plan = for_pipeline(pipe, num_inference_steps, eta, velocity, sigmas, grid_for=sigmas_for)
        velocity, noise_scale, sigmas = plan.velocity, plan.noise_scale, plan.chain.grid
        options["chain"] = plan.chain
        sigmas_for = lambda k: plan.chain.for_steps(k).grid  # noqa: E731
    x = streams.randn(seed, torch.arange(n), prepared.latent_shape, device=prepared.device)
    if noise_scale != 1.0:
        x = noise_scale * x  # the run's initial states: the scheduler's initial noise
    steps = len(sigmas) - 1
    cond = prepared.cond
    limit, source, fixed = _memory.resolve_limit(max_memory_gb, x.device, "max_memory_gb")
    # the largest run the tuner times is the batch on a tree of budget_max (any tree of that budget
    # holds as many nodes and rows); calls above the memory model's max_rows are split
    sized = _memory.estimate(
        trajectories=batch,
        state_numel=math.prod(prepared.latent_shape),
        tree=chain_tree(budget_max),
        verify="drafted",
        draft=_memory_draft(drafts),
        steps=steps,
        row_bytes=parts.row_bytes(pipe, velocity, prepared.latent_shape, cond),
        cond_bytes=sum(v[0].numel() * v.element_size() for v in cond.values()),
        fixed_bytes=fixed,
        limit_bytes=limit,
        limit_source=source,
        device=x.device,
        chunked=False,
        **_memory.chain_shape(make_sde(None, sigmas, "flow_match", 1.0, churn, options.get("chain", "em"))),
    )
    return latency_tune(
        velocity,
        x,
        steps=steps,
        churn=churn,
        cond=cond,
        batch=batch,
        budget_max=budget_max,
        drafts=drafts,
        calibration_trajectories=calibration_images,
        seed=seed,
        progress=progress,
        sigmas_for=sigmas_for,
        max_rows=sized.max_rows or sized.rows_per_call,
        **options,
    )


def _memory_draft(drafts: Sequence[str]) -> Optional[str]:
    """The draft the memory is sized for: the calibration chains of a draft that remembers run full
    (the one keeping most)."""
    return max(
        (d for d in drafts if get_proposal(d).uses_memory),
        key=lambda d: get_proposal(d).uses_states,
        default=None,
    )
