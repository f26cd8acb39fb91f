"""Draft topologies (eq. 9-11) and the time grid / reverse SDE (eqs. 35-38)."""

import math

import pytest
import torch

from specforest import trees
from specforest.reverse_sde import ReverseSDE
from specforest.sde import flow_match_grid, shift_sigmas, uniform_grid


@pytest.mark.parametrize("K,L", [(1, 1), (1, 5), (2, 3), (3, 4), (4, 4), (5, 3), (7, 2), (6, 6)])
def test_uniform_budgets_match_eq_10(K, L):
    t = trees.uniform(K, L)
    assert t.budget == sum(K**level for level in range(1, L + 1))
    assert t.size == t.budget + 1
    assert t.verification_budget("internal") == sum(K**level for level in range(L))
    assert t.verification_budget("drafted") == t.size
    assert t.L == L
    for level in range(L + 1):
        sl = t.layer(level)
        assert sl.stop - sl.start == K**level
        assert (t.depth[sl] == level).all()


def test_paper_budgets():
    assert [trees.uniform(*kl).budget for kl in [(2, 3), (2, 5), (3, 4), (4, 4), (5, 3)]] == [14, 62, 120, 340, 155]
    assert [trees.uniform(K, 2).budget for K in range(2, 8)] == [6, 12, 20, 30, 42, 56]
    assert trees.uniform(7, 6).budget == 137256


def test_children_table_and_parents_agree():
    t = trees.widths([3, 2, 1])
    assert t.budget == 3 + 6 + 6
    for v in range(1, t.size):
        p = int(t.parent[v])
        assert v in t.children[p].tolist()
    assert (t.num_children[t.layer(3)] == 0).all()
    assert t.internal.sum() == 1 + 3 + 6


def test_truncation_is_induced_subtree():
    t = trees.uniform(3, 4)
    for m in range(0, 6):
        u = t.truncate(m)
        mm = min(m, 4)
        assert u.L == mm and u.size == sum(3**level for level in range(mm + 1))
        assert torch.equal(u.parent, t.parent[: u.size])
        assert u.size == t.size_at_depth(m)
    assert t.truncate(0).budget == 0


def test_from_parents_reorders_to_breadth_first():
    # node 3 is the root; 0 hangs below 2 below 3, 1 below 3
    t = trees.from_parents([2, 3, 3, -1, 0])
    assert t.size == 5 and t.L == 3
    assert t.depth.tolist() == [0, 1, 1, 2, 3]
    assert t.num_children.tolist() == [2, 0, 1, 1, 0]


@pytest.mark.parametrize(
    "parents,match",
    [
        ([0, -1, 5], "not a node index"),
        ([-1, -1], "exactly one root"),
        ([1, 2, 0, -1], "not describe a tree"),
    ],
)
def test_from_parents_rejects_non_trees(parents, match):
    with pytest.raises(ValueError, match=match):
        trees.from_parents(parents)


def test_flow_match_grid_is_diffusers_default():
    s = flow_match_grid(30)
    ref = torch.linspace(1.0, 0.001, 30, dtype=torch.float64)
    assert torch.allclose(s[:-1], ref) and s[-1] == 0 and s.shape == (31,)


def test_shift_fixes_endpoints_and_pushes_up():
    s = torch.linspace(0, 1, 11, dtype=torch.float64)
    sh = shift_sigmas(s, 3.0)
    assert sh[0] == 0 and sh[-1] == 1 and (sh[1:-1] > s[1:-1]).all()
    assert torch.allclose(shift_sigmas(s, 1.0), s)
    with pytest.raises(ValueError, match="shift"):
        shift_sigmas(s, 0.0)


@pytest.mark.parametrize("grid", [uniform_grid(20), flow_match_grid(20), flow_match_grid(20, shift=3.0)])
def test_sde_deterministic_endpoints_finite_scales(grid):
    sde = ReverseSDE(grid, 0.7)
    assert not sde.stochastic[0] and not sde.stochastic[-1] and sde.stochastic[1:-1].all()
    assert torch.isfinite(sde.scale).all() and (sde.scale[1:-1] > 0).all()
    assert sde.scale[0] == 0 and sde.scale[-1] == 0
    assert int(sde.run_end[1]) == 19 and int(sde.run_end[0]) == 0


def test_sde_mean_matches_paper_eq_36_37():
    sde = ReverseSDE(uniform_grid(10), 0.4)
    n, gamma, eps = 3, 0.1, 0.4
    t = n * gamma  # paper's reverse time; sigma = 1 - t
    y = torch.randn(4, 6, dtype=torch.float64)
    v = torch.randn(4, 6, dtype=torch.float64)
    step = torch.full((4,), n)
    ref = y - gamma * ((1 + eps**2) * v + eps**2 * y / t)
    assert torch.allclose(sde.mean_from_velocity(y, v, step), ref)
    assert math.isclose(float(sde.scale[n]), eps * math.sqrt(2 * gamma * (1 - t) / t), rel_tol=1e-12)
    b = sde.drift(y, v, step)
    assert torch.allclose(sde.mean_from_drift(y, b, step), ref)
    # deterministic first step: plain Euler on the velocity
    z = torch.zeros(4, dtype=torch.long)
    assert torch.allclose(sde.mean_from_velocity(y, v, z), y - gamma * v)


@pytest.mark.parametrize(
    "sigmas,churn,match",
    [
        (torch.tensor([1.0, 0.5, 0.0]), 0.0, "churn must be in"),
        (torch.tensor([1.0, 0.5, 0.0]), 1.01, "churn must be in"),
        (torch.tensor([1.2, 0.5, 0.0]), 0.5, "decrease strictly"),
        (torch.tensor([1.0, 0.5, 0.1]), 0.5, "exactly 0"),
        (torch.tensor([1.0, 0.5, 0.6, 0.0]), 0.5, "decrease strictly"),
        (torch.tensor([1.0, float("nan"), 0.0]), 0.5, "finite"),
    ],
)
def test_sde_validation(sigmas, churn, match):
    with pytest.raises(ValueError, match=match):
        ReverseSDE(sigmas, churn)
