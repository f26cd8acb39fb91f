"""A draft's own per-trajectory memory, which the engine carries without knowing its fields: the
shipped chain memory's rows (take, put, restart, the secant gains), a run's restart of it, and a
draft defined outside the library with a memory of its own class."""

from dataclasses import dataclass, fields

import pytest
import torch

import specforest
from specforest import engine, streams, trees
from specforest.drafts import ChainMemory, DraftMemory, PairedChainMemory, Prefetch, Proposal
from specforest.models import GaussianMixture
from specforest.sampler import prepare

CPU = torch.device("cpu")


def _rand(seed=0):
    g = torch.Generator().manual_seed(seed)
    return lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)


def _memory(batch=3, dim=5, width=4, states=False, steps=0):
    """An empty chain memory (no node remembered) of ``batch`` trajectories."""
    return ChainMemory.empty(batch, width, dim, torch.float64, CPU, states=states, steps=steps)


def test_memory_rows_follow_take_restart_and_put():
    r = _rand()
    x0 = r(3, 4, 5)
    mem = _memory().replaced(x0, torch.tensor([3, 5, 2]), torch.tensor([4, 2, 4]))
    assert mem.y is None and mem.gain_num is None and mem.features is None  # kept only where asked
    sub = mem.take(torch.tensor([2, 0]))
    assert torch.equal(sub.x0, x0[[2, 0]]) and sub.s0.tolist() == [2, 3] and sub.n.tolist() == [4, 4]
    back = mem.restart(torch.tensor([1]))
    assert back.n.tolist() == [4, 0, 4] and torch.equal(back.x0[1], torch.zeros(4, 5, dtype=torch.float64))
    # a shorter chain is padded, a subset of rows replaced
    one = torch.tensor([1])
    part = mem.put(one, mem.take(one).replaced(x0[:1, :2], torch.tensor([9]), torch.tensor([2])))
    assert part.s0.tolist() == [3, 9, 2] and torch.equal(part.x0[1, :2], x0[0, :2])
    assert torch.equal(part.x0[0], x0[0]) and not part.x0[1, 2:].any()
    # the prefetch is the engine's evaluations only: a draft's memory lives apart from it
    names = {f.name for f in fields(Prefetch)}
    assert names == {"y", "v", "step", "prev_y", "prev_v", "prev_step", "has_prev", "valid"}


def test_secant_states_and_gains_follow_take_and_restart():
    r = _rand()
    mem = _memory(states=True, steps=12)
    y = r(3, 4, 5)
    for s0 in (torch.tensor([3, 5, 2]), torch.tensor([4, 5, 3])):
        mem = mem.replaced(r(3, 4, 5), s0, torch.tensor([4, 2, 4]), y=y + 0.1 * r(3, 4, 5))
    assert (mem.gain_den > 0).any(1).all()
    sub = mem.take(torch.tensor([2, 0]))
    assert torch.equal(sub.y, mem.y[[2, 0]]) and torch.equal(sub.gain_num, mem.gain_num[[2, 0]])
    back = mem.restart(torch.tensor([1]))
    assert not back.gain_den[1].any() and not back.y[1].any() and torch.equal(back.gain_den[0], mem.gain_den[0])
    with pytest.raises(ValueError, match="needs y"):
        mem.replaced(r(3, 4, 5), torch.tensor([4, 5, 3]), torch.tensor([4, 2, 4]))


def test_a_runs_restart_clears_the_drafts_memory_of_the_restarted_rows():
    """``RunState.restart`` (continuous batching's refill) gives the restarted rows the memory
    ``init_state`` gives a fresh trajectory and keeps the others', though the engine never reads the
    memory's fields (the secant draft's chain, states and gains here)."""
    spec = prepare(specforest.SamplerOptions(steps=12, churn=0.5, tree=trees.chain(4), coupling="rmc", draft="secant"))
    gmm = GaussianMixture.paper(dim=4, components=3, seed=0)
    batch, rows, other = 5, torch.tensor([2, 3]), torch.tensor([0, 1, 4])
    ctx = spec.context(gmm, (4,), torch.float64, CPU, batch, {})
    x0, keys = (
        streams.randn(1, torch.arange(batch), (4,), dtype=torch.float64),
        streams.sample_keys(1, torch.arange(batch)),
    )
    with torch.inference_mode():
        old = engine.init_state(ctx, x0, keys)
        for _ in range(5):
            old = engine.run_round(ctx, old)
        new = old.restart(rows, x0[rows], keys[rows])
        fresh = engine.init_state(ctx, x0, keys)
    assert isinstance(old.memory, ChainMemory) and bool((old.memory.n > 0).all())
    assert bool((old.memory.gain_den[rows] > 0).any(1).all())  # the restarted rows have gains to clear
    for f in fields(ChainMemory):
        got, was, init = (getattr(m.memory, f.name) for m in (new, old, fresh))
        assert (got is None) == (f.name == "features"), f.name
        if got is not None:
            assert torch.equal(got[rows], init[rows]) and torch.equal(got[other], was[other]), f.name


@dataclass(frozen=True)
class LastChain(DraftMemory):
    """A memory written outside the library: per trajectory, the last chain round's clean-data
    predictions ``x0 (batch, W, D)``, from step ``s0 (batch,)``, the first ``n (batch,)`` valid."""

    x0: torch.Tensor
    s0: torch.Tensor
    n: torch.Tensor


class OwnMemory(Proposal):
    """The memory draft's rule written outside the library with a memory of its own
    (:class:`LastChain`): it declares, makes and updates it through the hooks, and the engine
    carries it without knowing its fields."""

    affine = True
    uses_memory = True
    aligned_noise = True
    name = "own_memory"

    def init_memory(self, batch, D, width, steps, features, dtype, device):
        zero = torch.zeros(batch, dtype=torch.long, device=device)
        return LastChain(x0=torch.zeros(batch, width, D, dtype=dtype, device=device), s0=zero, n=zero)

    def remember(self, memory, tab, chain):
        G, Lr, D = chain.y.shape
        W = memory.x0.shape[1]
        x0 = chain.y - tab.sig[chain.steps][..., None] * chain.v.to(chain.y.dtype)
        x0 = torch.cat([x0, x0.new_zeros(G, max(W - Lr, 0), D)], 1)[:, :W]
        return LastChain(x0=x0, s0=chain.s0, n=chain.n.clamp(max=W))

    def coefficients(self, tab, steps, pre, state, terms=None, memory=None):
        ac = tab.ac[steps]
        a, c = ac[..., :1], ac[..., 1:]
        k = c / tab.sig[steps][..., None]
        x0 = (pre.y - tab.sig[pre.step][:, None] * pre.v)[:, None]
        if memory is not None:
            n, s0 = memory.n[:, None], memory.s0[:, None]
            t = steps - s0
            j = torch.minimum(t, n - 1).clamp(min=0)
            use = (n > 0) & (t >= 0) & (s0 + j >= pre.step[:, None])
            mem = memory.x0.gather(1, j[..., None].expand(-1, -1, memory.x0.shape[2]))
            x0 = torch.where(use[..., None], mem, x0)
        return a + k, -k * x0


@pytest.mark.parametrize("batch", [1, 7])
def test_a_draft_with_its_own_memory_needs_no_engine_file(batch):
    """A draft defined outside the library, its memory its own class, drafts as the shipped memory
    draft does (same NFE and samples) in one trajectory and in a batch whose groups the engine takes
    rows of; continuous batching (which restarts its rows) gives every sample as one run does."""
    gmm = GaussianMixture.paper(dim=6, seed=0)
    x = torch.randn(batch, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    kw = dict(steps=20, churn=0.3, tree=trees.chain(5), coupling="rmc", seed=3)
    ref = specforest.sample(gmm, x, draft="memory", **kw)
    got = specforest.sample(gmm, x, draft=OwnMemory(), **kw)
    assert torch.equal(got.stats.nfe, ref.stats.nfe)
    torch.testing.assert_close(got.samples, ref.samples, rtol=0, atol=1e-12)
    # a draft that forgets gives other numbers: the comparison can fail
    assert not torch.equal(specforest.sample(gmm, x, draft="x0", **kw).stats.nfe, ref.stats.nfe)
    gen = specforest.generate(gmm, count=batch, make_x=lambda i: x[i], draft=OwnMemory(), batch=2, **kw)
    for f in gen:
        for j, i in enumerate(f.index.tolist()):
            torch.testing.assert_close(f.samples[j], got.samples[i], rtol=0, atol=1e-12)


def test_a_draft_that_keeps_a_memory_must_say_how_it_remembers():
    """A draft that makes a memory but not :meth:`~specforest.drafts.Proposal.remember` is stopped at
    its first chain round, naming it."""

    class Forgets(OwnMemory):
        name = "forgets"
        remember = Proposal.remember

    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="'forgets' keeps a memory"):
        specforest.sample(
            GaussianMixture.paper(dim=6, seed=0), x, steps=10, churn=0.3, tree=trees.chain(3), draft=Forgets()
        )


def test_a_runs_restart_clears_the_corrected_drafts_pairs():
    """The corrected draft's memory (the chain, states, gains and deep features, and each node's pair:
    its features, the offset and whether it has one) is cleared for the restarted rows and kept for the
    others, field by field, as :meth:`DraftMemory.restart` does for any memory."""
    spec = prepare(
        specforest.SamplerOptions(steps=12, churn=0.5, tree=trees.chain(4), coupling="rmc", draft="corrected")
    )
    gmm = GaussianMixture.paper(dim=4, components=3, seed=0)
    batch, rows, other = 5, torch.tensor([2, 3]), torch.tensor([0, 1, 4])
    ctx = spec.context(gmm, (4,), torch.float64, CPU, batch, {})
    x0, keys = (
        streams.randn(1, torch.arange(batch), (4,), dtype=torch.float64),
        streams.sample_keys(1, torch.arange(batch)),
    )
    with torch.inference_mode():
        old = engine.init_state(ctx, x0, keys)
        for _ in range(5):
            old = engine.run_round(ctx, old)
        new = old.restart(rows, x0[rows], keys[rows])
        fresh = engine.init_state(ctx, x0, keys)
    assert isinstance(old.memory, PairedChainMemory)
    assert bool(old.memory.paired[rows].any(1).all())  # the restarted rows have pairs to clear
    for f in fields(PairedChainMemory):
        got, was, init = (getattr(m.memory, f.name) for m in (new, old, fresh))
        assert got is not None, f.name
        assert torch.equal(got[rows], init[rows]) and torch.equal(got[other], was[other]), f.name
