"""The shipped natural-image models: unconditional EDM denoisers of ``3 x 32 x 32`` and ``3 x 64 x 64``
crops of photographs.

Two models, named by :data:`MODELS`:

* ``natural32``: ``3 x 32 x 32`` (``d = 3072``);
* ``natural64``: ``3 x 64 x 64`` (``d = 12288``).

Data: the photographs scikit-image ships inside its wheel (``skimage.data``, no download), scaled
to ``[-1, 1]`` as ``x / 127.5 - 1``. Colour: astronaut, coffee, chelsea, rocket, motorcycle (the
left image of ``stereo_motorcycle``), hubble_deep_field, retina, immunohistochemistry. Grey:
brick, grass, gravel, camera, coins, moon, replicated to three equal channels (so the model's law
holds grey images beside colour ones: the grey textures are a third of the photographs the issue
names, and dropping them would leave six colour pictures to learn from). Two images are held out
of training for evaluation (:data:`HELD_OUT`: chelsea, one colour photograph, and gravel, one grey
texture); the others train. Each image is kept at a pyramid of scales (factors ``2^{-k/2}`` down
to the smallest whose shorter side is at least ``1.5`` crops), so a crop is sometimes a texture
patch at full resolution and sometimes most of a downscaled picture (:func:`load_images`,
:func:`random_crops`).

The networks are :class:`~specforest.models.unet.UNet` s (three resolutions, no class labels)
wrapped in EDM's preconditioning (:class:`~specforest.models.unet.EDMPrecond`), trained by
``specforest train natural32`` / ``natural64`` (:mod:`specforest.experiments.train_natural`).
Their weights ship as safetensors files beside the digits model's, with their SHA-256 in the same
``weights/manifest.json``; the loaders check the digest before reading a tensor
(:func:`specforest.models.digits.read_safetensors`).

* :func:`load_denoiser` -- ``D(x: (M, 3, H, W), sigma: (M,)) -> (M, 3, H, W)`` on VE noise levels
  ``x = x_0 + sigma n``: what the k-diffusion drop-ins (:mod:`specforest.kdiffusion`) take;
* :func:`load_velocity` -- the same as a linear-path velocity for :func:`specforest.sample`;
* :func:`load_draft_denoiser` -- a model's learned draft: a narrower U-Net
  (:attr:`NaturalModel.draft_unet`) distilled from the target by ``specforest train NAME-draft``
  (:mod:`specforest.experiments.train_natural_draft`), which the shipped target declares for
  ``draft="learned"`` (:class:`specforest.drafts.LearnedDraft`).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from .digits import (
    MANIFEST,
    ROW_BYTES_FLOAT32,
    WEIGHTS_DIR,
    PathLike,
    WeightsFileError,
    manifest,
    read_safetensors,
    resolve_weights,
)
from .edm import EDMDenoiserVelocity
from .unet import EDMPrecond, UNet, UNetConfig

__all__ = [
    "COLOUR_IMAGES",
    "GREY_IMAGES",
    "HELD_OUT",
    "MODELS",
    "NaturalModel",
    "activation_numel",
    "check_name",
    "load_denoiser",
    "load_draft_denoiser",
    "load_images",
    "load_velocity",
    "random_crops",
    "weights_path",
]

COLOUR_IMAGES = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "motorcycle",
    "hubble_deep_field",
    "retina",
    "immunohistochemistry",
)
"""The colour photographs of ``skimage.data`` the models learn from (``motorcycle``: the left image
of ``stereo_motorcycle``)."""
GREY_IMAGES = ("brick", "grass", "gravel", "camera", "coins", "moon")
"""The grey photographs, replicated to three channels."""
HELD_OUT = ("chelsea", "gravel")
"""Images never trained on: the held-out crops of the evaluation come from them."""


@dataclass(frozen=True)
class NaturalModel:
    """One shipped natural-image model.

    Attributes:
        name: ``"natural32"`` or ``"natural64"``.
        file: its weights file in the weights folder.
        unet: the network's architecture (what training builds; the shipped file records its own).
        steps: optimizer steps of the shipped run (``specforest train NAME``'s default).
        batch: crops per step of the shipped run.
        draft_file: its learned draft's weights file (``specforest train NAME-draft``).
        draft_unet: the draft's architecture: the target's, narrower
            (:func:`specforest.models.digits.multiply_adds` counts a call's cost against the target's).
        draft_steps: optimizer steps of the shipped draft's run.
        draft_batch: states per step of the shipped draft's run.
    """

    name: str
    file: str
    unet: UNetConfig
    steps: int
    batch: int
    draft_file: str
    draft_unet: UNetConfig
    draft_steps: int
    draft_batch: int

    @property
    def resolution(self) -> int:
        """The crop side in pixels."""
        return self.unet.img_resolution

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """``(3, H, W)``: the per-sample shape the model serves."""
        return (3, self.resolution, self.resolution)


MODELS: dict[str, NaturalModel] = {
    "natural32": NaturalModel(
        "natural32",
        "natural32_unet.safetensors",
        UNetConfig(img_channels=3, img_resolution=32, channels=(32, 64, 96), emb_dim=128, num_classes=0),
        steps=2000,
        batch=32,
        draft_file="natural32_draft_unet.safetensors",
        draft_unet=UNetConfig(img_channels=3, img_resolution=32, channels=(16, 32, 48), emb_dim=64, num_classes=0),
        draft_steps=1800,
        draft_batch=16,
    ),
    "natural64": NaturalModel(
        "natural64",
        "natural64_unet.safetensors",
        UNetConfig(img_channels=3, img_resolution=64, channels=(16, 32, 64), emb_dim=128, num_classes=0),
        steps=2500,
        batch=16,
        draft_file="natural64_draft_unet.safetensors",
        draft_unet=UNetConfig(img_channels=3, img_resolution=64, channels=(8, 16, 32), emb_dim=64, num_classes=0),
        draft_steps=1600,
        draft_batch=8,
    ),
}
"""The models by name, with the architecture and the run ``specforest train NAME`` makes by default
(sized so that a run fits in under an hour on a loaded 2-core CPU: ``docs/natural.md``)."""

_KIND = "a natural-image U-Net's weights (specforest.models.natural.load_denoiser)"
_DIGITS_UNET = UNetConfig()
_PYRAMID_STEP = math.sqrt(2.0)
_MIN_SIDE_CROPS = 1.5


def check_name(name: str) -> NaturalModel:
    """The model called ``name``.

    Raises:
        TypeError: if ``name`` is not a string.
        ValueError: naming ``name`` and the accepted names.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be one of {', '.join(MODELS)} (a string), got {type(name).__name__}")
    if name not in MODELS:
        raise ValueError(f"name must be one of {', '.join(MODELS)}, got {name!r}")
    return MODELS[name]


def check_architecture(name: str, unet_config: UNetConfig) -> None:
    """Refuse a U-Net configuration that does not serve model ``name``'s images (unconditional 3 x side x side).

    Raises:
        ValueError: naming ``unet_config``, the model and what the configuration serves instead.
    """
    spec = check_name(name)
    if (unet_config.img_channels, unet_config.img_resolution, unet_config.num_classes) != (3, spec.resolution, 0):
        raise ValueError(
            f"unet_config must serve unconditional 3 x {spec.resolution} x {spec.resolution} images for {name}, "
            f"got {unet_config.img_channels} channels, side {unet_config.img_resolution}, "
            f"{unet_config.num_classes} classes"
        )


def _skimage() -> tuple[Any, Any]:
    """scikit-image's ``data`` module and its ``rescale``."""
    try:
        from skimage import data
        from skimage.transform import rescale
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the natural-image data need scikit-image: pip install 'specforest[natural]'") from e
    return data, rescale


def _read_image(name: str) -> np.ndarray:
    """``(H, W, 3)`` uint8 of one of :data:`COLOUR_IMAGES` or :data:`GREY_IMAGES` (grey replicated)."""
    data, _ = _skimage()
    img = data.stereo_motorcycle()[0] if name == "motorcycle" else getattr(data, name)()
    img = np.asarray(img)
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    return img[:, :, :3]


def load_images(resolution: int, split: str = "train") -> list[list[torch.Tensor]]:
    """The photographs of ``split`` as pyramids of ``(3, H, W)`` float32 tensors in ``[-1, 1]``.

    Level ``k`` of an image is the image downscaled by ``2^{-k/2}`` (anti-aliased); the levels stop
    at the smallest whose shorter side is at least ``1.5 * resolution``, so every level has room
    for crops at many positions.

    Args:
        resolution: the crop side the pyramids serve (32 or 64).
        split: ``"train"`` (every image but :data:`HELD_OUT`) or ``"held_out"``.

    Returns:
        One list of levels per image, in the order of :data:`COLOUR_IMAGES` then :data:`GREY_IMAGES`.

    Raises:
        ValueError: on another ``split`` or a ``resolution`` below 4.
        ImportError: without scikit-image.
    """
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    if not isinstance(resolution, int) or isinstance(resolution, bool) or resolution < 4:
        raise ValueError(f"resolution must be an integer >= 4, got {resolution!r}")
    return _pyramids(resolution, split)


@functools.lru_cache(maxsize=4)
def _pyramids(resolution: int, split: str) -> list[list[torch.Tensor]]:
    # cached: a training run, its evaluation and a test read the same pyramids (a few seconds of
    # anti-aliased rescaling); callers only slice them
    _, rescale = _skimage()
    names = [n for n in COLOUR_IMAGES + GREY_IMAGES if (n in HELD_OUT) == (split == "held_out")]
    out = []
    for name in names:
        img = _read_image(name).astype(np.float32) / 127.5 - 1.0
        levels = []
        k = 0
        while True:
            f = _PYRAMID_STEP ** (-k)
            if min(img.shape[:2]) * f < _MIN_SIDE_CROPS * resolution:
                break
            lev = img if k == 0 else rescale(img, f, anti_aliasing=True, channel_axis=2, order=1)
            levels.append(torch.from_numpy(np.ascontiguousarray(lev.transpose(2, 0, 1), dtype=np.float32)))
            k += 1
        out.append(levels)
    return out


def random_crops(
    pyramids: list[list[torch.Tensor]], n: int, resolution: int, generator: torch.Generator
) -> torch.Tensor:
    """``(n, 3, resolution, resolution)`` random crops: an image uniformly, one of its levels
    uniformly, a position uniformly, and a horizontal flip with probability 1/2, every draw from
    ``generator`` (the same generator state gives the same crops)."""
    img = torch.randint(0, len(pyramids), (n,), generator=generator).tolist()
    u = torch.rand(n, 3, generator=generator, dtype=torch.float64).tolist()
    flip = (torch.rand(n, generator=generator) < 0.5).tolist()
    crops = []
    for i, (ul, uy, ux), fl in zip(img, u, flip, strict=True):
        levels = pyramids[i]
        lev = levels[min(int(ul * len(levels)), len(levels) - 1)]
        _, h, w = lev.shape
        y = min(int(uy * (h - resolution + 1)), h - resolution)
        x = min(int(ux * (w - resolution + 1)), w - resolution)
        c = lev[:, y : y + resolution, x : x + resolution]
        crops.append(c.flip(2) if fl else c)
    return torch.stack(crops)


def activation_numel(config: UNetConfig) -> int:
    """Numbers one image's forward pass through a U-Net of ``config`` produces (every module's
    output tensors, counted with hooks on a freshly initialized network): the measure
    :func:`load_velocity` scales the digits U-Net's measured bytes a row by. The caller's global
    random state is left as it was (the initialization draws from a forked one)."""
    with torch.random.fork_rng():
        net = UNet(config)
    total = [0]

    def hook(mod: torch.nn.Module, inputs: tuple, out: torch.Tensor) -> None:
        if isinstance(out, torch.Tensor):
            total[0] += out.numel()

    handles = [m.register_forward_hook(hook) for m in net.modules() if not list(m.children())]
    r = config.img_resolution
    with torch.no_grad():
        net(torch.zeros(1, config.img_channels, r, r), torch.zeros(1))
    for h in handles:
        h.remove()
    return total[0]


def load_denoiser(
    name: str,
    *,
    path: Optional[PathLike] = None,
    sha256: Optional[str] = None,
    device: "str | torch.device" = "cpu",
    dtype: torch.dtype = torch.float32,
) -> EDMPrecond:
    """The trained EDM denoiser ``D(x: (M, 3, H, W), sigma: (M,)) -> (M, 3, H, W)`` of model ``name``.

    ``D(x; sigma)`` estimates ``E[x_0 | x = x_0 + sigma n]`` (VE noise levels, EDM's convention),
    unconditionally: called as ``D(x, sigma)``, as the k-diffusion drop-ins call a denoiser
    (:func:`specforest.kdiffusion.sample_euler_ancestral`). ``sigma`` may also be a scalar.

    Args:
        name: ``"natural32"`` (``H = W = 32``) or ``"natural64"`` (``H = W = 64``).
        path: a safetensors file; the shipped weights of ``name`` by default.
        sha256: expected digest; by default the one in the manifest next to the file.
        device: where to put the network.
        dtype: the network's dtype (its preconditioning and the sampler stay in float32).

    Returns:
        An :class:`~specforest.models.unet.EDMPrecond` in eval mode, gradients off. The shipped
        weights' denoiser declares the draft distilled from it where that draft ships (its file and
        its manifest entry beside the target's), ``learned_draft``: a callable of no arguments giving
        :func:`load_draft_denoiser` of ``name`` on the same device and dtype, which ``draft="learned"``
        reads (:func:`specforest.drafts.declared_draft`).

    Raises:
        ValueError: naming ``name`` and the accepted names.
        FileNotFoundError: if the file or its manifest entry is missing (``specforest train NAME``).
        WeightsFileError: if the file is not a natural-image U-Net of ``name``'s shape.
        ChecksumError: if the file's digest differs from the recorded one, or none is recorded.
    """
    model = check_name(name)
    shipped = path is None
    if path is None and (
        not (WEIGHTS_DIR / model.file).is_file()
        or (WEIGHTS_DIR / MANIFEST).is_file()
        and model.file not in manifest(WEIGHTS_DIR)
    ):
        raise FileNotFoundError(
            f"{name}'s weights {model.file} are not in {WEIGHTS_DIR} or its {MANIFEST}; run `specforest train {name}`"
        )
    path, sha256 = resolve_weights(model.file, path, sha256)
    tensors, meta = read_safetensors(path, sha256)
    if "config" not in meta:
        raise WeightsFileError(f"{path} is not {_KIND}: its metadata record no U-Net architecture")
    try:
        cfg = UNetConfig.from_dict(json.loads(meta["config"]))
        if (cfg.img_channels, cfg.img_resolution) != (3, model.resolution):
            raise ValueError(
                f"it serves {cfg.img_channels} x {cfg.img_resolution} x {cfg.img_resolution} images, "
                f"{name} serves {' x '.join(map(str, model.state_shape))}"
            )
        with torch.random.fork_rng():  # the initialization, overwritten at once, leaves the caller's stream alone
            net = UNet(cfg)
        net.load_state_dict(tensors)
    except (ValueError, TypeError, KeyError, RuntimeError) as e:
        raise WeightsFileError(f"{path} is not valid as {_KIND} of {name}: {e}") from None
    den = EDMPrecond(net.to(dtype), sigma_data=cfg.sigma_data).to(device).eval()
    den.requires_grad_(False)
    if shipped and _ships(model.draft_file):
        # the shipped target declares the draft distilled from it (draft="learned"), on its device
        den.learned_draft = functools.partial(load_draft_denoiser, name, device=device, dtype=dtype)
    return den


def _ships(file: str) -> bool:
    """Whether ``file`` is in the package's weights folder and listed in its manifest."""
    return (WEIGHTS_DIR / file).is_file() and (WEIGHTS_DIR / MANIFEST).is_file() and file in manifest(WEIGHTS_DIR)


def load_draft_denoiser(
    name: str,
    *,
    path: Optional[PathLike] = None,
    sha256: Optional[str] = None,
    device: "str | torch.device" = "cpu",
    dtype: torch.dtype = torch.float32,
) -> EDMPrecond:
    """Model ``name``'s learned draft, an EDM denoiser ``D(x: (M, 3, H, W), sigma: (M,)) -> (M, 3, H, W)``
    with the target's signature: what ``draft="learned"`` evaluates
    (:meth:`specforest.drafts.LearnedDraft.from_denoiser`), through the EDM adapter in
    :func:`specforest.sample` and as the model is called in the k-diffusion drop-ins.

    The weights default to the shipped ``NAME_draft_unet.safetensors`` (checked against the manifest);
    see :func:`load_denoiser` for the arguments.

    Raises:
        ValueError: naming ``name`` and the accepted names.
        FileNotFoundError: if the file or its manifest entry is missing (``specforest train NAME-draft``).
        WeightsFileError: if the file is not a natural-image U-Net of ``name``'s shape.
        ChecksumError: if the file's digest differs from the recorded one, or none is recorded.
    """
    model = check_name(name)
    if path is None and not _ships(model.draft_file):
        raise FileNotFoundError(
            f"{name}'s draft weights {model.draft_file} are not in {WEIGHTS_DIR} or its {MANIFEST}; "
            f"run `specforest train {name}-draft`"
        )
    path, sha256 = resolve_weights(model.draft_file, path, sha256)
    return load_denoiser(name, path=path, sha256=sha256, device=device, dtype=dtype)


def load_velocity(
    name: str,
    *,
    path: Optional[PathLike] = None,
    sha256: Optional[str] = None,
    device: "str | torch.device" = "cpu",
    dtype: torch.dtype = torch.float32,
    sigma_min: float = 2e-3,
    sigma_max: float = 80.0,
) -> EDMDenoiserVelocity:
    """Model ``name`` as a linear-path velocity ``v(x: (M, 3, H, W), sigma: (M,))`` for
    :func:`specforest.sample`.

    The EDM noise level is clipped to ``[sigma_min, sigma_max]`` (the range the networks were
    trained on and evaluated at). It declares its memory per row: the digits U-Net's measured
    :data:`~specforest.models.digits.ROW_BYTES_FLOAT32` scaled by the ratio of the two networks'
    activations (:func:`activation_numel`) and to ``dtype`` (lower precisions counted as float32).
    See :func:`load_denoiser` for the other arguments and the errors.
    """
    den = load_denoiser(name, path=path, sha256=sha256, device=device, dtype=dtype)
    ratio = activation_numel(den.net.config) / activation_numel(_DIGITS_UNET)
    row = math.ceil(ROW_BYTES_FLOAT32 * ratio) * max(torch.empty((), dtype=dtype).element_size(), 4) // 4
    return EDMDenoiserVelocity(den, sigma_min=sigma_min, sigma_max=sigma_max, row_bytes=row)


def weights_path(name: str, weights_dir: PathLike = WEIGHTS_DIR) -> Path:
    """Where model ``name``'s weights file is (or goes) in ``weights_dir``."""
    return Path(weights_dir) / check_name(name).file
