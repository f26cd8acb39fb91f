"""Reproducible experiments of the paper, as library functions (the CLI is a thin shell).

* :mod:`specforest.experiments.gmm` -- the Gaussian-mixture study of Sec. 5.1
  (one configuration, the ``(K, L)`` sweep of Figures 3 and 7).
"""

from . import gmm

__all__ = ["gmm"]
