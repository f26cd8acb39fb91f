"""A diffusers scheduler's own chain: ``chain="scheduler"``.

A diffusers user picks a sampler by swapping the pipeline's scheduler. Each stochastic scheduler
below moves its latents by a Gaussian whose covariance depends on the schedule alone, so it is a
:class:`~specforest.chains.Chain`; :func:`scheduler_chain` reads it off the scheduler, following
its ``step`` as the code computes it: its timesteps (spacing, ``steps_offset``), the level it steps
to (DDIM's ``t - num_train_timesteps // T``, which need not be the next timestep the model sees),
its variance formula, and ``clip_sample`` / thresholding of the predicted clean latents.

One class per scheduler. Each scheduler followed is a :class:`Followed` subclass registered under its
diffusers class name (:data:`FOLLOWED`, :func:`register_scheduler`): it declares the ``eta`` its step takes,
the further step arguments it reads (:attr:`Followed.options`: ``EDMEulerScheduler``'s ``s_churn``...), the
configs it refuses with the reason, its tables read off the scheduler's own config and arrays, and where it
draws; its history is its tables' (multistep DPM-Solver: its order less one), and so are its stages (KDPM2
ancestral's two calls a step: a :class:`StagedSchedulerChain`) and its half-steps (``DPMSolverSDEScheduler``'s
two calls a step with correlated noises: a chain of half-steps, :attr:`SchedulerChain.halves`). Every other scheduler of diffusers is refused
with its reason in one table, :data:`REFUSED_SCHEDULERS` (deterministic ODE solvers, inversions, discrete
samplers, and the ones whose two calls a step are not yet followed). Nothing outside this module names a
scheduler.

Coordinates. The pipeline's latents ``x`` at the timestep ``k`` the model sees next are written on
the library's linear path as ``y = x / n(s_k)``, where ``s_k = sqrt((1 - abar_k) / abar_k)`` and
``n(s) = (1 + s) / sqrt(1 + s^2)`` for the schedulers that keep variance-preserving latents (DDPM,
DDIM, LCM, TCD, DPM-Solver), ``n(s) = 1 + s`` for the ones that keep ``x = x_0 + s xi``
(Euler ancestral, the EDM schedulers, consistency models), and ``n = 1`` on the flow-matching path. The
velocity adapters of :mod:`specforest.diffusers.unet` feed the network exactly these latents at exactly the
scheduler's timestep (VP schedulers: a map of the level; KDPM2 ancestral and DPM-Solver SDE, whose two calls a step
pass timesteps a level does not give, the second of KDPM2 ancestral's at the next step's first call's level, declare
each call's own, :meth:`Followed.call_timesteps`, which the engine hands the adapter with the call; the EDM ones are
followed at the scheduler's level, ``scheduler_chain``),
so a step ``x' = P x + Q D + R z`` of the scheduler (``D`` its predicted clean latents) is
``y' = (P n / n') y + (Q / n') D + (R / n') z``: tables, whatever the scheduler.

Clipping is not affine in ``D``. The chain's mean stays ``a y + c v`` with the prediction replaced
by the scheduler's own (:attr:`SchedulerChain.prediction`, applied inside the velocity): the law is
the scheduler's exactly, and every draft, coupling and tree works unchanged.

Refused, each naming the reason: deterministic schedulers with a tree (the caller's check, through
:attr:`~specforest.sde.GaussianChain.stochastic`), learned variances (the covariance comes from the
network), ``fixed_large_log`` (diffusers returns NaN there), DPM-Solver's ``sde-dpmsolver``, EDM DPM-Solver's third order (its step
raises), ``final_sigmas_type`` other than ``zero``. So are the options a step would not follow: an ``eta``
with a scheduler whose ``step`` takes none (:data:`ETA_SCHEDULERS`), a DDIM ``eta`` that makes a step's
variance negative (diffusers' step is NaN there), Euler ancestral's and KDPM2 ancestral's
``prediction_type="sample"`` (their step raises). A config flag is followed as the step follows it: TCD's
step neither clips nor thresholds, DPM-Solver's thresholds, ``euler_at_final`` changes nothing into 0.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Optional

import torch

from ..chains import DPMPP2MSDE, LCM, Chain, EulerAncestral, check_ddim_eta, from_ve, stage_from_ve
from ..schedules import check_sigmas

__all__ = [
    "ETA_SCHEDULERS",
    "FOLLOWED",
    "REFUSED_SCHEDULERS",
    "SCHEDULERS",
    "Followed",
    "Tables",
    "PipelinePlan",
    "SchedulerChain",
    "StagedSchedulerChain",
    "check_scheduler",
    "directory_scheduler",
    "followed",
    "for_pipeline",
    "scheduler_chain",
    "scheduler_class",
    "register_scheduler",
    "scheduler_eta",
    "swapped_scheduler",
]
EULER_A_PREDICTIONS = ("epsilon", "v_prediction")
"""The ``prediction_type`` values ``EulerAncestralDiscreteScheduler.step`` implements (and the EDM Euler and
KDPM2 ancestral steps)."""


def _unimplemented_prediction(name: str, cfg: dict) -> Optional[str]:
    """Why scheduler ``name`` with config ``cfg`` is refused when its ``prediction_type`` is one its step does
    not implement (diffusers raises there), or ``None``."""
    if cfg.get("prediction_type", "epsilon") in EULER_A_PREDICTIONS:
        return None
    return (
        f"{name} with prediction_type={cfg.get('prediction_type')!r}: its step does not implement it "
        f"(diffusers raises); it takes {' or '.join(EULER_A_PREDICTIONS)}"
    )


SWAP = (
    "pipe.scheduler = EulerAncestralDiscreteScheduler.from_config(pipe.scheduler.config)  "
    "(or DDPMScheduler, LCMScheduler, TCDScheduler with eta > 0, DDIMScheduler with eta > 0, "
    "DPMSolverMultistepScheduler with algorithm_type='sde-dpmsolver++')"
)


@dataclass(frozen=True)
class SchedulerChain(Chain):
    """The chain of one scheduler on its own grid (made by :func:`scheduler_chain`).

    Attributes:
        scheduler: the scheduler's class name; ``eta``: the ``eta`` its steps take (DDIM, TCD), ``None``
            for a scheduler whose step takes none (:data:`ETA_SCHEDULERS`); ``options``: ``(name, value)`` pairs of
            the further arguments its step reads (:attr:`Followed.options`), empty for most.
        grid: ``(T + 1,)`` float64 linear-path levels of the timesteps the model sees, then 0.
        timesteps: ``(T,)`` the scheduler's timesteps (the network's time input at each level).
        prediction: ``prediction(D, step) -> D`` the scheduler's clip or threshold of the predicted
            clean latents ``D (M, ...)`` at steps ``step (M,)``, or ``None`` when it keeps them as they are.
        draws: ``(T,)`` bool, the steps at which the scheduler draws noise from the generator (one
            ``randn_tensor`` each), so that a run with ``tree=None`` replays the pipeline's draws.
        noise_dtype: the dtype of those draws when the scheduler fixes it (DPM-Solver, flow matching: float32), else
            ``None`` (the network output's dtype, promoted with float32 where ``noise_promoted``).
        noise_scale: the pipeline's initial latents (``init_noise_sigma xi``) on the linear path are
            ``noise_scale xi``.
        remake: ``remake(n)`` the same scheduler's chain at ``n`` inference steps (:meth:`for_steps`), or
            ``None``: the chain runs on its own grid only.
        K: ``(T, 2)`` what each state hands on to carry (:meth:`~specforest.chains.Chain.carries`), or ``None``:
            its prediction.
        halves: the grid holds each step's start and midpoint (``DPMSolverSDEScheduler``): ``N`` inference steps
            are ``2 N - 1`` chain steps, each one model call.
        times: ``(T, s)`` float64 the network's timestep at each step's calls, where the scheduler's levels do not
            give them (:meth:`call_times`), or ``None``.
    """

    scheduler: str = ""
    eta: Optional[float] = 0.0
    options: tuple = ()
    grid: torch.Tensor = field(default=None, repr=False, compare=False)
    timesteps: torch.Tensor = field(default=None, repr=False, compare=False)
    P: torch.Tensor = field(default=None, repr=False, compare=False)
    Q: torch.Tensor = field(default=None, repr=False, compare=False)
    R: torch.Tensor = field(default=None, repr=False, compare=False)
    B: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    K: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    prediction: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = field(
        default=None, repr=False, compare=False
    )
    draws: torch.Tensor = field(default=None, repr=False, compare=False)
    noise_dtype: Optional[torch.dtype] = field(default=None, repr=False, compare=False)
    noise_scale: float = field(default=1.0, repr=False, compare=False)
    noise_promoted: bool = field(default=False, repr=False, compare=False)
    remake: Optional[Callable[[int], "SchedulerChain"]] = field(default=None, repr=False, compare=False)
    halves: bool = field(default=False, repr=False, compare=False)
    times: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    name: ClassVar[str] = "scheduler"

    @property
    def params(self) -> dict:
        return {"scheduler": self.scheduler, "eta": self.eta, **dict(self.options)}

    @property
    def inference_steps(self) -> int:
        """The scheduler's ``num_inference_steps`` ``N``: the chain's steps, or ``(T + 1) / 2`` of a chain of
        half-steps."""
        return self.grid.numel() // 2 if self.halves else self.grid.numel() - 1

    def for_steps(self, steps: int) -> "SchedulerChain":
        """The same scheduler's chain at ``steps`` inference steps, on its own grid of that many steps
        (a tuner's shorter timing runs: ``chain.for_steps(n).grid`` is their grid, and this chain built
        on it takes that chain's tables).

        Raises:
            ValueError: if the chain was made without ``remake`` and ``steps`` is not its own.
        """
        if steps == self.inference_steps:
            return self
        if self.remake is None:
            raise ValueError(
                f"this {self.scheduler} chain was made for {self.grid.numel() - 1} steps only; make the chain of "
                f"{steps} steps with specforest.diffusers.scheduler_chain"
            )
        return self.remake(steps)

    def coefficients(self, sigmas: torch.Tensor) -> tuple:
        s = check_sigmas(sigmas)
        if s.shape != self.grid.shape and self.remake is not None:
            return self._on(s[:-1]).coefficients(s)
        if s.shape != self.grid.shape or not torch.allclose(s, self.grid, rtol=1e-12, atol=0.0):
            raise ValueError(
                f"the {self.scheduler} chain is tabulated on its own {self.grid.numel() - 1}-step grid; "
                "run it on chain.grid (specforest.diffusers.scheduler_chain gives both)"
            )
        return self.grid, self.P, self.Q, self.R, 1.0, 0.0

    @property
    def history(self) -> int:
        """How many past predictions the scheduler's mean reads (multistep DPM-Solver: its order less one), else 0."""
        return 0 if self.B is None else self.B.shape[1]

    def past(self, t: torch.Tensor, t_next: torch.Tensor) -> Optional[torch.Tensor]:
        return self._on(t).B

    def carries(self, t: torch.Tensor, t_next: torch.Tensor) -> Optional[torch.Tensor]:
        return self._on(t).K

    def call_times(self, sigmas: torch.Tensor) -> Optional[torch.Tensor]:
        """The scheduler's own timestep at each call (:attr:`times`), where its step declares them
        (:meth:`Followed.call_timesteps`); ``None``: the network's adapter maps the level."""
        return self._on(check_sigmas(sigmas)[:-1]).times

    def _on(self, t: torch.Tensor) -> "SchedulerChain":
        """This chain, or the same scheduler's on the grid of the states ``t (T,)`` (a tuner's shorter runs)."""
        if t.numel() == self.grid.numel() - 1 or self.remake is None:
            return self
        # a chain of half-steps has 2 N - 1 steps for N inference steps
        return self.for_steps((t.numel() + 1) // 2 if self.halves else t.numel())


@dataclass(frozen=True)
class StagedSchedulerChain(SchedulerChain):
    """The chain of a scheduler whose step makes two model calls (``KDPM2AncestralDiscreteScheduler``: its
    timesteps alternate a call at the state and one at its own interpolated level), a chain of two stages.

    Attributes:
        tableau: ``(level, alpha, beta, weight)`` on :attr:`grid` (:meth:`~specforest.chains.Chain.stage_points`).
    """

    tableau: tuple = field(default=None, repr=False, compare=False)
    stages: ClassVar[int] = 2

    def stage_points(self, sigmas: torch.Tensor) -> tuple:
        s = check_sigmas(sigmas)
        if s.shape != self.grid.shape and self.remake is not None:
            return self._on(s[:-1]).stage_points(s)
        # the grid itself is checked by coefficients, which build reads first
        return self.tableau


def _name(scheduler: Any) -> str:
    return type(scheduler).__name__


# -- the registry: one class per scheduler followed, one table of the ones refused ---------------------


@dataclass(frozen=True)
class Tables:
    """A scheduler's step on its own grid in the linear path's coordinates (what :class:`SchedulerChain` holds).

    Attributes:
        grid: ``(T + 1,)`` float64 levels of the timesteps the model sees, then 0.
        P, Q, R: ``(T,)`` float64, ``y' = P y + Q D + R z``; ``B``: ``(T, history)`` the coefficients of the
            predictions ``1 .. history`` steps before, or ``None``.
        prediction: the clip or threshold of ``D`` the step applies (:attr:`SchedulerChain.prediction`), or ``None``.
        noise_scale: the pipeline's initial latents on the linear path are ``noise_scale xi``.
    """

    grid: torch.Tensor
    P: torch.Tensor
    Q: torch.Tensor
    R: torch.Tensor
    B: Optional[torch.Tensor] = None
    prediction: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
    noise_scale: float = 1.0
    draws: Optional[torch.Tensor] = None
    """``(T,)`` bool where the draws depend on the step's arguments (else :meth:`Followed.draws`)."""
    stages: Optional[tuple] = None
    """A step of two model calls: its tableau ``(level, alpha, beta, weight)`` on ``grid``
    (:meth:`specforest.chains.Chain.stage_points`; ``P, Q`` then read ``D_eff``), else ``None`` (one call)."""
    K: Optional[torch.Tensor] = None
    """``(T, 2)`` what a state hands on to carry (:meth:`specforest.chains.Chain.carries`), else ``None``."""
    halves: bool = False
    """Whether ``grid`` holds each step's start and midpoint (:attr:`SchedulerChain.halves`)."""
    times: Optional[torch.Tensor] = None
    """``(T, s)`` float64 the timestep the network gets at each step's calls, where the levels do not give it
    (:meth:`Followed.call_timesteps`), else ``None``."""


class Followed:
    """How ``chain="scheduler"`` follows one diffusers scheduler: what its ``step`` reads and how it moves.

    A subclass is registered under the scheduler's class name (:func:`register_scheduler`) and declares:
    :attr:`eta_max` (the ``eta`` its ``step`` takes, up to this bound; ``None``: its step takes none),
    :attr:`noise_dtype` (the dtype of its draws where it fixes one), :meth:`refusal` (a config it does not
    follow, with the reason), :meth:`tables` (its step read off the scheduler's own config and tables),
    :meth:`draws` (the steps at which its ``step`` draws). Its history is the tables': the number of
    columns of ``B``; so are its stages: two where the tables carry a tableau (:attr:`Tables.stages`).
    """

    name: ClassVar[str] = ""
    eta_max: ClassVar[Optional[float]] = None
    noise_dtype: ClassVar[Optional[torch.dtype]] = None
    options: ClassVar["dict[str, float]"] = {}
    """The further arguments its ``step`` reads (besides ``eta``), with their defaults: EDM Euler's ``s_churn``..."""
    noise_promoted: ClassVar[bool] = False
    """Whether its draws take the dtype of float32 promoted with the network output's (its step upcasts the state
    to float32 and draws like the prediction), rather than :attr:`noise_dtype` or the output's."""
    own_generator: ClassVar[bool] = True
    """Whether the pipelines pass their generator to its ``step`` (else its noise is torch's global generator)."""
    family_grid: ClassVar[bool] = False
    """Whether a pipeline's run takes the family's grid (:meth:`on_grid`) rather than the scheduler's own."""

    @classmethod
    def refusal(cls, cfg: Any) -> Optional[str]:
        """The reason a scheduler of config ``cfg`` is not followed, or ``None`` (the default: every config is)."""
        return None

    @classmethod
    def check_steps(cls, sch: Any, eta: float, steps: int) -> None:
        """Raise for an ``eta`` that the step at ``steps`` steps does not define (the default: none)."""

    @classmethod
    def tables(cls, sch: Any, eta: float, **options: float) -> Tables:
        """The step's tables from ``sch``, a copy of the scheduler with its timesteps set, and the ``step``
        arguments ``options`` (:attr:`options`, checked)."""
        raise NotImplementedError

    @classmethod
    def model_timesteps(cls, sch: Any) -> torch.Tensor:
        """``(T,)`` the timesteps the model sees, one a step (the default: the scheduler's ``timesteps``)."""
        return sch.timesteps

    @classmethod
    def first_calls(cls, sch: Any) -> torch.Tensor:
        """``(N,)`` the timesteps of each inference step's first call, the UNet families' grid
        (:func:`~specforest.diffusers.unet.vp_schedule`; the default: :meth:`model_timesteps`)."""
        return cls.model_timesteps(sch)

    @classmethod
    def call_timesteps(cls, sch: Any) -> Optional[torch.Tensor]:
        """``(T, s)`` the timestep the pipeline passes the network at each of the chain's step's ``s`` calls, declared
        where the levels do not give it (two calls at one level with two timesteps); the engine hands each call its
        own (:meth:`specforest.chains.Chain.call_times`). ``None`` (the default): the adapter maps the level."""
        return None

    @classmethod
    def on_grid(cls, grid: torch.Tensor) -> Tables:
        """The tables on a family's grid ``grid (T + 1,)`` (for :attr:`family_grid` schedulers)."""
        raise NotImplementedError

    @classmethod
    def draws(cls, timesteps: torch.Tensor, eta: float) -> torch.Tensor:
        """``(T,)`` bool: where the scheduler's ``step`` draws its noise (whether or not it weighs it); the
        default: at every step."""
        return torch.ones(timesteps.numel(), dtype=torch.bool)

    @classmethod
    def own_noise(
        cls, sch: Any, steps: int, shape: tuple, device: torch.device, dtype: torch.dtype
    ) -> Optional[Callable[[int], torch.Tensor]]:
        """The standard run's noise where the scheduler's ``step`` does not draw one ``randn_tensor`` a step:
        ``noise(n) -> (shape) float32``, the chain's draw at its step ``n``, for the pipeline's scheduler ``sch``
        (read, not changed) at ``steps`` inference steps and latents of ``shape``, ``dtype`` on ``device``.
        ``None`` (the default): the draws of :meth:`PipelinePlan.noise_from`."""
        return None


FOLLOWED: "dict[str, type[Followed]]" = {}
"""The schedulers ``chain="scheduler"`` follows, by diffusers class name (:func:`register_scheduler`)."""


def register_scheduler(cls: "type[Followed]") -> "type[Followed]":
    """Make ``chain="scheduler"`` follow the diffusers scheduler ``cls.name`` as ``cls`` declares (a decorator)."""
    FOLLOWED[cls.name] = cls
    REFUSED_SCHEDULERS.pop(cls.name, None)
    return cls


_ODE = "deterministic (an ODE solver)"
_STAGES = "two model calls a step: needs stages"

REFUSED_SCHEDULERS: "dict[str, str]" = {
    "PNDMScheduler": _ODE,
    "EulerDiscreteScheduler": _ODE + " (its step's s_churn is an argument no pipeline passes)",
    "HeunDiscreteScheduler": _ODE,
    "DEISMultistepScheduler": _ODE,
    "UniPCMultistepScheduler": _ODE,
    "KDPM2DiscreteScheduler": _ODE,
    "LMSDiscreteScheduler": _ODE,
    "IPNDMScheduler": _ODE,
    "FlowMatchHeunDiscreteScheduler": _ODE + " with two model calls a step",
    "FlowMapEulerDiscreteScheduler": _ODE,
    "MiniMaxH3Scheduler": _ODE,
    "PiflowScheduler": _ODE,
    "HeliosScheduler": _ODE,
    "DDIMInverseScheduler": "an inversion (image to noise), not a sampler",
    "DPMSolverMultistepInverseScheduler": "an inversion (image to noise), not a sampler",
    "ScoreSdeVeScheduler": "a predictor-corrector (step_pred and step_correct, two model calls a step): needs stages",
    "KarrasVeScheduler": f"{_STAGES} (its step and step_correct)",
    "AmusedScheduler": "a masked-token sampler (discrete states), not a Gaussian chain",
    "VQDiffusionScheduler": "a discrete (vector-quantized) sampler, not a Gaussian chain",
    "BlockRefinementScheduler": "a masked-token sampler (discrete states), not a Gaussian chain",
    "EntropyBoundScheduler": "a masked-token sampler (discrete states), not a Gaussian chain",
    "DiscreteDDIMScheduler": "a discrete-state sampler, not a Gaussian chain",
    "RePaintScheduler": "an inpainting sampler whose step reads the known image and mask and resamples (jumps back)",
    "RFD4ProteinaScheduler": "a protein-structure sampler whose step reads an emission mask: not a latent image chain",
    "HeliosDMDScheduler": "its step reads a noisy tensor the pipeline passes (dmd_noisy_tensor), not a state it carries",
    "CogVideoXDPMScheduler": (
        "its step reads the previous step's prediction and a second timestep the pipeline passes "
        "(old_pred_original_sample, timestep_back): not followed yet"
    ),
    "UnCLIPScheduler": "its variance is learned (learned_range: the covariance comes from the network)",
    "CosineDPMSolverMultistepScheduler": (
        "its noise comes from a Brownian tree seeded by the run, not the pipeline's generator: not followed yet"
    ),
    "CogVideoXDDIMScheduler": "deterministic: its step takes eta but draws no noise",
    "DPMSolverSinglestepScheduler": (
        "its sde-dpmsolver++ updates read the state at the start of their group of steps (a singlestep solver's "
        "stages spread over several steps), not one state a step: not followed yet"
    ),
    "SASolverScheduler": "stochastic and Gaussian given its past predictions (a predictor-corrector over up to 4), not followed yet",
    "SCMScheduler": "stochastic (sCM's TrigFlow consistency steps), not followed yet",
}
"""The diffusers schedulers ``chain="scheduler"`` refuses, by class name, with the reason (a name in neither this
table nor :data:`FOLLOWED` is refused as unknown)."""


def _ddim_levels(sch: Any, ts: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor]":
    """``(abar, abar')`` ``(T,)`` float64 of DDIM's steps: ``abar'`` at ``t - num_train_timesteps // T``
    (``final_alpha_cumprod`` below 0), which need not be the next timestep the model sees."""
    acp = sch.alphas_cumprod.to(torch.float64)
    final = torch.tensor(float(getattr(sch, "final_alpha_cumprod", torch.tensor(1.0))), dtype=torch.float64)
    pt = ts - sch.config["num_train_timesteps"] // ts.numel()
    return acp[ts], torch.where(pt >= 0, acp[pt.clamp(min=0)], final)


def _fresh(scheduler: Any, steps: int, **kw: Any) -> Any:
    """A copy of ``scheduler`` with ``set_timesteps(steps)`` (the pipeline's scheduler is not touched)."""
    fresh = type(scheduler).from_config(scheduler.config)
    fresh.set_timesteps(steps, device="cpu", **kw)
    return fresh


def _vp_scale(ab: torch.Tensor) -> torch.Tensor:
    """``n(s)`` of VP latents at ``abar`` (``x = n y``): ``(1 + s) / sqrt(1 + s^2) = sqrt(abar) + sqrt(1 - abar)``."""
    return ab.sqrt() + (1.0 - ab).sqrt()


def _to_linear(P, Q, R, n, n_next) -> tuple:
    """A step ``x' = P x + Q D + R z`` on latents ``x = n y`` in the linear path's coordinates."""
    return P * n / n_next, Q / n_next, R / n_next


def _clip(cfg: Any, weight: Optional[torch.Tensor]) -> Optional[Callable]:
    """The scheduler's clip or dynamic threshold of ``D`` as a prediction hook; with ``weight (T,)``
    (DDIM without ``use_clipped_model_output``) the mean mixes the clipped and raw predictions:
    ``D_eff = w clip(D) + (1 - w) D``."""
    if cfg.get("thresholding", False):
        ratio, top = float(cfg.get("dynamic_thresholding_ratio", 0.995)), float(cfg.get("sample_max_value", 1.0))

        def change(d: torch.Tensor) -> torch.Tensor:
            flat = d.reshape(d.shape[0], -1)
            s = torch.quantile(flat.abs().float(), ratio, dim=1).clamp(1.0, top).to(d.dtype)[:, None]
            return (flat.clamp(-s, s) / s).reshape(d.shape)

    elif cfg.get("clip_sample", False):
        r = float(cfg.get("clip_sample_range", 1.0))

        def change(d: torch.Tensor) -> torch.Tensor:
            return d.clamp(-r, r)

    else:
        return None
    if weight is None:
        return lambda d, step: change(d)

    def mixed(d: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        w = weight.to(d.device, d.dtype)[step].reshape(-1, *[1] * (d.ndim - 1))
        return torch.lerp(d, change(d), w)

    return mixed


def _ve_levels(sch: Any) -> torch.Tensor:
    """``(T,)`` the VE levels ``sigma`` a sigma-based scheduler steps through (its ``sigmas``, the last 0 dropped)."""
    sig = torch.as_tensor(sch.sigmas).detach().to("cpu", torch.float64)
    if sig.numel() != sch.timesteps.numel() + 1 or float(sig[-1]) != 0.0:
        raise ValueError(
            f"{_name(sch)} ends its grid at sigma = {float(sig[-1]):.4g}, not 0: chain='scheduler' follows grids "
            "that end at 0 only"
        )
    return sig[:-1]


def _vp_linear(cls: "type[_VP]", sch: Any, eta: float) -> Tables:
    """A VP scheduler's tables: its step on VP latents, on the linear path."""
    ab, P, Q, R, weight = cls.vp_step(sch, eta)
    s = ((1.0 - ab) / ab).sqrt()
    grid = torch.cat([s / (1.0 + s), s.new_zeros(1)])
    n = _vp_scale(ab)
    n_next = torch.cat([n[1:], torch.ones(1, dtype=torch.float64)])  # the last state is the output latents
    P, Q, R = _to_linear(P, Q, R, n, n_next)
    clip = _clip(sch.config, weight) if cls.clips else None
    return Tables(grid, P, Q, R, prediction=clip, noise_scale=_vp_noise_scale(sch, float(s[0])))


class _VP(Followed):
    """A scheduler of variance-preserving latents stepping on its ``alphas_cumprod`` at its integer timesteps."""

    clips: ClassVar[bool] = True
    """Whether the step clips or thresholds the predicted clean latents as its config says."""

    @classmethod
    def vp_step(cls, sch: Any, eta: float) -> tuple:
        """``(ab (T,), P, Q, R (T,) on VP latents, weight)`` (``weight``: see :func:`_clip`)."""
        raise NotImplementedError

    @classmethod
    def tables(cls, sch: Any, eta: float, **options: float) -> Tables:
        return _vp_linear(cls, sch, eta)


@register_scheduler
class _DDPM(_VP):
    name = "DDPMScheduler"

    @classmethod
    def refusal(cls, cfg: Any) -> Optional[str]:
        variance = cfg.get("variance_type")
        if variance in ("learned", "learned_range"):
            return (
                f"DDPMScheduler with variance_type={variance!r}: the variance comes from the network's output, so "
                "the step's covariance depends on the model and no coupling can be exact to it; use fixed_small or "
                "fixed_large"
            )
        if variance == "fixed_large_log":
            return "DDPMScheduler with variance_type='fixed_large_log' returns NaN in diffusers; use fixed_large"
        return None

    @classmethod
    def vp_step(cls, sch, eta):
        ts = sch.timesteps.to(torch.long)
        acp = sch.alphas_cumprod.to(torch.float64)
        ab = acp[ts]
        prev = torch.cat([acp[ts[1:]], torch.ones(1, dtype=torch.float64)])  # previous_timestep, -1 -> one
        alpha = ab / prev
        beta = 1.0 - alpha
        Q = prev.sqrt() * beta / (1.0 - ab)
        P = alpha.sqrt() * (1.0 - prev) / (1.0 - ab)
        small = ((1.0 - prev) / (1.0 - ab) * beta).clamp_min(1e-20)
        var = beta if sch.config.get("variance_type", "fixed_small") == "fixed_large" else small
        R = torch.where(ts > 0, var.sqrt(), torch.zeros_like(var))
        # (the clamp leaves 1e-10 at a last step into abar' = 1: a point mass there, as near as float allows)
        R = torch.where(prev >= 1.0, torch.zeros_like(R), R)
        return ab, P, Q, R, None

    @classmethod
    def draws(cls, timesteps, eta):
        return timesteps > 0


@register_scheduler
class _DDIM(_VP):
    name = "DDIMScheduler"
    eta_max = math.inf

    @classmethod
    def check_steps(cls, sch, eta, steps):
        if eta > 0:
            fresh = _fresh(sch, steps)
            ts = fresh.timesteps.to(torch.long)
            check_ddim_eta(eta, *_ddim_levels(fresh, ts), ts)

    @classmethod
    def vp_step(cls, sch, eta):
        ts = sch.timesteps.to(torch.long)
        ab, prev = _ddim_levels(sch, ts)
        check_ddim_eta(eta, ab, prev, ts)
        var = (1.0 - prev) / (1.0 - ab) * (1.0 - ab / prev)
        std = eta * var.sqrt()
        # (rounding only, eta checked: the variance is >= 0 up to 1e-12)
        k = (1.0 - prev - std**2).clamp_min(0.0).sqrt()
        P = k / (1.0 - ab).sqrt()
        Q = prev.sqrt() - k * ab.sqrt() / (1.0 - ab).sqrt()
        # pipelines never pass step(use_clipped_model_output=True): the mean reads the clipped D
        # (through sqrt(abar')) and the raw one (through eps)
        weight = prev.sqrt() / Q
        return ab, P, Q, std, weight

    @classmethod
    def draws(cls, timesteps, eta):
        return torch.full((timesteps.numel(),), eta > 0)


@register_scheduler
class _DDPMParallel(_DDPM):
    """``DDPMParallelScheduler``: DDPM's step (its ``batch_step_no_noise`` is for ParaDiGMS, not a pipeline's loop)."""

    name = "DDPMParallelScheduler"


@register_scheduler
class _DDIMParallel(_DDIM):
    """``DDIMParallelScheduler``: DDIM's step, its ``eta`` included."""

    name = "DDIMParallelScheduler"


@register_scheduler
class _DDPMWuerstchen(_VP):
    """``DDPMWuerstchenScheduler``: DDPM's posterior step on Wuerstchen's cosine ``abar(t)`` (clamped to
    ``[1e-4, 0.9999]``) at its continuous timesteps ``1 .. 0``, the network predicting the noise. Its last step
    lands at ``abar(0)`` without noise (the output latents); it draws at every step."""

    name = "DDPMWuerstchenScheduler"

    @classmethod
    def model_timesteps(cls, sch):
        return sch.timesteps[:-1]  # (its list ends with the 0 it steps to)

    @classmethod
    def vp_step(cls, sch, eta):
        ts = sch.timesteps.detach().to("cpu")
        acp = sch._alpha_cumprod(ts, "cpu").to(torch.float64)
        ab, prev = acp[:-1], acp[1:]
        alpha = ab / prev
        P = (1.0 - (1.0 - alpha) / (1.0 - ab)) / alpha.sqrt()
        Q = (1.0 - alpha) * ab.sqrt() / (alpha.sqrt() * (1.0 - ab))
        R = ((1.0 - alpha) * (1.0 - prev) / (1.0 - ab)).sqrt()
        R = torch.where(ts[1:] != 0, R, torch.zeros_like(R))
        return ab, P, Q, R, None


@register_scheduler
class _LCM(_VP):
    name = "LCMScheduler"

    @classmethod
    def vp_step(cls, sch, eta):
        ts = sch.timesteps.to(torch.long)
        T = ts.numel()
        acp = sch.alphas_cumprod.to(torch.float64)
        ab = acp[ts]
        prev = torch.cat([acp[ts[1:]], ab[-1:]])
        scal = [sch.get_scalings_for_boundary_condition_discrete(t) for t in ts.tolist()]
        c_skip = torch.tensor([float(c[0]) for c in scal], dtype=torch.float64)
        c_out = torch.tensor([float(c[1]) for c in scal], dtype=torch.float64)
        last = torch.arange(T) == T - 1
        g = torch.where(last, torch.ones_like(prev), prev.sqrt())
        R = torch.where(last, torch.zeros_like(prev), (1.0 - prev).sqrt())
        return ab, g * c_skip, g * c_out, R, None

    @classmethod
    def draws(cls, timesteps, eta):
        return torch.arange(timesteps.numel()) != timesteps.numel() - 1


@register_scheduler
class _TCD(_VP):
    name = "TCDScheduler"
    eta_max = 1.0
    # TCD's step neither clips nor thresholds, whatever its config says (diffusers keeps the flags unused)
    clips = False

    @classmethod
    def vp_step(cls, sch, eta):
        ts = sch.timesteps.to(torch.long)
        T = ts.numel()
        acp = sch.alphas_cumprod.to(torch.float64)
        ab = acp[ts]
        prev_t = torch.cat([ts[1:], torch.zeros(1, dtype=torch.long)])
        prev = acp[prev_t]
        s_t = torch.floor((1.0 - eta) * prev_t.double()).long()
        ab_s = acp[s_t]
        A = (1.0 - ab_s).sqrt() / (1.0 - ab).sqrt()
        Bq = ab_s.sqrt() - (1.0 - ab_s).sqrt() * ab.sqrt() / (1.0 - ab).sqrt()
        last = torch.arange(T) == T - 1
        renoise = (eta > 0) & ~last
        g = torch.where(renoise, (prev / ab_s).sqrt(), torch.ones_like(prev))
        R = torch.where(renoise, (1.0 - prev / ab_s).clamp_min(0.0).sqrt(), torch.zeros_like(prev))
        return ab, g * A, g * Bq, R, None

    @classmethod
    def draws(cls, timesteps, eta):
        return (torch.arange(timesteps.numel()) != timesteps.numel() - 1) & (eta > 0)


@register_scheduler
class _EulerAncestral(Followed):
    name = "EulerAncestralDiscreteScheduler"

    @classmethod
    def refusal(cls, cfg):
        return _unimplemented_prediction(cls.name, cfg)

    @classmethod
    def tables(cls, sch, eta, **options):
        s = _ve_levels(sch)
        grid = torch.cat([s / (1.0 + s), s.new_zeros(1)])
        # its latents are VE (x_0 + s xi): the initial noise init_noise_sigma xi is y = x / (1 + s_0)
        scale = float(sch.init_noise_sigma) / (1.0 + float(s[0]))
        return Tables(grid, *EulerAncestral(eta=1.0).step(grid[:-1], grid[1:]), noise_scale=scale)


def _dpm_sde_third(s: torch.Tensor, solver_type: str, lower_order_final: bool) -> tuple:
    """``(P, Q, B (T, 2), R)`` on VE levels of diffusers' ``sde-dpmsolver++`` at ``solver_order=3`` on the VE
    levels ``s (T,)`` then 0 (``x' = P x + Q D + B_0 D_1 + B_1 D_2 + R z``, ``D_j`` the prediction ``j`` steps before).

    Its step picks its order as ``DPMSolverMultistepScheduler.step`` does: first at step 0 and at the last step
    (into 0), second at step 1 and, with ``lower_order_final`` and fewer than 15 steps, at the last but one; third
    elsewhere, ``h = log(s / s')``, ``r0 = h_1 / h``, ``r1 = h_2 / h`` (the two steps before)::

        x' = (s' / s) e^(-h) x + (1 - e^(-2h)) D0 + c1 D1 + c2 D2 + s' sqrt(1 - e^(-2h)) z,
        c1 = (1 - e^(-2h)) / (-2h) + 1,  c2 = (1 - e^(-2h) - 2h) / (2h)^2 - 1/2,

    with ``D1 = D1_0 + r0 (D1_0 - D1_1) / (r0 + r1)``, ``D2 = (D1_0 - D1_1) / (r0 + r1)``, ``D1_0 = (D - D_1) / r0``,
    ``D1_1 = (D_1 - D_2) / r1``. (diffusers' ``c2`` is not k-diffusion's DPM++ 3M SDE ``-phi_3``: the sign of its
    ``1/2`` differs, so this is its own chain.)
    """
    grid = torch.cat([s / (1.0 + s), s.new_zeros(1)])
    t, t_next = grid[:-1], grid[1:]
    P, Q0, k, R, h = DPMPP2MSDE(eta=1.0, solver_type=solver_type).ve_terms(t, t_next)
    T = s.numel()
    n = torch.arange(T)
    last = n == T - 1
    second = (n == 1) | ((n == T - 2) & lower_order_final & (T < 15))
    third = (n >= 2) & ~second & ~last
    H = 2.0 * h
    c1 = Q0 / (-H) + 1.0
    c2 = (Q0 - H) / (H * H) - 0.5
    r0 = torch.cat([h.new_ones(1), h[:-1] / h[1:]])
    r1 = torch.cat([h.new_ones(2), h[:-2] / h[2:]])
    u, w = r0 / (r0 + r1), 1.0 / (r0 + r1)
    alpha, beta = c1 * (1.0 + u) + c2 * w, c1 * u + c2 * w
    zero = torch.zeros_like(h)
    e0 = torch.where(third, alpha / r0, torch.where(second & ~last, k / r0, zero))  # of D - D_1
    e1 = torch.where(third, beta / r1, zero)  # of D_1 - D_2, with a minus
    B = torch.stack([-e0 - e1, e1], 1)
    return P, Q0 + e0, B, R


@register_scheduler
class _DPMSolverMultistep(Followed):
    """DPM-Solver++ with ``algorithm_type="sde-dpmsolver++"`` on VP latents: k-diffusion's DPM++ 2M SDE at
    ``eta = 1`` for ``solver_order`` 1 (without its multistep term) and 2 (history 1); at order 3 diffusers'
    own third-order update (:func:`_dpm_sde_third`), which reads two past predictions (history 2). Its sigmas
    (Karras, exponential, beta, Lu's lambdas) are read off the scheduler; ``euler_at_final`` changes nothing with
    ``final_sigmas_type="zero"`` (the last step is first order there anyway)."""

    name = "DPMSolverMultistepScheduler"
    noise_dtype = torch.float32

    @classmethod
    def refusal(cls, cfg):
        if cfg.get("algorithm_type") != "sde-dpmsolver++" or cfg.get("solver_order", 2) not in (1, 2, 3):
            return (
                f"{cls.name} is followed with algorithm_type='sde-dpmsolver++' and solver_order 1, 2 "
                f"or 3 (got {cfg.get('algorithm_type')!r}, order {cfg.get('solver_order')}); the ODE algorithms are "
                "deterministic and sde-dpmsolver is deprecated in diffusers"
            )
        if cfg.get("final_sigmas_type", "zero") != "zero":
            return f"{cls.name} is followed with final_sigmas_type='zero' only (sigma_min ends the grid above the data)"
        if cfg.get("use_flow_sigmas", False):
            return f"{cls.name} with use_flow_sigmas=True (latents on the flow path) is not followed yet"
        if cfg.get("variance_type") is not None:
            return (
                f"{cls.name} with variance_type={cfg.get('variance_type')!r} (the network's variance channels, "
                "which the step drops) is not followed"
            )
        return None

    @classmethod
    def noise_scale(cls, sch: Any, s0: float) -> float:
        """The initial state's scale on the linear path (VP latents)."""
        return _vp_noise_scale(sch, s0)

    @classmethod
    def tables(cls, sch, eta, **options):
        s = _ve_levels(sch)
        grid = torch.cat([s / (1.0 + s), s.new_zeros(1)])
        t, t_next = grid[:-1], grid[1:]
        solver_type = sch.config.get("solver_type", "midpoint")
        chain = DPMPP2MSDE(eta=1.0, solver_type=solver_type)
        scale = cls.noise_scale(sch, float(s[0]))
        # its step thresholds the predicted clean latents (the ones it keeps for the next step too); it has no clip
        threshold = _clip({k: v for k, v in sch.config.items() if k != "clip_sample"}, None)
        order = sch.config.get("solver_order", 2)
        if order == 1:
            Pv, Q0, _, Rv, _ = chain.ve_terms(t, t_next)
            return Tables(grid, *from_ve(t, t_next, Pv, Q0, Rv), prediction=threshold, noise_scale=scale)
        if order == 2:
            return Tables(
                grid, *chain.step(t, t_next), B=chain.past(t, t_next), prediction=threshold, noise_scale=scale
            )
        P, Q, B, R = _dpm_sde_third(s, solver_type, bool(sch.config.get("lower_order_final", True)))
        return Tables(
            grid,
            *from_ve(t, t_next, P, Q, R),
            B=(1.0 - t_next)[:, None] * B,
            prediction=threshold,
            noise_scale=scale,
        )


@register_scheduler
class _EDMDPMSolverMultistep(_DPMSolverMultistep):
    """``EDMDPMSolverMultistepScheduler`` with ``algorithm_type="sde-dpmsolver++"`` at ``solver_order`` 1 and 2 (the
    orders its stochastic step offers): DPM-Solver++'s step on its EDM (Karras or exponential) sigmas, on VE latents ``x = x_0 + s xi`` (its ``alpha_t = 1``); its draws take the
    network output's dtype."""

    name = "EDMDPMSolverMultistepScheduler"
    noise_dtype = None

    @classmethod
    def refusal(cls, cfg):
        if cfg.get("algorithm_type") == "sde-dpmsolver++" and cfg.get("solver_order", 2) == 3:
            return (
                f"{cls.name} with algorithm_type='sde-dpmsolver++' and solver_order=3: its step raises from the "
                "third step on (diffusers has no third-order sde-dpmsolver++ update there); use solver_order 1 or 2, "
                "or DPMSolverMultistepScheduler, which has one"
            )
        return super().refusal(cfg)

    @classmethod
    def noise_scale(cls, sch, s0):
        return float(sch.init_noise_sigma) / (1.0 + s0)


@register_scheduler
class _EDMEuler(Followed):
    """``EDMEulerScheduler`` with ``s_churn`` (and ``s_tmin``, ``s_tmax``, ``s_noise``), on VE latents.

    Its ``step`` takes the network output ``F`` the pipeline computed at the state ``x`` and level ``s`` (before
    any churn), churns ``x^ = x + s_noise sqrt(s^2_hat - s^2) z`` with ``s^ = s (1 + gamma)``,
    ``gamma = min(s_churn / T, sqrt 2 - 1)`` where ``s_tmin <= s <= s_tmax``, then reads ``F`` as a prediction at
    ``s^``: ``D^ = c_skip(s^) x^ + c_out(s^) F`` and ``x' = x^ + (D^ - x^) (s' - s^) / s^``. With the model's
    own prediction at ``(x, s)``, ``D = c_skip(s) x + c_out(s) F``, that is Gaussian given ``x`` and ``D``::

        x' = (A - C c_skip(s)) x + C D + A s_noise sqrt(s^2_hat - s^2) z,
        A = s' / s^ + (1 - s' / s^) c_skip(s^),  C = (1 - s' / s^) c_out(s^) / c_out(s),

    (not EDM's Algorithm 2, which evaluates the model at the churned state: diffusers' step does not). With
    ``s_churn = 0`` (its default, and all a pipeline passes) it is deterministic Euler.
    """

    name = "EDMEulerScheduler"
    options = {"s_churn": 0.0, "s_tmin": 0.0, "s_tmax": math.inf, "s_noise": 1.0}

    @classmethod
    def refusal(cls, cfg):
        return _unimplemented_prediction(cls.name, cfg)

    @classmethod
    def tables(cls, sch, eta, **options):
        s = _ve_levels(sch)
        s_next = torch.cat([s[1:], s.new_zeros(1)])
        T = s.numel()
        sd = float(sch.config.get("sigma_data", 0.5))
        # diffusers compares the float32 sigma with the bounds and takes gamma in Python floats
        s32 = torch.as_tensor(sch.sigmas).detach().to("cpu")[:-1]
        on = (s32 >= options["s_tmin"]) & (s32 <= options["s_tmax"]) & (options["s_churn"] > 0)
        gamma = torch.where(on, min(options["s_churn"] / T, 2**0.5 - 1), 0.0).to(torch.float64)
        hat = s * (gamma + 1.0)

        def c_skip(v):
            return sd**2 / (v * v + sd**2)

        def c_out(v):  # (v_prediction's sign cancels in the ratio below)
            return v * sd / (v * v + sd**2).sqrt()

        ratio = s_next / hat
        A = ratio + (1.0 - ratio) * c_skip(hat)
        C = (1.0 - ratio) * c_out(hat) / c_out(s)
        R = A * options["s_noise"] * (hat * hat - s * s).clamp_min(0.0).sqrt()
        grid = torch.cat([s / (1.0 + s), s.new_zeros(1)])
        P, Q, R = _to_linear(A - C * c_skip(s), C, R, 1.0 + s, 1.0 + s_next)
        return Tables(grid, P, Q, R, noise_scale=float(sch.init_noise_sigma) / (1.0 + float(s[0])), draws=on)


@register_scheduler
class _CMStochasticIterative(Followed):
    """``CMStochasticIterativeScheduler``, consistency models' multistep sampling, on VE latents.

    Its step takes the denoised ``D = c_skip(s) x + c_out(s) F`` (clamped to ``[-1, 1]`` with ``clip_denoised``,
    the prediction hook) and renoises to the next level: ``x' = D + s_noise sqrt(s'^2 - sigma_min^2) z`` with
    ``s'`` clamped to ``[sigma_min, sigma_max]``. Its last level is ``sigma_min``, where it renoises by 0: the
    output is the last ``D``, at level 0 here. It draws at every step of a run of more than one step.
    """

    name = "CMStochasticIterativeScheduler"

    @classmethod
    def tables(cls, sch, eta, **options):
        cfg = sch.config
        sig = torch.as_tensor(sch.sigmas).detach().to("cpu", torch.float64)
        s, s_next = sig[:-1], torch.cat([sig[1:-1], sig.new_zeros(1)])
        lo, hi = float(cfg.sigma_min), float(cfg.sigma_max)
        hat = sig[1:].clamp(lo, hi)
        noise = float(cfg.s_noise) * (hat * hat - lo * lo).clamp_min(0.0).sqrt()
        grid = torch.cat([s / (1.0 + s), s.new_zeros(1)])
        P, Q, R = _to_linear(torch.zeros_like(s), torch.ones_like(s), noise, 1.0 + s, 1.0 + s_next)
        clip = (lambda d, step: d.clamp(-1.0, 1.0)) if cfg.get("clip_denoised", True) else None
        return Tables(grid, P, Q, R, prediction=clip, noise_scale=float(sch.init_noise_sigma) / (1.0 + float(s[0])))

    @classmethod
    def draws(cls, timesteps, eta):
        return torch.full((timesteps.numel(),), timesteps.numel() > 1)


@register_scheduler
class _KDPM2Ancestral(Followed):
    """``KDPM2AncestralDiscreteScheduler``, k-diffusion's DPM2 ancestral at ``eta = 1`` on VE latents: two calls a step.

    Its timesteps interleave two calls a step ``n``: a first-order ``step`` at the state ``x`` (level ``s``, its
    ``sigmas``) moves to ``x_2 = x + (s_mid - s) d_1`` at its own interpolated level ``s_mid`` (``sigmas_interpol``,
    the log-midpoint of ``s`` and ``sigma_down``), and the second-order ``step`` at ``x_2`` ends at
    ``x' = x + (sigma_down - s) d_2 + sigma_up z`` (its draw). That is ``x' = (sigma_down / s) x +
    (1 - sigma_down / s) D_eff + sigma_up z`` with ``D_eff = (1 - s / s_mid) D_1 + (s / s_mid) D_2``. Its last step
    (``s_mid = 0``) makes one call, ``x' = D_1``, and draws nothing: a run of ``T`` steps makes ``2 T - 1`` calls.
    Read off its own (float32) ``sigmas``, ``sigmas_interpol``, ``sigmas_up``, ``sigmas_down``, whatever its
    spacing and sigma family.
    """

    name = "KDPM2AncestralDiscreteScheduler"

    @classmethod
    def refusal(cls, cfg):
        return _unimplemented_prediction(cls.name, cfg)

    @classmethod
    def model_timesteps(cls, sch):
        # a step's first call is every other timestep (the second ones are its interpolated levels')
        return sch.timesteps[0::2]

    @classmethod
    def call_timesteps(cls, sch):
        # its second call's level is the next step's first's (sigma_interpol = sigma' at eta 1), where it passes
        # sigma_to_t of the level, and the next step's first call the spacing's own timestep: a level gives neither
        ts = torch.as_tensor(sch.timesteps).detach().to("cpu", torch.float64)
        first = ts[0::2]
        # (the last step makes one call: its unused second stage reads the first's timestep)
        return torch.stack([first, torch.cat([ts[1::2], first[-1:]])], 1)

    @classmethod
    def tables(cls, sch, eta, **options):
        T = int(sch.num_inference_steps)
        # its arrays repeat each step's value twice after the first: step n's are at 0, 1, 3, ..., 2 T - 3
        at = torch.tensor([0] + [2 * n - 1 for n in range(1, T)], dtype=torch.long)
        read = lambda a: torch.as_tensor(a).detach().to("cpu", torch.float64)[at]  # noqa: E731
        s, mid, up, down = read(sch.sigmas), read(sch.sigmas_interpol), read(sch.sigmas_up), read(sch.sigmas_down)
        s_next = torch.cat([s[1:], s.new_zeros(1)])
        one = mid == 0  # the last step: one call, x' = D_1, no draw
        ratio = torch.where(one, torch.zeros_like(s), down / s)
        noise = torch.where(one, torch.zeros_like(up), up)
        t, t_next = s / (1.0 + s), s_next / (1.0 + s_next)
        P, Q, R = from_ve(t, t_next, ratio, 1.0 - ratio, noise)
        # the second call: at x_2 = (s_mid / s) x + (1 - s_mid / s) D_1, level s_mid (its own state where unused)
        t2 = torch.where(one, t, mid / (1.0 + mid))
        mid_ratio = torch.where(one, torch.ones_like(s), mid / s)
        alpha, beta = stage_from_ve(t, t2, mid_ratio, (1.0 - mid_ratio)[:, None])
        w2 = torch.where(one, torch.zeros_like(s), s / mid.clamp_min(torch.finfo(torch.float64).tiny))
        be = torch.zeros(T, 2, 2, dtype=torch.float64)
        be[:, 1, :1] = beta
        stages = (
            torch.stack([t, t2], 1),
            torch.stack([torch.ones_like(t), alpha], 1),
            be,
            torch.stack([1.0 - w2, w2], 1),
        )
        grid = torch.cat([t, t.new_zeros(1)])
        scale = float(sch.init_noise_sigma) / (1.0 + float(s[0]))
        return Tables(grid, P, Q, R, noise_scale=scale, draws=~one, stages=stages, times=cls.call_timesteps(sch))


@register_scheduler
class _DPMSolverSDE(Followed):
    """``DPMSolverSDEScheduler``, k-diffusion's DPM++ SDE at ``eta = 1`` and ``r = 1/2`` (its ``midpoint_ratio``) on
    VE latents: two calls a step, with two correlated noises from one Brownian tree (torchsde, identity transform).

    Its timesteps interleave each step's first-order call, at the state (level ``s``, its ``sigmas``), and its
    second-order call, at the midpoint ``x_2`` (level ``sigma_fn(t + h / 2)``, its ``mid_point_sigma``; the
    scheduler keeps the step's start in ``sample`` meanwhile, ``state_in_first_order``). Its second-order ``step``
    reads only the midpoint's prediction (``fac = 1``) and draws the whole step's noise, correlated with the first's:
    the chain of half-steps :class:`~specforest.chains.DPMPPSDE` on its own (float32) levels, the midpoints computed
    as its step computes them. Its last step (into 0) makes one call: a run of ``T`` steps makes ``2 T - 1`` calls,
    one a chain step, each at its own timestep (:meth:`call_timesteps`). Its ``step``'s ``s_noise`` is followed
    (:attr:`Followed.options`). Its noise is its Brownian tree's (seeded by ``noise_sampler_seed``, else torch's
    global generator), never a pipeline's generator: a run draws pairs of that law, and a standard run through a
    pipeline queries the tree as its step does (:meth:`own_noise`), the pipeline's own latents.
    """

    name = "DPMSolverSDEScheduler"
    options = {"s_noise": 1.0}
    own_generator = False

    @classmethod
    def refusal(cls, cfg):
        return _unimplemented_prediction(cls.name, cfg)

    @classmethod
    def first_calls(cls, sch):
        # its timesteps interleave each step's start and its midpoint: the steps' starts are every other one
        return sch.timesteps[0::2]

    @classmethod
    def call_timesteps(cls, sch):
        # one call a half-step, at its own timestep (the midpoint's is sigma_to_t of the midpoint in float64)
        return torch.as_tensor(sch.timesteps).detach().to("cpu", torch.float64)[:, None]

    @classmethod
    def tables(cls, sch, eta, **options):
        from ..chains import DPMPPSDE

        sig = torch.as_tensor(sch.sigmas).detach().to("cpu")  # (2 T,): s_0, s_1, s_1, ..., s_{T-1}, s_{T-1}, 0
        start, end = sig[0::2], sig[1::2]  # each step's sigma and sigma_next, as its first-order step reads them
        # the midpoint as its step computes it, in the sigmas' dtype: sigma_fn(t + (t_next - t) / 2)
        t, t_next = start[:-1].log().neg(), end[:-1].log().neg()
        mid = (t + (t_next - t) * 0.5).neg().exp().to(torch.float64)
        s = start.to(torch.float64)
        levels = torch.empty(sig.numel(), dtype=torch.float64)
        levels[0::2] = s / (1.0 + s)
        levels[1:-1:2] = mid / (1.0 + mid)
        levels[-1] = 0.0
        chain = DPMPPSDE(eta=1.0, s_noise=options.get("s_noise", 1.0), r=0.5)
        a, b = levels[:-1], levels[1:]
        P, Q, R = chain.step(a, b)
        scale = float(sch.init_noise_sigma) / (1.0 + float(s[0]))
        draws = torch.ones(a.numel(), dtype=torch.bool)
        draws[-1] = False  # into 0: its Euler step draws nothing
        return Tables(
            levels, P, Q, R, B=chain.past(a, b), K=chain.carries(a, b), noise_scale=scale, draws=draws, halves=True,
            times=cls.call_timesteps(sch),
        )  # fmt: skip

    @classmethod
    def own_noise(cls, sch, steps, shape, device, dtype):
        """Its own Brownian tree's noise, as its ``step`` queries it: made at the first draw as the step makes it
        (diffusers' ``BrownianTreeNoiseSampler`` over its sigmas, seeded by ``noise_sampler_seed``, else by torch's
        global generator then), then at each step the increment to its midpoint ``n_1`` and over the whole step
        ``n_2``, at the float32 levels its step computes. The chain's half-steps read independent draws: ``n_1``,
        then ``(n_2 - rho n_1) / sqrt(1 - rho^2)`` with ``rho = sqrt((s - s_mid) / (s - s'))``, which its second
        half-step combines back into ``n_2``. So a standard run gives the pipeline's own latents."""
        from diffusers.schedulers.scheduling_dpmsolver_sde import BrownianTreeNoiseSampler

        sig = _fresh(sch, steps).sigmas.to(device)  # (2 N,) float32: s_0, s_1, s_1, ..., s_{N-1}, s_{N-1}, 0
        seed = getattr(sch, "noise_sampler_seed", None)
        made: dict = {}

        def pair(i: int) -> "tuple[torch.Tensor, torch.Tensor]":
            if "sampler" not in made:
                # (as its step does on its first call: a seed of None draws one from torch's global generator)
                lo, hi = sig[sig > 0].min(), sig.max()
                x = torch.zeros(shape, device=device, dtype=dtype)
                made["sampler"] = BrownianTreeNoiseSampler(x, lo.item(), hi.item(), seed)
            if made.get("step") != i:
                # its step's arithmetic on its float32 sigmas: sigma_fn(t), sigma_fn(t + h / 2), sigma_fn(t_next)
                t, t_next = sig[2 * i].log().neg(), sig[2 * i + 1].log().neg()
                s, mid, nxt = t.neg().exp(), (t + (t_next - t) * 0.5).neg().exp(), t_next.neg().exp()
                n1, n2 = made["sampler"](s, mid), made["sampler"](s, nxt)
                rho = math.sqrt((float(s) - float(mid)) / (float(s) - float(nxt)))
                second = (n2.double() - rho * n1.double()) / math.sqrt(1.0 - rho * rho)
                made.update(step=i, draws=(n1.float().reshape(shape), second.float().reshape(shape)))
            return made["draws"]

        def noise(n: int) -> torch.Tensor:
            if n < 0 or n >= 2 * steps - 2:  # (the last step, into 0, draws nothing)
                return torch.zeros(shape, device=device)
            return pair(n // 2)[n % 2]

        return noise


@register_scheduler
class _LTXEulerAncestralRF(Followed):
    """``LTXEulerAncestralRFScheduler``: Euler ancestral on the flow path (ComfyUI's ``euler_ancestral_RF``), its
    config's ``eta`` and ``s_noise``. With ``s_d = s' (1 + (s' / s - 1) eta)``, ``a' = 1 - s'``, ``a_d = 1 - s_d``::

        x' = (a' / a_d) ((s_d / s) x + (1 - s_d / s) D) + s_noise sqrt(s'^2 - s_d^2 a'^2 / a_d^2) z,

    its ``1e-12`` guards on ``a_d`` kept, ``x' = D`` into 0; it draws where it renoises. The network's output is
    the flow velocity itself (``D = x - s v``), and the latents are on the flow path.
    """

    name = "LTXEulerAncestralRFScheduler"
    noise_dtype = torch.float32

    @classmethod
    def tables(cls, sch, eta, **options):
        sig = torch.as_tensor(sch.sigmas).detach().to("cpu", torch.float64)
        if sig.numel() != sch.timesteps.numel() + 1 or float(sig[-1]) != 0.0:
            raise ValueError(
                f"{cls.name} ends its grid at sigma = {float(sig[-1]):.4g}, not 0: it is followed to 0 only"
            )
        s, s_next = sig[:-1], sig[1:]
        e, s_noise = float(sch.config.eta), float(sch.config.s_noise)
        down = s_next * (1.0 + (s_next / s - 1.0) * e)
        a_next, a_down = 1.0 - s_next, 1.0 - down
        last = s_next.abs() < 1e-8
        noisy = ~last & (e > 0.0) & (s_noise > 0.0)
        g = torch.where(noisy, a_next / (a_down + 1e-12), torch.ones_like(s))
        ratio = down / s
        P = torch.where(last, torch.zeros_like(s), g * ratio)
        Q = torch.where(last, torch.ones_like(s), g * (1.0 - ratio))
        renoise = (s_next**2 - down**2 * a_next**2 / (a_down**2 + 1e-12)).clamp_min(0.0).sqrt() * s_noise
        R = torch.where(noisy, renoise, torch.zeros_like(s))
        return Tables(sig, P, Q, R, draws=noisy)


@register_scheduler
class _FlowMatchLCM(Followed):
    """``FlowMatchLCMScheduler``: LCM on the flow path, ``x' = (1 - s') D + s' z`` on its own sigmas (shift, Karras,
    exponential or beta), drawing at every step in float32."""

    name = "FlowMatchLCMScheduler"
    # its step upcasts the state to float32 and draws in the dtype of x - s F: float32 with the output's
    noise_promoted = True

    @classmethod
    def refusal(cls, cfg):
        if cfg.get("scale_factors"):
            return f"{cls.name} with scale_factors: its step resizes the predicted latents, not one chain of a state"
        if cfg.get("invert_sigmas", False):
            return f"{cls.name} with invert_sigmas=True runs from the data to the noise, not a sampler"
        return None

    @classmethod
    def tables(cls, sch, eta, **options):
        sig = torch.as_tensor(sch.sigmas).detach().to("cpu", torch.float64)
        if sig.numel() != sch.timesteps.numel() + 1 or float(sig[-1]) != 0.0:
            raise ValueError(
                f"{cls.name} ends its grid at sigma = {float(sig[-1]):.4g}, not 0: it is followed to 0 only"
            )
        return Tables(sig, *LCM().step(sig[:-1], sig[1:]))


@register_scheduler
class _FlowMatchEuler(Followed):
    """Stochastic flow matching: ``x' = (1 - s') D + s' z``, LCM's step on the flow path."""

    name = "FlowMatchEulerDiscreteScheduler"
    noise_dtype = torch.float32
    # SD3's and Flux's pipelines call its step without their generator, and their grid has the shift and mu in it
    own_generator = False
    family_grid = True

    @classmethod
    def refusal(cls, cfg):
        if not cfg.get("stochastic_sampling", False):
            return (
                f"{cls.name} with stochastic_sampling=False is deterministic (an ODE solver): "
                "build it with stochastic_sampling=True to speculate it"
            )
        return None

    @classmethod
    def tables(cls, sch, eta, **options):
        return cls.on_grid(torch.as_tensor(sch.sigmas).detach().to("cpu", torch.float64))

    @classmethod
    def on_grid(cls, grid: torch.Tensor) -> Tables:
        """The tables on the flow-path levels ``grid (T + 1,)``."""
        return Tables(grid, *LCM().step(grid[:-1], grid[1:]))


SCHEDULERS = tuple(FOLLOWED)
"""The stochastic schedulers ``chain="scheduler"`` follows (by class name; :data:`FOLLOWED` holds their classes)."""

ETA_SCHEDULERS = tuple(n for n, c in FOLLOWED.items() if c.eta_max is not None)
"""The schedulers whose ``step`` reads ``eta``; the others' noise is their config's alone, so an ``eta``
given with them would be dropped (it is refused)."""


def followed(scheduler: Any) -> "type[Followed]":
    """The registered class that follows ``scheduler`` (checked with :func:`check_scheduler`)."""
    return FOLLOWED[_name(scheduler)]


def scheduler_eta(name: str, eta: float) -> Optional[float]:
    """The ``eta`` a run of scheduler ``name`` records: its step's, or ``None`` where its step takes none."""
    cls = FOLLOWED.get(name)
    return float(eta) if cls is not None and cls.eta_max is not None else None


def check_scheduler(scheduler: Any, eta: float = 0.0, steps: Optional[int] = None) -> None:
    """Raise for a scheduler ``chain="scheduler"`` cannot follow (or an ``eta`` out of its range, or given to a
    scheduler whose step takes none), naming the reason and the swap. With ``steps``, also an ``eta`` that
    the step at ``steps`` steps does not define (DDIM's negative variances, :func:`check_ddim_eta`)."""
    eta = float(eta)
    name = _name(scheduler)
    cls = FOLLOWED.get(name)
    if cls is None:
        reason = REFUSED_SCHEDULERS.get(name, "not one chain='scheduler' follows")
        raise ValueError(
            f"chain='scheduler' follows the stochastic schedulers {', '.join(FOLLOWED)}; the pipeline's "
            f"{name} is {reason}. Swap it in one line: {SWAP}"
        )
    reason = cls.refusal(scheduler.config)
    if reason is not None:
        raise ValueError(reason)
    top = math.inf if cls.eta_max is None else cls.eta_max
    if not math.isfinite(eta) or eta < 0 or eta > top:
        raise ValueError(f"eta must be in [0, {top:g}), got {eta}")
    if eta != 0.0 and cls.eta_max is None:
        raise ValueError(
            f"eta={eta}: {name}'s step takes no eta (its noise is set by its config alone), so it would be "
            f"dropped; eta applies to {' and '.join(n for n, c in FOLLOWED.items() if c.eta_max is not None)}: "
            "leave it out"
        )
    if steps is not None:
        cls.check_steps(scheduler, eta, steps)


def scheduler_class(name: str) -> type:
    """diffusers' scheduler class ``name`` (``--scheduler NAME``; nothing is made).

    Raises:
        ValueError: if diffusers has no scheduler of that name, listing the ones it has.
    """
    import diffusers

    cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and name.endswith("Scheduler") and hasattr(cls, "from_config")):
        known = sorted(n for n in dir(diffusers) if n.endswith("Scheduler") and not n.startswith("_"))
        raise ValueError(f"scheduler {name!r} is not a diffusers scheduler; one of {', '.join(known)}")
    return cls


def swapped_scheduler(pipe: Any, name: str) -> Any:
    """The scheduler ``name`` made from ``pipe``'s scheduler config, as users swap one in (``pipe`` is not changed).

    Raises:
        ValueError: as :func:`scheduler_class`.
    """
    return scheduler_class(name).from_config(pipe.scheduler.config)


def directory_scheduler(path: str, name: Optional[str] = None) -> Optional[Any]:
    """The scheduler a run of the pipeline saved in ``path`` steps with, made from its
    ``scheduler/scheduler_config.json`` alone (no model is loaded): the pipeline's own class, or diffusers'
    class ``name`` swapped in from that config (as :func:`swapped_scheduler` does). ``None`` when the
    directory holds no scheduler config (the loaded pipeline's is checked then).

    Raises:
        ValueError: as :func:`scheduler_class`.
    """
    import json
    from pathlib import Path

    config = Path(path) / "scheduler" / "scheduler_config.json"
    cls = scheduler_class(name) if name is not None else None  # (a wrong name is refused first)
    if not config.is_file():
        return None
    saved = json.loads(config.read_text())
    if cls is None:
        import diffusers

        cls = getattr(diffusers, str(saved.get("_class_name")), None)
        if not (isinstance(cls, type) and hasattr(cls, "from_config")):
            return None
    return cls.from_config(saved)


def scheduler_chain(
    scheduler: Any, steps: int, *, eta: float = 0.0, step_options: Optional[dict] = None, **set_timesteps: Any
) -> SchedulerChain:
    """The chain of ``scheduler`` at ``steps`` inference steps, on its own grid.

    Args:
        scheduler: a diffusers scheduler (the pipeline's; it is not modified: a copy takes
            ``set_timesteps``).
        steps: ``num_inference_steps``.
        eta: the ``eta`` the pipeline passes to ``step`` (DDIM, TCD; the others ignore it).
        step_options: the further arguments given to each ``step`` where the scheduler's step reads some
            (:attr:`Followed.options`: ``EDMEulerScheduler``'s ``s_churn``, ``s_tmin``, ``s_tmax``, ``s_noise``);
            the ones left out take ``step``'s defaults.
        set_timesteps: further arguments of ``set_timesteps`` (Flux's and SD3's ``sigmas``, ``mu``).

    Returns:
        A :class:`SchedulerChain`; ``chain.grid`` is the grid to sample on and ``chain.timesteps``
        the network's time input at each of its levels.

    Raises:
        ValueError: a scheduler or setting it does not follow, naming the reason.
    """
    check_scheduler(scheduler, eta)
    options = _step_options(followed(scheduler), step_options)
    if "sigmas" in set_timesteps or "timesteps" in set_timesteps:
        # (an explicit grid has its own length only)
        return _tabulated(scheduler, steps, eta, set_timesteps, options)
    return _remaking(lambda n: _tabulated(scheduler, n, eta, set_timesteps, options))(steps)


def _step_options(cls: "type[Followed]", given: Optional[dict]) -> dict:
    """``given`` checked against the step arguments ``cls`` reads, with their defaults filled in.

    Raises:
        ValueError: an argument its step does not read, or one that is not a number (``s_churn``, ``s_noise``
            >= 0; ``s_tmin <= s_tmax``).
    """
    given = dict(given or {})
    unknown = sorted(set(given) - set(cls.options))
    if unknown:
        takes = ", ".join(cls.options) or "none"
        raise ValueError(f"step_options {', '.join(unknown)}: {cls.name}'s step does not read them (it reads {takes})")
    out = {**cls.options, **{k: float(v) for k, v in given.items()}}
    for k, v in out.items():
        if math.isnan(v) or (k in ("s_churn", "s_noise") and not (math.isfinite(v) and v >= 0)):
            raise ValueError(f"step_options {k} must be a finite number >= 0, got {v}")
    if out.get("s_tmin", 0.0) > out.get("s_tmax", math.inf):
        raise ValueError(f"step_options s_tmin must be <= s_tmax, got {out['s_tmin']} > {out['s_tmax']}")
    return out


def _remaking(make: Callable[[int], SchedulerChain]) -> Callable[[int], SchedulerChain]:
    """``make`` (a chain of ``n`` steps), each chain it makes able to remake itself the same way
    (:meth:`SchedulerChain.for_steps`); the last few made are kept."""

    @functools.lru_cache(maxsize=8)
    def remake(steps: int) -> SchedulerChain:
        return replace(make(steps), remake=remake)

    return remake


def _tabulated(scheduler: Any, steps: int, eta: float, set_timesteps: dict, options: dict) -> SchedulerChain:
    """:func:`scheduler_chain`'s tables, the scheduler and ``options`` checked already."""
    sch = _fresh(scheduler, steps, **set_timesteps)
    cls = followed(scheduler)
    timesteps = torch.as_tensor(cls.model_timesteps(sch)).detach().to("cpu", torch.float64)
    return _made(cls, eta, timesteps, cls.tables(sch, float(eta), **options), options)


def _vp_noise_scale(sch: Any, s0: float) -> float:
    """The initial state's scale on the linear path for variance-preserving latents ``init_noise_sigma xi``
    at level ``s0``: ``y = x sqrt(1 + s0^2) / (1 + s0)``."""
    return float(sch.init_noise_sigma) * math.sqrt(1.0 + s0 * s0) / (1.0 + s0)


def _made(
    cls: "type[Followed]", eta: float, timesteps: torch.Tensor, tables: Tables, options: Optional[dict] = None
) -> SchedulerChain:
    staged = {} if tables.stages is None else {"tableau": tables.stages}
    return (SchedulerChain if tables.stages is None else StagedSchedulerChain)(
        **staged,
        scheduler=cls.name,
        eta=scheduler_eta(cls.name, eta),
        options=tuple((options or {}).items()),
        grid=tables.grid,
        timesteps=timesteps,
        P=tables.P,
        Q=tables.Q,
        R=tables.R,
        B=tables.B,
        K=tables.K,
        halves=tables.halves,
        times=tables.times,
        prediction=tables.prediction,
        draws=cls.draws(timesteps, float(eta)) if tables.draws is None else tables.draws,
        noise_dtype=cls.noise_dtype,
        noise_promoted=cls.noise_promoted,
        noise_scale=float(tables.noise_scale),
    )


class _Predicted:
    """A family's velocity whose clean prediction goes through the scheduler's clip or threshold
    (:attr:`SchedulerChain.prediction`); every other attribute is the velocity's."""

    def __init__(self, velocity: Any, chain: SchedulerChain) -> None:
        self._velocity, self._chain = velocity, chain

    def __getattr__(self, name: str) -> Any:
        return getattr(self._velocity, name)

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **cond: Any) -> torch.Tensor:
        v = self._velocity(x, sigma, **cond)
        t = sigma.to(x.dtype).reshape(-1, *[1] * (x.ndim - 1))
        grid = self._chain.grid[:-1].to(sigma.device, torch.float64)
        step = torch.searchsorted(-grid, -sigma.to(torch.float64)).clamp(max=grid.numel() - 1)
        d = self._chain.prediction(x - t * v, step)
        return (x - d) / t


@dataclass(frozen=True)
class PipelinePlan:
    """How a family's run follows its pipeline's scheduler (:func:`for_pipeline`).

    Attributes:
        chain: the scheduler's chain; ``chain.grid`` is the run's grid.
        velocity: the family's velocity, behind the scheduler's clip or threshold where it has one.
    """

    chain: SchedulerChain
    velocity: Any
    scheduler: Any = None
    """The pipeline's scheduler (read, never changed), for a scheduler whose step draws its own noise
    (:meth:`Followed.own_noise`), or ``None``."""

    @property
    def noise_scale(self) -> float:
        """The run's initial state is ``noise_scale x N(0, I)``: the pipeline's latents on the linear path."""
        return self.chain.noise_scale

    def noise_from(
        self,
        generator: Any,
        shape: tuple,
        device: torch.device,
        dtype: torch.dtype,
        layout: Optional[tuple] = None,
    ) -> Callable:
        """The standard sampler's noise as the pipeline draws it: after the latents, one
        ``randn_tensor(shape, generator)`` at each step where the scheduler's ``step`` draws one
        (``shape`` the batch of latents; ``dtype`` the network output's unless the scheduler fixes it).
        SD3's and Flux's pipelines pass no generator to ``step``: their scheduler's noise comes from
        torch's global generator, and so does this. A scheduler whose step draws otherwise (DPM-Solver SDE's
        Brownian tree) gives its own (:meth:`Followed.own_noise`). ``layout``: ``(shape drawn, to_states)`` where
        the pipeline's latents are laid out otherwise (Flux's packed latents), ``to_states`` mapping a draw
        to ``shape``."""
        from diffusers.utils.torch_utils import randn_tensor

        draws, noise_dtype = self.chain.draws.tolist(), self.chain.noise_dtype or dtype
        followed = FOLLOWED[self.chain.scheduler]
        own = None
        if self.scheduler is not None and layout is None:
            own = followed.own_noise(self.scheduler, self.chain.inference_steps, shape, device, noise_dtype)
        if own is not None:
            return own
        if self.chain.noise_promoted:
            noise_dtype = torch.promote_types(dtype, torch.float32)
        if not followed.own_generator:
            generator = None

        def noise(step: int) -> torch.Tensor:
            if step < 0 or not draws[step]:
                return torch.zeros(shape, device=device)
            if layout is not None:
                z = randn_tensor(layout[0], generator=generator, device=device, dtype=noise_dtype)
                return layout[1](z).float().reshape(shape)
            return randn_tensor(shape, generator=generator, device=device, dtype=noise_dtype).float()

        return noise


def for_pipeline(
    pipe: Any,
    steps: int,
    eta: float,
    velocity: Any,
    grid: torch.Tensor,
    grid_for: Optional[Callable[[int], torch.Tensor]] = None,
) -> PipelinePlan:
    """The plan of ``chain="scheduler"`` for a family's run of ``pipe`` at ``steps`` steps.

    Args:
        pipe: the pipeline; its ``scheduler`` is read (a copy takes ``set_timesteps``), not changed.
        steps: ``num_inference_steps``.
        eta: the pipeline's ``eta`` (DDIM, TCD).
        velocity: the family's velocity.
        grid: the family's grid: a flow-matching family's is its scheduler's (shift, ``mu``) already.
        grid_for: the family's grid of ``n`` steps (``(n + 1,)``), for the chain at other step counts
            (:meth:`SchedulerChain.for_steps`, a tuner's timing runs) of a flow-matching family; the
            other schedulers' chains remake themselves.

    Raises:
        ValueError: as :func:`scheduler_chain`.
    """
    scheduler = pipe.scheduler
    check_scheduler(scheduler, eta)
    cls = followed(scheduler)
    if cls.family_grid:

        def flow(n: int) -> SchedulerChain:
            g = torch.as_tensor(grid if n == steps or grid_for is None else grid_for(n), dtype=torch.float64)
            return _made(cls, eta, 1000.0 * g[:-1], cls.on_grid(g))

        chain = flow(steps) if grid_for is None else _remaking(flow)(steps)
        return PipelinePlan(chain=chain, velocity=velocity)
    chain = scheduler_chain(scheduler, steps, eta=eta)
    wrapped = velocity if chain.prediction is None else _Predicted(velocity, chain)
    return PipelinePlan(chain=chain, velocity=wrapped, scheduler=scheduler)
