"""Loading a local diffusers pipeline of any supported family, and the options a family takes.

:func:`load_pipeline` reads the directory's ``model_index.json`` first
(:func:`specforest.diffusers.family_of_directory`), so an unsupported or
missing pipeline is refused before anything is loaded, then loads the named
diffusers class offline. :func:`family_options` checks a command's family
options against the signature of the family function that will take them and
fills in that function's defaults: the command line holds no per-family table.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any

from ..diffusers.families import Family, family_of_directory, pipeline_class_name
from .common import check_choice
from .sd3.loading import DTYPES

__all__ = ["DTYPES", "family_options", "load_pipeline", "signature_defaults"]


def load_pipeline(
    path: "str | os.PathLike[str]", *, device: str = "cuda", dtype: str = "float16"
) -> "tuple[Any, Family]":
    """The pipeline saved at ``path`` (its ``model_index.json``'s class, ``from_pretrained(path,
    local_files_only=True)`` in ``dtype``) on ``device``, and its :class:`~specforest.diffusers.families.Family`.

    Raises:
        FileNotFoundError: if ``path`` has no ``model_index.json``.
        ValueError: on an unknown dtype, or a class of no supported family (naming the supported ones).
        ImportError: without diffusers (``pip install 'specforest[diffusers]'``).
    """
    check_choice("dtype", dtype, tuple(DTYPES))
    family = family_of_directory(path)
    class_name = pipeline_class_name(path)
    try:
        import diffusers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("diffusers pipelines need diffusers: pip install 'specforest[diffusers]'") from e
    from diffusers.pipelines import pipeline_utils

    cls = getattr(diffusers, class_name, None)
    if cls is None:
        raise ImportError(f"this diffusers ({diffusers.__version__}) has no {class_name}; upgrade diffusers")
    # newer diffusers renamed torch_dtype to dtype (the old name warns)
    key = "dtype" if hasattr(pipeline_utils, "_resolve_dtype") else "torch_dtype"
    pipe = cls.from_pretrained(str(path), local_files_only=True, **{key: DTYPES[dtype]}).to(device)
    pipe.set_progress_bar_config(disable=True)
    if not family.is_family(pipe):
        raise ValueError(f"{path} loads a {type(pipe).__name__} that the {family.name} family does not take")
    return pipe, family


def signature_defaults(fn: Callable[..., Any]) -> dict[str, Any]:
    """``{name: default}`` of ``fn``'s parameters that have a default."""
    return {
        k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not inspect.Parameter.empty
    }


def family_options(
    family: Family, what: str, given: Mapping[str, Any], *, names: "Mapping[str, str] | None" = None
) -> dict[str, Any]:
    """The family options of a call of ``family``'s ``what`` (``sample``, ``prepare`` or ``tune``),
    with that function's own defaults where not given.

    Args:
        family: the pipeline's family.
        what: which of its functions takes them.
        given: library parameter name -> value (``None``: not given), e.g. ``{"guidance_scale": None,
            "true_cfg_scale": 4.0}``.
        names: library name -> how the user spells it (``{"guidance_scale": "--guidance"}``), for errors.

    Returns:
        For each name of ``given`` that the function takes: the given value, else its default
        (names it does not take and that were not given are left out).

    Raises:
        NotImplementedError: if the family has no ``what`` (``tune``, ``prepare``).
        ValueError: naming every given option the function does not take.
    """
    fn = getattr(family, what)
    if fn is None:
        raise NotImplementedError(
            f"the {family.name} family ({family.pipeline_classes[0]}) has no {what} yet "
            "(specforest.diffusers.families.FAMILIES lists none for it)"
        )
    params = inspect.signature(fn).parameters
    names = names or {}
    refused = [names.get(k, k) for k, v in given.items() if v is not None and k not in params]
    if refused:
        raise ValueError(
            f"{', '.join(refused)}: not an option of the {family.name} family's {what} "
            f"({fn.__module__}.{fn.__name__}); leave {'it' if len(refused) == 1 else 'them'} out"
        )
    defaults = signature_defaults(fn)
    return {k: (v if v is not None else defaults.get(k)) for k, v in given.items() if k in params}
