"""Training of the shipped digits models (``specforest train digits``).

Two networks are trained on scikit-learn's digits (1797 images, ``1 x 8 x 8``,
scaled to ``[-1, 1]``), on the CPU:

* the class-conditional EDM denoiser (:mod:`specforest.models.unet`): EDM's loss
  ``lambda(s) |D(x_0 + s n; s, c) - x_0|^2`` with ``lambda = (s^2 + sd^2) / (s sd)^2``,
  noise levels ``ln s ~ N(P_mean, P_std^2)`` mixed with a log-uniform share over
  the sampler's whole clipped range ``[1e-3, 80]``, label dropout (for
  unconditional use), Adam with warm-up and cosine decay, and an exponential
  moving average of the weights, which is what ships;
* the evaluation classifier (:class:`specforest.models.digits.DigitsClassifier`),
  trained on a seeded 80 % split with one-pixel shifts and small noise as
  augmentation; its held-out accuracy is recorded.

Outputs: the two safetensors files and ``manifest.json`` (SHA-256, configuration,
training summary) in the weights directory, written atomically; a loss curve
``loss.png`` and ``train_log.json`` in the output directory. Nothing here runs at
import or at test time.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.nn import functional as F

from .. import sample
from ..models.digits import (
    CLASSIFIER_FILE,
    MANIFEST,
    UNET_FILE,
    WEIGHTS_DIR,
    DigitsClassifier,
    load_digits_data,
    manifest,
)
from ..models.edm import EDMDenoiserVelocity
from ..models.unet import EDMPrecond, UNet, UNetConfig
from .io import atomic_write, atomic_write_text

__all__ = [
    "TrainConfig",
    "loss_figure",
    "lr_at",
    "main_train",
    "optimizer_step",
    "safetensors_bytes",
    "sample_sigma",
    "train_classifier",
    "train_denoiser",
]


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of both trainings (recorded in the manifest).

    Attributes:
        steps: optimizer steps of the denoiser.
        batch: denoiser batch size.
        lr: peak Adam learning rate (linear warm-up, cosine decay to 5 %;
            gradients clipped to norm 1).
        warmup: warm-up steps.
        ema_decay: decay of the weights' moving average.
        p_mean, p_std: EDM's log-normal noise-level distribution.
        p_uniform: share of noise levels drawn log-uniformly on ``[1e-3, 80]``.
        label_dropout: probability of training a sample unconditionally.
        classifier_epochs: epochs of the classifier.
        seed: seed of initialization, batches and noise.
        max_minutes: wall-clock limit of the denoiser's training (stops early).
        eval_samples: class-conditional samples drawn with the standard sampler
            after training to measure the classifier's accuracy on them.
    """

    steps: int = 3000
    batch: int = 128
    lr: float = 2e-3
    warmup: int = 200
    ema_decay: float = 0.999
    p_mean: float = -1.2
    p_std: float = 1.2
    p_uniform: float = 0.2
    label_dropout: float = 0.1
    classifier_epochs: int = 60
    seed: int = 0
    max_minutes: float = 18.0
    eval_samples: int = 500


def lr_at(step: int, lr: float, warmup: int, steps: int) -> float:
    """The learning rate at ``step``: linear warm-up over ``warmup`` steps to ``lr``, then a cosine
    decay to 5 % of it at ``steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def optimizer_step(
    model: torch.nn.Module,
    ema: torch.nn.Module,
    opt: torch.optim.Optimizer,
    loss: torch.Tensor,
    step: int,
    lr: float,
    ema_decay: float,
) -> float:
    """One step of both trainings: ``opt`` at learning rate ``lr`` on ``loss`` (gradients clipped to
    norm 1), then ``ema``'s weights moved toward ``model``'s (decay ``min(ema_decay, (1 + step) /
    (10 + step))``). Returns the loss as a float."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    with torch.no_grad():
        decay = min(ema_decay, (1 + step) / (10 + step))
        for pe, pm in zip(ema.parameters(), model.parameters(), strict=True):
            pe.lerp_(pm, 1.0 - decay)
    return loss.item()


def sample_sigma(n: int, cfg: TrainConfig, g: torch.Generator) -> torch.Tensor:
    """``(n,)`` EDM training noise levels: ``ln s ~ N(cfg.p_mean, cfg.p_std^2)``, a share ``cfg.p_uniform``
    drawn log-uniformly on ``[1e-3, 80]`` instead, every draw from ``g``."""
    normal = (torch.randn(n, generator=g) * cfg.p_std + cfg.p_mean).exp()
    lo, hi = math.log(1e-3), math.log(80.0)
    unif = (torch.rand(n, generator=g) * (hi - lo) + lo).exp()
    return torch.where(torch.rand(n, generator=g) < cfg.p_uniform, unif, normal)


def train_denoiser(
    x: torch.Tensor,
    labels: torch.Tensor,
    cfg: TrainConfig,
    *,
    unet_config: Optional[UNetConfig] = None,
    progress: bool = True,
) -> tuple[EDMPrecond, dict]:
    """Train the EDM denoiser; returns the EMA model and ``{"loss": [...], ...}``.

    Args:
        x: ``(N, 1, H, W)`` training images in ``[-1, 1]``.
        labels: ``(N,)`` class labels.
        cfg: hyper-parameters.
        unet_config: the architecture (default: :class:`UNetConfig` at the images' resolution).
        progress: tqdm progress bar on stderr.
    """
    if unet_config is None:
        unet_config = UNetConfig(img_resolution=x.shape[-1])
    g = torch.Generator().manual_seed(cfg.seed)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        net = UNet(unet_config)
    model = EDMPrecond(net, sigma_data=unet_config.sigma_data)
    ema = copy.deepcopy(model).eval()
    ema.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sd2 = unet_config.sigma_data**2
    null = unet_config.num_classes
    losses: list[float] = []
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, desc="denoiser", unit="step")
    step = 0
    for step in range(cfg.steps):
        if time.perf_counter() - t0 > 60.0 * cfg.max_minutes:
            break
        idx = torch.randint(0, x.shape[0], (cfg.batch,), generator=g)
        x0, c = x[idx], labels[idx].clone()
        c[torch.rand(cfg.batch, generator=g) < cfg.label_dropout] = null
        s = sample_sigma(cfg.batch, cfg, g)
        n = torch.randn(x0.shape, generator=g)
        d = model(x0 + s[:, None, None, None] * n, s, c)
        w = (s * s + sd2) / (s * s * sd2)
        loss = (w[:, None, None, None] * (d - x0).square()).mean()
        lr = lr_at(step, cfg.lr, cfg.warmup, cfg.steps)
        losses.append(optimizer_step(model, ema, opt, loss, step, lr, cfg.ema_decay))
        if bar is not None:
            bar.update(1)
            if step % 50 == 0:
                bar.set_postfix(loss=f"{np.mean(losses[-200:]):.4f}")
    if bar is not None:
        bar.close()
    steps_done = len(losses)
    info = {
        "loss": losses,
        "steps_done": steps_done,
        "stopped_early": steps_done < cfg.steps,
        "seconds": time.perf_counter() - t0,
        "final_loss": float(np.mean(losses[-200:])),
    }
    return ema, info


def _augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One-pixel random shifts (background filled with -1) and small Gaussian noise."""
    n, _, h, w = x.shape
    pad = F.pad(x, (1, 1, 1, 1), value=-1.0)
    dy = torch.randint(0, 3, (n,), generator=g)
    dx = torch.randint(0, 3, (n,), generator=g)
    rows = (dy[:, None] + torch.arange(h)[None])[:, None, :, None].expand(n, 1, h, w + 2)
    out = pad.gather(2, rows)
    cols = (dx[:, None] + torch.arange(w)[None])[:, None, None, :].expand(n, 1, h, w)
    out = out.gather(3, cols)
    return (out + 0.1 * torch.randn(out.shape, generator=g)).clamp(-1.5, 1.5)


def train_classifier(
    x: torch.Tensor, labels: torch.Tensor, cfg: TrainConfig, *, progress: bool = True
) -> tuple[DigitsClassifier, dict]:
    """Train the evaluation classifier on a seeded 80 % split.

    Returns:
        The classifier in eval mode and ``{"test_accuracy", "train_accuracy", ...}``
        (held-out accuracy on the other 20 %).
    """
    g = torch.Generator().manual_seed(cfg.seed + 1)
    perm = torch.randperm(x.shape[0], generator=g)
    n_tr = int(0.8 * x.shape[0])
    tr, te = perm[:n_tr], perm[n_tr:]
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed + 1)
        clf = DigitsClassifier()
    opt = torch.optim.Adam(clf.parameters(), lr=2e-3, weight_decay=1e-4)
    t0 = time.perf_counter()
    it = range(cfg.classifier_epochs)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="classifier", unit="epoch")
    clf.train()
    for epoch in it:
        for group in opt.param_groups:
            group["lr"] = 2e-3 * 0.5 * (1 + math.cos(math.pi * epoch / cfg.classifier_epochs))
        order = tr[torch.randperm(n_tr, generator=g)]
        for i in range(0, n_tr, 64):
            b = order[i : i + 64]
            loss = F.cross_entropy(clf(_augment(x[b], g)), labels[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    clf.eval()
    clf.requires_grad_(False)
    info = {
        "train_accuracy": float((clf.predict(x[tr]) == labels[tr]).float().mean()),
        "test_accuracy": float((clf.predict(x[te]) == labels[te]).float().mean()),
        "test_size": int(te.numel()),
        "seconds": time.perf_counter() - t0,
    }
    return clf, info


def safetensors_bytes(module: torch.nn.Module, metadata: dict[str, str]) -> bytes:
    """``module``'s weights as safetensors bytes (contiguous CPU tensors) with ``metadata``."""
    from safetensors.torch import save

    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    return save(state, metadata=metadata)


def loss_figure(losses: list[float], path: Path, *, title: str = "digits denoiser training") -> None:
    """A PNG of a training's loss curve (batch losses and their running mean) at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    a = np.asarray(losses)
    ax.plot(a, lw=0.3, alpha=0.4, label="batch loss")
    k = min(100, max(1, a.size // 20))
    if a.size >= k:
        ax.plot(
            np.arange(k - 1, a.size),
            np.convolve(a, np.ones(k) / k, mode="valid"),
            lw=1.5,
            label=f"moving average ({k})",
        )
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("EDM loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()

    def write(f) -> None:
        fig.savefig(f, format="png", dpi=120)

    atomic_write(path, write, binary=True)
    plt.close(fig)


@torch.no_grad()
def _sample_accuracy(den: EDMPrecond, clf: DigitsClassifier, n: int, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 10
    xT = torch.randn(n, 1, 8, 8, generator=g)
    out = sample(
        EDMDenoiserVelocity(den),
        xT,
        steps=100,
        churn=0.3,
        grid="flow_match",
        generator=g,
        cond={"class_labels": labels},
    )
    return float((clf.predict(out.samples) == labels).float().mean())


def main_train(
    out_dir: str | Path = "results/train_digits",
    *,
    weights_dir: str | Path = WEIGHTS_DIR,
    config: TrainConfig = TrainConfig(),
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Train both digits networks and write the weights, manifest, log and loss curve.

    Args:
        out_dir: directory of ``loss.png`` and ``train_log.json``.
        weights_dir: where the safetensors files and ``manifest.json`` go (the
            package's ``models/weights`` by default).
        config: hyper-parameters.
        progress: progress bars on stderr.
        log: receives one-line status messages.

    Returns:
        The training summary written to ``train_log.json`` (without the loss curve).
    """
    out_dir, weights_dir = Path(out_dir), Path(weights_dir)
    t0 = time.perf_counter()
    x, labels = load_digits_data()
    log(f"training the denoiser on {x.shape[0]} digits, {config.steps} steps (limit {config.max_minutes} min)")
    ucfg = UNetConfig(img_resolution=x.shape[-1])
    den, dinfo = train_denoiser(x, labels, config, unet_config=ucfg, progress=progress)
    log(f"denoiser: {dinfo['steps_done']} steps in {dinfo['seconds']:.0f} s, final loss {dinfo['final_loss']:.4f}")
    clf, cinfo = train_classifier(x, labels, config, progress=progress)
    log(f"classifier: held-out accuracy {cinfo['test_accuracy']:.4f} ({cinfo['test_size']} images)")
    acc = _sample_accuracy(den, clf, config.eval_samples, config.seed + 2) if config.eval_samples else None
    if acc is not None:
        log(f"classifier accuracy on {config.eval_samples} standard-sampler samples (T=100, churn 0.3): {acc:.4f}")
    summary = {
        "config": asdict(config),
        "unet_config": ucfg.to_dict(),
        "denoiser": {k: v for k, v in dinfo.items() if k != "loss"},
        "classifier": cinfo,
        "sample_accuracy": acc,
        "parameters": sum(p.numel() for p in den.net.parameters()),
        "seconds_total": time.perf_counter() - t0,
        "torch": torch.__version__,
    }
    meta_common = {"train": json.dumps(summary)}
    files = {
        UNET_FILE: safetensors_bytes(den.net, {"config": json.dumps(ucfg.to_dict()), **meta_common}),
        CLASSIFIER_FILE: safetensors_bytes(
            clf, {"width": str(clf.width), "feature_dim": str(clf.feature_dim), **meta_common}
        ),
    }
    # the other files' entries (the learned draft's, ``specforest train digits-draft``) stay
    entries = manifest(weights_dir) if (weights_dir / MANIFEST).exists() else {}
    for name, data in files.items():
        atomic_write(weights_dir / name, lambda f, d=data: f.write(d), binary=True)
        entries[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    entries[UNET_FILE]["denoiser"] = summary["denoiser"]
    entries[UNET_FILE]["sample_accuracy"] = acc
    entries[CLASSIFIER_FILE]["classifier"] = cinfo
    atomic_write_text(weights_dir / MANIFEST, json.dumps(entries, indent=2) + "\n")
    loss_figure(dinfo["loss"], out_dir / "loss.png")
    atomic_write_text(out_dir / "train_log.json", json.dumps(summary, indent=2) + "\n")
    log(f"wrote {', '.join(str(weights_dir / n) for n in files)}, {weights_dir / MANIFEST}")
    log(f"wrote {out_dir / 'loss.png'}, {out_dir / 'train_log.json'}")
    return summary
