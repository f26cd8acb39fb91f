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


class LabelledDPM2Ancestral(chains.DPM2Ancestral):
    """``dpm_2_ancestral`` declaring each call's own time input ``1000 n + k`` (stage ``k`` of step ``n``),
    as a diffusers scheduler followed through ``pipe(...)`` declares its UNet's timesteps."""

    def call_times(self, sigmas: torch.Tensor) -> torch.Tensor:
        T = sigmas.numel() - 1
        return 1000.0 * torch.arange(T, dtype=torch.float64)[:, None] + torch.arange(2, dtype=torch.float64)


class TimedMixture:
    """The job's mixture, moved by each call's time input (``timestep``, which it declares it takes): a row
    given another row's, step's or stage's time input gives other samples."""

    takes_timestep = True

    def __init__(self) -> None:
        self.gmm = model()

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, timestep: "torch.Tensor | None" = None) -> torch.Tensor:
        v = self.gmm(x, sigma)
        return v if timestep is None else v + 1e-6 * timestep[:, None].to(x.dtype)


TIMED = "dpm_2_ancestral/timestep"
"""The job of a chain that declares its calls' time inputs, run with :class:`TimedMixture`."""


def timed_config() -> dict:
    """:func:`config` of ``dpm_2_ancestral`` with its calls' time inputs declared."""
    return {**config("dpm_2_ancestral"), "chain": LabelledDPM2Ancestral()}
