"""The closed-form Gaussian-mixture target (paper Sec. 5.1).

For data ``x_0 ~ sum_k w_k N(mu_k, s_k^2 I)`` on the linear path
``x_sigma = (1 - sigma) x_0 + sigma xi``, component ``k`` gives
``x_sigma ~ N(a mu_k, var_k I)`` with ``a = 1 - sigma`` and
``var_k = a^2 s_k^2 + sigma^2``, and ``(x_0, xi, x_sigma)`` is jointly Gaussian.
The exact velocity ``v = E[xi - x_0 | x_sigma]`` is therefore

    v(x, sigma) = sum_k r_k(x) [ (sigma - a s_k^2) (x - a mu_k) / var_k - mu_k ],

with posterior responsibilities ``r_k``; it is finite on all of [0, 1]
(``v(x, 0) = -x``, ``v(x, 1) = x - sum_k w_k mu_k``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..validation import check_int

__all__ = ["GaussianMixture", "MixtureSize"]


@dataclass(frozen=True)
class MixtureSize:
    """What a mixture of ``components`` isotropic Gaussians in ``dim`` dimensions costs, known
    before its parameters are drawn: :func:`specforest.memory.estimate` reads it as the model's
    declarations (``row_bytes``, ``feature_numel``), so a run can be sized, and refused, before
    the mixture is built. :attr:`GaussianMixture.size` gives a mixture's own.

    Attributes:
        dim: dimension ``d``.
        components: number of components ``C``.
    """

    dim: int
    components: int

    @property
    def parameter_bytes(self) -> int:
        """Peak bytes of the parameters, ``16 C d``: the float64 means and one temporary while
        :meth:`GaussianMixture.paper` draws them, then the means beside the float32 copy a call
        uses and its square (the stds and weights, ``C`` numbers each, are not counted)."""
        return 16 * self.components * self.dim

    def row_bytes(self, x: torch.Tensor, **cond: object) -> int:
        """Peak bytes one row adds inside a call (:func:`specforest.memory.row_bytes_of`).

        ``(2 d + 7 C) w`` for ``x`` rows of dtype size ``w`` (float32 unless
        float64): the running velocity and its update (``d`` each) and the
        ``(rows, C)`` responsibilities and their intermediates, output included.
        Measured on ``d`` 250 and 500, ``C`` 5 and 20, float32 and float64: within
        1% (``benchmarks/memory.py``). The component loop keeps ``rows x C x d``
        from ever being held at once.
        """
        w = 8 if x.dtype == torch.float64 else 4
        return (2 * self.dim + 7 * self.components) * w

    def feature_numel(self, shape: tuple[int, ...]) -> int:
        """The deep features a call keeps per row for ``draft="cached"``: the ``C`` responsibilities."""
        return self.components


class GaussianMixture:
    """Isotropic Gaussian mixture with its exact linear-path velocity.

    Args:
        means: ``(C, d)`` component means.
        stds: ``(C,)`` component standard deviations, > 0.
        weights: ``(C,)`` mixture weights (normalized here); uniform if omitted.

    Calling the instance, ``gmm(x, sigma)``, returns the velocity:
    ``x: (M, d)``, ``sigma: (M,)`` or scalar -> ``(M, d)``, in ``x``'s dtype
    (computed in float64 internally when ``x`` is float64).
    """

    def __init__(self, means: torch.Tensor, stds: torch.Tensor, weights: Optional[torch.Tensor] = None) -> None:
        means = torch.as_tensor(means, dtype=torch.float64)
        stds = torch.as_tensor(stds, dtype=torch.float64).reshape(-1)
        if means.ndim != 2 or means.shape[0] < 1 or means.shape[1] < 1:
            raise ValueError(f"means must have shape (components, dim), got {tuple(means.shape)}")
        C = means.shape[0]
        if stds.shape != (C,) or not (stds > 0).all() or not torch.isfinite(stds).all():
            raise ValueError(f"stds must be {C} finite positive numbers")
        if weights is None:
            weights = torch.full((C,), 1.0 / C, dtype=torch.float64)
        weights = torch.as_tensor(weights, dtype=torch.float64).reshape(-1)
        if weights.shape != (C,) or (weights < 0).any() or weights.sum() <= 0:
            raise ValueError(f"weights must be {C} non-negative numbers with a positive sum")
        self.means = means
        self.stds = stds
        self.weights = weights / weights.sum()
        self._cache: dict = {}

    @classmethod
    def paper(
        cls,
        dim: int = 500,
        components: int = 5,
        seed: int = 0,
        mean_range: float = 2.0,
        std_range: tuple[float, float] = (0.10, 0.25),
    ) -> "GaussianMixture":
        """The paper's mixture: means ``U([-2, 2]^d)``, stds ``U([0.10, 0.25])``.

        Drawn once from ``seed`` (a CPU ``torch.Generator``), so the same seed
        gives the same mixture on every machine.

        Raises:
            ValueError / TypeError: on an invalid ``dim``, ``components`` or ``seed``, naming it.
            MemoryError: if the parameters (:attr:`MixtureSize.parameter_bytes`) exceed the
                machine's physical memory, naming ``dim`` and ``components``, before they are drawn
                (a run's own limit is checked where the run is sized: ``specforest.experiments.gmm``).
        """
        from ..memory import physical_memory

        dim = check_int("dim", dim, 1)
        components = check_int("components", components, 1)
        seed = check_int("seed", seed, 0, 2**64 - 1)
        need, total = MixtureSize(dim, components).parameter_bytes, physical_memory()
        if total is not None and need > total:
            raise MemoryError(
                f"a mixture of components={components} x dim={dim} needs about {need / 1e9:.3g} GB for its "
                f"parameters, more than this machine's {total / 1e9:.3g} GB of physical memory: "
                "lower components or dim"
            )
        g = torch.Generator().manual_seed(seed)
        means = (torch.rand(components, dim, generator=g, dtype=torch.float64) * 2 - 1) * mean_range
        lo, hi = std_range
        stds = lo + (hi - lo) * torch.rand(components, generator=g, dtype=torch.float64)
        return cls(means, stds)

    def row_bytes(self, x: torch.Tensor, **cond: object) -> int:
        """Peak bytes one row adds inside a call: :meth:`MixtureSize.row_bytes`."""
        return self.size.row_bytes(x)

    @property
    def dim(self) -> int:
        return self.means.shape[1]

    @property
    def num_components(self) -> int:
        return self.means.shape[0]

    @property
    def size(self) -> MixtureSize:
        """The mixture's :class:`MixtureSize`."""
        return MixtureSize(self.dim, self.num_components)

    def _params(self, dtype, device):
        key = (dtype, device)
        if key not in self._cache:
            m = self.means.to(device, dtype)
            self._cache[key] = (
                m,
                (m * m).sum(1),
                self.stds.to(device, dtype) ** 2,
                self.weights.to(device, dtype).log(),
            )
        return self._cache[key]

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor | float) -> torch.Tensor:
        return self._velocity(x, sigma)[0]

    def feature_numel(self, shape: tuple[int, ...]) -> int:
        """The deep features a call keeps per row for ``draft="cached"``
        (:class:`~specforest.drafts.CachedDraft`): the ``C`` posterior responsibilities."""
        return self.num_components

    def with_features(self, x: torch.Tensor, sigma: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(v, r)``: the velocity (the same numbers as a call) and the responsibilities
        ``r (M, C)`` it used, the mixture's one nonlinear part (its "deep features")."""
        return self._velocity(x, sigma)

    def from_features(self, x: torch.Tensor, sigma: torch.Tensor | float, r: torch.Tensor) -> torch.Tensor:
        """The velocity at ``x (M, d)``, ``sigma`` with the responsibilities ``r (M, C)`` of an
        earlier :meth:`with_features` call instead of its own: every component's affine part is
        recomputed at ``x``, which component it is drawn from is the earlier state's belief.
        Exact for one component; the cached self-draft's cheap evaluation otherwise."""
        return self._velocity(x, sigma, r)[0]

    def _velocity(
        self, x: torch.Tensor, sigma: torch.Tensor | float, r: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"x must have shape (M, {self.dim}), got {tuple(x.shape)}")
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        xw = x.to(work)
        mu, mu2, s2, logw = self._params(work, x.device)
        sig = torch.as_tensor(sigma, dtype=work, device=x.device).reshape(-1, 1).expand(x.shape[0], 1)
        a = 1.0 - sig  # (M, 1)
        var = a * a * s2[None, :] + sig * sig  # (M, C)
        if r is None:
            # row-wise reductions and elementwise ops only, no matmul: a row's velocity is
            # then bitwise the same in any batch (BLAS blocking depends on the batch size)
            x2 = (xw * xw).sum(1, keepdim=True)
            xm = torch.stack([(xw * m).sum(1) for m in mu], 1)  # (M, C)
            dist2 = x2 - 2.0 * a * xm + a * a * mu2[None, :]
            logits = logw[None, :] - 0.5 * dist2 / var - 0.5 * self.dim * torch.log(var)
            r = torch.softmax(logits, dim=1)  # (M, C)
        elif not isinstance(r, torch.Tensor) or tuple(r.shape) != (x.shape[0], self.num_components):
            got = tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__
            raise ValueError(f"r must have shape ({x.shape[0]}, {self.num_components}), got {got}")
        else:
            r = r.to(work)
        c = r * (sig - a * s2[None, :]) / var  # (M, C)
        # sum_k c_k (x - a mu_k) - r_k mu_k
        w = c * a + r
        v = c.sum(1, keepdim=True) * xw
        for k in range(mu.shape[0]):
            v = torch.addcmul(v, w[:, k : k + 1], mu[k], value=-1.0)
        return v.to(x.dtype), r

    def sample(self, n: int, generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw ``n`` data points; returns ``(x (n, d) float64, component (n,) long)``."""
        k = torch.multinomial(self.weights, n, replacement=True, generator=generator)
        z = torch.randn(n, self.dim, generator=generator, dtype=torch.float64)
        return self.means[k] + self.stds[k, None] * z, k

    def assign(self, x: torch.Tensor) -> torch.Tensor:
        """``(n,)`` most likely component of each data point ``x: (n, d)``."""
        x = x.to(torch.float64)
        d2 = torch.cdist(x, self.means) ** 2
        ll = self.weights.log()[None] - 0.5 * d2 / self.stds[None] ** 2 - self.dim * torch.log(self.stds)[None]
        return ll.argmax(1)

    def __repr__(self) -> str:
        return f"GaussianMixture(components={self.num_components}, dim={self.dim})"
