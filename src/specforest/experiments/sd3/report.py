"""Figure 5 and the text of the SD3 study: speedup against ``K``, one line per configuration, the table."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..common import pm, pyplot, save_figure
from ..results import describe_method

__all__ = ["format_line", "format_summary", "write_figure"]


def format_line(r: dict) -> str:
    """One line for the log: NFE, speedup, acceptance, CLIP score and wall-clock of a record."""
    acc = "-" if r["accept_rate"] is None else f"{r['accept_rate']:.3f}"
    clip = "" if r.get("clip_mean") is None else f"  CLIP {pm(r['clip_mean'], r['clip_sem'], 2)}"
    warm = f" after a {r['warmup_seconds']:.1f} s warm-up" if r.get("warmup_seconds") else ""
    return (
        f"{describe_method(r)}: NFE {pm(r['nfe_mean'], r['nfe_sem'], 2)}  speedup {pm(r['speedup_mean'], r['speedup_sem'])}"
        f"  acceptance {acc}{clip}  ({r['wall_seconds']:.1f} s{warm})"
    )


def write_figure(records: list[dict], out_dir: str | os.PathLike[str]) -> Path:
    """Figure 5: speedup ``T / NFE`` against ``K`` for D-GRS and RMC at the matched budget.

    Returns:
        The path written, ``out_dir/speedup_vs_K.png``.
    """
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.5, 4.2), constrained_layout=True)
    dg = sorted((r for r in records if r["method"] == "dgrs"), key=lambda r: r["K"])
    rm = {r["budget"]: r for r in records if r["method"] == "rmc"}

    def arr(rs, key):
        return np.array([np.nan if r[key] is None else r[key] for r in rs], dtype=float)

    if dg:
        Ks = np.array([r["K"] for r in dg], dtype=float)
        m, s = arr(dg, "speedup_mean"), np.nan_to_num(arr(dg, "speedup_sem"))
        ax.plot(Ks, m, "o-", color="C0", label="D-GRS, (K, L) tree")
        ax.fill_between(Ks, m - s, m + s, color="C0", alpha=0.2, lw=0)
        pairs = [(r["K"], rm[r["budget"]]) for r in dg if r["budget"] in rm]
        if pairs:
            kr = np.array([k for k, _ in pairs], dtype=float)
            mr = arr([r for _, r in pairs], "speedup_mean")
            sr = np.nan_to_num(arr([r for _, r in pairs], "speedup_sem"))
            ax.errorbar(kr, mr, yerr=sr, fmt="s--", color="C3", capsize=3, label="RMC, chain of matched B")
        ax.set_xticks(Ks, [f"{int(k)}\nB={r['budget']}" for k, r in zip(Ks, dg, strict=True)])
    ax.axhline(1.0, color="gray", ls=":", label="standard sampler")
    ax.set_xlabel("K (children per node)")
    ax.set_ylabel("speedup T / NFE (mean ± SEM)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if records:
        r = records[0]
        ax.set_title(
            f"SD3 {r['height']}x{r['width']}, T={r['steps']}, guidance {r['guidance_scale']}, churn {r['churn']}, "
            f"shift {r['shift']}, L={r['L_tree']}, {r['images']} images, verify={r['verify']}",
            fontsize=7,
        )
    return save_figure(fig, Path(out_dir) / "speedup_vs_K.png")


def format_summary(records: list[dict]) -> str:
    """A table: one line per ``K`` with D-GRS and RMC at the matched budget, and the standard sampler."""
    dg = {r["K"]: r for r in records if r["method"] == "dgrs"}
    rm = {r["budget"]: r for r in records if r["method"] == "rmc"}
    st = next((r for r in records if r["method"] == "standard"), None)

    def cells(r):
        if r is None:
            return f"{'-':>16} {'-':>6} {'-':>13}"
        acc = "-" if r["accept_rate"] is None else f"{r['accept_rate']:.3f}"
        return f"{pm(r['speedup_mean'], r['speedup_sem']):>16} {acc:>6} {pm(r['clip_mean'], r['clip_sem'], 2):>13}"

    head = f"{'K':>2} {'B':>4}  {'D-GRS T/NFE':>16} {'acc':>6} {'CLIP':>13}   {'RMC T/NFE':>16} {'acc':>6} {'CLIP':>13}"
    lines = [head, "-" * len(head)]
    for K in sorted(dg):
        lines.append(f"{K:>2} {dg[K]['budget']:>4}  {cells(dg[K])}   {cells(rm.get(dg[K]['budget']))}")
    if st is not None:
        lines.append(
            f"standard sampler: NFE {pm(st['nfe_mean'], st['nfe_sem'], 2)}, CLIP {pm(st['clip_mean'], st['clip_sem'], 2)}"
        )
    for r in records:
        if r["method"] == "tuned":
            wall = ""
            if st is not None and r["wall_seconds"] > 0:
                wall = f", wall-clock {st['wall_seconds'] / r['wall_seconds']:.2f}x the standard sampler's"
            lines.append(
                f"{describe_method(r)}: T/NFE {pm(r['speedup_mean'], r['speedup_sem'])}{wall}, "
                f"CLIP {pm(r['clip_mean'], r['clip_sem'], 2)}"
            )
    return "\n".join(lines)
