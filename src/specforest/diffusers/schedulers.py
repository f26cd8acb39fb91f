"""A diffusers scheduler's own chain: ``chain="scheduler"``.

A diffusers user picks a sampler by swapping the pipeline's scheduler. Each stochastic scheduler
below moves its latents by a Gaussian whose covariance depends on the schedule alone, so it is a
:class:`~specforest.chains.Chain`; :func:`scheduler_chain` reads it off the scheduler, following
its ``step`` as the code computes it: its timesteps (spacing, ``steps_offset``), the level it steps
to (DDIM's ``t - num_train_timesteps // T``, which need not be the next timestep the model sees),
its variance formula, and ``clip_sample`` / thresholding of the predicted clean latents.

Coordinates. The pipeline's latents ``x`` at the timestep ``k`` the model sees next are written on
the library's linear path as ``y = x / n(s_k)``, where ``s_k = sqrt((1 - abar_k) / abar_k)`` and
``n(s) = (1 + s) / sqrt(1 + s^2)`` for the schedulers that keep variance-preserving latents (DDPM,
DDIM, LCM, TCD, DPM-Solver), ``n(s) = 1 + s`` for the ones that keep ``x = x_0 + s xi``
(Euler ancestral), and ``n = 1`` on the flow-matching path. The velocity adapters of
:mod:`specforest.diffusers.unet` feed the network exactly these latents at exactly the scheduler's
timestep, so a step ``x' = P x + Q D + R z`` of the scheduler (``D`` its predicted clean latents) is
``y' = (P n / n') y + (Q / n') D + (R / n') z``: tables, whatever the scheduler.

Clipping is not affine in ``D``. The chain's mean stays ``a y + c v`` with the prediction replaced
by the scheduler's own (:attr:`SchedulerChain.prediction`, applied inside the velocity): the law is
the scheduler's exactly, and every draft, coupling and tree works unchanged.

Refused, each naming the reason: deterministic schedulers with a tree (the caller's check, through
:attr:`~specforest.sde.GaussianChain.stochastic`), learned variances (the covariance comes from the
network), ``fixed_large_log`` (diffusers returns NaN there), ``DPMSolverSDEScheduler`` (two
correlated noises per step), DPM-Solver's ``sde-dpmsolver`` and third order, and grids this module
does not follow yet (Karras or other sigma families on a UNet scheduler, ``final_sigmas_type`` other
than ``zero``). So are the options a step would not follow: an ``eta`` with a scheduler whose ``step``
takes none (:data:`ETA_SCHEDULERS`), a DDIM ``eta`` that makes a step's variance negative (diffusers'
step is NaN there), Euler ancestral's ``prediction_type="sample"`` (its step raises). A config flag is
followed as the step follows it: TCD's step neither clips nor thresholds, DPM-Solver's thresholds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Optional

import torch

from ..chains import DPMPP2MSDE, LCM, REFUSED, Chain, EulerAncestral, check_ddim_eta, from_ve
from ..sde import _check_sigmas

__all__ = [
    "ETA_SCHEDULERS",
    "SCHEDULERS",
    "PipelinePlan",
    "SchedulerChain",
    "check_scheduler",
    "directory_scheduler",
    "for_pipeline",
    "scheduler_chain",
    "scheduler_class",
    "scheduler_eta",
    "swapped_scheduler",
]

SCHEDULERS = (
    "DDPMScheduler",
    "DDIMScheduler",
    "EulerAncestralDiscreteScheduler",
    "DPMSolverMultistepScheduler",
    "LCMScheduler",
    "TCDScheduler",
    "FlowMatchEulerDiscreteScheduler",
)
"""The stochastic schedulers ``chain="scheduler"`` follows (by class name)."""

EULER_A_PREDICTIONS = ("epsilon", "v_prediction")
"""The ``prediction_type`` values ``EulerAncestralDiscreteScheduler.step`` implements."""

ETA_SCHEDULERS = ("DDIMScheduler", "TCDScheduler")
"""The schedulers whose ``step`` reads ``eta``; the others' noise is their config's alone, so an ``eta``
given with them would be dropped (it is refused)."""

DETERMINISTIC = (
    "PNDMScheduler",
    "EulerDiscreteScheduler",
    "HeunDiscreteScheduler",
    "DEISMultistepScheduler",
    "UniPCMultistepScheduler",
    "KDPM2DiscreteScheduler",
    "LMSDiscreteScheduler",
)
"""Schedulers with no noise after the first draw: they run with ``tree=None`` only."""

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
            for a scheduler whose step takes none (:data:`ETA_SCHEDULERS`).
        grid: ``(T + 1,)`` float64 linear-path levels of the timesteps the model sees, then 0.
        timesteps: ``(T,)`` the scheduler's timesteps (the network's time input at each level).
        prediction: ``prediction(D, step) -> D`` the scheduler's clip or threshold of the predicted
            clean latents ``D (M, ...)`` at steps ``step (M,)``, or ``None`` when it keeps them as they are.
        draws: ``(T,)`` bool, the steps at which the scheduler draws noise from the generator (one
            ``randn_tensor`` each), so that a run with ``tree=None`` replays the pipeline's draws.
        noise_dtype: the dtype of those draws when the scheduler fixes it (DPM-Solver, flow matching: float32), else
            ``None`` (the network output's dtype).
        noise_scale: the pipeline's initial latents (``init_noise_sigma xi``) on the linear path are
            ``noise_scale xi``.
        remake: ``remake(n)`` the same scheduler's chain at ``n`` inference steps (:meth:`for_steps`), or
            ``None``: the chain runs on its own grid only.
    """

    scheduler: str = ""
    eta: Optional[float] = 0.0
    grid: torch.Tensor = field(default=None, repr=False, compare=False)
    timesteps: torch.Tensor = field(default=None, repr=False, compare=False)
    P: torch.Tensor = field(default=None, repr=False, compare=False)
    Q: torch.Tensor = field(default=None, repr=False, compare=False)
    R: torch.Tensor = field(default=None, repr=False, compare=False)
    B: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    prediction: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = field(
        default=None, repr=False, compare=False
    )
    draws: torch.Tensor = field(default=None, repr=False, compare=False)
    noise_dtype: Optional[torch.dtype] = field(default=None, repr=False, compare=False)
    noise_scale: float = field(default=1.0, repr=False, compare=False)
    remake: Optional[Callable[[int], "SchedulerChain"]] = field(default=None, repr=False, compare=False)
    name: ClassVar[str] = "scheduler"

    @property
    def params(self) -> dict:
        return {"scheduler": self.scheduler, "eta": self.eta}

    def for_steps(self, steps: int) -> "SchedulerChain":
        """The same scheduler's chain at ``steps`` inference steps, on its own grid of that many steps
        (a tuner's shorter timing runs: ``chain.for_steps(n).grid`` is their grid, and this chain built
        on it takes that chain's tables).

        Raises:
            ValueError: if the chain was made without ``remake`` and ``steps`` is not its own.
        """
        if steps == self.grid.numel() - 1:
            return self
        if self.remake is None:
            raise ValueError(
                f"this {self.scheduler} chain was made for {self.grid.numel() - 1} steps only; make the chain of "
                f"{steps} steps with specforest.diffusers.scheduler_chain"
            )
        return self.remake(steps)

    def coefficients(self, sigmas: torch.Tensor) -> tuple:
        s = _check_sigmas(sigmas)
        if s.shape != self.grid.shape and self.remake is not None:
            return self.for_steps(s.numel() - 1).coefficients(s)
        if s.shape != self.grid.shape or not torch.allclose(s, self.grid, rtol=1e-12, atol=0.0):
            raise ValueError(
                f"the {self.scheduler} chain is tabulated on its own {self.grid.numel() - 1}-step grid; "
                "run it on chain.grid (specforest.diffusers.scheduler_chain gives both)"
            )
        return self.grid, self.P, self.Q, self.R, 1.0, 0.0

    @property
    def history(self) -> int:
        """1 where the scheduler's mean reads the previous step's prediction (multistep DPM-Solver), else 0."""
        return 0 if self.B is None else 1

    def past(self, t: torch.Tensor, t_next: torch.Tensor) -> Optional[torch.Tensor]:
        B = self.for_steps(t.numel()).B if t.numel() != self.grid.numel() - 1 and self.remake is not None else self.B
        return None if B is None else B[:, None]


def _name(scheduler: Any) -> str:
    return type(scheduler).__name__


def scheduler_eta(name: str, eta: float) -> Optional[float]:
    """The ``eta`` a run of scheduler ``name`` records: its step's, or ``None`` where its step takes none."""
    return float(eta) if name in ETA_SCHEDULERS else None


def check_scheduler(scheduler: Any, eta: float = 0.0, steps: Optional[int] = None) -> None:
    """Raise for a scheduler ``chain="scheduler"`` cannot follow (or an ``eta`` out of its range, or given to a
    scheduler whose step takes none), naming the reason and the swap. With ``steps``, also an ``eta`` that
    gives a step of ``steps`` a negative variance (DDIM's, :func:`check_ddim_eta`)."""
    eta = float(eta)
    name, cfg = _name(scheduler), scheduler.config
    if name == "DPMSolverSDEScheduler":
        raise ValueError(f"DPMSolverSDEScheduler is not a Gaussian chain: {REFUSED['dpmpp_sde']}")
    if name not in SCHEDULERS:
        kind = "deterministic (an ODE solver)" if name in DETERMINISTIC else "not one chain='scheduler' follows"
        raise ValueError(
            f"chain='scheduler' follows the stochastic schedulers {', '.join(SCHEDULERS)}; the pipeline's "
            f"{name} is {kind}. Swap it in one line: {SWAP}"
        )
    variance = cfg.get("variance_type")
    if name == "DDPMScheduler" and variance in ("learned", "learned_range"):
        raise ValueError(
            f"DDPMScheduler with variance_type={variance!r}: the variance comes from the network's output, so "
            "the step's covariance depends on the model and no coupling can be exact to it; use fixed_small or "
            "fixed_large"
        )
    if name == "DDPMScheduler" and variance == "fixed_large_log":
        raise ValueError("DDPMScheduler with variance_type='fixed_large_log' returns NaN in diffusers; use fixed_large")
    if name == "DPMSolverMultistepScheduler":
        if cfg.get("algorithm_type") != "sde-dpmsolver++" or cfg.get("solver_order", 2) not in (1, 2):
            raise ValueError(
                "DPMSolverMultistepScheduler is followed with algorithm_type='sde-dpmsolver++' and solver_order 1 "
                f"or 2 (got {cfg.get('algorithm_type')!r}, order {cfg.get('solver_order')}); the ODE algorithms are "
                "deterministic and sde-dpmsolver is deprecated in diffusers"
            )
        if cfg.get("final_sigmas_type", "zero") != "zero" or cfg.get("euler_at_final", False):
            raise ValueError("DPMSolverMultistepScheduler is followed with final_sigmas_type='zero' only")
    if name == "EulerAncestralDiscreteScheduler" and cfg.get("prediction_type", "epsilon") not in EULER_A_PREDICTIONS:
        raise ValueError(
            f"EulerAncestralDiscreteScheduler with prediction_type={cfg.get('prediction_type')!r}: its step does not "
            f"implement it (diffusers raises); it takes {' or '.join(EULER_A_PREDICTIONS)}"
        )
    if name == "FlowMatchEulerDiscreteScheduler" and not cfg.get("stochastic_sampling", False):
        raise ValueError(
            "FlowMatchEulerDiscreteScheduler with stochastic_sampling=False is deterministic (an ODE solver): "
            "build it with stochastic_sampling=True to speculate it"
        )
    if not math.isfinite(eta) or eta < 0 or (name == "TCDScheduler" and eta > 1):
        raise ValueError(f"eta must be in [0, {1 if name == 'TCDScheduler' else 'inf'}), got {eta}")
    if eta != 0.0 and name not in ETA_SCHEDULERS:
        raise ValueError(
            f"eta={eta}: {name}'s step takes no eta (its noise is set by its config alone), so it would be "
            f"dropped; eta applies to {' and '.join(ETA_SCHEDULERS)}: leave it out"
        )
    if steps is not None and name == "DDIMScheduler" and eta > 0:
        sch = _fresh(scheduler, steps)
        ts = sch.timesteps.to(torch.long)
        check_ddim_eta(eta, *_ddim_levels(sch, ts), ts)


def _ddim_levels(sch: Any, ts: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor]":
    """``(abar, abar')`` ``(T,)`` float64 of DDIM's steps: ``abar'`` at ``t - num_train_timesteps // T``
    (``final_alpha_cumprod`` below 0), which need not be the next timestep the model sees."""
    acp = sch.alphas_cumprod.to(torch.float64)
    final = torch.tensor(float(getattr(sch, "final_alpha_cumprod", torch.tensor(1.0))), dtype=torch.float64)
    pt = ts - sch.config["num_train_timesteps"] // ts.numel()
    return acp[ts], torch.where(pt >= 0, acp[pt.clamp(min=0)], final)


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


def _vp_tables(name: str, sch: Any, eta: float) -> tuple:
    """``(ab (T,), P, Q, R (T,) on VP latents, weight)`` of a VP scheduler's steps (``weight``: see :func:`_clip`)."""
    ts = sch.timesteps.to(torch.long)
    T = ts.numel()
    acp = sch.alphas_cumprod.to(torch.float64)
    ab = acp[ts]
    cfg = sch.config
    weight = None
    if name == "DDPMScheduler":
        prev = torch.cat([acp[ts[1:]], torch.ones(1, dtype=torch.float64)])  # previous_timestep, -1 -> one
        alpha = ab / prev
        beta = 1.0 - alpha
        Q = prev.sqrt() * beta / (1.0 - ab)
        P = alpha.sqrt() * (1.0 - prev) / (1.0 - ab)
        small = ((1.0 - prev) / (1.0 - ab) * beta).clamp_min(1e-20)
        var = beta if cfg.get("variance_type", "fixed_small") == "fixed_large" else small
        R = torch.where(ts > 0, var.sqrt(), torch.zeros_like(var))
        # (the clamp leaves 1e-10 at a last step into abar' = 1: a point mass there, as near as float allows)
        R = torch.where(prev >= 1.0, torch.zeros_like(R), R)
        return ab, P, Q, R, weight
    if name == "DDIMScheduler":
        _, prev = _ddim_levels(sch, ts)
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
    if name == "LCMScheduler":
        prev = torch.cat([acp[ts[1:]], ab[-1:]])
        scal = [sch.get_scalings_for_boundary_condition_discrete(t) for t in ts.tolist()]
        c_skip = torch.tensor([float(c[0]) for c in scal], dtype=torch.float64)
        c_out = torch.tensor([float(c[1]) for c in scal], dtype=torch.float64)
        last = torch.arange(T) == T - 1
        g = torch.where(last, torch.ones_like(prev), prev.sqrt())
        R = torch.where(last, torch.zeros_like(prev), (1.0 - prev).sqrt())
        return ab, g * c_skip, g * c_out, R, weight
    if name == "TCDScheduler":
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
        return ab, g * A, g * Bq, R, weight
    raise AssertionError(name)


def _ve_levels(sch: Any) -> torch.Tensor:
    """``(T,)`` the VE levels ``sigma`` a sigma-based scheduler steps through (its ``sigmas``, the last 0 dropped)."""
    sig = torch.as_tensor(sch.sigmas).detach().to("cpu", torch.float64)
    if sig.numel() != sch.timesteps.numel() + 1 or float(sig[-1]) != 0.0:
        raise ValueError(
            f"{_name(sch)} ends its grid at sigma = {float(sig[-1]):.4g}, not 0: chain='scheduler' follows grids "
            "that end at 0 only"
        )
    return sig[:-1]


def scheduler_chain(scheduler: Any, steps: int, *, eta: float = 0.0, **set_timesteps: Any) -> SchedulerChain:
    """The chain of ``scheduler`` at ``steps`` inference steps, on its own grid.

    Args:
        scheduler: a diffusers scheduler (the pipeline's; it is not modified: a copy takes
            ``set_timesteps``).
        steps: ``num_inference_steps``.
        eta: the ``eta`` the pipeline passes to ``step`` (DDIM, TCD; the others ignore it).
        set_timesteps: further arguments of ``set_timesteps`` (Flux's and SD3's ``sigmas``, ``mu``).

    Returns:
        A :class:`SchedulerChain`; ``chain.grid`` is the grid to sample on and ``chain.timesteps``
        the network's time input at each of its levels.

    Raises:
        ValueError: a scheduler or setting it does not follow, naming the reason.
    """
    check_scheduler(scheduler, eta)
    if "sigmas" in set_timesteps or "timesteps" in set_timesteps:
        return _tabulated(scheduler, steps, eta, set_timesteps)  # (an explicit grid has its own length only)
    return _remaking(lambda n: _tabulated(scheduler, n, eta, set_timesteps))(steps)


def _remaking(make: Callable[[int], SchedulerChain]) -> Callable[[int], SchedulerChain]:
    """``make`` (a chain of ``n`` steps), each chain it makes able to remake itself the same way
    (:meth:`SchedulerChain.for_steps`); the last few made are kept."""

    @functools.lru_cache(maxsize=8)
    def remake(steps: int) -> SchedulerChain:
        return replace(make(steps), remake=remake)

    return remake


def _tabulated(scheduler: Any, steps: int, eta: float, set_timesteps: dict) -> SchedulerChain:
    """:func:`scheduler_chain`'s tables, the scheduler checked already."""
    name = _name(scheduler)
    sch = _fresh(scheduler, steps, **set_timesteps)
    timesteps = torch.as_tensor(sch.timesteps).detach().to("cpu", torch.float64)
    if name == "FlowMatchEulerDiscreteScheduler":
        return _flow_chain(eta, torch.as_tensor(sch.sigmas).detach().to("cpu", torch.float64), timesteps)
    if name in ("EulerAncestralDiscreteScheduler", "DPMSolverMultistepScheduler"):
        s = _ve_levels(sch)
        grid = torch.cat([s / (1.0 + s), s.new_zeros(1)])
        t, t_next = grid[:-1], grid[1:]
        if name == "EulerAncestralDiscreteScheduler":
            # its latents are VE (x_0 + s xi): the initial noise init_noise_sigma xi is y = x / (1 + s_0)
            scale = float(sch.init_noise_sigma) / (1.0 + float(s[0]))
            return _made(name, eta, grid, timesteps, *EulerAncestral(eta=1.0).step(t, t_next), noise_scale=scale)
        # sde-dpmsolver++ is k-diffusion's DPM++ 2M SDE at eta = 1 (first order: without its multistep term)
        chain = DPMPP2MSDE(eta=1.0, solver_type=sch.config.get("solver_type", "midpoint"))
        scale = _vp_noise_scale(sch, float(s[0]))
        # its step thresholds the predicted clean latents (the ones it keeps for the next step too); it has no clip
        threshold = _clip({k: v for k, v in sch.config.items() if k != "clip_sample"}, None)
        if sch.config.get("solver_order", 2) == 1:
            Pv, Q0, _, Rv, _ = chain._terms(t, t_next)
            return _made(
                name, eta, grid, timesteps, *from_ve(t, t_next, Pv, Q0, Rv), prediction=threshold, noise_scale=scale
            )
        B = chain.past(t, t_next)[:, 0]
        return _made(name, eta, grid, timesteps, *chain.step(t, t_next), B=B, prediction=threshold, noise_scale=scale)
    ab, P, Q, R, weight = _vp_tables(name, sch, float(eta))
    s = ((1.0 - ab) / ab).sqrt()
    grid = torch.cat([s / (1.0 + s), s.new_zeros(1)])
    n = _vp_scale(ab)
    n_next = torch.cat([n[1:], torch.ones(1, dtype=torch.float64)])  # the last state is the output latents
    P, Q, R = _to_linear(P, Q, R, n, n_next)
    scale = _vp_noise_scale(sch, float(s[0]))
    # TCD's step neither clips nor thresholds, whatever its config says (diffusers keeps the flags unused)
    clip = None if name == "TCDScheduler" else _clip(sch.config, weight)
    return _made(name, eta, grid, timesteps, P, Q, R, prediction=clip, noise_scale=scale)


def _vp_noise_scale(sch: Any, s0: float) -> float:
    """The initial state's scale on the linear path for variance-preserving latents ``init_noise_sigma xi``
    at level ``s0``: ``y = x sqrt(1 + s0^2) / (1 + s0)``."""
    return float(sch.init_noise_sigma) * math.sqrt(1.0 + s0 * s0) / (1.0 + s0)


def _flow_chain(eta: float, grid: torch.Tensor, timesteps: torch.Tensor) -> SchedulerChain:
    """Stochastic flow matching on ``grid``: ``x' = (1 - s') D + s' z``, LCM's step on the flow path."""
    P, Q, R = LCM().step(grid[:-1], grid[1:])
    return _made("FlowMatchEulerDiscreteScheduler", eta, grid, timesteps, P, Q, R)


def _draws(name: str, timesteps: torch.Tensor, eta: float) -> torch.Tensor:
    """``(T,)`` bool: where the scheduler's ``step`` draws its noise (whether or not it weighs it)."""
    T = timesteps.numel()
    last = torch.arange(T) == T - 1
    if name == "DDPMScheduler":
        return timesteps > 0
    if name == "DDIMScheduler":
        return torch.full((T,), eta > 0)
    if name == "LCMScheduler":
        return ~last
    if name == "TCDScheduler":
        return ~last & (eta > 0)
    return torch.ones(T, dtype=torch.bool)


def _made(name, eta, grid, timesteps, P, Q, R, B=None, prediction=None, noise_scale=1.0) -> SchedulerChain:
    return SchedulerChain(
        scheduler=name,
        eta=scheduler_eta(name, eta),
        grid=grid,
        timesteps=timesteps,
        P=P,
        Q=Q,
        R=R,
        B=B,
        prediction=prediction,
        draws=_draws(name, timesteps, float(eta)),
        noise_dtype=torch.float32
        if name in ("DPMSolverMultistepScheduler", "FlowMatchEulerDiscreteScheduler")
        else None,
        noise_scale=float(noise_scale),
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
        torch's global generator, and so does this. ``layout``: ``(shape drawn, to_states)`` where the
        pipeline's latents are laid out otherwise (Flux's packed latents), ``to_states`` mapping a draw
        to ``shape``."""
        from diffusers.utils.torch_utils import randn_tensor

        draws, noise_dtype = self.chain.draws.tolist(), self.chain.noise_dtype or dtype
        if self.chain.scheduler == "FlowMatchEulerDiscreteScheduler":
            # SD3's and Flux's pipelines call step without their generator: its noise is torch's global one
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
    if _name(scheduler) == "FlowMatchEulerDiscreteScheduler":
        check_scheduler(scheduler, eta)

        def flow(n: int) -> SchedulerChain:
            g = torch.as_tensor(grid if n == steps or grid_for is None else grid_for(n), dtype=torch.float64)
            return _flow_chain(eta, g, 1000.0 * g[:-1])

        chain = flow(steps) if grid_for is None else _remaking(flow)(steps)
        return PipelinePlan(chain=chain, velocity=velocity)
    chain = scheduler_chain(scheduler, steps, eta=eta)
    wrapped = velocity if chain.prediction is None else _Predicted(velocity, chain)
    return PipelinePlan(chain=chain, velocity=wrapped)
