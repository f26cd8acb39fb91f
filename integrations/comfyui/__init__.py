"""specforest's exact speculative samplers as a ComfyUI custom node package.

Copy or link this folder into ``ComfyUI/custom_nodes/`` (with ``specforest`` installed in ComfyUI's
Python). On import it adds ``specforest_<name>`` to ComfyUI's sampler list for every sampler ComfyUI
has whose chain specforest registers (``samplers.available``), each with ComfyUI's options and the
default tree, and offers the node ``SamplerSpecforest`` (a ``SAMPLER`` for ``SamplerCustom``) with the
tree, coupling and draft as inputs. ``docs/comfyui.md`` in specforest's repository says what is
supported and what is refused.
"""

from __future__ import annotations

import comfy.samplers
from comfy.k_diffusion import sampling as k_sampling

from specforest.couplings import available_couplings
from specforest.drafts.base import DRAFT_KINDS

from .samplers import DEFAULT_TREE, PREFIX, available, make_tree, options_of, register

SAMPLERS = register(comfy.samplers, k_sampling)
"""The names added to ComfyUI's sampler list."""

_CHAIN_OPTIONS = {
    "eta": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 100.0, "step": 0.01, "round": False}),
    "s_noise": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 100.0, "step": 0.01, "round": False}),
    "s_churn": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 100.0, "step": 0.01, "round": False}),
}


class SamplerSpecforest:
    """A ``SAMPLER`` for ``SamplerCustom``: one of specforest's samplers with the tree, coupling and draft
    chosen. ``eta``, ``s_noise`` and ``s_churn`` go to the samplers that take them (ComfyUI's options of
    the same names); the defaults are ComfyUI's, and the tree's :data:`samplers.DEFAULT_TREE`."""

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        names = [PREFIX + n for n in available(list(comfy.samplers.KSAMPLER_NAMES)) if PREFIX + n in SAMPLERS]
        return {
            "required": {
                "sampler_name": (names,),
                "tree": (["chain", "uniform", "none"], {"default": "chain"}),
                "depth": ("INT", {"default": DEFAULT_TREE["tree"].L, "min": 1, "max": 64}),
                "width": ("INT", {"default": 2, "min": 1, "max": 8}),
                "coupling": (available_couplings(), {"default": DEFAULT_TREE["coupling"]}),
                "draft": (list(DRAFT_KINDS), {"default": DEFAULT_TREE["draft"]}),
                **_CHAIN_OPTIONS,
            }
        }

    RETURN_TYPES = ("SAMPLER",)
    FUNCTION = "get_sampler"
    CATEGORY = "sampling/custom_sampling/samplers"

    def get_sampler(
        self,
        sampler_name: str,
        tree: str,
        depth: int,
        width: int,
        coupling: str,
        draft: str,
        eta: float = 1.0,
        s_noise: float = 1.0,
        s_churn: float = 0.0,
    ) -> tuple:
        """The ``KSAMPLER`` of ``sampler_name`` with these options.

        Raises:
            ValueError: naming ``sampler_name`` or ``tree``.
        """
        if sampler_name not in SAMPLERS:
            raise ValueError(f"sampler_name must be one of {SAMPLERS}, got {sampler_name!r}")
        comfy_name = sampler_name[len(PREFIX) :]
        taken = options_of(comfy_name, available([comfy_name])[comfy_name])
        chain_options = {k: v for k, v in {"eta": eta, "s_noise": s_noise, "s_churn": s_churn}.items() if k in taken}
        options = {"tree": make_tree(tree, depth, width), "coupling": coupling, "draft": draft, **chain_options}
        return (comfy.samplers.ksampler(sampler_name, options),)


NODE_CLASS_MAPPINGS = {"SamplerSpecforest": SamplerSpecforest}
NODE_DISPLAY_NAME_MAPPINGS = {"SamplerSpecforest": "SamplerSpecforest (exact speculative)"}
