"""Pixel-space parameterizations as velocities of the linear path (paper Sec. 5.2).

The library's one model contract is a velocity ``v(x, sigma, **cond)`` on the
linear path ``x_sigma = (1 - sigma) x_0 + sigma xi`` (``sigma = 1`` noise, 0
data), ``v(x, sigma) = E[xi - x_0 | x_sigma = x]``. The adapters here turn the
usual parameterizations of pixel-space networks into that form:

* :class:`EDMDenoiserVelocity`: an EDM denoiser ``D(y; s) ~ E[x_0 | y = x_0 + s xi]``
  (Karras et al. 2022, the paper's CIFAR-10 / FFHQ models);
* :class:`EpsilonPredictionVelocity` and :class:`X0PredictionVelocity`: VP / DDPM
  networks ``net(x_k, k)`` with ``x_k = sqrt(abar_k) x_0 + sqrt(1 - abar_k) xi``
  predicting ``xi`` or ``x_0`` (e.g. a diffusers ``UNet2DModel`` with the
  ``alphas_cumprod`` of its ``DDPMScheduler``), via :class:`VPDenoiser`, which
  also converts v-prediction (``v = sqrt(abar) xi - sqrt(1 - abar) x_0``); the
  diffusers UNet pipelines use it through
  :class:`specforest.diffusers.unet.UNetVelocity`.

Derivation (ERRATA 5). Write ``t`` for the linear-path noise level ``sigma`` and
``s(t) = t / (1 - t)`` for the EDM noise level. Dividing the state by ``1 - t``,

    x_t / (1 - t) = x_0 + (t / (1 - t)) xi = x_0 + s(t) xi,

so ``E[x_0 | x_t] = D(x_t / (1 - t); s(t))``. From ``x_t = (1 - t) x_0 + t xi``,
``E[xi | x_t] = (x_t - (1 - t) E[x_0 | x_t]) / t``, hence

    v(x_t, t) = E[xi | x_t] - E[x_0 | x_t] = (x_t - (1 - t) D - t D) / t
              = (x_t - D(x_t / (1 - t); t / (1 - t))) / t.

The paper prints ``(1/t) x_t - D(...)``, which drops the ``1/t`` on ``D``.

Clipping and endpoints. Networks are trained on a bounded range of noise levels
``[sigma_min, sigma_max]`` (EDM: ``[0.002, 80]``; the paper clips to
``[1e-3, 80]``), and ``s(t)`` leaves it near both ends of the path:

* ``t -> 1`` (``s -> inf``, the sampler's first, deterministic Euler step is at
  ``t = 1`` exactly): the denoiser is evaluated at ``sigma_max`` on the state
  rescaled to that noise level, ``y = (sigma_max / t) x_t`` (at ``t = 1``,
  ``x_1 = xi`` becomes ``sigma_max xi``, the input an EDM sampler starts from),
  and the velocity uses the well-conditioned ``E[xi | x_t] = (x_t - (1 - t) D) / t``,
  which is exact at ``t = 1`` (``v = x_1 - D``).
* ``t -> 0`` (``s -> 0``): ``y = x_t / (1 - t)`` stays finite, the denoiser is
  evaluated at ``sigma_min`` and the noise is estimated as the network's own
  ``E[xi | y] = (y - D) / sigma_min``, which stays bounded (dividing
  ``x_t - D`` by ``t`` would not): the noise estimate is frozen at its value at
  ``sigma_min``, and at ``t = 0`` the velocity is the exact limit ``-x`` up to
  that estimate (``O(sigma_min / tau^2)`` for data of scale ``tau``). The
  sampler never evaluates below the grid's smallest positive level (1e-3 on
  the flow-matching grid, where ``s`` is just above ``1e-3``); the guard keeps
  the adapter finite and continuous down to ``t = 0``.

Inside the range the two noise estimates coincide, so the adapter is exact:
with an exact denoiser it returns the exact velocity (tested against the closed
form of :class:`~specforest.models.GaussianMixture`).

Conditioning. Keyword arguments (for example ``class_labels``) are passed to the
network unchanged. Per-sample labels ``(batch,)`` go in :func:`specforest.sample`'s
``cond={"class_labels": labels}``: every call then receives the labels of the
trajectories its rows belong to. ``class_labels=None`` is unconditional use.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

import torch

from ..target import model_name
from ..validation import check_number, check_optional_int

__all__ = [
    "EDMDenoiserVelocity",
    "EpsilonPredictionVelocity",
    "VPDenoiser",
    "X0PredictionVelocity",
    "linear_to_edm_sigma",
    "vp_sigmas",
]

Denoiser = Callable[..., torch.Tensor]


def linear_to_edm_sigma(sigma: torch.Tensor) -> torch.Tensor:
    """EDM noise level ``s = t / (1 - t)`` of linear-path level ``t`` (``inf`` at ``t = 1``)."""
    return sigma / (1.0 - sigma)


def check_sigma_range(sigma_min: float, sigma_max: float) -> tuple[float, float]:
    """``(sigma_min, sigma_max)`` as floats if ``0 < sigma_min < sigma_max`` (an EDM denoiser's range).

    Raises:
        TypeError / ValueError: naming ``sigma_min`` or ``sigma_max``.
    """
    sigma_min = check_number("sigma_min", sigma_min, 0, lo_open=True)
    sigma_max = check_number("sigma_max", sigma_max, 0, lo_open=True)
    if sigma_min >= sigma_max:
        raise ValueError(f"need sigma_min < sigma_max, got {sigma_min} and {sigma_max}")
    return sigma_min, sigma_max


def _unwrap(out: Any) -> torch.Tensor:
    """A network's tensor output: diffusers' ``*Output(sample=...)``, a tuple, or a tensor."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "sample"):
        return out.sample
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"the network must return a tensor (or an object with .sample), got {type(out).__name__}")


class EDMDenoiserVelocity:
    """Linear-path velocity of an EDM denoiser (paper Sec. 5.2, ERRATA 5).

    ``v(x_t, t) = (x_t - D(x_t / (1 - t); t / (1 - t))) / t`` with the EDM noise
    level clipped to ``[sigma_min, sigma_max]``; see the module docstring for the
    derivation and the treatment of both ends of the path.

    Args:
        denoiser: ``D(y: (M, *shape), s: (M,), **cond) -> (M, *shape)``, an
            estimate of ``E[x_0 | y = x_0 + s xi]`` (EDM's preconditioned network).
        sigma_min: smallest EDM noise level the denoiser is evaluated at.
        sigma_max: largest EDM noise level the denoiser is evaluated at.
        row_bytes: peak bytes one row adds inside a call (the denoiser's
            activations), for :func:`specforest.memory.estimate`; ``None``: not
            declared (the estimate's default applies).

    Calling the instance, ``v = adapter(x, sigma, **cond)``: ``x: (M, *shape)``,
    ``sigma: (M,)`` or a scalar, linear-path levels in ``[0, 1]`` -> ``(M, *shape)``
    in ``x``'s dtype. The adapter's arithmetic runs in float64 when ``x`` is
    float64 and in float32 otherwise; the denoiser receives ``y`` in that dtype
    and keeps its own precision.

    Raises:
        TypeError: if the clipping range is not numbers or ``row_bytes`` not ``None`` or an int.
        ValueError: on an invalid clipping range or a negative ``row_bytes``, or (at call time)
            on ``sigma`` outside ``[0, 1]`` or of the wrong length.
    """

    def __init__(
        self, denoiser: Denoiser, sigma_min: float = 1e-3, sigma_max: float = 80.0, *, row_bytes: Optional[int] = None
    ) -> None:
        if not callable(denoiser):
            raise TypeError("denoiser must be callable as denoiser(y, s, **cond)")
        self.denoiser = denoiser
        self.row_bytes = check_optional_int("row_bytes", row_bytes, 0)
        self.sigma_min, self.sigma_max = check_sigma_range(sigma_min, sigma_max)

    def _denoise(self, y: torch.Tensor, s: torch.Tensor, **cond: Any) -> torch.Tensor:
        return _unwrap(self.denoiser(y, s, **cond))

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor | float, **cond: Any) -> torch.Tensor:
        return self._velocity(x, sigma, lambda y, s: self._denoise(y, s, **cond))

    def feature_numel(self, shape: tuple[int, ...]) -> int:
        """Numbers per row of the deep features a call can keep for a later cheap call
        (:meth:`with_features`, :meth:`from_features`: the protocol of ``draft="cached"``), for
        states of per-sample ``shape``; ``0`` when the denoiser has no ``deep`` and ``shallow``
        methods (:class:`~specforest.models.unet.EDMPrecond` has them). Made by one call on a zero
        row without conditioning."""
        if not (callable(getattr(self.denoiser, "deep", None)) and callable(getattr(self.denoiser, "shallow", None))):
            return 0
        param = next(iter(self.denoiser.parameters()), None) if hasattr(self.denoiser, "parameters") else None
        x = torch.zeros(1, *shape, device=None if param is None else param.device)
        with torch.no_grad():
            return int(self.with_features(x, torch.full((1,), 0.5))[1].shape[1])

    def with_features(
        self, x: torch.Tensor, sigma: torch.Tensor | float, **cond: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(v, feat)``: the velocity of :meth:`__call__` (the same numbers) and the denoiser's deep
        features ``(M, F)``, flattened per row, in the network's dtype."""
        kept: list = []

        def denoise(y: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            d, f = self.denoiser.deep(y, s, **cond)
            kept.append(f)
            return _unwrap(d)

        v = self._velocity(x, sigma, denoise)
        return v, kept[0].reshape(x.shape[0], -1)

    def from_features(
        self, x: torch.Tensor, sigma: torch.Tensor | float, feat: torch.Tensor, **cond: Any
    ) -> torch.Tensor:
        """The velocity at ``x (M, *shape)``, ``sigma`` with the deep features ``feat (M, F)`` of an
        earlier :meth:`with_features` call in place of the denoiser's lower resolutions (its
        ``shallow`` method): DeepCache's cheap evaluation, not the target's."""
        return self._velocity(x, sigma, lambda y, s: _unwrap(self.denoiser.shallow(y, s, feat, **cond)))

    def _velocity(
        self, x: torch.Tensor, sigma: torch.Tensor | float, denoise: Callable[[torch.Tensor, torch.Tensor], Any]
    ) -> torch.Tensor:
        """The velocity of :meth:`__call__` with ``denoise(y, s)`` as the denoiser."""
        if not isinstance(x, torch.Tensor) or x.ndim < 1:
            raise TypeError("x must be a tensor of shape (M, *shape)")
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        M = x.shape[0]
        t = torch.as_tensor(sigma, dtype=work, device=x.device).reshape(-1)
        if t.numel() == 1:
            t = t.expand(M)
        if t.numel() != M:
            raise ValueError(f"sigma must be a scalar or have shape ({M},), got {t.numel()} values")
        if not ((t >= 0) & (t <= 1)).all():
            raise ValueError("sigma (the linear-path noise level) must lie in [0, 1]")
        xw = x.to(work)
        bshape = (M,) + (1,) * (x.ndim - 1)
        one_m_t = 1.0 - t
        tiny = torch.finfo(work).tiny  # denominators of branches torch.where discards
        # EDM noise level s = t / (1 - t), computed without dividing by zero at t = 1
        s = torch.where(one_m_t > 0, t / one_m_t.clamp_min(tiny), torch.full_like(t, math.inf))
        high = s > self.sigma_max
        low = s < self.sigma_min
        s_c = s.clamp(self.sigma_min, self.sigma_max)
        # input scale: 1 / (1 - t) inside the range and below it, sigma_max / t above it
        scale = torch.where(high, self.sigma_max / t.clamp_min(tiny), 1.0 / one_m_t.clamp_min(tiny))
        y = xw * scale.reshape(bshape)
        d = denoise(y, s_c).to(work)
        if d.shape != x.shape:
            raise ValueError(f"the denoiser must return shape {tuple(x.shape)}, got {tuple(d.shape)}")
        if d.device != x.device:
            raise ValueError(
                f"the denoiser {model_name(self.denoiser)} returned its output on {d.device}, but the states it "
                f"was given are on {x.device}: return the denoised x0 on its input's device"
            )
        # E[xi | x_t]: from the state's decomposition where t is not small, from the
        # denoiser's own noise estimate below sigma_min (bounded as t -> 0)
        eps_state = (xw - one_m_t.reshape(bshape) * d) / t.clamp_min(tiny).reshape(bshape)
        eps_net = (y - d) / s_c.reshape(bshape)
        eps = torch.where(low.reshape(bshape), eps_net, eps_state)
        return (eps - d).to(x.dtype)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({type(self.denoiser).__name__}, "
            f"sigma_min={self.sigma_min:g}, sigma_max={self.sigma_max:g})"
        )


def vp_sigmas(alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """EDM noise levels ``sqrt((1 - abar_k) / abar_k)`` of a VP schedule, float64, shape ``(N,)``."""
    ac = torch.as_tensor(alphas_cumprod, dtype=torch.float64).detach().cpu().reshape(-1)
    return ((1.0 - ac) / ac).sqrt()


class VPDenoiser:
    """An EDM denoiser built from a VP / DDPM network that predicts noise, data or v.

    A VP state at timestep ``k`` is ``x_k = sqrt(abar_k) x_0 + sqrt(1 - abar_k) xi``;
    it has the signal-to-noise ratio of ``y = x_0 + s xi`` with
    ``s = sqrt((1 - abar_k) / abar_k)``, and ``x_k = y / sqrt(1 + s^2)``. So
    ``D(y; s)`` finds the (fractional) timestep ``k(s)`` of the same ratio, calls
    the network on ``y / sqrt(1 + s^2)`` and converts its output:
    ``D = y - s eps`` for noise prediction, ``D = x0`` for data prediction, and
    ``D = (x_k - s v) / sqrt(1 + s^2)`` for v-prediction: with ``a = sqrt(abar) =
    1 / sqrt(1 + s^2)`` and ``b = sqrt(1 - abar) = s a``, ``v = a xi - b x_0`` and
    ``x_k = a x_0 + b xi`` give ``a x_k - b v = (a^2 + b^2) x_0 = x_0``.

    Fractional timesteps: ``k(s)`` interpolates ``log s`` linearly between the
    integer timesteps (k-diffusion's ``DiscreteSchedule`` convention); a network
    that accepts float timesteps (diffusers' ``UNet2DModel`` does) sees them as
    is, ``quantize=True`` rounds to the nearest integer timestep instead (then the
    network sees a slightly different ratio than the state's).

    Args:
        net: ``net(x_k: (M, *shape), k: (M,), **cond)`` returning a tensor or an
            object with ``.sample`` (diffusers ``UNet2DOutput``).
        alphas_cumprod: ``(N,)`` cumulative products ``abar_k``, decreasing in ``k``,
            in ``(0, 1)``.
        prediction: ``"epsilon"``, ``"sample"`` or ``"v_prediction"`` (diffusers'
            ``prediction_type`` names).
        quantize: round timesteps to integers.

    Attributes:
        sigma_min, sigma_max: the EDM noise range ``[s_0, s_{N-1}]`` the schedule covers.
    """

    PREDICTIONS = ("epsilon", "sample", "v_prediction")

    def __init__(
        self,
        net: Callable[..., Any],
        alphas_cumprod: torch.Tensor,
        prediction: str = "epsilon",
        *,
        quantize: bool = False,
    ) -> None:
        if not callable(net):
            raise TypeError("net must be callable as net(x_k, k, **cond)")
        if prediction not in self.PREDICTIONS:
            raise ValueError(f"prediction must be one of {self.PREDICTIONS}, got {prediction!r}")
        ac = torch.as_tensor(alphas_cumprod, dtype=torch.float64).detach().cpu().reshape(-1)
        if ac.numel() < 2 or not torch.isfinite(ac).all() or (ac <= 0).any() or (ac >= 1).any():
            raise ValueError("alphas_cumprod must hold >= 2 values in (0, 1)")
        if (ac[1:] >= ac[:-1]).any():
            raise ValueError("alphas_cumprod must decrease strictly with the timestep")
        self.net, self.prediction, self.quantize = net, prediction, bool(quantize)
        self.log_sigmas = vp_sigmas(ac).log()
        self.sigma_min = float(self.log_sigmas[0].exp())
        self.sigma_max = float(self.log_sigmas[-1].exp())

    def timestep(self, s: torch.Tensor) -> torch.Tensor:
        """Fractional timestep ``k(s)`` of EDM noise levels ``s: (M,)``, clamped to ``[0, N - 1]``."""
        ls = self.log_sigmas.to(s.device)
        x = s.to(torch.float64).clamp_min(1e-300).log().clamp(ls[0], ls[-1])
        i = torch.searchsorted(ls, x, right=True).clamp(1, ls.numel() - 1)
        lo, hi = ls[i - 1], ls[i]
        k = (i - 1).to(torch.float64) + (x - lo) / (hi - lo)
        return k.round() if self.quantize else k

    def __call__(
        self, y: torch.Tensor, s: torch.Tensor, *, timestep: Optional[torch.Tensor] = None, **cond: Any
    ) -> torch.Tensor:
        """``D (M, *shape)`` of VE states ``y (M, *shape)`` at levels ``s (M,)``; the network is called at
        ``timestep (M,)`` where the caller has the scheduler's own (a chain's declared time input), else at
        :meth:`timestep` of ``s``."""
        work = torch.float64 if y.dtype == torch.float64 else torch.float32
        s_b = s.to(work).reshape((-1,) + (1,) * (y.ndim - 1))
        x_k = y.to(work) / (1.0 + s_b * s_b).sqrt()
        k = (self.timestep(s) if timestep is None else timestep.to(s.device)).to(work)
        out = _unwrap(self.net(x_k, k, **cond)).to(work)
        if out.shape != y.shape:
            raise ValueError(f"the network must return shape {tuple(y.shape)}, got {tuple(out.shape)}")
        if out.device != y.device:
            raise ValueError(
                f"the network {model_name(self.net)} returned its output on {out.device}, but the states it was "
                f"given are on {y.device}: return its prediction on its input's device"
            )
        if self.prediction == "epsilon":
            return y.to(work) - s_b * out
        if self.prediction == "v_prediction":
            return (x_k - s_b * out) / (1.0 + s_b * s_b).sqrt()
        return out

    def __repr__(self) -> str:
        return (
            f"VPDenoiser({type(self.net).__name__}, prediction={self.prediction!r}, "
            f"sigma=[{self.sigma_min:.4g}, {self.sigma_max:.4g}])"
        )


class _VPVelocity(EDMDenoiserVelocity):
    """A VP network as an EDM denoiser, clipped to its schedule's noise range."""

    prediction = "epsilon"

    def __init__(self, net: Callable[..., Any], alphas_cumprod: torch.Tensor, *, quantize: bool = False) -> None:
        vp = VPDenoiser(net, alphas_cumprod, self.prediction, quantize=quantize)
        super().__init__(vp, sigma_min=vp.sigma_min, sigma_max=vp.sigma_max)


class EpsilonPredictionVelocity(_VPVelocity):
    """Linear-path velocity of a VP network that predicts the noise ``xi``.

    Linear-path level ``t`` has the signal-to-noise ratio ``(1 - t)^2 / t^2``;
    the VP timestep with ``abar / (1 - abar)`` equal to it is found through the
    EDM level ``s = t / (1 - t) = sqrt((1 - abar) / abar)``, the state is rescaled
    to ``x_k = x_t / sqrt((1 - t)^2 + t^2)`` (``= y / sqrt(1 + s^2)`` with
    ``y = x_t / (1 - t)``), and the prediction ``eps`` gives
    ``E[x_0 | x_t] = y - s eps`` and the velocity of :class:`EDMDenoiserVelocity`
    (inside the schedule's range, ``v = (eps - x_t) / (1 - t)``, i.e. ``eps - x0``).
    Noise levels outside the schedule's ``[s_0, s_{N-1}]`` are clipped to it.

    Args:
        net: ``net(x_k, k, **cond)``, e.g. a diffusers ``UNet2DModel``
            (``class_labels=...`` for class-conditional ones).
        alphas_cumprod: ``(N,)`` the schedule's ``abar_k`` (``DDPMScheduler.alphas_cumprod``).
        quantize: round timesteps to integers (see :class:`VPDenoiser`).
    """

    prediction = "epsilon"


class X0PredictionVelocity(_VPVelocity):
    """Linear-path velocity of a VP network that predicts the data ``x_0``.

    As :class:`EpsilonPredictionVelocity`, with ``E[x_0 | x_t]`` the network's
    output itself (diffusers' ``prediction_type="sample"``); inside the
    schedule's range ``v = (x_t - x0) / t``.

    Args:
        net: ``net(x_k, k, **cond)`` predicting ``x_0``.
        alphas_cumprod: ``(N,)`` the schedule's ``abar_k``.
        quantize: round timesteps to integers (see :class:`VPDenoiser`).
    """

    prediction = "sample"
