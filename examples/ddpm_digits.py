"""DDPM at its own 1000 steps on the shipped digits model: the standard sampler against speculation.

Both runs have the law of ancestral DDPM (ComfyUI's ``sample_ddpm``; ``docs/chains.md``): the
speculative one drafts 62 steps ahead with the ``secant`` draft and accepts by the RMC coupling.
Prints the sequential model calls and the seconds of each.

    .venv/bin/python examples/ddpm_digits.py [--images 1] [--steps 1000]
"""

import argparse
import time

import torch

import specforest
from specforest import chains
from specforest.models.digits import load_velocity

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--images", type=int, default=1, help="digits to draw (>= 1)")
ap.add_argument("--steps", type=int, default=1000, help="DDPM steps (>= 2); 1000 is DDPM's own schedule")
args = ap.parse_args()
if args.images < 1 or args.steps < 2:
    ap.error("--images must be >= 1 and --steps >= 2")

model = load_velocity()
grid = chains.ddpm_linear_grid(args.steps)
labels = torch.arange(args.images) % 10
x = float(grid[0]) * torch.randn(args.images, 1, 8, 8, generator=torch.Generator().manual_seed(0))
run = dict(sigmas=grid, chain="ddpm", seed=1, cond={"class_labels": labels})
for name, extra in [
    ("standard DDPM", dict(tree=None)),
    (
        "speculative DDPM, RMC chain B = 62, secant",
        dict(tree=specforest.trees.chain(62), coupling="rmc", draft="secant"),
    ),
]:
    t0 = time.perf_counter()
    out = specforest.sample(model, x, **run, **extra)
    seconds = time.perf_counter() - t0
    nfe = out.stats.nfe.double().mean()
    print(f"{name:45s} {nfe:7.1f} sequential calls  {seconds:6.2f} s  ({args.steps / nfe:.1f}x fewer calls)")
print("digits drawn for labels", labels.tolist())
