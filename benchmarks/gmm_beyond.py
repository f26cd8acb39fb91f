"""Beyond D-GRS on the paper's Gaussian mixture: couplings and drafts at equal budget.

    .venv/bin/python benchmarks/gmm_beyond.py [--trajectories 200]

Two tables, both at the paper's setting (d = 500, 5 components, T = 30, churn
0.1, flow_match grid, prefetch nearest, verify drafted), in lazy mode (only the
visited nodes are realized: the law of samples and NFE is that of the full tree):

* couplings: RMC chains, D-GRS, rank and antithetic trees at equal budgets B,
  velocity draft;
* drafts: every frozen-prediction kind (velocity, drift, x0, eps, x0
  extrapolated in time, and the online choice ``auto``) for RMC chains and D-GRS/rank trees at B in
  {14, 62, 155}, and ``auto`` on deeper trees with B <= 155;

plus a dimension check at d = 65,536. Regenerates the ``beyond`` section of
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import specforest
from specforest.experiments import gmm as gmm_exp
from specforest.experiments.results import machine_line, replace_section

COUPLING_ROWS = [
    (14, [("rmc", 1, 14), ("dgrs", 2, 3), ("rank", 2, 3), ("antithetic", 2, 3)]),
    (62, [("rmc", 1, 62), ("dgrs", 2, 5), ("rank", 2, 5), ("antithetic", 2, 5)]),
    (84, [("rmc", 1, 84), ("dgrs", 4, 3), ("rank", 4, 3), ("antithetic", 4, 3)]),
    (120, [("rmc", 1, 120), ("dgrs", 3, 4), ("rank", 3, 4)]),
    (155, [("rmc", 1, 155), ("dgrs", 5, 3), ("rank", 5, 3)]),
    (254, [("rmc", 1, 254), ("dgrs", 2, 7), ("rank", 2, 7), ("antithetic", 2, 7)]),
]
DRAFT_ROWS = [
    (14, [("rmc", 1, 14), ("dgrs", 2, 3), ("rank", 2, 3)]),
    (62, [("rmc", 1, 62), ("dgrs", 2, 5), ("rank", 2, 5)]),
    (155, [("rmc", 1, 155), ("dgrs", 5, 3), ("rank", 5, 3)]),
]
DRAFTS = ("velocity", "drift", "x0", "eps", "x0_extrap", "auto")
# deeper, narrower trees suit drafts that stay accurate far from the prefetched evaluation
AUTO_TREES = [
    ("chain B=28", "rmc", 1, 28, None),
    ("(2, 6)", "rank", 2, 6, None),
    ("(2, 6)", "antithetic", 2, 6, None),
    ("widths [2, 2, 2, 1 x 12]", "rank", None, None, [2, 2, 2] + [1] * 12),
    ("widths [4, 1 x 20]", "rank", None, None, [4] + [1] * 20),
]
LABEL = {"rmc": "RMC chain", "dgrs": "D-GRS", "rank": "rank", "antithetic": "antithetic"}


def fmt(r: dict) -> str:
    return (
        f"{r['nfe_mean']:.2f} ± {r['nfe_sem']:.2f} | {r['speedup_mean']:.3f} ± {r['speedup_sem']:.3f} | "
        f"{r['speedup_paper_mean']:.3f} ± {r['speedup_paper_sem']:.3f} | {r['accept_rate']:.3f}"
    )


def rel_change(r: dict, ref: dict) -> str:
    """NFE change of ``r`` against ``ref`` in percent, ± its standard error (delta method, runs independent)."""
    ratio = r["nfe_mean"] / ref["nfe_mean"]
    se = ratio * math.hypot(r["nfe_sem"] / r["nfe_mean"], ref["nfe_sem"] / ref["nfe_mean"])
    return f"{100 * (ratio - 1):+.1f} ± {100 * se:.1f}% NFE"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trajectories", type=int, default=200, help="trajectories per configuration (>= 2)")
    ap.add_argument("--big-trajectories", type=int, default=20, help="trajectories at d = 65,536 (>= 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of x_T and the sampling noise (>= 0)")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = ap.parse_args()
    if args.trajectories < 2 or args.big_trajectories < 2:
        ap.error("--trajectories and --big-trajectories must be >= 2")
    t0 = time.perf_counter()
    setting = gmm_exp.GMMSetting(trajectories=args.trajectories)
    common = dict(prefetch="nearest", verify="drafted", seed=args.seed, lazy=True)

    def run(method, K, L, draft="velocity", s=setting):
        r = gmm_exp.run_config(s, method=method, K=K, L=L, draft=draft, **common)
        tqdm.write(f"{method} ({K},{L}) {draft} d={s.dim}: {fmt(r)}", file=sys.stderr)
        return r

    def run_tree(tree, coupling, label):
        """A tree outside the uniform family, through the engine directly (same setting and x_T)."""
        gmm = setting.mixture()
        x = gmm_exp.initial_states(setting.trajectories, setting.dim, args.seed)
        t = time.perf_counter()
        out = specforest.sample(
            gmm,
            x,
            steps=setting.steps,
            churn=setting.churn,
            grid=setting.grid,
            tree=tree,
            coupling=coupling,
            draft="auto",
            prefetch="nearest",
            verify="drafted",
            lazy=True,
            generator=torch.Generator().manual_seed(args.seed + 1),
        )
        n = out.stats.nfe.double()
        sp, spp = setting.steps / n, (setting.steps - 2) / (n - 2)
        sq = math.sqrt(n.numel())
        r = dict(
            nfe_mean=float(n.mean()),
            nfe_sem=float(n.std() / sq),
            speedup_mean=float(sp.mean()),
            speedup_sem=float(sp.std() / sq),
            speedup_paper_mean=float(spp.mean()),
            speedup_paper_sem=float(spp.std() / sq),
            accept_rate=float(out.stats.accepts.sum() / out.stats.attempts.sum()),
        )
        tqdm.write(f"{label} {coupling} auto: {fmt(r)} ({time.perf_counter() - t:.1f} s)", file=sys.stderr)
        return r

    head = "| B | method | (K, L) | NFE | T/NFE | (T-2)/(NFE-2) | per-step acceptance |"
    sep = "| --- | --- | --- | --- | --- | --- | --- |"
    std = gmm_exp.run_config(setting, method="standard", seed=args.seed)
    lines = [
        f"Measured with `benchmarks/gmm_beyond.py --trajectories {args.trajectories}` on {machine_line()}.",
        "",
        f"Paper setting (d = 500, 5 components, T = 30, churn 0.1, flow_match grid), {args.trajectories} "
        "trajectories, prefetch nearest, verify drafted, lazy mode (same law of samples and NFE as the "
        f"full tree). Standard sampler: NFE {std['nfe_mean']:.0f}. Mean ± standard error; the new couplings' "
        "NFE change against D-GRS and against the RMC chain of the same budget B, ± standard error.",
        "",
        "### Couplings at equal budget (velocity draft)",
        "",
        head,
        sep,
    ]
    ref_at: dict = {}
    for B, rows in tqdm(COUPLING_ROWS, desc="couplings"):
        for m, K, L in rows:
            r = run(m, K, L)
            ref_at[B, m] = r
            lines.append(f"| {B} | {LABEL[m]} | ({K}, {L}) | {fmt(r)} |")
            if m in ("rank", "antithetic"):
                vs = [f"{rel_change(r, ref_at[B, ref])} vs {LABEL[ref]}" for ref in ("dgrs", "rmc")]
                lines[-1] = lines[-1][:-2] + f" ({'; '.join(vs)}) |"
    lines += [
        "",
        "### Draft kinds (what the draft freezes from the prefetched evaluation)",
        "",
        "| B | method | (K, L) | draft | NFE | T/NFE | (T-2)/(NFE-2) | per-step acceptance |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for B, rows in tqdm(DRAFT_ROWS, desc="drafts"):
        for m, K, L in rows:
            for dr in DRAFTS:
                r = run(m, K, L, dr)
                lines.append(f"| {B} | {LABEL[m]} | ({K}, {L}) | {dr} | {fmt(r)} |")
    lines += [
        "",
        "### The auto draft on deep trees with B <= 155",
        "",
        "| B | tree | coupling | NFE | T/NFE | (T-2)/(NFE-2) | per-step acceptance |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, cp, K, L, ks in AUTO_TREES:
        tree = specforest.trees.widths(ks) if ks is not None else None
        r = run_tree(tree, cp, label) if tree is not None else run(cp, K, L, "auto")
        B = tree.budget if tree is not None else r["budget"]
        lines.append(f"| {B} | {label} | {cp} | {fmt(r)} |")
    big = gmm_exp.GMMSetting(dim=65536, trajectories=args.big_trajectories)
    lines += [
        "",
        f"### Dimension d = 65,536 ({args.big_trajectories} trajectories)",
        "",
        "| B | method | (K, L) | draft | NFE | T/NFE | (T-2)/(NFE-2) | per-step acceptance |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m, K, L in [("rmc", 1, 155), ("dgrs", 5, 3), ("rank", 5, 3)]:
        for dr in ("velocity", "x0"):
            r = run(m, K, L, dr, big)
            lines.append(f"| 155 | {LABEL[m]} | ({K}, {L}) | {dr} | {fmt(r)} |")
    lines += ["", f"Total wall time {(time.perf_counter() - t0) / 60:.1f} min."]
    replace_section(args.out, "beyond", "## Gaussian mixture: couplings and drafts beyond D-GRS", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
