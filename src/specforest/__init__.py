"""specforest: exact speculative sampling for diffusion models on draft trees.

Quick start::

    import torch, specforest
    x_T = specforest.streams.randn(0, torch.arange(16), (500,))
    out = specforest.sample(velocity_fn, x_T, steps=30, churn=0.1, seed=0,
                            tree=specforest.trees.uniform(K=4, L=4), coupling="grs")
    out.samples, out.stats.nfe
"""

from . import chains, couplings, drafts, proposals, schedules, sde, streams, trees
from .couplings import GRS, RMC, Coupling, register_coupling
from .drafts import DraftModel, FrozenPrediction, MemoryDraft, SecantDraft, register_draft
from .generation import Finished, Generation, generate
from .options import SamplerOptions
from .reverse_sde import ReverseSDE
from .sampler import SampleResult, SampleStats, sample, standard_sample
from .schedules import flow_match_grid, uniform_grid

__version__ = "0.1.0"

__all__ = [
    "GRS",
    "RMC",
    "Coupling",
    "DraftModel",
    "Finished",
    "Generation",
    "FrozenPrediction",
    "MemoryDraft",
    "SecantDraft",
    "ReverseSDE",
    "SampleResult",
    "SampleStats",
    "SamplerOptions",
    "chains",
    "couplings",
    "drafts",
    "flow_match_grid",
    "generate",
    "proposals",
    "register_coupling",
    "register_draft",
    "sample",
    "schedules",
    "sde",
    "standard_sample",
    "streams",
    "trees",
    "uniform_grid",
]
