"""Figures and text of the pixel experiment: speedup against budget, sample grids, summaries."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

import numpy as np

from ..common import METHOD_LABELS, SWEEP_METHODS, describe_chain, pm, pyplot, save_figure
from ..results import describe_method
from .setting import MODEL_NAME, samples_path

__all__ = ["format_result", "format_summary", "image_grid", "write_figures"]

_MARKERS = {"rmc": "s", "dgrs": "o", "rank": "^", "antithetic": "v"}


def format_result(r: dict) -> str:
    """A few human-readable lines describing one record."""
    sd = "" if r["speedup_std"] is None else f" (std {r['speedup_std']:.3f})"
    what = "digits" if r.get("model", MODEL_NAME) == MODEL_NAME else f"images of {r['model']}"
    lines = [
        f"{describe_method(r)}: {r['samples']} {what}, T={r['steps']} ({r['grid']}), {describe_chain(r, ' ')}, "
        f"{r['mode']} mode",
        f"  NFE {r['nfe_mean']:.2f}   speedup T/NFE {r['speedup_mean']:.3f}{sd}"
        f"   paper accounting {r['speedup_paper_mean']:.3f}",
    ]
    if r["method"] != "standard":
        per = ", ".join("-" if a is None else f"{a:.2f}" for a in r["accept_rate_per_depth"])
        lines.append(f"  acceptance per depth [{per}]")
    warm = f" (after a {r['warmup_seconds']:.2f} s warm-up)" if r.get("warmup_seconds") else ""
    # (an unconditional model has no labels to score against)
    acc = "" if r["classifier_accuracy"] is None else f"classifier accuracy vs label {r['classifier_accuracy']:.3f}   "
    lines.append(f"  {acc}wall {r['wall_seconds']:.1f} s{warm}")
    return "\n".join(lines)


def image_grid(images: np.ndarray, cols: int = 8, pad: int = 1) -> np.ndarray:
    """Tile ``(n, 1, h, w)`` images in ``[-1, 1]`` into one 2-D array in ``[0, 1]`` (padding at 1)."""
    n, _, h, w = images.shape
    rows = math.ceil(n / cols)
    out = np.ones((rows * (h + pad) + pad, cols * (w + pad) + pad), dtype=np.float32)
    for i in range(n):
        r, c = divmod(i, cols)
        out[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + c * (w + pad) : pad + c * (w + pad) + w] = (
            np.clip(images[i, 0], -1, 1) + 1
        ) / 2
    return out


def write_figures(records: list[dict], out_dir: str | os.PathLike[str]) -> list[Path]:
    """``speedup_vs_budget.png`` (Figure 4-like) and ``samples_grid.png`` (Figure 8-like).

    The speedup figure has one panel per churn: mean ± std of ``T / NFE`` per
    image against the budget, RMC vs each tree method. The grid shows the first
    64 samples of RMC (top) and D-GRS (bottom) at the largest budget of each
    churn, read from ``out_dir/samples`` (:func:`~.setting.samples_path`); it is
    skipped when those files are missing.

    Returns:
        The paths written (none without tree-method records).
    """
    plt = pyplot()

    out_dir = Path(out_dir)
    files: list[Path] = []
    churns = sorted({r["churn"] for r in records if r["method"] != "standard"})
    if not churns:
        return files
    fig, axes = plt.subplots(1, len(churns), figsize=(4.2 * len(churns), 3.6), squeeze=False, sharey=True)
    for ax, churn in zip(axes[0], churns, strict=True):
        for method, marker in _MARKERS.items():
            rs = sorted(
                (r for r in records if r["method"] == method and r["churn"] == churn),
                key=lambda r: r["budget"],
            )
            if rs:
                ax.errorbar(
                    [r["budget"] for r in rs],
                    [r["speedup_mean"] for r in rs],
                    yerr=[r["speedup_std"] or 0.0 for r in rs],
                    marker=marker,
                    capsize=3,
                    label=METHOD_LABELS[method],
                )
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        budgets = sorted({r["budget"] for r in records if r["method"] != "standard" and r["churn"] == churn})
        ax.set_xscale("log")
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.set_xlabel("budget B (drafted states)")
        ax.set_title(f"churn {churn:g}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("speedup T / NFE (mean ± std)")
    axes[0][0].legend()
    fig.suptitle("digits 1x8x8, T=100: speedup vs budget")
    fig.tight_layout()
    files.append(save_figure(fig, out_dir / "speedup_vs_budget.png", dpi=130))

    panels = []
    for churn in churns:
        row = []
        for method in ("rmc", "dgrs"):
            rs = [r for r in records if r["method"] == method and r["churn"] == churn]
            if not rs:
                break
            r = max(rs, key=lambda r: r["budget"])
            p = samples_path(out_dir, r)
            if not p.exists():
                break
            with np.load(p) as z:
                row.append((r, z["samples"][:64]))
        if len(row) == 2:
            panels.append((churn, row))
    if panels:
        fig, axes = plt.subplots(2, len(panels), figsize=(3.2 * len(panels), 6.6), squeeze=False)
        for j, (churn, row) in enumerate(panels):
            for i, (r, imgs) in enumerate(row):
                ax = axes[i][j]
                ax.imshow(image_grid(imgs), cmap="gray_r", vmin=0, vmax=1, interpolation="nearest")
                name = "RMC" if r["method"] == "rmc" else f"D-GRS ({r['K']},{r['L']})"
                ax.set_title(f"{name}, B={r['budget']}, churn {churn:g}", fontsize=9)
                ax.axis("off")
        fig.tight_layout()
        files.append(save_figure(fig, out_dir / "samples_grid.png", dpi=130))
    return files


def format_summary(records: list[dict]) -> str:
    """A table: speedup mean ± std of each method at each churn and budget, and classifier accuracy."""

    def cell(r: Optional[dict]) -> str:
        return "-" if r is None else pm(r["speedup_mean"], r["speedup_std"] or 0.0, 2)

    def acc(r: Optional[dict]) -> str:
        return "-" if r is None else f"{r['classifier_accuracy']:.3f}"

    methods = [m for m in (*SWEEP_METHODS, "rmc") if any(r["method"] == m for r in records)]
    head = f"{'churn':>5} {'B':>4} {'(K,L)':>6}  " + " ".join(f"{METHOD_LABELS[m]:>15}" for m in methods)
    lines = [head + "  " + " ".join(f"{'acc ' + METHOD_LABELS[m]:>14}" for m in methods)]
    for churn in sorted({r["churn"] for r in records}):
        by = {m: {r["budget"]: r for r in records if r["method"] == m and r["churn"] == churn} for m in methods}
        for B in sorted(set().union(*by.values())):
            rows = [by[m].get(B) for m in methods]
            tree = next((r for r in rows if r is not None and r["method"] != "rmc"), None)
            kl = f"({tree['K']},{tree['L']})" if tree else ""
            lines.append(
                f"{churn:>5g} {B:>4} {kl:>6}  "
                + " ".join(f"{cell(r):>15}" for r in rows)
                + "  "
                + " ".join(f"{acc(r):>14}" for r in rows)
            )
    return "\n".join(lines)
