"""k-diffusion's sampler signature over the exact speculative sampler, and drop-in samplers.

:func:`sample_speculative` (:mod:`~specforest.kdiffusion.speculative`) runs the library's chain
behind k-diffusion's signature; the drop-ins (:mod:`~specforest.kdiffusion.dropins`:
``sample_euler_ancestral``, ``sample_euler``, ``sample_dpmpp_2m_sde``, ``sample_dpmpp_3m_sde``, ``sample_ddpm``,
``sample_lcm``) are the samplers people run, exactly (``docs/kdiffusion.md``). The schedules they take are
k-diffusion's own VE sigmas, under k-diffusion's names (:mod:`specforest.schedules`): ``get_sigmas_karras``,
``get_sigmas_exponential``, ``get_sigmas_polyexponential``, ``get_sigmas_vp``. :func:`has_features` says
whether a denoiser keeps the deep features ``draft="cached"`` reuses.
"""

from ..schedules import get_sigmas_exponential, get_sigmas_karras, get_sigmas_polyexponential, get_sigmas_vp
from .dropins import (
    sample_ddpm,
    sample_dpmpp_2m_sde,
    sample_dpmpp_3m_sde,
    sample_dpmpp_sde,
    sample_euler,
    sample_euler_ancestral,
    sample_lcm,
)
from .speculative import KEYS, PATHS, has_features, linear_grid, sample, sample_speculative

__all__ = [
    "KEYS",
    "PATHS",
    "get_sigmas_exponential",
    "get_sigmas_karras",
    "get_sigmas_polyexponential",
    "get_sigmas_vp",
    "has_features",
    "linear_grid",
    "sample",
    "sample_ddpm",
    "sample_dpmpp_2m_sde",
    "sample_dpmpp_3m_sde",
    "sample_dpmpp_sde",
    "sample_euler",
    "sample_euler_ancestral",
    "sample_lcm",
    "sample_speculative",
]
