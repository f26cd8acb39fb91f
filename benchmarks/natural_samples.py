"""Samples and denoising losses of the shipped natural-image models (docs/natural.md).

    .venv/bin/python benchmarks/natural_samples.py [--models natural32,natural64] [--crops 256]

For each model: ``benchmarks/figures/NAME_samples.png`` (16 samples of
``specforest.kdiffusion.sample_euler_ancestral``, 50 Karras steps on ``[0.002, 80]``, seed 0,
beside 16 real held-out crops), and the EDM loss per noise level on held-out and training crops
with the identity, zero and mean baselines, printed as the Markdown table of docs/natural.md
(the same numbers the training run recorded in ``weights/manifest.json``, for the same seed and
crop count). One thread; a few minutes on a CPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specforest.experiments.train_natural import evaluate, loss_table, samples_figure
from specforest.models.natural import MODELS, load_denoiser

FIGURES = Path(__file__).with_name("figures")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated model names")
    ap.add_argument("--crops", type=int, default=256, help="held-out and training crops per table (>= 1)")
    ap.add_argument("--samples", type=int, default=16, help="samples in each figure (>= 1)")
    args = ap.parse_args()
    names = args.models.split(",")
    bad = [n for n in names if n not in MODELS]
    if bad:
        ap.error(f"--models must name models among {', '.join(MODELS)}, got {', '.join(bad)}")
    if args.crops < 1 or args.samples < 1:
        ap.error("--crops and --samples must be >= 1")
    torch.set_num_threads(1)
    for name in names:
        den = load_denoiser(name)
        path = samples_figure(den, name, FIGURES / f"{name}_samples.png", n=args.samples)
        print(f"## {name}\n\nwrote {path}\n")
        print(loss_table(evaluate(den, name, args.crops)) + "\n", flush=True)


if __name__ == "__main__":
    main()
