"""The stochastic samplers people run, as chains the engine speculates exactly.

Each sampler here moves its state by a Gaussian whose covariance does not
depend on the network: ``x' ~ N(P x + Q D, R^2 I)`` in the sampler's own
coordinates, with ``D`` the model's clean-image prediction and ``P, Q, R``
functions of the schedule alone. Written in the library's coordinates (the
linear path ``y = (1 - t) x_0 + t xi``, velocity ``v``, ``D = y - t v``) it is a
:class:`~specforest.sde.GaussianChain`: ``y' ~ N(a y + c v, scale^2 I)``. A
:class:`Chain` holds a sampler's parameters and turns a grid into those
tables (:meth:`Chain.build`); the engine, the couplings and the drafts see
only the tables, so every coupling, tree, draft and execution mode works on
every chain and keeps its law.

The grid is the library's, ``t_n`` on the linear path. A sampler written on
VE noise levels (k-diffusion, ComfyUI's ``EPS`` models) reads
``sigma_n = t_n / (1 - t_n)`` (:func:`specforest.kdiffusion.linear_grid` is the
inverse); its state is ``x = y / (1 - t)``. A VE sampler's first level must be
finite (``t_0 < 1``), except where its step has a finite limit there.

Registered (:func:`available_chains`; :func:`register_chain` adds one):

* ``em``: the paper's Euler-Maruyama step with churn (:class:`~specforest.reverse_sde.ReverseSDE`);
* ``euler_ancestral``: k-diffusion's ``sample_euler_ancestral`` (``eta``, ``s_noise``) on VE
  levels, or ComfyUI's ``sample_euler_ancestral_RF`` with ``path="linear"``;
* ``euler``: EDM's churned Euler (k-diffusion's ``sample_euler`` with ``s_churn``), as a chain on
  the churned state ``x-hat``;
* ``ddpm``: ancestral DDPM (ComfyUI's ``sample_ddpm``), ``variance`` ``fixed_small`` or ``fixed_large``;
* ``ddim``: DDIM with ``eta > 0``;
* ``lcm``: LCM's re-noising step (ComfyUI's ``sample_lcm``);
* ``dpmpp_2m_sde``: k-diffusion's ``sample_dpmpp_2m_sde`` (``eta``, ``s_noise``, ``solver_type``), a
  multistep chain whose mean also reads the previous step's prediction (``history = 1``);
* ``dpmpp_3m_sde``: k-diffusion's ``sample_dpmpp_3m_sde`` (``eta``, ``s_noise``), whose mean reads the
  two previous steps' predictions (``history = 2``);
* ``heun``: EDM's Algorithm 2 (k-diffusion's ``sample_heun`` with ``s_churn``), two model calls a step
  (``stages = 2``), as a chain on the churned state like ``euler``;
* ``dpm_2``: k-diffusion's ``sample_dpm_2`` (DPM-Solver-2 with churn), two calls a step, on the churned state;
* ``dpm_2_ancestral``, ``dpmpp_2s_ancestral``: k-diffusion's ``sample_dpm_2_ancestral`` and
  ``sample_dpmpp_2s_ancestral`` (``eta``, ``s_noise``), two calls a step;
* ``dpmpp_sde``: k-diffusion's ``sample_dpmpp_sde`` (``eta``, ``s_noise``, ``r``), whose two noises a step are
  correlated: a chain of half-steps, the end's mean reading what the step's start carries (``history = 1``); with
  ``path="linear"`` ComfyUI's ``sample_dpmpp_sde`` for ``CONST`` models.

``../shared/research/samplers.md`` (in the project's notes) and ``docs/chains.md`` give
each update as its code does it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, ClassVar

import torch

from .registry import Registry
from .reverse_sde import ReverseSDE
from .schedules import PATHS, check_sigmas, ddpm_linear_grid, karras_linear_grid
from .sde import GaussianChain
from .stages import Stages
from .validation import check_choice, check_number

__all__ = [
    "DDIM",
    "DDPM",
    "DPMPP2MSDE",
    "DPMPP3MSDE",
    "DPMPPSDE",
    "DPM2Ancestral",
    "DPM2Churn",
    "DPMPP2SAncestral",
    "EM",
    "REFUSED",
    "LCM",
    "PARAMETERS",
    "Chain",
    "EulerAncestral",
    "EulerChurn",
    "HeunChurn",
    "Transitions",
    "available_chains",
    "check_ddim_eta",
    "get_chain",
    "register_chain",
    "unregister_chain",
    "ddpm_linear_grid",
    "from_ve",
    "karras_linear_grid",
    "stage_from_ve",
]


class Transitions(GaussianChain):
    """The tables of a :class:`Chain` on one grid (see :class:`~specforest.sde.GaussianChain`).

    Args:
        chain: the chain that made them (its name and parameters are the record's).
        sigmas: ``(T + 1,)`` linear-path levels of the states.
        a, c, scale: ``(T,)`` float64 per-step coefficients (``mean = a y + c v``).
        past: ``(T, h)`` float64 coefficients of the past predictions (a multistep chain's, ``h`` its
            :attr:`Chain.history`), or ``None``.
        stages: the stage tableau of a chain of :attr:`Chain.stages` ``> 1`` (:class:`~specforest.stages.Stages`), or ``None``.
        carry: ``(T, 2)`` float64 ``(k_y, k_v)``, what a state hands its children to carry, ``k_y y + k_v v``
            (:attr:`~specforest.sde.GaussianChain.carries`), or ``None``: its prediction.
        init_a, init_scale: the start ``init_a x + init_scale z`` (see :class:`~specforest.sde.GaussianChain`).
        times: ``(T, s)`` float64, the model's own time input at each step's calls (:meth:`Chain.call_times`), or
            ``None``: the model maps the level.
    """

    def __init__(
        self,
        chain: "Chain",
        sigmas: torch.Tensor,
        a: torch.Tensor,
        c: torch.Tensor,
        scale: torch.Tensor,
        init_a: float = 1.0,
        init_scale: float = 0.0,
        past: "torch.Tensor | None" = None,
        stages: "Stages | None" = None,
        carry: "torch.Tensor | None" = None,
        times: "torch.Tensor | None" = None,
    ) -> None:
        self.chain = chain
        self.name = chain.name
        # EDM's churn raises the level where its window begins: only a grid must decrease
        self._set_tables(
            sigmas,
            a,
            c,
            scale,
            init_a=init_a,
            init_scale=init_scale,
            monotone=False,
            past=past,
            stages=stages,
            carry=carry,
            times=times,
        )

    @property
    def params(self) -> dict:
        return self.chain.params


@dataclass(frozen=True)
class Chain:
    """A stochastic sampler's parameters; :meth:`build` makes its tables on a grid.

    A subclass is a frozen dataclass of its parameters (validated in ``__post_init__``)
    with a :attr:`name` and :meth:`step`: the sampler's step ``x' = P x + Q D + R z``
    from level ``t`` to ``t'`` in the linear path's coordinates (``P, Q, R`` per step).

    Its shape is declared, and the engine reads only the declaration: :attr:`history`, how many
    past predictions its mean reads. A multistep sampler declares ``history = h`` and returns their
    coefficients from :meth:`past`: ``x' = P x + Q D + past_0 D_1 + ... + past_{h-1} D_h + R z`` with
    ``D_j`` the prediction ``j`` steps before; the engine carries them
    (:class:`~specforest.carried.Carried`), whatever ``h``. What a state hands on need not be its
    prediction: :meth:`carries` declares another fixed combination of the state and its prediction
    (``dpmpp_sde`` hands its half-step's end the start's part of its mean).

    And :attr:`stages`, how many model calls a step makes: a chain of ``s > 1`` stages returns its
    tableau from :meth:`stage_points` (each stage's level and point, linear in the state and the
    earlier stages' predictions, and each prediction's weight in the mean); the engine makes ``s``
    sequential batched calls a round (:mod:`specforest.stages`). ``P, Q, R`` of :meth:`step` are then
    the step's with ``D`` the weighted prediction ``D_eff = sum_k w_k D_k``.

    A model maps a call's level to its own time input. Where the level does not give it, :meth:`call_times`
    declares the time input of each step's calls, and the engine hands it to the model with the call (a
    diffusers scheduler whose two calls at one level pass the network two timesteps).
    """

    name: ClassVar[str] = "chain"
    history: ClassVar[int] = 0
    """How many past clean-image predictions the mean reads (0: a one-step sampler)."""
    stages: ClassVar[int] = 1
    """How many model calls a step makes (1: one call at the state)."""

    @property
    def params(self) -> dict:
        """The parameters, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def step(self, t: torch.Tensor, t_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(P, Q, R)``, each ``(T,)`` float64: ``y' = P y + Q D + R z`` from ``t (T,)`` to ``t_next (T,)``."""
        raise NotImplementedError

    def past(self, t: torch.Tensor, t_next: torch.Tensor) -> "torch.Tensor | None":
        """``past (T, history)`` float64, the coefficients of the predictions ``1 .. history`` steps before
        (linear coordinates), or ``None`` for a one-step sampler (the default). Where a step has no
        such prediction (step ``n <= j`` for ``past[:, j]``) :meth:`build` sets the coefficient to 0."""
        return None

    def carries(self, t: torch.Tensor, t_next: torch.Tensor) -> "torch.Tensor | None":
        """What a chain of :attr:`history` ``> 0`` carries from each state: ``(u, w) (T, 2)`` float64, the quantity
        ``u y + w D`` of a state ``y`` at step ``n`` (level ``t[n]``, linear coordinates) with prediction ``D``,
        which :meth:`past`'s coefficients of the next steps multiply in place of ``D``. ``None`` (the default):
        the prediction itself (``u = 0``, ``w = 1``), what a multistep sampler reads."""
        return None

    def stage_points(self, sigmas: torch.Tensor) -> "tuple | None":
        """The tableau of a chain of :attr:`stages` ``s > 1`` on the grid ``sigmas`` (the states of
        :meth:`coefficients`), in the linear path's coordinates: ``(level (T, s), alpha (T, s),
        beta (T, s, s), weight (T, s))`` float64 (:class:`~specforest.stages.Stages`; stage 0 is the
        state itself: ``level[:, 0]`` its level, ``alpha[:, 0] = 1``). ``None`` (the default) for one stage.
        :func:`stage_from_ve` writes a VE sampler's stage in these coordinates."""
        return None

    def call_times(self, sigmas: torch.Tensor) -> "torch.Tensor | None":
        """``(T, s)`` float64, the model's own time input at each step's :attr:`stages` calls on the grid ``sigmas``
        (stage ``k`` of step ``n`` at ``[n, k]``), for a chain whose model is called at times its levels do not
        give; the engine passes it with each call (:class:`~specforest.target.Target`: as ``timestep`` to a
        model that declares ``takes_timestep``). ``None`` (the default): the model maps each call's level."""
        return None

    def coefficients(self, sigmas: torch.Tensor) -> tuple:
        """``(states (T + 1,), P, Q, R (T,), init_a, init_scale)`` of the chain on the grid ``sigmas``.

        The states sit on the grid itself, and the chain starts from the caller's ``x``, for every
        chain but EDM's churned Euler; the default applies :meth:`step` between grid levels.
        """
        P, Q, R = self.step(sigmas[:-1], sigmas[1:])
        return sigmas, P, Q, R, 1.0, 0.0

    def build(self, sigmas: torch.Tensor) -> Transitions:
        """The chain's tables on ``sigmas`` (``(T + 1,)`` linear-path levels, decreasing to 0).

        Raises:
            ValueError: if the grid is not one, or the sampler is not defined on it (a VE sampler's
                first level at ``t = 1``, ``sigma = inf``), naming the chain.
        """
        sig = check_sigmas(sigmas)
        with torch.no_grad():
            states, P, Q, R, init_a, init_scale = self.coefficients(sig)
        t, t_next = states[:-1], states[1:]
        a, c, scale = P + Q, -Q * t, R
        with torch.no_grad():
            past = self.past(t, t_next) if self.history else None
        if past is not None:
            past = past.reshape(t.numel(), self.history)
            # step n has n predictions before it: the coefficients of the ones it lacks are 0
            n = torch.arange(t.numel())[:, None]
            past = torch.where(n > torch.arange(self.history)[None], past, torch.zeros_like(past))
        carry = None
        if self.history:
            with torch.no_grad():
                uw = self.carries(t, t_next)
            if uw is not None:
                u, w = uw.to(torch.float64).reshape(t.numel(), 2).unbind(1)
                # u y + w D with D = y - t v, as the coefficients of the state and its velocity
                carry = torch.stack([u + w, -w * t], 1)
        stages = None
        if self.stages > 1:
            if self.history:
                raise ValueError(f"chain {self.name!r}: a chain with stages > 1 must have history 0")
            with torch.no_grad():
                tab = self.stage_points(sig)
            if tab is None or tab[0].shape != (t.numel(), self.stages):
                raise ValueError(
                    f"chain {self.name!r} declares stages={self.stages}: stage_points must give (T, s) tables"
                )
            stages = Stages.build(*(x.to(torch.float64) for x in tab), self.name)
        with torch.no_grad():
            times = self.call_times(sig)
        if times is not None:
            times = torch.as_tensor(times, dtype=torch.float64).reshape(t.numel(), -1)
            if times.shape[1] != self.stages or not bool(torch.isfinite(times).all()):
                raise ValueError(
                    f"chain {self.name!r}: call_times must give (T, stages) = ({t.numel()}, {self.stages}) finite "
                    "numbers"
                )
        bad = ~(torch.isfinite(a) & torch.isfinite(c) & torch.isfinite(scale))
        if past is not None:
            bad |= ~torch.isfinite(past).all(1)
        if carry is not None:
            bad |= ~torch.isfinite(carry).all(1)
        if bool(bad.any()) or not (math.isfinite(init_a) and math.isfinite(init_scale)):
            n = int(bad.nonzero()[0, 0]) if bool(bad.any()) else 0
            raise ValueError(
                f"chain {self.name!r} is not defined on this grid at step {n} (levels {float(t[n]):.6g} -> "
                f"{float(t_next[n]):.6g} on the linear path): a sampler on VE noise levels sigma = t / (1 - t) "
                "needs a finite first level, t < 1; pass sigmas that start below 1 "
                "(specforest.kdiffusion.linear_grid of a k-diffusion schedule such as "
                "specforest.kdiffusion.get_sigmas_karras, or chains.karras_linear_grid / chains.ddpm_linear_grid)"
            )
        return Transitions(self, states, a, c, scale.clamp_min(0.0), init_a, init_scale, past, stages, carry, times)

    def grid_step(self, steps: int) -> torch.Tensor:
        """``(T,)`` long: the step of a grid of ``steps`` steps each of the chain's ``T`` steps belongs to (a
        callback reports a grid step where its first chain step begins): ``arange(steps)`` for a chain
        whose steps are the grid's; a chain of half-steps (``dpmpp_sde``) overrides it."""
        return torch.arange(steps)

    def example(self) -> "Chain":
        """This chain, or a setting of it with stochastic steps (what the test batteries run): a chain
        whose default is deterministic (EDM's churn at ``s_churn = 0``) overrides it."""
        return self

    def replace(self, **params: Any) -> "Chain":
        """This chain with other parameter values (validated).

        Raises:
            TypeError: naming a parameter the chain does not have, and listing those it has.
        """
        names = [f.name for f in fields(self)]
        unknown = sorted(set(params) - set(names))
        if unknown:
            raise TypeError(f"chain {self.name!r} has no parameter {unknown[0]!r}; its parameters: {names}")
        return replace(self, **params)


def _ve(t: torch.Tensor) -> torch.Tensor:
    """VE noise level ``t / (1 - t)`` (``inf`` at ``t = 1``)."""
    return t / (1.0 - t)


def from_ve(t: torch.Tensor, t_next: torch.Tensor, P, Q, R) -> tuple:
    """A VE step ``x' = P x + Q D + R z`` from ``t`` to ``t_next`` in the linear path's coordinates
    (the state ``y = (1 - t) x``): ``((1 - t') P / (1 - t), (1 - t') Q, (1 - t') R)``, each ``(T,)``."""
    return (1.0 - t_next) * P / (1.0 - t), (1.0 - t_next) * Q, (1.0 - t_next) * R


def stage_from_ve(t: torch.Tensor, t_stage: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> tuple:
    """A VE stage point ``x_k = alpha x + sum_i beta_i D_i`` at ``t_stage`` of states at ``t`` (each ``(T,)``;
    ``beta (T, k)``) in the linear path's coordinates (``y = (1 - t) x``, ``y_k = (1 - t_k) x_k``):
    ``((1 - t_k) alpha / (1 - t), (1 - t_k) beta)``."""
    return (1.0 - t_stage) * alpha / (1.0 - t), (1.0 - t_stage)[:, None] * beta


def _check_s_noise(s_noise: object) -> float:
    return check_number("s_noise", s_noise, 0.0, lo_open=True)


@dataclass(frozen=True)
class EM(Chain):
    """The paper's Euler-Maruyama step with churn ``eps`` in ``(0, 1]`` (eqs. 35-37)."""

    churn: float = 1.0
    name: ClassVar[str] = "em"

    def __post_init__(self) -> None:
        from .validation import check_churn

        object.__setattr__(self, "churn", check_churn(self.churn))

    def build(self, sigmas: torch.Tensor) -> ReverseSDE:
        return ReverseSDE(torch.as_tensor(sigmas, dtype=torch.float64), self.churn)


@dataclass(frozen=True)
class EulerAncestral(Chain):
    """k-diffusion's ``sample_euler_ancestral``, or ComfyUI's ``sample_euler_ancestral_RF`` (``path="linear"``).

    VE (``path="ve"``): ``(sigma_down, sigma_up) = get_ancestral_step(sigma, sigma', eta)``,
    ``x' = (sigma_down / sigma) x + (1 - sigma_down / sigma) D + s_noise sigma_up z``.
    Linear (``path="linear"``, ComfyUI's ``CONST`` models): ``sigma_down = t' (1 + eta (t' / t - 1))``,
    an Euler step of the flow to ``sigma_down``, then re-noised to ``t'``. The step into 0 is ``x' = D``.
    """

    eta: float = 1.0
    s_noise: float = 1.0
    path: str = "ve"
    name: ClassVar[str] = "euler_ancestral"

    def __post_init__(self) -> None:
        object.__setattr__(self, "eta", check_number("eta", self.eta, 0.0))
        object.__setattr__(self, "s_noise", _check_s_noise(self.s_noise))
        check_choice("path", self.path, PATHS)

    def step(self, t, t_next):
        if self.path == "linear":
            down, renoise, up2 = _ancestral_linear(t, t_next, self.eta)
            last = t_next == 0
            _check_renoise(self.eta, t, t_next, up2, last)
            up2 = up2.clamp_min(0.0)  # (rounding at eta = 0, where it is t'^2 - t'^2)
            P = torch.where(last, torch.zeros_like(t), renoise * down / t)
            Q = torch.where(last, torch.ones_like(t), renoise * (1.0 - down / t))
            R = torch.where(last | (self.eta == 0), torch.zeros_like(t), self.s_noise * up2.sqrt())
            return P, Q, R
        s, s_next = _ve(t), _ve(t_next)
        # get_ancestral_step: sigma_up = min(s', eta sqrt(s'^2 (s^2 - s'^2) / s^2)), written with
        # the ratio s' / s, which is finite (0) at s = inf
        ratio = torch.where(torch.isinf(s), torch.zeros_like(s), s_next / s)
        up = torch.minimum(s_next, self.eta * s_next * (1.0 - ratio**2).clamp_min(0.0).sqrt())
        down = (s_next**2 - up**2).clamp_min(0.0).sqrt()
        # x' = (down / s) x + (1 - down / s) D; in y = (1 - t) x the state's coefficient is
        # (1 - t') down / t, finite at t = 1
        frac = torch.where(torch.isinf(s), torch.zeros_like(s), down / s)
        P = (1.0 - t_next) * down / t
        Q = (1.0 - t_next) * (1.0 - frac)
        R = (1.0 - t_next) * self.s_noise * up
        return P, Q, R


def _ancestral_linear(t: torch.Tensor, t_next: torch.Tensor, eta: float) -> tuple:
    """ComfyUI's ancestral step on the linear path (its ``_RF`` samplers): ``(sigma_down, renoise, up2)``, each
    ``(T,)``, with ``sigma_down = t' (1 + eta (t' / t - 1))``, the re-noising factor ``renoise = (1 - t') /
    (1 - sigma_down)`` of the state and the variance ``up2 = t'^2 - (sigma_down renoise)^2`` of the noise it adds
    (``x' = renoise x_down + s_noise sqrt(up2) z``, ``x_down`` the deterministic step's state at ``sigma_down``)."""
    down = t_next * (1.0 + eta * (t_next / t - 1.0))
    renoise = (1.0 - t_next) / (1.0 - down)
    return down, renoise, t_next**2 - (down * renoise) ** 2


def _check_renoise(eta: float, t: torch.Tensor, t_next: torch.Tensor, up2: torch.Tensor, last: torch.Tensor) -> None:
    """Refuse an ``eta`` whose linear-path ancestral step re-noises with a negative variance ``up2 (T,)``.

    ``sigma_down = t' (1 - eta (1 - t' / t))`` falls below ``-t' / (1 - 2 t')`` for ``eta`` above
    ``2 (1 - t') / ((1 - 2 t') (1 - t' / t))``: ComfyUI's ``sample_euler_ancestral_RF`` takes the square root
    of a negative number there (NaN), and clamping it to 0 would sample another chain.

    Raises:
        ValueError: naming ``eta``, the first such step, and the largest ``eta`` the grid allows.
    """
    bad = (up2 < -1e-12 * t_next**2) & ~last
    if not bool(bad.any()):
        return
    i = int(bad.nonzero()[0, 0])
    small = (t_next > 0) & (t_next < 0.5)
    top = float((2.0 * (1.0 - t_next) / ((1.0 - 2.0 * t_next) * (1.0 - t_next / t)))[small].min())
    raise ValueError(
        f"eta={eta:g} gives a negative variance at step {i} (levels {float(t[i]):.6g} -> {float(t_next[i]):.6g} on the "
        f"linear path: the re-noising step's variance is {float(up2[i]):.3g} < 0, NaN in ComfyUI's "
        f"sample_euler_ancestral_RF); on this grid eta must be at most {top:.6g}"
    )


def _churn_gamma(t: torch.Tensor, steps: int, s_churn: float, s_tmin: float, s_tmax: float) -> torch.Tensor:
    """EDM's ``gamma_i = min(s_churn / N, sqrt 2 - 1)`` where ``s_tmin <= sigma_i <= s_tmax``, else 0, at the
    levels ``t (T,)`` on the linear path (``sigma = t / (1 - t)``)."""
    g = min(s_churn / steps, math.sqrt(2.0) - 1.0)
    # the window's edges are mapped as a k-diffusion schedule's levels are (t = sigma / (1 + sigma)), and
    # compared there: an edge at one of the schedule's own sigmas then includes that level, as k-diffusion's
    # s_tmin <= sigma_i does, where t / (1 - t) can be an ulp off sigma_i
    edges = torch.tensor([s_tmin, s_tmax], dtype=torch.float64)
    lo, hi = torch.where(torch.isinf(edges), 1.0, edges / (1.0 + edges)).tolist()
    inside = (t >= lo) & (t <= hi)
    return torch.where(inside, torch.full_like(t, g), torch.zeros_like(t))


@dataclass(frozen=True)
class EulerChurn(Chain):
    """EDM's stochastic Euler sampler (k-diffusion's ``sample_euler`` with ``s_churn``), on ``x-hat``.

    k-diffusion adds the churn noise *before* the network call, so its own step is not a Gaussian
    transition of ``x``. Taking the churned ``x-hat_i`` (at ``sigma-hat_i = sigma_i (1 + gamma_i)``)
    as the state makes it one::

        x-hat_{i+1} = x-hat_i + (sigma_{i+1} - sigma-hat_i) d(x-hat_i) + s_noise sqrt(sigma-hat_{i+1}^2 - sigma_{i+1}^2) z

    The chain starts from ``x-hat_0 = x + s_noise sqrt(sigma-hat_0^2 - sigma_0^2) z``, and its last step
    (into 0) is the plain Euler step. Its states sit at ``sigma-hat``: :meth:`levels`.
    """

    s_churn: float = 0.0
    s_tmin: float = 0.0
    s_tmax: float = float("inf")
    s_noise: float = 1.0
    name: ClassVar[str] = "euler"

    def __post_init__(self) -> None:
        object.__setattr__(self, "s_churn", check_number("s_churn", self.s_churn, 0.0))
        object.__setattr__(self, "s_tmin", check_number("s_tmin", self.s_tmin, 0.0))
        tmax = self.s_tmax
        if not (isinstance(tmax, (int, float)) and not isinstance(tmax, bool) and float(tmax) >= self.s_tmin):
            raise ValueError(f"s_tmax must be a number >= s_tmin ({self.s_tmin}), got {tmax!r}")
        object.__setattr__(self, "s_tmax", float(tmax))
        object.__setattr__(self, "s_noise", _check_s_noise(self.s_noise))

    def example(self) -> "EulerChurn":
        return self if self.s_churn > 0 else replace(self, s_churn=20.0)

    def _churned(self, sigmas: torch.Tensor) -> tuple:
        """``(s, hat, t_hat)``, each ``(N + 1,)``: k-diffusion's levels (the last 0), the states' churned
        levels ``sigma-hat`` and those on the linear path."""
        s = _ve(sigmas)
        g = _churn_gamma(sigmas[:-1], s.numel() - 1, self.s_churn, self.s_tmin, self.s_tmax)
        hat = torch.cat([s[:-1] * (1.0 + g), s.new_zeros(1)])
        t_hat = torch.where(torch.isinf(hat), torch.ones_like(hat), hat / (1.0 + hat))
        return s, hat, t_hat

    def coefficients(self, sigmas):
        s, hat, t_hat = self._churned(sigmas)
        # step i: x-hat_{i+1} = (s_{i+1} / hat_i) x-hat_i + (1 - s_{i+1} / hat_i) D + noise_{i+1} z
        noise = self.s_noise * (hat**2 - s**2).clamp_min(0.0).sqrt()  # (N + 1,), 0 where gamma = 0
        ratio = s[1:] / hat[:-1]
        P, Q, R = from_ve(t_hat[:-1], t_hat[1:], ratio, 1.0 - ratio, noise[1:])
        # x-hat_0 = x_0 + noise_0 z: in y, y-hat_0 = (1 - t-hat_0) (y_0 / (1 - t_0) + noise_0 z)
        init_a = float((1.0 - t_hat[0]) / (1.0 - sigmas[0]))
        return t_hat, P, Q, R, init_a, float((1.0 - t_hat[0]) * noise[0])


@dataclass(frozen=True)
class HeunChurn(EulerChurn):
    """EDM's stochastic sampler, Algorithm 2 of Karras et al. (k-diffusion's ``sample_heun`` with
    ``s_churn``, ``s_tmin``, ``s_tmax``, ``s_noise``), on the churned state ``x-hat`` as :class:`EulerChurn`.

    A step makes two model calls (``stages = 2``): ``D_1`` at ``x-hat_i`` (level ``sigma-hat_i``), then
    ``D_2`` at the Euler point ``x_2 = (sigma' / sigma-hat) x-hat + (1 - sigma' / sigma-hat) D_1`` at
    ``sigma' = sigma_{i+1}``; the step averages the two slopes::

        x_{i+1} = x-hat + (sigma' - sigma-hat) (d_1 + d_2) / 2 = (sigma' / sigma-hat) x-hat + (1 - sigma' / sigma-hat) D_eff

    with ``D_eff = (1 - sigma-hat / (2 sigma')) D_1 + sigma-hat / (2 sigma') D_2``, then churned as
    :class:`EulerChurn`. The last step (into 0) is Euler's, one call. A standard run of ``N`` steps
    makes ``2 N - 1`` calls.
    """

    name: ClassVar[str] = "heun"
    stages: ClassVar[int] = 2

    def stage_points(self, sigmas):
        s, hat, t_hat = self._churned(sigmas)
        h, nxt = hat[:-1], s[1:]
        last = nxt == 0
        # the second call at sigma' itself (t' = sigmas[n + 1], the grid's own level)
        w2 = h / (2.0 * torch.where(last, h, nxt))
        return _euler_point_stages(t_hat[:-1], h, nxt, sigmas[1:], w2, last)


def _euler_point_stages(
    t: torch.Tensor,
    sigma: torch.Tensor,
    mid: torch.Tensor,
    t_mid: torch.Tensor,
    w2: torch.Tensor,
    one: torch.Tensor,
    ve: bool = True,
) -> tuple:
    """The tableau of a two-stage step whose second call is at the Euler point toward ``mid``:
    ``x_2 = (mid / sigma) x + (1 - mid / sigma) D_1`` at ``mid`` (Heun, DPM-Solver-2, DPM++ 2S: the same
    point), ``D_eff = (1 - w2) D_1 + w2 D_2`` (:meth:`Chain.stage_points`).

    Args:
        t, sigma: ``(T,)`` the states' levels, linear and the sampler's (VE, or ``t`` itself where not ``ve``).
        mid, t_mid: ``(T,)`` the second call's level, the sampler's and linear.
        w2: ``(T,)`` the second prediction's weight.
        one: ``(T,)`` bool, the steps that make one call (an Euler step into 0): their second stage is a
            finite point at the state itself, of weight 0.
        ve: the point is a VE sampler's (converted to the linear path's coordinates), else a linear-path
            sampler's (ComfyUI's ``_RF`` samplers: already in them).
    """
    ratio = torch.where(one, sigma, mid) / sigma
    # the steps of one call evaluate no second stage: a finite point at their own state, weight 0
    t2 = torch.where(one, t, t_mid)
    if ve:
        alpha, beta = stage_from_ve(t, t2, ratio, (1.0 - ratio)[:, None])
    else:
        alpha, beta = ratio, (1.0 - ratio)[:, None]
    w2 = torch.where(one, torch.zeros_like(w2), w2)
    be = torch.zeros(t.numel(), 2, 2, dtype=torch.float64)
    be[:, 1, :1] = beta
    return torch.stack([t, t2], 1), torch.stack([torch.ones_like(t), alpha], 1), be, torch.stack([1.0 - w2, w2], 1)


def _log_midpoint(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """k-diffusion's ``a.log().lerp(b.log(), 0.5).exp()``, the geometric mean of ``a, b > 0`` (``(T,)``)."""
    return torch.lerp(a.log(), b.log(), 0.5).exp()


def _ancestral_ve(s: torch.Tensor, s_next: torch.Tensor, eta: float) -> tuple:
    """k-diffusion's ``get_ancestral_step`` on VE levels: ``(sigma_down, sigma_up)``, each ``(T,)``."""
    up = torch.minimum(s_next, eta * (s_next**2 * (s**2 - s_next**2) / s**2).clamp_min(0.0).sqrt())
    return (s_next**2 - up**2).clamp_min(0.0).sqrt(), up


@dataclass(frozen=True)
class DPM2Churn(EulerChurn):
    """k-diffusion's ``sample_dpm_2`` (DPM-Solver-2 with EDM's churn: ``s_churn``, ``s_tmin``, ``s_tmax``,
    ``s_noise``), on the churned state ``x-hat`` as :class:`EulerChurn`: two calls a step.

    ``D_1`` at ``x-hat`` (``sigma-hat``), ``D_2`` at ``x_2 = x-hat + (sigma_mid - sigma-hat) d_1`` at the log-midpoint
    ``sigma_mid = sqrt(sigma-hat sigma')``, then ``x = x-hat + (sigma' - sigma-hat) d_2``: the Euler step's
    ``P, Q`` with ``D_eff = (1 - sigma-hat / sigma_mid) D_1 + (sigma-hat / sigma_mid) D_2``. Into 0: Euler's, one call.
    """

    name: ClassVar[str] = "dpm_2"
    stages: ClassVar[int] = 2

    def stage_points(self, sigmas):
        s, hat, t_hat = self._churned(sigmas)
        h, nxt = hat[:-1], s[1:]
        last = nxt == 0
        mid = _log_midpoint(h, torch.where(last, h, nxt))
        return _euler_point_stages(t_hat[:-1], h, mid, mid / (1.0 + mid), h / mid, last)


@dataclass(frozen=True)
class _AncestralTwoStage(Chain):
    """An ancestral step of two calls (``eta``, ``s_noise``, ``path``).

    VE (``path="ve"``, k-diffusion): ``(sigma_down, sigma_up) = get_ancestral_step(sigma, sigma', eta)``, the
    deterministic step to ``sigma_down`` at the log-midpoint's Euler point (two calls; one, the Euler step
    ``x' = D``, where ``sigma_down = 0``), then ``s_noise sigma_up z``.

    Linear (``path="linear"``, ComfyUI's ``_RF`` samplers, which it runs for ``CONST`` models): ``sigma_down =
    t' (1 + eta (t' / t - 1))`` on the linear path, the same deterministic step to it in the linear path's own
    coordinates (its second call at a midpoint of ``t`` and ``sigma_down``), then re-noised to ``t'``:
    ``x' = ((1 - t') / (1 - sigma_down)) x_down + s_noise sqrt(t'^2 - sigma_down^2 (1 - t')^2 / (1 - sigma_down)^2) z``.
    An ``eta`` whose ``sigma_down`` falls below 0 before the last step is refused (ComfyUI takes its logarithm: NaN).
    """

    eta: float = 1.0
    s_noise: float = 1.0
    path: str = "ve"
    stages: ClassVar[int] = 2
    _steps_to_zero: ClassVar[bool] = False
    """Whether the linear path's code takes a ``sigma_down = 0`` before the last step as its Euler step
    ``x' = D`` (``sample_dpm_2_ancestral_RF`` branches on it; ``sample_dpmpp_2s_ancestral_RF`` would call
    the model at level 0 there: refused)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "eta", check_number("eta", self.eta, 0.0))
        object.__setattr__(self, "s_noise", _check_s_noise(self.s_noise))
        check_choice("path", self.path, PATHS)

    def _noise(self, s_next: torch.Tensor, down: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``(T,)`` the VE noise scale of each step: ``s_noise sigma_up`` where ``sigma' > 0``."""
        return torch.where(s_next > 0, self.s_noise * up, torch.zeros_like(up))

    def _weight(self, s: torch.Tensor, mid: torch.Tensor) -> torch.Tensor:
        """``(T,)`` the second prediction's weight in ``D_eff``."""
        raise NotImplementedError

    def _linear_mid(self, t: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """``(T,)`` the second call's level on the linear path between ``t`` and ``sigma_down > 0`` (``path="linear"``)."""
        raise NotImplementedError

    def _down_linear(self, t: torch.Tensor, t_next: torch.Tensor) -> tuple:
        """``(sigma_down, renoise, up2, one)`` of the linear path's steps (:func:`_ancestral_linear`; ``one``: the
        steps of one call, ``sigma_down = 0``), refusing an ``eta`` that puts ``sigma_down`` below 0 before the
        last step.

        Raises:
            ValueError: naming ``eta``, the first such step and the largest ``eta`` the grid allows.
        """
        down, renoise, up2 = _ancestral_linear(t, t_next, self.eta)
        bad = ((down <= 0) if not self._steps_to_zero else (down < 0)) & (t_next > 0)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            inner = t_next > 0
            top = float((t / (t - t_next))[inner].min())
            raise ValueError(
                f"eta={self.eta:g} puts sigma_down below 0 at step {i} (levels {float(t[i]):.6g} -> "
                f"{float(t_next[i]):.6g} on the linear path: sigma_down = {float(down[i]):.3g}), whose logarithm "
                f"ComfyUI's sample_{self.name}_RF takes (NaN); on this grid eta must be "
                f"{'at most' if self._steps_to_zero else 'below'} {top:.6g}"
            )
        return down, renoise, up2, down == 0

    def step(self, t, t_next):
        if self.path == "linear":
            down, renoise, up2, one = self._down_linear(t, t_next)
            zero = torch.zeros_like(t)
            P = torch.where(one, zero, renoise * down / t)
            Q = torch.where(one, torch.ones_like(t), renoise * (1.0 - down / t))
            # (at eta = 0 sigma_down = t' and up2 = 0; rounding can leave it a hair below)
            R = torch.where(one, zero, self.s_noise * up2.clamp_min(0.0).sqrt())
            return P, Q, R
        s, s_next = _ve(t), _ve(t_next)
        down, up = _ancestral_ve(s, s_next, self.eta)
        ratio = down / s
        return from_ve(t, t_next, ratio, 1.0 - ratio, self._noise(s_next, down, up))

    def stage_points(self, sigmas):
        t = sigmas[:-1]
        if self.path == "linear":
            down, _, _, one = self._down_linear(t, sigmas[1:])
            mid = self._linear_mid(t, torch.where(one, t, down))
            return _euler_point_stages(t, t, mid, mid, self._weight(t, mid), one, ve=False)
        s, s_next = _ve(t), _ve(sigmas[1:])
        down, _ = _ancestral_ve(s, s_next, self.eta)
        one = down == 0
        mid = _log_midpoint(s, torch.where(one, s, down))
        return _euler_point_stages(t, s, mid, mid / (1.0 + mid), self._weight(s, mid), one)


@dataclass(frozen=True)
class DPM2Ancestral(_AncestralTwoStage):
    """k-diffusion's ``sample_dpm_2_ancestral`` (``eta``, ``s_noise``): DPM-Solver-2 to ``sigma_down`` (the
    second call at ``sigma_mid = sqrt(sigma sigma_down)``, ``x' = x + (sigma_down - sigma) d_2``, so
    ``D_eff = (1 - sigma / sigma_mid) D_1 + (sigma / sigma_mid) D_2``), then ``s_noise sigma_up z``; where
    ``sigma_down = 0`` the Euler step ``x' = D`` with no noise (its code adds the noise in the two-call branch only).

    ``path="linear"``: ComfyUI's ``sample_dpm_2_ancestral_RF``, the same DPM-Solver-2 step on the linear path's
    levels to its ``sigma_down`` (``sigma_mid = sqrt(t sigma_down)``), then re-noised (:class:`_AncestralTwoStage`);
    where ``sigma_down = 0`` (into 0) ``x' = D``, one call.
    """

    name: ClassVar[str] = "dpm_2_ancestral"
    _steps_to_zero: ClassVar[bool] = True

    def draws_noise(self, sigmas: torch.Tensor) -> torch.Tensor:
        """``(T,)`` bool: the steps whose code draws a noise on the sampler's levels ``sigmas (T + 1,)`` (VE, or the
        linear path's with ``path="linear"``): those with ``sigma_down > 0`` (with ``eta > 1`` k-diffusion's
        ``sigma_up`` can clip to ``sigma'`` before the last step)."""
        s = sigmas.detach().to("cpu", torch.float64)
        if self.path == "linear":
            return _ancestral_linear(s[:-1], s[1:], self.eta)[0] > 0
        return _ancestral_ve(s[:-1], s[1:], self.eta)[0] > 0

    def _noise(self, s_next, down, up):
        return torch.where(down > 0, self.s_noise * up, torch.zeros_like(up))

    def _weight(self, s, mid):
        return s / mid

    def _linear_mid(self, t, down):
        return _log_midpoint(t, down)


@dataclass(frozen=True)
class DPMPP2SAncestral(_AncestralTwoStage):
    """k-diffusion's ``sample_dpmpp_2s_ancestral`` (``eta``, ``s_noise``): DPM-Solver++(2S) to ``sigma_down``,
    ``x_2 = (sigma_mid / sigma) x - expm1(-h / 2) D_1`` at ``sigma_mid = sqrt(sigma sigma_down)``
    (``h = log(sigma / sigma_down)``), ``x' = (sigma_down / sigma) x - expm1(-h) D_2``: the mean reads the second
    prediction only (``D_eff = D_2``); then ``s_noise sigma_up z`` where ``sigma' > 0``. Where
    ``sigma_down = 0`` the Euler step ``x' = D``.

    ``path="linear"``: ComfyUI's ``sample_dpmpp_2s_ancestral_RF``: the second call at the Euler point toward
    ``sigma_s``, the midpoint of ``t`` and ``sigma_down`` in ``lambda = log((1 - sigma) / sigma)`` (``0.9999`` from
    ``t = 1``), ``x_down = (sigma_down / t) x + (1 - sigma_down / t) D_2``, then re-noised (:class:`_AncestralTwoStage`);
    into 0 ``x' = D``, one call.
    """

    name: ClassVar[str] = "dpmpp_2s_ancestral"

    def _weight(self, s, mid):
        return torch.ones_like(s)

    def _linear_mid(self, t, down):
        lam = torch.lerp(torch.logit(t).neg(), torch.logit(down).neg(), 0.5)
        # ComfyUI's sample_dpmpp_2s_ancestral_RF takes this level from t = 1, where lambda is -inf
        return torch.where(t == 1.0, torch.full_like(t, 0.9999), torch.sigmoid(-lam))


VARIANCES = ("fixed_small", "fixed_large")


@dataclass(frozen=True)
class DDPM(Chain):
    """Ancestral DDPM (ComfyUI's ``sample_ddpm``) on VE levels, ``alpha-bar = 1 / (1 + sigma^2)``.

    ``mu = alpha^(-1/2) (x~ - (1 - alpha) eps / sqrt(1 - alpha-bar))`` with ``alpha = alpha-bar / alpha-bar'``,
    ``x~ = x / sqrt(1 + sigma^2)``, then ``x' = sqrt(1 + sigma'^2) (mu + std z)``: ``std^2`` is
    ``beta~ = (1 - alpha)(1 - alpha-bar') / (1 - alpha-bar)`` (``fixed_small``) or
    ``beta = 1 - alpha`` (``fixed_large``). Learned variances are refused: their covariance comes
    from the network.
    """

    variance: str = "fixed_small"
    name: ClassVar[str] = "ddpm"

    def __post_init__(self) -> None:
        if self.variance in ("learned", "learned_range"):
            raise ValueError(
                f"variance={self.variance!r}: a learned variance comes from the network, so the transition's "
                "covariance depends on the model and no coupling can be exact; use fixed_small or fixed_large"
            )
        check_choice("variance", self.variance, VARIANCES)

    def step(self, t, t_next):
        s, s_next = _ve(t), _ve(t_next)
        ab, ab_next = 1.0 / (1.0 + s**2), 1.0 / (1.0 + s_next**2)
        alpha = ab / ab_next
        k = (1.0 + s_next**2).sqrt() / alpha.sqrt()
        # eps = (x - D) / s and sqrt(1 - ab) = s / sqrt(1 + s^2)
        w = (1.0 - alpha) * (1.0 + s**2).sqrt() / s**2
        P = k * (1.0 / (1.0 + s**2).sqrt() - w)
        Q = k * w
        if self.variance == "fixed_small":
            var = (1.0 - alpha) * (1.0 - ab_next) / (1.0 - ab)
        else:
            var = 1.0 - alpha
        R = torch.where(s_next > 0, (1.0 + s_next**2).sqrt() * var.clamp_min(0.0).sqrt(), torch.zeros_like(s))
        return from_ve(t, t_next, P, Q, R)


def check_ddim_eta(eta: float, ab: torch.Tensor, prev: torch.Tensor, timesteps: "torch.Tensor | None" = None) -> None:
    """Refuse an ``eta`` that makes a DDIM step's variance negative.

    DDIM's step (Song et al. 2021, eq. 12) draws ``s_t z`` beside ``sqrt(1 - abar' - s_t^2) eps`` with
    ``s_t^2 = eta^2 (1 - abar') / (1 - abar) (1 - abar / abar')``: above ``eta_max = min_t sqrt((1 - abar') /
    var_t)`` the square root is of a negative number (diffusers' step returns NaN there), and clamping it
    to 0 would sample another chain.

    Args:
        eta: the step's ``eta``.
        ab, prev: ``(T,)`` float64 ``abar`` and ``abar'`` of each step.
        timesteps: ``(T,)`` the scheduler's timesteps, named in the message (``None``: a chain's grid).

    Raises:
        ValueError: naming ``eta``, the first step whose variance is negative, and ``eta_max``.
    """
    var = (1.0 - prev) / (1.0 - ab) * (1.0 - ab / prev)
    left = 1.0 - prev - eta * eta * var  # the variance of eps's term; its square root is taken
    # (a relative margin: at eta = 1 it is (1 - abar')(abar / abar' - abar) / (1 - abar) >= 0 up to rounding)
    bad = left < -1e-12 * (1.0 - prev)
    if not bool(bad.any()):
        return
    i = int(bad.nonzero()[0, 0])
    positive = var > 0
    top = float(((1.0 - prev[positive]) / var[positive]).sqrt().min())
    where = f"timestep {int(timesteps[i])}, " if timesteps is not None else ""
    raise ValueError(
        f"eta={eta:g} gives a negative variance at step {i} ({where}alpha-bar {float(ab[i]):.6g} -> "
        f"{float(prev[i]):.6g}: 1 - alpha-bar' - s_t^2 = {float(left[i]):.3g} < 0); on these steps eta must be at "
        f"most {top:.6g}"
    )


@dataclass(frozen=True)
class DDIM(Chain):
    """DDIM with ``eta > 0`` on variance-preserving levels ``alpha-bar = 1 / (1 + sigma^2)``.

    ``x' = sqrt(alpha-bar') D + sqrt(1 - alpha-bar' - s_t^2) eps + s_t z`` with
    ``s_t = eta sqrt((1 - alpha-bar') / (1 - alpha-bar)) sqrt(1 - alpha-bar / alpha-bar')``
    (no clipping). ``eta = 0`` is the deterministic DDIM: no tree can speculate it. An ``eta`` above 1
    can make ``1 - alpha-bar' - s_t^2`` negative on a grid: it is refused there, naming the step
    (:func:`check_ddim_eta`).
    """

    eta: float = 1.0
    name: ClassVar[str] = "ddim"

    def __post_init__(self) -> None:
        object.__setattr__(self, "eta", check_number("eta", self.eta, 0.0))

    def step(self, t, t_next):
        # in VP coordinates x = n y with n = sqrt(ab) + sqrt(1 - ab) = 1 / (1 - t + t) scaled:
        # sqrt(ab) = (1 - t) / r, sqrt(1 - ab) = t / r, r = sqrt((1 - t)^2 + t^2)
        r, r_next = ((1.0 - t) ** 2 + t**2).sqrt(), ((1.0 - t_next) ** 2 + t_next**2).sqrt()
        sa, sb = (1.0 - t) / r, t / r  # sqrt(ab), sqrt(1 - ab)
        sa_n, sb_n = (1.0 - t_next) / r_next, t_next / r_next
        ab, ab_next = sa**2, sa_n**2
        check_ddim_eta(self.eta, ab, ab_next)
        st = self.eta * (sb_n / sb) * (1.0 - ab / ab_next).clamp_min(0.0).sqrt()
        c2 = (sb_n**2 - st**2).clamp_min(0.0).sqrt()
        n, n_next = sa + sb, sa_n + sb_n  # x_vp = n y
        P = c2 * n / (sb * n_next)
        Q = (sa_n - c2 * sa / sb) / n_next
        R = st / n_next
        return P, Q, R


@dataclass(frozen=True)
class LCM(Chain):
    """LCM's step (ComfyUI's ``sample_lcm``): ``x' = D + s_noise sigma' z`` (VE), ``(1 - t') D + s_noise t' z``
    on the linear path: the same chain."""

    s_noise: float = 1.0
    name: ClassVar[str] = "lcm"

    def __post_init__(self) -> None:
        object.__setattr__(self, "s_noise", _check_s_noise(self.s_noise))

    def step(self, t, t_next):
        return torch.zeros_like(t), 1.0 - t_next, self.s_noise * t_next


SOLVER_TYPES = ("midpoint", "heun")


@dataclass(frozen=True)
class DPMPP2MSDE(Chain):
    """k-diffusion's ``sample_dpmpp_2m_sde`` (``eta``, ``s_noise``, ``solver_type``) on VE levels.

    With ``h = log(sigma / sigma')``, ``H = (1 + eta) h`` and ``r = h_prev / h``::

        x' = (sigma' / sigma) e^(-eta h) x + (1 - e^(-H)) D + k (D - D_prev) / r + s_noise sigma' sqrt(1 - e^(-2 eta h)) z

    with ``k = (1 - e^(-H)) / 2`` (``midpoint``) or ``1 - (1 - e^(-H)) / H`` (``heun``), no ``D_prev``
    term at the first step, and ``x' = D`` into 0. The state is ``(x, D_prev)``: given the
    previous prediction the step is Gaussian with a covariance free of the network, so the chain
    declares ``history = 1`` and the engine carries each node's parent prediction
    (:class:`~specforest.carried.Carried`). On the linear path (ComfyUI's ``CONST`` models, ``lambda = log((1 -
    sigma) / sigma)``, its ``alpha_t`` factors) the same step is this chain on the same linear grid.
    ``eta = 0`` is the deterministic DPM++ 2M: no tree can speculate it.
    """

    eta: float = 1.0
    s_noise: float = 1.0
    solver_type: str = "midpoint"
    name: ClassVar[str] = "dpmpp_2m_sde"
    history: ClassVar[int] = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "eta", check_number("eta", self.eta, 0.0))
        object.__setattr__(self, "s_noise", _check_s_noise(self.s_noise))
        check_choice("solver_type", self.solver_type, SOLVER_TYPES)

    def ve_terms(self, t: torch.Tensor, t_next: torch.Tensor) -> tuple:
        """``(P, Q0, k, R, h, last)`` of each step on VE levels (``Q0`` without the multistep term)."""
        s, s_next = _ve(t), _ve(t_next)
        last = s_next == 0
        safe_next = torch.where(last, s, s_next)  # the step into 0 is x' = D: any finite h
        h = torch.log(s / safe_next)
        H = (1.0 + self.eta) * h
        Q0 = -torch.expm1(-H)
        if self.solver_type == "midpoint":
            k = 0.5 * Q0
        else:
            k = Q0 / (-H) + 1.0
        P = torch.where(last, torch.zeros_like(s), torch.exp(-H))  # (s' / s) e^(-eta h) = e^(-H)
        R = self.s_noise * s_next * (-torch.expm1(-2.0 * self.eta * h)).clamp_min(0.0).sqrt()
        R = torch.where(last | (self.eta == 0), torch.zeros_like(s), R)
        return P, torch.where(last, torch.ones_like(s), Q0), torch.where(last, torch.zeros_like(s), k), R, h

    def _multistep(self, t: torch.Tensor, t_next: torch.Tensor) -> torch.Tensor:
        """``(T,)`` the VE coefficient ``k / r`` of ``D - D_prev`` (0 at the first step)."""
        _, _, k, _, h = self.ve_terms(t, t_next)
        r = torch.cat([h.new_ones(1), h[:-1] / h[1:]])
        return torch.cat([h.new_zeros(1), (k / r)[1:]])

    def step(self, t, t_next):
        P, Q0, _, R, _ = self.ve_terms(t, t_next)
        E = self._multistep(t, t_next)
        return from_ve(t, t_next, P, Q0 + E, R)

    def past(self, t, t_next):
        return (-(1.0 - t_next) * self._multistep(t, t_next))[:, None]


@dataclass(frozen=True)
class DPMPP3MSDE(Chain):
    """k-diffusion's ``sample_dpmpp_3m_sde`` (``eta``, ``s_noise``) on VE levels: a chain of history 2.

    With ``h = log(sigma / sigma')``, ``H = (1 + eta) h``, ``phi_2 = 1 - (1 - e^(-H)) / H`` and
    ``phi_3 = phi_2 / H - 1/2``::

        x' = (sigma' / sigma) e^(-eta h) x + (1 - e^(-H)) D + phi_2 d_1 - phi_3 d_2 + s_noise sigma' sqrt(1 - e^(-2 eta h)) z

    where, with the two previous steps' ``h_1, h_2``, ``r0 = h_1 / h``, ``r1 = h_2 / h``,
    ``d1_0 = (D - D_1) / r0`` and ``d1_1 = (D_1 - D_2) / r1``: ``d_1 = d1_0 + (d1_0 - d1_1) r0 / (r0 + r1)``,
    ``d_2 = (d1_0 - d1_1) / (r0 + r1)``; at the second step (one previous prediction) ``d_1 = (D - D_1) / r0``,
    ``d_2 = 0``; at the first neither; ``x' = D`` into 0. ``D_1, D_2`` are the predictions one and two
    steps before: given them the step is Gaussian with a covariance free of the network, so the chain
    declares ``history = 2`` and the engine carries both (:class:`~specforest.carried.Carried`). On the
    linear path (ComfyUI's ``CONST`` models, ``lambda = log((1 - sigma) / sigma)``, its ``alpha_t`` factors)
    the same step is this chain on the same linear grid. ``eta = 0`` is the deterministic DPM++ 3M.
    """

    eta: float = 1.0
    s_noise: float = 1.0
    name: ClassVar[str] = "dpmpp_3m_sde"
    history: ClassVar[int] = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "eta", check_number("eta", self.eta, 0.0))
        object.__setattr__(self, "s_noise", _check_s_noise(self.s_noise))

    def ve_terms(self, t: torch.Tensor, t_next: torch.Tensor) -> tuple:
        """``(P, Q, past (T, 2), R)`` of each step on VE levels (``x' = P x + Q D + past_0 D_1 + past_1 D_2 + R z``)."""
        s, s_next = _ve(t), _ve(t_next)
        last = s_next == 0
        safe_next = torch.where(last, s, s_next)  # the step into 0 is x' = D: any finite h
        h = torch.log(s / safe_next)
        H = (1.0 + self.eta) * h
        Q = -torch.expm1(-H)
        phi2 = torch.expm1(-H) / H + 1.0
        phi3 = phi2 / H - 0.5
        # the step ratios to the one and two steps before (1 where there is none: its coefficient is 0)
        r0 = torch.cat([h.new_ones(1), h[:-1] / h[1:]])
        r1 = torch.cat([h.new_ones(2), h[:-2] / h[2:]])
        # second step: phi_2 (D - D_1) / r0
        second = phi2 / r0
        # from the third: phi_2 d_1 - phi_3 d_2 = alpha d1_0 - beta d1_1
        u, w = r0 / (r0 + r1), 1.0 / (r0 + r1)
        alpha = phi2 * (1.0 + u) - phi3 * w
        beta = phi2 * u - phi3 * w
        n = torch.arange(t.numel())
        e = torch.where(n >= 2, alpha / r0, torch.where(n == 1, second, torch.zeros_like(h)))
        e2 = torch.where(n >= 2, beta / r1, torch.zeros_like(h))
        keep = ~last
        zero = torch.zeros_like(h)
        P = torch.where(last, zero, torch.exp(-H))  # (s' / s) e^(-eta h) = e^(-H)
        Q = torch.where(last, torch.ones_like(h), Q + e)
        past = torch.stack([torch.where(keep, -e - e2, zero), torch.where(keep, e2, zero)], 1)
        R = self.s_noise * s_next * (-torch.expm1(-2.0 * self.eta * h)).clamp_min(0.0).sqrt()
        R = torch.where(last | (self.eta == 0), zero, R)
        return P, Q, past, R

    def step(self, t, t_next):
        P, Q, _, R = self.ve_terms(t, t_next)
        return from_ve(t, t_next, P, Q, R)

    def past(self, t, t_next):
        return (1.0 - t_next)[:, None] * self.ve_terms(t, t_next)[2]


@dataclass(frozen=True)
class DPMPPSDE(Chain):
    """k-diffusion's ``sample_dpmpp_sde`` (DPM-Solver++ SDE: ``eta``, ``s_noise``, ``r``) on VE levels, a chain of
    half-steps.

    A step from ``sigma`` to ``sigma'`` calls the model at ``sigma`` and at ``sigma_s = sigma^(1 - r) sigma'^r`` and
    draws two noises from one Brownian motion (k-diffusion's ``BrownianTreeNoiseSampler``, identity transform):
    ``n_1`` normalizes its increment over ``[sigma_s, sigma]``, ``n_2`` over ``[sigma', sigma]``, so their
    correlation is ``rho = sqrt((sigma - sigma_s) / (sigma - sigma'))``. With ``(d_1, u_1)`` and ``(d_2, u_2)``
    ``get_ancestral_step(sigma, sigma_s, eta)`` and ``get_ancestral_step(sigma, sigma', eta)``::

        x_2 = (d_1 / sigma) x + (1 - d_1 / sigma) D + s_noise u_1 n_1                                  (D_2 at sigma_s)
        x'  = (d_2 / sigma) x + (1 - d_2 / sigma) ((1 - 1 / (2 r)) D + D_2 / (2 r)) + s_noise u_2 n_2

    Given ``(x, D)`` the midpoint ``x_2`` is Gaussian. Given ``x_2`` and the step's start, ``n_1 = (x_2 - mean_1) /
    (s_noise u_1)`` is known and ``n_2 = rho n_1 + sqrt(1 - rho^2) z``, so the end is Gaussian too: its mean is
    ``k x_2 + (1 - d_2 / sigma) D_2 / (2 r) + K`` with ``k = rho u_2 / u_1`` and ``K = (d_2 / sigma - k d_1 / sigma) x
    + ((1 - d_2 / sigma)(1 - 1 / (2 r)) - k (1 - d_1 / sigma)) D``, its std ``s_noise u_2 sqrt(1 - rho^2)``. So the
    chain's states are each step's start and its midpoint (:meth:`coefficients`), one call each: ``history = 1``,
    the start hands its midpoint ``K`` to carry (:meth:`carries`) and the end's mean reads it (:meth:`past`). A
    run of ``N`` steps is ``2 N - 1`` half-steps and calls, as k-diffusion's: the step into 0 is Euler's,
    ``x' = D``. ``r`` must lie in ``(0, 1)``: at 1 the two noises are one draw, above it ``sigma_s`` falls below
    ``sigma'`` (outside the Brownian tree's interval at the last step). ``eta = 0`` is deterministic.

    ``path="linear"``: ComfyUI's ``sample_dpmpp_sde`` for a ``CONST`` model, which works in half-log-SNR ``lambda =
    log((1 - t) / t)`` with ``alpha_t = 1 - t`` factors: its midpoint is ``sigmoid(-lambda_s)``, ``lambda_s = lambda +
    r (lambda' - lambda)``, and its means and noise scales are the VE step's above on the mapped levels ``sigma = t / (1
    - t)`` (``get_ancestral_step`` of them, in ``y = (1 - t) x``). Its Brownian tree is queried at the linear levels,
    so the correlation is ``rho = sqrt((t - t_s) / (t - t'))``. A first level of 1 is refused: ComfyUI moves it to its
    model's ``model_sampling.percent_to_sigma(1e-4)`` (``offset_first_sigma_for_snr``), which a grid must then start at.
    """

    eta: float = 1.0
    s_noise: float = 1.0
    r: float = 0.5
    path: str = "ve"
    name: ClassVar[str] = "dpmpp_sde"
    history: ClassVar[int] = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "eta", check_number("eta", self.eta, 0.0))
        object.__setattr__(self, "s_noise", _check_s_noise(self.s_noise))
        check_choice("path", self.path, PATHS)
        r = check_number("r", self.r, 0.0, 1.0, lo_open=True)
        if r == 1.0:
            raise ValueError(
                "r must be in (0, 1), got 1: the midpoint would sit at sigma', where both noises are one draw"
            )
        object.__setattr__(self, "r", r)

    def midpoints(self, s: torch.Tensor, s_next: torch.Tensor) -> torch.Tensor:
        """``sigma_s = exp(-(t + r h))`` with ``t = -log sigma``, ``h = log(sigma / sigma')`` (k-diffusion's
        ``sigma_fn(s)``), each ``(N,)`` VE."""
        return torch.lerp(s.log(), s_next.log(), self.r).exp()

    def linear_midpoints(self, t: torch.Tensor, t_next: torch.Tensor) -> torch.Tensor:
        """``t_s = sigmoid(-(lambda + r (lambda' - lambda)))`` with ``lambda = -logit(t)`` (ComfyUI's
        ``sigma_fn(lambda_s_1)`` for a ``CONST`` model), each ``(N,)`` on the linear path."""
        return torch.sigmoid(-torch.lerp(torch.logit(t).neg(), torch.logit(t_next).neg(), self.r))

    def noise_correlation(self, s: torch.Tensor, s_mid: torch.Tensor, s_next: torch.Tensor) -> torch.Tensor:
        """``rho (N,)``: the correlation of a step's two noises, the Brownian increments over ``[sigma_s, sigma]``
        and ``[sigma', sigma]`` normalized, each ``(N,)`` on the levels the Brownian tree is queried at (VE, or the
        linear path's with ``path="linear"``)."""
        return ((s - s_mid) / (s - s_next)).sqrt()

    def _halves(self, t: torch.Tensor, t_next: torch.Tensor) -> dict:
        """Each two-call step's VE terms from the chain's half-step levels ``t, t_next (2 N - 1,)``: the starts at
        the even steps, the midpoints at the odd ones, and the last step into 0."""
        ta, tb, tb_next = t[0:-1:2], t[1::2], t_next[1::2]
        s, s_mid, s_next = _ve(ta), _ve(tb), _ve(tb_next)
        d1, u1 = _ancestral_ve(s, s_mid, self.eta)
        d2, u2 = _ancestral_ve(s, s_next, self.eta)
        # ComfyUI queries its Brownian tree of a CONST model at the linear levels, k-diffusion at the VE ones
        rho = self.noise_correlation(*((ta, tb, tb_next) if self.path == "linear" else (s, s_mid, s_next)))
        k = torch.where(u1 > 0, rho * u2 / torch.where(u1 > 0, u1, torch.ones_like(u1)), torch.zeros_like(u1))
        fac = 1.0 / (2.0 * self.r)
        return dict(ta=ta, tb=tb, tb_next=tb_next, s=s, d1=d1, u1=u1, d2=d2, u2=u2, rho=rho, k=k, fac=fac)

    def coefficients(self, sigmas):
        states = torch.empty(2 * (sigmas.numel() - 1), dtype=torch.float64)
        states[0::2] = sigmas[:-1]
        if self.path == "linear":
            if float(sigmas[0]) >= 1.0:
                raise ValueError(
                    "sigmas must start below 1 for dpmpp_sde with path='linear' (got a first level "
                    f"{float(sigmas[0]):.6g}): ComfyUI's sample_dpmpp_sde moves a first level of 1 to its model's "
                    "model_sampling.percent_to_sigma(1e-4) (1 - 1e-4 at shift 1), where lambda is finite; pass that level"
                )
            states[1:-1:2] = self.linear_midpoints(sigmas[:-2], sigmas[1:-1])
        else:
            s = _ve(sigmas)
            mid = self.midpoints(s[:-2], s[1:-1])
            states[1:-1:2] = torch.where(
                torch.isinf(mid), torch.ones_like(mid), mid / (1.0 + mid)
            )  # (refused at t = 1)
        states[-1] = 0.0
        P, Q, R = self.step(states[:-1], states[1:])
        return states, P, Q, R, 1.0, 0.0

    def step(self, t, t_next):
        """The half-steps ``(P, Q, R)`` on the chain's own levels ``t, t_next (2 N - 1,)`` (:meth:`coefficients`)."""
        h = self._halves(t, t_next)
        s = h["s"]
        P, Q, R = torch.zeros_like(t), torch.ones_like(t), torch.zeros_like(t)  # the last: x' = D
        # to the midpoint: x_2 = (d_1 / sigma) x + (1 - d_1 / sigma) D + s_noise u_1 n_1
        a = from_ve(h["ta"], h["tb"], h["d1"] / s, 1.0 - h["d1"] / s, self.s_noise * h["u1"])
        # to the end: k x_2 + (1 - d_2 / sigma) D_2 / (2 r) + K + s_noise u_2 sqrt(1 - rho^2) z
        sd = self.s_noise * h["u2"] * (1.0 - h["rho"] ** 2).clamp_min(0.0).sqrt()
        b = from_ve(h["tb"], h["tb_next"], h["k"], (1.0 - h["d2"] / s) * h["fac"], sd)
        for out, first, second in zip((P, Q, R), a, b, strict=True):
            out[0:-1:2], out[1::2] = first, second
        return P, Q, R

    def carries(self, t, t_next):
        # a step's start hands on K (VE, in x = y / (1 - t) and D); the midpoint hands on nothing read
        h = self._halves(t, t_next)
        s, k = h["s"], h["k"]
        uw = torch.zeros(t.numel(), 2, dtype=torch.float64)
        alpha = h["d2"] / s - k * h["d1"] / s
        beta = (1.0 - h["d2"] / s) * (1.0 - h["fac"]) - k * (1.0 - h["d1"] / s)
        uw[0:-1:2, 0], uw[0:-1:2, 1] = alpha / (1.0 - h["ta"]), beta
        return uw

    def past(self, t, t_next):
        # the end's mean reads K in its own coordinates, y' = (1 - t') x'
        past = torch.zeros(t.numel(), 1, dtype=torch.float64)
        past[1::2, 0] = 1.0 - t_next[1::2]
        return past

    def grid_step(self, steps: int) -> torch.Tensor:
        # half-steps 2 i and 2 i + 1 make grid step i; the last, into 0, is one
        return torch.arange(2 * steps - 1) // 2


_RENAMED = {
    "karras_sigmas": "karras_linear_grid",
    "ddpm_sigmas": "ddpm_linear_grid",
}


def __getattr__(name: str) -> Any:
    # the old names returned linear-path levels that a k-diffusion drop-in (which takes VE sigmas, as
    # k-diffusion's get_sigmas_karras returns them) ran without complaint at sigma <= 1: refused, naming both
    if name in _RENAMED:
        raise AttributeError(
            f"specforest.chains.{name} is gone: it returned linear-path levels t = sigma / (1 + sigma), not the "
            f"VE sigmas its name suggested. For a grid of specforest.sample(sigmas=...) or Chain.build use "
            f"specforest.chains.{_RENAMED[name]}; for VE sigmas (the k-diffusion drop-ins, k-diffusion's own "
            "samplers) use specforest.kdiffusion.get_sigmas_karras (and get_sigmas_exponential, "
            "get_sigmas_polyexponential, get_sigmas_vp)"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


REFUSED: dict = {}
"""Samplers refused by name, with the reason (``get_chain`` says it): none today (``dpmpp_sde``, once refused,
is the chain of half-steps :class:`DPMPPSDE`)."""

_CHAINS: Registry[Chain] = Registry(
    "chain",
    {
        c.name: c
        for c in (
            EM,
            EulerAncestral,
            EulerChurn,
            DDPM,
            DDIM,
            LCM,
            DPMPP2MSDE,
            DPMPP3MSDE,
            HeunChurn,
            DPM2Churn,
            DPM2Ancestral,
            DPMPP2SAncestral,
            DPMPPSDE,
        )
    },  # fmt: skip
    case_insensitive=True,
)


def register_chain(name: str, factory: Callable[[], Chain], *, replace: bool = False) -> None:
    """Make ``chain=name`` resolve to ``factory()`` (a :class:`Chain` with default parameters) everywhere.

    Raises:
        ValueError: if the name is taken and ``replace`` is False.
    """
    _CHAINS.register(name, factory, replace=replace)


def unregister_chain(name: str) -> None:
    """Remove ``name`` from the chain registry (undoes :func:`register_chain`).

    Raises:
        ValueError: if ``name`` is not registered.
    """
    _CHAINS.unregister(name)


def available_chains() -> list[str]:
    """The registered chain names."""
    return _CHAINS.names()


def get_chain(chain: "str | Chain", **params: Any) -> Chain:
    """A :class:`Chain` from a registered name (with ``params`` set) or a :class:`Chain` as it is.

    Raises:
        ValueError: an unknown name, listing the registered ones; TypeError: a parameter the chain lacks.
    """
    if isinstance(chain, Chain):
        return chain.replace(**params) if params else chain
    if isinstance(chain, str) and chain.lower() in REFUSED:
        raise ValueError(f"chain {chain!r} is refused: {REFUSED[chain.lower()]}")
    if chain not in _CHAINS:
        raise ValueError(f"chain must be a Chain or one of {', '.join(available_chains())}; got {chain!r}")
    made = _CHAINS.make(chain)
    return made.replace(**params) if params else made


PARAMETERS: dict[str, str] = {
    "churn": "The em chain's churn eps in (0, 1] (the paper's eq. 35).",
    "eta": "The chain's eta: the share of the ancestral noise, >= 0 (0: no noise, no speculation).",
    "s_noise": "The chain's s_noise: the scale of the noise it adds, > 0.",
    "s_churn": "The chain's s_churn: EDM's churn, >= 0 (0: no noise, no speculation).",
    "s_tmin": "The chain's s_tmin: EDM's churn applies at VE levels >= s_tmin, >= 0.",
    "s_tmax": "The chain's s_tmax: EDM's churn applies at VE levels <= s_tmax, >= s_tmin (inf: no bound).",
    "path": "The chain's path: ve (k-diffusion's samplers) or linear (ComfyUI's CONST models: SD3, Flux).",
    "variance": "The chain's variance: DDPM's fixed_small or fixed_large (a learned one is refused).",
    "solver_type": "The chain's solver_type (DPM++ 2M SDE's second-order step: midpoint or heun).",
    "r": "The chain's r: where DPM++ SDE's midpoint sits in log sigma between a step's levels, in (0, 1).",
}
"""What each chain parameter is, by its name (the chains share names: ``eta`` is every ancestral
chain's): a chain declares its parameters as its dataclass fields (name, type, default), and this one
line each. The command line makes a flag of each, ``--`` and the name with dashes (the em chain's
``churn`` is ``--churn``), with this help; a new parameter needs its line here."""
