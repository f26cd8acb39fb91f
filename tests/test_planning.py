"""The budget-shaped tree optimizer: exact DP against brute force, calibration, CLI."""

import itertools
import json

import pytest
import torch
from click.testing import CliRunner

import specforest
from specforest import planning, trees
from specforest.cli import main
from specforest.couplings import grs_acceptance
from specforest.models import GaussianMixture
from specforest.planning import AdaptiveTree, acceptance_model, make_tree, plan_tree


def expected_steps(tree, acc) -> float:
    """Expected committed steps of a round on ``tree`` under the model (by recursion)."""

    def value(u: int, level: int) -> float:
        kids = [int(c) for c in tree.children[u] if c >= 0]
        if not kids:
            return 0.0
        a = acc(level, len(kids))
        # identical children are interchangeable; average their continuation
        cont = sum(value(c, level + 1) for c in kids) / len(kids)
        return 1.0 + a * cont

    return value(0, 1)


def all_width_trees(budget: int, depth: int):
    """Every depth-dependent-width tree with at most ``budget`` drafted states."""
    for L in range(1, depth + 1):
        for ks in itertools.product(range(1, budget + 1), repeat=L):
            t, layer = 0, 1
            for k in ks:
                layer *= k
                t += layer
            if t <= budget:
                yield trees.widths(list(ks))


def model(level, k):
    d = [0.5, 2.5, 1.5, 3.0][min(level, 4) - 1]
    return float(grs_acceptance(torch.tensor(d), k))


@pytest.mark.parametrize("budget", [1, 3, 6, 10, 14])
def test_optimal_tree_beats_every_width_tree(budget):
    best = trees.optimal(model, budget, 4)
    assert best.budget <= budget
    v = expected_steps(best, model)
    for t in all_width_trees(budget, 4):
        assert expected_steps(t, model) <= v + 1e-9


def test_optimal_is_a_chain_when_acceptance_ignores_width():
    t = trees.optimal(lambda level, k: 0.9, 5, 10)
    assert t.budget == 5 and t.L == 5 and t.max_children == 1


def test_optimal_validates_the_model():
    with pytest.raises(ValueError, match="acceptance"):
        trees.optimal(lambda level, k: 1.5, 3, 3)
    with pytest.raises(ValueError, match="budget must be an int >= 1"):
        trees.optimal(model, 0, 3)


@pytest.mark.parametrize("coupling, k", [("rmc", 1), ("grs", 2), ("grs", 4)])
def test_acceptance_model_is_unbiased_between_grid_points(coupling, k):
    """Deltas spread over [0.3, 2.7], none on the 0.05 grid: the model is the mean closed form to 2e-4.
    Counting each delta at the grid point above it (0.025 too high on average) is 0.005-0.01 low."""
    from specforest.couplings import get_coupling

    d = 0.3 + 2.4 * torch.rand(4000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    d = d + 0.013 * (torch.remainder(d, 0.05) < 1e-3)  # off the grid points
    a = acceptance_model(torch.stack([torch.ones_like(d), d], 1), coupling)
    exact = float(get_coupling(coupling).model_acceptance(d, k).mean())
    assert a(1, k) == pytest.approx(exact, abs=2e-4)


def test_acceptance_model_averages_closed_forms():
    deltas = torch.tensor([[1.0, 0.5], [1.0, 1.5], [2.0, 3.0]], dtype=torch.float64)
    a = acceptance_model(deltas, "grs")
    ref = 0.5 * (float(grs_acceptance(torch.tensor(0.5), 3)) + float(grs_acceptance(torch.tensor(1.5), 3)))
    assert a(1, 3) == pytest.approx(ref, abs=1e-4)  # the closed form interpolated on a 0.05 grid
    assert a(5, 2) == a(2, 2)  # deeper than observed: the deepest observed depth
    with pytest.raises(ValueError, match="deltas"):
        acceptance_model(torch.zeros(0, 2))


def test_planned_tree_is_exact_and_within_budget():
    gmm = GaussianMixture(torch.tensor([[2.0, -1.0, 0.5]], dtype=torch.float64), torch.tensor([0.3]))
    x = torch.randn(4000, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tree = plan_tree(gmm, x, budget=12, steps=12, churn=0.6, grid="uniform", generator=torch.Generator().manual_seed(1))
    assert 1 <= tree.budget <= 12
    a = specforest.sample(
        gmm, x, steps=12, churn=0.6, grid="uniform", tree=tree, generator=torch.Generator().manual_seed(2)
    )
    b = specforest.sample(gmm, x, steps=12, churn=0.6, grid="uniform", generator=torch.Generator().manual_seed(3))
    from scipy import stats as sps

    for j in range(3):
        assert sps.ks_2samp(a.samples[:, j].numpy(), b.samples[:, j].numpy()).pvalue > 1e-4


def test_cli_optimal_tree():
    res = CliRunner().invoke(
        main,
        [
            "gmm",
            "--method",
            "dgrs",
            "--tree",
            "optimal",
            "--budget",
            "20",
            "--dim",
            "8",
            "--steps",
            "10",
            "--trajectories",
            "20",
            "--lazy",
            "--json",
            "--no-progress",
        ],
    )
    assert res.exit_code == 0, res.output
    rec = json.loads(res.output)
    assert rec["tree"] == "optimal" and 1 <= rec["budget"] <= 20
    res = CliRunner().invoke(main, ["gmm", "--tree", "optimal", "--dim", "8", "--steps", "10", "--no-progress"])
    assert res.exit_code != 0 and "budget" in res.output


def test_draft_diagnostics_cli(tmp_path):
    out = tmp_path / "drafts.png"
    res = CliRunner().invoke(main, ["gmm", "drafts", "--out", str(out), "--trajectories", "4", "--depth", "3"])
    assert res.exit_code == 0, res.output
    assert out.stat().st_size > 1000
    assert all(k in res.output for k in ("velocity", "drift", "x0", "eps", "auto"))


def test_auto_draft_fills_unseen_offsets_from_the_nearest_seen_one():
    from specforest.proposals import AutoDraft

    total, count = AutoDraft(max_offset=5, stretches=1).init_state(torch.device("cpu"))
    total[0, 1] = 3.0
    total[0, 1, 2] = 1.0  # x0 best at offset 1
    count[0, 1] = 1.0
    assert AutoDraft.choice((total, count)).tolist() == [[0, 2, 2, 2, 2, 2]]


def test_auto_draft_tells_stretches_of_the_grid_apart():
    """With two stretches, a (stretch, offset) pair with ``min_count`` observations takes its own
    best kind; one with fewer takes the offset's best over the whole grid; a verified parent's
    mismatch counts in its own stretch (steps ``0 .. T/2 - 1`` the first, the rest the second)."""
    from specforest.proposals import AUTO_KINDS, AutoDraft
    from specforest.reverse_sde import ReverseSDE
    from specforest.sde import flow_match_grid

    auto = AutoDraft(max_offset=3, stretches=2, min_count=4)
    total, count = auto.init_state(torch.device("cpu"))
    assert total.shape == (2, 4, len(AUTO_KINDS)) and count.shape == (2, 4)
    total[:, 1] = 5.0
    total[0, 1, 2] = 1.0  # x0 best at offset 1 early in the grid
    total[1, 1, 3] = 2.0  # eps best there late
    count[:, 1] = 4.0
    total[1, 2] = 5.0
    total[1, 2, 4] = 0.1  # x0_extrap best at offset 2 late, but seen only 3 times
    count[1, 2] = 3.0
    pick = AutoDraft.choice((total, count), min_count=4)
    # offset 2 pooled over the grid: x0_extrap; offset 3 unseen: offset 2's pooled choice
    assert pick.tolist() == [[0, 2, 4, 4], [0, 3, 4, 4]]
    # one stretch is the pooled rule of the offsets alone
    assert AutoDraft.choice((total.sum(0, keepdim=True), count.sum(0, keepdim=True))).tolist() == [[0, 2, 4, 4]]
    tab = ReverseSDE(flow_match_grid(20), 0.5).tables("cpu", torch.float64)
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    pre, _ = _auto_prefetch(r, 3, 5, memory=False)  # prefetched at steps 3, 5, 7
    steps = torch.tensor([4, 14, 9])  # offsets 1, 9 (kept as 3), 2; stretches 0, 1, 0
    state = auto.observe(auto.init_state(torch.device("cpu")), tab, r(3, 5), r(3, 5), steps, pre, torch.ones(3))
    assert state[1].tolist() == [[0, 1, 1, 0], [0, 0, 0, 1]]
    with pytest.raises(ValueError, match="stretches"):
        AutoDraft(stretches=0)


def _auto_prefetch(r, batch, dim, memory):
    """A prefetch with a history and, when ``memory``, a chain memory that some parents read, with
    its states and gains fitted from two chain memories (rows 0 and 1 have pairs at steps 4-6, 5-6):
    ``(pre, memory)``, the memory ``None`` without."""
    from specforest.drafts import ChainMemory, Prefetch

    live = torch.ones(batch, dtype=torch.bool)
    pre = Prefetch(r(batch, dim), r(batch, dim), torch.tensor([3, 5, 7]), r(batch, dim), r(batch, dim),
                   torch.tensor([2, 4, 6]), torch.tensor([True, False, True]), live)  # fmt: skip
    mem = None
    if memory:
        cpu = torch.device("cpu")
        pre = Prefetch.empty(batch, dim, torch.float64, cpu).replaced(pre.prev_y, pre.prev_v, pre.prev_step)
        pre = pre.replaced(pre.y * 0 + r(batch, dim), r(batch, dim), torch.tensor([3, 5, 7]))
        mem = ChainMemory.empty(batch, 4, dim, torch.float64, cpu, states=True, steps=20)
        n = torch.tensor([4, 2, 4])
        for s0 in (torch.tensor([2, 5, 1]), torch.tensor([3, 5, 2])):
            mem = mem.replaced(r(batch, 4, dim), s0, n, y=r(batch, 4, dim))
    return pre, mem


@pytest.mark.parametrize("memory", [False, True])
def test_auto_draft_means_are_the_kinds_means(memory):
    """AutoDraft writes every kind as one affine map of the prefetch and memory; each equals
    FrozenPrediction's, MemoryDraft's or SecantDraft's to rounding, and the velocity kind (the
    choice before anything is seen) bit for bit."""
    from specforest.proposals import AUTO_KINDS, AutoDraft, FrozenPrediction, MemoryDraft, SecantDraft
    from specforest.reverse_sde import ReverseSDE
    from specforest.sde import flow_match_grid

    tab = ReverseSDE(flow_match_grid(20, shift=3.0), 0.5).tables("cpu", torch.float64)
    g = torch.Generator().manual_seed(0)
    batch, dim = 3, 5
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    pre, mem = _auto_prefetch(r, batch, dim, memory)
    steps = torch.tensor([[4, 5, 6, 7], [6, 7, 8, 9], [8, 9, 10, 11]])
    y = r(batch, 4, dim)
    coef, (ys, vs, x0p, x0m, ym) = AutoDraft._all_kinds(tab, steps, pre, mem)
    assert (x0m is None) == (not memory) and (ym is None) == (not memory)
    A, alpha, beta, eps, mu, nu = coef  # (7, batch, 4) each
    props = {"memory": MemoryDraft(), "secant": SecantDraft()}
    for i, kind in enumerate(AUTO_KINDS):
        if kind in props:
            Ak, Ck = props[kind].coefficients(tab, steps, pre, None, memory=mem)
        else:
            Ak, Ck = FrozenPrediction(kind).coefficients(tab, steps, pre, None)
        ours = A[i][..., None] * y + alpha[i][..., None] * ys[:, None] + beta[i][..., None] * vs[:, None]
        ours = ours + eps[i][..., None] * x0p[:, None]
        if x0m is not None:
            ours = ours + mu[i][..., None] * x0m + nu[i][..., None] * ym
        torch.testing.assert_close(ours, torch.addcmul(Ck, Ak, y), rtol=0, atol=1e-13)
    auto = AutoDraft()
    Aa, Ca = auto.coefficients(tab, steps, pre, auto.init_state(torch.device("cpu")), memory=mem)
    Av, Cv = FrozenPrediction("velocity").coefficients(tab, steps, pre, None)
    assert torch.equal(torch.addcmul(Ca, Aa, y), torch.addcmul(Cv, Av, y))
    # the check can fail: another kind's mean is not the velocity kind's, and the memory is read
    Ax, Cx = FrozenPrediction("x0").coefficients(tab, steps, pre, None)
    assert not torch.allclose(torch.addcmul(Cx, Ax, y), torch.addcmul(Cv, Av, y))
    Am, Cm = MemoryDraft().coefficients(tab, steps, pre, None, memory=mem)
    assert torch.allclose(torch.addcmul(Cx, Ax, y), torch.addcmul(Cm, Am, y)) == (not memory)
    # and the secant kind's gain moves the memory's mean where a trajectory has pairs
    As, Cs = SecantDraft().coefficients(tab, steps, pre, None, memory=mem)
    assert torch.allclose(torch.addcmul(Cs, As, y), torch.addcmul(Cm, Am, y)) == (not memory)


@pytest.mark.parametrize("memory", [False, True])
def test_auto_draft_shared_round_terms_change_nothing(memory):
    """A drafted round computes the kinds' coefficients once (``round_terms``) for the draft and the
    observation; the means and the next state are bit for bit those computed from scratch."""
    from specforest.proposals import AUTO_KINDS, AutoDraft
    from specforest.reverse_sde import ReverseSDE
    from specforest.sde import flow_match_grid

    tab = ReverseSDE(flow_match_grid(20, shift=3.0), 0.5).tables("cpu", torch.float64)
    g = torch.Generator().manual_seed(1)
    batch, dim, n = 3, 5, 4
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    pre, mem = _auto_prefetch(r, batch, dim, memory)
    steps = pre.step[:, None] + 1 + torch.arange(n)
    auto = AutoDraft()
    # a state that picks a different kind at each offset
    state = (
        torch.rand(auto.stretches, auto.max_offset + 1, len(AUTO_KINDS), generator=g, dtype=torch.float64),
        torch.ones(auto.stretches, auto.max_offset + 1).double(),
    )
    terms = auto.round_terms(tab, steps, pre, memory=mem)
    for a, b in zip(
        auto.coefficients(tab, steps, pre, state, terms, memory=mem),
        auto.coefficients(tab, steps, pre, state, memory=mem),
        strict=True,
    ):
        assert torch.equal(a, b)
    rows, cols = torch.tensor([0, 0, 1, 2, 2]), torch.tensor([0, 1, 0, 2, 3])
    y, mu_q, scale = r(5, dim), r(5, dim), torch.rand(5, generator=g, dtype=torch.float64) + 0.1
    st = steps[rows, cols]
    args = (state, tab, y, mu_q, st, pre.take(rows), scale)
    kw = dict(memory=None if mem is None else mem.take(rows))
    shared = auto.observe(*args, auto.take_terms(terms, rows, cols), **kw)
    alone = auto.observe(*args, **kw)
    assert all(torch.equal(a, b) for a, b in zip(shared, alone, strict=True))
    # terms taken at other parents give another state: the comparison can fail
    wrong = auto.observe(*args, auto.take_terms(terms, rows, (cols + 1) % n), **kw)
    assert not torch.equal(wrong[0], alone[0])


def test_adaptive_tree_replans_within_budget_and_validates():
    from specforest.planning import AdaptiveTree

    seen = []
    gmm = GaussianMixture(torch.tensor([[2.0, -1.0, 0.5]], dtype=torch.float64), torch.tensor([0.3]))

    def model(x, sigma):
        seen.append(x.shape[0])
        return gmm(x, sigma)

    x = torch.randn(50, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = specforest.sample(
        model,
        x,
        steps=20,
        churn=0.6,
        tree=AdaptiveTree(10, kmax=3),
        verify="drafted",
        generator=torch.Generator().manual_seed(1),
    )
    # every round evaluates at most the budget plus the root per trajectory
    assert max(seen) <= 50 * 11
    assert out.stats.nfe.double().mean() < 20
    with pytest.raises(ValueError, match="budget"):
        AdaptiveTree(0)
    with pytest.raises(ValueError, match="i.i.d. children"):
        specforest.sample(gmm, x, steps=5, churn=0.5, tree=AdaptiveTree(6), coupling="antithetic")
    res = CliRunner().invoke(
        main,
        [
            "gmm",
            "--method",
            "rank",
            "--tree",
            "adaptive",
            "--budget",
            "12",
            "--dim",
            "8",
            "--steps",
            "10",
            "--trajectories",
            "10",
            "--lazy",
            "--json",
            "--no-progress",
        ],
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["tree"] == "adaptive"


def test_plan_tree_takes_the_calibration_rows_of_cond():
    from specforest.planning import plan_tree

    gmm = GaussianMixture.paper(dim=5, components=2, seed=0)
    seen = []

    def model(x, sigma, label):
        seen.append(label.shape[0] == x.shape[0])
        return gmm(x, sigma)

    x = torch.randn(40, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tree = plan_tree(model, x, budget=12, steps=12, churn=0.4, cond={"label": torch.arange(40)}, seed=3)
    assert tree.budget <= 12 and seen and all(seen)


def test_make_tree_is_the_one_tree_of_every_command():
    assert make_tree() is None
    assert make_tree(K=2, L=3).budget == 14
    assert make_tree(L=56, coupling="rmc", steps=50).budget == 50  # rounds never outrun the grid
    assert make_tree(L=6, coupling="rmc").budget == 6
    assert repr(make_tree(K=1, L=6, coupling="rmc")) == repr(trees.chain(6))
    given = trees.uniform(2, 2)
    assert make_tree(tree=given) is given
    with pytest.raises(ValueError, match="K=3"):
        make_tree(K=3, L=6, coupling="rmc")
    with pytest.raises(ValueError, match="give both K and L"):
        make_tree(K=3)
    with pytest.raises(ValueError, match="either tree or K/L"):
        make_tree(K=2, L=2, tree=given)
    with pytest.raises(TypeError, match="K must be None or an int"):
        make_tree(K=2.0, L=2)
    with pytest.raises(ValueError, match="L must be None or an int >= 1"):
        make_tree(K=2, L=0)


def test_memory_estimate_chunks_trajectories_and_rows_to_fit():
    from specforest import memory

    EM = dict(history=0, stages=1)  # the em chain's declarations: no carried prediction, one call a step
    tree = trees.uniform(2, 2)
    D = 8
    nodes, rows = memory.tree_footprint(tree)
    assert (nodes, rows) == (tree.size, tree.verification_budget("internal"))
    m1 = memory.estimate(**EM, trajectories=1, state_numel=D, tree=tree, limit_bytes=10**12)
    per, row, tables = m1.trajectory_bytes, m1.row_bytes, m1.fixed_bytes
    # measured states of a full round: 6 per node, 5 per verified node, 1 per row, 8 of scratch; int64 keys
    assert per == D * 4 * (6 * 7 + 5 * 3 + 1 * 3 + 8) + 8 * 7
    assert row == memory.DEFAULT_ROW_STATES * D * 4 and m1.row_source == "default"

    def limit(dynamic: int) -> int:
        return tables + dynamic + memory.allocator_slack(dynamic)

    # everything fits: one chunk, whole calls
    m = memory.estimate(**EM, trajectories=10, state_numel=D, tree=tree, limit_bytes=limit(10 * (per + rows * row)))
    assert (m.chunk, m.chunks, m.max_rows) == (10, 1, None)
    assert m.total_bytes <= m.limit_bytes
    # 4 trajectories fit with their whole calls: 3 balanced chunks of <= 4, not 4 + 4 + 2
    m = memory.estimate(**EM, trajectories=10, state_numel=D, tree=tree, limit_bytes=limit(4 * (per + rows * row)))
    assert (m.chunk, m.chunks, m.max_rows) == (4, 3, None) and m.total_bytes <= m.limit_bytes
    # one trajectory and one row fit, its whole call does not: one at a time, calls split
    m = memory.estimate(**EM, trajectories=10, state_numel=D, tree=tree, limit_bytes=limit(per + 2 * row))
    assert (m.chunk, m.max_rows) == (1, 2) and m.total_bytes <= m.limit_bytes
    # without chunking the rows of a call are split instead
    lim = limit(10 * per + 5 * row)
    m = memory.estimate(**EM, trajectories=10, state_numel=D, tree=tree, limit_bytes=lim, chunked=False)
    assert (m.chunk, m.max_rows) == (10, 5) and m.total_bytes <= m.limit_bytes
    with pytest.raises(MemoryError, match=r"does not fit the memory limit of .* needs about .*lazy=True"):
        memory.estimate(
            **EM, trajectories=10, state_numel=D, tree=tree, limit_bytes=limit(9 * per + row), chunked=False
        )
    with pytest.raises(MemoryError, match="already holds 0.001 GB"):
        memory.estimate(**EM, trajectories=1, state_numel=D, tree=tree, limit_bytes=limit(per), fixed_bytes=10**6)
    # a model's declaration is read; a given row_bytes wins over it
    gmm = GaussianMixture.paper(dim=D, components=3)
    declared = memory.estimate(**EM, trajectories=1, state_numel=D, tree=tree, limit_bytes=10**12, model=gmm)
    assert declared.row_bytes == (2 * D + 7 * 3) * 4 and "GaussianMixture" in declared.row_source
    given = memory.estimate(**EM, trajectories=1, state_numel=D, tree=tree, limit_bytes=10**12, model=gmm, row_bytes=5)
    assert given.row_bytes == 5
    # tree-parallel: each process's call holds its share of the rows, every process the gathered rows
    tp = memory.estimate(**EM, trajectories=10, state_numel=D, tree=tree, limit_bytes=10**12, world=2)
    assert tp.call_rows == 15 and tp.trajectory_bytes == per + 3 * rows * D * 4
    # lazy runs hold the children of one node per depth and call with one row
    assert memory.tree_footprint(tree, lazy=True) == (1 + 2 * 2, 1)
    assert memory.tree_footprint(AdaptiveTree(10), lazy=False) == (11, 11)
    assert memory.tree_footprint(None) == (1, 1)
    limit_, source = memory.default_memory_limit("cpu")
    assert limit_ > 0 and source
    assert memory.held_bytes() > 10**7  # this process: the interpreter and torch


def test_allocator_slack_and_its_inverse():
    from specforest import memory

    assert memory.allocator_slack(10**6) == 10**6 + 10**5  # small: the heap's fragmentation doubles it
    big = 10**10
    assert memory.allocator_slack(big) == memory.HEAP_SLACK_BYTES + big // 10
    assert memory.allocator_slack(big, "cuda") == big // 10
    for room in (10**6, 10**9, 10**11):
        d = memory._dynamic_room(room, "cpu")
        assert d + memory.allocator_slack(d) <= room < (d + 10) + memory.allocator_slack(d + 10)


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(budget=0), ValueError, "budget must be an int >= 1"),
        (dict(budget=True), TypeError, "budget must be an int"),
        (dict(budget=8, kmax=0), ValueError, "kmax must be an int >= 1"),
        (dict(budget=8, max_depth=2.5), TypeError, "max_depth must be an int"),
        (dict(budget=8, max_depth=0), ValueError, "max_depth must be an int >= 1"),
    ],
)
def test_adaptive_tree_refuses_bad_sizes_by_name(kw, err, match):
    with pytest.raises(err, match=match):
        planning.AdaptiveTree(**kw)
