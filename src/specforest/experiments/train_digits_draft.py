"""Training of the digits model's learned draft (``specforest train digits-draft``).

The draft network is a narrower copy of the digits U-Net
(:data:`specforest.models.digits.DRAFT_CONFIG`), distilled from the shipped
target so that the sampler's mismatch is small where the sampler verifies it:

* states are the linear path's ``y = (1 - t) x_0 + t xi`` at the noise levels
  ``t`` of the grid the pixel experiment samples on (flow_match, ``T`` steps,
  churn as given), ``x_0`` scikit-learn's digits with their labels; a step is
  drawn uniformly among the stochastic ones (the verified ones);
* the loss is the draft's squared mismatch over the step's noise scale,
  ``delta^2 = (c_s / scale_s)^2 |v_draft(y) - v_target(y)|^2 / D`` with ``c_s``
  the velocity's coefficient in the transition mean (``mean = a y + c v``),
  i.e. the quantity a coupling's acceptance falls with
  (:func:`specforest.acceptance`), averaged over the grid's steps;
* Adam with warm-up and cosine decay, and an exponential moving average of the
  weights, which is what ships.

Outputs: ``digits_draft_unet.safetensors`` (its configuration and training
summary in the file's metadata) and its entry in ``manifest.json`` (SHA-256,
bytes, multiply-adds per call against the target's), written atomically and
merged with the entries already there. Nothing here runs at import or at test
time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..models.digits import (
    DRAFT_CONFIG,
    DRAFT_FILE,
    MANIFEST,
    UNET_FILE,
    WEIGHTS_DIR,
    load_digits_data,
    load_velocity,
    manifest,
    multiply_adds,
)
from ..models.edm import EDMDenoiserVelocity
from ..models.unet import EDMPrecond, UNetConfig
from ..options import make_sde
from ..validation import check_churn, check_int, check_number
from .training import LoopConfig, ship_weights, train_loop

__all__ = ["DraftTrainConfig", "main_train_draft", "train_draft"]


@dataclass(frozen=True)
class DraftTrainConfig:
    """Hyper-parameters of the draft's distillation (recorded in the manifest).

    Attributes:
        steps: optimizer steps.
        batch: states per step.
        lr: peak Adam learning rate (linear warm-up, cosine decay to 5 %; gradients clipped to norm 1).
        warmup: warm-up steps.
        ema_decay: decay of the weights' moving average.
        grid_steps: ``T`` of the grid whose noise levels are trained on.
        churn: the grid's churn (it sets each step's ``c_s / scale_s`` weight).
        seed: seed of initialization, batches and noise.
        max_minutes: wall-clock limit (stops early).

    Raises:
        ValueError / TypeError: on a field out of its range, naming it.
    """

    steps: int = 2500
    batch: int = 256
    lr: float = 2e-3
    warmup: int = 100
    ema_decay: float = 0.998
    grid_steps: int = 100
    churn: float = 0.3
    seed: int = 0
    max_minutes: float = 15.0

    def __post_init__(self) -> None:
        for name, lo in (("steps", 1), ("batch", 1), ("warmup", 1), ("grid_steps", 3), ("seed", 0)):
            check_int(name, getattr(self, name), lo)
        check_number("lr", self.lr, 0.0, lo_open=True)
        check_number("ema_decay", self.ema_decay, 0.0, 1.0)
        check_number("max_minutes", self.max_minutes, 0.0, lo_open=True)
        check_churn(self.churn)


def grid_weights(cfg: DraftTrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The verified steps' noise levels ``t (S,)`` and weights ``(c_s / scale_s)^2 (S,)`` (mean 1)."""
    sde = make_sde(cfg.grid_steps, None, "flow_match", 1.0, cfg.churn)
    tab = sde.tables("cpu", torch.float64)
    on = tab.stochastic
    w = (tab.c[on] / tab.scale[on]).square()
    return tab.sig[:-1][on].float(), (w / w.mean()).float()


def train_draft(
    teacher: Callable[..., torch.Tensor],
    x: torch.Tensor,
    labels: torch.Tensor,
    cfg: DraftTrainConfig,
    *,
    unet_config: UNetConfig = DRAFT_CONFIG,
    progress: bool = True,
) -> tuple[EDMPrecond, dict]:
    """Distill ``teacher`` (a velocity ``v(x, t, class_labels=...)``) into a small EDM denoiser.

    Args:
        teacher: the target velocity, called without gradients.
        x: ``(N, 1, H, W)`` clean images in ``[-1, 1]``.
        labels: ``(N,)`` class labels.
        cfg: hyper-parameters.
        unet_config: the draft's architecture.
        progress: tqdm progress bar on stderr.

    Returns:
        The EMA denoiser (eval mode, gradients off) and ``{"loss": [...], ...}``; the loss is the
        mean ``delta^2`` of a batch.
    """
    t_grid, w_grid = grid_weights(cfg)

    def loss_of(model: EDMPrecond, g: torch.Generator) -> torch.Tensor:
        idx = torch.randint(0, x.shape[0], (cfg.batch,), generator=g)
        k = torch.randint(0, t_grid.numel(), (cfg.batch,), generator=g)
        t, w = t_grid[k], w_grid[k]
        x0, c = x[idx], labels[idx]
        tb = t[:, None, None, None]
        y = (1.0 - tb) * x0 + tb * torch.randn(x0.shape, generator=g)
        with torch.no_grad():
            v_target = teacher(y, t, class_labels=c)
        v = EDMDenoiserVelocity(model)(y, t, class_labels=c)
        return (w * (v - v_target).square().flatten(1).mean(1)).mean()

    loop = LoopConfig(
        steps=cfg.steps,
        lr=cfg.lr,
        warmup=cfg.warmup,
        ema_decay=cfg.ema_decay,
        seed=cfg.seed,
        max_minutes=cfg.max_minutes,
    )
    ema, info = train_loop(
        loss_of, unet_config, loop, desc="draft", postfix="delta2", postfix_window=100, progress=progress
    )
    info["final_delta2"] = info.pop("final_loss")
    return ema, info


@torch.no_grad()
def held_out_delta(
    teacher: Callable[..., torch.Tensor], draft: Callable[..., torch.Tensor], cfg: DraftTrainConfig, n: int = 2000
) -> float:
    """Root mean ``delta^2`` of ``draft`` against ``teacher`` on ``n`` fresh states (seed ``cfg.seed + 1``)."""
    x, labels = load_digits_data()
    g = torch.Generator().manual_seed(cfg.seed + 1)
    t_grid, w_grid = grid_weights(cfg)
    idx = torch.randint(0, x.shape[0], (n,), generator=g)
    k = torch.randint(0, t_grid.numel(), (n,), generator=g)
    t, w = t_grid[k], w_grid[k]
    tb = t[:, None, None, None]
    y = (1.0 - tb) * x[idx] + tb * torch.randn(x[idx].shape, generator=g)
    c = labels[idx]
    err = (draft(y, t, class_labels=c) - teacher(y, t, class_labels=c)).square().flatten(1).mean(1)
    return float((w * err).mean().sqrt())


def main_train_draft(
    *,
    weights_dir: str | Path = WEIGHTS_DIR,
    config: DraftTrainConfig = DraftTrainConfig(),
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Distill the digits draft from the shipped target and write its weights and manifest entry.

    Args:
        weights_dir: where ``digits_draft_unet.safetensors`` goes and whose ``manifest.json``
            gets its entry (the target's weights are read from the package).
        config: hyper-parameters.
        progress: a progress bar on stderr.
        log: receives one-line status messages.

    Returns:
        The training summary recorded in the manifest (without the loss curve).
    """
    weights_dir = Path(weights_dir)
    teacher = load_velocity()
    x, labels = load_digits_data()
    ratio = multiply_adds(DRAFT_CONFIG) / multiply_adds(UNetConfig())
    log(f"distilling the digits draft ({DRAFT_CONFIG.channels} channels, {1 / ratio:.1f}x fewer multiply-adds)")
    den, info = train_draft(teacher, x, labels, config, progress=progress)
    rms = held_out_delta(teacher, EDMDenoiserVelocity(den), config)
    log(f"draft: {info['steps_done']} steps in {info['seconds']:.0f} s, held-out rms delta {rms:.4f}")
    summary = {
        "config": asdict(config),
        "unet_config": DRAFT_CONFIG.to_dict(),
        "draft": {k: v for k, v in info.items() if k != "loss"},
        "held_out_rms_delta": rms,
        "multiply_adds": multiply_adds(DRAFT_CONFIG),
        "target_multiply_adds": multiply_adds(UNetConfig()),
        "parameters": sum(p.numel() for p in den.net.parameters()),
        "target_sha256": manifest()[UNET_FILE]["sha256"],
        "torch": torch.__version__,
    }
    ship_weights(den, weights_dir, DRAFT_FILE, summary)
    log(f"wrote {weights_dir / DRAFT_FILE}, {weights_dir / MANIFEST}")
    return summary
