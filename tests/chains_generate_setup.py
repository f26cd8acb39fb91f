"""The generation job that ``tests/test_chains_generate.py`` runs in one process and under ``torchrun``."""

from __future__ import annotations

import torch

from specforest import chains, trees
from specforest.models.gmm import GaussianMixture

COUNT = 10
GRID = chains.karras_linear_grid(12, 0.03, 20.0)


def model() -> GaussianMixture:
    return GaussianMixture.paper(dim=3, seed=0)


def make_x(idx: torch.Tensor) -> torch.Tensor:
    """Per-index initial states (a function of the index alone)."""
    return torch.stack(
        [torch.randn(3, generator=torch.Generator().manual_seed(int(i)), dtype=torch.float64) for i in idx]
    )


def config(name: str) -> dict:
    """The options of chain ``name``'s job: its stochastic example, a branching tree, 3 slots."""
    return dict(
        seed=5, batch=3, sigmas=GRID, chain=chains.get_chain(name).example(), tree=trees.uniform(2, 2), coupling="grs",
        draft="x0",
    )  # fmt: skip
