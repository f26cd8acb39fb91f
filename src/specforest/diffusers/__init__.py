"""Speculative sampling for diffusers pipelines: SD3 and Flux (flow matching), SDXL and SD 1.5 / 2.x (UNets).

One entry point, a module per family, and the concepts they share in a module each:

* :func:`sample` (:mod:`~specforest.diffusers.families`) takes any supported
  pipeline and dispatches on its family (:mod:`~specforest.diffusers.detection`
  tells them apart), refusing others with the list of supported ones.
* The families' entry points, each a pipeline end to end (text encoding, latents,
  :func:`specforest.sample`, VAE decoding):
  :mod:`~specforest.diffusers.pipeline_sd3` (``StableDiffusion3Pipeline``),
  :mod:`~specforest.diffusers.pipeline_flux` (``FluxPipeline``, dev and schnell:
  unpacked state, embedded guidance and true CFG in one call) and
  :mod:`~specforest.diffusers.pipeline_sdxl` (``StableDiffusionXLPipeline`` and
  ``StableDiffusionPipeline``, on the scheduler's own grid, which starts below t = 1).
* The velocity adapters, each network as ``v(x, sigma, **cond)``, the library's
  model contract, with classifier-free guidance in one batched call:
  :class:`FlowMatchVelocity` (:mod:`~specforest.diffusers.flow_matching`, SD3),
  :class:`FluxVelocity` (:mod:`~specforest.diffusers.flux_velocity`, packing
  included) and :class:`~specforest.diffusers.unet.UNetVelocity`
  (:mod:`~specforest.diffusers.unet`: epsilon, v and sample predictions changed
  from the VP path to the linear one).
* The grids as data, without touching the pipeline's scheduler:
  :func:`scheduler_sigmas` and :func:`~specforest.diffusers.grid.flux_sigmas`
  (:mod:`~specforest.diffusers.grid`), :func:`~specforest.diffusers.unet.vp_schedule`.
* :mod:`~specforest.diffusers.flow`: the flow every family shares, written once:
  a family's ``sample``, ``prepare`` and tuner are ``sample_family``,
  ``prepare_family`` and ``tune_family`` on the family's own parts (its
  ``PARTS``, a ``FamilyParts``: checks, text encoding, velocity and grid,
  row bytes, decoding), so every family takes every option (``chain``,
  ``pad_rows``, ``warmup``, ...).
* What the flow uses: the checks before any work
  (:mod:`~specforest.diffusers.checks`, the text inputs in
  :mod:`~specforest.diffusers.text`), the run (:mod:`~specforest.diffusers.run`:
  memory plan, initial latents, the sampler; :class:`SD3Result`) and the decoding
  (:mod:`~specforest.diffusers.decoding`).
* :mod:`~specforest.diffusers.tuning`: :func:`tune` (SD3), :func:`tune_flux` and
  :func:`tune_sdxl` (SDXL and SD) pick the fastest exact configuration of a
  pipeline on this device (:func:`specforest.latency.tune` on its transformer
  or UNet and its scheduler grid).
* :mod:`~specforest.diffusers.prepared`: a family's ``prepare`` takes a pipeline
  apart (:class:`Prepared`: velocity, grid, per-caption conditioning, decoder)
  for jobs that sample index by index (``specforest generate diffusers``).

Trees come from :func:`specforest.planning.make_tree` and memory sizing from
:mod:`specforest.memory`, as for every other command. diffusers itself is not
imported: everything goes through the pipeline object that is passed in.
"""

from .decoding import OUTPUT_TYPES
from .detection import is_flux, is_sd, is_sdxl
from .families import (
    FAMILIES,
    Family,
    family_of,
    family_of_class_name,
    family_of_directory,
    pipeline_class_name,
    sample,
)
from .flow_matching import FlowMatchVelocity, transformer_row_bytes
from .flux_velocity import FluxVelocity
from .grid import scheduler_sigmas
from .pipeline_flux import FluxResult
from .prepared import Prepared
from .run import SD3Result
from .tuning import tune, tune_flux, tune_sdxl

__all__ = [
    "FAMILIES",
    "OUTPUT_TYPES",
    "Family",
    "FlowMatchVelocity",
    "FluxResult",
    "FluxVelocity",
    "Prepared",
    "SD3Result",
    "family_of",
    "family_of_class_name",
    "family_of_directory",
    "is_flux",
    "is_sd",
    "is_sdxl",
    "pipeline_class_name",
    "sample",
    "scheduler_sigmas",
    "transformer_row_bytes",
    "tune",
    "tune_flux",
    "tune_sdxl",
]
