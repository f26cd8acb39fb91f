"""A small class-conditional U-Net with EDM preconditioning (Karras et al. 2022).

:class:`UNet` is the raw network ``F(x, c_noise, label)``; :class:`EDMPrecond`
wraps it into the denoiser ``D(x; s) = c_skip(s) x + c_out(s) F(c_in(s) x, c_noise(s))``
with EDM's coefficients (Table 1 of Karras et al., ``sigma_data = 0.5``):

    c_skip = sigma_data^2 / (s^2 + sigma_data^2)
    c_out  = s sigma_data / sqrt(s^2 + sigma_data^2)
    c_in   = 1 / sqrt(s^2 + sigma_data^2)
    c_noise = ln(s) / 4

so that the network's input and its training target have unit variance at every
noise level. The denoiser follows the EDM convention
``D(y; s) ~ E[x_0 | y = x_0 + s xi]`` and becomes a linear-path velocity through
:class:`specforest.models.edm.EDMDenoiserVelocity`.

Three resolutions (full, 1/2, 1/4): the shipped digits model runs at ``1 x 8 x 8``
(8, 4, 2); any side divisible by 4 works (e.g. ``1 x 16 x 16``), and a network serves
the one shape of its :class:`UNetConfig` (:attr:`UNet.state_shape`): another is refused
with a ``ValueError`` naming both, a shape check that reads no tensor. Labels are
integers in ``[0, num_classes)``; ``None`` (or the value ``num_classes``) selects
the unconditional embedding learned with label dropout. Labels outside that range are
refused with a ``ValueError`` where reading them costs no host-device synchronization
(Python integers, tensors on the CPU); labels already on an accelerator are not read inside
the call (see :func:`check_labels`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["EDMPrecond", "UNet", "UNetConfig", "check_labels"]


@dataclass(frozen=True)
class UNetConfig:
    """Architecture hyper-parameters (stored with the weights).

    Attributes:
        img_channels: image channels (1 for digits).
        img_resolution: image side in pixels, divisible by 4.
        channels: feature channels at the three resolutions (full, 1/2, 1/4).
        emb_dim: width of the noise-and-label embedding.
        num_classes: number of class labels (0: unconditional only).
        fourier_scale: std of the random frequencies of the noise embedding.
        sigma_data: EDM's data standard deviation.
    """

    img_channels: int = 1
    img_resolution: int = 8
    channels: tuple[int, int, int] = (32, 64, 96)
    emb_dim: int = 128
    num_classes: int = 10
    fourier_scale: float = 4.0
    sigma_data: float = 0.5

    def to_dict(self) -> dict:
        d = asdict(self)
        d["channels"] = list(self.channels)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "UNetConfig":
        d = dict(d)
        d["channels"] = tuple(int(c) for c in d["channels"])
        return cls(**d)


def _groups(c: int) -> int:
    return min(8, c // 4)


def check_labels(labels: torch.Tensor, num_classes: int) -> None:
    """Refuse class labels outside ``[0, num_classes]`` (``num_classes`` is the unconditional label).

    The values are read only where that costs no host-device synchronization: a tensor on the
    CPU (where a sampler keeps a run's conditioning next to a CUDA model, and where Python
    integers land). Labels already on an accelerator are not read: a read in every network call
    would synchronize every round; an out-of-range one fails there in the embedding's own
    device-side index check.

    Args:
        labels: ``(M,)`` integer labels, on any device.
        num_classes: the network's number of classes.

    Raises:
        ValueError: naming ``class_labels``, the accepted range and the first label outside it.
    """
    if labels.device.type != "cpu" or labels.numel() == 0:
        return
    lo, hi = torch.aminmax(labels)
    lo, hi = lo.item(), hi.item()
    if lo < 0 or hi > num_classes:
        bad = lo if lo < 0 else hi
        classes = f"[0, {num_classes - 1}], or {num_classes}" if num_classes > 0 else f"{num_classes}"
        raise ValueError(f"class_labels must be in {classes} (the unconditional label) or None, got {bad}")


class _ResBlock(nn.Module):
    """GroupNorm-SiLU-conv twice, with the embedding as a scale/shift in between."""

    def __init__(self, cin: int, cout: int, emb_dim: int) -> None:
        super().__init__()
        self.norm0 = nn.GroupNorm(_groups(cin), cin)
        self.conv0 = nn.Conv2d(cin, cout, 3, padding=1)
        self.affine = nn.Linear(emb_dim, 2 * cout)
        self.norm1 = nn.GroupNorm(_groups(cout), cout)
        self.conv1 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()
        nn.init.zeros_(self.conv1.weight)
        nn.init.zeros_(self.conv1.bias)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv0(F.silu(self.norm0(x)))
        scale, shift = self.affine(emb)[:, :, None, None].chunk(2, dim=1)
        h = F.silu(self.norm1(h) * (1 + scale) + shift)
        return (self.skip(x) + self.conv1(h)) / math.sqrt(2.0)


class UNet(nn.Module):
    """The raw network ``F(x, c_noise, labels)``.

    Args:
        config: a :class:`UNetConfig`.

    Forward: ``x: (M, C, H, W)``, ``c_noise: (M,)``, ``labels: (M,)`` long or
    ``None`` -> ``(M, C, H, W)``.
    """

    def __init__(self, config: UNetConfig = UNetConfig()) -> None:
        super().__init__()
        if config.img_resolution % 4:
            raise ValueError(f"img_resolution must be divisible by 4, got {config.img_resolution}")
        self.config = config
        c0, c1, c2 = config.channels
        e = config.emb_dim
        g = torch.Generator().manual_seed(0)
        self.register_buffer("freqs", torch.randn(e // 2, generator=g) * config.fourier_scale)
        self.map_noise = nn.Sequential(nn.Linear(e, e), nn.SiLU(), nn.Linear(e, e))
        # index num_classes is the unconditional ("null") label
        self.map_label = nn.Embedding(config.num_classes + 1, e)
        nn.init.normal_(self.map_label.weight, std=0.02)
        self.conv_in = nn.Conv2d(config.img_channels, c0, 3, padding=1)
        self.enc0 = _ResBlock(c0, c0, e)
        self.down0 = nn.Conv2d(c0, c1, 3, stride=2, padding=1)
        self.enc1 = _ResBlock(c1, c1, e)
        self.down1 = nn.Conv2d(c1, c2, 3, stride=2, padding=1)
        self.mid0 = _ResBlock(c2, c2, e)
        self.mid1 = _ResBlock(c2, c2, e)
        self.up1 = nn.Conv2d(c2, c1, 3, padding=1)
        self.dec1 = _ResBlock(2 * c1, c1, e)
        self.up0 = nn.Conv2d(c1, c0, 3, padding=1)
        self.dec0 = _ResBlock(2 * c0, c0, e)
        self.norm_out = nn.GroupNorm(_groups(c0), c0)
        self.conv_out = nn.Conv2d(c0, config.img_channels, 3, padding=1)
        nn.init.zeros_(self.conv_out.weight)
        nn.init.zeros_(self.conv_out.bias)

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)``: the one per-sample shape the network serves (its config's channels and side)."""
        r = self.config.img_resolution
        return (self.config.img_channels, r, r)

    def check_state(self, x: torch.Tensor) -> None:
        """Refuse a batch ``x`` that is not ``(M, *state_shape)``: a shape check, no tensor is read.

        Raises:
            TypeError: if ``x`` is not a tensor.
            ValueError: naming ``x``, the shape the network serves and the shape given.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a tensor of shape (M, {', '.join(map(str, self.state_shape))})")
        if x.ndim != 4 or tuple(x.shape[1:]) != self.state_shape:
            want = ", ".join(map(str, self.state_shape))
            raise ValueError(
                f"x must have shape (M, {want}): the network serves states of shape ({want}), got {tuple(x.shape)}"
            )

    def embed(self, c_noise: torch.Tensor, labels: Optional[torch.Tensor]) -> torch.Tensor:
        """``(M, emb_dim)`` embedding of the noise level and the label."""
        arg = c_noise.to(self.freqs.dtype)[:, None] * self.freqs[None, :] * (2 * math.pi)
        emb = self.map_noise(torch.cat([arg.cos(), arg.sin()], dim=1))
        n = self.config.num_classes
        if labels is None:
            labels = torch.full((c_noise.shape[0],), n, dtype=torch.long, device=c_noise.device)
        else:
            check_labels(labels, n)
        return F.silu(emb + self.map_label(labels.to(c_noise.device).long()))

    def forward(self, x: torch.Tensor, c_noise: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.deep(x, c_noise, labels)[0]

    def deep(
        self, x: torch.Tensor, c_noise: torch.Tensor, labels: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output and the deep features ``(M, c0, H, W)``: everything the lower resolutions
        give the last decoder block (DeepCache's cached branch; :meth:`shallow` reuses them)."""
        self.check_state(x)
        emb = self.embed(c_noise, labels)
        h0 = self.enc0(self.conv_in(x), emb)
        h1 = self.enc1(self.down0(h0), emb)
        h = self.mid1(self.mid0(self.down1(h1), emb), emb)
        h = self.up1(F.interpolate(h, scale_factor=2.0, mode="nearest"))
        h = self.dec1(torch.cat([h, h1], dim=1), emb)
        feat = self.up0(F.interpolate(h, scale_factor=2.0, mode="nearest"))
        return self._head(feat, h0, emb), feat

    def shallow(
        self, x: torch.Tensor, c_noise: torch.Tensor, labels: Optional[torch.Tensor], feat: torch.Tensor
    ) -> torch.Tensor:
        """The output with the deep features ``feat (M, c0, H, W)`` (or flattened, ``(M, c0 H W)``)
        of an earlier call (:meth:`deep`) in place of the lower resolutions: only the embedding, the
        first encoder block and the last decoder block run. ``shallow(x, c, l, deep(x, c, l)[1])``
        is ``forward(x, c, l)``."""
        self.check_state(x)
        M, c0, (_, h, w) = x.shape[0], self.config.channels[0], self.state_shape
        if not isinstance(feat, torch.Tensor) or feat.ndim < 1 or feat.shape[0] != M or feat.numel() != M * c0 * h * w:
            got = tuple(feat.shape) if isinstance(feat, torch.Tensor) else type(feat).__name__
            raise ValueError(f"feat must have shape ({M}, {c0}, {h}, {w}) or ({M}, {c0 * h * w}), got {got}")
        emb = self.embed(c_noise, labels)
        h0 = self.enc0(self.conv_in(x), emb)
        return self._head(feat.to(h0.dtype).reshape(h0.shape), h0, emb)

    def _head(self, feat: torch.Tensor, h0: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.dec0(torch.cat([feat, h0], dim=1), emb)
        return self.conv_out(F.silu(self.norm_out(h)))


class EDMPrecond(nn.Module):
    """EDM-preconditioned denoiser ``D(x; s, class_labels)`` around a :class:`UNet`.

    Args:
        net: the raw network.
        sigma_data: EDM's data standard deviation (0.5).

    Forward: ``x: (M, C, H, W)`` noisy images ``x_0 + s xi``, ``sigma: (M,)`` or a
    scalar EDM noise level ``s > 0``, ``class_labels: (M,)`` integers, a scalar
    integer (one label for all rows) or ``None`` (unconditional) ->
    ``(M, C, H, W)`` estimate of ``E[x_0 | x]`` in ``x``'s dtype; the network
    runs in its parameters' dtype. With ``keep`` it returns the network's deep features
    ``(M, c0, H, W)`` too; with ``feat`` (features an earlier call kept) only the shallow
    blocks run (:meth:`deep`, :meth:`shallow`: the cached self-draft's protocol).
    """

    def __init__(self, net: UNet, sigma_data: float = 0.5) -> None:
        super().__init__()
        self.net = net
        self.sigma_data = float(sigma_data)

    def forward(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor | float,
        class_labels: Optional[torch.Tensor | int] = None,
        *,
        feat: Optional[torch.Tensor] = None,
        keep: bool = False,
    ) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
        # refused before the preconditioning, whose broadcasting would turn a wrong shape into another
        self.net.check_state(x)
        M = x.shape[0]
        dtype = next(self.net.parameters()).dtype
        s = torch.as_tensor(sigma, dtype=x.dtype, device=x.device)
        if s.numel() != 1 and tuple(s.shape) != (M,):
            raise ValueError(f"sigma must be a scalar or have shape ({M},), got shape {tuple(s.shape)}")
        s = s.reshape(-1).expand(M)
        if class_labels is not None:
            # on their own device: the network reads labels on the CPU for its range check before it
            # moves them (:func:`check_labels`), which it could not do once they are on an accelerator
            class_labels = torch.as_tensor(class_labels).reshape(-1)
            class_labels = class_labels.expand(M) if class_labels.numel() == 1 else class_labels
            if class_labels.shape != (M,):
                raise ValueError(f"class_labels must be None, a scalar or have shape ({M},)")
        sd2 = self.sigma_data**2
        sb = s.reshape(-1, 1, 1, 1)
        c_skip = sd2 / (sb * sb + sd2)
        c_out = sb * self.sigma_data / (sb * sb + sd2).sqrt()
        c_in = 1.0 / (sb * sb + sd2).sqrt()
        c_noise = s.log() / 4
        xin, cn = (c_in * x).to(dtype), c_noise.to(dtype)
        if feat is None:
            f, kept = self.net.deep(xin, cn, class_labels)
        else:
            f, kept = self.net.shallow(xin, cn, class_labels, feat), feat
        d = (c_skip * x + c_out * f.to(x.dtype)).to(x.dtype)
        return (d, kept) if keep else d

    def deep(
        self, x: torch.Tensor, sigma: torch.Tensor | float, class_labels: Optional[torch.Tensor | int] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(D(x; sigma), feat)``: the denoised estimate and the network's deep features
        ``(M, c0, H, W)`` (:meth:`UNet.deep`), for :meth:`shallow` at a later call."""
        return self.forward(x, sigma, class_labels, keep=True)

    def shallow(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor | float,
        feat: torch.Tensor,
        class_labels: Optional[torch.Tensor | int] = None,
    ) -> torch.Tensor:
        """``D(x; sigma)`` with the deep features ``feat`` of an earlier :meth:`deep` call reused
        (:meth:`UNet.shallow`: DeepCache's cheap evaluation)."""
        return self.forward(x, sigma, class_labels, feat=feat)
