"""The Gaussian-mixture experiment's fixed setting, its mixture and its initial states."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ...models import GaussianMixture
from ...sampler import GRIDS
from ...sde import ReverseSDE, flow_match_grid, uniform_grid
from ..common import check_choice, check_churn, check_int, derive_seed

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
    "steps",
    "dim",
    "components",
    "trajectories",
    "seed",
    "mixture_seed",
)
"""Fields that identify a configuration in a results file (a resumed sweep skips
a configuration whose key is already present)."""

# x_T and the calibration runs come from separate streams of one seed
STREAM_INIT, STREAM_CALIBRATION_X, STREAM_CALIBRATION_NOISE = 0, 7, 8


@dataclass(frozen=True)
class GMMSetting:
    """The experiment's fixed setting; the defaults are the paper's.

    Attributes:
        dim: dimension ``d >= 1``.
        components: number of mixture components ``>= 1``.
        steps: grid steps ``T >= 3`` (the first and last are deterministic).
        churn: ``eps`` in (0, 1].
        trajectories: number of independent trajectories ``>= 1``.
        grid: ``flow_match`` or ``uniform``.
        mixture_seed: seed of the mixture's means and stds, ``>= 0``.
    """

    dim: int = 500
    components: int = 5
    steps: int = 30
    churn: float = 0.1
    trajectories: int = 100
    grid: str = "flow_match"
    mixture_seed: int = 0

    def __post_init__(self) -> None:
        check_int("dim", self.dim, 1)
        check_int("components", self.components, 1)
        check_int("steps", self.steps, 3)
        check_int("trajectories", self.trajectories, 1)
        check_int("mixture_seed", self.mixture_seed, 0, 2**64 - 1)
        check_choice("grid", self.grid, GRIDS)
        object.__setattr__(self, "churn", check_churn(self.churn))

    def mixture(self) -> GaussianMixture:
        """The mixture drawn from ``mixture_seed`` (independent of the sampling seed)."""
        return GaussianMixture.paper(dim=self.dim, components=self.components, seed=self.mixture_seed)

    def sde(self) -> ReverseSDE:
        """The discretized reverse SDE the sampler runs (same grid as :func:`specforest.sample`)."""
        sig = flow_match_grid(self.steps) if self.grid == "flow_match" else uniform_grid(self.steps)
        return ReverseSDE(sig, self.churn)

    @property
    def deterministic_steps(self) -> int:
        """Steps of the grid taken as plain Euler steps (2 on both grids)."""
        return self.steps - int(self.sde().stochastic.sum())


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
