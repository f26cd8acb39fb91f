"""The paper's chain: the Euler-Maruyama discretization of the churned reverse SDE on the linear
(rectified-flow) path (:class:`ReverseSDE`, the ``em`` chain's tables), a :class:`~specforest.sde.GaussianChain`.

The paper's reverse time is ``1 - t`` and its step size is ``gamma_n = t_n - t_{n + 1}``. With churn
``eps`` the reverse drift (paper eq. 35) and the Euler-Maruyama transition (eqs. 36-37) are::

    b(y)    = -(1 + eps^2) v(y, t_n) - eps^2 y / (1 - t_n)
    m(y)    = y + gamma_n b(y)
    scale_n = eps * sqrt(2 gamma_n t_n / (1 - t_n))

The steps from ``t = 1`` and into ``t = 0`` are deterministic Euler steps (:mod:`specforest.sde`'s conventions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .schedules import check_sigmas
from .sde import GaussianChain
from .validation import check_churn

__all__ = ["ReverseSDE"]


@dataclass(frozen=True)
class ReverseSDE(GaussianChain):
    """Euler-Maruyama discretization of the churned reverse SDE on a grid: the ``em`` chain.

    Attributes:
        sigmas: ``(T + 1,)`` float64 levels ``t_n``, decreasing, ``t_T = 0``.
        churn: ``eps`` in (0, 1]; 0 would make every transition a point mass.

    ``mean = y - gamma [(1 + eps^2) v + eps^2 y / (1 - t)]`` and
    ``scale = eps sqrt(2 gamma t / (1 - t))`` on stochastic steps, the Euler step ``y - gamma v`` with
    scale 0 on the deterministic ones (from ``t = 1``, into ``t = 0``).
    """

    sigmas: torch.Tensor
    churn: float

    name = "em"

    def __post_init__(self) -> None:
        t = check_sigmas(self.sigmas)
        churn = check_churn(self.churn)
        object.__setattr__(self, "churn", churn)
        eps2 = churn**2
        gamma = t[:-1] - t[1:]
        stochastic = (t[:-1] < 1.0) & (t[1:] > 0.0)
        rev = (1.0 - t[:-1]).clamp_min(1e-300)  # the paper's reverse time 1 - t
        scale = torch.where(stochastic, churn * torch.sqrt(2.0 * gamma * t[:-1] / rev), torch.zeros_like(gamma))
        a = torch.where(stochastic, 1.0 - gamma * eps2 / rev, torch.ones_like(gamma))
        c = torch.where(stochastic, -gamma * (1.0 + eps2), -gamma)
        f = torch.where(stochastic, torch.full_like(rev, 1.0 + eps2), torch.ones_like(rev))
        k = torch.where(stochastic, eps2 / rev, torch.zeros_like(rev))
        self._set_tables(t, a, c, scale, f, k)

    @property
    def params(self) -> dict:
        return {"churn": self.churn}
