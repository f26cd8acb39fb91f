"""A diffusers UNet on a VP schedule as the library's velocity, and its grid (SDXL, SD 1.5 / 2.x).

The UNets of Stable Diffusion 1.5 / 2.x and SDXL are trained on a VP schedule:
at timestep ``k`` the state is ``x_k = a_k x_0 + b_k xi`` with ``a_k =
sqrt(abar_k)``, ``b_k = sqrt(1 - abar_k)``, and the network predicts ``xi``
(``epsilon``), ``v = a_k xi - b_k x_0`` (``v_prediction``) or ``x_0``
(``sample``), as ``prediction_type`` in the scheduler's config says. The
library's model contract is a velocity on the linear path ``x_t = (1 - t) x_0 +
t xi``, ``v(x, t) = E[xi - x_0 | x_t = x]``. The change of variables:

* ``s = b_k / a_k = sqrt((1 - abar_k) / abar_k)`` is the Karras (EDM / VE)
  noise level: ``x_VE = x_0 + s xi = x_k / a_k = x_k sqrt(1 + s^2)``;
* the linear-path state with the same signal-to-noise ratio is ``x_lin =
  x_VE / (1 + s)``, at ``t = s / (1 + s)`` (so ``s = t / (1 - t)``);
* the UNet is called on ``x_k = x_VE / sqrt(1 + s^2)`` (what Euler-type
  schedulers' ``scale_model_input`` passes) at the timestep ``k(s)`` whose
  ``log s`` interpolates the ``alphas_cumprod`` table linearly (the Euler
  scheduler's ``_sigma_to_t``; the scheduler's own integer timesteps are
  recovered, to about 1e-4 of a timestep in float32);
* its output gives ``D = E[x_0 | x]``: ``D = x_VE - s eps`` (epsilon),
  ``D = (x_k - s v) / sqrt(1 + s^2)`` (v-prediction: ``a x_k - b v = x_0``
  with ``a = 1 / sqrt(1 + s^2)``, ``b = s a``), ``D = x0`` (sample);
* and the velocity is ``v = E[xi | x] - D = (x_lin - D) / t``, because
  ``E[xi | x] = (x_lin - (1 - t) D) / t``.

The last three steps are :class:`~specforest.models.edm.VPDenoiser` and
:class:`~specforest.models.edm.EDMDenoiserVelocity` (which also clips ``s`` to the
schedule's range at both ends of the path); :class:`UNetVelocity` puts them on
top of :class:`UNetPrediction`, the UNet call with classifier-free guidance.
Plain guidance ``u + g (c - u)`` is affine in the prediction and each of the
maps above is affine in it too, so guiding the prediction (as the pipelines do)
and guiding the velocity are the same.

:func:`vp_schedule` reads the grid off the pipeline's scheduler (a fresh copy
built from its config; the pipeline's own is never touched).

An EDM scheduler (``EDMEulerScheduler``, ``EDMDPMSolverMultistepScheduler``: Playground
v2.5's SDXL pipeline) preconditions the UNet as EDM does instead: :class:`EDMUNetVelocity`
follows it, on :func:`edm_schedule`'s grid (:func:`is_edm_scheduler` tells them apart).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..models.edm import EDMDenoiserVelocity, VPDenoiser
from ..schedules import vp_sigmas
from ..validation import check_int, check_number
from .flow_matching import guide, module_dtype_device

__all__ = [
    "PREDICTION_TYPES",
    "EDMPreconditioned",
    "EDMUNetVelocity",
    "UNetPrediction",
    "UNetVelocity",
    "VPSchedule",
    "edm_schedule",
    "is_edm_scheduler",
    "unet_row_bytes",
    "vp_schedule",
]

PREDICTION_TYPES = VPDenoiser.PREDICTIONS
"""The UNet parameterizations :class:`UNetVelocity` converts (diffusers' ``prediction_type`` names)."""


@dataclass(frozen=True)
class VPSchedule:
    """A VP scheduler's grid as the library's data.

    Attributes:
        sigmas: ``(T + 1,)`` float64 linear-path levels ``t_n = s_n / (1 + s_n)``,
            decreasing, then 0; ``t_0 < 1`` (SD's ``s_max = 14.6`` gives 0.936).
        edm_sigmas: ``(T,)`` float64 Karras levels ``s_n`` of the scheduler's timesteps.
        timesteps: ``(T,)`` float64 the scheduler's distinct timesteps, decreasing.
        init_noise_sigma: the standard deviation of the initial VE state
            ``x_VE = init_noise_sigma * xi`` the scheduler starts from:
            ``s_0`` for Euler-type schedulers with ``linspace``/``trailing``
            spacing, ``sqrt(s_0^2 + 1)`` for ``leading`` spacing and for the
            schedulers that work on the VP state (PNDM, DDIM, DPM-Solver, ...:
            ``x_k = xi`` there, ``x_VE = x_k sqrt(1 + s_0^2)``).
        alphas_cumprod: ``(N,)`` float64 the scheduler's ``abar_k`` (``None`` for an EDM scheduler: :func:`edm_schedule`).
        scheduler: the scheduler's class name.
    """

    sigmas: torch.Tensor
    edm_sigmas: torch.Tensor
    timesteps: torch.Tensor
    init_noise_sigma: float
    alphas_cumprod: Optional[torch.Tensor]
    scheduler: str

    @property
    def steps(self) -> int:
        """Number of steps ``T``."""
        return self.sigmas.numel() - 1

    @property
    def latent_scale(self) -> float:
        """Standard deviation of the initial linear-path state: ``init_noise_sigma / (1 + s_0)``."""
        return self.init_noise_sigma / (1.0 + float(self.edm_sigmas[0]))


def vp_schedule(scheduler: Any, steps: int) -> VPSchedule:
    """The grid of a VP scheduler (``EulerDiscreteScheduler``, ``PNDMScheduler``, DDIM, DPM-Solver, ...).

    A fresh scheduler is built from ``scheduler.config`` and its own
    ``set_timesteps(steps)`` gives the timesteps (spacing ``leading`` /
    ``trailing`` / ``linspace``, ``steps_offset``, Karras sigmas and the like
    all as the pipeline would use them); consecutive repeats (PNDM's PLMS
    warm-up, Heun's second evaluations) are dropped, and so are the second calls
    of a scheduler that ``chain="scheduler"`` follows with two calls a step
    (KDPM2 ancestral's interpolated levels, DPM-Solver SDE's midpoints: each
    step's first call's timestep is the grid's). The Karras level of a
    timestep ``k`` is ``s_k = sqrt((1 - abar_k) / abar_k)`` from
    ``alphas_cumprod`` (the scheduler's ``.sigmas`` are not needed, and PNDM or
    DDIM have none), with ``log s`` interpolated linearly at fractional
    timesteps so that the adapter's timestep map returns the scheduler's
    timestep. The grid is ``t_n = s_n / (1 + s_n)``, then 0: it starts where the
    scheduler starts (``t_0 < 1``) and ends at the data, as Euler's
    ``final_sigmas_type="zero"``.

    Args:
        scheduler: the pipeline's scheduler (read, never modified).
        steps: number of steps ``T >= 1``.

    Returns:
        :class:`VPSchedule`.

    Raises:
        TypeError: if the scheduler has no VP ``alphas_cumprod`` (a flow-matching scheduler).
        ValueError: on a scheduler whose timesteps are not ``T`` distinct
            decreasing levels (second-order schedulers interleaving midpoints
            that ``chain="scheduler"`` does not follow, such as the deterministic
            KDPM2), continuous timesteps, or an infinite noise level
            (zero terminal SNR without the Euler scheduler's clamp).
    """
    steps = check_int("num_inference_steps", steps, 1)
    config = getattr(scheduler, "config", None)
    name = type(scheduler).__name__
    if not isinstance(config, Mapping) or getattr(scheduler, "alphas_cumprod", None) is None:
        raise TypeError(
            f"the scheduler must be a VP scheduler with alphas_cumprod (EulerDiscreteScheduler, PNDMScheduler, "
            f"DDIMScheduler, DPMSolverMultistepScheduler, ...), got {name}"
        )
    if config.get("timestep_type", "discrete") != "discrete":
        raise ValueError(
            f"{name} uses timestep_type={config['timestep_type']!r}; only discrete timesteps are supported"
        )
    fresh = type(scheduler).from_config(config)
    fresh.set_timesteps(steps, device="cpu")
    raw = torch.as_tensor(fresh.timesteps).detach().to("cpu", torch.float64).reshape(-1)
    ts = torch.unique_consecutive(raw)
    if ts.numel() != steps:
        # a scheduler chain="scheduler" follows with two calls a step (KDPM2 ancestral, DPM-Solver SDE) interleaves
        # each step's call at the state with one at its own second level: the grid is the first calls' levels (the
        # scheduler's chain makes the second calls at its own levels and timesteps)
        from .schedulers import FOLLOWED

        follows = FOLLOWED.get(name)
        if follows is not None:
            ts = torch.unique_consecutive(
                torch.as_tensor(follows.first_calls(fresh)).detach().to("cpu", torch.float64).reshape(-1)
            )
    if ts.numel() != steps or (ts[1:] >= ts[:-1]).any():
        raise ValueError(
            f"{name}.set_timesteps({steps}) gives the timesteps {[round(v, 3) for v in raw.tolist()]}, not {steps} "
            "distinct decreasing levels; use a first-order scheduler's config (EulerDiscreteScheduler, DDIM, PNDM, "
            "DPM-Solver)"
        )
    ac = torch.as_tensor(fresh.alphas_cumprod).detach().to("cpu", torch.float64).reshape(-1)
    if not ((ac > 0) & (ac < 1)).all():
        raise ValueError(
            f"{name}'s alphas_cumprod leave (0, 1) (zero terminal SNR gives an infinite noise level); "
            "use EulerDiscreteScheduler, which clamps it"
        )
    s = vp_sigmas(ac, ts)
    # Euler-type schedulers keep the VE state x_VE and divide it by sqrt(1 + s^2) for the UNet;
    # the others keep the VP state x_k itself. Which one: what scale_model_input does to a one.
    probe = float(fresh.scale_model_input(torch.ones(1, dtype=torch.float64), fresh.timesteps[0]).reshape(-1)[0])
    init = float(torch.as_tensor(fresh.init_noise_sigma, dtype=torch.float64))
    if abs(probe - 1.0) < 1e-9:
        init = init * math.sqrt(1.0 + float(s[0]) ** 2)
    if not (math.isfinite(init) and init > 0):
        raise ValueError(f"{name}'s initial noise scale is {init}; it must be finite and > 0")
    t = s / (1.0 + s)
    return VPSchedule(
        sigmas=torch.cat([t, t.new_zeros(1)]),
        edm_sigmas=s,
        timesteps=ts,
        init_noise_sigma=init,
        alphas_cumprod=ac,
        scheduler=name,
    )


def edm_schedule(scheduler: Any, steps: int) -> VPSchedule:
    """The grid of an EDM scheduler (``EDMEulerScheduler``, ``EDMDPMSolverMultistepScheduler``: Playground v2.5's
    SDXL pipeline), whose UNet is preconditioned as EDM's (:class:`EDMUNetVelocity`).

    A fresh scheduler from ``scheduler.config`` takes ``set_timesteps(steps)``; its own ``sigmas`` (the Karras
    or exponential levels ``s_n``, then 0) are the levels, ``t_n = s_n / (1 + s_n)``, its ``timesteps`` the
    UNet's time input there (``c_noise = log(s_n) / 4``), its latents ``x = x_0 + s xi`` (its
    ``init_noise_sigma`` the initial state's scale).

    Returns:
        :class:`VPSchedule` with ``alphas_cumprod`` ``None`` (an EDM scheduler has none).

    Raises:
        ValueError: on ``steps`` below 1 or a scheduler whose levels do not decrease to 0.
    """
    steps = check_int("num_inference_steps", steps, 1)
    name = type(scheduler).__name__
    fresh = type(scheduler).from_config(scheduler.config)
    fresh.set_timesteps(steps, device="cpu")
    sig = torch.as_tensor(fresh.sigmas).detach().to("cpu", torch.float64).reshape(-1)
    s = sig[:-1]
    if s.numel() != steps or float(sig[-1]) != 0.0 or bool((s[1:] >= s[:-1]).any()) or not bool((s > 0).all()):
        raise ValueError(
            f"{name}.set_timesteps({steps}) gives the levels {[round(v, 4) for v in sig.tolist()]}, not {steps} "
            "decreasing levels then 0 (final_sigmas_type='zero')"
        )
    init = float(torch.as_tensor(fresh.init_noise_sigma, dtype=torch.float64))
    t = s / (1.0 + s)
    return VPSchedule(
        sigmas=torch.cat([t, t.new_zeros(1)]),
        edm_sigmas=s,
        timesteps=torch.as_tensor(fresh.timesteps).detach().to("cpu", torch.float64).reshape(-1),
        init_noise_sigma=init,
        alphas_cumprod=None,
        scheduler=name,
    )


def is_edm_scheduler(scheduler: Any) -> bool:
    """Whether ``scheduler`` preconditions the UNet as EDM does (its ``precondition_inputs``, ``precondition_noise``,
    ``precondition_outputs``: diffusers' ``EDMEulerScheduler``, ``EDMDPMSolverMultistepScheduler``)."""
    return all(callable(getattr(scheduler, m, None)) for m in _EDM_METHODS)


_EDM_METHODS = ("precondition_inputs", "precondition_noise", "precondition_outputs")


class UNetPrediction:
    """A diffusers ``UNet2DConditionModel``'s (guided) prediction, ``net(x_k, k, **cond)``.

    With ``guidance_scale > 1`` both classifier-free guidance branches of every
    row go through **one** UNet call (rows ``[uncond; cond]``, as the pipelines
    order them) and the prediction is ``u + g (c - u)`` in float32. The UNet
    runs in its own dtype on ``device``: the inputs (state, timestep-free
    conditioning) are cast to it; the result is float32 on ``x_k``'s device.

    SDXL's added conditioning (``added_cond_kwargs``) is passed per row:
    ``text_embeds`` (the pooled text embedding) and ``time_ids`` (``orig_h,
    orig_w, crop_top, crop_left, tgt_h, tgt_w``), each with its negative for the
    unconditional branch.

    Args:
        unet: the network, called as ``unet(x_k, k, encoder_hidden_states=,
            added_cond_kwargs=, cross_attention_kwargs=, return_dict=False)[0]``.
        guidance_scale: ``g >= 0``; ``g <= 1`` runs the conditional branch only.
        device: where inputs are sent (default: the UNet's device).
        cross_attention_kwargs: passed to the UNet unchanged (LoRA scale, ...).
    """

    def __init__(
        self,
        unet: torch.nn.Module,
        *,
        guidance_scale: float = 1.0,
        device: str | torch.device | None = None,
        cross_attention_kwargs: Optional[dict] = None,
    ) -> None:
        if not callable(unet):
            raise TypeError("unet must be a callable torch module")
        guidance_scale = check_number("guidance_scale", guidance_scale, 0.0)
        if cross_attention_kwargs is not None and not isinstance(cross_attention_kwargs, dict):
            raise TypeError(
                f"cross_attention_kwargs must be a dict or None, got {type(cross_attention_kwargs).__name__}"
            )
        self.unet = unet
        self.guidance_scale = guidance_scale
        self.dtype, own = module_dtype_device(unet)
        self.device = torch.device(device) if device is not None else own
        self.cross_attention_kwargs = cross_attention_kwargs

    @property
    def do_classifier_free_guidance(self) -> bool:
        """True when ``guidance_scale > 1`` (diffusers' convention)."""
        return self.guidance_scale > 1.0

    @property
    def branches(self) -> int:
        """UNet rows per state: 2 with guidance, 1 without."""
        return 2 if self.do_classifier_free_guidance else 1

    @torch.no_grad()
    def __call__(
        self,
        x_k: torch.Tensor,
        k: torch.Tensor,
        *,
        encoder_hidden_states: torch.Tensor,
        negative_encoder_hidden_states: Optional[torch.Tensor] = None,
        text_embeds: Optional[torch.Tensor] = None,
        negative_text_embeds: Optional[torch.Tensor] = None,
        time_ids: Optional[torch.Tensor] = None,
        negative_time_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The (guided) prediction.

        Args:
            x_k: ``(M, C, h, w)`` VP states (the UNet's input).
            k: ``(M,)`` fractional timesteps.
            encoder_hidden_states: ``(M, seq, cross_attention_dim)`` text embeddings.
            negative_encoder_hidden_states: ``(M, seq, cross_attention_dim)``, with guidance.
            text_embeds: ``(M, pooled_dim)`` SDXL pooled embeddings (with ``time_ids``).
            negative_text_embeds: ``(M, pooled_dim)``, with guidance and ``text_embeds``.
            time_ids: ``(M, n_ids)`` SDXL micro-conditioning.
            negative_time_ids: ``(M, n_ids)``, with guidance and ``time_ids``.

        Returns:
            ``(M, C, h, w)`` float32 prediction on ``x_k``'s device.

        Raises:
            ValueError: on missing negatives, half the added conditioning, or mismatched rows.
        """
        M = x_k.shape[0]
        added = text_embeds is not None or time_ids is not None
        if added and (text_embeds is None or time_ids is None):
            raise ValueError("SDXL's added conditioning needs both text_embeds and time_ids")
        pos = [encoder_hidden_states] + ([text_embeds, time_ids] if added else [])
        neg = [negative_encoder_hidden_states] + ([negative_text_embeds, negative_time_ids] if added else [])
        cfg = self.do_classifier_free_guidance
        if cfg and any(n is None for n in neg):
            names = ["negative_encoder_hidden_states"] + (
                ["negative_text_embeds", "negative_time_ids"] if added else []
            )
            raise ValueError(f"guidance_scale={self.guidance_scale} > 1 needs {', '.join(names)}")
        rows = [c.shape[0] for c in pos + (neg if cfg else [])]
        if k.shape != (M,) or any(r != M for r in rows):
            raise ValueError(f"x_k has {M} rows but k has shape {tuple(k.shape)} and the conditioning has {rows} rows")
        dev, dt = self.device, self.dtype

        def both(p: torch.Tensor, n: Optional[torch.Tensor]) -> torch.Tensor:
            p = p.to(dev, dt)
            return torch.cat([n.to(dev, dt), p]) if cfg else p

        h = both(x_k, x_k)
        t = both(k, k).to(torch.float32)  # the timestep embedding is computed in float32 whatever the dtype
        kwargs: dict[str, Any] = {"encoder_hidden_states": both(encoder_hidden_states, negative_encoder_hidden_states)}
        if added:
            kwargs["added_cond_kwargs"] = {
                "text_embeds": both(text_embeds, negative_text_embeds),
                "time_ids": both(time_ids, negative_time_ids),
            }
        if self.cross_attention_kwargs is not None:
            kwargs["cross_attention_kwargs"] = self.cross_attention_kwargs
        out = self.unet(h, t, return_dict=False, **kwargs)[0].to(torch.float32)
        if cfg:
            out = guide(out, self.guidance_scale)
        return out.to(x_k.device)

    def __repr__(self) -> str:
        return (
            f"UNetPrediction({type(self.unet).__name__}, guidance_scale={self.guidance_scale}, "
            f"dtype={self.dtype}, device={self.device})"
        )


class UNetVelocity(EDMDenoiserVelocity):
    """A diffusers UNet on a VP schedule as a velocity ``v(x, t, **cond)`` on the linear path.

    :class:`UNetPrediction` (the guided UNet call) under
    :class:`~specforest.models.edm.VPDenoiser` (timestep map, input scaling,
    prediction to ``E[x_0 | x]``) under
    :class:`~specforest.models.edm.EDMDenoiserVelocity` (``E[x_0 | x]`` to the
    velocity); the change of variables is in the module docstring. The
    adapter's arithmetic runs in float32 (float64 for float64 states); only
    the UNet runs in its own dtype.

    Args:
        unet: a ``UNet2DConditionModel`` (or a module with its call signature).
        alphas_cumprod: ``(N,)`` the scheduler's ``abar_k`` (:attr:`VPSchedule.alphas_cumprod`).
        prediction_type: one of :data:`PREDICTION_TYPES` (the scheduler config's).
        guidance_scale: classifier-free guidance ``g >= 0``.
        device: where the UNet's inputs go (default: its device).
        cross_attention_kwargs: passed to the UNet unchanged.

    Calling it: ``x (M, C, h, w)`` linear-path states, ``sigma (M,)`` their levels
    ``t`` in ``[0, 1]``, ``cond`` the keyword tensors of
    :meth:`UNetPrediction.__call__` (one row per state) -> ``(M, C, h, w)``; ``timestep (M,)``, where given,
    the UNet's timestep itself instead of the level's (:attr:`takes_timestep`).

    Raises:
        ValueError: on an unsupported ``prediction_type`` or invalid table.
    """

    takes_timestep = True
    """It takes the scheduler's own timestep of a call (``timestep=``) where the run's chain declares one
    (:meth:`specforest.chains.Chain.call_times`: a scheduler whose two calls at one level pass two timesteps)."""

    def __init__(
        self,
        unet: torch.nn.Module,
        alphas_cumprod: torch.Tensor,
        *,
        prediction_type: str = "epsilon",
        guidance_scale: float = 1.0,
        device: str | torch.device | None = None,
        cross_attention_kwargs: Optional[dict] = None,
    ) -> None:
        if prediction_type not in PREDICTION_TYPES:
            raise ValueError(
                f"prediction_type must be one of {PREDICTION_TYPES} (the scheduler config's), got {prediction_type!r}"
            )
        self.prediction = UNetPrediction(
            unet, guidance_scale=guidance_scale, device=device, cross_attention_kwargs=cross_attention_kwargs
        )
        vp = VPDenoiser(self.prediction, alphas_cumprod, prediction_type)
        super().__init__(vp, sigma_min=vp.sigma_min, sigma_max=vp.sigma_max)
        self.prediction_type = prediction_type

    @property
    def guidance_scale(self) -> float:
        """The guidance scale ``g``."""
        return self.prediction.guidance_scale

    @property
    def branches(self) -> int:
        """UNet rows per state: 2 with guidance, 1 without."""
        return self.prediction.branches

    @property
    def dtype(self) -> torch.dtype:
        """The UNet's dtype (its inputs are cast to it)."""
        return self.prediction.dtype

    @property
    def device(self) -> torch.device:
        """Where the UNet's inputs go."""
        return self.prediction.device

    def __repr__(self) -> str:
        return (
            f"UNetVelocity({type(self.prediction.unet).__name__}, prediction_type={self.prediction_type!r}, "
            f"guidance_scale={self.guidance_scale}, dtype={self.dtype}, device={self.device})"
        )


class EDMPreconditioned:
    """A UNet preconditioned as EDM's (Karras et al. 2022, Table 1, as diffusers' EDM schedulers apply it), as a
    denoiser ``D(y; s)`` of VE states ``y = x_0 + s xi``: the UNet takes ``c_in y`` with ``c_in = 1 / sqrt(s^2 +
    sigma_data^2)`` at the time input ``c_noise = log(s) / 4``, and ``D = c_skip y + c_out F`` of its output ``F``,
    ``c_skip = sigma_data^2 / (s^2 + sigma_data^2)``, ``c_out = s sigma_data / sqrt(s^2 + sigma_data^2)``
    (``epsilon``; its negative for ``v_prediction``).

    Args:
        net: the guided prediction (:class:`UNetPrediction`).
        sigma_data: the data's standard deviation (the scheduler config's).
        prediction: ``"epsilon"`` or ``"v_prediction"``.
    """

    PREDICTIONS = ("epsilon", "v_prediction")

    def __init__(self, net: Any, sigma_data: float, prediction: str) -> None:
        if prediction not in self.PREDICTIONS:
            raise ValueError(
                f"prediction_type must be one of {self.PREDICTIONS} for an EDM scheduler (its preconditioning "
                f"has no other), got {prediction!r}"
            )
        self.net, self.prediction = net, prediction
        self.sigma_data = check_number("sigma_data", sigma_data, 0.0, lo_open=True)

    def __call__(self, y: torch.Tensor, s: torch.Tensor, **cond: Any) -> torch.Tensor:
        work = torch.float64 if y.dtype == torch.float64 else torch.float32
        sd2 = self.sigma_data**2
        s = s.to(work)
        s_b = s.reshape((-1,) + (1,) * (y.ndim - 1))
        yw = y.to(work)
        out = self.net(yw / (s_b * s_b + sd2).sqrt(), 0.25 * s.log(), **cond).to(work)
        c_out = s_b * self.sigma_data / (s_b * s_b + sd2).sqrt()
        if self.prediction == "v_prediction":
            c_out = -c_out
        return sd2 / (s_b * s_b + sd2) * yw + c_out * out


class EDMUNetVelocity(UNetVelocity):
    """A diffusers UNet preconditioned as EDM's (an EDM scheduler's pipeline: Playground v2.5) as a velocity
    ``v(x, t, **cond)`` on the linear path: :class:`UNetPrediction` under :class:`EDMPreconditioned` under
    :class:`~specforest.models.edm.EDMDenoiserVelocity`, clipped to the scheduler's ``[sigma_min, sigma_max]``.

    Args:
        unet: a ``UNet2DConditionModel``.
        sigma_data, sigma_min, sigma_max: the EDM scheduler config's.
        prediction_type: ``epsilon`` or ``v_prediction`` (the scheduler config's).
        guidance_scale, device, cross_attention_kwargs: as :class:`UNetVelocity`.
    """

    # its time input is log(sigma) / 4 of the level: no chain declares another
    takes_timestep = False

    def __init__(
        self,
        unet: torch.nn.Module,
        *,
        sigma_data: float,
        sigma_min: float,
        sigma_max: float,
        prediction_type: str = "epsilon",
        guidance_scale: float = 1.0,
        device: str | torch.device | None = None,
        cross_attention_kwargs: Optional[dict] = None,
    ) -> None:
        self.prediction = UNetPrediction(
            unet, guidance_scale=guidance_scale, device=device, cross_attention_kwargs=cross_attention_kwargs
        )
        precond = EDMPreconditioned(self.prediction, sigma_data, prediction_type)
        EDMDenoiserVelocity.__init__(self, precond, sigma_min=sigma_min, sigma_max=sigma_max)
        self.prediction_type = prediction_type


# Heuristic peak activation of one UNet row at each resolution level, in units of
# tokens x channels x bytes: skip connections kept for the up path, resnet
# temporaries, q/k/v and the GEGLU feed-forward (8x) of the transformer blocks.
# Attention probabilities are counted as if materialised (float32 scores and
# softmax), which overestimates fused kernels: the estimate errs towards
# smaller sub-batches, never towards OOM.
_UNET_ACTIVATION_FACTOR = 24


def unet_row_bytes(
    config: Mapping,
    *,
    latent_hw: tuple[int, int],
    text_tokens: int,
    branches: int,
    dtype: torch.dtype,
    cond_numel: int,
    latent_numel: int,
) -> int:
    """Peak bytes one sampler row adds inside a UNet call (all its guidance branches).

    A heuristic upper bound: per branch and resolution level ``l`` (``h w / 4^l``
    tokens, ``block_out_channels[l]`` channels) ``24 x tokens x channels`` in the
    UNet's dtype, plus float32 self- and cross-attention scores ``2 x heads x
    tokens x (tokens + text_tokens)`` at levels with attention; plus the gathered
    conditioning, the input and output latents and the float32 velocity.
    """
    mb = torch.empty((), dtype=dtype).element_size()
    h, w = latent_hw
    heads_cfg = config.get("num_attention_heads") or config.get("attention_head_dim") or 8
    per_branch = 0
    for level, (chans, kind) in enumerate(zip(config["block_out_channels"], config["down_block_types"], strict=True)):
        tokens = math.ceil(h / 2**level) * math.ceil(w / 2**level)
        per_branch += _UNET_ACTIVATION_FACTOR * tokens * int(chans) * mb
        if "CrossAttn" in kind:
            heads = heads_cfg[level] if isinstance(heads_cfg, Sequence) else heads_cfg
            per_branch += 2 * 4 * int(heads) * tokens * (tokens + text_tokens)
    return branches * (per_branch + 2 * cond_numel * mb + 2 * latent_numel * mb) + 3 * latent_numel * 4
