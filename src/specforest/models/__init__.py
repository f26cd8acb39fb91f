"""Model adapters: every family becomes a velocity ``v(x, sigma, **cond)`` on the linear path."""

from .gmm import GaussianMixture

__all__ = ["GaussianMixture"]
