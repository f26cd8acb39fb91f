"""Drafts that read what the run evaluated before: what they read, and that reading one evaluation
too far (a peek at the drafted node's own draws) is caught by the whole-chain law test."""

import pytest
import torch

import specforest
from specforest import testing, trees
from specforest.models import GaussianMixture
from specforest.proposals import FrozenPrediction, MemoryDraft, Prefetch
from specforest.sde import ReverseSDE, flow_match_grid

MU0 = torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64)
S0 = 0.3
GAUSS = GaussianMixture(MU0[None], torch.tensor([S0]))
N, STEPS, CHURN = 6000, 12, 0.6


class PeekMemory(MemoryDraft):
    """The memory draft off by one: a parent at step ``s`` reads the previous round's node at
    ``s + 1``, whose state was drawn with the noise the drafted child now reuses (a peek)."""

    name = "peek"

    def coefficients(self, tab, steps, pre, state, terms=None):
        ac = tab.ac[steps]
        a, c = ac[..., :1], ac[..., 1:]
        k = c / tab.sig[steps][..., None]
        x0 = (pre.y - tab.sig[pre.step][:, None] * pre.v)[:, None]
        n, s0 = pre.mem_n[:, None], pre.mem_s0[:, None]
        t = steps - s0 + 1
        j = torch.minimum(t, n - 1).clamp(min=0)
        use = (n > 0) & (t >= 0) & (t < n)
        mem = pre.mem_x0.gather(1, j[..., None].expand(-1, -1, pre.mem_x0.shape[2]))
        return a + k, -k * torch.where(use[..., None], mem, x0)


def _law_failures(draft, coupling="rmc"):
    x = torch.randn(N, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = specforest.sample(
        GAUSS,
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


def _pre(batch=3, dim=5, memory=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    pre = Prefetch.empty(batch, dim, torch.float64, torch.device("cpu"), memory=memory)
    pre = pre.replaced(r(batch, dim), r(batch, dim), torch.tensor([3, 5, 7]))
    return pre, r


def test_memory_draft_reads_the_node_at_the_parents_step_and_falls_back_to_x0():
    tab = ReverseSDE(flow_match_grid(20, shift=3.0), 0.5).tables("cpu", torch.float64)
    pre, r = _pre()
    steps = pre.step[:, None] + 1 + torch.arange(5)  # (3, 5) parents after each prefetch
    y = r(3, 5, 5)
    mem = MemoryDraft()
    # no memory yet: the x0 kind's mean
    A, C = mem.coefficients(tab, steps, pre, None)
    Ax, Cx = FrozenPrediction("x0").coefficients(tab, steps, pre, None)
    torch.testing.assert_close(torch.addcmul(C, A, y), torch.addcmul(Cx, Ax, y), rtol=0, atol=1e-12)
    # row 0 remembers 4 nodes from step 3, row 1 two from step 5, row 2 four from step 2 (older than its prefetch at 7)
    x0 = r(3, 4, 5)
    pre = pre.with_memory(None, x0, torch.tensor([3, 5, 2]), torch.tensor([4, 2, 4]))
    A, C = mem.coefficients(tab, steps, pre, None)
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


def test_memory_rows_follow_take_restart_and_with_rows():
    pre, r = _pre()
    x0 = r(3, 4, 5)
    pre = pre.with_memory(None, x0, torch.tensor([3, 5, 2]), torch.tensor([4, 2, 4]))
    sub = pre.take(torch.tensor([2, 0]), history=False)
    assert torch.equal(sub.mem_x0, x0[[2, 0]]) and sub.mem_s0.tolist() == [2, 3] and sub.mem_n.tolist() == [4, 4]
    back = pre.restart(torch.tensor([1]))
    assert back.mem_n.tolist() == [4, 0, 4] and torch.equal(back.mem_x0[1], torch.zeros(4, 5, dtype=torch.float64))
    # a shorter chain is padded, a subset of rows replaced
    part = pre.with_memory(torch.tensor([1]), x0[:1, :2], torch.tensor([9]), torch.tensor([2]))
    assert part.mem_s0.tolist() == [3, 9, 2] and torch.equal(part.mem_x0[1, :2], x0[0, :2])
    assert torch.equal(part.mem_x0[0], x0[0]) and not part.mem_x0[1, 2:].any()
    moved = part.with_rows(torch.tensor([0]), r(1, 5), r(1, 5), torch.tensor([8]), keep_prev=True)
    assert torch.equal(moved.mem_x0, part.mem_x0)


def test_memory_draft_cuts_target_calls_on_the_mixture():
    """Not a speed test: on a d = 500 mixture the aligned memory accepts more per round than
    the x0 kind it falls back to (a broken memory would not)."""
    gmm = GaussianMixture.paper(dim=500, seed=0)
    x = torch.randn(16, 500, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    nfe = {
        d: specforest.sample(gmm, x, steps=30, churn=0.1, tree=trees.chain(30), coupling="rmc", draft=d, seed=1)
        .stats.nfe.double()
        .mean()
        for d in ("x0", "memory")
    }
    assert nfe["memory"] < 0.85 * nfe["x0"]


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
