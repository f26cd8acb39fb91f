"""Draft diagnostics: mismatch and acceptance per step and per depth for each draft kind.

For each frozen-prediction kind the target is sampled on a deep chain in lazy
mode with every verification recorded (``record_deltas``); the figure shows
the mean ``delta`` and the acceptance rate of the coupling against the step
and against the depth in the round. Works for the paper's Gaussian mixture and
for the shipped digits model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .. import sample, trees
from ..plots import pyplot, save_figure
from ..proposals import DRAFT_KINDS
from .gmm import GMMSetting, initial_states

__all__ = ["MODELS", "draft_diagnostics", "plot_draft_diagnostics"]

MODELS = ("gmm", "digits")


def _target(model: str, n: int, seed: int):
    if model == "gmm":
        s = GMMSetting(trajectories=n)
        return s.mixture(), initial_states(n, s.dim, seed), {}, s.steps, s.churn
    from ..models.digits import load_velocity
    from .pixel import initial_states as pixel_states

    x, labels = pixel_states(n, seed)
    return load_velocity(), x, {"class_labels": labels}, 100, 0.3


def draft_diagnostics(
    model: str = "gmm", kinds: Sequence[str] = DRAFT_KINDS, trajectories: int = 50, depth: int = 10, seed: int = 0
) -> dict[str, dict[str, np.ndarray]]:
    """Per kind: mean ``delta`` and acceptance per step and per depth of a lazy chain run.

    Args:
        model: ``gmm`` (the paper's setting) or ``digits`` (T = 100, churn 0.3).
        kinds: draft kinds to compare.
        trajectories: trajectories per kind (>= 1).
        depth: chain length (>= 1).
        seed: seed of the initial states and the sampling noise.

    Returns:
        ``{kind: {"step", "delta_step", "accept_step", "depth", "delta_depth",
        "accept_depth", "speedup"}}`` arrays (NaN where nothing was verified).
    """
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    out = {}
    for kind in kinds:
        fn, x, kw, steps, churn = _target(model, trajectories, seed)
        res = sample(
            fn,
            x,
            steps=steps,
            churn=churn,
            tree=trees.chain(depth),
            coupling="grs",
            draft=kind,
            lazy=True,
            record_deltas=True,
            cond=kw,
            generator=torch.Generator().manual_seed(seed + 1),
        )
        d = res.stats.deltas.numpy()
        rows = {}
        for name, col, n in (("step", 1, steps), ("depth", 0, depth + 1)):
            idx = d[:, col].astype(int)
            cnt = np.bincount(idx, minlength=n).astype(float)
            with np.errstate(invalid="ignore", divide="ignore"):
                rows[f"delta_{name}"] = np.bincount(idx, weights=d[:, 2], minlength=n) / cnt
                rows[f"accept_{name}"] = np.bincount(idx, weights=d[:, 3], minlength=n) / cnt
            rows[name] = np.arange(n)
        rows["speedup"] = float(res.stats.speedup.mean())
        out[kind] = rows
    return out


def plot_draft_diagnostics(results: dict, path: str | Path, title: str = "") -> Path:
    """Four panels: delta and acceptance against the step and against the depth."""
    plt = pyplot()

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    for kind, r in results.items():
        label = f"{kind} (T/NFE {r['speedup']:.2f})"
        axes[0, 0].plot(r["step"], r["delta_step"], "o-", ms=3, label=label)
        axes[1, 0].plot(r["step"], r["accept_step"], "o-", ms=3, label=label)
        axes[0, 1].plot(r["depth"][1:], r["delta_depth"][1:], "o-", ms=3, label=label)
        axes[1, 1].plot(r["depth"][1:], r["accept_depth"][1:], "o-", ms=3, label=label)
    axes[0, 0].set_ylabel(r"mean $\delta$")
    axes[1, 0].set_ylabel("acceptance")
    axes[1, 0].set_xlabel("step of the verified parent")
    axes[1, 1].set_xlabel("depth in the round")
    for ax in axes.ravel():
        ax.grid(alpha=0.3)
    axes[0, 0].set_yscale("log")
    axes[0, 1].set_yscale("log")
    axes[0, 1].legend(frameon=False, fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    save_figure(fig, path, dpi=130)
    return Path(path)
