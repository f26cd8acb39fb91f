"""Loading a local diffusers pipeline of any supported family, the options a family takes, its images.

:func:`load_pipeline` reads the directory's ``model_index.json`` first
(:func:`specforest.diffusers.family_of_directory`), so an unsupported or
missing pipeline is refused before anything is loaded, then loads the named
diffusers class offline. :func:`family_options` checks a command's family
options against the signature of the family function that will take them and
fills in that function's defaults: the command line holds no per-family table.
:func:`sample_images` is ``specforest diffusers``: images of a family's
``sample``, each from its own seed, written to a new folder with their record.
"""

from __future__ import annotations

import inspect
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from ..diffusers.families import Family, family_of_directory, pipeline_class_name
from .common import check_choice, check_int, derive_seed, json_params
from .sd3.loading import DTYPES

__all__ = ["DTYPES", "family_options", "load_pipeline", "sample_images", "signature_defaults"]


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


def sample_images(
    pipe: Any,
    family: Family,
    prompts: Sequence[str],
    out: "str | os.PathLike[str]",
    *,
    seed: int,
    batch_size: Optional[int] = None,
    record: Optional[Mapping[str, Any]] = None,
    **options: Any,
) -> dict:
    """One image per entry of ``prompts`` with ``family.sample``, written to the new folder ``out``.

    Image ``i`` is sampled with its own generator seeded from ``(seed, i)`` (latents and sampling noise),
    so it does not depend on ``batch_size``. ``out`` holds ``000000.png, ...`` and ``run.json``:
    ``record``'s fields, then ``config`` (the family's, of the first call), ``images`` (file, prompt,
    NFE of each), ``nfe``, ``nfe_mean``, ``steps``, ``standard_calls`` (the standard run's model calls, ``steps`` for one call a
    step; Heun's ``2 T - 1``), ``speedup`` (``standard_calls`` / mean NFE) and ``wall_seconds``
    (sampling, decoding and writing the PNGs). The folder is filled under a temporary name and renamed:
    it appears complete or not at all.

    Args:
        pipe: the pipeline, of ``family``.
        family: its :class:`~specforest.diffusers.families.Family`.
        prompts: the caption of each image.
        out: a folder that does not exist yet.
        seed: the images' seed (``>= 0``).
        batch_size: images per ``family.sample`` call (``None``: all at once).
        record: fields of ``run.json`` before the results (the options that made the images).
        options: ``family.sample``'s options (``num_inference_steps``, ``tree``, ``coupling``, ...).

    Returns:
        What ``run.json`` holds.

    Raises:
        FileExistsError: if ``out`` exists.
        ValueError / TypeError / MemoryError / FloatingPointError: as ``family.sample``.
    """
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; choose another folder (a run never writes into an old one)")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts must hold at least one caption")
    seed = check_int("seed", seed, 0)
    batch = len(prompts) if batch_size is None else check_int("batch_size", batch_size, 1)
    steps = options.get("num_inference_steps", signature_defaults(family.sample).get("num_inference_steps"))
    tmp = out.with_name(f".{out.name}.tmp-{secrets.token_hex(4)}")
    tmp.mkdir(parents=True)
    try:
        nfe: list = []
        standard_calls = 0
        config: Optional[dict] = None
        t0 = time.perf_counter()
        for start in range(0, len(prompts), batch):
            idx = range(start, min(start + batch, len(prompts)))
            gens = [torch.Generator().manual_seed(derive_seed(seed, i)) for i in idx]
            res = family.sample(pipe, [prompts[i] for i in idx], generator=gens, output_type="pil", **options)
            for i, im in zip(idx, res.images, strict=True):
                im.save(tmp / f"{i:06d}.png", format="PNG")
            nfe += [int(v) for v in res.stats.nfe.tolist()]
            standard_calls = res.stats.standard_calls or steps  # the chain's: Heun's 2 T - 1, not T
            # (EDM's s_tmax = inf, no bound, as null: JSON has no infinity)
            config = config or json_params(dict(res.config))
        wall = time.perf_counter() - t0
        nfe_mean = sum(nfe) / len(nfe)
        data = {
            **(record or {}),
            "config": config,
            "images": [
                {"file": f"{i:06d}.png", "prompt": p, "nfe": n}
                for i, (p, n) in enumerate(zip(prompts, nfe, strict=True))
            ],
            "nfe": nfe,
            "nfe_mean": nfe_mean,
            "steps": steps,
            "standard_calls": standard_calls,
            "speedup": standard_calls / nfe_mean,
            "wall_seconds": wall,
        }
        (tmp / "run.json").write_text(json.dumps(data, indent=1, allow_nan=False) + "\n", encoding="utf-8")
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return data
