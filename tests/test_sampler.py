"""Whole-chain exactness, determinism, accounting and input validation of the sampler.

With a single-Gaussian data law the velocity is affine in ``x``, so the
discretized chain is linear-Gaussian: the law of its final state has a closed
form, computed here step by step from the paper's formulas (eqs. 35-37) and
independently of ``specforest.sde``.
"""

import pytest
import torch

import specforest
from specforest import testing, trees
from specforest.couplings import GRS
from specforest.models import GaussianMixture
from specforest.planning import AdaptiveTree
from specforest.proposals import AutoDraft, LearnedDraft
from specforest.sde import flow_match_grid, uniform_grid

MU0 = torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64)
S0 = 0.3
GAUSS = GaussianMixture(MU0[None], torch.tensor([S0]))
X0 = testing.X0Features(GAUSS)
Z_TOL = 4.5


def check_law(samples: torch.Tensor, sigmas, churn) -> list[str]:
    """What fails in the comparison of ``samples`` with the chain's closed-form law."""
    return testing.check_law(samples, sigmas, churn, MU0, S0).failures


N = 6000
CHURN = 0.6
CONFIGS = {
    "standard": dict(tree=None),
    "rmc_chain": dict(tree=trees.chain(4), coupling="rmc"),
    "grs_chain": dict(tree=trees.chain(3), coupling="grs"),
    "grs_tree_internal": dict(tree=trees.uniform(2, 3)),
    "grs_tree_drafted": dict(tree=trees.uniform(3, 2), verify="drafted"),
    "grs_tree_parent": dict(tree=trees.uniform(2, 3), prefetch="parent"),
    "grs_widths_drift": dict(tree=trees.widths([3, 2, 1]), draft="drift"),
    "grs_irregular_x0": dict(tree=trees.from_parents([-1, 0, 0, 0, 1, 1, 4, 2]), draft="x0"),
    "grs_tree_eps_drafted_parent": dict(tree=trees.uniform(2, 2), draft="eps", verify="drafted", prefetch="parent"),
    "draft_model": dict(tree=trees.uniform(2, 3), draft=lambda x, s: 0.9 * GAUSS(x, s)),
    "lazy_tree": dict(tree=trees.uniform(3, 3), lazy=True),
    "lazy_drafted_parent": dict(tree=trees.uniform(2, 3), lazy=True, verify="drafted", prefetch="parent"),
    "lazy_chain_rmc": dict(tree=trees.chain(5), coupling="rmc", lazy=True),
    "rank_tree": dict(tree=trees.uniform(3, 3), coupling="rank"),
    "rank_irregular_drafted": dict(
        tree=trees.from_parents([-1, 0, 0, 0, 1, 1, 4, 2]), coupling="rank", verify="drafted"
    ),
    "rank_lazy_parent": dict(tree=trees.uniform(4, 2), coupling="rank", lazy=True, prefetch="parent"),
    "antithetic_tree": dict(tree=trees.uniform(2, 3), coupling="antithetic"),
    "auto_draft_rank": dict(tree=trees.uniform(2, 4), coupling="rank", draft="auto"),
    "x0_extrap_tree": dict(tree=trees.uniform(2, 3), draft="x0_extrap"),
    "x0_extrap_lazy_chain_parent": dict(
        tree=trees.chain(5), coupling="rmc", draft="x0_extrap", lazy=True, prefetch="parent"
    ),
    "adaptive_tree": dict(tree=AdaptiveTree(12, kmax=4), coupling="grs"),
    "adaptive_tree_lazy_drafted": dict(tree=AdaptiveTree(20, kmax=3), lazy=True, verify="drafted"),
    "auto_draft_lazy_chain": dict(tree=trees.chain(6), coupling="rmc", draft="auto", lazy=True),
    "auto_offsets_only_chain": dict(tree=trees.chain(5), coupling="rmc", draft=AutoDraft(stretches=1)),
    "antithetic_lazy_drafted": dict(tree=trees.uniform(2, 4), coupling="antithetic", lazy=True, verify="drafted"),
    "antithetic_pairs_k4": dict(tree=trees.uniform(4, 2), coupling="antithetic"),
    # pruned: a leaf beside an internal node at depth 1 (pairs complete wherever there are children)
    "antithetic_pruned": dict(tree=trees.from_parents([-1, 0, 0, 1, 1, 3, 3]), coupling="antithetic"),
    "antithetic_pairs_k4_lazy_parent": dict(
        tree=trees.uniform(4, 3), coupling="antithetic", lazy=True, prefetch="parent", draft="x0"
    ),
    # the previous round's evaluations at the same step, on noise aligned by step
    "memory_rmc_chain": dict(tree=trees.chain(5), coupling="rmc", draft="memory"),
    "memory_grs_chain_drafted": dict(tree=trees.chain(4), coupling="grs", draft="memory", verify="drafted"),
    "memory_rank_chain_lazy_parent": dict(
        tree=trees.chain(6), coupling="rank", draft="memory", lazy=True, prefetch="parent"
    ),
    "memory_tree": dict(tree=trees.uniform(2, 3), draft="memory"),
    "memory_antithetic_tree": dict(tree=trees.uniform(2, 2), coupling="antithetic", draft="memory"),
    # the same, moved to the drafted state by each trajectory's fitted secant gain
    "secant_rmc_chain": dict(tree=trees.chain(5), coupling="rmc", draft="secant"),
    "secant_grs_chain_drafted": dict(tree=trees.chain(4), coupling="grs", draft="secant", verify="drafted"),
    "secant_rank_chain_lazy_parent": dict(
        tree=trees.chain(6), coupling="rank", draft="secant", lazy=True, prefetch="parent"
    ),
    "secant_tree": dict(tree=trees.uniform(2, 3), draft="secant"),
    "secant_antithetic_tree": dict(tree=trees.uniform(2, 2), coupling="antithetic", draft="secant"),
    # a draft network (a wrong velocity) anchored at the same-step memory or the prefetch
    "learned_rmc_chain": dict(tree=trees.chain(5), coupling="rmc", draft=LearnedDraft(lambda x, s: 0.8 * GAUSS(x, s))),
    "learned_grs_chain_drafted_parent": dict(
        tree=trees.chain(4), verify="drafted", prefetch="parent", draft=LearnedDraft(lambda x, s: 0.8 * GAUSS(x, s))
    ),
    "learned_rank_tree_lazy": dict(
        tree=trees.uniform(3, 2), coupling="rank", lazy=True, draft=LearnedDraft(lambda x, s: 0.8 * GAUSS(x, s))
    ),
    # the x0 chain refined by Picard sweeps of the target (a branching tree drafts as x0)
    "picard_rmc_chain": dict(tree=trees.chain(5), coupling="rmc", draft="picard"),
    "picard2_grs_chain_drafted": dict(tree=trees.chain(8), coupling="grs", draft="picard2", verify="drafted"),
    "picard_rank_chain_lazy_parent": dict(
        tree=trees.chain(6), coupling="rank", draft="picard", lazy=True, prefetch="parent"
    ),
    "picard_antithetic_tree": dict(tree=trees.uniform(2, 2), coupling="antithetic", draft="picard"),
    "learned_antithetic_tree": dict(
        tree=trees.uniform(2, 2), coupling="antithetic", draft=LearnedDraft(lambda x, s: 0.8 * GAUSS(x, s))
    ),
    # the target's deep features of the last round's nodes, its outer part recomputed: the Gaussian's
    # own (responsibility 1: exact where it reads a node) and the clean-data prediction (the
    # memory draft's, not exact)
    "cached_rmc_chain": dict(tree=trees.chain(5), coupling="rmc", draft="cached"),
    "cached_prediction_rmc_chain": dict(tree=trees.chain(5), coupling="rmc", draft="cached", model=X0),
    "cached_prediction_grs_chain_drafted_parent": dict(
        tree=trees.chain(4), verify="drafted", prefetch="parent", draft="cached", model=X0
    ),
    "cached_prediction_rank_chain_lazy": dict(
        tree=trees.chain(6), coupling="rank", lazy=True, draft="cached", model=X0
    ),
    "cached_prediction_antithetic_tree": dict(
        tree=trees.uniform(2, 2), coupling="antithetic", draft="cached", model=X0
    ),
    # the cached draft plus the secant correction of its own error (the Gaussian's and the memory draft's)
    "corrected_rmc_chain": dict(tree=trees.chain(5), coupling="rmc", draft="corrected"),
    "corrected_prediction_rank_chain_lazy": dict(
        tree=trees.chain(6), coupling="rank", lazy=True, draft="corrected", model=X0
    ),
}


@pytest.mark.parametrize("grid", [pytest.param("uniform", marks=pytest.mark.slow), "flow_match"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_whole_chain_matches_linear_gaussian_law(name, grid):
    steps = 12
    sigmas = uniform_grid(steps) if grid == "uniform" else flow_match_grid(steps)
    x = torch.randn(N, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    cfg = dict(CONFIGS[name])
    out = specforest.sample(
        cfg.pop("model", GAUSS),
        x,
        steps=steps,
        churn=CHURN,
        grid=grid,
        generator=torch.Generator().manual_seed(2),
        **cfg,
    )
    assert not check_law(out.samples, sigmas, CHURN)
    if CONFIGS[name]["tree"] is not None:
        # speculation happened: fewer NFE than the standard sampler on average
        assert out.stats.nfe.double().mean() < steps


def test_whole_chain_rejects_broken_coupling():
    class Unfixed(GRS):
        def acceptance_weights(self, rho, lam_prev, G, s_hat):
            return ((rho - lam_prev).clamp_min(0.0) / s_hat).clamp(max=1.0)

    steps = 12
    x = torch.randn(N, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = specforest.sample(
        GAUSS,
        x,
        steps=steps,
        churn=CHURN,
        grid="uniform",
        tree=trees.uniform(3, 3),
        coupling=Unfixed(),
        generator=torch.Generator().manual_seed(2),
    )
    assert check_law(out.samples, uniform_grid(steps), CHURN)


def test_structured_siblings_need_uniform_widths():
    with pytest.raises(ValueError, match="same number of children"):
        specforest.sample(
            GAUSS, torch.zeros(2, 3), steps=5, churn=0.5, coupling="antithetic", tree=trees.from_parents([-1, 0, 0, 1])
        )
    with pytest.raises(ValueError, match="tree: .*even number of children"):
        specforest.sample(GAUSS, torch.zeros(2, 3), steps=5, churn=0.5, coupling="antithetic", tree=trees.uniform(3, 2))
    with pytest.raises(ValueError, match="at most 1 child"):
        specforest.sample(GAUSS, torch.zeros(2, 3), steps=5, churn=0.5, coupling="rmc", tree=trees.uniform(2, 2))


def test_antithetic_siblings_are_mirrored_in_the_draft():
    seen = []

    def model(x, sigma):
        seen.append(x.clone())
        return GAUSS(x, sigma)

    x = torch.randn(1, 3, dtype=torch.float64)
    specforest.sample(
        model,
        x,
        steps=30,
        churn=0.5,
        tree=trees.uniform(2, 1),
        coupling="antithetic",
        verify="drafted",
        generator=torch.Generator().manual_seed(0),
    )
    rows = seen[2]  # Euler step, root fetch, then root + 2 children
    mid = 0.5 * (rows[1] + rows[2])
    # both children sit symmetrically about the draft mean: their midpoint is the same for any noise
    assert rows.shape[0] == 3 and torch.isfinite(mid).all()
    seen.clear()
    specforest.sample(
        model,
        x,
        steps=30,
        churn=0.5,
        tree=trees.uniform(2, 1),
        coupling="antithetic",
        verify="drafted",
        generator=torch.Generator().manual_seed(1),
    )
    assert torch.allclose(0.5 * (seen[2][1] + seen[2][2]), mid)


def test_four_antithetic_children_are_two_mirrored_pairs():
    seen = []

    def model(x, sigma):
        seen.append(x.clone())
        return GAUSS(x, sigma)

    x = torch.randn(1, 3, dtype=torch.float64)
    specforest.sample(
        model,
        x,
        steps=30,
        churn=0.5,
        tree=trees.uniform(4, 1),
        coupling="antithetic",
        verify="drafted",
        generator=torch.Generator().manual_seed(0),
    )
    rows = seen[2]  # root + 4 children
    assert rows.shape[0] == 5
    assert torch.allclose(rows[1] + rows[2], rows[3] + rows[4])
    assert not torch.allclose(rows[1], rows[3])


@pytest.mark.parametrize(
    "coupling,tree,lazy",
    [
        ("grs", trees.uniform(3, 2), False),
        ("rank", trees.uniform(3, 2), False),
        ("rank", trees.uniform(2, 4), True),
        ("antithetic", trees.uniform(2, 3), False),
        ("rmc", trees.chain(4), False),
    ],
)
def test_acceptance_rate_matches_the_closed_form_for_observed_delta(coupling, tree, lazy):
    """Sampler-level check: every verification's acceptance agrees with the coupling's closed form
    at the mismatch observed there (Theorem 2 for GRS), pooled over the run."""
    gmm = GaussianMixture.paper(dim=50, components=3, seed=0)
    x = torch.randn(400, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = specforest.sample(
        gmm,
        x,
        steps=20,
        churn=0.2,
        tree=tree,
        coupling=coupling,
        lazy=lazy,
        prefetch="parent",
        record_deltas=True,
        generator=torch.Generator().manual_seed(1),
    )
    d, acc = out.stats.deltas[:, 2], out.stats.deltas[:, 3]
    # the closed form (a quadrature for rank and antithetic) on a fine grid, interpolated: its error
    # (~1e-4) is far below the test's resolution (~0.006 per verification at these sizes)
    grid = torch.linspace(0.0, float(d.max()) + 1e-9, 257, dtype=torch.float64)
    a = specforest.couplings.get_coupling(coupling).acceptance(grid, tree.max_children).reshape(-1)
    d = d.contiguous()
    i = torch.bucketize(d, grid).clamp(1, len(grid) - 1)
    w = (d - grid[i - 1]) / (grid[i] - grid[i - 1])
    p = (1 - w) * a[i - 1] + w * a[i]
    z = (acc.sum() - p.sum()) / torch.sqrt((p * (1 - p)).sum())
    assert abs(float(z)) < Z_TOL


def test_the_acceptance_check_sees_an_over_accepting_rule():
    class Generous(GRS):
        def acceptance_weights(self, rho, lam_prev, G, s_hat):
            return (1.5 * super().acceptance_weights(rho, lam_prev, G, s_hat)).clamp(max=1.0)

    gmm = GaussianMixture.paper(dim=50, components=3, seed=0)
    x = torch.randn(400, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = specforest.sample(
        gmm,
        x,
        steps=20,
        churn=0.2,
        tree=trees.uniform(3, 2),
        coupling=Generous(),
        prefetch="parent",
        record_deltas=True,
        generator=torch.Generator().manual_seed(1),
    )
    d, acc = out.stats.deltas[:, 2], out.stats.deltas[:, 3]
    p = specforest.couplings.grs_acceptance(d, 3)
    assert (acc.sum() - p.sum()) / torch.sqrt((p * (1 - p)).sum()) > Z_TOL


def _run(**kw):
    x = torch.randn(40, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    base = dict(steps=10, churn=0.5, tree=trees.uniform(2, 3), generator=torch.Generator().manual_seed(9))
    base.update(kw)
    return specforest.sample(GAUSS, x, **base)


def test_same_seed_same_result_and_different_seed_differs():
    a, b = _run(), _run()
    assert torch.equal(a.samples, b.samples) and torch.equal(a.stats.nfe, b.stats.nfe)
    c = _run(generator=torch.Generator().manual_seed(10))
    assert not torch.equal(a.samples, c.samples)


def test_max_rows_chunking_changes_nothing():
    a, b = _run(), _run(max_rows=7)
    assert torch.equal(a.samples, b.samples)


def test_input_not_modified_and_dtype_kept():
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    x0 = x.clone()
    out = specforest.sample(
        GAUSS, x, steps=6, churn=0.5, tree=trees.uniform(2, 2), generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(x, x0)
    assert out.samples.dtype == torch.float32 and out.samples.shape == (8, 3)


def test_image_shaped_states_and_model_kwargs():
    def model(x, sigma, scale):
        assert x.shape[1:] == (2, 3, 3) and sigma.shape == (x.shape[0],)
        return scale * x

    x = torch.randn(5, 2, 3, 3, generator=torch.Generator().manual_seed(0))
    out = specforest.sample(
        model,
        x,
        steps=8,
        churn=0.3,
        tree=trees.uniform(2, 2),
        model_kwargs={"scale": 0.5},
        generator=torch.Generator().manual_seed(0),
    )
    assert out.samples.shape == x.shape


@pytest.mark.parametrize("lazy", [False, True])
def test_per_trajectory_conditioning_follows_rows(lazy):
    """Labels (batch,) in cond reach each state of that trajectory, tree nodes included."""
    centers = torch.tensor([[-5.0, 0.0, 0.0], [5.0, 0.0, 0.0]], dtype=torch.float64)
    comps = [GaussianMixture(c[None], torch.tensor([0.2])) for c in centers]

    def model(x, sigma, label):
        assert label.shape == (x.shape[0],)
        return torch.where((label == 0)[:, None], comps[0](x, sigma), comps[1](x, sigma))

    label = torch.tensor([0, 1] * 50)
    x = torch.randn(100, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = specforest.sample(
        model,
        x,
        steps=10,
        churn=0.5,
        tree=trees.uniform(2, 3),
        lazy=lazy,
        cond={"label": label},
        generator=torch.Generator().manual_seed(1),
    )
    assert torch.equal((out.samples[:, 0] > 0).long(), label)
    # a draft model gets the same per-row conditioning
    out = specforest.sample(
        model,
        x,
        steps=10,
        churn=0.5,
        tree=trees.uniform(2, 3),
        lazy=lazy,
        draft=lambda x, s, label: 0.9 * model(x, s, label),
        cond={"label": label},
        generator=torch.Generator().manual_seed(1),
    )
    assert torch.equal((out.samples[:, 0] > 0).long(), label)
    assert out.stats.nfe.double().mean() < 10


def test_accounting_one_call_per_round():
    calls = []

    def model(x, sigma):
        calls.append(x.shape[0])
        return GAUSS(x, sigma)

    x = torch.randn(30, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = specforest.sample(
        model, x, steps=12, churn=0.5, tree=trees.uniform(2, 2), generator=torch.Generator().manual_seed(0)
    )
    st = out.stats
    assert len(calls) == st.calls == int(st.nfe.max())
    assert sum(calls) == int(st.rows.sum())
    assert (st.nfe >= 3).all()  # two Euler steps and one root fetch at least
    # committed steps add up: 2 Euler steps + speculative steps = T
    assert ((st.spec_steps + 2) == 12).all()
    assert (st.accepts <= st.attempts).all()
    std = specforest.sample(model, x, steps=12, churn=0.5, generator=torch.Generator().manual_seed(0))
    assert (std.stats.nfe == 12).all() and (std.stats.speedup == 1).all()


def test_budget_drafted_states_per_round():
    counted = []

    def model(x, sigma):
        counted.append(x.shape[0])
        return GAUSS(x, sigma)

    x = torch.randn(1, 3, dtype=torch.float64)
    tree = trees.uniform(2, 3)
    specforest.sample(
        model, x, steps=30, churn=0.5, tree=tree, verify="drafted", generator=torch.Generator().manual_seed(0)
    )
    # first rounds: Euler step, root fetch, then a full tree: |V| = B + 1 evaluations
    assert counted[:3] == [1, 1, tree.budget + 1]


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(churn=0.0), ValueError, "churn must be in \\(0, 1\\]"),
        (dict(churn=-0.1), ValueError, "churn"),
        (dict(churn=1.5), ValueError, "churn"),
        (dict(steps=0), ValueError, "steps must be >= 1"),
        (dict(steps=2.5), TypeError, "steps must be an int"),
        (dict(prefetch="first"), ValueError, "prefetch must be one of"),
        (dict(verify="all"), ValueError, "verify must be one of"),
        (dict(coupling="rmc"), ValueError, "tree: coupling .rmc. takes at most 1 child per node"),
        (dict(coupling="xyz"), ValueError, "coupling must be one of"),
        (dict(draft="mu"), ValueError, "draft must be one of"),
        (dict(grid="cosine"), ValueError, "grid must be one of"),
        (dict(tree="uniform"), TypeError, "tree must be a DraftTree"),
        (dict(max_rows=0), ValueError, "max_rows"),
        (dict(lazy="yes"), TypeError, "lazy must be a bool"),
    ],
)
def test_bad_input_names_the_parameter(kwargs, exc, match):
    base = dict(steps=5, churn=0.5, tree=trees.uniform(2, 2))
    base.update(kwargs)
    with pytest.raises(exc, match=match):
        specforest.sample(GAUSS, torch.zeros(2, 3), **base)


@pytest.mark.parametrize(
    "fn,match",
    [
        (lambda: trees.uniform(0, 2), "K must be an int >= 1"),
        (lambda: trees.uniform(2, 0), "L must be an int >= 1"),
        (lambda: trees.chain(0), "L must be an int >= 1"),
        (lambda: trees.widths([2, 0]), "K must be an int >= 1"),
    ],
)
def test_bad_tree_parameters(fn, match):
    with pytest.raises(ValueError, match=match):
        fn()


def test_bad_states_and_model_outputs():
    with pytest.raises(ValueError, match="shape \\(batch, \\*shape\\)"):
        specforest.sample(GAUSS, torch.zeros(3), steps=5, churn=0.5)
    with pytest.raises(TypeError, match="floating-point"):
        specforest.sample(GAUSS, torch.zeros(2, 3, dtype=torch.long), steps=5, churn=0.5)
    with pytest.raises(ValueError, match="NaN or inf"):
        specforest.sample(GAUSS, torch.full((2, 3), float("nan")), steps=5, churn=0.5)
    with pytest.raises(ValueError, match="model must return a tensor of the input's shape"):
        specforest.sample(lambda x, s: x[:, :2], torch.zeros(2, 3), steps=5, churn=0.5)
    with pytest.raises(ValueError, match="shape \\(M, 3\\)"):
        specforest.sample(GAUSS, torch.zeros(2, 4), steps=5, churn=0.5)

    def nan_model(x, sigma):
        out = GAUSS(x, sigma)
        out[sigma < 0.5] = float("nan")
        return out

    with pytest.raises(FloatingPointError, match="NaN or inf"):
        specforest.sample(nan_model, torch.zeros(2, 3), steps=5, churn=0.5, tree=trees.uniform(2, 2))


def test_progress_and_callback():
    seen = []
    _run(callback=lambda d: seen.append((d["round"], d["step"].clone())), progress=True)
    assert seen and seen[-1][1].eq(10).all()
    assert [r for r, _ in seen] == list(range(1, len(seen) + 1))


def _per_row(record, batch: int, prefix: str = "") -> dict:
    """Every per-trajectory tensor of a run's state (a tensor field with one row per trajectory),
    found through its records, by dotted name."""
    import dataclasses

    out = {}
    for f in dataclasses.fields(record):
        v = getattr(record, f.name)
        if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == batch:
            out[prefix + f.name] = v
        elif dataclasses.is_dataclass(v):
            out.update(_per_row(v, batch, f"{prefix}{f.name}."))
    return out


def _restart_failures(old, new, fresh, rows) -> list:
    """What differs from a restart: rows ``rows`` of every per-trajectory tensor as in ``fresh``, the others as in ``old``."""
    batch = old.x.shape[0]
    other = torch.ones(batch, dtype=torch.bool)
    other[rows] = False
    want_new, want_old = _per_row(fresh, batch), _per_row(old, batch)
    got = _per_row(new, batch)
    bad = sorted(set(want_new) ^ set(got) | set(want_old) ^ set(got))
    for name in sorted(set(want_new) & set(got) & set(want_old)):
        if not torch.equal(got[name][rows], want_new[name][rows]) or not torch.equal(
            got[name][other], want_old[name][other]
        ):
            bad.append(name)
    return bad


def test_restart_resets_every_per_trajectory_field_of_the_state():
    """``RunState.restart`` (continuous batching's refill) gives the restarted rows of every per-trajectory
    field what ``init_state`` gives a fresh trajectory, keeps the other rows and the run's own fields: a
    field it forgot would fail here, and a broken restart is caught."""
    from dataclasses import replace

    from specforest import engine, streams
    from specforest.sampler import prepare

    spec = prepare(
        specforest.SamplerOptions(steps=12, churn=0.5, tree=trees.uniform(2, 2), draft="x0_extrap", record_deltas=True)
    )
    gmm = GaussianMixture.paper(dim=4, components=3, seed=0)
    batch = 5
    ctx = spec.context(gmm, (4,), torch.float64, torch.device("cpu"), batch, {})
    x0, keys = (
        streams.randn(1, torch.arange(batch), (4,), dtype=torch.float64),
        streams.sample_keys(1, torch.arange(batch)),
    )
    with torch.inference_mode():
        old = engine.init_state(ctx, x0, keys)
        for _ in range(5):  # prefetched evaluations with a history, pending counters, records
            old = engine.run_round(ctx, old)
        rows = torch.tensor([1, 3])
        x_new = streams.randn(1, torch.tensor([7, 8]), (4,), dtype=torch.float64)
        keys_new = streams.sample_keys(1, torch.tensor([7, 8]))
        new = old.restart(rows, x_new, keys_new)
        fresh = engine.init_state(ctx, x0.index_copy(0, rows, x_new), keys.index_copy(0, rows, keys_new))
    assert old.counters.pending and bool(old.pre.has_prev[rows].all()) and old.records
    flushed = replace(old, counters=old.counters.flushed())
    names = _per_row(fresh, batch)
    assert {"x", "step", "keys", "pre.y", "pre.prev_v", "pre.has_prev", "counters.nfe", "counters.per_depth"} <= set(
        names
    )
    assert _restart_failures(flushed, new, fresh, rows) == []
    # the run's own fields are kept
    assert (new.rounds, new.records, new.draft_calls, new.seconds) == (
        old.rounds,
        old.records,
        old.draft_calls,
        old.seconds,
    )
    assert new.draft_state is old.draft_state and new.counters.pending == () and new.noise is None
    # the check has teeth: a restart that kept a prefetch field, or left a field out, is caught
    kept = replace(new, pre=replace(new.pre, prev_y=old.pre.prev_y))
    assert _restart_failures(flushed, kept, fresh, rows) == ["pre.prev_y"]
    lost = replace(new, counters=replace(new.counters, commits=None))
    assert _restart_failures(flushed, lost, fresh, rows) == ["counters.commits"]


def _tensors(value, name: str, out: dict) -> dict:
    """Every tensor reachable from a run's context through its records and tuples, by dotted name."""
    import dataclasses

    if isinstance(value, torch.Tensor):
        out[name] = value
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            _tensors(v, f"{name}[{i}]", out)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _tensors(getattr(value, f.name), f"{name}.{f.name}", out)
    return out


@pytest.mark.parametrize(
    "tree,lazy",
    [(None, False), (trees.uniform(2, 2), False), (trees.widths([3, 2]), True), (AdaptiveTree(6, kmax=3), False)],
)
def test_rounds_never_change_the_run_context(tree, lazy):
    """No round writes the ``RunContext``: its fields stay the same objects and none of its tensors is
    changed in place (their version counters do not move), the per-run tables included."""
    from specforest import engine, streams
    from specforest.sampler import prepare

    if isinstance(tree, trees.DraftTree):
        tree = trees.from_parents(tree.parent.tolist())  # its own tables, made here in normal mode
    spec = prepare(specforest.SamplerOptions(churn=0.5, sigmas=flow_match_grid(10), tree=tree, lazy=lazy))
    gmm = GaussianMixture.paper(dim=4, components=3, seed=0)
    ctx = spec.context(gmm, (4,), torch.float64, torch.device("cpu"), 4, {})
    state = engine.init_state(ctx, streams.randn(0, torch.arange(4), (4,), dtype=torch.float64), torch.arange(4))
    fields = {k: id(v) for k, v in vars(ctx).items()}
    before = {k: (id(t), t._version) for k, t in _tensors(ctx, "ctx", {}).items()}
    assert len(before) > 10
    with torch.inference_mode():
        while (nxt := engine.run_round(ctx, state)) is not None:
            state = nxt
    assert bool((state.step == 10).all())
    assert {k: id(v) for k, v in vars(ctx).items()} == fields
    assert {k: (id(t), t._version) for k, t in _tensors(ctx, "ctx", {}).items()} == before
