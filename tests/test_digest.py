"""A recorded digest of samples: refactors of the engine keep every sample as it was.

Each configuration (every registered coupling, every tree family, every draft,
lazy and full, the standard sampler, continuous batching through ``generate``,
the digits network) is run with a fixed seed and compared with the samples and
per-sample NFE recorded in ``tests/data/sample_digest.pt``. NFE are compared
exactly. The mixture runs in float64 and its samples are compared within 1e-12
(a changed draw or acceptance moves a sample by order one; the last bit of a
batched matrix product can differ between CPUs, e.g. with and without AVX-512);
the digits network within 1e-5. Regenerate the record, only when a change
of the samples is intended and understood, with ``python tests/test_digest.py``.
Every registered chain (``specforest.chains``) has its own record, ``tests/data/chain_digest.pt``
(``python tests/test_digest.py --chains-only`` rewrites only it).
"""

from pathlib import Path

import pytest
import torch

import specforest
from specforest import chains, planning, trees
from specforest.models import GaussianMixture

RECORD = Path(__file__).parent / "data" / "sample_digest.pt"
CHAIN_RECORD = Path(__file__).parent / "data" / "chain_digest.pt"
CHAIN_GRID = chains.karras_linear_grid(12, 0.03, 20.0)
GMM = GaussianMixture.paper(dim=6, components=3, seed=1)
X = torch.randn(6, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
BASE = dict(steps=16, churn=0.5, seed=2024)
MIXTURE_ATOL = 1e-12

CONFIGS = {
    "standard": dict(tree=None),
    "rmc_chain": dict(tree=trees.chain(4), coupling="rmc"),
    "grs_chain_velocity": dict(tree=trees.chain(3)),
    "grs_uniform_x0": dict(tree=trees.uniform(2, 3), draft="x0"),
    "grs_optimal_lazy": dict(tree=trees.optimal(lambda level, k: 1 - 0.5 ** (k + level), 12, 3), lazy=True),
    "grs_drafted_parent": dict(tree=trees.uniform(3, 2), verify="drafted", prefetch="parent"),
    "grs_widths_eps": dict(tree=trees.widths([3, 2, 1]), draft="eps"),
    "grs_x0_extrap_chunked": dict(tree=trees.uniform(2, 2), draft="x0_extrap", max_rows=3),
    "grs_auto": dict(tree=trees.uniform(2, 3), draft="auto"),
    "grs_drift": dict(tree=trees.chain(4), draft="drift"),
    "rmc_memory_chain": dict(tree=trees.chain(4), coupling="rmc", draft="memory"),
    "rmc_secant_chain": dict(tree=trees.chain(4), coupling="rmc", draft="secant"),
    "grs_auto_chain_drafted": dict(tree=trees.chain(3), draft="auto", verify="drafted"),
    "grs_adaptive": dict(tree=planning.AdaptiveTree(budget=10, max_depth=3)),
    "rank_uniform": dict(tree=trees.uniform(3, 2), coupling="rank"),
    "rank_lazy": dict(tree=trees.uniform(2, 3), coupling="rank", lazy=True),
    "antithetic_uniform": dict(tree=trees.uniform(2, 3), coupling="antithetic"),
    "antithetic_pruned": dict(tree=trees.from_parents([-1, 0, 0, 1, 1, 3, 3]), coupling="antithetic"),
    "draft_model": dict(tree=trees.uniform(2, 2), draft=lambda x, s: 0.9 * GMM(x, s)),
    "rmc_cached_chain": dict(tree=trees.chain(4), coupling="rmc", draft="cached"),
}


def _gmm(name: str) -> dict:
    r = specforest.sample(GMM, X, **BASE, **CONFIGS[name])
    return {"samples": r.samples, "nfe": r.stats.nfe}


def _generated() -> dict:
    g = specforest.generate(
        GMM,
        count=7,
        make_x=lambda idx: torch.stack([X[int(i) % 6] * (1 + 0.1 * int(i)) for i in idx]),
        seed=11,
        batch=3,
        steps=16,
        churn=0.5,
        tree=trees.uniform(2, 2),
        coupling="rank",
    )
    out = {}
    for fin in g:
        for j, i in enumerate(fin.index.tolist()):
            out[i] = (fin.samples[j], fin.stats.nfe[j])
    order = sorted(out)
    return {"samples": torch.stack([out[i][0] for i in order]), "nfe": torch.stack([out[i][1] for i in order])}


def _digits() -> dict:
    from specforest.models import digits

    v = digits.load_velocity()
    x = specforest.streams.randn(3, torch.arange(3), (1, 8, 8))
    labels = torch.tensor([1, 4, 7])
    r = specforest.sample(
        v, x, steps=12, churn=0.3, seed=9, tree=trees.chain(3), draft="x0", cond={"class_labels": labels}
    )
    return {"samples": r.samples, "nfe": r.stats.nfe}


def _chain(name: str) -> dict:
    """Every registered chain (a stochastic setting of it) on a GRS tree with the secant draft."""
    ch = chains.get_chain(name).example()
    r = specforest.sample(
        GMM, X, sigmas=CHAIN_GRID, chain=ch, seed=77, tree=trees.uniform(2, 2), coupling="grs", draft="secant"
    )
    return {"samples": r.samples, "nfe": r.stats.nfe}


def _all() -> dict:
    torch.set_num_threads(1)
    out = {name: _gmm(name) for name in CONFIGS}
    out["generate"] = _generated()
    out["digits"] = _digits()
    return out


@pytest.fixture(scope="module")
def record() -> dict:
    return torch.load(RECORD, weights_only=True)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mixture_samples_are_the_recorded_ones(record, name):
    got = _gmm(name)
    assert torch.equal(got["nfe"], record[name]["nfe"])
    torch.testing.assert_close(got["samples"], record[name]["samples"], rtol=0, atol=MIXTURE_ATOL)


def test_generated_samples_are_the_recorded_ones(record):
    got = _generated()
    assert torch.equal(got["nfe"], record["generate"]["nfe"])
    torch.testing.assert_close(got["samples"], record["generate"]["samples"], rtol=0, atol=MIXTURE_ATOL)


def test_digits_samples_are_the_recorded_ones(record):
    got = _digits()
    assert torch.equal(got["nfe"], record["digits"]["nfe"])
    torch.testing.assert_close(got["samples"], record["digits"]["samples"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", chains.available_chains())
def test_every_chain_samples_the_recorded_ones(name):
    record = torch.load(CHAIN_RECORD, weights_only=True)
    assert name in record, f"chain {name!r} has no recorded digest: regenerate with python tests/test_digest.py"
    got = _chain(name)
    assert torch.equal(got["nfe"], record[name]["nfe"])
    torch.testing.assert_close(got["samples"], record[name]["samples"], rtol=0, atol=MIXTURE_ATOL)


def test_a_changed_sampler_fails_the_digest(record):
    # the same comparison refuses a run that differs only in its seed
    got = specforest.sample(GMM, X, **{**BASE, "seed": 2025}, **CONFIGS["grs_chain_velocity"])
    gap = (got.samples - record["grs_chain_velocity"]["samples"]).abs().max()
    assert gap > 1e6 * MIXTURE_ATOL


if __name__ == "__main__":
    import sys

    RECORD.parent.mkdir(exist_ok=True)
    if "--chains-only" not in sys.argv:
        torch.save(_all(), RECORD)
        print(f"wrote {RECORD}")
    torch.set_num_threads(1)
    torch.save({name: _chain(name) for name in chains.available_chains()}, CHAIN_RECORD)
    print(f"wrote {CHAIN_RECORD}")
