"""The sampler's own time per round next to the target call it makes.

    .venv/bin/python benchmarks/sampler_overhead.py

A small convolutional network on 3x32x32 states stands in for a target
denoiser (it is far cheaper than a real one, which makes the comparison
harsher on the sampler). For each tree, times the whole run, the time spent
inside target calls, and reports the sampler's own time per round (drafting,
coupling, bookkeeping) against the mean target call. Regenerates the
``overhead`` section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

import specforest
from specforest import trees
from specforest.experiments.results import machine_line, replace_section


class ConvNet(nn.Module):
    """A 4-layer conv net, 64 channels: a stand-in for a (much larger) denoiser."""

    def __init__(self, ch: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(4, ch, 3, padding=1), nn.SiLU(),
            nn.Conv2d(ch, ch, 3, padding=1), nn.SiLU(),
            nn.Conv2d(ch, ch, 3, padding=1), nn.SiLU(),
            nn.Conv2d(ch, 3, 3, padding=1),
        )

    @torch.no_grad()
    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        s = sigma.reshape(-1, 1, 1, 1).expand(-1, 1, *x.shape[2:])
        return 0.1 * self.net(torch.cat([x, s], 1)) + x


def run(tree, coupling, batch: int, steps: int, seed: int = 0) -> dict:
    torch.manual_seed(0)
    net = ConvNet().eval()
    model_time = [0.0]

    def model(x, sigma):
        t = time.perf_counter()
        out = net(x, sigma)
        model_time[0] += time.perf_counter() - t
        return out

    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    t0 = time.perf_counter()
    out = specforest.sample(model, x, steps=steps, churn=0.3, tree=tree, coupling=coupling,
                            generator=torch.Generator().manual_seed(seed + 1))
    total = time.perf_counter() - t0
    calls = out.stats.calls
    return dict(total=total, model=model_time[0], calls=calls,
                overhead_per_round=(total - model_time[0]) / calls,
                model_per_call=model_time[0] / calls, rows=float(out.stats.rows.double().mean()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8, help="trajectories, >= 1")
    ap.add_argument("--steps", type=int, default=30, help="steps T, >= 3")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    configs = [
        ("standard", None, "grs"),
        ("RMC chain B=14", trees.chain(14), "rmc"),
        ("D-GRS (2,3) B=14", trees.uniform(2, 3), "grs"),
        ("D-GRS (3,4) B=120", trees.uniform(3, 4), "grs"),
        ("D-GRS (4,4) B=340", trees.uniform(4, 4), "grs"),
    ]
    lines = [
        f"Measured with `benchmarks/sampler_overhead.py --batch {args.batch} --steps {args.steps}` on {machine_line()}.",
        "",
        f"States 3x32x32, {args.batch} trajectories, churn 0.3; target = a 4-layer 64-channel conv net "
        "(a stand-in far cheaper than a real denoiser). Sampler time = wall time outside target calls.",
        "",
        "| configuration | rounds (target calls) | states per call | target time per call (ms) | sampler time per round (ms) | sampler / target |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, tree, coupling in configs:
        r = run(tree, coupling, args.batch, args.steps)
        per_call_rows = r["rows"] * args.batch / r["calls"]
        lines.append(
            f"| {name} | {r['calls']} | {per_call_rows:.0f} | {1e3 * r['model_per_call']:.1f} | "
            f"{1e3 * r['overhead_per_round']:.1f} | {r['overhead_per_round'] / r['model_per_call']:.2f} |"
        )
        print(lines[-1], flush=True)
    replace_section(args.out, "overhead", "## Sampler overhead per round", "\n".join(lines))


if __name__ == "__main__":
    main()
