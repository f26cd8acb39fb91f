"""Regenerate the shipped rank-rule table, src/specforest/data/rank_rules.json.

    .venv/bin/python scripts/make_rank_table.py [--kmax 16] [--workers 2]

For each number of values M and each delta of the table's grid, finds the cap
and rank weights of the best capped rank rule (:func:`specforest.rank_rules.best_rule`):
``normal`` for M = 2..kmax i.i.d. children (the ``rank`` coupling), and
``halfnormal`` for M = 1..kmax/2 antithetic pairs (the ``antithetic`` coupling).
Takes about 12 minutes on two cores. The file is written atomically.
"""

from __future__ import annotations

import argparse
import json
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tqdm import tqdm

OUT = Path(__file__).resolve().parents[1] / "src" / "specforest" / "data" / "rank_rules.json"


def _job(args: tuple[str, int, float]) -> tuple[str, int, float, list[float], float, float]:
    import torch

    torch.set_num_threads(1)
    from specforest.rank_rules import best_rule

    base, M, delta = args
    w, cap, acc = best_rule(delta, M, base)
    return base, M, delta, [round(float(x), 8) for x in w], round(cap, 6), acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kmax", type=int, default=16, help="largest number of children tabulated (>= 2)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes")
    args = ap.parse_args()
    if args.kmax < 2:
        ap.error("--kmax must be >= 2")
    from specforest.experiments.io import atomic_write_text
    from specforest.rank_rules import TABLE_DELTAS

    deltas = [round(float(d), 6) for d in TABLE_DELTAS]
    jobs = [("normal", M, d) for M in range(2, args.kmax + 1) for d in deltas]
    jobs += [("halfnormal", M, d) for M in range(1, args.kmax // 2 + 1) for d in deltas]
    out: dict = {"deltas": deltas, "normal": {}, "halfnormal": {}}
    rows: dict = {}
    with ProcessPoolExecutor(max_workers=args.workers) as ex:
        for base, M, d, w, cap, acc in tqdm(ex.map(_job, jobs, chunksize=4), total=len(jobs), desc="rules"):
            rows[base, M, d] = (w, cap, acc)
    for base, M, _ in jobs:
        if str(M) in out[base]:
            continue
        out[base][str(M)] = {
            "weights": [rows[base, M, d][0] for d in deltas],
            "caps": [rows[base, M, d][1] for d in deltas],
            "acceptance": [round(rows[base, M, d][2], 8) for d in deltas],
        }
    atomic_write_text(OUT, json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
