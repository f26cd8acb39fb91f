"""Speculative sampling of the paper's Gaussian mixture, next to the standard sampler."""

import torch

import specforest
from specforest.models import GaussianMixture

gmm = GaussianMixture.paper(dim=500, components=5, seed=0)
x_T = torch.randn(64, 500, generator=torch.Generator().manual_seed(1))

std = specforest.sample(gmm, x_T, steps=30, churn=0.1, generator=torch.Generator().manual_seed(2))
for name, tree, coupling in [
    ("RMC chain, B=14", specforest.trees.chain(14), "rmc"),
    ("D-GRS (2,3), B=14", specforest.trees.uniform(K=2, L=3), "grs"),
    ("D-GRS (4,4), B=340", specforest.trees.uniform(K=4, L=4), "grs"),
]:
    out = specforest.sample(
        gmm, x_T, steps=30, churn=0.1, tree=tree, coupling=coupling,
        generator=torch.Generator().manual_seed(2), progress=True,
    )
    s = out.stats
    print(
        f"{name:20s} NFE {s.nfe.double().mean():5.2f} (standard {std.stats.nfe.double().mean():.0f})"
        f"  speedup {s.speedup.mean():.3f} +- {s.speedup.std() / len(s.speedup) ** 0.5:.3f}"
        f"  accept/depth {[round(a, 2) for a in s.accept_rate_per_depth.tolist()]}"
    )
share = torch.bincount(gmm.assign(out.samples), minlength=5).tolist()
print("samples per mixture component (D-GRS):", share)
