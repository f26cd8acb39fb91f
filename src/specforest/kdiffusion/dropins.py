"""Drop-in samplers with the signatures of the functions they replace (k-diffusion's and ComfyUI's).

``sample_euler_ancestral``, ``sample_euler``, ``sample_heun``, ``sample_dpm_2``, ``sample_dpm_2_ancestral``,
``sample_dpmpp_2s_ancestral``, ``sample_dpmpp_sde``, ``sample_dpmpp_2m_sde`` and ``sample_dpmpp_3m_sde`` take
k-diffusion's exact signatures; ``sample_ddpm`` and ``sample_lcm`` take ComfyUI's. Each runs its sampler's chain
(:mod:`specforest.chains`) through :func:`specforest.kdiffusion.sample`: with ``tree=None`` and the same
noise the output is the real function's, with a tree the law is the same. ``docs/kdiffusion.md`` shows them
registered as ComfyUI ``KSAMPLER`` s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from .speculative import linear_grid, sample

__all__ = [
    "sample_ddpm",
    "sample_dpmpp_2m_sde",
    "sample_dpmpp_3m_sde",
    "sample_dpmpp_sde",
    "sample_euler",
    "sample_euler_ancestral",
    "sample_lcm",
]


def _seed(seed: Any, extra_args: Optional[dict], tree: Any, generator: Any) -> Optional[int]:
    """The run's seed: ``seed``, else ComfyUI's ``extra_args["seed"]``; ``None`` with a ``generator``
    (the run draws its seed from it, as :func:`specforest.sample` does); with a tree and none of them,
    one draw from torch's global generator (so ``torch.manual_seed`` reproduces the run, as it does
    k-diffusion's).

    Raises:
        ValueError: naming both where two of ``seed``, ``generator`` and ``extra_args["seed"]`` are
            given and disagree (the two seeds with one value are one seed).
    """
    comfy = None
    if isinstance(extra_args, dict) and extra_args.get("seed") is not None:
        comfy = extra_args["seed"]
        if isinstance(comfy, torch.Tensor) and comfy.numel() == 1:
            comfy = int(comfy)
    if generator is not None:
        if seed is not None:
            raise ValueError(f"give seed or generator, not both: got seed={seed!r} and generator")
        if comfy is not None:
            raise ValueError(
                f"give generator or extra_args['seed'], not both: got generator and extra_args['seed'] = {comfy!r}"
            )
        return None
    if seed is not None and comfy is not None and seed != comfy:
        raise ValueError(
            f"seed and extra_args['seed'] disagree: got seed={seed!r} and extra_args['seed'] = {comfy!r}; "
            "give one (or the same value in both)"
        )
    if seed is None:
        seed = comfy
    if seed is None and tree is not None:
        seed = int(torch.randint(0, 2**62, ()))
    return seed


def _step_noise(
    x: torch.Tensor,
    sigmas: torch.Tensor,
    noise_sampler: Optional[Callable],
    start: bool = False,
    draws: Optional[list] = None,
) -> Callable[[int], torch.Tensor]:
    """The standard chain's noise in k-diffusion's order of calls: step ``n``'s draw is
    ``noise_sampler(sigmas[n], sigmas[n + 1])`` (or ``torch.randn_like(x)`` without one), made only
    where ``sigmas[n + 1] > 0``; with ``start`` (EDM's churn) the draws are one step ahead (the start
    takes the first, step ``n`` the churn of step ``n + 1``). ``draws``: per step, whether the sampler's code
    draws there (default: where ``sigmas[n + 1] > 0``)."""
    T = sigmas.numel() - 1
    started = [False]

    def noise(n: int) -> torch.Tensor:
        if start:
            # EDM's churn: k-diffusion draws at every step i the churn of step i; the start takes
            # draw 0 (drawn even where the chain's start adds none, which the engine does not ask for),
            # step n the draw of step n + 1, the last step none
            if not started[0]:
                started[0] = True
                z0 = torch.randn_like(x)
                if n == -1:
                    return z0
            return torch.randn_like(x) if n + 1 < T else torch.zeros_like(x)
        if not (bool(sigmas[n + 1] > 0) if draws is None else draws[n]):
            return torch.zeros_like(x)
        return noise_sampler(sigmas[n], sigmas[n + 1]) if noise_sampler is not None else torch.randn_like(x)

    return noise


def _ve_only(name: str, path: str) -> None:
    if path != "ve":
        raise ValueError(
            f"{name} is defined on VE noise levels (x = x_0 + sigma xi) only, path='ve'; got path={path!r} "
            "(for a CONST model use sample_euler_ancestral, sample_dpm_2_ancestral, sample_dpmpp_2s_ancestral, "
            "sample_dpmpp_sde, sample_dpmpp_2m_sde, sample_dpmpp_3m_sde or sample_lcm with path='linear')"
        )


def _snr_start(name: str, sigmas: torch.Tensor, path: str) -> None:
    """Refuse ``sigmas (T + 1,)`` from 1 on the linear path for a sampler written in half-log-SNR ``lambda = log((1 -
    t) / t)``, infinite at ``t = 1``, where the first step's coefficients are not numbers (``dpmpp_2m_sde``,
    ``dpmpp_3m_sde``; ``dpmpp_sde``'s chain refuses it itself). ComfyUI's function moves such a first level of a
    ``CONST`` model to ``model_sampling.percent_to_sigma(1e-4)`` (``offset_first_sigma_for_snr``).

    Raises:
        ValueError: naming ``sigmas`` and the level to pass.
    """
    linear_grid(sigmas, path)  # a bad schedule is refused by name first
    if path == "linear" and float(sigmas[0]) >= 1.0:
        raise ValueError(
            f"sigmas must start below 1 for {name} with path='linear' (got a first level {float(sigmas[0]):.6g}): "
            "its step is written in half-log-SNR lambda = log((1 - t) / t), infinite at t = 1; ComfyUI's "
            f"{name} moves a first level of 1 to its model's model_sampling.percent_to_sigma(1e-4) "
            "(1 - 1e-4 at shift 1), where lambda is finite; pass that level"
        )


def _drop_in(
    chain,
    model,
    x,
    sigmas,
    extra_args,
    callback,
    disable,
    noise_sampler,
    *,
    tree,
    seed,
    path,
    row_args,
    shared_args,
    options,
    start: bool = False,
    draws: Optional[list] = None,
    noise: Optional[Callable[[int], torch.Tensor]] = None,
) -> torch.Tensor:
    """Run ``chain``'s drop-in; ``noise``: the standard run's noise by chain step where the chain's steps are not
    the grid's (``dpmpp_sde``'s half-steps), in place of :func:`_step_noise`'s."""
    for name in ("chain", "churn", "noise"):
        if name in options:
            raise TypeError(f"{name} is set by this sampler's own arguments; call specforest.kdiffusion.sample for it")
    if noise_sampler is not None and tree is not None:
        raise ValueError(
            "noise_sampler was given with a tree: a speculative run draws each node's noise from seed (or "
            "extra_args['seed']), keyed by sample and node, so that drafts and the exact chain share it; it "
            "cannot replay a noise sampler's sequence. Pass seed, or tree=None"
        )
    generator = options.get("generator")
    if noise_sampler is not None and generator is not None:
        raise ValueError(
            "give noise_sampler or generator, not both: got noise_sampler and generator (the steps would take "
            "the noise sampler's draws and never read the generator)"
        )
    linear_grid(sigmas, path)  # refuse a bad schedule by name before the noise reads it
    seed = _seed(seed, extra_args, tree, generator)
    own, noise = noise, None
    if tree is None and (noise_sampler is not None or (seed is None and generator is None)):
        noise = own if own is not None else _step_noise(x, sigmas, noise_sampler, start=start, draws=draws)
    return sample(
        model,
        x,
        sigmas,
        extra_args,
        callback,
        disable,
        row_args=row_args,
        shared_args=shared_args,
        path=path,
        chain=chain,
        tree=tree,
        seed=seed,
        noise=noise,
        **options,
    ).samples


def sample_euler_ancestral(
    model: Callable[..., torch.Tensor],
    x: torch.Tensor,
    sigmas: torch.Tensor,
    extra_args: Optional[dict] = None,
    callback: Optional[Callable[[dict], None]] = None,
    disable: Optional[bool] = None,
    eta: float = 1.0,
    s_noise: float = 1.0,
    noise_sampler: Optional[Callable] = None,
    *,
    tree: Any = None,
    coupling: Any = "grs",
    draft: Any = "velocity",
    seed: Optional[int] = None,
    row_args: Sequence[str] = (),
    shared_args: Sequence[str] = (),
    path: str = "ve",
    **options: Any,
) -> torch.Tensor:
    """k-diffusion's ``sample_euler_ancestral``, exactly; with a ``tree``, speculated in law.

    The signature is k-diffusion's, then keyword-only ``tree``, ``coupling``, ``draft``, ``seed``,
    ``row_args``, ``shared_args`` (see :func:`sample_speculative`), ``path`` and further options of
    :func:`specforest.sample` (``prefetch``, ``verify``, ``max_rows``, ``lazy``, ``pad_rows``, ...).
    With ``path="linear"`` (ComfyUI's ``CONST`` models: SD3, Flux) it is ComfyUI's
    ``sample_euler_ancestral_RF``, which ComfyUI runs for them.

    Randomness: with ``tree=None`` and a ``noise_sampler`` the steps take its draws, called as
    k-diffusion calls it (``noise_sampler(sigma, sigma_next)`` where ``sigma_next > 0``): the output
    is k-diffusion's for the same draws. With neither a ``noise_sampler`` nor a seed it draws
    ``torch.randn_like(x)`` per step, as k-diffusion's default does. With a ``seed`` (or ComfyUI's
    ``extra_args["seed"]``) every draw is keyed by (seed, sample, step, node) (per sample
    reproducible); a ``tree`` needs that (a ``noise_sampler`` beside one is refused). A ``generator``
    (in ``options``: a ``torch.Generator`` or one per sample) gives the run its seed, as
    :func:`specforest.sample` takes it, with or without a tree. Two sources of randomness are refused
    naming both: ``seed`` and ``generator``, ``seed`` and another ``extra_args["seed"]``, ``generator``
    and ``extra_args["seed"]``, ``noise_sampler`` and ``generator``.

    Statistics: the drop-in is :func:`specforest.kdiffusion.sample` with
    ``chain=EulerAncestral(eta=eta, s_noise=s_noise, path=path)``; that call, with the same ``seed``
    or ``generator``, returns the same samples with the run's ``stats`` (``docs/kdiffusion.md``).

    Returns:
        ``(batch, *shape)`` samples at ``sigma = 0`` in ``x``'s dtype.

    Raises:
        ValueError / TypeError: naming the parameter (``sigmas``, ``eta``, ``s_noise``, two sources of
            randomness, ...).
    """
    from ..chains import EulerAncestral

    chain = EulerAncestral(eta=eta, s_noise=s_noise, path=path)
    return _drop_in(
        chain, model, x, sigmas, extra_args, callback, disable, noise_sampler,
        tree=tree, seed=seed, path=path, row_args=row_args, shared_args=shared_args,
        options={"coupling": coupling, "draft": draft, **options},
    )  # fmt: skip


def sample_euler(
    model: Callable[..., torch.Tensor],
    x: torch.Tensor,
    sigmas: torch.Tensor,
    extra_args: Optional[dict] = None,
    callback: Optional[Callable[[dict], None]] = None,
    disable: Optional[bool] = None,
    s_churn: float = 0.0,
    s_tmin: float = 0.0,
    s_tmax: float = float("inf"),
    s_noise: float = 1.0,
    *,
    tree: Any = None,
    coupling: Any = "grs",
    draft: Any = "velocity",
    seed: Optional[int] = None,
    row_args: Sequence[str] = (),
    shared_args: Sequence[str] = (),
    path: str = "ve",
    **options: Any,
) -> torch.Tensor:
    """k-diffusion's ``sample_euler`` (EDM's Algorithm 2 with Euler steps), exactly; with a ``tree`` and
    ``s_churn > 0``, speculated in law on the churned states ``x-hat`` (:class:`~specforest.chains.EulerChurn`).

    Randomness: with ``tree=None`` and no ``seed`` the churn noise is ``torch.randn_like(x)``, drawn at
    every step as k-diffusion draws it (same global-generator state, same output). With a ``seed`` (or
    ``extra_args["seed"]``) every draw is keyed by sample. ``s_churn = 0`` is the deterministic Euler
    sampler: it runs with ``tree=None`` and is refused with a tree. Other arguments as
    :func:`sample_euler_ancestral`.
    """
    from ..chains import EulerChurn

    _ve_only("sample_euler", path)
    chain = EulerChurn(s_churn=s_churn, s_tmin=s_tmin, s_tmax=s_tmax, s_noise=s_noise)
    return _drop_in(
        chain, model, x, sigmas, extra_args, callback, disable, None,
        tree=tree, seed=seed, path=path, row_args=row_args, shared_args=shared_args,
        options={"coupling": coupling, "draft": draft, **options}, start=True,
    )  # fmt: skip


def sample_heun(
    model: Callable[..., torch.Tensor],
    x: torch.Tensor,
    sigmas: torch.Tensor,
    extra_args: Optional[dict] = None,
    callback: Optional[Callable[[dict], None]] = None,
    disable: Optional[bool] = None,
    s_churn: float = 0.0,
    s_tmin: float = 0.0,
    s_tmax: float = float("inf"),
    s_noise: float = 1.0,
    *,
    tree: Any = None,
    coupling: Any = "grs",
    draft: Any = "velocity",
    seed: Optional[int] = None,
    row_args: Sequence[str] = (),
    shared_args: Sequence[str] = (),
    path: str = "ve",
    **options: Any,
) -> torch.Tensor:
    """k-diffusion's ``sample_heun`` (EDM's Algorithm 2 with Heun steps), exactly; with a ``tree`` and
    ``s_churn > 0``, speculated in law on the churned states ``x-hat`` (:class:`~specforest.chains.HeunChurn`).

    Two model calls a step, one at the last (into 0): a standard run of ``N`` steps makes ``2 N - 1``
    calls, as k-diffusion's; a speculative round makes two sequential batched calls. Randomness,
    ``s_churn = 0`` and the other arguments as :func:`sample_euler`.
    """
    from ..chains import HeunChurn

    _ve_only("sample_heun", path)
    chain = HeunChurn(s_churn=s_churn, s_tmin=s_tmin, s_tmax=s_tmax, s_noise=s_noise)
    return _drop_in(
        chain, model, x, sigmas, extra_args, callback, disable, None,
        tree=tree, seed=seed, path=path, row_args=row_args, shared_args=shared_args,
        options={"coupling": coupling, "draft": draft, **options}, start=True,
    )  # fmt: skip


def sample_dpm_2(
    model: Callable[..., torch.Tensor],
    x: torch.Tensor,
    sigmas: torch.Tensor,
    extra_args: Optional[dict] = None,
    callback: Optional[Callable[[dict], None]] = None,
    disable: Optional[bool] = None,
    s_churn: float = 0.0,
    s_tmin: float = 0.0,
    s_tmax: float = float("inf"),
    s_noise: float = 1.0,
    *,
    tree: Any = None,
    coupling: Any = "grs",
    draft: Any = "velocity",
    seed: Optional[int] = None,
    row_args: Sequence[str] = (),
    shared_args: Sequence[str] = (),
    path: str = "ve",
    **options: Any,
) -> torch.Tensor:
    """k-diffusion's ``sample_dpm_2`` (DPM-Solver-2 with EDM's churn), exactly; with a ``tree`` and
    ``s_churn > 0``, speculated in law on the churned states (:class:`~specforest.chains.DPM2Churn`).

    Two model calls a step, one at the last (into 0), as k-diffusion's. Randomness, ``s_churn = 0`` and
    the other arguments as :func:`sample_euler`.
    """
    from ..chains import DPM2Churn

    _ve_only("sample_dpm_2", path)
    chain = DPM2Churn(s_churn=s_churn, s_tmin=s_tmin, s_tmax=s_tmax, s_noise=s_noise)
    return _drop_in(
        chain, model, x, sigmas, extra_args, callback, disable, None,
        tree=tree, seed=seed, path=path, row_args=row_args, shared_args=shared_args,
        options={"coupling": coupling, "draft": draft, **options}, start=True,
    )  # fmt: skip


def sample_dpm_2_ancestral(
    model: Callable[..., torch.Tensor],
    x: torch.Tensor,
    sigmas: torch.Tensor,
    extra_args: Optional[dict] = None,
    callback: Optional[Callable[[dict], None]] = None,
    disable: Optional[bool] = None,
    eta: float = 1.0,
    s_noise: float = 1.0,
    noise_sampler: Optional[Callable] = None,
    *,
    tree: Any = None,
    coupling: Any = "grs",
    draft: Any = "velocity",
    seed: Optional[int] = None,
    row_args: Sequence[str] = (),
    shared_args: Sequence[str] = (),
    path: str = "ve",
    **options: Any,
) -> torch.Tensor:
    """k-diffusion's ``sample_dpm_2_ancestral``, exactly; with a ``tree``, speculated in law
    (:class:`~specforest.chains.DPM2Ancestral`). Two model calls a step, one where ``sigma_down = 0``.
    With ``path="linear"`` (ComfyUI's ``CONST`` models: SD3, Flux) it is ComfyUI's
    ``sample_dpm_2_ancestral_RF``, which ComfyUI runs for them.

    The noise sampler is called where the real function calls it (steps with ``sigma_down > 0``). Arguments
    and randomness as :func:`sample_euler_ancestral`.
    """
    from ..chains import DPM2Ancestral

    chain = DPM2Ancestral(eta=eta, s_noise=s_noise, path=path)
    return _drop_in(
        chain, model, x, sigmas, extra_args, callback, disable, noise_sampler,
        tree=tree, seed=seed, path=path, row_args=row_args, shared_args=shared_args,
        options={"coupling": coupling, "draft": draft, **options},
        draws=chain.draws_noise(sigmas).tolist() if isinstance(sigmas, torch.Tensor) else None,
    )  # fmt: skip


def sample_dpmpp_2s_ancestral(
    model: Callable[..., torch.Tensor],
    x: torch.Tensor,
    sigmas: torch.Tensor,
    extra_args: Optional[dict] = None,
    callback: Optional[Callable[[dict], None]] = None,
    disable: Optional[bool] = None,
    eta: float = 1.0,
    s_noise: float = 1.0,
    noise_sampler: Optional[Callable] = None,
    *,
    tree: Any = None,
    coupling: Any = "grs",
    draft: Any = "velocity",
    seed: Optional[int] = None,
    row_args: Sequence[str] = (),
    shared_args: Sequence[str] = (),
    path: str = "ve",
    **options: Any,
) -> torch.Tensor:
    """k-diffusion's ``sample_dpmpp_2s_ancestral`` (DPM-Solver++(2S) with ancestral noise), exactly; with a
    ``tree``, speculated in law (:class:`~specforest.chains.DPMPP2SAncestral`). Two model calls a step,
    one where ``sigma_down = 0``. With ``path="linear"`` (ComfyUI's ``CONST`` models) it is ComfyUI's
    ``sample_dpmpp_2s_ancestral_RF``, which ComfyUI runs for them. Arguments and randomness as
    :func:`sample_euler_ancestral`.
    """
    from ..chains import DPMPP2SAncestral

    chain = DPMPP2SAncestral(eta=eta, s_noise=s_noise, path=path)
    return _drop_in(
        chain, model, x, sigmas, extra_args, callback, disable, noise_sampler,
        tree=tree, seed=seed, path=path, row_args=row_args, shared_args=shared_args,
        options={"coupling": coupling, "draft": draft, **options},
    )  # fmt: skip


def sample_ddpm(
    model: Callable[..., torch.Tensor],
    x: torch.Tensor,
    sigmas: torch.Tensor,
    extra_args: Optional[dict] = None,
    callback: Optional[Callable[[dict], None]] = None,
    disable: Optional[bool] = None,
    noise_sampler: Optional[Callable] = None,
    *,
    tree: Any = None,
    coupling: Any = "grs",
    draft: Any = "velocity",
    seed: Optional[int] = None,
    row_args: Sequence[str] = (),
    shared_args: Sequence[str] = (),
    path: str = "ve",
    **options: Any,
) -> torch.Tensor:
    """ComfyUI's ``sample_ddpm`` (ancestral DDPM, ``fixed_small`` variance, on VE sigmas), exactly;
    with a ``tree``, speculated in law. Arguments and randomness as :func:`sample_euler_ancestral`
    (DDPM's own 1000-step schedule as VE sigmas: ``t / (1 - t)`` of :func:`specforest.chains.ddpm_linear_grid`,
    or :func:`specforest.schedules.ddpm_discrete_sigmas` at fewer steps)."""
    from ..chains import DDPM

    _ve_only("sample_ddpm", path)
    return _drop_in(
        DDPM(), model, x, sigmas, extra_args, callback, disable, noise_sampler,
        tree=tree, seed=seed, path=path, row_args=row_args, shared_args=shared_args,
        options={"coupling": coupling, "draft": draft, **options},
    )  # fmt: skip


def sample_lcm(
    model: Callable[..., torch.Tensor],
    x: torch.Tensor,
    sigmas: torch.Tensor,
    extra_args: Optional[dict] = None,
    callback: Optional[Callable[[dict], None]] = None,
    disable: Optional[bool] = None,
    noise_sampler: Optional[Callable] = None,
    s_noise: float = 1.0,
    s_noise_end: Optional[float] = None,
    noise_clip_std: float = 0.0,
    *,
    tree: Any = None,
    coupling: Any = "grs",
    draft: Any = "velocity",
    seed: Optional[int] = None,
    row_args: Sequence[str] = (),
    shared_args: Sequence[str] = (),
    path: str = "ve",
    **options: Any,
) -> torch.Tensor:
    """ComfyUI's ``sample_lcm`` (``x = D``, then re-noised to the next level with ``s_noise`` times the noise),
    exactly; with a ``tree``, speculated in law. ``path="linear"`` for ``CONST`` models (the same chain on the
    linear path). Arguments and randomness as :func:`sample_euler_ancestral`.

    Raises:
        ValueError: ``s_noise_end`` other than ``None`` or ``s_noise`` (ComfyUI's per-step multiplier, interpolated
            from ``s_noise`` to it: the chain's ``s_noise`` is one number), or ``noise_clip_std > 0`` (ComfyUI clamps
            each noise to that many of its standard deviations: a step that is no longer Gaussian), each named.
    """
    from ..chains import LCM

    if s_noise_end is not None and s_noise_end != s_noise:
        raise ValueError(
            f"s_noise_end must be None or s_noise (got {s_noise_end!r} with s_noise {s_noise!r}): ComfyUI's per-step "
            "noise multiplier, interpolated from s_noise to s_noise_end, is not a parameter of the lcm chain, whose "
            "s_noise is one number for every step"
        )
    if noise_clip_std > 0:
        raise ValueError(
            f"noise_clip_std must be 0 (got {noise_clip_std!r}): ComfyUI clamps each step's noise to that many of its "
            "standard deviations, which makes the step non-Gaussian; the lcm chain samples the Gaussian step only"
        )
    return _drop_in(
        LCM(s_noise=s_noise), model, x, sigmas, extra_args, callback, disable, noise_sampler,
        tree=tree, seed=seed, path=path, row_args=row_args, shared_args=shared_args,
        options={"coupling": coupling, "draft": draft, **options},
    )  # fmt: skip


def sample_dpmpp_2m_sde(
    model: Callable[..., torch.Tensor],
    x: torch.Tensor,
    sigmas: torch.Tensor,
    extra_args: Optional[dict] = None,
    callback: Optional[Callable[[dict], None]] = None,
    disable: Optional[bool] = None,
    eta: float = 1.0,
    s_noise: float = 1.0,
    noise_sampler: Optional[Callable] = None,
    solver_type: str = "midpoint",
    *,
    tree: Any = None,
    coupling: Any = "grs",
    draft: Any = "velocity",
    seed: Optional[int] = None,
    row_args: Sequence[str] = (),
    shared_args: Sequence[str] = (),
    path: str = "ve",
    **options: Any,
) -> torch.Tensor:
    """k-diffusion's ``sample_dpmpp_2m_sde`` (DPM-Solver++(2M) SDE, ``solver_type`` ``midpoint`` or
    ``heun``), exactly; with a ``tree`` and ``eta > 0``, speculated in law
    (:class:`~specforest.chains.DPMPP2MSDE`: the engine carries each node's parent prediction).

    Randomness as :func:`sample_euler_ancestral`. k-diffusion's default noise is a Brownian tree
    over ``[sigma_min, sigma_max]``; its steps' intervals are disjoint, so its draws are independent
    standard normals (up to torchsde's rounding of the query times, ``docs/chains.md``), the law
    this sampler draws without a ``noise_sampler``. ``eta = 0`` (DPM++ 2M) runs with ``tree=None``
    and is refused with a tree. ``path="linear"`` for ComfyUI's ``CONST`` models (its
    ``sample_dpmpp_2m_sde`` in half-log-SNR ``lambda = log((1 - sigma) / sigma)`` with ``alpha_t = 1 - sigma'``
    factors: the same chain on the linear path), with a first level below 1 (ComfyUI moves a first level of 1
    to its model's ``percent_to_sigma(1e-4)``: pass that level).
    """
    from ..chains import DPMPP2MSDE

    _snr_start("sample_dpmpp_2m_sde", sigmas, path)
    chain = DPMPP2MSDE(eta=eta, s_noise=s_noise, solver_type=solver_type)
    return _drop_in(
        chain, model, x, sigmas, extra_args, callback, disable, noise_sampler,
        tree=tree, seed=seed, path=path, row_args=row_args, shared_args=shared_args,
        options={"coupling": coupling, "draft": draft, **options},
    )  # fmt: skip


def sample_dpmpp_3m_sde(
    model: Callable[..., torch.Tensor],
    x: torch.Tensor,
    sigmas: torch.Tensor,
    extra_args: Optional[dict] = None,
    callback: Optional[Callable[[dict], None]] = None,
    disable: Optional[bool] = None,
    eta: float = 1.0,
    s_noise: float = 1.0,
    noise_sampler: Optional[Callable] = None,
    *,
    tree: Any = None,
    coupling: Any = "grs",
    draft: Any = "velocity",
    seed: Optional[int] = None,
    row_args: Sequence[str] = (),
    shared_args: Sequence[str] = (),
    path: str = "ve",
    **options: Any,
) -> torch.Tensor:
    """k-diffusion's ``sample_dpmpp_3m_sde`` (DPM-Solver++(3M) SDE), exactly; with a ``tree`` and ``eta > 0``,
    speculated in law (:class:`~specforest.chains.DPMPP3MSDE`, a chain of history 2: the engine carries each
    node's two previous predictions). ``path="linear"`` for ComfyUI's ``CONST`` models (its
    ``sample_dpmpp_3m_sde`` in half-log-SNR ``lambda = log((1 - sigma) / sigma)``: the same chain on the
    linear path), with a first level below 1 (ComfyUI moves a first level of 1 to its model's
    ``percent_to_sigma(1e-4)``: pass that level).

    Randomness as :func:`sample_dpmpp_2m_sde` (k-diffusion's default Brownian-tree noise is i.i.d. over its
    disjoint steps). ``eta = 0`` (DPM++ 3M) runs with ``tree=None`` and is refused with a tree.
    """
    from ..chains import DPMPP3MSDE

    _snr_start("sample_dpmpp_3m_sde", sigmas, path)
    chain = DPMPP3MSDE(eta=eta, s_noise=s_noise)
    return _drop_in(
        chain, model, x, sigmas, extra_args, callback, disable, noise_sampler,
        tree=tree, seed=seed, path=path, row_args=row_args, shared_args=shared_args,
        options={"coupling": coupling, "draft": draft, **options},
    )  # fmt: skip


def _dpmpp_sde_noise(
    chain: Any, x: torch.Tensor, sigmas: torch.Tensor, noise_sampler: Optional[Callable]
) -> Callable[[int], torch.Tensor]:
    """The half-step chain's noise (:class:`~specforest.chains.DPMPPSDE`) from k-diffusion's two draws a step,
    made in its order: half-step ``2 i`` takes ``n_1 = noise_sampler(sigma_fn(t), sigma_fn(s))``, half-step
    ``2 i + 1`` the part of ``n_2 = noise_sampler(sigma_fn(t), sigma_fn(t_next))`` that ``n_1`` does not give,
    ``z = (n_2 - rho n_1) / sqrt(1 - rho^2)``, so the chain's end draws exactly ``n_2`` whatever the sampler's pair;
    the step into 0 draws nothing. The levels passed are k-diffusion's own (``sigma_fn(t_fn(sigma))``, in
    ``sigmas``' dtype), or with ``path="linear"`` ComfyUI's for a ``CONST`` model (``sigmas[i]`` and
    ``sigma_fn(lambda_s_1)``, ``sigmas[i + 1]``). Without a noise sampler each half-step draws
    ``torch.randn_like(x)`` (the pair then has the Brownian tree's law)."""
    s = sigmas.detach().to("cpu", torch.float64)
    N = s.numel() - 1
    linear = chain.path == "linear"
    mid = chain.linear_midpoints(s[:-2], s[1:-1]) if linear else chain.midpoints(s[:-2], s[1:-1])
    rho = chain.noise_correlation(s[:-2], mid, s[1:-1]).tolist()
    first: list = [None]

    def noise(n: int) -> torch.Tensor:
        i = n // 2
        if n == 2 * N - 2:
            return torch.zeros_like(x)
        if noise_sampler is None:
            return torch.randn_like(x)
        if linear:
            # ComfyUI's lambda = -logit(sigma), lambda_s_1 = lambda_s + r h, sigma_s_1 = sigmoid(-lambda_s_1)
            lam, lam_next = sigmas[i].logit().neg(), sigmas[i + 1].logit().neg()
            level, level_mid, level_next = sigmas[i], (lam + chain.r * (lam_next - lam)).neg().sigmoid(), sigmas[i + 1]
        else:
            # k-diffusion's t = -log sigma, s = t + r h: the levels its noise sampler is given
            t, t_next = sigmas[i].log().neg(), sigmas[i + 1].log().neg()
            level, level_mid, level_next = t.neg().exp(), (t + (t_next - t) * chain.r).neg().exp(), t_next.neg().exp()
        if n % 2 == 0:
            first[0] = noise_sampler(level, level_mid)
            return first[0]
        n2 = noise_sampler(level, level_next)
        return (n2 - rho[i] * first[0]) / math.sqrt(1.0 - rho[i] ** 2)

    return noise


def sample_dpmpp_sde(
    model: Callable[..., torch.Tensor],
    x: torch.Tensor,
    sigmas: torch.Tensor,
    extra_args: Optional[dict] = None,
    callback: Optional[Callable[[dict], None]] = None,
    disable: Optional[bool] = None,
    eta: float = 1.0,
    s_noise: float = 1.0,
    noise_sampler: Optional[Callable] = None,
    r: float = 1 / 2,
    *,
    tree: Any = None,
    coupling: Any = "grs",
    draft: Any = "velocity",
    seed: Optional[int] = None,
    row_args: Sequence[str] = (),
    shared_args: Sequence[str] = (),
    path: str = "ve",
    **options: Any,
) -> torch.Tensor:
    """k-diffusion's ``sample_dpmpp_sde`` (DPM-Solver++ SDE, A1111's "DPM++ SDE"), exactly; with a ``tree`` and
    ``eta > 0``, speculated in law (:class:`~specforest.chains.DPMPPSDE`, a chain of half-steps: a step's two
    correlated noises become the midpoint's draw and the end's draw given it). Two model calls a step, one
    into 0 (``2 N - 1``, as the real function).

    Randomness as :func:`sample_euler_ancestral`, with the pair of draws a step: a ``noise_sampler`` (``tree=None``)
    is called as k-diffusion calls it, twice a step (over ``[sigma_s, sigma]``, then ``[sigma', sigma]``), and the
    output is the real function's for any pair it returns. k-diffusion's default noise is a Brownian tree over
    ``[sigma_min, sigma_max]``, whose two draws a step have correlation ``rho = sqrt((sigma - sigma_s) / (sigma -
    sigma'))``; without a ``noise_sampler`` (or with a tree) the run draws pairs of that law (``docs/chains.md``).
    ``r`` in ``(0, 1)`` (k-diffusion's default 1/2). ``eta = 0`` runs with ``tree=None`` and is refused with a tree.

    With ``path="linear"`` (ComfyUI's ``CONST`` models: SD3, Flux) it is ComfyUI's ``sample_dpmpp_sde``, which
    works in half-log-SNR for them and queries its Brownian tree at the linear levels (``rho = sqrt((t - t_s) / (t -
    t'))``); the noise sampler is called at those levels. A first level of 1 is refused: ComfyUI moves it to its
    model's ``model_sampling.percent_to_sigma(1e-4)``; pass that level (the ComfyUI integration does).
    """
    from ..chains import DPMPPSDE

    chain = DPMPPSDE(eta=eta, s_noise=s_noise, r=r, path=path)
    linear_grid(sigmas, path)  # refuse a bad schedule by name before the noise reads it
    noise = _dpmpp_sde_noise(chain, x, sigmas, noise_sampler) if tree is None else None
    return _drop_in(
        chain, model, x, sigmas, extra_args, callback, disable, noise_sampler,
        tree=tree, seed=seed, path=path, row_args=row_args, shared_args=shared_args,
        options={"coupling": coupling, "draft": draft, **options}, noise=noise,
    )  # fmt: skip
