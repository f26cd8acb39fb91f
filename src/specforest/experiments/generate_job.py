"""A ``specforest generate`` job: what it samples (:class:`JobSpec`) and the model options it records.

Everything here is what identifies a job's samples, and so what ``--resume`` compares with the
options on disk: the model, the count ``M``, the seed ``S``, the sampler's options and the
model's (for an image job, the captions' digest among them, so changed captions are refused).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from .. import memory
from ..generation import MAX_COUNT
from .common import METHODS, chain_of_record, check_choice, check_int
from .further_options import further_options, options_of_record

if TYPE_CHECKING:
    from .pixel.models import PixelModel

__all__ = [
    "IMAGE_MODELS",
    "JOB_SAMPLER_KEYS",
    "MERGE_ROW_BYTES",
    "MODELS",
    "JobSpec",
    "count_limit",
    "diffusers_options",
    "job_model_name",
    "pixel_model_of",
    "pixel_options",
    "prompts_digest",
    "sampler_chain",
    "sampler_further",
    "sd3_options",
]

MODELS = ("gmm", "pixel", "sd3", "diffusers")
"""Models ``specforest generate`` samples (``sd3``: a local ``StableDiffusion3Pipeline`` and a captions file;
``diffusers``: a local pipeline of any family of :data:`specforest.diffusers.FAMILIES` and a captions file)."""

IMAGE_MODELS = ("sd3", "diffusers")
"""The models whose output is a folder of PNGs, one per index."""

MERGE_ROW_BYTES = 1024
"""Host bytes the merge holds per sample besides its state: the sample's record (its index, NFE
and label as NumPy scalars, in a dict keyed by its index) and its NFE in the list and in the JSON
(about 700 bytes measured with CPython 3.11 and NumPy 2)."""

JOB_SAMPLER_KEYS = (
    "method",
    "K",
    "L",
    "steps",
    "grid",
    "prefetch",
    "verify",
    "draft",
    "churn",
    "chain",
    "chain_params",
    "tree",
)
"""The sampler options every job records (:attr:`JobSpec.sampler`); any other key is a further option's."""


@dataclass(frozen=True)
class JobSpec:
    """A generation job: what to sample and how.

    Attributes:
        model: one of :data:`MODELS`.
        count: samples ``M >= 1``.
        seed: the job's seed ``S >= 0``.
        sampler: sampler options (``method``, ``K``, ``L``, ``steps``, ``churn``,
            ``grid``, ``prefetch``, ``verify``, ``draft``; ``chain``, the chain's name, and
            ``chain_params``, its parameters (a job without them runs the ``em`` chain at ``churn``,
            and ``churn`` is ``None`` with another chain); ``tree``, a parent list, for a
            tree given as it is, e.g. a tuned one); and further options of :func:`specforest.sample`
            under their record keys (``declared_options()[name].key``; :func:`sampler_further`), passed
            to every run: a job without one ran at the option's default, and one given at its default is
            best left out, so that such a job resumes as it was.
        model_options: the model's options (``gmm``: ``dim``, ``components``, ``mixture_seed``; ``pixel``:
            :func:`pixel_options`; ``sd3``: :func:`sd3_options`; ``diffusers``: :func:`diffusers_options`).
    """

    model: str
    count: int
    seed: int
    sampler: dict
    model_options: dict

    def __post_init__(self) -> None:
        check_choice("model", self.model, MODELS)
        check_int("count", self.count, 1, MAX_COUNT)
        check_int("seed", self.seed, 0)
        check_choice("method", self.sampler.get("method"), METHODS)
        if self.model == "pixel":
            pixel_model_of(self.model_options)
        sampler_chain(self.sampler)  # the chain and its parameters, checked before anything is loaded
        sampler_further(self.sampler)

    def options(self) -> dict:
        """What identifies the job's samples (``--batch`` and the process count do not)."""
        return {
            "model": self.model,
            "count": self.count,
            "seed": self.seed,
            "sampler": dict(self.sampler),
            "model_options": dict(self.model_options),
        }


def sampler_further(sampler: dict) -> dict:
    """The further options of :func:`specforest.sample` a job's sampler options hold, by name: its keys beside
    :data:`JOB_SAMPLER_KEYS`, each an option's record key (a job started before they existed has none).

    Raises:
        ValueError / TypeError: a key that is no option's, an option the job sets itself (``coupling``,
            ``sigmas``, ``max_rows``, ...), or a value JSON does not hold, naming it.
    """
    return further_options(options_of_record(sampler, JOB_SAMPLER_KEYS), by="a generate job")


def sampler_chain(sampler: dict) -> dict:
    """:func:`specforest.sample`'s options ``churn`` and ``chain`` of a job's sampler options: the ``em``
    chain at ``churn`` (a job without ``chain``: one started before chains were recorded), or the chain
    ``chain`` with ``chain_params``.

    Raises:
        ValueError / TypeError: an unknown chain, a parameter it lacks or refuses, or a churn given
            with another chain, naming it.
    """
    name = sampler.get("chain", "em")
    if name == "em":
        return {"churn": sampler.get("churn"), "chain": "em"}
    if name == "scheduler":
        # the pipeline's own scheduler: its chain is made when the pipeline is loaded (generate_model)
        # (eta null: a scheduler whose step takes none, run at 0)
        return {
            "churn": None,
            "chain": "scheduler",
            "eta": float((sampler.get("chain_params") or {}).get("eta") or 0.0),
        }
    chain = chain_of_record(name, sampler.get("chain_params"))
    if sampler.get("churn") is not None:
        raise ValueError(
            f"churn is the em chain's parameter; chain {chain.name!r} takes {', '.join(chain.params)}; leave it null"
        )
    return {"churn": None, "chain": chain}


def count_limit(
    model: str, model_options: dict, *, memory_gb: Optional[float] = None, device: "str | torch.device" = "cpu"
) -> "tuple[int, str]":
    """The largest count ``M`` a job can hold, and why, for an error message.

    The merge at the end (:func:`specforest.experiments.generate.merge`) reads every shard and
    stacks the samples on the host: each sample's state twice in float32 (an image job keeps its
    PNGs on disk, none) and :data:`MERGE_ROW_BYTES`. That must fit the memory limit: ``memory_gb``
    for a job on the CPU, else :func:`specforest.memory.default_memory_limit` of the host. No count
    exceeds the int64 sample indices (:data:`specforest.generation.MAX_COUNT`).

    Args:
        model: one of :data:`MODELS`.
        model_options: the model's options (``gmm``: its ``dim``).
        memory_gb: the job's memory limit in GB (``None``: the default).
        device: where the job samples.

    Returns:
        ``(limit, reason)``: ``M <= limit`` fits; ``reason`` says what bounds it.

    Raises:
        ValueError / TypeError: naming ``model`` or ``dim``.
    """
    check_choice("model", model, MODELS)
    numel = 0
    if model == "gmm":
        numel = check_int("dim", model_options.get("dim"), 1)
    elif model == "pixel":
        numel = math.prod(pixel_model_of(model_options).shape)
    per_sample = MERGE_ROW_BYTES + 2 * 4 * numel
    on_host = memory_gb if torch.device(device).type == "cpu" else None
    limit, source, _ = memory.resolve_limit(on_host, "cpu", "memory_gb")
    reason = (
        f"the merge at the end holds every sample in host memory, about {per_sample:,} bytes each, within "
        f"{limit / 1e9:.3g} GB ({source})"
    )
    return min(MAX_COUNT, limit // per_sample), reason


def pixel_options(model: Optional[str] = None) -> dict:
    """The ``model_options`` of a ``pixel`` job sampling ``model``
    (:data:`~specforest.experiments.pixel.models.PIXEL_MODELS`; ``None``: the digits model):
    ``{"model": model}``, and none for the digits model, so that a digits job records what one made
    before ``--model`` existed, and resumes it.

    Raises:
        ValueError / TypeError: naming ``model`` and the accepted names.
    """
    from .pixel.models import DEFAULT_MODEL, pixel_model

    name = pixel_model(DEFAULT_MODEL if model is None else model).name
    return {} if name == DEFAULT_MODEL else {"model": name}


def pixel_model_of(model_options: dict) -> "PixelModel":
    """The :class:`~specforest.experiments.pixel.models.PixelModel` a ``pixel`` job's ``model_options`` name
    (the digits model where they name none).

    Raises:
        ValueError / TypeError: an unknown model, or another key, naming it.
    """
    from .pixel.models import DEFAULT_MODEL, pixel_model

    other = sorted(str(k) for k in model_options if k != "model")
    if other:
        raise ValueError(f"a pixel job's model_options hold only 'model', got {', '.join(other)}")
    return pixel_model(model_options.get("model", DEFAULT_MODEL))


def job_model_name(options: dict) -> str:
    """What a job's options (:meth:`JobSpec.options`, or those on disk) sample, as the command line names
    it: ``gmm``, a pixel job's model (``digits``, ``natural32``, ...), ``sd3`` or ``diffusers``; what a
    ``--resume`` with another model is refused naming."""
    model = options.get("model")
    if model == "pixel":
        from .pixel.models import DEFAULT_MODEL

        return str((options.get("model_options") or {}).get("model", DEFAULT_MODEL))
    return str(model)


def prompts_digest(prompts: list) -> str:
    """The SHA-256 of the captions, one a line: what a resumed image job checks its captions against."""
    import hashlib

    return hashlib.sha256("\n".join(prompts).encode("utf-8")).hexdigest()


def sd3_options(
    model: str,
    prompts: str,
    *,
    num_prompts: Optional[int],
    dtype: str,
    guidance: float,
    height: int,
    width: int,
    shift: float,
    max_sequence_length: int,
) -> dict:
    """The ``model_options`` of an SD3 job, with a digest of its captions (a resumed job checks it)."""
    from .sd3.loading import load_prompts

    caps = load_prompts(prompts, num_prompts)
    return {
        "model": str(Path(model).resolve()),
        "prompts": str(Path(prompts).resolve()),
        "num_prompts": num_prompts,
        "prompts_sha256": prompts_digest(caps),
        "dtype": dtype,
        "guidance": float(guidance),
        "height": height,
        "width": width,
        "shift": float(shift),
        "max_sequence_length": max_sequence_length,
    }


def diffusers_options(
    pipeline: str,
    prompts: str,
    *,
    num_prompts: Optional[int],
    dtype: str,
    options: dict,
    scheduler: Optional[str] = None,
) -> dict:
    """The ``model_options`` of a diffusers job: the pipeline directory and its family (read from its
    ``model_index.json``, nothing loaded), the captions with their digest (a resumed job checks it), the
    dtype, and the family's ``prepare`` options with its defaults filled in (a resumed job gets the
    same run even if a default changes).

    Args:
        pipeline: a local diffusers pipeline directory.
        prompts: the captions file.
        num_prompts: keep the first ``N`` captions (``None``: all).
        dtype: the models' dtype.
        options: the family's options by their library names (``guidance_scale``, ``height``, ...; ``None``:
            the family's default); ``num_inference_steps`` is the sampler's ``steps``, not one of them.
        scheduler: a diffusers scheduler class name swapped in from the pipeline's scheduler config
            (``None``: the pipeline's own; a job without the key is one).

    Raises:
        FileNotFoundError / ValueError: as :func:`specforest.diffusers.family_of_directory`; ValueError
            naming an option the family does not take.
        NotImplementedError: for a family without ``prepare``.
    """
    from ..diffusers.families import family_of_directory
    from ..diffusers.schedulers import scheduler_class
    from .pipelines import DTYPES, family_options
    from .sd3.loading import load_prompts

    check_choice("dtype", dtype, tuple(DTYPES))
    family = family_of_directory(pipeline)
    if "num_inference_steps" in options:
        raise ValueError("num_inference_steps is the sampler's steps, not a model option")
    resolved = family_options(family, "prepare", options)
    caps = load_prompts(prompts, num_prompts)
    return {
        "pipeline": str(Path(pipeline).resolve()),
        "family": family.name,
        "prompts": str(Path(prompts).resolve()),
        "num_prompts": num_prompts,
        "prompts_sha256": prompts_digest(caps),
        "dtype": dtype,
        "options": resolved,
        # (only when swapped: a job without the key, one started before, is the pipeline's own)
        **({"scheduler": scheduler_class(scheduler).__name__} if scheduler is not None else {}),
    }
