"""Drafts that read what the run evaluated before: what they read, and that reading one evaluation
too far (a peek at the drafted node's own draws) is caught by the whole-chain law test."""

from dataclasses import replace

import pytest
import torch

import specforest
from specforest import testing, trees
from specforest.drafting import runs_full
from specforest.drafts import ChainMemory, CorrectedDraft, EvaluatedChain
from specforest.models import GaussianMixture
from specforest.proposals import (
    CachedDraft,
    FrozenPrediction,
    LearnedDraft,
    MemoryDraft,
    PicardDraft,
    Prefetch,
    SecantDraft,
    get_proposal,
)
from specforest.reverse_sde import ReverseSDE
from specforest.sde import flow_match_grid

MU0 = torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64)
S0 = 0.3
GAUSS = GaussianMixture(MU0[None], torch.tensor([S0]))
N, STEPS, CHURN = 6000, 12, 0.6


class PeekMemory(MemoryDraft):
    """The memory draft off by one: a parent at step ``s`` reads the previous round's node at
    ``s + 1``, whose state was drawn with the noise the drafted child now reuses (a peek)."""

    name = "peek"

    def coefficients(self, tab, steps, pre, state, terms=None, memory=None):
        ac = tab.ac[steps]
        a, c = ac[..., :1], ac[..., 1:]
        k = c / tab.sig[steps][..., None]
        x0 = (pre.y - tab.sig[pre.step][:, None] * pre.v)[:, None]
        n, s0 = memory.n[:, None], memory.s0[:, None]
        t = steps - s0 + 1
        j = torch.minimum(t, n - 1).clamp(min=0)
        use = (n > 0) & (t >= 0) & (t < n)
        mem = memory.x0.gather(1, j[..., None].expand(-1, -1, memory.x0.shape[2]))
        return a + k, -k * torch.where(use[..., None], mem, x0)


def _a_step_early(memory):
    """``memory`` as if each trajectory's remembered chain started one step earlier (a peek)."""
    return None if memory is None else replace(memory, s0=memory.s0 - 1)


class PeekSecant(SecantDraft):
    """The secant draft off by one in the same way: it reads the remembered node (prediction and
    state) one step ahead of the parent, as if the memory started a step earlier."""

    name = "peek_secant"

    def coefficients(self, tab, steps, pre, state, terms=None, memory=None):
        return super().coefficients(tab, steps, pre, state, terms, memory=_a_step_early(memory))


def _law_failures(draft, coupling="rmc", model=GAUSS):
    x = torch.randn(N, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = specforest.sample(
        model,
        x,
        steps=STEPS,
        churn=CHURN,
        tree=trees.chain(6),
        coupling=coupling,
        draft=draft,
        generator=torch.Generator().manual_seed(2),
    )
    return testing.check_law(out.samples, flow_match_grid(STEPS), CHURN, MU0, S0).failures


@pytest.mark.parametrize("coupling", ["rmc", "grs"])
def test_a_memory_draft_that_peeks_fails_the_law_test_the_real_one_passes(coupling):
    assert not _law_failures("memory", coupling)
    assert _law_failures(PeekMemory(), coupling)


@pytest.mark.parametrize("coupling", ["rmc", "grs"])
def test_a_secant_draft_that_peeks_fails_the_law_test_the_real_one_passes(coupling):
    assert not _law_failures("secant", coupling)
    assert _law_failures(PeekSecant(), coupling)


def _pre(batch=3, dim=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    pre = Prefetch.empty(batch, dim, torch.float64, torch.device("cpu"))
    pre = pre.replaced(r(batch, dim), r(batch, dim), torch.tensor([3, 5, 7]))
    return pre, r


def _memory(batch=3, dim=5, width=4, states=False, steps=0, features=0):
    """An empty chain memory (no node remembered) of ``batch`` trajectories."""
    cpu = torch.device("cpu")
    return ChainMemory.empty(batch, width, dim, torch.float64, cpu, states=states, steps=steps, features=features)


def test_memory_draft_reads_the_node_at_the_parents_step_and_falls_back_to_x0():
    tab = ReverseSDE(flow_match_grid(20, shift=3.0), 0.5).tables("cpu", torch.float64)
    pre, r = _pre()
    steps = pre.step[:, None] + 1 + torch.arange(5)  # (3, 5) parents after each prefetch
    y = r(3, 5, 5)
    mem = MemoryDraft()
    # no memory yet (none kept, or nothing remembered): the x0 kind's mean
    Ax, Cx = FrozenPrediction("x0").coefficients(tab, steps, pre, None)
    for memory in (None, _memory()):
        A, C = mem.coefficients(tab, steps, pre, None, memory=memory)
        torch.testing.assert_close(torch.addcmul(C, A, y), torch.addcmul(Cx, Ax, y), rtol=0, atol=1e-12)
    # row 0 remembers 4 nodes from step 3, row 1 two from step 5, row 2 four from step 2 (older than its prefetch at 7)
    x0 = r(3, 4, 5)
    memory = _memory().replaced(x0, torch.tensor([3, 5, 2]), torch.tensor([4, 2, 4]))
    A, C = mem.coefficients(tab, steps, pre, None, memory=memory)
    m = torch.addcmul(C, A, y)
    k = tab.ac[steps][..., 1:] / tab.sig[steps][..., None]
    want = lambda b, i, src: (tab.ac[steps[b, i], 0] + k[b, i]) * y[b, i] - k[b, i] * src  # noqa: E731
    for i in range(5):
        # row 0: steps 4..8 read nodes 1, 2, 3, then the last node 3
        torch.testing.assert_close(m[0, i], want(0, i, x0[0, min(i + 1, 3)]), rtol=0, atol=1e-12)
        # row 1: steps 6..10 read node 1, then keep its prediction
        torch.testing.assert_close(m[1, i], want(1, i, x0[1, 1]), rtol=0, atol=1e-12)
    # row 2: its memory ends at step 5, before its prefetch (step 7): the prefetch's x0
    torch.testing.assert_close(m[2], torch.addcmul(Cx, Ax, y)[2], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "base, better, ratio",
    [("x0", "memory", 0.85), ("memory", "secant", 0.9)],
    ids=["memory_vs_x0", "secant_vs_memory"],
)
def test_a_draft_that_remembers_cuts_target_calls_below_the_one_it_falls_back_to(base, better, ratio):
    """Not a speed test: on a d = 500 mixture the aligned memory accepts more per round than the x0
    kind it falls back to, and the fitted gain more than the memory it corrects (a broken memory,
    or a gain of the wrong sign or size, would not)."""
    gmm = GaussianMixture.paper(dim=500, seed=0)
    x = torch.randn(16, 500, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    nfe = {
        d: specforest.sample(gmm, x, steps=30, churn=0.1, tree=trees.chain(30), coupling="rmc", draft=d, seed=1)
        .stats.nfe.double()
        .mean()
        for d in (base, better)
    }
    assert nfe[better] < ratio * nfe[base]


def _linear_x0(tab, y, steps, m, gain):
    """A target whose clean-data prediction is ``m_s + gain_s y`` at step ``s`` (``y (..., D)``,
    ``steps (...)``): its Jacobian is ``gain_s`` times the identity, as for an isotropic Gaussian."""
    return m[steps] + gain[steps][..., None] * y


def test_secant_gain_is_the_least_squares_slope_and_recovers_a_linear_target():
    """Closed form: where the target's prediction is ``m_s + g_s y``, two chain memories give every
    step they share the gain ``g_s`` exactly, and the draft's mean at any parent reading such a step
    is the mean under the target's own prediction there (the draft is the target's transition)."""
    tab = ReverseSDE(flow_match_grid(20, shift=3.0), 0.5).tables("cpu", torch.float64)
    T, D = 20, 5
    pre, r = _pre()
    mem = _memory(states=True, steps=T)
    m, gain = r(T, D), torch.rand(T, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    # round 1 remembers steps 3..6 / 5..6 / 2..5; round 2 steps 4..7 / 5..8 / 9..12
    s0a, na = torch.tensor([3, 5, 2]), torch.tensor([4, 2, 4])
    s0b, nb = torch.tensor([4, 5, 9]), torch.tensor([4, 4, 4])
    for s0, n in ((s0a, na), (s0b, nb)):
        st = s0[:, None] + torch.arange(4)
        y = r(3, 4, D)
        mem = mem.replaced(_linear_x0(tab, y, st, m, gain), s0, n, y=y)
    has = mem.gain_den > 0
    # pairs: row 0 at steps 4, 5, 6; row 1 at 5, 6; row 2 none (its rounds share no step)
    assert has.nonzero().tolist() == [[0, 4], [0, 5], [0, 6], [1, 5], [1, 6]]
    torch.testing.assert_close(mem.gain_num[has] / mem.gain_den[has], gain[has.nonzero()[:, 1]], rtol=1e-12, atol=0)
    # parents at the remembered steps: the secant mean is the target's x0-kind mean at y
    steps = torch.tensor([[4, 5, 6], [5, 6, 6], [9, 10, 11]])
    pre = replace(pre, step=torch.tensor([3, 4, 8]))
    y = r(3, 3, D)
    A, C = SecantDraft().coefficients(tab, steps, pre, None, memory=mem)
    ac = tab.ac[steps]
    k = ac[..., 1:] / tab.sig[steps][..., None]
    exact = (ac[..., :1] + k) * y - k * _linear_x0(tab, y, steps, m, gain)
    mean = torch.addcmul(C, A, y)
    torch.testing.assert_close(mean[:2], exact[:2], rtol=0, atol=1e-10)
    # row 2 has no pair yet: the memory draft, which is not the target's transition
    torch.testing.assert_close(
        mean[2], torch.addcmul(*MemoryDraft().coefficients(tab, steps, pre, None, memory=mem)[::-1], y)[2]
    )
    assert not torch.allclose(mean[2], exact[2])


class MeanOnlySecant(SecantDraft):
    """The secant draft as a proposal that only gives means (``affine = False``): the engine drafts
    it layer by layer, as it would a draft network that reads the run's memory."""

    affine = False
    name = "secant_mean_only"

    def mean(self, tab, y, steps, pre, cond, shape, state, memory=None):
        A, C = super().coefficients(tab, steps, pre, state, memory=memory)
        return torch.addcmul(C, A, y)


def test_a_draft_that_only_gives_means_remembers_its_chain_as_an_affine_one_does():
    """Chain noise keyed by step and the remembered chain do not depend on the proposal being affine:
    the mean-only secant gives the affine one's NFE and samples (to rounding), far from a draft that
    forgets (the mean-only draft before non-affine drafts could remember)."""
    gmm = GaussianMixture.paper(dim=50, seed=0)
    x = torch.randn(12, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    kw = dict(steps=30, churn=0.3, tree=trees.chain(8), coupling="rmc", seed=3)
    ref = specforest.sample(gmm, x, draft="secant", **kw)
    got = specforest.sample(gmm, x, draft=MeanOnlySecant(), **kw)
    assert torch.equal(got.stats.nfe, ref.stats.nfe)
    torch.testing.assert_close(got.samples, ref.samples, rtol=0, atol=1e-10)
    forgets = specforest.sample(gmm, x, draft="x0", **kw)
    assert not torch.equal(forgets.stats.nfe, ref.stats.nfe)


class NaNAtStep7(FrozenPrediction):
    """A draft whose mean comes out NaN at step 7 (a broken extrapolation)."""

    def __init__(self):
        super().__init__("x0")
        self.name = "bad"

    def coefficients(self, tab, steps, pre, state, terms=None):
        A, C = super().coefficients(tab, steps, pre, state, terms)
        return A, torch.where(steps[..., None] == 7, float("nan"), C)


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("tree", [trees.chain(4), trees.uniform(2, 2)], ids=["chain", "tree"])
def test_a_draft_that_gives_nan_stops_the_run_naming_draft_and_step(lazy, tree):
    gmm = GaussianMixture.paper(dim=10, seed=0)
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with pytest.raises(FloatingPointError, match=r"draft 'bad'.*step 7"):
        specforest.sample(gmm, x, steps=20, churn=0.3, tree=tree, draft=NaNAtStep7(), seed=1, lazy=lazy)
    # the same run with the sound draft finishes with finite samples
    out = specforest.sample(gmm, x, steps=20, churn=0.3, tree=tree, draft="x0", seed=1, lazy=lazy)
    assert torch.isfinite(out.samples).all()


# -- the learned draft: a draft network anchored at the run's evaluations ------------------------


def _wrong_velocity(x, s):
    """A draft network for the Gaussian: the target's velocity, 20% short."""
    return 0.8 * GAUSS(x, s)


class PeekLearned(LearnedDraft):
    """The learned draft off by one as :class:`PeekSecant`: its memory anchor is the remembered node
    one step ahead of the parent, drawn with the noise the drafted child reuses."""

    name = "peek_learned"

    def mean(self, tab, y, steps, pre, cond, shape, state, memory=None):
        return super().mean(tab, y, steps, pre, cond, shape, state, memory=_a_step_early(memory))


def _constant_prediction(x, s):
    """A draft network whose clean-data prediction is 0 everywhere (``f_x0 = y - s f = 0``)."""
    return x / s[:, None]


@pytest.mark.parametrize("network", [_wrong_velocity, _constant_prediction], ids=["wrong_velocity", "constant_x0"])
@pytest.mark.parametrize("coupling", ["rmc", "grs"])
def test_a_learned_draft_that_peeks_fails_the_law_test_the_real_one_passes(coupling, network):
    """The peek reads the anchor's state, which carries the child's noise, through
    ``x0_a - f_x0(y_a)``: a network near the target cancels most of it (the wrong velocity's peek
    moves the law by less than this test resolves), one with a constant prediction keeps all of it,
    and that peek is caught."""
    assert not _law_failures(LearnedDraft(network), coupling)
    if network is _constant_prediction:
        assert _law_failures(PeekLearned(network), coupling)


def test_a_learned_draft_whose_network_is_the_target_is_accepted_everywhere():
    """Closed form: with the target as its network the anchored prediction is the target's own at
    every parent (the anchor's terms cancel), so every drafted node is accepted, as with the target
    as a plain draft model (the oracle); a wrong network is not."""
    gmm = GaussianMixture.paper(dim=20, seed=0)
    x = torch.randn(24, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    kw = dict(steps=30, churn=0.3, tree=trees.chain(10), coupling="rmc", seed=4)
    oracle = specforest.sample(gmm, x, draft=lambda y, s: gmm(y, s), **kw)
    exact = specforest.sample(gmm, x, draft=LearnedDraft(gmm), **kw)
    assert torch.equal(exact.stats.accepts, exact.stats.attempts)
    # the same rounds, plus the one evaluation fetched before the first (the anchor a plain draft
    # model does without)
    assert torch.equal(exact.stats.nfe, oracle.stats.nfe + 1)
    wrong = specforest.sample(gmm, x, draft=LearnedDraft(lambda y, s: 0.5 * gmm(y, s)), **kw)
    assert (wrong.stats.accepts < wrong.stats.attempts).any()
    # its calls are the draft network's, one a drafted level, not the target's
    assert exact.stats.draft_calls > 0


def test_a_learned_draft_with_a_constant_prediction_is_the_x0_kind_on_a_tree():
    """Closed form: a network whose clean-data prediction is constant (``f = y / sigma``) anchored at
    the prefetch is the ``x0`` kind; a tree keeps no memory, so the two runs are the same."""
    gmm = GaussianMixture.paper(dim=20, seed=0)
    x = torch.randn(24, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    kw = dict(steps=20, churn=0.4, tree=trees.uniform(2, 3), seed=5)
    ref = specforest.sample(gmm, x, draft="x0", **kw)
    got = specforest.sample(gmm, x, draft=LearnedDraft(lambda y, s: y / s[:, None]), **kw)
    assert torch.equal(got.stats.nfe, ref.stats.nfe)
    torch.testing.assert_close(got.samples, ref.samples, rtol=0, atol=1e-10)


def test_the_digits_learned_draft_is_refused_on_another_model_before_sampling():
    calls = []

    def model(x, s):
        calls.append(1)
        return GAUSS(x, s)

    with pytest.raises(
        ValueError, match=r"draft='learned' is the digits model's distilled U-Net: .*\(1, 8, 8\), got \(3,\)"
    ):
        specforest.sample(model, torch.zeros(4, 3), steps=10, churn=0.3, tree=trees.chain(3), draft="learned")
    assert not calls  # refused before the first target call


def test_a_learned_draft_whose_network_gives_nan_stops_the_run_naming_step_and_draft():
    def nan_after_half(x, s):
        out = _wrong_velocity(x, s)
        return torch.where((s < 0.5)[:, None], float("nan"), out)

    with pytest.raises(FloatingPointError, match=r"draft 'learned' gave a NaN or inf mean at step \d+"):
        specforest.sample(
            GAUSS, torch.zeros(4, 3), steps=10, churn=0.3, tree=trees.chain(3), draft=LearnedDraft(nan_after_half)
        )


# -- Picard-refined chains ----------------------------------------------------------------------


def _peeking_picard(ctx, group, Y, SZ, steps, sweeps, carried=None):
    """The Picard sweep off by one: node ``l + 1`` drafted with the target's prediction at node
    ``l + 1`` of the last sweep, a state drawn with the very noise node ``l + 1`` has now."""
    G, Vr, D = Y.shape
    Lr = steps.shape[1]
    tab = ctx.tab
    sig = tab.sig[steps]
    ac = tab.ac[steps]
    k = ac[..., 1:] / sig[..., None]
    A = ac[..., :1] + k
    traj = (ctx.rows_all if group.everyone else group.ids).repeat_interleave(Lr)
    for _ in range(sweeps):
        at = Y[:, 1 : Lr + 1]  # one node too far
        V = ctx.target(at.reshape(-1, D), sig.reshape(-1), traj).view(G, Lr, D).to(Y.dtype)
        C = torch.addcmul(-k * at, k * sig[..., None], V)
        Ynew = Y.clone()
        for level in range(Lr):
            Ynew[:, level + 1] = A[:, level] * Ynew[:, level] + C[:, level] + SZ[:, level]
        Y = Ynew
    return Y, A * Y[:, :Lr] + C


@pytest.mark.parametrize("coupling", ["rmc", "grs"])
def test_a_picard_sweep_that_peeks_fails_the_law_test_the_real_one_passes(coupling, monkeypatch):
    from specforest import drafting

    assert not _law_failures("picard", coupling)
    monkeypatch.setattr(drafting, "_picard", _peeking_picard)
    assert _law_failures("picard", coupling)


@pytest.mark.parametrize("sweeps", [1, 2])
def test_picard_sweeps_make_the_first_nodes_the_targets_transition_and_count_as_calls(sweeps):
    """Closed form: after ``J`` sweeps the first ``J`` nodes of a chain are drafted with the target's
    own transition (the root's, then its exact child's, ...), so with RMC every verification at
    depths ``1 .. J`` accepts; the x0 kind (``J = 0``) does not. Each sweep is one target call each
    trajectory takes part in: one trajectory's NFE is the run's batched calls."""
    gmm = GaussianMixture.paper(dim=50, seed=0)
    x = torch.randn(16, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    kw = dict(steps=30, churn=0.3, tree=trees.chain(8), coupling="rmc", seed=6)
    out = specforest.sample(gmm, x, draft=PicardDraft(sweeps), **kw)
    att, acc = out.stats.attempts.sum(0), out.stats.accepts.sum(0)
    assert (att[:sweeps] > 0).all() and torch.equal(acc[:sweeps], att[:sweeps])
    assert (acc[sweeps:] < att[sweeps:]).any()
    base = specforest.sample(gmm, x, draft="x0", **kw).stats
    assert (base.accepts.sum(0)[:1] < base.attempts.sum(0)[:1]).all()
    one = specforest.sample(gmm, x[:1], draft=PicardDraft(sweeps), **kw)
    assert int(one.stats.nfe[0]) == one.stats.calls
    # a round of a chain with sweeps costs J + 1 calls: more than the x0 run's per round
    assert one.stats.calls > one.stats.rounds.sum()


def test_picard_runs_full_and_refuses_a_negative_sweep_count():
    gmm = GaussianMixture.paper(dim=10, seed=0)
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    kw = dict(steps=10, churn=0.3, tree=trees.chain(4), draft="picard", seed=1)
    lazy, full = (specforest.sample(gmm, x, lazy=m, **kw) for m in (True, False))
    # the sweeps evaluate every parent: lazy=True runs the full round, the same calls and samples
    assert torch.equal(lazy.samples, full.samples) and lazy.stats.calls == full.stats.calls
    assert runs_full(get_proposal("picard"), trees.chain(4)) and not runs_full(
        get_proposal("picard"), trees.uniform(2, 2)
    )
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"draft='picard': the sweeps J must be an int >= 0"):
            PicardDraft(bad)
    # J = 0 is the x0 kind
    ref = specforest.sample(gmm, x, steps=10, churn=0.3, tree=trees.chain(4), draft="x0", seed=1)
    zero = specforest.sample(gmm, x, steps=10, churn=0.3, tree=trees.chain(4), draft=PicardDraft(0), seed=1)
    assert torch.equal(zero.samples, ref.samples) and torch.equal(zero.stats.nfe, ref.stats.nfe)


# -- the cached self-draft: the target's deep features from the last round, its outer part anew --


class PeekCached(CachedDraft):
    """The cached draft off by one as :class:`PeekMemory`: it reads the features of the remembered
    node one step ahead of the parent, whose state carries the noise the drafted child reuses."""

    name = "peek_cached"

    def mean(self, tab, y, steps, pre, cond, shape, state, memory=None):
        return super().mean(tab, y, steps, pre, cond, shape, state, memory=_a_step_early(memory))


@pytest.mark.parametrize("coupling", ["rmc", "grs"])
def test_a_cached_draft_that_peeks_fails_the_law_test_the_real_one_passes(coupling):
    """With features that are the target's clean-data prediction (:class:`~specforest.testing.X0Features`)
    the cached draft is the memory draft, and its peek the memory draft's: caught."""
    model = testing.X0Features(GAUSS)
    assert not _law_failures("cached", coupling, model)
    assert _law_failures(PeekCached(), coupling, model)


def test_cached_draft_with_prediction_features_drafts_as_the_memory_draft():
    """Closed form: the features the verification call keeps are remembered per node and read back
    at the node the memory draft reads, so the two drafts give the same NFE and samples (to rounding),
    on a chain and, without memory, on a tree (both the x0 kind there)."""
    gmm = GaussianMixture.paper(dim=20, seed=0)
    x = torch.randn(16, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for tree, coupling in ((trees.uniform(2, 2), "grs"), (trees.chain(8), "rmc")):
        kw = dict(steps=30, churn=0.3, tree=tree, coupling=coupling, seed=3)
        ref = specforest.sample(gmm, x, draft="memory", **kw)
        got = specforest.sample(testing.X0Features(gmm), x, draft="cached", **kw)
        assert torch.equal(got.stats.nfe, ref.stats.nfe)
        torch.testing.assert_close(got.samples, ref.samples, rtol=0, atol=1e-10)
    # on the chain its evaluations are the outer part's, one a drafted level, never the target's
    assert got.stats.draft_calls > 0 and got.stats.calls == ref.stats.calls


def test_cached_mean_is_the_targets_own_transition_for_one_gaussian():
    """Closed form: one Gaussian component has responsibility 1 everywhere, so the mixture's cached
    evaluation (responsibilities frozen, every affine part recomputed) is its velocity at any state and
    step; a parent without a remembered node (before the prefetch) takes the x0 kind."""
    tab = ReverseSDE(flow_match_grid(20, shift=3.0), 0.5).tables("cpu", torch.float64)
    pre, r = _pre(dim=3)
    mem = _memory(dim=3, features=1)
    mem = mem.replaced(r(3, 4, 3), torch.tensor([3, 5, 2]), torch.tensor([4, 2, 4]), features=torch.ones(3, 4, 1))
    draft = CachedDraft()
    draft.bind(GAUSS, (3,))
    steps = pre.step[:, None] + 1 + torch.arange(5)
    y = r(3, 5, 3)
    got = draft.mean(tab, y, steps, pre, {}, (3,), None, memory=mem)
    exact = tab.mean(y, GAUSS(y.reshape(-1, 3), tab.sig[steps].reshape(-1)).view(3, 5, 3), steps)
    torch.testing.assert_close(got[:2], exact[:2], rtol=0, atol=1e-12)
    # row 2's memory ends before its prefetch: the x0 kind, which is not the transition
    Ax, Cx = FrozenPrediction("x0").coefficients(tab, steps, pre, None)
    torch.testing.assert_close(got[2], torch.addcmul(Cx, Ax, y)[2], rtol=0, atol=1e-12)
    assert not torch.allclose(got[2], exact[2])


def test_cached_draft_cuts_target_calls_below_every_free_draft_on_the_mixture():
    """The mixture's cached evaluation keeps the responsibilities of the node it reads and recomputes
    the rest at the drafted state: at d = 50 that accepts far more than the secant draft, the best
    free one on chains (5.0x against 3.9x fewer calls than the standard sampler here)."""
    gmm = GaussianMixture.paper(dim=50, seed=0)
    x = torch.randn(64, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    kw = dict(steps=30, churn=0.1, tree=trees.chain(14), coupling="rmc", seed=7)
    nfe = {d: specforest.sample(gmm, x, draft=d, **kw).stats.nfe.double().mean() for d in ("cached", "secant")}
    assert nfe["cached"] < 0.9 * nfe["secant"], nfe


def test_the_cached_draft_is_refused_on_a_model_without_features_before_sampling():
    calls = []

    def model(x, s):
        calls.append(1)
        return GAUSS(x, s)

    with pytest.raises(
        ValueError, match=r"draft='cached' reuses the target's deep features: .*the model given, model, does not"
    ):
        specforest.sample(model, torch.zeros(4, 3), steps=10, churn=0.3, tree=trees.chain(3), draft="cached")
    assert not calls  # refused before the first target call
    # and the tuner's filter drops it for a model it cannot serve, keeps it for one it can
    from specforest.proposals import drafts_serving

    assert "cached" not in drafts_serving(["cached", "x0"], (3,), model)
    assert drafts_serving(["cached", "x0"], (3,), GAUSS) == ["cached", "x0"]
    assert "cached" not in drafts_serving(["cached", "x0"], (3,))


class NaNFeatures(testing.X0Features):
    """Cheap evaluations that come out NaN below noise level 0.5 (a broken cached branch)."""

    def from_features(self, x, sigma, f, **cond):
        out = super().from_features(x, sigma, f, **cond)
        return torch.where((sigma < 0.5)[:, None], float("nan"), out)


def test_a_cached_draft_whose_evaluation_gives_nan_stops_the_run_naming_step_and_draft():
    with pytest.raises(FloatingPointError, match=r"draft 'cached' gave a NaN or inf mean at step \d+"):
        specforest.sample(
            NaNFeatures(GAUSS), torch.zeros(4, 3), steps=10, churn=0.3, tree=trees.chain(3), draft="cached"
        )


def test_features_travel_with_their_rows_through_chunks_padding_and_dtype():
    """The target wrapper returns the features a call keeps beside its velocities: split into
    ``max_rows`` chunks and padded rows, the same numbers as one call, cast to the run's dtype."""
    from specforest.target import Target

    gmm = GaussianMixture.paper(dim=6, components=4, seed=1)
    x = torch.randn(11, 6, generator=torch.Generator().manual_seed(0))
    s, traj = torch.rand(11), torch.arange(11)
    v0, f0 = gmm.with_features(x.double(), s.double())
    for max_rows, pad in ((None, None), (4, None), (None, (8, 16)), (3, (4,))):
        t = Target(gmm, (6,), torch.float64, max_rows, {}, {}, pad_rows=pad)
        v, f = t(x.double(), s.double(), traj, features=True)
        assert v.shape == (11, 6) and f.shape == (11, 4) and f.dtype == torch.float64
        torch.testing.assert_close(v, v0, rtol=0, atol=1e-12)
        torch.testing.assert_close(f, f0, rtol=0, atol=1e-12)
        assert torch.equal(t(x.double(), s.double(), traj), v)


def test_a_run_counts_the_models_features_once():
    """``feature_numel`` may run the network: the draft's check and its binding to the run share one count."""
    asked = []

    class Counting(testing.X0Features):
        def feature_numel(self, shape):
            asked.append(shape)
            return super().feature_numel(shape)

    specforest.sample(Counting(GAUSS), torch.zeros(4, 3), steps=10, churn=0.3, tree=trees.chain(3), draft="cached")
    assert asked == [(3,)]


def test_the_eps_draft_on_a_grid_from_pure_noise_drafts_the_velocity_there_and_keeps_the_law():
    # at sigma = 1 the state is the noise itself, so v = (xi - y) / (1 - sigma) is 0 / 0: the frozen
    # velocity drafts that step (the run used to stop with a NaN mean at step 0 on any chain from t = 1)
    tab = (
        specforest.chains.get_chain("euler_ancestral")
        .build(flow_match_grid(8))
        .tables(torch.device("cpu"), torch.float64)
    )
    pre, _ = _pre()
    pre = pre.replaced(pre.y, pre.v, torch.tensor([0, 2, 4]))
    steps = torch.tensor([[0, 1], [2, 3], [4, 5]])
    Ae, Ce = FrozenPrediction("eps").coefficients(tab, steps, pre, None)
    Av, Cv = FrozenPrediction("velocity").coefficients(tab, steps, pre, None)
    assert float(tab.sig[0]) == 1.0 and torch.isfinite(Ae).all() and torch.isfinite(Ce).all()
    torch.testing.assert_close((Ae[0, 0], Ce[0, 0]), (Av[0, 0], Cv[0, 0]), rtol=0, atol=0)
    assert not torch.allclose(Ce[1:], Cv[1:])  # elsewhere the noise prediction is what is frozen
    report = testing.check_chain_law(
        trees.chain(4), "rmc", "eps", sigmas=flow_match_grid(8), chain="euler_ancestral", trajectories=4000
    )
    assert not report.failures, report.failures


# -- the corrected self-draft: cached plus a secant of its own error from the last two rounds -----


class PeekCorrected(CorrectedDraft):
    """The corrected draft off by one as :class:`PeekCached`: it reads the remembered node (features,
    state, prediction and pair) one step ahead of the parent, a state drawn with the drafted child's noise."""

    name = "peek_corrected"

    def mean(self, tab, y, steps, pre, cond, shape, state, memory=None):
        return super().mean(tab, y, steps, pre, cond, shape, state, memory=_a_step_early(memory))


@pytest.mark.parametrize("coupling", ["rmc", "grs"])
def test_a_corrected_draft_that_peeks_fails_the_law_test_the_real_one_passes(coupling):
    """With the clean-data prediction as the features (:class:`~specforest.testing.X0Features`) the
    cached draft is the memory draft and the correction a rank-one secant of the Gaussian's
    prediction: the real draft keeps the law, its peek one step ahead is caught."""
    model = testing.X0Features(GAUSS)
    assert not _law_failures("corrected", coupling, model)
    assert _law_failures(PeekCorrected(), coupling, model)


def test_the_correction_acts_in_the_law_tests_runs():
    """The law test above sees the correction: the same run with ``cached`` (no correction) draws other
    samples and makes other calls, so the corrected draft's means are not the cached ones there."""
    x = torch.randn(400, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    kw = dict(steps=STEPS, churn=CHURN, tree=trees.chain(6), coupling="rmc", seed=2)
    model = testing.X0Features(GAUSS)
    got, ref = (specforest.sample(model, x, draft=d, **kw) for d in ("corrected", "cached"))
    assert not torch.equal(got.samples, ref.samples)
    assert got.stats.draft_calls == ref.stats.draft_calls  # the residual rows ride in the same calls


def _two_rounds(draft, tab, s0=4, seed=3):
    """The memory of one trajectory after two chain rounds of 4 nodes from step ``s0`` (the second
    round's nodes paired with the first's), evaluated by ``X0Features(GAUSS)``; and the two chains' states."""
    model = testing.X0Features(GAUSS)
    g = torch.Generator().manual_seed(seed)
    steps = s0 + torch.arange(4)[None]
    mem = draft.init_memory(1, 3, 4, 20, 3, torch.float64, torch.device("cpu"))
    ys = []
    for _ in range(2):
        y = torch.randn(1, 4, 3, generator=g, dtype=torch.float64)
        v, f = model.with_features(y.reshape(4, 3), tab.sig[steps].reshape(-1))
        chain = EvaluatedChain(
            y=y, v=v.view(1, 4, 3), steps=steps, s0=torch.tensor([s0]), n=torch.tensor([4]), features=f.view(1, 4, 3)
        )
        mem = draft.remember(mem, tab, chain)
        ys.append(y)
    return mem, ys


def test_corrected_mean_is_the_targets_transition_along_the_last_offset_for_one_gaussian():
    """Closed form: one isotropic Gaussian's clean-data prediction is affine in the state with a scalar
    Jacobian ``a I``, and with ``X0Features`` the cached draft freezes it at the remembered node, so its
    error at ``y`` is ``a (y - y_j)`` and its residual at node ``j`` (read with its pair's features) is
    ``a dy_j``. The correction ``c a dy_j`` makes the mean the target's transition exactly where
    ``y - y_j = c dy_j`` with ``|c| <= 1``, adds nothing where ``y - y_j`` is orthogonal to ``dy_j``
    (the cached mean), and is cut at ``c = 1`` past the pair's own offset."""
    tab = ReverseSDE(flow_match_grid(20, shift=3.0), 0.5).tables("cpu", torch.float64)
    draft, cached = CorrectedDraft(), CachedDraft()
    model = testing.X0Features(GAUSS)
    draft.bind(model, (3,))
    cached.bind(model, (3,))
    mem, (y1, y2) = _two_rounds(draft, tab)
    assert bool(mem.paired.all()) and torch.equal(mem.pair_dy, y2 - y1)
    pre = Prefetch.empty(1, 3, torch.float64, torch.device("cpu")).replaced(y1[:, 0], y1[:, 0], torch.tensor([4]))
    steps = 4 + torch.arange(4)[None]
    dy = y2 - y1
    ortho = torch.linalg.cross(dy[0, 3], torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    y = torch.stack([y2[0, 0] + 0.5 * dy[0, 0], y2[0, 1] - 0.7 * dy[0, 1], y2[0, 2] + 3.0 * dy[0, 2], y2[0, 3] + ortho])
    y = y[None]
    got = draft.mean(tab, y, steps, pre, {}, (3,), None, memory=mem)
    exact = tab.mean(y, GAUSS(y.reshape(-1, 3), tab.sig[steps].reshape(-1)).view(1, 4, 3), steps)
    plain = cached.mean(tab, y, steps, pre, {}, (3,), None, memory=mem)
    torch.testing.assert_close(got[:, :2], exact[:, :2], rtol=0, atol=1e-12)
    assert (got[:, :2] - plain[:, :2]).abs().amax() > 1e-4  # the cached mean is not it
    # c = 3 is cut at 1: the target's transition as if the parent were y_j + dy_j
    cut = y2[:, 2] + dy[:, 2]
    v_cut = GAUSS(cut, tab.sig[steps[:, 2]]) + (y[:, 2] - cut) / tab.sig[steps[:, 2]]
    torch.testing.assert_close(got[:, 2], tab.mean(y[:, 2:3], v_cut[:, None], steps[:, 2:3])[:, 0], rtol=0, atol=1e-12)
    assert not torch.allclose(got[:, 2], exact[:, 2])
    torch.testing.assert_close(got[:, 3], plain[:, 3], rtol=0, atol=1e-12)


def test_corrected_drafts_as_cached_until_a_node_has_a_pair():
    """After one remembered round no node has a pair (and on a model without the pairs' features, or
    with no memory, there is nothing to correct): the corrected mean is the cached one."""
    tab = ReverseSDE(flow_match_grid(20, shift=3.0), 0.5).tables("cpu", torch.float64)
    draft, cached = CorrectedDraft(), CachedDraft()
    model = testing.X0Features(GAUSS)
    draft.bind(model, (3,))
    cached.bind(model, (3,))
    mem, (y1, _) = _two_rounds(draft, tab)
    first = draft.init_memory(1, 3, 4, 20, 3, torch.float64, torch.device("cpu"))
    v, f = model.with_features(y1.reshape(4, 3), tab.sig[4 + torch.arange(4)])
    steps = 4 + torch.arange(4)[None]
    chain = EvaluatedChain(
        y=y1, v=v.view(1, 4, 3), steps=steps, s0=torch.tensor([4]), n=torch.tensor([4]), features=f.view(1, 4, 3)
    )
    one = draft.remember(first, tab, chain)
    assert not bool(one.paired.any())
    pre = Prefetch.empty(1, 3, torch.float64, torch.device("cpu")).replaced(y1[:, 0], y1[:, 0], torch.tensor([4]))
    y = y1 + 0.3
    for memory in (one, None):
        got = draft.mean(tab, y, steps, pre, {}, (3,), None, memory=memory)
        torch.testing.assert_close(got, cached.mean(tab, y, steps, pre, {}, (3,), None, memory=memory), rtol=0, atol=0)
