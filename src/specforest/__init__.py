"""specforest: exact speculative sampling for diffusion models on draft trees.

Quick start::

    import torch, specforest
    g = torch.Generator().manual_seed(0)
    x_T = torch.randn(16, 500, generator=g)
    out = specforest.sample(velocity_fn, x_T, steps=30, churn=0.1,
                            tree=specforest.trees.uniform(K=4, L=4),
                            coupling="grs", generator=g)
    out.samples, out.stats.nfe
"""

from . import couplings, proposals, sde, trees
from .couplings import GRS, RMC, Coupling
from .proposals import DraftModel, FrozenPrediction
from .sampler import SampleResult, SampleStats, sample, standard_sample
from .sde import ReverseSDE, flow_match_grid, uniform_grid

__version__ = "0.1.0"

__all__ = [
    "GRS",
    "RMC",
    "Coupling",
    "DraftModel",
    "FrozenPrediction",
    "ReverseSDE",
    "SampleResult",
    "SampleStats",
    "couplings",
    "flow_match_grid",
    "proposals",
    "sample",
    "sde",
    "standard_sample",
    "trees",
    "uniform_grid",
]
