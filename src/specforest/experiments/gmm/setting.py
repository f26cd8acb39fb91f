"""The Gaussian-mixture experiment's fixed setting, its mixture and its initial states."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import torch

from ...chains import EM, Chain
from ...models import GaussianMixture
from ...options import check_option
from ...schedules import named_grid
from ...sde import GaussianChain
from ..common import check_int, derive_seed, run_chain

__all__ = ["KEY_FIELDS", "GMMSetting", "initial_states", "mixture_fingerprint"]

KEY_FIELDS = (
    "method",
    "K",
    "L",
    "prefetch",
    "verify",
    "draft",
    "tree",
    "mode",
    "grid",
    "churn",
    "chain",
    "steps",
    "dim",
    "components",
    "trajectories",
    "seed",
    "mixture_seed",
)
"""Fields that identify a configuration in a results file (a resumed sweep skips
a configuration whose key is already present; ``chain`` is its name and parameters, the ``em`` chain
in a record written before chains)."""

DEFAULT_CHURN = 0.1
"""The em chain's churn of the paper's setting."""

# x_T and the calibration runs come from separate streams of one seed
STREAM_INIT, STREAM_CALIBRATION_X, STREAM_CALIBRATION_NOISE = 0, 7, 8


@dataclass(frozen=True)
class GMMSetting:
    """The experiment's fixed setting; the defaults are the paper's.

    Attributes:
        dim: dimension ``d >= 1``.
        components: number of mixture components ``>= 1``.
        steps: grid steps ``T >= 3`` (the em chain's first and last are deterministic).
        churn: ``eps`` in (0, 1] of the ``em`` chain (default 0.1, the paper's); ``None`` with another chain.
        trajectories: number of independent trajectories ``>= 1``.
        grid: ``flow_match`` or ``uniform``.
        mixture_seed: seed of the mixture's means and stds, ``>= 0``.
        chain: the sampler's chain (:mod:`specforest.chains`): ``"em"`` (the paper's Euler-Maruyama
            step with ``churn``, the default), or another registered name or
            :class:`~specforest.chains.Chain` with its parameters (``get_chain("euler_ancestral",
            eta=0.7)``); kept as ``"em"`` or the :class:`~specforest.chains.Chain` (:attr:`run_chain`).

    Raises:
        ValueError / TypeError: naming the field (a churn given with a chain other than em among them).
    """

    dim: int = 500
    components: int = 5
    steps: int = 30
    churn: Optional[float] = None
    trajectories: int = 100
    grid: str = "flow_match"
    mixture_seed: int = 0
    chain: "str | Chain" = "em"

    def __post_init__(self) -> None:
        check_int("dim", self.dim, 1)
        check_int("components", self.components, 1)
        check_int("steps", self.steps, 3)
        check_int("trajectories", self.trajectories, 1)
        check_int("mixture_seed", self.mixture_seed, 0, 2**64 - 1)
        check_option("grid", self.grid)
        chain = run_chain(self.chain, self.churn, DEFAULT_CHURN)
        em = isinstance(chain, EM)
        object.__setattr__(self, "churn", chain.churn if em else None)
        object.__setattr__(self, "chain", "em" if em else chain)

    @property
    def run_chain(self) -> Chain:
        """The chain the sampler runs (the ``em`` chain at :attr:`churn`, or :attr:`chain`)."""
        return EM(churn=self.churn) if self.chain == "em" else self.chain

    def mixture(self) -> GaussianMixture:
        """The mixture drawn from ``mixture_seed`` (independent of the sampling seed)."""
        return GaussianMixture.paper(dim=self.dim, components=self.components, seed=self.mixture_seed)

    def sde(self) -> GaussianChain:
        """The chain's tables the sampler runs (same grid as :func:`specforest.sample`): the discretized
        reverse SDE (:class:`~specforest.reverse_sde.ReverseSDE`) of the em chain."""
        sig = named_grid(self.grid, self.steps)
        return self.run_chain.build(sig.to(torch.float64))

    @property
    def deterministic_steps(self) -> int:
        """Steps of the grid taken as plain Euler steps, without noise (2 on both grids for the em chain)."""
        sde = self.sde()
        return sde.steps - int(sde.stochastic.sum())  # (the chain's steps, which a chain of half-steps doubles)


def mixture_fingerprint(gmm: GaussianMixture) -> str:
    """Short hash of a mixture's parameters, recorded with every result."""
    h = hashlib.sha256()
    for t in (gmm.means, gmm.stds, gmm.weights):
        # the array's own buffer, not a copy of it: the means are counted once in a run's memory
        h.update(t.detach().cpu().to(torch.float64).contiguous().numpy())
    return h.hexdigest()[:16]


def initial_states(trajectories: int, dim: int, seed: int) -> torch.Tensor:
    """``(trajectories, dim)`` float32 ``x_T ~ N(0, I)``, the same for every method at ``seed``."""
    g = torch.Generator().manual_seed(derive_seed(seed, STREAM_INIT))
    return torch.randn(trajectories, dim, generator=g, dtype=torch.float32)
