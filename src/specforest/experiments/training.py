"""The training loop every shipped network shares, with its checkpoints.

One loop (:func:`train_loop`) trains an EDM-preconditioned :class:`~specforest.models.unet.UNet` on a
loss the caller gives per batch (``loss_of(model, generator) -> scalar``): the natural-image
denoisers (:mod:`specforest.experiments.train_natural`), the digits draft and the natural drafts
(:mod:`specforest.experiments.train_digits_draft`, :mod:`specforest.experiments.train_natural_draft`).
The loop seeds the initialization and one generator (every draw of a batch comes from it), steps Adam
with warm-up and cosine decay (:func:`~specforest.experiments.train_digits.lr_at`,
:func:`~specforest.experiments.train_digits.optimizer_step`) and keeps the weights' moving average,
which is what a run returns.

With an output folder it is resumable: every ``checkpoint_every`` steps and when it stops it writes
:data:`CHECKPOINT` there (the network, its moving average, Adam's moments, the generator's state, the
step, the losses so far and the run's identity); started again with the same identity it continues to
the same weights, bit for bit, as a run never interrupted (same machine, same threads). No pickle is
written or read.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..models.digits import MANIFEST, manifest
from ..models.unet import EDMPrecond, UNet, UNetConfig
from .io import atomic_write, atomic_write_text
from .train_digits import lr_at, optimizer_step, safetensors_bytes

__all__ = ["CHECKPOINT", "LoopConfig", "checkpoint_bytes", "load_checkpoint", "ship_weights", "train_loop"]

CHECKPOINT = "checkpoint.safetensors"


@dataclass(frozen=True)
class LoopConfig:
    """What the loop itself reads of a run's configuration.

    Attributes:
        steps: optimizer steps.
        lr: peak Adam learning rate (linear warm-up, cosine decay to 5 %; gradients clipped to norm 1).
        warmup: warm-up steps.
        ema_decay: decay of the weights' moving average.
        seed: seed of the initialization and of the batches' generator.
        max_minutes: wall-clock limit of this invocation (it stops early, checkpointed where it can).
        checkpoint_every: steps between checkpoints (with an output folder).
    """

    steps: int
    lr: float
    warmup: int
    ema_decay: float
    seed: int
    max_minutes: float
    checkpoint_every: int = 100


def checkpoint_bytes(
    model: EDMPrecond, ema: EDMPrecond, opt: torch.optim.Optimizer, g: torch.Generator, meta: dict
) -> bytes:
    """A checkpoint's safetensors bytes: ``model``'s and ``ema``'s weights, Adam's state, ``g``'s
    state, and ``meta`` (JSON values) in the metadata."""
    from safetensors.torch import save

    tensors = {f"model.{k}": v for k, v in model.net.state_dict().items()}
    tensors.update({f"ema.{k}": v for k, v in ema.net.state_dict().items()})
    for i, st in opt.state_dict()["state"].items():
        tensors.update({f"opt.{i}.{k}": torch.as_tensor(v) for k, v in st.items()})
    tensors["rng"] = g.get_state()
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    return save(tensors, metadata={k: json.dumps(v) for k, v in meta.items()})


def load_checkpoint(
    path: Path, model: EDMPrecond, ema: EDMPrecond, opt: torch.optim.Optimizer, g: torch.Generator
) -> dict:
    """Restore a checkpoint of :func:`checkpoint_bytes` into the run's objects; returns its metadata."""
    from safetensors.torch import load

    tensors = load(path.read_bytes())
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = {k: json.loads(v) for k, v in json.loads(f.read(n))["__metadata__"].items()}
    model.net.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    ema.net.load_state_dict({k[4:]: v for k, v in tensors.items() if k.startswith("ema.")})
    state: dict[int, dict] = {}
    for k, v in tensors.items():
        if k.startswith("opt."):
            _, i, key = k.split(".", 2)
            state.setdefault(int(i), {})[key] = v
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
    g.set_state(tensors["rng"])
    return meta


def train_loop(
    loss_of: Callable[[EDMPrecond, torch.Generator], torch.Tensor],
    unet_config: UNetConfig,
    cfg: LoopConfig,
    *,
    out_dir: Optional[Path] = None,
    ident: Optional[dict] = None,
    desc: str = "train",
    postfix: str = "loss",
    postfix_window: int = 200,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> tuple[EDMPrecond, dict]:
    """Train a fresh EDM-preconditioned U-Net of ``unet_config`` on ``loss_of``; resume from
    ``out_dir``'s checkpoint when there is one.

    Args:
        loss_of: the loss of a batch, ``loss_of(model, g)``: it draws the batch from ``g`` (and only
            from it) and returns a scalar tensor with gradients to ``model``'s weights.
        unet_config: the network's architecture.
        cfg: the loop's settings.
        out_dir: the checkpoint's folder (``None``: no checkpoint, no resumption).
        ident: what a checkpoint must record to be resumed (JSON values; a checkpoint of another
            identity is refused).
        desc: the progress bar's name and the resumption message's.
        postfix: the progress bar's name for the mean loss of the last ``postfix_window`` steps.
        postfix_window: steps averaged by the progress bar and by the summary's ``final_loss``.
        progress: a progress bar on stderr.
        log: receives one-line status messages.

    Returns:
        The moving average (eval mode, gradients off) and ``{"steps_done", "stopped_early", "seconds",
        "final_loss", "loss"}`` (seconds summed over the resumed invocations, ``loss`` every step's).

    Raises:
        ValueError: if ``out_dir`` holds a checkpoint of another identity (nothing is written).
    """
    g = torch.Generator().manual_seed(cfg.seed)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        net = UNet(unet_config)
    model = EDMPrecond(net, sigma_data=unet_config.sigma_data)
    ema = copy.deepcopy(model).eval()
    ema.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    ckpt = None if out_dir is None else Path(out_dir) / CHECKPOINT
    start, losses, seconds = 0, [], 0.0
    if ckpt is not None and ckpt.is_file():
        meta = load_checkpoint(ckpt, model, ema, opt, g)
        if meta["run"] != ident:
            raise ValueError(
                f"{ckpt} was made by another configuration ({meta['run']}), not this one ({ident}): "
                "remove it to start afresh, or give another --out"
            )
        start, losses, seconds = meta["step"], meta["losses"], meta["seconds"]
        log(f"resuming {desc} from {ckpt} at step {start} of {cfg.steps}")
    t0 = time.perf_counter()

    def save(step: int) -> None:
        if ckpt is None:
            return
        meta = {"run": ident, "step": step, "losses": losses, "seconds": seconds + time.perf_counter() - t0}
        data = checkpoint_bytes(model, ema, opt, g, meta)
        atomic_write(ckpt, lambda f: f.write(data), binary=True)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=desc, unit="step")
    step = start
    model.train()
    while step < cfg.steps:
        if time.perf_counter() - t0 > 60.0 * cfg.max_minutes:
            break
        loss = loss_of(model, g)
        lr = lr_at(step, cfg.lr, cfg.warmup, cfg.steps)
        losses.append(optimizer_step(model, ema, opt, loss, step, lr, cfg.ema_decay))
        step += 1
        if bar is not None:
            bar.update(1)
            if step % 20 == 0:
                bar.set_postfix({postfix: f"{np.mean(losses[-postfix_window:]):.4f}"})
        if step % cfg.checkpoint_every == 0 and step < cfg.steps:
            save(step)
    if bar is not None:
        bar.close()
    save(step)
    info = {
        "steps_done": step,
        "stopped_early": step < cfg.steps,
        "seconds": seconds + time.perf_counter() - t0,
        "final_loss": float(np.mean(losses[-postfix_window:])) if losses else None,
    }
    return ema, {**info, "loss": losses}


def ship_weights(den: EDMPrecond, weights_dir: Path, file: str, summary: dict) -> dict:
    """Write ``den``'s network as ``weights_dir / file`` (safetensors, its architecture and ``summary`` in
    the metadata) and its manifest entry ``{"sha256", "bytes", **summary}``, merged with the entries
    already in ``weights_dir``'s manifest; both files atomically. Returns the entry."""
    data = safetensors_bytes(den.net, {"config": json.dumps(den.net.config.to_dict()), "train": json.dumps(summary)})
    weights_dir = Path(weights_dir)
    entries = manifest(weights_dir) if (weights_dir / MANIFEST).exists() else {}
    atomic_write(weights_dir / file, lambda f: f.write(data), binary=True)
    entries[file] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), **summary}
    atomic_write_text(weights_dir / MANIFEST, json.dumps(entries, indent=2) + "\n")
    return entries[file]
