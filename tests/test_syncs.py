"""Host-device synchronizations per round: at most 2 in full mode (one schedule read and one
for the rejected walks; the issue's budget was L + 2), counted here on CPU.

A synchronization is a host read of a tensor's values: ``item``/``bool`` (the
``item``, ``is_nonzero`` or ``_local_scalar_dense`` op), ``nonzero`` (its output size depends on the data;
``nonzero_static`` does not), and the engine's planned ``host_read``. The same
counter sees a coupling that adds one.
"""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import specforest
from specforest import chains, engine, residuals, testing, trees
from specforest.couplings import GRS
from specforest.drafts import LearnedDraft
from specforest.models import GaussianMixture

GMM = GaussianMixture.paper(dim=8, components=3, seed=0)
X = torch.randn(6, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


class _Syncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        # (under inference mode a host read dispatches as item or is_nonzero, not _local_scalar_dense)
        if name.split(".")[0] in ("_local_scalar_dense", "item", "is_nonzero", "nonzero"):
            self.count[name] += 1
        return func(*args, **(kwargs or {}))


def _syncs_per_round(monkeypatch, **kw):
    """Synchronizations inside rounds (not the run's set-up and final checks), per round."""
    spy, reads, rounds = _Syncs(), [], []
    real_read, real_round = engine.host_read, engine.run_round

    def counted_round(ctx, state):
        rounds.append(1)
        with spy:
            return real_round(ctx, state)

    # off the CPU the residual computes every branch; here it would skip some by reading masks
    monkeypatch.setattr(residuals, "_needed", lambda mask: True)
    monkeypatch.setattr(engine, "host_read", lambda t: reads.append(1) or real_read(t))
    monkeypatch.setattr(engine, "run_round", counted_round)
    run = kw.pop("run", {"steps": 20, "churn": 0.4})
    specforest.sample(kw.pop("model", GMM), X, seed=0, **run, **kw)
    return (sum(spy.count.values()) + len(reads)) / len(rounds), spy.count


@pytest.mark.parametrize(
    "tree,coupling", [(trees.uniform(2, 3), "grs"), (trees.chain(5), "rmc"), (trees.widths([3, 2, 1]), "grs")]
)
def test_at_most_two_synchronizations_per_round(monkeypatch, tree, coupling):
    per_round, seen = _syncs_per_round(monkeypatch, tree=tree, coupling=coupling)
    assert per_round <= 2, (per_round, seen)


@pytest.mark.parametrize("coupling", ["rank", "antithetic"])
def test_list_couplings_stay_within_depth_plus_two_synchronizations(monkeypatch, coupling):
    # their choice reads whether every problem has all its children, and their residuals are
    # rejection-sampled (one read a pass): within the budget of L + 2 a round
    tree = trees.uniform(2, 3)
    per_round, seen = _syncs_per_round(monkeypatch, tree=tree, coupling=coupling)
    assert per_round <= tree.L + 2, (per_round, seen)


def test_standard_sampler_synchronizes_never_inside_a_round(monkeypatch):
    per_round, seen = _syncs_per_round(monkeypatch, tree=None)
    assert per_round == 0, seen


@pytest.mark.parametrize("tree", [None, trees.uniform(2, 3)], ids=["standard", "tree"])
def test_a_chain_of_two_stages_adds_no_synchronization(monkeypatch, tree):
    """Heun's second call per round (its stage points, its weights) reads nothing on the host: the
    standard sampler still none inside a round (its steps' stage counts are the run's tables'), a tree at most two."""
    run = {"sigmas": chains.karras_linear_grid(20, 0.03, 20.0), "chain": chains.HeunChurn(s_churn=5.0)}
    per_round, seen = _syncs_per_round(monkeypatch, tree=tree, run=run)
    assert per_round <= (0 if tree is None else 2), (per_round, seen)


@pytest.mark.parametrize("draft", ["learned", "cached"])
def test_a_network_draft_through_a_chains_two_stages_adds_no_synchronization(monkeypatch, draft):
    """A network draft runs its network through both stages of each drafted level (its stage points,
    the anchors' steps, the remembered nodes' features) without reading anything on the host."""
    model = testing.X0Features(GMM) if draft == "cached" else GMM
    prop = "cached" if draft == "cached" else LearnedDraft(GaussianMixture.paper(dim=8, components=2, seed=1))
    run = {"sigmas": chains.karras_linear_grid(20, 0.03, 20.0), "chain": chains.HeunChurn(s_churn=5.0)}
    per_round, seen = _syncs_per_round(
        monkeypatch, model=model, tree=trees.chain(5), coupling="rmc", draft=prop, run=run
    )
    assert per_round <= 2, (per_round, seen)


def test_the_counter_sees_an_extra_synchronization(monkeypatch):
    class Chatty(GRS):
        def select(self, s_hat, delta, valid, rng):
            for _ in range(8):
                float(delta.sum())  # a host read per call: what the budget forbids
            return super().select(s_hat, delta, valid, rng)

    per_round, _ = _syncs_per_round(monkeypatch, tree=trees.uniform(2, 3), coupling=Chatty())
    assert per_round > 2
