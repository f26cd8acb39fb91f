"""``draft="auto"`` with the grid split into stretches, against the offset-only rule and ``secant``.

    .venv/bin/python benchmarks/auto_stretches.py [--trajectories 200] [--images 100]
    .venv/bin/python benchmarks/auto_stretches.py --dry-run   # a few trajectories, prints, writes nothing

``AutoDraft(stretches=S)`` chooses its kind per draft offset and per stretch of ``T / S``
steps (a pair with fewer than 16 observations takes the offset's choice over the whole grid);
``S = 1`` is the offset-only rule, the registered ``auto`` is ``S = 2``. Four settings, on the
same initial states and seeds for every rule: the paper's mixture (d = 500, T = 30, churn 0.1)
on the RMC chain of B = 14 and the rank (5, 3) tree, and the digits model (T = 100, churn 0.3)
on the RMC chain of B = 14 and the rank (3, 3) tree; verify drafted, prefetch nearest. T/NFE,
mean ± standard error over trajectories. Regenerates the ``auto_stretches`` section of
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import specforest
from specforest.experiments import gmm as gmm_exp
from specforest.experiments import pixel as pixel_exp
from specforest.experiments.results import machine_line, replace_section
from specforest.models.digits import load_velocity
from specforest.proposals import AutoDraft

STRETCHES = (1, 2, 4, 8)


def t_over_nfe(model, x, cond: dict, steps: int, churn: float, tree, coupling: str, draft, seed: int) -> str:
    """``T/NFE ± s.e.`` of one run of every trajectory of ``x``."""
    run = specforest.sample(
        model, x, steps=steps, churn=churn, tree=tree, coupling=coupling, draft=draft, seed=seed, cond=cond,
        verify="drafted", prefetch="nearest",
    )  # fmt: skip
    nfe = run.stats.nfe.double()
    mean = float(nfe.mean())
    se = float(nfe.std() / nfe.numel() ** 0.5) * steps / mean**2
    return f"{steps / mean:.3f} ± {se:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trajectories", type=int, default=200, help="mixture trajectories (>= 2)")
    ap.add_argument("--images", type=int, default=100, help="digits images (>= 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initial states and the sampling noise (>= 0)")
    ap.add_argument("--dry-run", action="store_true", help="4 trajectories per setting; print, write nothing")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = ap.parse_args()
    if min(args.trajectories, args.images) < 2 or args.seed < 0:
        ap.error("--trajectories and --images must be >= 2, --seed >= 0")
    if args.dry_run:
        args.trajectories = args.images = 4
    t0 = time.perf_counter()
    setting = gmm_exp.GMMSetting(trajectories=args.trajectories)
    gmm = setting.mixture()
    xg = gmm_exp.initial_states(args.trajectories, setting.dim, args.seed)
    xd, labels = pixel_exp.initial_states(args.images, args.seed)
    digits = load_velocity()
    cases = [
        ("mixture d = 500, RMC chain B = 14", gmm, xg, {}, 30, 0.1, specforest.trees.chain(14), "rmc"),
        ("mixture d = 500, rank (5, 3)", gmm, xg, {}, 30, 0.1, specforest.trees.uniform(5, 3), "rank"),
        ("digits, RMC chain B = 14", digits, xd, {"class_labels": labels}, 100, 0.3, specforest.trees.chain(14), "rmc"),
        ("digits, rank (3, 3)", digits, xd, {"class_labels": labels}, 100, 0.3, specforest.trees.uniform(3, 3), "rank"),
    ]
    head = " | ".join(f"S = {s}" for s in STRETCHES)
    lines = [
        f"Measured with `benchmarks/auto_stretches.py --trajectories {args.trajectories} --images {args.images}` "
        f"on {machine_line()}, {torch.get_num_threads()} threads.",
        "",
        "T/NFE (mean ± standard error over trajectories) of `AutoDraft(stretches=S)`: the kind chosen per "
        "draft offset and per stretch of T / S steps; S = 1 is the offset-only rule, the registered `auto` "
        "S = 2. `secant` beside it. Verify drafted, prefetch nearest; the same initial states and seeds "
        "for every rule.",
        "",
        f"| setting | {head} | secant |",
        "| --- |" + " --- |" * (len(STRETCHES) + 1),
    ]
    for name, model, x, cond, steps, churn, tree, coupling in cases:
        run = dict(steps=steps, churn=churn, tree=tree, coupling=coupling, seed=args.seed)
        cells = [t_over_nfe(model, x, cond, draft=AutoDraft(stretches=s), **run) for s in STRETCHES]
        cells.append(t_over_nfe(model, x, cond, draft="secant", **run))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        print(lines[-1], file=sys.stderr, flush=True)
    lines += ["", f"Total wall time {(time.perf_counter() - t0) / 60:.1f} min."]
    text = "\n".join(lines)
    if not args.dry_run:
        replace_section(args.out, "auto_stretches", "## auto: the grid in stretches", text)
    print(text)


if __name__ == "__main__":
    main()
