"""Regenerate the shipped rank-coupling weight table, src/specforest/data/rank_weights.json.

    .venv/bin/python scripts/make_rank_table.py [--kmax 16]

For each K and each delta of the table's grid, solves the linear program of
:func:`specforest.couplings.rank_weights_lp` for the mixture of order statistics
that maximizes the acceptance of the rank coupling.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from specforest.couplings import _RANK_DELTAS, rank_weights_lp
from specforest.experiments.io import atomic_write_text

OUT = Path(__file__).resolve().parents[1] / "src" / "specforest" / "data" / "rank_weights.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kmax", type=int, default=16, help="largest K tabulated (>= 2)")
    args = ap.parse_args()
    deltas = [round(float(d), 6) for d in _RANK_DELTAS]
    table = {}
    for K in tqdm(range(2, args.kmax + 1), desc="K"):
        table[str(K)] = [[round(float(w), 8) for w in rank_weights_lp(d, K)[0]] for d in deltas]
    atomic_write_text(OUT, json.dumps({"deltas": deltas, "weights": table}, separators=(",", ":")) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
