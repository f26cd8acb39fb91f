"""The shipped pixel-space model: class-conditional handwritten digits.

Data: scikit-learn's ``load_digits`` (1797 grey-scale ``8 x 8`` images with
values ``0..16``, bundled with scikit-learn, no download), scaled to ``[-1, 1]``
as ``x / 8 - 1``; the model works at the native ``1 x 8 x 8`` resolution.

Weights ship with the package as safetensors files under ``models/weights/``
(no pickle is ever loaded) and ``weights/manifest.json`` records their SHA-256;
the loaders verify it before reading a byte of the tensors and raise
:class:`ChecksumError` on a mismatch. They are produced by
``specforest train digits`` (:mod:`specforest.experiments.train_digits`). A path that
does not exist raises ``FileNotFoundError``; a folder, or a file that is not a valid
safetensors file of the kind the loader reads (a U-Net's or the classifier's), raises
:class:`WeightsFileError` saying what it is.

* :func:`load_denoiser` -- the EDM-preconditioned U-Net ``D(x; s, class_labels)``;
* :func:`load_velocity` -- the same as a linear-path velocity
  ``v(x, sigma, class_labels=...)`` for :func:`specforest.sample`;
* :func:`load_classifier` -- a small CNN used to evaluate samples (accuracy
  against the conditioning label, and its penultimate features for a Frechet
  distance);
* :func:`load_draft_denoiser` -- the learned draft: a narrower U-Net
  (:data:`DRAFT_CONFIG`) distilled from the target by ``specforest train
  digits-draft`` (:mod:`specforest.experiments.train_digits_draft`), for
  ``draft="learned"`` (:class:`specforest.drafts.LearnedDraft`);
  :func:`load_draft_velocity` is it as a linear-path velocity.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn
from torch.nn import functional as F

from .edm import EDMDenoiserVelocity
from .unet import EDMPrecond, UNet, UNetConfig

__all__ = [
    "CLASSIFIER_FILE",
    "DRAFT_CONFIG",
    "DRAFT_FILE",
    "IMAGE_SHAPE",
    "MANIFEST",
    "NUM_CLASSES",
    "UNET_FILE",
    "ROW_BYTES_FLOAT32",
    "WEIGHTS_DIR",
    "ChecksumError",
    "DigitsClassifier",
    "WeightsFileError",
    "load_classifier",
    "load_denoiser",
    "load_digits_data",
    "load_draft_velocity",
    "load_velocity",
    "manifest",
    "multiply_adds",
    "read_safetensors",
    "sha256_file",
]

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
UNET_FILE = "digits_unet.safetensors"
CLASSIFIER_FILE = "digits_classifier.safetensors"
DRAFT_FILE = "digits_draft_unet.safetensors"
DRAFT_CONFIG = UNetConfig(channels=(12, 24, 32), emb_dim=64)
"""The learned draft's architecture: the target's U-Net with narrower features and embedding
(:func:`multiply_adds` counts what a call costs against the target's)."""
MANIFEST = "manifest.json"
IMAGE_SHAPE = (1, 8, 8)
ROW_BYTES_FLOAT32 = 136_000
"""Peak bytes one row adds inside a call of the digits velocity in float32 (the U-Net's
activations, its input scaling and output included). The slope of the peak between 2048 and
8192 rows is 79.1-79.6 kB a row (``benchmarks/memory.py``), but one call's peak over the
resident set before it, in a fresh process, was 93-132 kB a row at 256-2048 rows (glibc's heap
and the kernels' buffers, with or without :func:`specforest.allocator.keep_freed_memory`), so
136 kB is declared: sized by the slope, a 0.5 GB pixel run reached 1.13 x its estimate. Other
dtypes scale with their size."""
NUM_CLASSES = 10

PathLike = Union[str, "os.PathLike[str]"]


class ChecksumError(ValueError):
    """A weights file does not have the SHA-256 recorded for it."""


class WeightsFileError(ValueError):
    """A weights path is not a valid specforest safetensors file of the kind a loader reads."""


# the kinds of weights file, told apart by their metadata (the files carry no kind of their own):
# a U-Net's records its architecture as "config", the classifier's its "width"
_UNET_KIND = "a digits U-Net's weights (load_denoiser, load_velocity, load_draft_velocity)"
_CLASSIFIER_KIND = "the digits classifier's weights (load_classifier)"


def _kind_of(meta: dict[str, str]) -> Optional[str]:
    """Which kind of weights file ``meta`` (a safetensors file's metadata) describes, if any."""
    if "config" in meta:
        return _UNET_KIND
    if "width" in meta or "feature_dim" in meta:
        return _CLASSIFIER_KIND
    return None


def _check_kind(path: Path, meta: dict[str, str], kind: str) -> None:
    """Refuse a file whose metadata are not those of ``kind``, naming the kind it is if it says."""
    found = _kind_of(meta)
    if found != kind:
        what = f"it holds {found}" if found is not None else "its metadata name no specforest weights"
        raise WeightsFileError(f"{path} is not {kind}: {what}")


def load_digits_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The digits data set, offline (bundled with scikit-learn).

    Returns:
        ``images (1797, 1, 8, 8)`` float32 in ``[-1, 1]`` and ``labels (1797,)`` long.

    Raises:
        ImportError: if scikit-learn is not installed.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the digits data need scikit-learn (pip install scikit-learn)") from e
    d = load_digits()
    x = torch.as_tensor(d.images, dtype=torch.float32)[:, None] / 8.0 - 1.0
    return x, torch.as_tensor(d.target, dtype=torch.long)


def sha256_file(path: PathLike) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest(weights_dir: PathLike = WEIGHTS_DIR) -> dict:
    """The weights manifest: ``{file: {"sha256": ..., ...}}``.

    Raises:
        FileNotFoundError: if ``weights_dir`` has no manifest.
        WeightsFileError: if the manifest is not a JSON object.
    """
    p = Path(weights_dir) / MANIFEST
    if not p.is_file():
        raise FileNotFoundError(f"no weights manifest at {p}; run `specforest train digits`")
    try:
        man = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsFileError(f"the weights manifest {p} is not valid JSON: {e}") from None
    if not isinstance(man, dict):
        raise WeightsFileError(f"the weights manifest {p} must be a JSON object, got {type(man).__name__}")
    return man


def _check_file(path: PathLike) -> Path:
    """``path`` as a :class:`~pathlib.Path`, refused if it does not name an existing regular file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"weights file {path} does not exist; run `specforest train digits`")
    if not path.is_file():
        what = "a folder" if path.is_dir() else "not a regular file"
        raise WeightsFileError(f"path must be a safetensors weights file, but {path} is {what}")
    return path


def _check_sha256(sha256: Optional[str]) -> Optional[str]:
    """``sha256`` lower-cased, refused unless ``None`` or 64 hex digits."""
    if sha256 is None:
        return None
    if not isinstance(sha256, str):
        raise TypeError(f"sha256 must be a hex SHA-256 digest (64 hex digits) or None, got {type(sha256).__name__}")
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256.lower()):
        raise ValueError(f"sha256 must be a hex SHA-256 digest (64 hex digits) or None, got {sha256!r}")
    return sha256.lower()


def read_safetensors(path: PathLike, sha256: Optional[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a safetensors file after checking its SHA-256.

    Args:
        path: the file.
        sha256: expected hex digest; ``None`` skips the check (not used by the loaders).

    Returns:
        ``(tensors, metadata)``.

    Raises:
        FileNotFoundError: if the file does not exist.
        WeightsFileError: if ``path`` is a folder or the file is not a valid safetensors file.
        ChecksumError: if the digest differs.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    sha256 = _check_sha256(sha256)
    path = _check_file(path)
    data = path.read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if sha256 is not None and got != sha256:
        raise ChecksumError(f"{path.name}: SHA-256 {got} does not match the recorded {sha256}")
    # the metadata live in the JSON header: 8-byte little-endian length, then the header
    n = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8")) if len(data) >= 8 + n else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    meta = (header.get("__metadata__") or {}) if isinstance(header, dict) else None
    tensors = None
    if isinstance(meta, dict):
        try:
            tensors = load(data)
        except SafetensorError:
            pass
    if tensors is None:
        raise WeightsFileError(f"{path} is not a valid safetensors file (its header or tensors cannot be read)")
    return tensors, meta


def resolve_weights(file: str, path: Optional[PathLike], sha256: Optional[str]) -> tuple[Path, str]:
    """The weights file to read and its expected digest: ``path`` (default the shipped ``file``),
    ``sha256`` (default the one recorded in the manifest next to the file)."""
    sha256 = _check_sha256(sha256)
    if path is None:
        path = WEIGHTS_DIR / file
        if sha256 is None:
            entry = manifest(WEIGHTS_DIR).get(file)
            if entry is None:
                raise FileNotFoundError(f"{file} is not listed in {WEIGHTS_DIR / MANIFEST}")
            sha256 = entry["sha256"]
    else:
        # what is wrong with the path itself comes before what its folder's manifest lacks
        path = _check_file(path)
        if sha256 is None:
            if not (path.parent / MANIFEST).is_file():
                raise ChecksumError(f"no SHA-256 recorded for {path}: no {MANIFEST} next to it; pass sha256=")
            entry = manifest(path.parent).get(path.name)
            if not isinstance(entry, dict) or "sha256" not in entry:
                raise ChecksumError(f"no SHA-256 recorded for {path} in {path.parent / MANIFEST}; pass sha256=")
            sha256 = entry["sha256"]
    return Path(path), sha256


def load_denoiser(
    path: Optional[PathLike] = None,
    *,
    sha256: Optional[str] = None,
    device: "str | torch.device" = "cpu",
    dtype: torch.dtype = torch.float32,
) -> EDMPrecond:
    """The trained EDM denoiser ``D(x: (M, 1, 8, 8), s: (M,), class_labels) -> (M, 1, 8, 8)``.

    Args:
        path: a safetensors file; the shipped weights by default.
        sha256: expected digest; by default the one in the manifest next to ``path``.
        device: where to put the network.
        dtype: the network's dtype (``torch.bfloat16``/``float16`` for a low-precision
            network; its preconditioning and the sampler stay in float32).

    Returns:
        An :class:`~specforest.models.unet.EDMPrecond` in eval mode, gradients off. The shipped
        weights' denoiser declares the draft distilled from it, ``learned_draft``: a callable of no
        arguments giving :func:`load_draft_denoiser` on the same device and dtype, which
        ``draft="learned"`` reads (:func:`specforest.drafts.declared_draft`).

    Raises:
        FileNotFoundError: if the file does not exist.
        WeightsFileError: if ``path`` is a folder, or not a valid safetensors file of a digits U-Net
            (the classifier's file, say).
        ChecksumError: if the file's digest differs from the recorded one, or none is recorded.
    """
    shipped = path is None
    path, sha256 = resolve_weights(UNET_FILE, path, sha256)
    tensors, meta = read_safetensors(path, sha256)
    _check_kind(path, meta, _UNET_KIND)
    try:
        cfg = UNetConfig.from_dict(json.loads(meta["config"]))
        net = UNet(cfg)
        net.load_state_dict(tensors)
    except (ValueError, TypeError, KeyError, RuntimeError) as e:
        raise WeightsFileError(f"{path} is not valid as {_UNET_KIND}: {e}") from None
    den = EDMPrecond(net.to(dtype), sigma_data=cfg.sigma_data).to(device).eval()
    den.requires_grad_(False)
    if shipped:
        # the shipped target declares the draft distilled from it (draft="learned"), on its device
        den.learned_draft = functools.partial(load_draft_denoiser, device=device, dtype=dtype)
    return den


def multiply_adds(config: Optional[UNetConfig] = None) -> int:
    """Multiply-adds of one call on one image of a U-Net of ``config`` (the target's by default):
    every convolution's and linear layer's (what dominates; normalizations and activations are
    not counted), counted by running a freshly initialized network once."""
    config = UNetConfig() if config is None else config
    net = UNet(config)
    total = [0]

    def hook(mod: nn.Module, inputs: tuple, out: torch.Tensor) -> None:
        if isinstance(mod, nn.Conv2d):
            k = mod.kernel_size[0] * mod.kernel_size[1] * mod.in_channels // mod.groups
            total[0] += out.numel() * k
        elif isinstance(mod, nn.Linear):
            total[0] += out.numel() * mod.in_features

    handles = [m.register_forward_hook(hook) for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    r = config.img_resolution
    with torch.no_grad():
        net(torch.zeros(1, config.img_channels, r, r), torch.zeros(1), torch.zeros(1, dtype=torch.long))
    for h in handles:
        h.remove()
    return total[0]


def load_draft_denoiser(
    path: Optional[PathLike] = None,
    *,
    sha256: Optional[str] = None,
    device: "str | torch.device" = "cpu",
    dtype: torch.dtype = torch.float32,
) -> EDMPrecond:
    """The learned draft's EDM denoiser ``D(x: (M, 1, 8, 8), s: (M,), class_labels) -> (M, 1, 8, 8)``:
    what ``draft="learned"`` evaluates (:meth:`specforest.drafts.LearnedDraft.from_denoiser`), through
    the EDM adapter in :func:`specforest.sample` and as the model is called in the k-diffusion drop-ins.

    The weights default to the shipped ``digits_draft_unet.safetensors`` (checked against the
    manifest); see :func:`load_denoiser` for the arguments.

    Raises:
        FileNotFoundError: if the file or its manifest entry is missing (``specforest train digits-draft``).
        WeightsFileError: if ``path`` is not a digits U-Net's safetensors file.
        ChecksumError: if the file's digest differs from the recorded one.
    """
    path, sha256 = resolve_weights(DRAFT_FILE, path, sha256)
    return load_denoiser(path, sha256=sha256, device=device, dtype=dtype)


def load_draft_velocity(
    path: Optional[PathLike] = None,
    *,
    sha256: Optional[str] = None,
    device: "str | torch.device" = "cpu",
    dtype: torch.dtype = torch.float32,
) -> EDMDenoiserVelocity:
    """The learned draft as a linear-path velocity ``v(x: (M, 1, 8, 8), sigma: (M,), class_labels)``.

    The weights default to the shipped ``digits_draft_unet.safetensors`` (checked against the
    manifest); the EDM noise level is clipped as the target's (:func:`load_velocity`).

    Raises:
        FileNotFoundError: if the file or its manifest entry is missing (``specforest train digits-draft``).
        ChecksumError: if the file's digest differs from the recorded one.
    """
    path, sha256 = resolve_weights(DRAFT_FILE, path, sha256)
    return load_velocity(path, sha256=sha256, device=device, dtype=dtype)


def load_velocity(
    path: Optional[PathLike] = None,
    *,
    sha256: Optional[str] = None,
    device: "str | torch.device" = "cpu",
    dtype: torch.dtype = torch.float32,
    sigma_min: float = 1e-3,
    sigma_max: float = 80.0,
) -> EDMDenoiserVelocity:
    """The digits model as a linear-path velocity ``v(x, sigma, class_labels=...)``.

    ``class_labels`` may be ``None`` (unconditional), one integer for every row,
    or a ``(M,)`` tensor; through :func:`specforest.sample` pass a ``(batch,)`` tensor
    as ``cond={"class_labels": labels}`` and each call gets the labels of its rows' trajectories.
    The EDM noise level is clipped to ``[sigma_min, sigma_max]`` (the paper's
    ``[1e-3, 80]``). It declares its memory per row (:data:`ROW_BYTES_FLOAT32`,
    scaled to ``dtype``; lower precisions are counted as float32, the adapter's
    own arithmetic). See :func:`load_denoiser` for the other arguments.
    """
    return EDMDenoiserVelocity(
        load_denoiser(path, sha256=sha256, device=device, dtype=dtype),
        sigma_min=sigma_min,
        sigma_max=sigma_max,
        row_bytes=ROW_BYTES_FLOAT32 * max(torch.empty((), dtype=dtype).element_size(), 4) // 4,
    )


class DigitsClassifier(nn.Module):
    """A small CNN classifier of ``1 x 8 x 8`` digits in ``[-1, 1]``.

    Forward: ``x: (M, 1, 8, 8)`` -> logits ``(M, 10)``; :meth:`features` gives
    the ``(M, feature_dim)`` penultimate activations used for Frechet distances.
    """

    def __init__(self, width: int = 32, feature_dim: int = 64) -> None:
        super().__init__()
        self.width, self.feature_dim = width, feature_dim
        self.conv0 = nn.Conv2d(1, width, 3, padding=1)
        self.conv1 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc = nn.Linear(2 * width * 16, feature_dim)
        self.head = nn.Linear(feature_dim, NUM_CLASSES)
        self.drop = nn.Dropout(0.2)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """``(M, feature_dim)`` penultimate activations of ``x: (M, 1, 8, 8)`` (no clipping).

        Raises:
            ValueError: if ``x`` is not ``(M, *IMAGE_SHAPE)`` (a shape check, no tensor is read).
        """
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or tuple(x.shape[1:]) != IMAGE_SHAPE:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"x must have shape (M, 1, 8, 8): the classifier serves images of shape (1, 8, 8), got {got}"
            )
        h = F.silu(self.conv0(x))
        h = F.avg_pool2d(F.silu(self.conv1(h)), 2)
        return F.silu(self.fc(h.flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.features(x)))

    @torch.no_grad()
    def predict(self, x: torch.Tensor, batch: int = 4096) -> torch.Tensor:
        """``(M,)`` predicted labels of images ``x: (M, 1, 8, 8)`` (inputs clipped to ``[-1, 1]``)."""
        return torch.cat([self(x[i : i + batch].float().clamp(-1, 1)).argmax(1) for i in range(0, x.shape[0], batch)])

    @torch.no_grad()
    def embed(self, x: torch.Tensor, batch: int = 4096) -> torch.Tensor:
        """``(M, feature_dim)`` penultimate features (inputs clipped to ``[-1, 1]``)."""
        return torch.cat([self.features(x[i : i + batch].float().clamp(-1, 1)) for i in range(0, x.shape[0], batch)])


def load_classifier(
    path: Optional[PathLike] = None, *, sha256: Optional[str] = None, device: "str | torch.device" = "cpu"
) -> DigitsClassifier:
    """The shipped digits classifier, in eval mode (see :func:`load_denoiser` for the arguments).

    Raises:
        FileNotFoundError: if the file does not exist.
        WeightsFileError: if ``path`` is a folder, or not a valid safetensors file of the digits
            classifier (a U-Net's, say).
        ChecksumError: if the file's digest differs from the recorded one, or none is recorded.
    """
    path, sha256 = resolve_weights(CLASSIFIER_FILE, path, sha256)
    tensors, meta = read_safetensors(path, sha256)
    _check_kind(path, meta, _CLASSIFIER_KIND)
    try:
        clf = DigitsClassifier(width=int(meta.get("width", 32)), feature_dim=int(meta.get("feature_dim", 64)))
        clf.load_state_dict(tensors)
    except (ValueError, TypeError, RuntimeError) as e:
        raise WeightsFileError(f"{path} is not valid as {_CLASSIFIER_KIND}: {e}") from None
    clf = clf.to(device).eval()
    clf.requires_grad_(False)
    return clf
