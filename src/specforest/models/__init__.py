"""Model adapters: every family becomes a velocity ``v(x, sigma, **cond)`` on the linear path."""

from .edm import EDMDenoiserVelocity, EpsilonPredictionVelocity, X0PredictionVelocity
from .gmm import GaussianMixture

__all__ = ["EDMDenoiserVelocity", "EpsilonPredictionVelocity", "GaussianMixture", "X0PredictionVelocity"]
