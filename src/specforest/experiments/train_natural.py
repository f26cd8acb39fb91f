"""Training of the shipped natural-image denoisers (``specforest train natural32`` / ``natural64``).

The EDM denoiser of :mod:`specforest.models.natural` is trained, unconditionally, on random
crops of the training photographs (:func:`specforest.models.natural.random_crops`: a random
image, scale, position and horizontal flip), on the CPU, with the digits model's recipe
(:mod:`specforest.experiments.train_digits`): EDM's loss
``lambda(s) |D(x_0 + s n; s) - x_0|^2``, ``lambda = (s^2 + sd^2) / (s sd)^2``, noise levels
``ln s ~ N(P_mean, P_std^2)`` mixed with a log-uniform share over ``[1e-3, 80]``, Adam with
warm-up and cosine decay, gradients clipped to norm 1, and an exponential moving average of the
weights, which is what ships.

A run is seeded and resumable: every ``checkpoint_every`` steps, and when it stops (its
``max_minutes`` reached, or its steps done), it writes ``checkpoint.safetensors`` in its output
folder: the network, its moving average, Adam's moments, the crop-and-noise generator's state,
the step and the losses so far. A run started again with the same configuration continues from it,
to the same weights bit for bit as a run that was never interrupted (same machine, same threads).
No pickle is written or read.

At the end it evaluates the moving average (:func:`denoising_losses`: the loss per noise level on
crops of the held-out photographs and of the training ones, beside the losses of the identity
``D(x) = x``, of zero and of the training data's mean), writes the weights file and its manifest entry
(SHA-256, architecture, configuration, training summary, evaluation) atomically into the weights
folder, and ``train_log.json``, ``loss.png`` and ``samples.png`` (:func:`samples_figure`) into the
output folder. Nothing here runs at import or at test time.
"""

from __future__ import annotations

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

from ..models.digits import MANIFEST, WEIGHTS_DIR, manifest
from ..models.natural import check_architecture, check_name, load_images, random_crops
from ..models.unet import EDMPrecond, UNet, UNetConfig
from ..plots import pyplot
from .io import atomic_write, atomic_write_text
from .train_digits import loss_figure, safetensors_bytes, sample_sigma
from .training import CHECKPOINT, LoopConfig, train_loop

__all__ = [
    "CHECKPOINT",
    "EVAL_SIGMAS",
    "NaturalTrainConfig",
    "denoising_losses",
    "evaluate",
    "evaluation_crops",
    "loss_table",
    "main_train_natural",
    "sample_images",
    "samples_figure",
]

EVAL_SIGMAS = (0.002, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 80.0)
"""The VE noise levels of the evaluation: the sampler's whole range ``[0.002, 80]``."""


@dataclass(frozen=True)
class NaturalTrainConfig:
    """Hyper-parameters of a natural-image training run (recorded in the manifest and the
    checkpoint; a checkpoint resumes only under the configuration that made it, whatever the
    ``max_minutes``).

    Attributes:
        steps: optimizer steps.
        batch: crops per step.
        lr: peak Adam learning rate (linear warm-up, cosine decay to 5 %).
        warmup: warm-up steps.
        ema_decay: decay of the weights' moving average.
        p_mean, p_std: EDM's log-normal noise-level distribution.
        p_uniform: share of noise levels drawn log-uniformly on ``[1e-3, 80]``.
        seed: seed of the initialization, the crops and the noise.
        max_minutes: wall-clock limit of this invocation's training (it stops early, checkpointed;
            the evaluation and the files come after it).
        checkpoint_every: steps between checkpoints.
        eval_crops: crops of each split (held-out, train) the evaluation measures.
        figure_samples: samples in ``samples.png`` (0: no figure).
    """

    steps: int = 2000
    batch: int = 32
    lr: float = 2e-3
    warmup: int = 100
    ema_decay: float = 0.998
    p_mean: float = -1.2
    p_std: float = 1.2
    p_uniform: float = 0.2
    seed: int = 0
    max_minutes: float = 50.0
    checkpoint_every: int = 100
    eval_crops: int = 256
    figure_samples: int = 16

    def resumable_dict(self) -> dict:
        """The fields a checkpoint must agree on to be resumed: all but the time limit, the
        checkpoint interval and what the evaluation measures."""
        d = asdict(self)
        for k in ("max_minutes", "checkpoint_every", "eval_crops", "figure_samples"):
            d.pop(k)
        return d


def evaluation_crops(name: str, split: str, n: int, seed: int = 0) -> torch.Tensor:
    """``(n, 3, H, W)`` crops of ``split`` (``"held_out"`` or ``"train"``) photographs at model
    ``name``'s resolution, drawn as training draws them from a generator seeded with ``seed``
    (offset per split, so the two splits' draws differ)."""
    res = check_name(name).resolution
    g = torch.Generator().manual_seed(seed + (1 if split == "held_out" else 2) * 1_000_003)
    return random_crops(load_images(res, split), n, res, g)


@torch.no_grad()
def denoising_losses(
    denoiser: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    crops: torch.Tensor,
    sigmas: tuple[float, ...] = EVAL_SIGMAS,
    *,
    mean: Optional[torch.Tensor] = None,
    sigma_data: float = 0.5,
    seed: int = 0,
    batch: int = 64,
) -> list[dict]:
    """The EDM loss of ``denoiser`` per noise level on ``crops``, beside two baselines.

    At each ``s`` the loss is ``mean over crops and pixels of lambda(s) (D(x_0 + s n; s) - x_0)^2``,
    ``lambda = (s^2 + sd^2) / (s sd)^2`` (the training loss at that level), with the noise ``n``
    drawn from ``seed`` (the same for every level and every denoiser). The baselines: the identity
    ``D(y) = y`` (loss ``lambda s^2 E n^2``), zero ``D(y) = 0`` (``lambda E x_0^2``) and the mean
    ``D(y) = mean`` (``lambda E (x_0 - mean)^2``); the best of them is what a denoiser that learned
    nothing of the images' structure reaches at each level (the identity wins at low noise, zero
    or the mean at high noise).

    Args:
        denoiser: ``D(y: (M, C, H, W), s: (M,)) -> (M, C, H, W)``.
        crops: ``(N, C, H, W)`` clean images.
        sigmas: the noise levels.
        mean: ``(C,)`` per-channel mean of the data (default: the crops' own).
        sigma_data: EDM's ``sd``.
        seed: the noise's seed.
        batch: crops per call.

    Returns:
        One record per level: ``sigma``, ``model``, ``identity``, ``zero``, ``mean`` and ``ratio``
        (the model's loss over the best baseline's).
    """
    crops = crops.float()
    mean = crops.mean(dim=(0, 2, 3)) if mean is None else torch.as_tensor(mean, dtype=torch.float32)
    noise = torch.randn(crops.shape, generator=torch.Generator().manual_seed(seed))
    sd2 = sigma_data**2
    out = []
    for s in sigmas:
        lam = (s * s + sd2) / (s * s * sd2)
        err = 0.0
        for i in range(0, crops.shape[0], batch):
            x0 = crops[i : i + batch]
            y = x0 + s * noise[i : i + batch]
            d = denoiser(y, torch.full((x0.shape[0],), float(s)))
            err += float((d.float() - x0).square().sum())
        model = lam * err / crops.numel()
        ident = lam * s * s * float(noise.square().mean())
        zero = lam * float(crops.square().mean())
        mean_loss = lam * float((crops - mean[None, :, None, None]).square().mean())
        out.append(
            {
                "sigma": float(s),
                "model": model,
                "identity": ident,
                "zero": zero,
                "mean": mean_loss,
                "ratio": model / min(ident, zero, mean_loss),
            }
        )
    return out


def evaluate(den: EDMPrecond, name: str, n: int, *, seed: int = 0) -> dict:
    """:func:`denoising_losses` on ``n`` held-out and ``n`` training crops of model ``name``, the
    baseline mean being the training crops' per-channel mean. Returns
    ``{"held_out": [...], "train": [...], "crops": n, "mean": [...]}``."""
    train = evaluation_crops(name, "train", n, seed)
    held = evaluation_crops(name, "held_out", n, seed)
    mean = train.mean(dim=(0, 2, 3))
    kw = {"mean": mean, "sigma_data": den.sigma_data, "seed": seed + 7}
    return {
        "held_out": denoising_losses(den, held, **kw),
        "train": denoising_losses(den, train, **kw),
        "crops": n,
        "mean": [float(m) for m in mean],
    }


def loss_table(evaluation: dict) -> str:
    """A Markdown table of an :func:`evaluate` result: per level the held-out and training losses,
    the baselines on the held-out crops, and each split's loss over its best baseline."""
    lines = [
        "| sigma | held-out | train | identity | zero | mean | held-out / best baseline | train / best baseline |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for h, t in zip(evaluation["held_out"], evaluation["train"], strict=True):
        lines.append(
            f"| {h['sigma']:g} | {h['model']:.3f} | {t['model']:.3f} | {h['identity']:.3f} | {h['zero']:.3f} "
            f"| {h['mean']:.3f} | {h['ratio']:.2f} | {t['ratio']:.2f} |"
        )
    return "\n".join(lines)


@torch.no_grad()
def sample_images(den: EDMPrecond, n: int, *, steps: int = 50, seed: int = 0) -> torch.Tensor:
    """``(n, 3, H, W)`` samples of ``den`` by :func:`specforest.kdiffusion.sample_euler_ancestral`,
    ``steps`` Karras steps on ``[0.002, 80]``, seeded (the drop-in's per-sample streams)."""
    from ..kdiffusion import get_sigmas_karras, sample_euler_ancestral

    shape = den.net.state_shape
    sigmas = get_sigmas_karras(steps, 0.002, 80.0)
    x = torch.randn((n, *shape), generator=torch.Generator().manual_seed(seed)) * sigmas[0]
    return sample_euler_ancestral(den, x, sigmas, disable=True, seed=seed)


def samples_figure(
    den: EDMPrecond, name: str, path: str | Path, *, n: int = 16, steps: int = 50, seed: int = 0
) -> Path:
    """Write a PNG of ``n`` samples (:func:`sample_images`) beside ``n`` real held-out crops."""
    plt = pyplot()
    samples = sample_images(den, n, steps=steps, seed=seed)
    real = evaluation_crops(name, "held_out", n, seed)
    cols = int(math.ceil(math.sqrt(n)))
    rows = int(math.ceil(n / cols))

    def grid(x: torch.Tensor) -> np.ndarray:
        x = ((x.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1).numpy()
        _, h, w, c = x.shape
        g = np.ones((rows * (h + 2), cols * (w + 2), c), dtype=np.float32)
        for i in range(x.shape[0]):
            r, q = divmod(i, cols)
            g[r * (h + 2) + 1 : r * (h + 2) + 1 + h, q * (w + 2) + 1 : q * (w + 2) + 1 + w] = x[i]
        return g

    fig, axes = plt.subplots(1, 2, figsize=(10, 5.4))
    for ax, img, title in (
        (axes[0], grid(samples), f"{name}: {n} samples (euler_ancestral, {steps} Karras steps)"),
        (axes[1], grid(real), f"{n} real held-out crops"),
    ):
        ax.imshow(img, interpolation="nearest")
        ax.set_title(title, fontsize=9)
        ax.axis("off")
    fig.tight_layout()
    atomic_write(Path(path), lambda f: fig.savefig(f, format="png", dpi=110), binary=True)
    plt.close(fig)
    return Path(path)


def _train(
    name: str,
    cfg: NaturalTrainConfig,
    unet_config: UNetConfig,
    out_dir: Path,
    *,
    progress: bool,
    log: Callable[[str], None],
) -> tuple[EDMPrecond, dict]:
    """The training loop (:func:`~specforest.experiments.training.train_loop`), from the checkpoint in
    ``out_dir`` when there is one (of ``cfg``)."""
    res = check_name(name).resolution
    pyramids = load_images(res, "train")
    sd2 = unet_config.sigma_data**2

    def loss_of(model: EDMPrecond, g: torch.Generator) -> torch.Tensor:
        # (the crops come through the module's name, which the interruption test replaces)
        x0 = random_crops(pyramids, cfg.batch, res, g)
        s = sample_sigma(cfg.batch, cfg, g)
        n = torch.randn(x0.shape, generator=g)
        d = model(x0 + s[:, None, None, None] * n, s)
        w = (s * s + sd2) / (s * s * sd2)
        return (w[:, None, None, None] * (d - x0).square()).mean()

    loop = LoopConfig(
        steps=cfg.steps,
        lr=cfg.lr,
        warmup=cfg.warmup,
        ema_decay=cfg.ema_decay,
        seed=cfg.seed,
        max_minutes=cfg.max_minutes,
        checkpoint_every=cfg.checkpoint_every,
    )
    ident = {"name": name, "config": cfg.resumable_dict(), "unet_config": unet_config.to_dict()}
    return train_loop(loss_of, unet_config, loop, out_dir=out_dir, ident=ident, desc=name, progress=progress, log=log)


def main_train_natural(
    name: str,
    out_dir: str | Path | None = None,
    *,
    weights_dir: str | Path = WEIGHTS_DIR,
    config: Optional[NaturalTrainConfig] = None,
    unet_config: Optional[UNetConfig] = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Train (or resume) model ``name``, evaluate it and write its weights, manifest entry and logs.

    Args:
        name: ``"natural32"`` or ``"natural64"``.
        out_dir: folder of the checkpoint, ``train_log.json``, ``loss.png`` and ``samples.png``
            (default ``results/train_NAME``).
        weights_dir: where the safetensors file goes and whose ``manifest.json`` gets its entry
            (the package's ``models/weights`` by default; the other entries stay).
        config: hyper-parameters (default: :class:`NaturalTrainConfig` with the model's ``steps`` and
            ``batch``, :data:`specforest.models.natural.MODELS`).
        unet_config: the architecture (default: the model's).
        progress: a progress bar on stderr.
        log: receives one-line status messages (the loss table among them).

    Returns:
        The summary written to ``train_log.json`` (without the loss curve).

    Raises:
        ValueError: on another ``name``, an architecture that does not serve ``name``'s images, or
            a checkpoint in ``out_dir`` made by another configuration.
    """
    spec = check_name(name)
    config = NaturalTrainConfig(steps=spec.steps, batch=spec.batch) if config is None else config
    unet_config = spec.unet if unet_config is None else unet_config
    check_architecture(name, unet_config)
    out_dir = Path(f"results/train_{name}" if out_dir is None else out_dir)
    weights_dir = Path(weights_dir)
    log(
        f"training {name} ({sum(p.numel() for p in UNet(unet_config).parameters())} parameters, "
        f"channels {unet_config.channels}): {config.steps} steps of {config.batch} crops "
        f"(limit {config.max_minutes} min this run)"
    )
    den, info = _train(name, config, unet_config, out_dir, progress=progress, log=log)
    log(f"{name}: {info['steps_done']} steps in {info['seconds']:.0f} s, final loss {info['final_loss']}")
    t_eval = time.perf_counter()
    ev = evaluate(den, name, config.eval_crops, seed=config.seed) if config.eval_crops else None
    if ev is not None:
        log(
            f"{name}: EDM loss per noise level on {config.eval_crops} crops (seconds {time.perf_counter() - t_eval:.0f})"
        )
        log(loss_table(ev))
    summary = {
        "name": name,
        "config": asdict(config),
        "unet_config": unet_config.to_dict(),
        "training": {k: v for k, v in info.items() if k != "loss"},
        "evaluation": ev,
        "parameters": sum(p.numel() for p in den.net.parameters()),
        "torch": torch.__version__,
    }
    data = safetensors_bytes(den.net, {"config": json.dumps(unet_config.to_dict()), "train": json.dumps(summary)})
    entries = manifest(weights_dir) if (weights_dir / MANIFEST).exists() else {}
    atomic_write(weights_dir / spec.file, lambda f: f.write(data), binary=True)
    entries[spec.file] = {
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
        "config": asdict(config),
        "unet_config": unet_config.to_dict(),
        "training": summary["training"],
        "evaluation": ev,
        "parameters": summary["parameters"],
        "torch": torch.__version__,
    }
    atomic_write_text(weights_dir / MANIFEST, json.dumps(entries, indent=2) + "\n")
    loss_figure(info["loss"], out_dir / "loss.png", title=f"{name} denoiser training")
    written = [str(weights_dir / spec.file), str(weights_dir / MANIFEST), str(out_dir / "loss.png")]
    if config.figure_samples:
        samples_figure(den, name, out_dir / "samples.png", n=config.figure_samples, seed=config.seed)
        written.append(str(out_dir / "samples.png"))
    atomic_write_text(out_dir / "train_log.json", json.dumps(summary, indent=2) + "\n")
    log(f"wrote {', '.join(written)}, {out_dir / 'train_log.json'}")
    return summary
