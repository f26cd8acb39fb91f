"""Figures and text of the Gaussian-mixture experiment: heat maps, speedup curves, summaries."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..common import METHOD_LABELS, SWEEP_METHODS, budget_of, describe_chain, pm, pyplot, save_figure
from ..results import describe_method

__all__ = ["format_result", "format_summary", "write_figures"]


def _grids(records: list[dict], Ks: Sequence[int], Ls: Sequence[int]):
    """``(len(Ls), len(Ks))`` arrays of mean and SEM speedup for RMC and each tree method."""
    tree = {(r["method"], r["K"], r["L"]): r for r in records if r["method"] in SWEEP_METHODS}
    rm = {r["L"]: r for r in records if r["method"] == "rmc"}
    shape = (len(Ls), len(Ks))
    out = {m: (np.full(shape, np.nan), np.full(shape, np.nan)) for m in ("rmc", *SWEEP_METHODS)}
    for i, L in enumerate(Ls):
        for j, K in enumerate(Ks):
            cells = [(m, tree.get((m, K, L))) for m in SWEEP_METHODS] + [("rmc", rm.get(budget_of("dgrs", K, L)))]
            for m, r in cells:
                if r is not None:
                    out[m][0][i, j] = np.nan if r["speedup_mean"] is None else r["speedup_mean"]
                    out[m][1][i, j] = np.nan if r["speedup_sem"] is None else r["speedup_sem"]
    return out


def _title(records: list[dict]) -> str:
    r = records[0]
    return (
        f"Gaussian mixture: d={r['dim']}, {r['components']} components, T={r['steps']}, "
        f"{describe_chain(r)}, {r['grid']} grid, {r['trajectories']} trajectories, "
        f"prefetch={r['prefetch']}, verify={r['verify']}"
    )


def write_figures(
    records: list[dict], out_dir: str | os.PathLike[str], K_values: Sequence[int], L_values: Sequence[int]
) -> list[Path]:
    """Figure 3 (``heatmap.png``) and Figure 7 (``speedup_vs_K.png``) of one sweep.

    Args:
        records: the sweep's records (one setting).
        out_dir: where the PNGs go.
        K_values, L_values: the grid's axes.

    Returns:
        The two paths written.
    """
    plt = pyplot()
    from matplotlib import cm, colors

    out_dir = Path(out_dir)
    Ks, Ls = sorted(K_values), sorted(L_values)
    g = _grids(records, Ks, Ls)
    vals = np.concatenate([g["rmc"][0].ravel(), g["dgrs"][0].ravel()])
    vals = vals[np.isfinite(vals)]
    vmin, vmax = (float(vals.min()), float(vals.max())) if vals.size else (1.0, 2.0)
    if vmax - vmin < 1e-9:
        vmin, vmax = vmin - 0.05, vmax + 0.05
    norm = colors.Normalize(vmin, vmax)
    title = _title(records) if records else "Gaussian mixture"

    fig, axes = plt.subplots(
        1, 2, figsize=(2.0 + 1.1 * len(Ks) * 2, 1.6 + 0.8 * len(Ls)), sharey=True, constrained_layout=True
    )
    for ax, m, name in zip(axes, ("rmc", "dgrs"), ("RMC (chain of matched B)", "D-GRS"), strict=True):
        z = g[m][0]
        im = ax.imshow(np.ma.masked_invalid(z), origin="lower", cmap="viridis", norm=norm, aspect="auto")
        for i in range(len(Ls)):
            for j in range(len(Ks)):
                if np.isfinite(z[i, j]):
                    light = norm(z[i, j]) > 0.6
                    ax.text(
                        j,
                        i,
                        f"{z[i, j]:.2f}\nB={budget_of('dgrs', Ks[j], Ls[i])}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="black" if light else "white",
                    )
        ax.set_xticks(range(len(Ks)), [str(k) for k in Ks])
        ax.set_yticks(range(len(Ls)), [str(v) for v in Ls])
        ax.set_xlabel("K (children per node)")
        ax.set_title(name)
    axes[0].set_ylabel("L (lookahead depth)")
    fig.colorbar(im, ax=axes, label="speedup T / NFE (mean)")
    fig.suptitle(title, fontsize=8)
    heat = save_figure(fig, out_dir / "heatmap.png")

    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    cmap = plt.get_cmap("viridis")
    lnorm = colors.Normalize(min(Ls), max(Ls) if max(Ls) > min(Ls) else min(Ls) + 1)
    x = np.array(Ks, dtype=float)
    rmc_labelled = False
    for i, L in enumerate(Ls):
        c = cmap(lnorm(L))
        mean, sem = g["dgrs"][0][i], g["dgrs"][1][i]
        ok = np.isfinite(mean)
        if ok.any():
            ax.plot(x[ok], mean[ok], "o-", color=c, ms=4, lw=1.5)
            s = np.where(np.isfinite(sem), sem, 0.0)[ok]
            ax.fill_between(x[ok], mean[ok] - s, mean[ok] + s, color=c, alpha=0.2, lw=0)
        r = g["rmc"][0][i]
        okr = np.isfinite(r)
        if okr.any():
            ax.plot(
                x[okr],
                r[okr],
                "x",
                color=c,
                ms=6,
                mew=1.5,
                ls="none",
                label=None if rmc_labelled else "RMC at matched budget B",
            )
            rmc_labelled = True
    # the other tree methods of the sweep, same colour per L, their own line style
    present = [m for m in SWEEP_METHODS[1:] if np.isfinite(g[m][0]).any()]
    for m, style in zip(present, ("^--", "v:"), strict=False):
        for i, L in enumerate(Ls):
            mean = g[m][0][i]
            ok = np.isfinite(mean)
            if ok.any():
                ax.plot(x[ok], mean[ok], style, color=cmap(lnorm(L)), ms=4, lw=1.3)
        ax.plot([], [], style, color="gray", label=METHOD_LABELS[m])
    ax.plot([], [], "o-", color="gray", label="D-GRS (mean, ±1 SEM band)")
    ax.set_xlabel("K (children per node)")
    ax.set_ylabel("speedup T / NFE")
    ax.set_xticks(Ks)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.colorbar(cm.ScalarMappable(norm=lnorm, cmap=cmap), ax=ax, label="L (lookahead depth)", ticks=Ls)
    ax.set_title(title, fontsize=7)
    line = save_figure(fig, out_dir / "speedup_vs_K.png")
    return [heat, line]


# -- text summaries ---------------------------------------------------------------------


def format_result(r: dict) -> str:
    """A few human-readable lines describing one record."""
    what = describe_method(r)
    per_depth = " ".join("-" if a is None else f"{a:.2f}" for a in r["accept_rate_per_depth"][:10])
    if len(r["accept_rate_per_depth"]) > 10:
        per_depth += " ..."
    lines = [
        (
            f"{what}: {r['trajectories']} trajectories, d={r['dim']}, {r['components']} components, "
            f"T={r['steps']}, {describe_chain(r)}, {r['grid']} grid, seed {r['seed']}, "
            f"mixture seed {r['mixture_seed']}"
        ),
        (
            f"  NFE {pm(r['nfe_mean'], r['nfe_sem'], 2)}   speedup T/NFE {pm(r['speedup_mean'], r['speedup_sem'])}"
            f"   paper accounting {pm(r['speedup_paper_mean'], r['speedup_paper_sem'])}"
        ),
    ]
    if r["method"] != "standard":
        acc = "n/a" if r["accept_rate"] is None else f"{r['accept_rate']:.3f}"
        lines.append(f"  per-step acceptance {acc}; per depth {per_depth}")
        lines.append(f"  prefetch {r['prefetch']}, verify {r['verify']}, mode {r['mode']}")
    warm = f" (after a {r['warmup_seconds']:.2f} s warm-up)" if r.get("warmup_seconds") else ""
    lines.append(
        f"  wall {r['wall_seconds']:.2f} s{warm} in {r['chunks']} chunk(s) of <= {r['chunk_size']} trajectories"
    )
    return "\n".join(lines)


def format_summary(records: list[dict]) -> str:
    """A table of a sweep: one line per ``(K, L)`` with each tree method and RMC at the same budget."""
    tree = {(r["method"], r["K"], r["L"]): r for r in records if r["method"] in SWEEP_METHODS}
    rm = {r["L"]: r for r in records if r["method"] == "rmc"}
    methods = [m for m in SWEEP_METHODS if any(k[0] == m for k in tree)]
    labels = [METHOD_LABELS[m] for m in [*methods, "rmc"]]
    head = f"{'L':>2} {'K':>2} {'B':>8}  " + "   ".join(
        f"{name + ' T/NFE':>16} {'paper acct':>10} {'acc':>5}" for name in labels
    )
    lines = [head, "-" * len(head)]

    def cells(r):
        if r is None:
            return f"{'-':>16} {'-':>10} {'-':>5}"
        acc = "-" if r["accept_rate"] is None else f"{r['accept_rate']:.2f}"
        pp = "-" if r["speedup_paper_mean"] is None else f"{r['speedup_paper_mean']:.3f}"
        return f"{pm(r['speedup_mean'], r['speedup_sem']):>16} {pp:>10} {acc:>5}"

    for K, L in sorted({(k[1], k[2]) for k in tree}, key=lambda kl: (kl[1], kl[0])):
        B = budget_of("dgrs", K, L)
        row = "   ".join(cells(tree.get((m, K, L))) for m in methods)
        lines.append(f"{L:>2} {K:>2} {B:>8}  {row}   {cells(rm.get(B))}")
    return "\n".join(lines)
