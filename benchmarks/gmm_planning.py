"""Planned trees against the best uniform (K, L) tree of the same budget on the GMM.

    .venv/bin/python benchmarks/gmm_planning.py [--trajectories 100]

At the paper's setting (lazy mode, prefetch nearest, verify drafted), for each
budget B in {14, 62, 155}: every uniform tree with K in 1..7 (K = 1: the chain),
L >= 1 and K + ... + K^L <= B, and the tree of ``--tree optimal`` for B, for two
pairs of coupling and draft. Regenerates the ``planning`` section of
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm.auto import tqdm

from specforest.experiments import gmm as gmm_exp
from specforest.experiments.results import machine_line, replace_section

BUDGETS = (14, 62, 155)
PAIRS = (("dgrs", "velocity"), ("rank", "auto"))


def uniform_candidates(B: int, steps: int):
    out = [("rmc", 1, min(B, steps))]
    for K in range(2, 8):
        L = 1
        while sum(K**i for i in range(1, L + 1)) <= B:
            out.append((None, K, L))
            L += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trajectories", type=int, default=100, help="trajectories per configuration (>= 2)")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = ap.parse_args()
    if args.trajectories < 2:
        ap.error("--trajectories must be >= 2")
    t0 = time.perf_counter()
    s = gmm_exp.GMMSetting(trajectories=args.trajectories)
    common = dict(prefetch="nearest", verify="drafted", seed=0, lazy=True)
    lines = [
        f"Measured with `benchmarks/gmm_planning.py --trajectories {args.trajectories}` on {machine_line()}.",
        "",
        "Paper setting, lazy mode, prefetch nearest, verify drafted. Uniform candidates: K in 1..7 "
        "(K = 1 is the RMC chain), every L with K + ... + K^L <= B. NFE mean ± standard error.",
        "",
        "| coupling | draft | B | best uniform (K, L) | its NFE | planned tree | planned NFE | NFE change |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for method, draft in PAIRS:
        for B in tqdm(BUDGETS, desc=f"{method}/{draft}"):
            best = None
            for rmc, K, L in uniform_candidates(B, s.steps):
                m = rmc or method
                r = gmm_exp.run_config(s, method=m, K=K, L=L, draft=draft, **common)
                if best is None or r["nfe_mean"] < best[1]["nfe_mean"]:
                    best = ((K, L), r)
            opt = gmm_exp.run_config(s, method=method, tree="optimal", budget=B, draft=draft, **common)
            (K, L), r = best
            change = 100.0 * (opt["nfe_mean"] / r["nfe_mean"] - 1.0)
            lines.append(
                f"| {method} | {draft} | {B} | ({K}, {L}) | {r['nfe_mean']:.2f} ± {r['nfe_sem']:.2f} | "
                f"{opt['tree_layers']} | {opt['nfe_mean']:.2f} ± {opt['nfe_sem']:.2f} | {change:+.1f}% |"
            )
            tqdm.write(lines[-1])
    lines += ["", f"Total wall time {(time.perf_counter() - t0) / 60:.1f} min."]
    replace_section(args.out, "planning", "## Gaussian mixture: planned trees against uniform ones", "\n".join(lines))


if __name__ == "__main__":
    main()
