"""k-diffusion's own ``sampling.py``, imported unchanged from the registry's ``k-diffusion`` wheel.

The package's ``__init__`` imports every submodule, and ``utils`` imports torchvision, which does not
import beside the pinned CPU torch. So the package is replaced by an empty one pointing at the
installed files, torchvision is stubbed in ``sys.modules`` while ``sampling`` (and the ``utils`` it
imports) load, and both are then restored: the functions tested are k-diffusion's, byte for byte.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path

_STUBS = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
_cache: dict = {}


def sampling() -> types.ModuleType:
    """k-diffusion's ``k_diffusion.sampling`` module (loaded once)."""
    if "sampling" in _cache:
        return _cache["sampling"]
    root = Path(str(importlib.metadata.distribution("k-diffusion").locate_file("k_diffusion")))
    saved = {name: sys.modules.get(name) for name in (*_STUBS, "k_diffusion", "k_diffusion.utils")}
    stubs = {name: types.ModuleType(name) for name in _STUBS}
    stubs["torchvision"].transforms = stubs["torchvision.transforms"]
    stubs["torchvision.transforms"].functional = stubs["torchvision.transforms.functional"]
    pkg = types.ModuleType("k_diffusion")
    pkg.__path__ = [str(root)]
    sys.modules.update(stubs)
    sys.modules["k_diffusion"] = pkg
    try:
        spec = importlib.util.spec_from_file_location("k_diffusion.sampling", root / "sampling.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["k_diffusion.sampling"] = module
        spec.loader.exec_module(module)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
        sys.modules.pop("k_diffusion.sampling", None)
    _cache["sampling"] = module
    return module
