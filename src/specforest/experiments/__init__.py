"""Reproducible experiments of the paper, as library functions (the CLI is a thin shell).

* :mod:`specforest.experiments.gmm` -- the Gaussian-mixture study of Sec. 5.1
  (one configuration, the ``(K, L)`` sweep of Figures 3 and 7).
* :mod:`specforest.experiments.pixel` -- the pixel-space study of Sec. 5.2 on the
  shipped class-conditional digits model (Figures 4 and 8).
* :mod:`specforest.experiments.sd3` -- Stable Diffusion 3 through diffusers (Sec. 5.3, Figure 5).
* :mod:`specforest.experiments.drafts` -- mismatch and acceptance per step and depth for each draft kind.
* :mod:`specforest.experiments.train_digits` -- how the shipped digits models are trained.

Each experiment is a package (setting, run, sweep, report) over the shared helpers of
:mod:`specforest.experiments.common`; :mod:`~specforest.experiments.io` writes result
files atomically and :mod:`~specforest.experiments.results` the sections of
``benchmarks/RESULTS.md``. The library never imports this package.
"""

from . import gmm

__all__ = ["gmm"]
