"""The noise schedules people know, as VE sigmas and as the library's linear-path grids.

Two kinds of level live in this library, and a schedule function says which it returns:

* **VE sigmas** (k-diffusion, ComfyUI's ``EPS`` models): ``x = x_0 + sigma xi``, from ``sigma_max``
  (often 80) down to 0. The k-diffusion drop-ins (:mod:`specforest.kdiffusion`) take these, as
  k-diffusion's samplers do. :func:`get_sigmas_karras`, :func:`get_sigmas_exponential`,
  :func:`get_sigmas_polyexponential` and :func:`get_sigmas_vp` are k-diffusion's own functions (names,
  signatures, torch's default dtype, a 0 appended), re-exported by :mod:`specforest.kdiffusion`.
* **Linear-path levels** ``t = sigma / (1 + sigma)`` in ``[0, 1]`` (:mod:`specforest.sde`): what
  :func:`specforest.sample`'s ``sigmas=`` and :meth:`specforest.chains.Chain.build` take.
  :func:`schedule_grid` makes the grid of a named schedule (:data:`SCHEDULES`, the ``schedule`` option).

A VE schedule may lie below 1 everywhere (``sigma_max = 0.9``): the two kinds cannot be told apart from
their values, only from the function that made them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .validation import check_int, check_number

__all__ = [
    "SCHEDULES",
    "SCHEDULE_SIGMA_RANGE",
    "ddpm_discrete_sigmas",
    "ddpm_linear_grid",
    "get_sigmas_exponential",
    "get_sigmas_karras",
    "get_sigmas_polyexponential",
    "get_sigmas_vp",
    "karras_linear_grid",
    "schedule_grid",
]

SCHEDULES = ("karras", "exponential", "ddpm", "vp")
"""The named schedules of the ``schedule`` option: Karras et al.'s and the exponential one between
``sigma_min`` and ``sigma_max``, DDPM's 1000-step training schedule (:func:`ddpm_discrete_sigmas`) and
k-diffusion's continuous VP schedule (:func:`get_sigmas_vp`) at their own levels."""

SCHEDULE_SIGMA_RANGE = {"karras": (0.002, 80.0), "exponential": (0.002, 80.0)}
"""The schedules that take ``sigma_min`` and ``sigma_max``, with their defaults (EDM's range)."""


def _scalar(value: object) -> object:
    """A one-element tensor's value (k-diffusion's callers pass ``model.sigma_min``), else ``value``."""
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def _check_range(n: int, sigma_min: float, sigma_max: float) -> tuple[float, float]:
    check_int("n", n, 1)
    sigma_min, sigma_max = _scalar(sigma_min), _scalar(sigma_max)
    lo = check_number("sigma_min", sigma_min, 0.0, lo_open=True)
    hi = check_number("sigma_max", sigma_max, lo, lo_open=True)
    return lo, hi


def _append_zero(s: torch.Tensor) -> torch.Tensor:
    return torch.cat([s, s.new_zeros([1])])


def _karras(n: int, sigma_min: float, sigma_max: float, rho: float, dtype: Optional[torch.dtype]) -> torch.Tensor:
    lo, hi = _check_range(n, sigma_min, sigma_max)
    rho = check_number("rho", rho, 0.0, lo_open=True)
    ramp = torch.linspace(0, 1, n, dtype=dtype)
    lo_r, hi_r = lo ** (1 / rho), hi ** (1 / rho)
    return _append_zero((hi_r + ramp * (lo_r - hi_r)) ** rho)


def get_sigmas_karras(
    n: int, sigma_min: float, sigma_max: float, rho: float = 7.0, device: "str | torch.device" = "cpu"
) -> torch.Tensor:
    """Karras et al. (2022) eq. (5), k-diffusion's ``get_sigmas_karras``: VE sigmas.

    Returns:
        ``(n + 1,)`` in torch's default dtype, from ``sigma_max`` down to ``sigma_min``, then 0.

    Raises:
        TypeError / ValueError: naming ``n`` (an int >= 1), ``sigma_min`` (> 0), ``sigma_max`` (> sigma_min)
            or ``rho`` (> 0).
    """
    return _karras(n, sigma_min, sigma_max, rho, None).to(device)


def _exponential(n: int, sigma_min: float, sigma_max: float, dtype: Optional[torch.dtype]) -> torch.Tensor:
    lo, hi = _check_range(n, sigma_min, sigma_max)
    return _append_zero(torch.linspace(math.log(hi), math.log(lo), n, dtype=dtype).exp())


def get_sigmas_exponential(
    n: int, sigma_min: float, sigma_max: float, device: "str | torch.device" = "cpu"
) -> torch.Tensor:
    """Sigmas evenly spaced in ``log sigma``, k-diffusion's ``get_sigmas_exponential``: VE sigmas.

    Returns:
        ``(n + 1,)`` in torch's default dtype, from ``sigma_max`` down to ``sigma_min``, then 0.

    Raises:
        TypeError / ValueError: as :func:`get_sigmas_karras`.
    """
    return _exponential(n, sigma_min, sigma_max, None).to(device)


def get_sigmas_polyexponential(
    n: int, sigma_min: float, sigma_max: float, rho: float = 1.0, device: "str | torch.device" = "cpu"
) -> torch.Tensor:
    """``log sigma`` a polynomial of degree ``rho`` in the ramp, k-diffusion's ``get_sigmas_polyexponential``
    (``rho = 1``: :func:`get_sigmas_exponential`): VE sigmas.

    Returns:
        ``(n + 1,)`` in torch's default dtype, from ``sigma_max`` down to ``sigma_min``, then 0.

    Raises:
        TypeError / ValueError: as :func:`get_sigmas_karras`.
    """
    lo, hi = _check_range(n, sigma_min, sigma_max)
    rho = check_number("rho", rho, 0.0, lo_open=True)
    ramp = torch.linspace(1, 0, n) ** rho
    return _append_zero(torch.exp(ramp * (math.log(hi) - math.log(lo)) + math.log(lo))).to(device)


def _vp(n: int, beta_d: float, beta_min: float, eps_s: float, dtype: Optional[torch.dtype]) -> torch.Tensor:
    check_int("n", n, 1)
    beta_d = check_number("beta_d", beta_d, 0.0, lo_open=True)
    beta_min = check_number("beta_min", beta_min, 0.0)
    eps_s = check_number("eps_s", eps_s, 0.0, 1.0, lo_open=True)
    t = torch.linspace(1, eps_s, n, dtype=dtype)
    return _append_zero(torch.sqrt(torch.exp(beta_d * t**2 / 2 + beta_min * t) - 1))


def get_sigmas_vp(
    n: int, beta_d: float = 19.9, beta_min: float = 0.1, eps_s: float = 1e-3, device: "str | torch.device" = "cpu"
) -> torch.Tensor:
    """The continuous VP schedule (Song et al. 2021), k-diffusion's ``get_sigmas_vp``: VE sigmas
    ``sqrt(exp(beta_d t^2 / 2 + beta_min t) - 1)`` at ``t`` from 1 to ``eps_s``.

    Returns:
        ``(n + 1,)`` in torch's default dtype (about 152 down to 0.01 at the defaults), then 0.

    Raises:
        TypeError / ValueError: naming ``n`` (an int >= 1), ``beta_d`` (> 0), ``beta_min`` (>= 0) or
            ``eps_s`` (in (0, 1]).
    """
    return _vp(n, beta_d, beta_min, eps_s, None).to(device)


def ddpm_discrete_sigmas(steps: int, *, train_steps: int = 1000) -> torch.Tensor:
    """DDPM's training schedule (linear betas 1e-4 to 0.02 over ``train_steps``, ``DDPMScheduler``'s
    defaults) at ``steps`` levels: VE sigmas ``sqrt((1 - ab) / ab)`` at ``steps`` timesteps evenly spaced
    from the last training step to the first, interpolated in ``log sigma`` between training steps
    (k-diffusion's ``DiscreteSchedule.get_sigmas``), then 0. At ``steps = train_steps`` every training
    step is a level.

    Returns:
        ``(steps + 1,)`` float64 (about 157 down to 0.01), then 0.

    Raises:
        TypeError / ValueError: naming ``steps`` (an int >= 1) or ``train_steps`` (>= 2).
    """
    check_int("steps", steps, 1)
    check_int("train_steps", train_steps, 2)
    betas = torch.linspace(1e-4, 0.02, train_steps, dtype=torch.float64)
    ab = torch.cumprod(1.0 - betas, 0)
    log_sigmas = ((1.0 - ab) / ab).sqrt().log()
    t = torch.linspace(train_steps - 1, 0, steps, dtype=torch.float64)
    low = t.floor().long()
    high = t.ceil().long()
    w = t - low
    return _append_zero(((1 - w) * log_sigmas[low] + w * log_sigmas[high]).exp())


def schedule_grid(
    schedule: str, steps: int, sigma_min: Optional[float] = None, sigma_max: Optional[float] = None
) -> torch.Tensor:
    """The linear-path grid of the named schedule ``schedule`` (:data:`SCHEDULES`) of ``steps`` steps.

    Args:
        schedule: ``karras`` (``rho = 7``), ``exponential``, ``ddpm`` (:func:`ddpm_discrete_sigmas`) or
            ``vp`` (:func:`get_sigmas_vp` at its defaults).
        steps: the steps ``T >= 1``: ``T`` VE levels, then 0.
        sigma_min, sigma_max: the VE range of ``karras`` and ``exponential`` (``None``: 0.002 and 80,
            :data:`SCHEDULE_SIGMA_RANGE`); the other schedules have their own levels and take neither.

    Returns:
        ``(T + 1,)`` float64 ``t = sigma / (1 + sigma)``, decreasing from ``t_0 < 1`` to 0.

    Raises:
        ValueError / TypeError: naming ``schedule`` (and the schedules), ``steps``, ``sigma_min`` or
            ``sigma_max`` (a range given to a schedule that takes none).
    """
    from .validation import check_choice

    check_choice("schedule", schedule, SCHEDULES)
    if schedule in SCHEDULE_SIGMA_RANGE:
        lo_default, hi_default = SCHEDULE_SIGMA_RANGE[schedule]
        lo = lo_default if sigma_min is None else sigma_min
        hi = hi_default if sigma_max is None else sigma_max
        check_int("steps", steps, 1)
        if schedule == "karras":
            s = _karras(steps, lo, hi, 7.0, torch.float64)
        else:
            s = _exponential(steps, lo, hi, torch.float64)
    else:
        given = [n for n, v in (("sigma_min", sigma_min), ("sigma_max", sigma_max)) if v is not None]
        if given:
            named, verb = " and ".join(given), "applies" if len(given) == 1 else "apply"
            raise ValueError(
                f"{named} {verb} to the schedules {', '.join(SCHEDULE_SIGMA_RANGE)}; schedule {schedule!r} has its "
                f"own levels: leave {named} unset"
            )
        check_int("steps", steps, 1)
        s = ddpm_discrete_sigmas(steps) if schedule == "ddpm" else _vp(steps, 19.9, 0.1, 1e-3, torch.float64)
    return s / (1.0 + s)


def ddpm_linear_grid(steps: int = 1000, *, beta_start: float = 1e-4, beta_end: float = 0.02) -> torch.Tensor:
    """DDPM's own schedule as a linear-path grid: linear betas over ``steps`` training steps
    (``DDPMScheduler``'s defaults), every one a sampling step, VE ``sigma = sqrt((1 - ab) / ab)``.

    A k-diffusion drop-in takes VE sigmas: ``t / (1 - t)`` of this grid (the last level 0 stays 0).

    Returns:
        ``(steps + 1,)`` float64 linear-path levels, decreasing to 0 (``t = sigma / (1 + sigma)``).
    """
    check_int("steps", steps, 2)
    betas = torch.linspace(beta_start, beta_end, steps, dtype=torch.float64)
    ab = torch.cumprod(1.0 - betas, 0)
    s = ((1.0 - ab) / ab).sqrt().flip(0)
    t = s / (1.0 + s)
    return torch.cat([t, t.new_zeros(1)])


def karras_linear_grid(steps: int, sigma_min: float = 0.002, sigma_max: float = 80.0, rho: float = 7.0) -> torch.Tensor:
    """Karras et al.'s schedule (k-diffusion's ``get_sigmas_karras``) as a linear-path grid, for
    :func:`specforest.sample`'s ``sigmas=`` and :meth:`specforest.chains.Chain.build`.

    A k-diffusion drop-in takes the VE sigmas themselves: :func:`specforest.kdiffusion.get_sigmas_karras`.

    Returns:
        ``(steps + 1,)`` float64 ``t = sigma / (1 + sigma)``, decreasing from ``t_0 < 1`` to 0.

    Raises:
        TypeError / ValueError: naming ``steps``, ``sigma_min``, ``sigma_max`` or ``rho``.
    """
    check_int("steps", steps, 1)
    s = _karras(steps, sigma_min, sigma_max, rho, torch.float64)
    return s / (1.0 + s)
