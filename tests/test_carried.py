"""The carried state (``specforest.carried.Carried``): the past predictions a chain's mean reads, one
concept for any history, and a chain of a history no shipped chain has run through the engine unchanged.
(``generate``'s refills with a chain of history 2: ``tests/test_chains_generate.py``, every registered chain.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import specforest
from specforest import chains, kdiffusion, testing, trees
from specforest.carried import NOTHING, Carried
from specforest.kdiffusion import linear_grid


def test_pushed_puts_the_newest_prediction_first_and_drops_the_oldest():
    p = torch.arange(2 * 3 * 4, dtype=torch.float64).view(2, 3, 4)
    x0 = torch.full((2, 4), -1.0, dtype=torch.float64)
    out = Carried(p).pushed(x0).p
    assert torch.equal(out[:, 0], x0) and torch.equal(out[:, 1:], p[:, :2])
    assert NOTHING.pushed(x0) is NOTHING and NOTHING.history == 0


@pytest.mark.parametrize("history", [1, 2, 3])
def test_at_nodes_gives_each_node_its_own_ancestors_predictions(history):
    """Node ``i``'s ``p_j`` is its ``j + 1``-th ancestor's prediction, the root's carried ones above it."""
    tree = trees.uniform(2, 3)
    up, depth = tree.parent.clamp(min=0), tree.depth  # (the engine's tables give the root itself as its parent)
    V, G, D = up.numel(), 2, 3
    x0 = torch.randn(G, V, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    root = torch.randn(G, history, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = Carried(root).at_nodes(x0, up).p
    assert got.shape == (G, V, history, D)
    for i in range(V):
        node = i
        for j in range(history):
            if int(depth[i]) > j:
                node = int(up[node])
                want = x0[:, node]
            else:
                want = root[:, j - int(depth[i])]
            assert torch.equal(got[:, i, j], want), (i, j)


def test_the_memory_estimate_counts_what_a_run_carries():
    assert Carried.held_states(0, 10, False) == 0
    assert Carried.held_states(2, 10, True) == 2 and Carried.held_states(2, 10, False) == 2 + 3 * 10


@dataclass(frozen=True)
class AveragedLCM(chains.Chain):
    """LCM's step on the mean of the last four predictions: ``x' = mean(D, D_1, D_2, D_3) + sigma' z`` (VE)."""

    name: ClassVar[str] = "averaged-lcm"
    history: ClassVar[int] = 3

    def _weight(self, t):
        return 1.0 / (torch.arange(t.numel(), dtype=torch.float64) + 1.0).clamp(max=4.0)

    def step(self, t, t_next):
        return chains.from_ve(t, t_next, torch.zeros_like(t), self._weight(t), t_next / (1 - t_next))

    def past(self, t, t_next):
        return ((1 - t_next) * self._weight(t))[:, None].expand(-1, 3)


def _bent(x, sigma, **_):
    s = sigma.reshape(-1, 1).to(torch.float64)
    return (x.to(torch.float64) / (1 + s**2) + 0.3 * torch.tanh(x)).to(x.dtype)


def _averaged_lcm_by_hand(x, sig, z):
    """The sampler written as a loop over k-diffusion's VE levels, independently of the tables."""
    seen = []
    for i in range(len(sig) - 1):
        seen.insert(0, _bent(x, sig[i] * torch.ones(x.shape[0], dtype=x.dtype)))
        x = torch.stack(seen[:4]).mean(0) + sig[i + 1] * z[i]
    return x


def test_a_chain_of_a_new_history_runs_through_the_engine_as_written():
    """A history of 3 (no shipped chain has one): with no tree, the sampler's own loop; with trees, full and
    lazy, its law. Nothing but the chain's class declares it."""
    sig = kdiffusion.get_sigmas_karras(10, 0.05, 20.0).double()
    x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * sig[0]
    gen = torch.Generator().manual_seed(1)
    z = [torch.randn(8, 4, dtype=torch.float64, generator=gen) for _ in range(len(sig))]
    want = _averaged_lcm_by_hand(x, sig, z)
    got = kdiffusion.sample(_bent, x, sig, chain=AveragedLCM(), noise=lambda n: z[n], disable=True).samples
    assert float((got - want).abs().max()) <= 1e-12 * float(want.abs().max())
    tables = AveragedLCM().build(linear_grid(sig))
    assert tables.history == 3 and bool((tables.past[2, 2] == 0) & (tables.past[3, 2] != 0))
    grid = chains.karras_linear_grid(12, 0.03, 20.0)
    for tree, coupling, lazy in ((trees.uniform(2, 2), "grs", True), (trees.chain(4), "rmc", False)):
        testing.check_chain_law(
            tree, coupling, "x0", chain=AveragedLCM(), sigmas=grid, churn=None, trajectories=3000, lazy=lazy
        ).assert_exact()


HISTORY_CHAINS = ["dpmpp_2m_sde", "dpmpp_3m_sde", "dpmpp_sde"]


@pytest.mark.parametrize("prefetched", ["root", "sibling", "none"])
@pytest.mark.parametrize("name", HISTORY_CHAINS)
def test_the_target_as_its_own_draft_drafts_every_depth_with_the_target_mean(name, prefetched):
    """The target as its own draft: the draft means at depths 1, 2 and 3 of a chain of history ``h`` are the
    target's transition means, in closed form on a single Gaussian (``v = alpha y + beta``,
    :mod:`specforest.testing`), whether the root was prefetched, a state at its step that is not the root (what
    ``prefetch="nearest"`` reuses after a rejection: the rejected sibling), or nothing. A drafted parent's past predictions are
    what its drafted ancestors hand on from the draft's own velocities there
    (:func:`specforest.drafting.own_hand_on`), so a perfect draft is exact at every depth; before, they were
    the root's prediction (or its older one), and even this draft was wrong below depth 1 or 2."""
    from dataclasses import replace

    from specforest import SamplerOptions, engine, streams
    from specforest.drafting import draft
    from specforest.drafts import Prefetch
    from specforest.drafts.model import DraftModel
    from specforest.models.gmm import GaussianMixture
    from specforest.sampler import prepare

    mu0, s0, D, G = torch.tensor([0.7, -0.4, 1.1], dtype=torch.float64), 0.6, 3, 4
    gauss = GaussianMixture(mu0[None], torch.tensor([s0], dtype=torch.float64))
    chain = chains.get_chain(name)
    grid = chains.karras_linear_grid(8)
    tr = chain.build(grid)
    spec = prepare(SamplerOptions(chain=chain, sigmas=grid, tree=trees.chain(4), draft=DraftModel(gauss)))
    ctx = spec.context(gauss, (D,), torch.float64, torch.device("cpu"), G, {})
    state = engine.init_state(ctx, streams.randn(0, torch.arange(G), (D,), dtype=torch.float64), torch.arange(G))
    r = torch.Generator().manual_seed(3)
    x = torch.randn(G, D, dtype=torch.float64, generator=r)
    n0 = 2  # a step start of dpmpp_sde: its midpoint's mean reads nothing, its end's what the start hands on
    step = torch.full((G,), n0, dtype=torch.long)
    t = tr.sigmas

    def velocity(y, n):
        alpha, beta = testing._gaussian_velocity(float(t[n]), mu0, s0)
        return alpha * y + beta

    pre = Prefetch.empty(G, D, torch.float64, torch.device("cpu"))
    if prefetched != "none":
        at = x if prefetched == "root" else x + 0.3
        pre = pre.replaced(at, velocity(at, n0), step)
    old = torch.randn(G, chain.history, D, dtype=torch.float64, generator=r)
    state = replace(state, x=x, step=step, pre=pre, carried=Carried(old))
    d = draft(ctx, state, engine.schedule(ctx, state).groups[0])
    # the chain by hand: what a state hands on from its velocity, k_y y + k_v v (tr.carries)
    carried, want = old, []
    for depth in range(4):
        n, y = n0 + depth, d.Y[:, depth]
        mean = tr.a[n] * y + tr.c[n] * velocity(y, n) + sum(tr.past[n, j] * carried[:, j] for j in range(chain.history))
        want.append(mean)
        handed = tr.carries[n, 0] * y + tr.carries[n, 1] * velocity(y, n)
        carried = torch.cat([handed[:, None], carried[:, :-1]], 1)
    assert bool(tr.past[n0 + 1, 0] != 0) and bool(tr.past[n0 + 2 + (name == "dpmpp_sde"), 0] != 0)
    for depth in range(4):
        torch.testing.assert_close(d.Mp[:, depth], want[depth], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", HISTORY_CHAINS)
def test_the_lazy_walk_drafts_the_carried_term_as_the_full_round(name):
    """The lazy walk pushes each drafted state's hand-on along its path as the full draft does, one depth at a
    time or all at once: the same numbers on a chain (an affine draft) and a tree (a draft model)."""
    from specforest.models.gmm import GaussianMixture

    gmm = GaussianMixture.paper(dim=4, components=3, seed=0)
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    kw = dict(chain=name, sigmas=chains.karras_linear_grid(12, 0.03, 20.0), seed=5)
    for opts in (
        dict(tree=trees.chain(5), coupling="rmc", draft="x0"),
        dict(tree=trees.uniform(2, 3), draft=lambda y, s: 0.9 * gmm(y, s)),
    ):
        full = specforest.sample(gmm, x, **kw, **opts)
        lazy = specforest.sample(gmm, x, lazy=True, **kw, **opts)
        assert torch.equal(lazy.samples, full.samples) and torch.equal(lazy.stats.nfe, full.stats.nfe)
        assert full.stats.accept_rate_per_depth[1] > 0


@pytest.mark.parametrize("name", HISTORY_CHAINS)
def test_a_draft_handing_on_its_own_predictions_keeps_the_law_lazy_and_full_and_the_check_sees_more_noise(name):
    """A draft network (a callable: not affine) hands on its own predictions at the drafted parents
    (:func:`specforest.drafting.own_hand_on`): the chain's law with an RMC chain in the lazy walk and a GRS tree in
    full rounds, 3000 trajectories on the single Gaussian; the same check rejects the chain with 10% more noise
    (``s_noise`` 1.1) sampled for the one at 1."""
    from specforest.models.gmm import GaussianMixture

    off = GaussianMixture(torch.tensor([[2.2, -0.8, 0.5]], dtype=torch.float64), torch.tensor([0.35]))
    grid = chains.karras_linear_grid(12, 0.03, 20.0)
    for tree, coupling, lazy in ((trees.chain(4), "rmc", True), (trees.uniform(2, 2), "grs", False)):
        rep = testing.check_chain_law(
            tree, coupling, off, chain=name, sigmas=grid, churn=None, trajectories=3000, lazy=lazy
        )
        rep.assert_exact()
        # the drafted steps were accepted: the hand-ons were read
        assert rep.nfe_mean < 0.75 * chains.get_chain(name).build(grid).standard_calls
    mu0, s0 = torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64), 0.3
    gauss = GaussianMixture(mu0[None], torch.tensor([s0]))
    x = torch.randn(3000, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    loud = specforest.sample(
        gauss,
        x,
        sigmas=grid,
        chain=chains.get_chain(name, s_noise=1.1),
        tree=trees.chain(4),
        coupling="rmc",
        draft=off,
        seed=1,
    )
    assert not testing.check_law(loud.samples, grid, None, mu0, s0, chain=name).passed
