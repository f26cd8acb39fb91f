"""The acceptance landscape: per-step acceptance of every coupling against ``delta``,
and an upper bound for any exact list coupling of ``K`` i.i.d. proposals.

Bound. Whatever rule picks a child, the selected child's law ``m`` (the part of
it that is accepted) satisfies ``m <= q`` and, for every set ``A``,
``m(A) <= P(some child lands in A) = 1 - (1 - p(A))^K``. The largest ``m(R)``
under these constraints bounds the acceptance of every exact coupling of
``K`` i.i.d. children. :func:`lp_bound` computes it by a linear program on a
discretization into cells (constraints for all unions of cells, added by a
separation oracle); cells only coarsen the constraints, so the LP value is a
valid upper bound at any resolution.

The constraint ``A -> 1 - (1 - p(A))^K`` is a concave function of a measure,
hence submodular, so the LP is a polymatroid problem whose value is
``min_A [F(A) + q(A^c)]``; for fixed ``p(A)`` the minimizing set maximizes
``q(A)``, a super-level set of ``q/p`` (Neyman-Pearson), i.e. ``{s >= t}``.
Hence the closed form :func:`list_bound` ``= min_t [1 - Phi(t)^K + Phi(t - delta)]``.
The tests check that both agree; for ``K = 1`` it is ``2 Phibar(delta / 2)``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch
from scipy import optimize
from scipy.stats import norm

from .couplings import AntitheticCoupling, RankCoupling, grs_acceptance, rmc_acceptance

__all__ = ["COLUMNS", "acceptance_table", "list_bound", "lp_bound", "plot_landscape"]

COLUMNS = ("rmc", "grs", "rank", "antithetic", "bound")


def list_bound(delta: float, K: int) -> float:
    """``min_t [1 - Phi(t)^K + Phi(t - delta)]``: the best acceptance of any exact
    coupling of ``K`` i.i.d. ``N(0, 1)`` proposals with ``N(delta, 1)``."""
    if delta <= 0:
        return 1.0

    def f(t: float) -> float:
        return 1.0 - math.exp(K * norm.logcdf(t)) + norm.cdf(t - delta)

    grid = np.linspace(-8.0, delta + 8.0, 4001)
    vals = 1.0 - np.exp(K * norm.logcdf(grid)) + norm.cdf(grid - delta)
    i = int(np.argmin(vals))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    res = optimize.minimize_scalar(f, bounds=(lo, hi), method="bounded", options={"xatol": 1e-12})
    return float(min(res.fun, vals[i], 1.0))


def lp_bound(delta: float, K: int, cells: int = 400, max_rounds: int = 50) -> float:
    """The list-coupling bound by linear programming on ``cells`` cells.

    Variables ``m_i in [0, q_i]``; constraints ``sum_{i in A} m_i <= 1 - (1 - p(A))^K``
    for unions of cells ``A``, starting from the suffix sets and adding, round by
    round, the most violated set found by sorting cells by ``m_i / p_i`` (for a
    given ``m`` the tightest set of each ``p``-mass is a prefix of that order).
    """
    from scipy.optimize import linprog

    edges = np.concatenate([[-np.inf], np.linspace(min(-8.0, delta - 8.0), max(8.0, delta + 8.0), cells - 1), [np.inf]])
    p = np.diff(norm.cdf(edges))
    q = np.diff(norm.cdf(edges - delta))
    n = len(p)
    rows: list[np.ndarray] = []
    rhs: list[float] = []

    def add(mask: np.ndarray) -> None:
        rows.append(mask.astype(float))
        rhs.append(1.0 - (1.0 - min(p[mask].sum(), 1.0)) ** K)

    for i in range(n):
        mask = np.zeros(n, dtype=bool)
        mask[i:] = True
        add(mask)
    value = float("nan")
    for _ in range(max_rounds):
        res = linprog(
            -np.ones(n),
            A_ub=np.array(rows),
            b_ub=np.array(rhs),
            bounds=list(zip(np.zeros(n), q, strict=True)),
            method="highs",
        )
        if not res.success:  # pragma: no cover
            raise RuntimeError(f"bound LP failed: {res.message}")
        m, value = res.x, -res.fun
        order = np.argsort(-(m / np.maximum(p, 1e-300)))
        cum_m, cum_p = np.cumsum(m[order]), np.cumsum(p[order])
        slack = 1.0 - (1.0 - np.minimum(cum_p, 1.0)) ** K - cum_m
        k = int(np.argmin(slack))
        if slack[k] >= -1e-10:
            break
        mask = np.zeros(n, dtype=bool)
        mask[order[: k + 1]] = True
        add(mask)
    return float(value)


def acceptance_table(deltas: Sequence[float], Ks: Sequence[int]) -> list[dict]:
    """One row per ``(delta, K)`` with the acceptance of each coupling and the bound.

    Keys: ``delta, K, rmc, grs, rank, antithetic, bound``. ``rmc`` is the single-
    proposal maximal coupling (it does not depend on ``K``); ``antithetic`` (``K / 2``
    mirrored pairs) is defined for even ``K`` only (``None`` otherwise) and may
    exceed ``bound``, which holds for i.i.d. children only.
    """
    rank, anti = RankCoupling(), AntitheticCoupling()
    out = []
    for K in Ks:
        for d in deltas:
            dt = torch.tensor(float(d), dtype=torch.float64)
            out.append(
                dict(
                    delta=float(d),
                    K=int(K),
                    rmc=float(rmc_acceptance(dt)),
                    grs=float(grs_acceptance(dt, int(K))),
                    rank=float(rank.acceptance(dt, int(K))),
                    antithetic=float(anti.acceptance(dt, int(K))) if K % 2 == 0 else None,
                    bound=list_bound(float(d), int(K)),
                )
            )
    return out


def plot_landscape(path, Ks: Sequence[int] = (1, 2, 4, 8), deltas: Optional[np.ndarray] = None) -> None:
    """Plot acceptance against ``delta`` in [0, 5], one column per ``K``, to ``path`` (PNG).

    Top row: acceptance. Bottom row: each rule relative to the i.i.d. list bound,
    in percent (the shaded band is within 2 % of it; structured siblings may
    rise above 0).
    """
    from .plots import pyplot, save_figure

    plt = pyplot()

    deltas = np.linspace(0.0, 5.0, 51) if deltas is None else deltas
    rows = acceptance_table(deltas, Ks)
    fig, axes = plt.subplots(
        2,
        len(Ks),
        figsize=(4.0 * len(Ks), 6.4),
        sharex=True,
        sharey="row",
        constrained_layout=True,
        squeeze=False,
        height_ratios=[3, 2],
    )
    styles = {
        "rmc": ("RMC (K=1)", "0.5", "--"),
        "grs": ("GRS", "#1D3557", "-"),
        "rank": ("rank (max-conditioned)", "#E76F51", "-"),
        "antithetic": ("antithetic pairs", "#2A9D8F", "-"),
        "bound": ("i.i.d. bound", "k", ":"),
    }
    for col, K in enumerate(Ks):
        top, bottom = axes[0, col], axes[1, col]
        sub = [r for r in rows if r["K"] == K]
        xs = [r["delta"] for r in sub]
        for key, (label, color, ls) in styles.items():
            ys = [r[key] for r in sub]
            if any(y is None for y in ys):
                continue
            top.plot(xs, ys, ls, color=color, label=label, lw=1.6)
            if key != "rmc":
                rel = [
                    100.0 * (y / r["bound"] - 1.0) if r["bound"] > 1e-9 else 0.0 for y, r in zip(ys, sub, strict=True)
                ]
                bottom.plot(xs, rel, ls, color=color, lw=1.6)
        top.set_title(f"K = {K}")
        bottom.set_xlabel(r"$\delta = \|m_q - m_p\| / \sigma$")
        bottom.axhspan(-2.0, 0.0, color="0.9", lw=0)
        bottom.set_ylim(-12.0, 3.0)
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
        top.legend(frameon=False, fontsize=7)
    axes[0, 0].set_ylabel("per-step acceptance")
    axes[1, 0].set_ylabel("vs i.i.d. bound (%)")
    save_figure(fig, path)
