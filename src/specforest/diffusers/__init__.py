"""Speculative sampling for diffusers' flow-matching pipelines (paper Sec. 5.3, App. C.3).

One concept per module:

* :mod:`~specforest.diffusers.flow_matching`: :class:`FlowMatchVelocity` adapts
  a flow-matching transformer (with classifier-free guidance in one batched
  call) to ``v(x, sigma, **cond)``, the library's model contract.
* :mod:`~specforest.diffusers.grid`: :func:`scheduler_sigmas` rebuilds the
  scheduler's grid as data, without touching the pipeline's scheduler.
* :mod:`~specforest.diffusers.pipeline_sd3`: :func:`sample` runs a
  ``StableDiffusion3Pipeline`` end to end: text encoding, latents,
  :func:`specforest.sample`, VAE decoding.
* :mod:`~specforest.diffusers.tuning`: :func:`tune` picks the fastest exact
  configuration of a pipeline on this device (:func:`specforest.latency.tune`
  on its transformer and scheduler grid).

Trees come from :func:`specforest.planning.make_tree` and memory sizing from
:mod:`specforest.memory`, as for every other command. diffusers itself is not
imported: everything goes through the pipeline object that is passed in.
"""

from .flow_matching import FlowMatchVelocity, transformer_row_bytes
from .grid import scheduler_sigmas
from .pipeline_sd3 import OUTPUT_TYPES, SD3Result, sample
from .tuning import tune

__all__ = [
    "OUTPUT_TYPES",
    "FlowMatchVelocity",
    "SD3Result",
    "sample",
    "scheduler_sigmas",
    "transformer_row_bytes",
    "tune",
]
