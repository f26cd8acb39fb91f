"""Every time grid and noise schedule of the library: the one module that makes them.

Two kinds of level live in this library, and a schedule function says which it returns:

* **VE sigmas** (k-diffusion, ComfyUI's ``EPS`` models): ``x = x_0 + sigma xi``, from ``sigma_max``
  (often 80) down to 0. The k-diffusion drop-ins (:mod:`specforest.kdiffusion`) take these, as
  k-diffusion's samplers do. :func:`get_sigmas_karras`, :func:`get_sigmas_exponential`,
  :func:`get_sigmas_polyexponential` and :func:`get_sigmas_vp` are k-diffusion's own functions (names,
  signatures, torch's default dtype, a 0 appended), re-exported by :mod:`specforest.kdiffusion`;
  :func:`vp_sigmas` reads a discrete VP schedule (``alphas_cumprod``) at its timesteps.
* **Linear-path levels** ``t`` in ``[0, 1]`` of ``x_t = (1 - t) x_0 + t xi`` (``t = sigma / (1 + sigma)``
  for VE sigmas, :func:`linear_grid`): what :func:`specforest.sample`'s ``sigmas=`` and
  :meth:`specforest.chains.Chain.build` take. A grid is a ``(T + 1,)`` float64 tensor decreasing
  strictly from at most 1 to exactly 0 (:func:`check_sigmas`); step ``n`` moves a state from level
  ``n`` to level ``n + 1``. :func:`named_grid` makes a named grid (:data:`GRIDS`, the ``grid`` option:
  :func:`flow_match_grid`, :func:`uniform_grid`, shifted by :func:`shift_sigmas`), :func:`schedule_grid`
  a named schedule's (:data:`SCHEDULES`, the ``schedule`` option), and :func:`karras_linear_grid`,
  :func:`ddpm_linear_grid` those two schedules with their own parameters.

A VE schedule may lie below 1 everywhere (``sigma_max = 0.9``): the two kinds cannot be told apart from
their values, only from the function that made them (:data:`PATHS`). The grids of a diffusers
pipeline's scheduler are read from the scheduler itself (:mod:`specforest.diffusers.grid`,
:func:`specforest.diffusers.unet.vp_schedule`).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .validation import check_choice, check_int, check_number

__all__ = [
    "GRIDS",
    "MAX_STEPS",
    "PATHS",
    "SCHEDULES",
    "SCHEDULE_SIGMA_RANGE",
    "check_sigmas",
    "ddpm_discrete_sigmas",
    "ddpm_linear_grid",
    "flow_match_grid",
    "get_sigmas_exponential",
    "get_sigmas_karras",
    "get_sigmas_polyexponential",
    "get_sigmas_vp",
    "karras_linear_grid",
    "linear_grid",
    "named_grid",
    "schedule_grid",
    "shift_sigmas",
    "uniform_grid",
    "ve_scale",
    "vp_sigmas",
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
    return _append_zero(vp_sigmas(ab, torch.linspace(train_steps - 1, 0, steps, dtype=torch.float64)))


def vp_sigmas(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """The VE levels ``sigma = sqrt((1 - ab) / ab)`` of a discrete VP schedule at (fractional) timesteps:
    ``log sigma`` interpolated linearly between training steps (k-diffusion's ``DiscreteSchedule``; the
    inverse of :meth:`specforest.models.edm.VPDenoiser.timestep`'s map), timesteps clamped to ``[0, N - 1]``.

    Args:
        alphas_cumprod: ``(N,)`` the schedule's ``ab_k`` in ``(0, 1)``, ``N >= 2``.
        timesteps: ``(T,)`` timesteps ``k``, floating.

    Returns:
        ``(T,)`` VE sigmas, in the timesteps' dtype.
    """
    log_sigmas = ((1.0 - alphas_cumprod) / alphas_cumprod).sqrt().log()
    n = log_sigmas.numel()
    k = timesteps.clamp(0, n - 1)
    i = k.floor().long().clamp(0, n - 2)
    w = k - i.to(k.dtype)
    return ((1.0 - w) * log_sigmas[i] + w * log_sigmas[i + 1]).exp()


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


PATHS = ("ve", "linear")
"""A sampler's noise levels: ``ve`` (``x = x_0 + sigma xi``, k-diffusion and EDM) or ``linear``
(``x = (1 - sigma) x_0 + sigma xi``, ComfyUI's ``CONST``: SD3, Flux)."""


MAX_STEPS = 1_000_000
"""Most grid steps a named grid takes (a million Euler steps is far past any use; the grid and the
run's per-step tables would otherwise be allocated before anything says the run cannot fit)."""


def _check_steps(steps: int) -> None:
    check_int("steps", steps, 1)
    if steps > MAX_STEPS:
        raise ValueError(f"steps must be in [1, {MAX_STEPS}], got {steps}")


def _check_grid(sigmas: torch.Tensor, steps: int, shift: float) -> torch.Tensor:
    """``sigmas`` if the shifted grid still decreases strictly; a shift so extreme that float64 rounds
    its noise levels together would otherwise be reported as a bad ``sigmas`` the caller never gave."""
    if bool((sigmas[:-1] <= sigmas[1:]).any()):
        raise ValueError(
            f"shift={shift} collapses the {steps}-step grid: its noise levels round to the same "
            f"float64 value (got {sigmas[:3].tolist()} ... {sigmas[-3:].tolist()}); use a shift closer to 1"
        )
    return sigmas


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """Apply the timestep shift of paper eq. (38), ``kappa s / (1 + (kappa - 1) s)``.

    Args:
        sigmas: noise levels in [0, 1], any shape.
        shift: ``kappa > 0``; 1 leaves the grid unchanged.

    Returns:
        The shifted noise levels, same shape; 0 and 1 are fixed points (exactly: the formula
        rounds at 1 for a shift far from 1, which would make the first step stochastic).

    Raises:
        TypeError: if ``shift`` is not a real number (``bool`` is refused).
        ValueError: if ``shift`` is not a finite positive number.
    """
    shift = check_number("shift", shift, 0.0, lo_open=True)
    out = shift * sigmas / (1.0 + (shift - 1.0) * sigmas)
    return torch.where((sigmas == 0) | (sigmas == 1), sigmas, out)


def flow_match_grid(steps: int, *, shift: float = 1.0, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The grid of diffusers' ``FlowMatchEulerDiscreteScheduler`` at its defaults.

    Noise levels ``linspace(1, 1/num_train_timesteps, steps)`` (optionally
    shifted), then 0. The authors' public code runs the Gaussian-mixture
    experiment on this grid. Its first step (from 1) and last step (into 0) are
    deterministic.

    Args:
        steps: number of steps ``1 <= T <=`` :data:`MAX_STEPS`.
        shift: timestep shift ``kappa`` of eq. (38).
        num_train_timesteps: the scheduler's training horizon (1000 in diffusers).

    Returns:
        ``sigmas`` of shape ``(T + 1,)``, float64, decreasing from 1 to 0.

    Raises:
        ValueError / TypeError: naming ``steps`` or ``shift`` (also a shift so far from 1 that
        the grid's levels round together).
    """
    _check_steps(steps)
    check_int("num_train_timesteps", num_train_timesteps, 2)
    s = torch.linspace(1.0, 1.0 / num_train_timesteps, steps, dtype=torch.float64)
    s = shift_sigmas(s, shift)
    return _check_grid(torch.cat([s, s.new_zeros(1)]), steps, shift)


def uniform_grid(steps: int, *, shift: float = 1.0) -> torch.Tensor:
    """The paper's uniform grid ``t_n = n / T``, i.e. ``sigma_n = 1 - n / T``.

    Args:
        steps: number of steps ``1 <= T <=`` :data:`MAX_STEPS`.
        shift: timestep shift ``kappa`` of eq. (38), applied to the noise levels.

    Returns:
        ``sigmas`` of shape ``(T + 1,)``, float64, from 1 to 0. The first and
        last steps are deterministic.

    Raises:
        ValueError / TypeError: as :func:`flow_match_grid`.
    """
    _check_steps(steps)
    s = 1.0 - torch.arange(steps + 1, dtype=torch.float64) / steps
    return _check_grid(shift_sigmas(s, shift), steps, shift)


def check_sigmas(s: object, monotone: bool = True) -> torch.Tensor:
    """``sigmas`` as a float64 CPU tensor if it is a strictly decreasing grid from at most 1 to exactly 0
    (with ``monotone=False``: levels in ``[0, 1]`` ending in 0, as a churned chain's states are)."""
    if not isinstance(s, torch.Tensor) or s.ndim != 1 or s.numel() < 2:
        raise ValueError("sigmas must be a 1-D tensor of T + 1 >= 2 noise levels")
    s = s.detach().to("cpu", torch.float64)
    if not torch.isfinite(s).all():
        raise ValueError("sigmas must be finite")
    if not monotone:
        if (s > 1.0).any() or (s[:-1] <= 0.0).any() or s[-1] != 0.0:
            raise ValueError("a chain's state levels must lie in (0, 1] and end in exactly 0")
        return s
    if s[0] > 1.0 or s[-1] != 0.0 or (s[:-1] <= s[1:]).any():
        raise ValueError(
            "sigmas must decrease strictly from at most 1 to exactly 0, "
            f"got first {s[0].item():.6g} and last {s[-1].item():.6g}"
        )
    return s


GRIDS = ("flow_match", "uniform")
"""The named grids of the ``grid`` option."""


def named_grid(grid: str, steps: int, *, shift: float = 1.0) -> torch.Tensor:
    """The linear-path grid named ``grid`` (:data:`GRIDS`, the ``grid`` option) of ``steps`` steps:
    :func:`flow_match_grid` or :func:`uniform_grid`, shifted by ``shift``.

    Returns:
        ``(T + 1,)`` float64 levels from 1 to 0.

    Raises:
        ValueError / TypeError: naming ``grid`` (and the grids), ``steps`` or ``shift``.
    """
    check_choice("grid", grid, GRIDS)
    return flow_match_grid(steps, shift=shift) if grid == "flow_match" else uniform_grid(steps, shift=shift)


def _check_schedule(sigmas: Any, path: str) -> torch.Tensor:
    """``sigmas`` as a float64 CPU tensor if it is a k-diffusion schedule on ``path`` (:data:`PATHS`)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if not isinstance(sigmas, torch.Tensor):
        raise TypeError(f"sigmas must be a 1-D torch.Tensor (a k-diffusion schedule), got {type(sigmas).__name__}")
    if sigmas.ndim != 1 or sigmas.numel() < 2:
        raise ValueError(f"sigmas must be a 1-D tensor of T + 1 >= 2 noise levels, got shape {tuple(sigmas.shape)}")
    s = sigmas.detach().to("cpu", torch.float64)
    if not torch.isfinite(s).all():
        raise ValueError("sigmas must be finite")
    if s[-1] != 0.0:
        raise ValueError(f"sigmas must end in 0 (a k-diffusion schedule), got last {s[-1].item():.6g}")
    if (s[:-1] <= s[1:]).any():
        n = int(torch.nonzero(s[:-1] <= s[1:])[0, 0])
        raise ValueError(
            f"sigmas must decrease strictly, got sigmas[{n}] = {s[n].item():.6g} <= sigmas[{n + 1}] = {s[n + 1].item():.6g}"
        )
    if path == "linear" and s[0] > 1.0:
        raise ValueError(
            f"with path='linear' sigmas are linear-path levels in [0, 1], got sigmas[0] = {s[0].item():.6g}"
        )
    return s


def linear_grid(sigmas: torch.Tensor, path: str = "ve") -> torch.Tensor:
    """The library's grid of a k-diffusion schedule: ``t_i = sigma_i / (1 + sigma_i)`` (``path="ve"``).

    Args:
        sigmas: ``(T + 1,)`` k-diffusion schedule, strictly decreasing, ending in 0.
        path: ``"ve"`` or ``"linear"`` (the levels are already linear-path levels, returned as they are).

    Returns:
        ``(T + 1,)`` float64 CPU tensor, decreasing from ``t_0 < 1`` (``<= 1`` for ``linear``) to 0.

    Raises:
        TypeError / ValueError: naming ``sigmas`` or ``path``.
    """
    s = _check_schedule(sigmas, path)
    return s / ve_scale(s) if path == "ve" else s


def ve_scale(sigma: torch.Tensor) -> torch.Tensor:
    """``1 + sigma``: a VE state is ``x = (1 + sigma) x_lin`` at linear-path level ``t = sigma / (1 + sigma)``
    (:func:`linear_grid`; the k-diffusion drop-ins scale their states by it)."""
    return 1.0 + sigma
