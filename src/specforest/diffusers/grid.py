"""The time grid of diffusers' ``FlowMatchEulerDiscreteScheduler``, rebuilt as data.

:func:`scheduler_sigmas` reproduces the scheduler's ``set_timesteps`` from its
config alone (static or dynamic shift, ``shift_terminal``, the scheduler's own
levels or the ones a pipeline passes), so the pipeline's scheduler is never
touched; :func:`flux_sigmas` is the grid ``FluxPipeline`` asks it for
(``linspace(1, 1/T, T)``, shifted once). The VP grid of the UNet pipelines is
:func:`specforest.diffusers.unet.vp_schedule`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Optional

import torch

from ..validation import check_int, check_number

__all__ = ["flux_sigmas", "scheduler_sigmas"]

# Scheduler options that replace the shifted linspace by another family of grids.
_UNSUPPORTED_SCHEDULER_OPTIONS = (
    "use_karras_sigmas",
    "use_exponential_sigmas",
    "use_beta_sigmas",
    "invert_sigmas",
)


def _calculate_shift(image_seq_len: int, config: Mapping) -> float:
    """``mu`` of dynamic shifting, as the SD3 pipeline computes it (linear in the sequence length)."""
    base_len = config.get("base_image_seq_len", 256)
    max_len = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.5)
    max_shift = config.get("max_shift", 1.16)
    m = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * m + base_shift - m * base_len


def scheduler_sigmas(
    config: Mapping,
    steps: int,
    *,
    shift: float | None = None,
    image_seq_len: int | None = None,
    sigmas: torch.Tensor | Sequence[float] | None = None,
) -> torch.Tensor:
    """The grid of a ``FlowMatchEulerDiscreteScheduler`` with this config, in float64.

    Reproduces ``set_timesteps(steps)`` (``mu`` from ``image_seq_len`` under
    dynamic shifting, as the SD3 pipeline passes it) without touching any
    scheduler. With a static shift ``kappa`` (eq. 38) diffusers' grid is::

        s_min = kappa (1/N) / (1 + (kappa - 1) / N)          # N = num_train_timesteps
        sigmas = shift_kappa(linspace(1, s_min, T)), then 0

    i.e. the smallest level is shifted twice (the scheduler shifts its
    training levels at construction and the inference grid again); for
    ``kappa = 3``, ``T = 50`` this differs from ``shift_kappa(linspace(1, 1/N, T))``
    (:func:`specforest.flow_match_grid`) by up to 6e-3.

    With ``sigmas`` (``set_timesteps(sigmas=..., mu=...)``, as ``FluxPipeline``
    calls it with ``linspace(1, 1/T, T)``) those levels are shifted once,
    statically or dynamically, instead of the scheduler's own.

    Args:
        config: the scheduler's ``config`` (e.g. ``pipe.scheduler.config``).
        steps: number of steps ``T >= 1``.
        shift: a static shift ``kappa > 0`` that overrides the config (as a
            scheduler built with ``shift=kappa, use_dynamic_shifting=False``);
            ``None`` uses the config as it is.
        image_seq_len: image tokens ``(h / p) (w / p)`` (Flux: the packed sequence
            length ``(h / 2) (w / 2)``); needed only when the config uses dynamic shifting.
        sigmas: ``(T,)`` unshifted levels in ``(0, 1]``, decreasing, as passed to
            ``set_timesteps(sigmas=...)``; ``None``: the scheduler's own.

    Returns:
        ``(T + 1,)`` float64 noise levels, decreasing from 1 to 0. The first and
        last steps are deterministic Euler steps in the sampler.

    Raises:
        ValueError: on invalid arguments, or a config that uses Karras,
            exponential, beta or inverted sigmas (not a shifted linspace).
    """
    steps = check_int("num_inference_steps", steps, 1)
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping (scheduler.config), got {type(config).__name__}")
    bad = [k for k in _UNSUPPORTED_SCHEDULER_OPTIONS if config.get(k)]
    if bad:
        raise ValueError(
            f"scheduler config sets {', '.join(bad)}; only shifted linear grids (static or dynamic "
            "shift, shift_terminal) are supported"
        )
    N = int(config.get("num_train_timesteps", 1000))
    if N < 2:
        raise ValueError(f"scheduler num_train_timesteps must be >= 2, got {N}")
    dynamic = bool(config.get("use_dynamic_shifting", False)) and shift is None
    kappa = check_number("shift", float(config.get("shift", 1.0)) if shift is None else shift, 0.0, lo_open=True)

    def static(s: torch.Tensor) -> torch.Tensor:
        return kappa * s / (1.0 + (kappa - 1.0) * s)

    if sigmas is not None:
        base = torch.as_tensor(sigmas, dtype=torch.float64).flatten()
        if base.numel() != steps:
            raise ValueError(f"sigmas has {base.numel()} levels but num_inference_steps={steps}")
        if not (torch.isfinite(base).all() and (base > 0).all() and (base <= 1).all()):
            raise ValueError("sigmas must be finite levels in (0, 1]")
        if steps > 1 and not (base[1:] < base[:-1]).all():
            raise ValueError("sigmas must be strictly decreasing")
    s_min = torch.tensor(1.0 / N, dtype=torch.float64)
    if dynamic:
        if image_seq_len is None:
            raise ValueError("the scheduler uses dynamic shifting: image_seq_len is required")
        mu = _calculate_shift(int(image_seq_len), config)
        kind = config.get("time_shift_type", "exponential")
        if kind not in ("exponential", "linear"):
            raise ValueError(f"scheduler time_shift_type must be 'exponential' or 'linear', got {kind!r}")
        scale = math.exp(mu) if kind == "exponential" else mu
        s = torch.linspace(1.0, float(s_min), steps, dtype=torch.float64) if sigmas is None else base
        s = scale / (scale + (1.0 / s - 1.0))
    elif sigmas is not None:
        s = static(base)
    else:
        s = static(torch.linspace(1.0, float(static(s_min)), steps, dtype=torch.float64))
    terminal = config.get("shift_terminal")
    if terminal:
        if steps < 2:
            raise ValueError("a scheduler with shift_terminal needs num_inference_steps >= 2 (diffusers gives NaN)")
        one_minus = 1.0 - s
        s = 1.0 - one_minus / (one_minus[-1] / (1.0 - float(terminal)))
    return torch.cat([s, s.new_zeros(1)])


def flux_sigmas(config: Mapping, steps: int, image_seq_len: int, *, shift: Optional[float] = None) -> torch.Tensor:
    """``FluxPipeline``'s grid: ``set_timesteps(sigmas=linspace(1, 1/T, T), mu=calculate_shift(seq))``.

    Args:
        config: the scheduler's config (``use_dynamic_shifting`` for dev, a static
            shift for schnell).
        steps: ``T >= 1``.
        image_seq_len: the packed sequence length ``(h/2) (w/2)`` (``mu`` under dynamic shifting).
        shift: a static shift overriding the config, as in :func:`scheduler_sigmas`.

    Returns:
        ``(T + 1,)`` float64 levels from 1 to 0.
    """
    steps = check_int("num_inference_steps", steps, 1)
    base = torch.linspace(1.0, 1.0 / steps, steps, dtype=torch.float64)
    return scheduler_sigmas(config, steps, shift=shift, image_seq_len=image_seq_len, sigmas=base)
