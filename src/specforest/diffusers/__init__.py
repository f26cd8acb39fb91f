"""Speculative sampling for diffusers pipelines: SD3 and Flux (flow matching), SDXL and SD 1.5 / 2.x (UNets).

One entry point, a module per family:

* :func:`sample` (:mod:`~specforest.diffusers.families`) takes any supported
  pipeline and dispatches on its family, refusing others with the list of
  supported ones.
* :mod:`~specforest.diffusers.pipeline_sd3`: ``StableDiffusion3Pipeline`` end to
  end (text encoding, latents, :func:`specforest.sample`, VAE decoding).
* :mod:`~specforest.diffusers.pipeline_flux`: ``FluxPipeline`` (dev and
  schnell): unpacked state, :class:`FluxVelocity` packing it for the
  transformer, embedded guidance and true CFG in one call.
* :mod:`~specforest.diffusers.pipeline_sdxl`: ``StableDiffusionXLPipeline`` and
  ``StableDiffusionPipeline`` (SD 1.5 / 2.x): epsilon, v and sample predictions
  of the UNet (:mod:`~specforest.diffusers.unet`) changed from the VP path to the
  linear one, on the scheduler's own grid, which starts below t = 1.
* :mod:`~specforest.diffusers.flow_matching`: :class:`FlowMatchVelocity` adapts
  SD3's transformer (with classifier-free guidance in one batched call) to
  ``v(x, sigma, **cond)``, the library's model contract.
* :mod:`~specforest.diffusers.grid`: :func:`scheduler_sigmas` rebuilds the
  scheduler's grid as data, without touching the pipeline's scheduler.
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
from .grid import scheduler_sigmas
from .pipeline_flux import FluxResult, FluxVelocity, is_flux
from .pipeline_sd3 import OUTPUT_TYPES, SD3Result
from .pipeline_sdxl import is_sd, is_sdxl
from .prepared import Prepared
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
