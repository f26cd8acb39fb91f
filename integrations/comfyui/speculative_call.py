"""ComfyUI's guided model as a denoiser whose every row is its own trajectory's, at its own noise level.

A speculative call evaluates tree nodes of several trajectories at several noise levels in one batch.
ComfyUI's model code was written for calls of one level and one row per latent: this module reads
what ComfyUI hands a sampler (``extra_args``: ``cond``, ``uncond``, ``cond_scale``, ``model_options``,
``seed``, ``denoise_mask``) and, before the first call, makes each feature that would change the
model in such a call per row or refuses it by name:

* per row: a conditioning batch with one entry per latent (each row gets its own trajectory's entry);
  conditioning timestep ranges (``ConditioningSetTimestepRange``'s ``start``/``end``) and ControlNet
  start/end percent (``ControlNetApplyAdvanced``): ComfyUI compares the call's first level with the
  range, so the rows are split into calls whose rows agree on which ranges hold (usually one, at most
  one more call per range boundary inside a round); inpainting (``denoise_mask``): the mask blends
  each row at its own level with its own trajectory's latent and noise, as ``KSamplerX0Inpaint`` does
  for one level;
* refused, naming the node: model patches that receive the call's levels and may read one of them
  (``model_function_wrapper``: step caches such as DeepCache; ``sampler_cfg_function``,
  ``sampler_post_cfg_function``: RescaleCFG, SAG, ...; transformer patches: FreeU, attention
  replacements, ...; ``denoise_mask_function``), and a ControlNet hint batch of several images.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

ROWS = "specforest_rows"
"""The ``extra_args`` name under which each call receives its rows' trajectory indices ``(M,)``."""

_REFUSED_OPTIONS = {
    "model_function_wrapper": "a model wrapper (a step cache such as DeepCache, or another node that wraps the "
    "UNet call)",
    "sampler_cfg_function": "a CFG function (RescaleCFG, a custom guidance node)",
    "sampler_post_cfg_function": "a post-CFG function (Self-Attention Guidance, ...)",
    "denoise_mask_function": "a denoise-mask function (differential diffusion)",
}


def _node(fn: Any) -> str:
    """The callable's qualified name: ComfyUI's patch functions are closures of their node's method
    (``FreeU.patch.<locals>.output_block_patch``), so this names the node."""
    owner = getattr(fn, "__self__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{type(owner).__qualname__}.{name}" if owner is not None and "." not in name else name


def check_model_options(model_options: dict) -> None:
    """Refuse the model patches that receive a call's levels, naming the node.

    Raises:
        ValueError: naming the ``model_options`` key and the patch's function (its node).
    """
    why = (
        "it receives the call's noise levels, and a speculative call mixes levels across rows: a patch that "
        "reads one of them (sigma[0]) would silently change the model for the other rows. Remove the node "
        "from the workflow, or use ComfyUI's own sampler"
    )
    for key, what in _REFUSED_OPTIONS.items():
        fns = model_options.get(key)
        if fns is None or (isinstance(fns, (list, tuple)) and not fns):
            continue
        names = ", ".join(_node(f) for f in (fns if isinstance(fns, (list, tuple)) else [fns]))
        raise ValueError(f"specforest refuses model_options[{key!r}] ({what}: {names}): {why}")
    transformer = model_options.get("transformer_options", {})
    for key in ("patches", "patches_replace"):
        patches = transformer.get(key) or {}
        found = []
        for place, entry in patches.items():
            fns = entry.values() if isinstance(entry, dict) else entry
            found += [f"{place}: {_node(f)}" for f in fns]
        if found:
            raise ValueError(
                f"specforest refuses transformer_options[{key!r}] ({'; '.join(found)}; FreeU, attention patches, "
                f"IPAdapter-style replacements): {why}"
            )


def _controls(entry: dict) -> list:
    """The ControlNets of one conditioning entry, the chain ``previous_controlnet`` included."""
    out, control = [], entry.get("control")
    while control is not None:
        out.append(control)
        control = getattr(control, "previous_controlnet", None)
    return out


def _by_row(obj: Any, rows: torch.Tensor) -> Any:
    """A conditioning value with one entry per row: ``value[rows % n]`` where it holds ``n > 1`` entries
    (ComfyUI repeats a batch of ``n`` to the latents, latent ``i`` taking entry ``i % n``)."""
    cond = getattr(obj, "cond", None)
    if not isinstance(cond, torch.Tensor) or cond.ndim == 0 or cond.shape[0] == 1:
        return obj
    return obj._copy_with(cond[rows.to(cond.device) % cond.shape[0]])


class SpeculativeCall:
    """ComfyUI's guided model (``KSamplerX0Inpaint`` as ``KSAMPLER`` hands it to a sampler) as a
    k-diffusion denoiser ``D(x (M, C, H, W), sigma (M,), specforest_rows (M,))`` with one trajectory and
    one level per row.

    Args:
        model: ``KSamplerX0Inpaint`` (its ``inner_model`` the CFG predictor, with ``noise`` and
            ``latent_image`` of the latent batch).
        extra_args: what ComfyUI hands the sampler.
        batch: the latent batch.
        speculative: whether calls will mix levels (a tree); without one every call has one level, as
            ComfyUI's own, and nothing is refused.

    Raises:
        ValueError: with ``speculative``, a feature that a speculative call would change, refused naming its node.
    """

    def __init__(self, model: Any, extra_args: dict, batch: int, speculative: bool = True) -> None:
        self.model, self.batch = model, batch
        self.cond = list(extra_args.get("cond") or [])
        self.uncond = list(extra_args.get("uncond") or [])
        self.cond_scale = extra_args.get("cond_scale", 1.0)
        self.model_options = extra_args.get("model_options") or {}
        self.seed = extra_args.get("seed")
        self.mask = extra_args.get("denoise_mask")
        if speculative:
            check_model_options(self.model_options)
        self.ranges = []  # (high, low): a conditioning entry or ControlNet holds where low <= sigma <= high
        for entry in self.cond + self.uncond:
            if "timestep_start" in entry or "timestep_end" in entry:
                self.ranges.append((entry.get("timestep_start"), entry.get("timestep_end")))
            for control in _controls(entry):
                hint = getattr(control, "cond_hint_original", None)
                if speculative and isinstance(hint, torch.Tensor) and hint.shape[0] > 1:
                    raise ValueError(
                        f"specforest refuses a ControlNet ({type(control).__name__}) with a batch of "
                        f"{hint.shape[0]} hint images: ComfyUI spreads the hints over a call's rows, which in a "
                        "speculative call are tree nodes of several latents; give one hint image"
                    )
                if getattr(control, "timestep_range", None) is not None:
                    self.ranges.append(control.timestep_range)
        self.ranges = list(dict.fromkeys(self.ranges))

    def _groups(self, sigma: torch.Tensor) -> list:
        """Row indices grouped so that every range holds for all or none of a group's rows, as
        ComfyUI's test of the call's first level (``timestep[0] > start`` or ``< end``) decides."""
        if not self.ranges:
            return [torch.arange(sigma.shape[0], device=sigma.device)]
        keys = torch.zeros(sigma.shape[0], dtype=torch.long, device=sigma.device)
        for bit, (high, low) in enumerate(self.ranges):
            on = torch.ones_like(keys, dtype=torch.bool)
            if high is not None:
                on &= ~(sigma > high)
            if low is not None:
                on &= ~(sigma < low)
            keys |= on.long() << bit
        return [(keys == k).nonzero()[:, 0] for k in torch.unique(keys)]

    def _conds(self, entries: list, rows: torch.Tensor) -> list:
        out = []
        for entry in entries:
            entry = dict(entry)
            entry["model_conds"] = {k: _by_row(v, rows) for k, v in entry["model_conds"].items()}
            mask = entry.get("mask")
            if isinstance(mask, torch.Tensor) and mask.ndim == 3 and mask.shape[0] > 1:
                entry["mask"] = mask[rows.to(mask.device) % mask.shape[0]]
            out.append(entry)
        return out

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **rows: torch.Tensor) -> torch.Tensor:
        """The guided denoised ``(M, C, H, W)`` of each row at its own level, for its own trajectory."""
        traj = rows[ROWS].long()
        out = torch.empty_like(x)
        for idx in self._groups(sigma):
            out[idx] = self._call(x[idx], sigma[idx], traj[idx.to(traj.device)])
        return out

    def _call(self, x: torch.Tensor, sigma: torch.Tensor, traj: torch.Tensor) -> torch.Tensor:
        guided = self.model.inner_model
        mask: Optional[torch.Tensor] = None
        if self.mask is not None:
            # KSamplerX0Inpaint's blend, with each row's own trajectory's latent and noise at its own level
            mask = self.mask[traj.to(self.mask.device) % self.mask.shape[0]]
            latent = self.model.latent_image[traj.to(x.device) % self.model.latent_image.shape[0]]
            noise = self.model.noise[traj.to(x.device) % self.model.noise.shape[0]]
            level = sigma.reshape((-1,) + (1,) * (x.ndim - 1))
            x = x * mask + guided.inner_model.model_sampling.noise_scaling(level, noise, latent) * (1.0 - mask)
        out = guided(
            x,
            sigma,
            cond=self._conds(self.cond, traj),
            uncond=self._conds(self.uncond, traj),
            cond_scale=self.cond_scale,
            model_options=self.model_options,
            seed=self.seed,
        )
        if mask is not None:
            out = out * mask + latent * (1.0 - mask)
        return out
