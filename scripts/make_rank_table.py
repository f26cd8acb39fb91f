"""Regenerate the shipped rank-rule table, src/specforest/data/rank_rules.npz.

    .venv/bin/python scripts/make_rank_table.py [--kmax 16] [--workers 2]

For each number of values M and each delta of the table's grid, solves the
linear program of :func:`specforest.rank_rules.rule_lp` for the weights of the
max-conditioned rank rule. It does this for the ``normal`` base, M = 2..kmax
i.i.d. children (the ``rank`` coupling), and for the ``halfnormal`` base,
M = 2..kmax/2 antithetic pairs (the ``antithetic`` coupling). It also stores
each row's acceptance by quadrature. Takes a few minutes on two cores. The file
is written atomically.
"""

from __future__ import annotations

import argparse
import io
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

OUT = Path(__file__).resolve().parents[1] / "src" / "specforest" / "data" / "rank_rules.npz"


def _job(args: tuple[str, int, float]):
    import torch

    torch.set_num_threads(1)
    from specforest.rank_rules import rule_acceptance, rule_lp

    base, M, delta = args
    W, _ = rule_lp(delta, M, base)
    return base, M, delta, W.numpy(), float(rule_acceptance(delta, W, base, n=8001))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kmax", type=int, default=16, help="largest number of children tabulated (>= 2)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes")
    args = ap.parse_args()
    if args.kmax < 2:
        ap.error("--kmax must be >= 2")
    from specforest.experiments.io import atomic_write
    from specforest.rank_rules import EDGES, TABLE_DELTAS

    deltas = [float(d) for d in TABLE_DELTAS]
    jobs = [("normal", M, d) for M in range(2, args.kmax + 1) for d in deltas]
    jobs += [("halfnormal", M, d) for M in range(2, args.kmax // 2 + 1) for d in deltas]
    rows: dict = {}
    with ProcessPoolExecutor(max_workers=args.workers) as ex:
        for base, M, d, W, acc in tqdm(ex.map(_job, jobs, chunksize=4), total=len(jobs), desc="rules"):
            rows[base, M, d] = (W, acc)
    arrays = {"deltas": np.array(deltas), **{f"edges_{b}": EDGES[b].numpy() for b in EDGES}}
    for base, M in sorted({(b, m) for b, m, _ in jobs}):
        arrays[f"{base}_{M}"] = np.stack([rows[base, M, d][0] for d in deltas]).astype(np.float32)
        arrays[f"acceptance_{base}_{M}"] = np.array([rows[base, M, d][1] for d in deltas])
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    atomic_write(OUT, lambda f: f.write(buf.getvalue()), binary=True)
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
