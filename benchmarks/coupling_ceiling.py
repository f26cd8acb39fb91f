"""How many target calls can a better coupling save at B = 155?

    .venv/bin/python benchmarks/coupling_ceiling.py [--trajectories 200]

At the paper's GMM setting (d = 500, T = 30, churn 0.1, prefetch nearest,
verify drafted, lazy mode), for the paper's frozen-velocity draft and for the
``auto`` draft:

* measured: D-GRS and the rank coupling on the paper's (5, 3) tree and
  on the tree planned for B = 155 (``--tree optimal``), NFE mean ± standard
  error, and the change against D-GRS on (5, 3);
* modelled: the expected steps committed per round of each tree under the
  acceptance model of :mod:`specforest.planning` (closed-form acceptance
  averaged over the mismatches ``delta`` observed per depth in a calibration
  run), for GRS, the rank coupling and the i.i.d. list bound
  (:func:`specforest.landscape.list_bound`), which no exact coupling of i.i.d.
  children can exceed at any node. The bound's row is the ceiling of what a
  coupling can do with this draft and budget; its NFE is extrapolated from
  D-GRS's measured NFE by the ratio of modelled steps per round.

Regenerates the ``ceiling`` section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import specforest
from specforest.acceptance import acceptance_model
from specforest.couplings import Coupling
from specforest.experiments import gmm as gmm_exp
from specforest.experiments.results import machine_line, replace_section
from specforest.landscape import list_bound

BUDGET = 155
DRAFTS = ("velocity", "auto")


class ListBound(Coupling):
    """Not a coupling: carries the i.i.d. list bound as an acceptance model."""

    name = "bound"

    def acceptance(self, delta, K):
        d = torch.as_tensor(delta, dtype=torch.float64)
        return torch.tensor([list_bound(float(v), int(K)) for v in d.reshape(-1)], dtype=torch.float64).reshape(d.shape)


def expected_steps(tree, a) -> float:
    """Expected steps committed per round: ``1 + a(l, k) * mean over children`` recursively."""
    par, dep = tree.parent.tolist(), tree.depth.tolist()
    kids: list[list[int]] = [[] for _ in par]
    for v in range(1, len(par)):
        kids[par[v]].append(v)
    val = [1.0] * len(par)
    for v in range(len(par) - 1, -1, -1):
        if kids[v]:
            val[v] = 1.0 + a(dep[v] + 1, len(kids[v])) * sum(val[c] for c in kids[v]) / len(kids[v])
    return val[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trajectories", type=int, default=200, help="trajectories per configuration (>= 2)")
    ap.add_argument("--calibration", type=int, default=200, help="trajectories of the calibration run (>= 2)")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = ap.parse_args()
    if args.trajectories < 2 or args.calibration < 2:
        ap.error("--trajectories and --calibration must be >= 2")
    t0 = time.perf_counter()
    s = gmm_exp.GMMSetting(trajectories=args.trajectories)
    common = dict(prefetch="nearest", verify="drafted", seed=0, lazy=True)
    det = s.deterministic_steps
    lines = [
        f"Measured with `benchmarks/coupling_ceiling.py --trajectories {args.trajectories}` on {machine_line()}.",
        "",
        f"Paper setting, B = {BUDGET}, lazy mode, prefetch nearest, verify drafted; {args.trajectories} trajectories "
        "per measured row (mean ± standard error). *Model*: expected steps per round from the closed-form "
        f"acceptance averaged over the delta per depth of a calibration run ({args.calibration} trajectories, "
        "GRS chain, independent seed). The *i.i.d. bound* rows are no sampler: they are the best any exact "
        "coupling of i.i.d. children could do at every node of the same tree, with the NFE extrapolated from the "
        "rank coupling's measured NFE on that tree by the ratio of modelled steps per round.",
        "",
    ]
    gmm = s.mixture()
    for draft in DRAFTS:
        cal = specforest.sample(
            gmm,
            gmm_exp.initial_states(args.calibration, s.dim, 99),
            steps=s.steps,
            churn=s.churn,
            grid=s.grid,
            tree=specforest.trees.chain(20),
            coupling="grs",
            draft=draft,
            prefetch="nearest",
            verify="drafted",
            lazy=True,
            record_deltas=True,
            generator=torch.Generator().manual_seed(98),
        )
        deltas = cal.stats.deltas[:, [0, 2]]
        models = {
            name: acceptance_model(deltas, cp, kmax=16)
            for name, cp in (("grs", "grs"), ("rank", "rank"), ("bound", ListBound()))
        }
        lines += [
            f"### Draft: {draft}",
            "",
            "| coupling | tree | model steps/round | NFE | change vs D-GRS (5, 3) |",
            "| --- | --- | --- | --- | --- |",
        ]
        base, rank_runs = None, {}
        for method, label in (("dgrs", "D-GRS"), ("rank", "rank")):
            name = "grs" if method == "dgrs" else "rank"
            for tree_mode in ("uniform", "optimal"):
                run = gmm_exp.simulate(
                    s,
                    method=method,
                    K=5,
                    L=3,
                    draft=draft,
                    tree=tree_mode,
                    budget=BUDGET if tree_mode == "optimal" else None,
                    **common,
                )
                r = run.record
                steps = expected_steps(run.tree, models[name])
                if base is None:
                    base = r
                if method == "rank":
                    rank_runs[tree_mode] = (run, steps)
                change = 100.0 * (r["nfe_mean"] / base["nfe_mean"] - 1.0)
                shown = "(5, 3)" if tree_mode == "uniform" else f"planned: {r['tree_layers']}"
                lines.append(
                    f"| {label} | {shown} | {steps:.3f} | {r['nfe_mean']:.2f} ± {r['nfe_sem']:.2f} | {change:+.1f}% |"
                )
                tqdm.write(lines[-1], file=sys.stderr)
        # the bound on the very trees rank ran on, extrapolated from rank's measured NFE there
        for tree_mode, shown in (("uniform", "(5, 3)"), ("optimal", "rank's planned tree")):
            run, rank_steps = rank_runs[tree_mode]
            steps = expected_steps(run.tree, models["bound"])
            nfe = det + (run.record["nfe_mean"] - det) * rank_steps / steps
            change = 100.0 * (nfe / base["nfe_mean"] - 1.0)
            lines.append(
                f"| i.i.d. bound (model) | {shown} | {steps:.3f} | {nfe:.2f} (extrapolated) | {change:+.1f}% |"
            )
        # the tree the rank model plans from this (larger) calibration, and the bound on it
        tree = specforest.trees.optimal(models["rank"], BUDGET, min(BUDGET, s.steps), kmax=16)
        r = gmm_exp.run_config(s, method="rank", draft=draft, tree=tree, **common)
        rank_steps, steps = expected_steps(tree, models["rank"]), expected_steps(tree, models["bound"])
        change = 100.0 * (r["nfe_mean"] / base["nfe_mean"] - 1.0)
        lines.append(
            f"| rank | planned from the calibration run: {tree!r} | {rank_steps:.3f} | "
            f"{r['nfe_mean']:.2f} ± {r['nfe_sem']:.2f} | {change:+.1f}% |"
        )
        nfe = det + (r["nfe_mean"] - det) * rank_steps / steps
        lines.append(
            f"| i.i.d. bound (model) | the same tree | {steps:.3f} | {nfe:.2f} (extrapolated) | "
            f"{100.0 * (nfe / base['nfe_mean'] - 1.0):+.1f}% |"
        )
        best = specforest.trees.optimal(models["bound"], BUDGET, min(BUDGET, s.steps), kmax=16)
        lines.append(
            f"| i.i.d. bound (model) | its own best tree: {best!r} | {expected_steps(best, models['bound']):.3f} | | |"
        )
        lines.append("")
    lines += [f"Total wall time {(time.perf_counter() - t0) / 60:.1f} min."]
    replace_section(args.out, "ceiling", "## Gaussian mixture: what a coupling can save at B = 155", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
