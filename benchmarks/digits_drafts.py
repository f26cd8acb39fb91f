"""Draft kinds and couplings on the shipped digits model.

    .venv/bin/python benchmarks/digits_drafts.py [--samples 100]

Class-conditional 8x8 digits, T = 100 on the flow_match grid, churn 0.3,
prefetch nearest, verify drafted, lazy mode (same law of samples and NFE as the
full tree). For RMC chains and D-GRS / rank trees at B = 14 and 62, every draft
kind. Regenerates the ``digits_drafts`` section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm.auto import tqdm

from specforest.experiments import pixel as pixel_exp
from specforest.experiments.results import machine_line, replace_section
from specforest.models.digits import load_classifier, load_velocity
from specforest.proposals import DRAFT_KINDS

CONFIGS = [
    (14, "rmc", 1, 14),
    (14, "dgrs", 2, 3),
    (14, "rank", 2, 3),
    (62, "rmc", 1, 62),
    (62, "dgrs", 2, 5),
    (62, "rank", 2, 5),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=100, help="images per configuration (>= 2)")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = ap.parse_args()
    if args.samples < 2:
        ap.error("--samples must be >= 2")
    t0 = time.perf_counter()
    model, clf = load_velocity(), load_classifier()
    lines = [
        f"Measured with `benchmarks/digits_drafts.py --samples {args.samples}` on {machine_line()}.",
        "",
        "Digits model (8x8), T = 100 flow_match grid, churn 0.3, prefetch nearest, verify drafted, lazy mode. "
        "T/NFE mean ± standard error; the paper's accounting (T-2)/(NFE-2) in brackets; classifier accuracy "
        "of the samples against their labels.",
        "",
        "| B | method | (K, L) | draft | T/NFE | per-step acceptance | classifier accuracy |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for B, method, K, L in tqdm(CONFIGS, desc="digits drafts"):
        for draft in DRAFT_KINDS:
            r = pixel_exp.simulate(
                method=method,
                K=K,
                L=L,
                churn=0.3,
                samples=args.samples,
                steps=100,
                verify="drafted",
                lazy=True,
                draft=draft,
                model=model,
                classifier=clf,
            ).record
            lines.append(
                f"| {B} | {method} | ({K}, {L}) | {draft} | {r['speedup_mean']:.3f} ± {r['speedup_sem']:.3f} "
                f"[{r['speedup_paper_mean']:.3f}] | {r['accept_rate']:.3f} | {r['classifier_accuracy']:.3f} |"
            )
    lines += ["", f"Total wall time {(time.perf_counter() - t0) / 60:.1f} min."]
    replace_section(args.out, "digits_drafts", "## Digits model: draft kinds and couplings", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
