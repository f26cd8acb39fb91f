"""Training of the natural-image models' learned drafts (``specforest train natural32-draft`` /
``natural64-draft``).

Each draft is a narrower copy of its target's U-Net (:attr:`specforest.models.natural.NaturalModel.draft_unet`),
distilled from the shipped target so that the sampler's mismatch is small where the sampler verifies it:

* states are training crops (:func:`specforest.models.natural.random_crops`) noised to
  ``x = x_0 + s n`` at a level ``s`` drawn uniformly among the verified (stochastic) steps of
  ``euler_ancestral`` on 50 Karras levels over ``[0.002, 80]`` (``rho = 7``), the sampler the
  natural models are measured with;
* the loss is the draft's squared mismatch over the step's noise scale,
  ``delta^2 = (c_s / (t_s scale_s))^2 |D_draft(x; s) - D_target(x; s)|^2 / D`` in the chain's own
  linear-path units (``mean = a y + c v``, ``v = (y - D) / t``: a clean-image error ``e`` moves the
  mean by ``c e / t``), the quantity a coupling's acceptance falls with (:func:`specforest.acceptance`),
  averaged over the verified steps (:func:`verified_levels`);
* the loop, its optimizer and checkpoints are the natural denoisers' (:func:`specforest.experiments.training.train_loop`):
  seeded, checkpointed in the output folder, resumed bit for bit.

At the end it measures the moving average's root-mean ``delta^2`` per noise band on held-out crops
(:func:`held_out_deltas`) and writes ``NAME_draft_unet.safetensors`` and its manifest entry (SHA-256,
architecture, multiply-adds per call against the target's, the target's digest, configuration,
training summary, evaluation) atomically, merged with the entries already there, and
``train_log.json`` in the output folder. Nothing here runs at import or at test time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from ..models.digits import MANIFEST, WEIGHTS_DIR, manifest, multiply_adds
from ..models.natural import (
    check_architecture,
    check_name,
    load_denoiser,
    load_draft_denoiser,
    load_images,
    random_crops,
)
from ..models.unet import EDMPrecond, UNetConfig
from ..validation import check_int, check_number
from .io import atomic_write_text
from .train_natural import evaluation_crops
from .training import LoopConfig, ship_weights, train_loop

__all__ = [
    "BANDS",
    "NaturalDraftConfig",
    "acceptance_run",
    "compare_drafts",
    "delta_squared",
    "delta_table",
    "held_out_deltas",
    "main_train_natural_draft",
    "trajectory_deltas",
    "verified_levels",
]

BANDS = ((0.002, 0.1), (0.1, 1.0), (1.0, 10.0), (10.0, 80.0))
"""The VE noise bands ``[lo, hi)`` (the last closed) the held-out mismatch is reported in."""


@dataclass(frozen=True)
class NaturalDraftConfig:
    """Hyper-parameters of a natural draft's distillation (recorded in the manifest and the checkpoint;
    a checkpoint resumes only under the configuration that made it, whatever the ``max_minutes``).

    Attributes:
        steps: optimizer steps.
        batch: noised crops per step.
        lr: peak Adam learning rate (linear warm-up, cosine decay to 5 %; gradients clipped to norm 1).
        warmup: warm-up steps.
        ema_decay: decay of the weights' moving average.
        sampler_steps: ``T`` of the ``euler_ancestral`` Karras grid whose verified levels are trained on.
        seed: seed of the initialization, the crops, the levels and the noise.
        max_minutes: wall-clock limit of this invocation's training (it stops early, checkpointed).
        checkpoint_every: steps between checkpoints.
        eval_crops: held-out crops the evaluation noises at every verified level (0: no evaluation).

    Raises:
        ValueError / TypeError: on a field out of its range, naming it.
    """

    steps: int = 2000
    batch: int = 16
    lr: float = 2e-3
    warmup: int = 100
    ema_decay: float = 0.998
    sampler_steps: int = 50
    seed: int = 0
    max_minutes: float = 15.0
    checkpoint_every: int = 100
    eval_crops: int = 64

    def __post_init__(self) -> None:
        for name, lo in (
            ("steps", 1),
            ("batch", 1),
            ("warmup", 1),
            ("sampler_steps", 2),
            ("seed", 0),
            ("checkpoint_every", 1),
            ("eval_crops", 0),
        ):
            check_int(name, getattr(self, name), lo)
        check_number("lr", self.lr, 0.0, lo_open=True)
        check_number("ema_decay", self.ema_decay, 0.0, 1.0)
        check_number("max_minutes", self.max_minutes, 0.0, lo_open=True)

    def loop(self) -> LoopConfig:
        """The loop's settings."""
        return LoopConfig(
            steps=self.steps,
            lr=self.lr,
            warmup=self.warmup,
            ema_decay=self.ema_decay,
            seed=self.seed,
            max_minutes=self.max_minutes,
            checkpoint_every=self.checkpoint_every,
        )

    def resumable_dict(self) -> dict:
        """The fields a checkpoint must agree on to be resumed."""
        d = asdict(self)
        for k in ("max_minutes", "checkpoint_every", "eval_crops"):
            d.pop(k)
        return d


def verified_levels(sampler_steps: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    """The VE noise levels ``s (S,)`` of the verified steps of ``euler_ancestral`` on ``sampler_steps``
    Karras levels over ``[0.002, 80]``, and each step's weight ``(c_s / (t_s scale_s))^2 (S,)``: the
    ``delta^2`` per unit mean-square error of a clean-image prediction (float32)."""
    from ..chains import EulerAncestral
    from ..kdiffusion.speculative import linear_grid
    from ..schedules import get_sigmas_karras

    tab = (
        EulerAncestral().build(linear_grid(get_sigmas_karras(sampler_steps, 0.002, 80.0))).tables("cpu", torch.float64)
    )
    on = tab.stochastic
    t = tab.sig[:-1][on]
    w = (tab.c[on] / (t * tab.scale[on])).square()
    return (t / (1.0 - t)).float(), w.float()


def delta_squared(
    draft: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    target: torch.Tensor,
    x: torch.Tensor,
    sigma: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    """``delta^2 (M,)`` of ``draft``'s prediction at the noised states ``x: (M, 3, H, W)`` of levels
    ``sigma: (M,)`` against the target's ``target: (M, 3, H, W)``, the steps' weights ``weight: (M,)``."""
    return weight * (draft(x, sigma) - target).square().flatten(1).mean(1)


def held_out_deltas(
    target: EDMPrecond, draft: EDMPrecond, name: str, cfg: NaturalDraftConfig, *, batch: int = 64
) -> list[dict]:
    """Root-mean ``delta^2`` of ``draft`` against ``target`` per band of :data:`BANDS` on
    ``cfg.eval_crops`` held-out crops (seed ``cfg.seed``), each noised at every verified level (the
    noise drawn from seed ``cfg.seed + 1``). Returns ``[{"lo", "hi", "steps", "rms_delta"}, ...]``."""
    crops = evaluation_crops(name, "held_out", cfg.eval_crops, cfg.seed)
    sig, w = verified_levels(cfg.sampler_steps)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    per_level = []
    with torch.no_grad():
        for s, ws in zip(sig.tolist(), w.tolist(), strict=True):
            d2 = []
            for i in range(0, crops.shape[0], batch):
                x0 = crops[i : i + batch]
                sv = torch.full((x0.shape[0],), s)
                x = x0 + s * torch.randn(x0.shape, generator=g)
                d2.append(delta_squared(draft, target(x, sv), x, sv, torch.full_like(sv, ws)))
            per_level.append(float(torch.cat(d2).mean()))
    return _bands(sig.tolist(), per_level)


def _bands(sig: list[float], d2: list[float]) -> list[dict]:
    """Root-mean of ``d2`` (a ``delta^2`` per level ``sig``) per band of :data:`BANDS`."""
    out = []
    for lo, hi in BANDS:
        sel = [d for s, d in zip(sig, d2, strict=True) if lo <= s < hi or (hi == BANDS[-1][1] and s == hi)]
        out.append({"lo": lo, "hi": hi, "steps": len(sel), "rms_delta": (sum(sel) / len(sel)) ** 0.5})
    return out


@torch.no_grad()
def compare_drafts(name: str, *, trajectories: int = 2, sampler_steps: int = 50, depth: int = 8, seed: int = 0) -> dict:
    """The shipped draft of ``name`` beside the frozen ``velocity`` draft and the ``cached`` self-draft,
    on ``euler_ancestral`` with ``sampler_steps`` Karras levels over ``[0.002, 80]``.

    Two measurements:

    * ``deltas``: on the standard sampler's own trajectories (``trajectories`` of them, seeded), at each
      verified step ``s + 1`` the mismatch of each draft of the target's prediction there, drafted from
      the target's evaluation at step ``s`` (a depth-2 problem of a round anchored at step ``s``): the
      velocity draft's ``y_{s+1} - t_{s+1} v_s`` (linear-path units), the cached draft's target with its
      deep features from step ``s`` (its ``shallow`` call), and the learned draft anchored as
      :class:`~specforest.drafts.LearnedDraft` anchors it, ``D_s + f(x_{s+1}) - f(x_s)``; root-mean
      ``delta^2`` per band of :data:`BANDS`, the same states for every draft;
    * ``runs``: the RMC chain of ``depth`` with each draft through the drop-in (``seed``), its pooled
      acceptance rate, steps per target call (``T / NFE``) and target and draft calls.
    """
    target = load_denoiser(name)
    return {
        **trajectory_deltas(target, load_draft_denoiser(name), trajectories, sampler_steps, seed),
        "runs": {
            d: acceptance_run(target, d, trajectories, sampler_steps, depth, seed)
            for d in ("velocity", "cached", "learned")
        },
        "trajectories": trajectories,
        "depth": depth,
        "steps": sampler_steps,
    }


@torch.no_grad()
def trajectory_deltas(
    target: EDMPrecond, draft: EDMPrecond, trajectories: int, sampler_steps: int, seed: int
) -> dict[str, dict[str, list[dict]]]:
    """``{"deltas": {draft: bands}}``: the first measurement of :func:`compare_drafts`, of the draft
    network ``draft`` of the target ``target``."""
    from ..chains import EulerAncestral
    from ..kdiffusion import linear_grid, sample_euler_ancestral
    from ..schedules import get_sigmas_karras
    from ..streams import randn

    sigmas = get_sigmas_karras(sampler_steps, 0.002, 80.0).double()
    tab = EulerAncestral().build(linear_grid(sigmas)).tables("cpu", torch.float64)
    x0 = randn(seed, torch.arange(trajectories), target.net.state_shape) * float(sigmas[0])
    states: list[torch.Tensor] = []
    sample_euler_ancestral(
        target, x0, sigmas, callback=lambda d: states.append(d["x"].clone()), disable=True, seed=seed
    )
    errs: dict[str, list[float]] = {"velocity": [], "cached": [], "learned": []}
    levels = []
    for s in range(sampler_steps - 1):
        if not bool(tab.stochastic[s + 1]):
            continue
        sa, sb = float(sigmas[s]), float(sigmas[s + 1])
        xa, xb = states[s], states[s + 1]
        da, feat = target.deep(xa, torch.full((trajectories,), sa))
        db = target(xb, torch.full((trajectories,), sb))
        ta, tb = sa / (1 + sa), sb / (1 + sb)
        ya, yb = xa / (1 + sa), xb / (1 + sb)
        guesses = {
            "velocity": yb - tb * (ya - da) / ta,
            "cached": target.shallow(xb, torch.full((trajectories,), sb), feat),
            "learned": da + draft(xb, torch.full((trajectories,), sb)) - draft(xa, torch.full((trajectories,), sa)),
        }
        w = float((tab.c[s + 1] / (tab.sig[s + 1] * tab.scale[s + 1])).square())
        for k, guess in guesses.items():
            errs[k].append(w * float((guess - db).square().mean()))
        levels.append(sb)
    return {"deltas": {k: _bands(levels, v) for k, v in errs.items()}}


@torch.no_grad()
def acceptance_run(
    target: EDMPrecond, draft: str, trajectories: int, sampler_steps: int, depth: int, seed: int
) -> dict:
    """The second measurement of :func:`compare_drafts` for one ``draft`` name: ``{"acceptance",
    "steps_per_call", "calls", "draft_calls"}``."""
    from ..kdiffusion import sample
    from ..schedules import get_sigmas_karras
    from ..streams import randn
    from ..trees import chain

    sigmas = get_sigmas_karras(sampler_steps, 0.002, 80.0).double()
    x0 = randn(seed, torch.arange(trajectories), target.net.state_shape) * float(sigmas[0])
    out = sample(target, x0, sigmas, chain="euler_ancestral", tree=chain(depth), coupling="rmc", draft=draft,
                 seed=seed, disable=True)  # fmt: skip
    st = out.stats
    return {
        "acceptance": float(st.accepts.sum() / st.attempts.sum()),
        "steps_per_call": float(st.speedup.mean()),
        "calls": int(st.calls),
        "draft_calls": int(st.draft_calls),
    }


def delta_table(rows: dict[str, list[dict]]) -> str:
    """A Markdown table of :func:`held_out_deltas`-shaped results, one column per named draft."""
    names = list(rows)
    first = rows[names[0]]
    lines = [
        "| VE sigma band | verified steps | " + " | ".join(names) + " |",
        "|---|---:|" + "---:|" * len(names),
    ]
    for i, band in enumerate(first):
        vals = " | ".join(f"{rows[n][i]['rms_delta']:.3g}" for n in names)
        lines.append(f"| [{band['lo']:g}, {band['hi']:g}) | {band['steps']} | {vals} |")
    return "\n".join(lines)


def main_train_natural_draft(
    name: str,
    out_dir: str | Path | None = None,
    *,
    weights_dir: str | Path = WEIGHTS_DIR,
    config: Optional[NaturalDraftConfig] = None,
    unet_config: Optional[UNetConfig] = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Distill (or resume distilling) model ``name``'s learned draft from its shipped target, evaluate it
    and write its weights, manifest entry and log.

    Args:
        name: ``"natural32"`` or ``"natural64"``.
        out_dir: folder of the checkpoint and ``train_log.json`` (default ``results/train_NAME-draft``).
        weights_dir: where ``NAME_draft_unet.safetensors`` goes and whose ``manifest.json`` gets its
            entry (the target's weights are read from the package).
        config: hyper-parameters (default: :class:`NaturalDraftConfig` with the model's ``draft_steps``
            and ``draft_batch``).
        unet_config: the draft's architecture (default: the model's ``draft_unet``).
        progress: a progress bar on stderr.
        log: receives one-line status messages.

    Returns:
        The summary written to ``train_log.json`` and the manifest (without the loss curve).

    Raises:
        ValueError: on another ``name``, an architecture that does not serve ``name``'s images, or a
            checkpoint in ``out_dir`` made by another configuration (nothing is written).
    """
    spec = check_name(name)
    config = NaturalDraftConfig(steps=spec.draft_steps, batch=spec.draft_batch) if config is None else config
    unet_config = spec.draft_unet if unet_config is None else unet_config
    check_architecture(name, unet_config)
    out_dir = Path(f"results/train_{name}-draft" if out_dir is None else out_dir)
    weights_dir = Path(weights_dir)
    target = load_denoiser(name)
    macs, target_macs = multiply_adds(unet_config), multiply_adds(target.net.config)
    log(
        f"distilling {name}'s draft (channels {unet_config.channels}, {target_macs / macs:.1f}x fewer multiply-adds "
        f"than the target): {config.steps} steps of {config.batch} states (limit {config.max_minutes} min this run)"
    )
    res = spec.resolution
    pyramids = load_images(res, "train")
    sig, w = verified_levels(config.sampler_steps)

    def loss_of(model: EDMPrecond, g: torch.Generator) -> torch.Tensor:
        x0 = random_crops(pyramids, config.batch, res, g)
        k = torch.randint(0, sig.numel(), (config.batch,), generator=g)
        s = sig[k]
        x = x0 + s[:, None, None, None] * torch.randn(x0.shape, generator=g)
        with torch.no_grad():
            d_target = target(x, s)
        return delta_squared(model, d_target, x, s, w[k]).mean()

    ident = {"name": f"{name}-draft", "config": config.resumable_dict(), "unet_config": unet_config.to_dict()}
    den, info = train_loop(
        loss_of,
        unet_config,
        config.loop(),
        out_dir=out_dir,
        ident=ident,
        desc=f"{name}-draft",
        postfix="delta2",
        progress=progress,
        log=log,
    )
    log(f"{name}-draft: {info['steps_done']} steps in {info['seconds']:.0f} s, final delta^2 {info['final_loss']}")
    bands = held_out_deltas(target, den, name, config) if config.eval_crops else None
    if bands is not None:
        log(delta_table({"learned": bands}))
    summary = {
        "name": f"{name}-draft",
        "config": asdict(config),
        "unet_config": unet_config.to_dict(),
        "training": {k: v for k, v in info.items() if k != "loss"},
        "held_out_rms_delta": bands,
        "multiply_adds": macs,
        "target_multiply_adds": target_macs,
        "parameters": sum(p.numel() for p in den.net.parameters()),
        "target_sha256": manifest()[spec.file]["sha256"],
        "torch": torch.__version__,
    }
    ship_weights(den, weights_dir, spec.draft_file, summary)
    atomic_write_text(out_dir / "train_log.json", json.dumps({**summary, "loss": info["loss"]}, indent=2) + "\n")
    log(f"wrote {weights_dir / spec.draft_file}, {weights_dir / MANIFEST}, {out_dir / 'train_log.json'}")
    return summary
