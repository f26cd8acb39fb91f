"""Network drafts on chains of several model calls a step (``heun``, ``dpm_2``, ``dpm_2_ancestral``,
``dpmpp_2s_ancestral``): the draft runs its own network through the chain's stage tableau
(:attr:`specforest.drafts.Proposal.staged`), so a draft network equal to the target drafts the
target's own mean, every stage included, and is accepted at every depth; any other network keeps
the chain's law.

The data law is one Gaussian ``N(MU, S0^2 I)`` in 3 dimensions (its velocity in closed form), the
grid :data:`GRID`; the draft network of the law tests is another Gaussian's velocity (:data:`OTHER`).
"""

from __future__ import annotations

import pytest
import torch

import specforest
from specforest import chains, testing, trees
from specforest.drafts import LearnedDraft
from specforest.models import GaussianMixture

MU, S0 = torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64), 0.3
GAUSS = GaussianMixture(MU[None], torch.tensor([S0], dtype=torch.float64))
OTHER = GaussianMixture(torch.tensor([[1.5, -0.5, 0.0]], dtype=torch.float64), torch.tensor([0.5], dtype=torch.float64))
GRID = chains.karras_linear_grid(12, 0.03, 20.0)
STAGED = {
    "heun": chains.get_chain("heun", s_churn=5.0),
    "dpm_2": chains.get_chain("dpm_2", s_churn=5.0),
    "dpm_2_ancestral": chains.get_chain("dpm_2_ancestral"),
    "dpmpp_2s_ancestral": chains.get_chain("dpmpp_2s_ancestral"),
}


class Counted:
    """A velocity network ``fn(x, sigma, **cond)`` with its calls counted."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **cond) -> torch.Tensor:
        self.calls += 1
        return self.fn(x, sigma, **cond)


class NetworkFeatures:
    """A target ``fn`` with the cached self-draft's protocol whose cheap evaluation is the network
    ``net`` at the state it is given, whatever the features (one number a row, kept and ignored):
    ``draft="cached"`` then drafts with ``net`` wherever it reads a remembered node, and with the
    ``x0`` kind where it reads none (its first round)."""

    def __init__(self, fn, net) -> None:
        self.fn, self.net, self.cheap_calls = fn, net, 0

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **cond) -> torch.Tensor:
        return self.fn(x, sigma, **cond)

    def feature_numel(self, shape: tuple) -> int:
        return 1

    def with_features(self, x: torch.Tensor, sigma: torch.Tensor, **cond) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(x, sigma, **cond), x.new_zeros(x.shape[0], 1)

    def from_features(self, x: torch.Tensor, sigma: torch.Tensor, f: torch.Tensor, **cond) -> torch.Tensor:
        self.cheap_calls += 1
        return self.net(x, sigma, **cond)


def _x(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * float(GRID[0])


@pytest.mark.parametrize("chain", list(STAGED))
@pytest.mark.parametrize("kind, lazy", [("model", False), ("model", True), ("learned", False)])
def test_a_draft_network_equal_to_the_target_is_accepted_at_every_depth_of_a_staged_chain(chain, kind, lazy):
    """Closed form: the draft's ``v_eff`` is the target's (its second stage at the point its own first
    prediction gives, weighted as the tableau says), so its mean is the target's mean to rounding and
    every drafted node is accepted; the draft network's calls are ``stats.draft_calls``, two a drafted level."""
    net = Counted(GAUSS)
    draft = net if kind == "model" else LearnedDraft(net)
    out = specforest.sample(
        GAUSS, _x(16), sigmas=GRID, chain=STAGED[chain], tree=trees.chain(6), coupling="rmc", draft=draft, seed=3,
        lazy=lazy,
    )  # fmt: skip
    st = out.stats
    assert int(st.attempts[:, 1:].sum()) > 0  # deeper than the root's children
    assert torch.equal(st.accepts, st.attempts), st.accept_rate_per_depth
    assert st.draft_calls == net.calls and net.calls % 2 == 0 and net.calls > 0


def _rejects_in_the_first_round_only(model, chain: str, draft: str):
    """``stats`` of a run of ``draft`` on an RMC chain as deep as the grid, 32 trajectories, asserting that some
    trajectory rejects (the first rounds, drafted by the ``x0`` kind, do) and none more than once."""
    out = specforest.sample(
        model, _x(32), sigmas=GRID, chain=STAGED[chain], tree=trees.chain(GRID.numel()), coupling="rmc",
        draft=draft, seed=3,
    )  # fmt: skip
    rejected = (out.stats.attempts - out.stats.accepts).sum(1)
    assert int(rejected.sum()) > 0  # the first rounds do reject: the test sees a rejection
    assert int(rejected.max()) <= 1, rejected
    return out.stats


@pytest.mark.parametrize("chain", list(STAGED))
@pytest.mark.parametrize("draft", ["cached", "corrected"])
def test_a_cached_draft_whose_cheap_evaluation_is_the_target_rejects_only_in_its_first_round(chain, draft):
    """The cached draft drafts its first round with the ``x0`` kind (no remembered node), every later
    one with the cheap evaluation at the remembered node, here the target itself through both stages:
    a chain as deep as the grid rejects at most once per trajectory, in that first round. The corrected
    draft's residual, the target's prediction at the node less the cheap one through the same stages,
    is then zero: it drafts as the cached one."""
    st = _rejects_in_the_first_round_only(NetworkFeatures(GAUSS, GAUSS), chain, draft)
    assert st.draft_calls > 0 and st.draft_calls % 2 == 0


class LevelFeatures(NetworkFeatures):
    """Deep features that remember the level they were made at (one number a row): the cheap evaluation
    is the target at the features' level, so it is the target only with the features of a call at the
    same level, as a remembered node's call at the same stage is."""

    def with_features(self, x: torch.Tensor, sigma: torch.Tensor, **cond) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(x, sigma, **cond), torch.as_tensor(sigma, dtype=x.dtype).expand(x.shape[0])[:, None]

    def from_features(self, x: torch.Tensor, sigma: torch.Tensor, f: torch.Tensor, **cond) -> torch.Tensor:
        self.cheap_calls += 1
        return self.fn(x, f[:, 0], **cond)


@pytest.mark.parametrize("chain", list(STAGED))
@pytest.mark.parametrize("draft", ["cached", "corrected"])
def test_a_cached_draft_reads_each_stage_with_the_remembered_nodes_features_of_that_stage(chain, draft):
    """A verified row keeps the deep features of each of its stages' calls (:func:`specforest.stages.evaluate`),
    and the cached draft's stage ``k`` reads the remembered node's stage ``k`` features: with features that
    hold their call's level, the cheap evaluation is the target at every stage from the second round on,
    so a chain as deep as the grid rejects at most once per trajectory. With the first stage's features at
    the second stage (before), the second stage is evaluated at the step's level and drafts are rejected."""
    model = LevelFeatures(GAUSS, None)
    _rejects_in_the_first_round_only(model, chain, draft)
    assert model.cheap_calls > 0


def _law(out, chain) -> None:
    testing.check_law(out.samples, GRID, None, MU, S0, chain=chain).assert_exact()


@pytest.mark.parametrize("chain", list(STAGED))
@pytest.mark.parametrize("kind", ["model", "learned"])
def test_a_wrong_draft_network_keeps_a_staged_chains_law_full_and_lazy(chain, kind):
    """Another Gaussian's velocity as the draft network, run through the stages: any draft mean keeps
    the law (the coupling's), on a chain and on a tree, the plain draft model lazy too."""
    for tree, coupling, lazy in ((trees.chain(5), "rmc", False), (trees.uniform(2, 3), "grs", kind == "model")):
        draft = OTHER if kind == "model" else LearnedDraft(OTHER)
        rep = testing.check_chain_law(
            tree, coupling, draft, chain=STAGED[chain], sigmas=GRID, churn=None, trajectories=3000, lazy=lazy
        )
        rep.assert_exact()


@pytest.mark.parametrize("chain", list(STAGED))
@pytest.mark.parametrize("draft", ["cached", "corrected"])
def test_a_wrong_cheap_evaluation_keeps_a_staged_chains_law(chain, draft):
    """The cached and corrected drafts with another Gaussian's velocity as the cheap evaluation, run
    through the stages at the parents, the remembered nodes and their pairs: the law is kept."""
    model = NetworkFeatures(GAUSS, OTHER)
    x = torch.randn(3000, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for tree, coupling in ((trees.chain(5), "rmc"), (trees.uniform(2, 2), "grs")):
        out = specforest.sample(
            model, x, sigmas=GRID, chain=STAGED[chain], tree=tree, coupling=coupling, draft=draft, seed=2
        )
        _law(out, STAGED[chain])
    assert model.cheap_calls > 0
