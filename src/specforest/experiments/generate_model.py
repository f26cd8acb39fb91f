"""What a ``specforest generate`` job samples on this process: the model, its states' shape, per-index
conditioning, how results are kept, and how many slots fit the memory limit (:func:`size_slots`).

Sample ``i``'s conditioning (the pixel job's label, an image job's caption ``i mod n``) is a function of
``(S, i)`` alone, as its initial state and noise are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .. import memory, streams
from ..atomic import atomic_write
from ..options import SamplerOptions
from ..trees import from_parents
from .common import COUPLING_OF, chain_steps, method_tree
from .generate_job import JobSpec, pixel_model_of, prompts_digest, sampler_chain, sampler_further

__all__ = ["JobModel", "gmm_model", "image_model", "pixel_model", "size_slots"]

# labels of the pixel job: a stream of their own, apart from the chain's
_LABEL_TAG = 0x4C4142454C


@dataclass
class JobModel:
    """What a job samples: the velocity, the states' shape, per-index conditioning and how results are kept.

    Attributes:
        velocity: the target, ``v(x, t, **cond)``.
        shape: one state's shape (without the batch dimension).
        sampler: the job's :class:`~specforest.options.SamplerOptions` (grid, tree, coupling, ...).
        make_cond: indices ``(n,)`` -> their conditioning (``None``: unconditional).
        labels_of: indices ``(n,)`` -> their class labels ``(n,)``, kept in the output (pixel).
        save_images: ``(index (n,), latents (n, *shape))`` -> writes one PNG per index (image jobs).
        noise_scale: the initial state is ``noise_scale`` times ``N(0, I)``.
    """

    velocity: Callable
    shape: tuple
    sampler: SamplerOptions
    make_cond: Optional[Callable[[torch.Tensor], dict]] = None
    labels_of: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    save_images: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None
    noise_scale: float = 1.0


def _tree_kwargs(o: dict) -> dict:
    """The tree, coupling and round options of :func:`specforest.generate` for a job's sampler options ``o``,
    with its further options (:func:`~.generate_job.sampler_further`)."""
    method = o["method"]
    # a tuned tree comes as its parent list; otherwise the method's (K, L) tree
    chained = sampler_chain(o)
    if o.get("tree") is not None:
        tree = from_parents(o["tree"])
    else:
        # no deeper than the chain's steps (dpmpp_sde's 2 T - 1 half-steps), not the grid's
        tree = method_tree(method, o["K"], o["L"], chain_steps(chained["chain"], o["steps"]))
    kwargs = dict(tree=tree, coupling=COUPLING_OF.get(method, "grs"), **chained)
    # a standard job records none of the draft's options (it uses none; a job started before recorded the defaults)
    kwargs.update({k: o[k] for k in ("draft", "prefetch", "verify") if o.get(k) is not None})
    return {**kwargs, **sampler_further(o)}


def gmm_model(spec: JobSpec) -> JobModel:
    """The paper's Gaussian mixture of a ``gmm`` job (``model_options``: ``dim``, ``components``, ``mixture_seed``)."""
    from ..models import GaussianMixture

    o, m = spec.sampler, spec.model_options
    # the mixture moves its parameters to the states' device itself
    gmm = GaussianMixture.paper(dim=m["dim"], components=m["components"], seed=m["mixture_seed"])
    return JobModel(gmm, (m["dim"],), SamplerOptions(steps=o["steps"], grid=o["grid"], **_tree_kwargs(o)))


def pixel_model(spec: JobSpec, device: str) -> JobModel:
    """The shipped model of a ``pixel`` job (the digits model, or the one its ``model_options`` name,
    :func:`~.generate_job.pixel_options`); a conditional model's class label of sample ``i`` comes from
    ``(S, i)``.

    Raises:
        ValueError: ``draft='learned'`` with a model that declares no draft network
            (:func:`~specforest.experiments.pixel.models.refuse_undeclared_learned`).
    """
    from .pixel.models import refuse_undeclared_learned

    o, pm = spec.sampler, pixel_model_of(spec.model_options)
    velocity = pm.load(device=device)
    if o.get("draft") is not None:
        refuse_undeclared_learned(velocity, pm, o["draft"])
    sampler = SamplerOptions(steps=o["steps"], grid=o["grid"], **_tree_kwargs(o))
    if not pm.conditional:
        return JobModel(velocity, pm.shape, sampler)

    def labels_of(idx: torch.Tensor) -> torch.Tensor:
        keys = streams.fold(streams.sample_keys(spec.seed, idx.cpu()), _LABEL_TAG)
        return (streams.uniform(keys, 1)[:, 0] * pm.num_classes).long().clamp(max=pm.num_classes - 1)

    return JobModel(
        velocity,
        pm.shape,
        sampler,
        make_cond=lambda idx: {"class_labels": labels_of(idx).to(device)},
        labels_of=labels_of,
    )


def image_model(spec: JobSpec, out: Path, device: str) -> JobModel:
    """Image ``i`` of an image job: caption ``i mod n``, latents and noise from ``(S, i)``, a PNG ``OUT/i.png``.

    The pipeline is taken apart by its family's ``prepare`` (:class:`specforest.diffusers.Prepared`); an
    ``sd3`` job is the sd3 family's, its options under the names ``specforest generate sd3`` gave them.
    """
    from .pipelines import family_options, load_pipeline
    from .sd3.loading import load_prompts

    m, o = spec.model_options, spec.sampler
    if spec.model == "sd3":
        from ..diffusers.prepared import prepare_sd3
        from .sd3.loading import load_pipeline as load_sd3_pipeline

        pipe, prepare = load_sd3_pipeline(m["model"], device=device, dtype=m["dtype"]), prepare_sd3
        options = {k: m[k] for k in ("height", "width", "shift", "max_sequence_length")}
        options["guidance_scale"] = m["guidance"]
    else:
        pipe, family = load_pipeline(m["pipeline"], device=device, dtype=m["dtype"])
        if family.name != m["family"]:
            raise ValueError(f"{m['pipeline']} now holds a {family.name} pipeline, not the job's {m['family']}")
        if m.get("scheduler"):
            from ..diffusers.schedulers import swapped_scheduler

            pipe.scheduler = swapped_scheduler(pipe, m["scheduler"])
        options = family_options(family, "prepare", m["options"])
        prepare = family.prepare
    prompts = load_prompts(m["prompts"], m["num_prompts"])
    if prompts_digest(prompts) != m["prompts_sha256"]:
        raise ValueError(f"the captions in {m['prompts']} changed since the job started")
    parts = prepare(pipe, prompts, num_inference_steps=o["steps"], **options)
    n = len(prompts)

    def make_cond(idx: torch.Tensor) -> dict:
        rows = (idx % n).to(parts.device)
        return {k: v[rows] for k, v in parts.cond.items()}

    def save_images(index: torch.Tensor, latents: torch.Tensor) -> None:
        images = parts.decode(latents)
        for i, im in zip(index.tolist(), images, strict=True):
            atomic_write(out / f"{i:06d}.png", lambda f, im=im: im.save(f, format="PNG"), binary=True)

    kwargs, velocity, sigmas, noise_scale = _tree_kwargs(o), parts.velocity, parts.sigmas, parts.noise_scale
    if kwargs["chain"] == "scheduler":
        # the pipeline's own scheduler (specforest.diffusers.schedulers): its chain on its grid, its clip
        # inside the velocity, the pipeline's latents on the linear path
        from ..diffusers.schedulers import for_pipeline

        plan = for_pipeline(pipe, o["steps"], kwargs.pop("eta"), velocity, sigmas)
        kwargs["chain"], velocity, sigmas, noise_scale = plan.chain, plan.velocity, plan.chain.grid, plan.noise_scale
    return JobModel(
        velocity,
        parts.latent_shape,
        SamplerOptions(sigmas=sigmas, **kwargs),
        make_cond=make_cond,
        save_images=save_images,
        noise_scale=noise_scale,
    )


def size_slots(
    model: JobModel,
    batch: int,
    memory_gb: Optional[float],
    *,
    world: int = 1,
    device: "str | torch.device" = "cpu",
) -> memory.MemoryEstimate:
    """How many of ``batch`` slots fit the memory limit on this process, and the rows per network call.

    The slots are the trajectories of :func:`specforest.memory.estimate` (with per-sample streams
    their number changes no sample); ``world`` processes share each call's rows with
    ``tree_parallel``. The limit bounds this process, what it holds now (the model) counting as fixed.

    Raises:
        MemoryError: if one slot does not fit, with the numbers.
    """
    limit, source, fixed = memory.resolve_limit(memory_gb, device, "--memory-gb")
    idx = torch.zeros(1, dtype=torch.long)
    cond_row = model.make_cond(idx) if model.make_cond is not None else {}
    # (what the job's options decide; generate runs every tree full, whatever lazy says)
    shape = {**memory.run_shape(model.sampler), "lazy": False}
    return memory.estimate(
        trajectories=batch,
        state_numel=math.prod(model.shape),
        **shape,
        model=model.velocity,
        x_row=torch.zeros((1, *model.shape)),
        cond_row=cond_row,
        cond_bytes=sum(v[0].numel() * v.element_size() for v in cond_row.values() if isinstance(v, torch.Tensor)),
        fixed_bytes=fixed,
        limit_bytes=limit,
        limit_source=source,
        device=device,
        world=world,
    )
