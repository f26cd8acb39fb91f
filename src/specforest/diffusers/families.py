"""Which module samples a given diffusers pipeline: one :class:`Family` per pipeline family.

:func:`sample` is the package's one entry point, ``specforest.diffusers.sample(pipe,
prompt, ...)``: it finds the family of ``pipe`` (:func:`family_of`) and calls that
family's ``sample`` with the same arguments. A new family is one entry of
:data:`FAMILIES`: a predicate on the pipeline object, the family module's
``sample``, and the ``model_index.json`` class names it covers (what a command
line reads to pick the family before loading anything,
:func:`family_of_directory`); optionally its tuner and its ``prepare``
(:mod:`~specforest.diffusers.prepared`), which ``specforest tune --model
diffusers`` and ``specforest generate diffusers`` call, and its parts
(:class:`~specforest.diffusers.flow.FamilyParts`: checks, text, velocity and
grid, row bytes, decoding), on which those three are the one flow of
:mod:`~specforest.diffusers.flow`. The command line reads a family's options and
defaults from these functions' signatures, so a new entry needs no change there.

The predicates (:mod:`~specforest.diffusers.detection`) read class names only:
diffusers is not imported.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from . import pipeline_flux, pipeline_sd3, pipeline_sdxl, tuning
from .detection import is_flux, is_sd, is_sd3, is_sdxl
from .flow import FamilyParts
from .prepared import prepare_flux, prepare_sd3, prepare_sdxl

__all__ = [
    "FAMILIES",
    "Family",
    "family_of",
    "family_of_class_name",
    "family_of_directory",
    "is_sd3",
    "pipeline_class_name",
    "sample",
]


@dataclass(frozen=True)
class Family:
    """A pipeline family and the function that samples it.

    Attributes:
        name: short name (``sd3``, ``flux``), as in results' ``config["family"]``.
        pipeline_classes: the diffusers pipeline class names it covers (the
            ``_class_name`` of a ``model_index.json``); the first one names it in errors.
        is_family: ``is_family(pipe) -> bool``, cheap and without importing diffusers.
        sample: ``sample(pipe, prompt, **options)`` of the family's module.
        tune: ``tune(pipe, prompt, **options) -> Tuned``, the family's tuner
            (:mod:`~specforest.diffusers.tuning`); ``None``: not tunable yet.
        prepare: ``prepare(pipe, prompts, **options) -> Prepared``, the parts of a run
            (:mod:`~specforest.diffusers.prepared`) that ``specforest generate`` samples
            index by index; ``None``: not available yet.
        parts: what is the family's own (:class:`~specforest.diffusers.flow.FamilyParts`: its
            checks, text encoding, velocity and grid, row-bytes estimate and decoding), on which
            ``sample``, ``tune`` and ``prepare`` are the flow every family shares; ``None`` for an
            entry whose functions are its own.
    """

    name: str
    pipeline_classes: tuple[str, ...]
    is_family: Callable[[Any], bool]
    sample: Callable[..., Any]
    tune: Optional[Callable[..., Any]] = None
    prepare: Optional[Callable[..., Any]] = None
    parts: Optional[FamilyParts] = None


def _family(name: str, pipeline_class: str, is_family: Callable[[Any], bool], module: Any, **functions: Any) -> Family:
    """An entry whose ``sample`` and parts are those of its family module (on the shared flow)."""
    return Family(name, (pipeline_class,), is_family, module.sample, parts=module.PARTS, **functions)


# The predicates are disjoint (SD3 and Flux key on their transformer class, SDXL and SD on their UNet's added
# embeddings and second text encoder), so the order only sets the order of the names in errors.
FAMILIES: tuple[Family, ...] = (
    _family("sd3", "StableDiffusion3Pipeline", is_sd3, pipeline_sd3, tune=tuning.tune, prepare=prepare_sd3),
    _family("flux", "FluxPipeline", is_flux, pipeline_flux, tune=tuning.tune_flux, prepare=prepare_flux),
    _family("sdxl", "StableDiffusionXLPipeline", is_sdxl, pipeline_sdxl, tune=tuning.tune_sdxl, prepare=prepare_sdxl),
    _family("sd", "StableDiffusionPipeline", is_sd, pipeline_sdxl, tune=tuning.tune_sdxl, prepare=prepare_sdxl),
)


def _supported() -> str:
    return ", ".join(f"{f.pipeline_classes[0]} ({f.name})" for f in FAMILIES)


def family_of(pipe: Any) -> Family:
    """The :class:`Family` of a pipeline object.

    Raises:
        TypeError: naming the supported pipelines, when no family takes ``pipe``.
    """
    for f in FAMILIES:
        if f.is_family(pipe):
            return f
    what = type(pipe).__name__
    if getattr(pipe, "transformer", None) is None and getattr(pipe, "unet", None) is None:
        what += " (it has no transformer or unet)"
    else:
        net = getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)
        what += f" (with a {type(net).__name__})"
    raise TypeError(f"pipe must be a diffusers pipeline of a supported family: {_supported()}; got {what}")


def family_of_class_name(class_name: str) -> Family:
    """The :class:`Family` of a pipeline class name, as ``model_index.json``'s ``_class_name`` gives it.

    Raises:
        ValueError: naming the supported pipelines.
    """
    for f in FAMILIES:
        if class_name in f.pipeline_classes:
            return f
    raise ValueError(f"pipeline class {class_name!r} is not supported; supported: {_supported()}")


def pipeline_class_name(path: "str | os.PathLike[str]") -> str:
    """The ``_class_name`` of a diffusers pipeline directory's ``model_index.json`` (nothing is loaded).

    Raises:
        FileNotFoundError: if ``path`` has no ``model_index.json``.
        ValueError: if the file is not JSON or names no class.
    """
    index = Path(path) / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(
            f"{path} has no model_index.json: not a diffusers pipeline directory (a save_pretrained folder "
            "or a downloaded pipeline repository)"
        )
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{index} is not valid JSON ({e})") from e
    name = data.get("_class_name") if isinstance(data, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"{index} names no pipeline class (its _class_name is {name!r})")
    return name


def family_of_directory(path: "str | os.PathLike[str]") -> Family:
    """The :class:`Family` of a diffusers pipeline directory, from its ``model_index.json``'s
    ``_class_name`` (:func:`pipeline_class_name`), without loading anything.

    Raises:
        FileNotFoundError: if ``path`` has no ``model_index.json``.
        ValueError: if it names no class, or one of no supported family (naming the supported ones).
    """
    name = pipeline_class_name(path)
    try:
        return family_of_class_name(name)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def sample(pipe: Any, prompt: "str | list[str] | None" = None, **options: Any) -> Any:
    """Sample a diffusers pipeline exactly with the speculative sampler of its family.

    Dispatches to the family's ``sample`` (:data:`FAMILIES`): SD3 to
    :func:`specforest.diffusers.pipeline_sd3.sample`, Flux to
    :func:`specforest.diffusers.pipeline_flux.sample`, SDXL and SD 1.5 / 2.x to
    :func:`specforest.diffusers.pipeline_sdxl.sample`, with the same arguments.
    The options common to the families keep their names and meanings
    (``num_inference_steps``, ``guidance_scale``, ``height``, ``width``,
    ``generator``, ``num_images_per_prompt``, ``output_type``, ``max_memory_gb``,
    ``shift``, ``max_sequence_length``, the ``*prompt_embeds``, ``warmup``, and the
    sampler's options); defaults are each pipeline's own (Flux: 28 steps,
    guidance 3.5; SDXL 5.0 and SD 7.5 with ``guidance_scale=None``). Flux adds
    ``true_cfg_scale``; SDXL ``prompt_2`` and its size and crop conditioning. SDXL
    and SD take no ``shift`` or ``max_sequence_length``. Every family takes every
    sampler option (``churn``, ``chain``, ``tree``/``K``/``L``, ``coupling``,
    ``draft``, ``prefetch``, ``verify``, ``lazy``, ``pad_rows``, ``record_deltas``),
    meaning what :class:`~specforest.options.SamplerOptions` documents: the one flow
    of the families (:func:`~specforest.diffusers.flow.sample_family`) makes one of
    them with the family's grid.

    Returns:
        The family's result (:class:`~specforest.diffusers.SD3Result`,
        :class:`~specforest.diffusers.FluxResult`): ``images``, ``latents``
        ``(N, C, h, w)``, ``stats``, ``memory``, ``config``.

    Raises:
        TypeError: for a pipeline of no supported family (naming the supported
            ones), or an option the family does not take (naming the family). A field
            of :class:`~specforest.options.SamplerOptions` the family's ``sample`` has no
            parameter for is passed to the sampler (its further options).
        ValueError / MemoryError / FloatingPointError: as the family's ``sample``.
    """
    from .. import options as sampler_options

    family = family_of(pipe)
    params = inspect.signature(family.sample).parameters
    # (a field of SamplerOptions without a parameter goes to the family's further options, which check it;
    # one that is another family's own parameter, SD3's and Flux's shift, is not this family's)
    others = {k for f in FAMILIES for k in inspect.signature(f.sample).parameters}
    further = set(sampler_options.SamplerOptions.names()) - others
    unknown = sorted(k for k in options if k not in params and k not in further)
    if unknown:
        raise TypeError(
            f"{', '.join(unknown)}: not an option of the {family.name} family's sample "
            f"({family.sample.__module__}.sample)"
        )
    return family.sample(pipe, prompt, **options)
