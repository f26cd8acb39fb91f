"""specforest's samplers in ComfyUI's sampler list, and the node that makes one with a tree.

Which samplers: every sampler of this ComfyUI (``comfy.samplers.KSAMPLER_NAMES``) whose chain is
registered in :func:`specforest.chains.available_chains`. A ComfyUI sampler's chain is the chain of the
same name, unless :data:`COMFY_CHAINS` names another (ComfyUI's ``_gpu`` forms) or none. A chain
registered later (``dpmpp_3m_sde``, say) appears without an edit here. Each is run by its drop-in
``specforest.kdiffusion.sample_<chain>``, whose signature is ComfyUI's function's, so it takes the same
options; a chain without a drop-in is run by :func:`specforest.kdiffusion.sample` with ComfyUI's
options as the chain's parameters.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Optional

import torch

from specforest import chains, kdiffusion, trees
from specforest.options import NoStochasticStep

from .speculative_call import ROWS, SpeculativeCall

PREFIX = "specforest_"

COMFY_CHAINS: "dict[str, str | None]" = {
    "dpmpp_2m_sde_gpu": "dpmpp_2m_sde",
    "dpmpp_3m_sde_gpu": "dpmpp_3m_sde",
    "dpmpp_sde_gpu": "dpmpp_sde",
    "ddim": None,
}
"""ComfyUI's sampler names whose chain is not the chain of the same name: the ``_gpu`` forms (they differ
from theirs only in where ComfyUI draws its Brownian tree's noise; specforest draws keyed normals), and
``None`` for a name that is another sampler than specforest's chain of that name (ComfyUI's ``ddim`` is
Euler with DDIM's inpainting noise, not DDIM with ``eta``)."""

SNR_OFFSET = ("dpmpp_sde", "dpmpp_2m_sde", "dpmpp_3m_sde")
"""The chains whose ComfyUI function moves a ``CONST`` model's first level of 1 (where its half-log-SNR is
infinite) to ``model_sampling.percent_to_sigma(1e-4)`` (``offset_first_sigma_for_snr``): ``sample_dpmpp_sde``,
``sample_dpmpp_2m_sde`` and ``sample_dpmpp_3m_sde`` (their ``_gpu`` forms call them) of ComfyUI 02159d8; its
``sample_er_sde``, ``sample_seeds_2``, ``sample_seeds_3`` and ``sample_sa_solver`` do too, whose chains specforest
does not register. specforest refuses a first level of 1 for these on the linear path, so the sampler list hands
them the level ComfyUI samples from."""

NOISE_SCALE = ("dpmpp_sde", "dpmpp_2m_sde", "dpmpp_3m_sde")
"""The chains whose ComfyUI function multiplies ``s_noise`` by the model's ``model_sampling.noise_scale`` (1 where a
model has none) on every model (ComfyUI 02159d8's ``sample_dpmpp_sde``, ``sample_dpmpp_2m_sde``, ``sample_dpmpp_3m_sde``)."""

NOISE_SCALE_CONST = ("euler_ancestral", "dpm_2_ancestral", "dpmpp_2s_ancestral")
"""The chains whose ComfyUI function multiplies ``s_noise`` by ``model_sampling.noise_scale`` on a ``CONST`` model
only: the ``_RF`` forms it runs for them there (its ``sample_euler_ancestral`` and the others on EPS models do not)."""

DEFAULT_TREE = {"tree": trees.chain(8), "coupling": "rmc", "draft": "x0"}
"""The tree the sampler list's entries use: ``tune``'s pick for one image at a time (an RMC chain of 8
to 20 states with the x0 draft, docs/latency.md), at its cheapest size."""

_SPECULATION = ("tree", "coupling", "draft")


def model_sampling(model: Any) -> Any:
    """The ComfyUI model's ``model_sampling``, found through the ``inner_model`` chain ComfyUI hands a sampler.

    Raises:
        TypeError: if no ``model_sampling`` is reachable.
    """
    inner = model
    for _ in range(8):
        sampling = getattr(inner, "model_sampling", None)
        if sampling is not None:
            return sampling
        inner = getattr(inner, "inner_model", None)
        if inner is None:
            break
    raise TypeError(f"model must be ComfyUI's model (with a model_sampling), got {type(model).__name__}")


def model_path(model: Any) -> str:
    """``"linear"`` for a ``CONST`` model (SD3, Flux: ``x = (1 - sigma) x0 + sigma noise``), ``"ve"`` for
    EPS and V_PREDICTION models, read from the ComfyUI model's ``model_sampling`` (:func:`model_sampling`).

    Raises:
        TypeError: if no ``model_sampling`` is reachable.
    """
    const = next((c for c in type(model_sampling(model)).__mro__ if c.__name__ == "CONST"), None)
    return "linear" if const is not None else "ve"


def first_level(model: Any, chain: str, sigmas: torch.Tensor, path: str) -> torch.Tensor:
    """``sigmas (T + 1,)`` as ComfyUI's function of ``chain`` samples them: for a chain of :data:`SNR_OFFSET` on a
    ``CONST`` model (``path="linear"``) a first level ``>= 1`` becomes ``model_sampling.percent_to_sigma(1e-4)``."""
    if path != "linear" or chain not in SNR_OFFSET or sigmas.shape[0] < 2 or float(sigmas[0]) < 1.0:
        return sigmas
    sigmas = sigmas.clone()
    sigmas[0] = model_sampling(model).percent_to_sigma(1e-4)
    return sigmas


def noise_scaled(model: Any, chain: str, path: str, options: dict) -> dict:
    """``options`` with ``s_noise`` times the model's ``model_sampling.noise_scale`` where ComfyUI's function of ``chain``
    takes it (:data:`NOISE_SCALE`, :data:`NOISE_SCALE_CONST` on a ``CONST`` model, ``path="linear"``), as it is."""
    scale = getattr(model_sampling(model), "noise_scale", 1.0)
    if scale == 1.0 or not (chain in NOISE_SCALE or (path == "linear" and chain in NOISE_SCALE_CONST)):
        return options
    return {**options, "s_noise": options.get("s_noise", 1.0) * scale}


def available(comfy_names: "list[str]") -> dict:
    """ComfyUI's sampler name -> chain name, for each of ``comfy_names`` whose chain is registered now."""
    registered = {c.lower() for c in chains.available_chains()}
    out = {}
    for name in comfy_names:
        chain = COMFY_CHAINS.get(name, name)
        if not name.startswith(PREFIX) and chain is not None and chain.lower() in registered:
            out[name] = chain
    return out


def _chain_function(chain: str) -> Callable[..., torch.Tensor]:
    """The drop-in of ``chain``, or :func:`specforest.kdiffusion.sample` with ComfyUI's options as its parameters."""
    drop_in = getattr(kdiffusion, f"sample_{chain}", None)
    if drop_in is not None:
        return drop_in

    def run(
        model: Callable[..., torch.Tensor],
        x: torch.Tensor,
        sigmas: torch.Tensor,
        extra_args: Optional[dict] = None,
        callback: Optional[Callable[[dict], None]] = None,
        disable: Optional[bool] = None,
        noise_sampler: Optional[Callable] = None,
        **options: Any,
    ) -> torch.Tensor:
        if noise_sampler is not None and options.get("tree") is not None:
            raise ValueError("noise_sampler was given with a tree: a speculative run draws keyed noise from its seed")
        fields = set(chains.get_chain(chain).params)
        # ComfyUI's options that are the chain's parameters (a chain's path is also the run's)
        params = {k: options[k] for k in fields if k in options}
        options = {k: v for k, v in options.items() if k not in fields or k == "path"}
        return kdiffusion.sample(
            model, x, sigmas, extra_args, callback, disable, chain=chains.get_chain(chain, **params), **options
        ).samples

    return run


def sampler_function(comfy_name: str, chain: str) -> Callable[..., torch.Tensor]:
    """ComfyUI's sampler function of ``comfy_name`` (``sampler_function(model, x, sigmas, extra_args,
    callback, disable, **options)``, as ``comfy.samplers.KSAMPLER`` calls it), run by specforest.

    ``options`` are ComfyUI's options of that sampler (``eta``, ``s_noise``, ``solver_type``,
    ``noise_sampler``, ...) and ``tree``, ``coupling``, ``draft`` (default :data:`DEFAULT_TREE`) and
    the other options of :func:`specforest.sample`. The path is read from the model, the seed from
    ``extra_args["seed"]``, the first level and ``s_noise`` are those ComfyUI's function samples with
    (:func:`first_level`, :func:`noise_scaled`); ComfyUI's callback (its progress bar and preview) gets each round's
    ``i``, ``denoised`` and ``x``, and then the sample at step ``T - 1`` if the last round reported an
    earlier step. A setting without a stochastic step (ComfyUI's ``euler`` at its
    default ``s_churn = 0``) runs as the standard sampler, which it then is.
    """
    run = _chain_function(chain)

    def sample(
        model: Any,
        x: torch.Tensor,
        sigmas: torch.Tensor,
        extra_args: Optional[dict] = None,
        callback: Optional[Callable[[dict], None]] = None,
        disable: Optional[bool] = None,
        **options: Any,
    ) -> torch.Tensor:
        extra = dict(extra_args or {})
        for key in _SPECULATION:
            options.setdefault(key, DEFAULT_TREE[key])
        call = SpeculativeCall(model, extra, x.shape[0], speculative=options["tree"] is not None)
        rows = {ROWS: torch.arange(x.shape[0], device=x.device)}
        seed = extra.get("seed")
        path = model_path(model)
        sigmas = first_level(model, chain, sigmas, path)
        kwargs = dict(row_args=(ROWS,), path=path, seed=seed, **noise_scaled(model, chain, path, options))
        last = [-1]

        def report(info: dict) -> None:
            last[0] = info["i"]
            callback(info)

        hook = None if callback is None else report
        try:
            out = run(call, x, sigmas, rows, hook, disable, **kwargs)
        except NoStochasticStep:
            if options["tree"] is None:
                raise
            logging.warning(f"{PREFIX}{comfy_name}: this setting has no stochastic step; ran the standard sampler")
            out = run(call, x, sigmas, rows, hook, disable, **{**kwargs, "tree": None})
        T = sigmas.shape[0] - 1
        if callback is not None and last[0] < T - 1:
            # a round that accepts the last steps reports only its start: ComfyUI's progress bar and
            # preview end where the standard sampler's last report (step T - 1, whose prediction is the
            # sample) leaves them
            callback({"x": out, "i": T - 1, "sigma": sigmas[T - 1], "sigma_hat": sigmas[T - 1], "denoised": out})
        return out

    sample.__name__ = f"sample_{PREFIX}{comfy_name}"
    sample.__qualname__ = sample.__name__
    return sample


def options_of(comfy_name: str, chain: str) -> list:
    """The options ComfyUI's own function of ``comfy_name`` takes, in order (its parameters after
    ``disable``), read from the specforest function that replaces it."""
    fn = _chain_function(chain)
    params = list(inspect.signature(fn).parameters.values())
    skip = {"model", "x", "sigmas", "extra_args", "callback", "disable"}
    return [p.name for p in params if p.name not in skip and p.kind is p.POSITIONAL_OR_KEYWORD]


def register(samplers_module: Any, k_sampling: Any) -> list:
    """Put ``specforest_<name>`` for each sampler of :func:`available` in ComfyUI's sampler list, the way custom
    samplers are added: the function as ``comfy.k_diffusion.sampling.sample_<name>`` (where
    ``comfy.samplers.ksampler`` looks it up) and the name in ``KSAMPLER_NAMES`` and ``SAMPLER_NAMES``
    (the list the ``KSampler`` node and ``KSamplerSelect`` offer, ``KSampler.SAMPLERS``). Where the ``KSampler`` node
    makes its schedule for ``<name>`` one step longer and drops the next-to-last level
    (``KSampler.DISCARD_PENULTIMATE_SIGMA_SAMPLERS``: ``dpm_2``, ``dpm_2_ancestral``), it does so for
    ``specforest_<name>`` too, so the two sample the same levels.

    Returns:
        The names added (those already there are kept as they are).
    """
    added = []
    discard = getattr(getattr(samplers_module, "KSampler", None), "DISCARD_PENULTIMATE_SIGMA_SAMPLERS", None)
    for comfy_name, chain in available(list(samplers_module.KSAMPLER_NAMES)).items():
        name = PREFIX + comfy_name
        setattr(k_sampling, f"sample_{name}", sampler_function(comfy_name, chain))
        for names in (samplers_module.KSAMPLER_NAMES, samplers_module.SAMPLER_NAMES):
            if name not in names:
                names.append(name)
        if discard is not None and comfy_name in discard:
            discard.add(name)
        added.append(name)
    return added


def make_tree(shape: str, depth: int, width: int) -> Optional[trees.DraftTree]:
    """The tree of :class:`SamplerSpecforest`'s inputs: ``chain`` (``depth`` states, for RMC),
    ``uniform`` (``width`` children per node, ``depth`` levels, for GRS) or ``none`` (the standard sampler).

    Raises:
        ValueError: naming ``tree`` and its choices.
    """
    if shape == "none":
        return None
    if shape == "chain":
        return trees.chain(depth)
    if shape == "uniform":
        return trees.uniform(width, depth)
    raise ValueError(f"tree must be one of chain, uniform, none; got {shape!r}")
