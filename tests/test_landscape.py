"""The list-coupling bound and the acceptance table."""

import json

import pytest
import torch
from click.testing import CliRunner

from specforest.cli import main
from specforest.couplings import AntitheticCoupling, RankCoupling, rmc_acceptance
from specforest.landscape import COLUMNS, acceptance_table, list_bound, lp_bound
from specforest.rank_rules import (
    TABLE_DELTAS,
    log_rule_pdf,
    n_cells,
    rule_acceptance,
    rule_log_density,
    rule_lp,
    table_acceptance,
    table_rule,
)


@pytest.mark.parametrize(
    "delta,K", [(0.5, 2), *(pytest.param(d, k, marks=pytest.mark.slow) for d, k in [(1.0, 4), (2.0, 8), (1.5, 1)])]
)
def test_closed_form_bound_equals_the_lp_bound(delta, K):
    closed, lp = list_bound(delta, K), lp_bound(delta, K, cells=300)
    # cells only coarsen the constraints: the LP is an upper bound, tight as cells grow
    assert lp >= closed - 1e-9
    assert lp - closed < 1e-3


def test_bound_for_one_proposal_is_total_variation():
    for d in [0.3, 1.0, 3.0]:
        assert list_bound(d, 1) == pytest.approx(float(rmc_acceptance(d)), abs=1e-9)


def test_every_iid_coupling_is_below_the_bound_and_rank_is_near_it():
    rows = acceptance_table([0.25, 0.5, 1.0, 2.0, 3.0], [2, 4, 8])
    for r in rows:
        assert r["grs"] <= r["rank"] + 1e-6 <= r["bound"] + 2e-5
        assert r["rank"] >= 0.99 * r["bound"]


def test_rank_rule_attains_the_iid_bound_on_the_table():
    """The max-conditioned rule is within 0.6 % of the bound at every tabulated delta and K,
    which also shows the bound is (nearly) attained, not just an upper bound."""
    for K in (2, 3, 5, 8, 16):
        acc = table_acceptance(TABLE_DELTAS, K)
        bound = torch.tensor([list_bound(float(d), K) for d in TABLE_DELTAS], dtype=torch.float64)
        assert (acc <= bound + 1e-4).all()
        assert (acc >= 0.994 * bound).all(), (K, float((acc / bound).min()))


def test_best_two_child_rule_is_within_two_percent_of_the_bound():
    """The rank target on delta in [0.5, 3], between table nodes too (interpolated rules)."""
    d = torch.linspace(0.5, 3.0, 51, dtype=torch.float64)
    rank = RankCoupling().acceptance(d, 2)
    anti = AntitheticCoupling().acceptance(d, 2)
    bound = torch.tensor([list_bound(float(v), 2) for v in d], dtype=torch.float64)
    best = torch.maximum(rank, anti)
    assert (best >= 0.98 * bound).all(), (d[best < 0.98 * bound], (best / bound).min())
    assert (rank >= 0.997 * bound).all()


def test_conditioning_on_the_maximum_beats_the_plain_order_statistic_mixture():
    for delta, K in [(0.5, 2), (1.0, 3), (1.0, 8)]:
        W_plain, _ = rule_lp(delta, K, per_cell=False)
        plain = float(rule_acceptance(delta, W_plain))
        assert float(RankCoupling().acceptance(delta, K)) > plain + 0.01


def test_shipped_rules_match_a_fresh_lp():
    """The shipped table is what scripts/make_rank_table.py computes (spot checks)."""
    for base, M, i in [("normal", 2, 5), ("normal", 5, 10), ("halfnormal", 2, 20)]:
        delta = float(TABLE_DELTAS[i])
        W, _ = rule_lp(delta, M, base)
        fresh = float(rule_acceptance(delta, W, base))
        shipped = float(rule_acceptance(delta, table_rule(TABLE_DELTAS[i : i + 1], M, base), base))
        assert shipped == pytest.approx(fresh, abs=2e-4)
        assert float(table_acceptance(TABLE_DELTAS[i : i + 1], M, base)) == pytest.approx(shipped, abs=2e-4)


def test_antithetic_pairs_escape_the_iid_bound():
    anti = AntitheticCoupling()
    for d in [1.0, 1.5, 2.0, 3.0]:
        assert float(anti.acceptance(d, 2)) > list_bound(d, 2)
    for d in [1.5, 2.0, 3.0]:
        assert float(anti.acceptance(d, 4)) > list_bound(d, 4)


def test_rank_acceptance_closed_form_matches_its_lp():
    for d, K in [(0.5, 2), (1.0, 4), (2.0, 3)]:
        _, lp_acc = rule_lp(d, K)
        assert float(RankCoupling().acceptance(torch.tensor(d), K)) == pytest.approx(lp_acc, abs=2e-3)


def test_cli_table_prints_the_librarys_table():
    res = CliRunner().invoke(main, ["couplings", "table", "--json", "--K-values", "1,2", "--deltas", "0,1"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.output.strip().splitlines()]
    assert rows == acceptance_table([0.0, 1.0], [1, 2])
    for r in rows:
        assert set(r) == {"delta", "K", *COLUMNS}
        assert (r["antithetic"] is None) == (r["K"] % 2 == 1)


def test_cli_table_default_grid_and_plot(tmp_path):
    res = CliRunner().invoke(main, ["couplings", "table", "--json", "--K-values", "1"])
    assert res.exit_code == 0
    deltas = [json.loads(line)["delta"] for line in res.output.strip().splitlines()]
    assert deltas == [0.25 * i for i in range(21)]
    out = tmp_path / "land.png"
    res = CliRunner().invoke(main, ["couplings", "plot", "--out", str(out), "--K-values", "2"])
    assert res.exit_code == 0 and out.stat().st_size > 1000
    res = CliRunner().invoke(main, ["couplings", "table", "--deltas", "-1"])
    assert res.exit_code != 0 and "delta" in res.output


@pytest.mark.parametrize("base", ["normal", "halfnormal"])
@pytest.mark.parametrize("M", [1, 2, 3])
def test_closed_form_rule_density_is_the_basis_density(base, M):
    """``rule_log_density`` (a few gathers for M <= 2) equals ``log_rule_pdf`` (the (C, M) basis)
    over both tails and every cell, for random and tabulated weights; a lookup in the wrong cell is caught by the same
    comparison."""
    g = torch.Generator().manual_seed(M)
    W = torch.rand(4, n_cells(base), M, generator=g, dtype=torch.float64)
    W = W / W.sum(-1, keepdim=True)
    if M > 1:
        W[:2] = table_rule(torch.tensor([0.3, 4.0], dtype=torch.float64), M, base)
    lo = 0.0 if base == "halfnormal" else -12.0
    s = torch.linspace(lo, 14.0, 2001, dtype=torch.float64).expand(4, -1).contiguous()
    rows = torch.arange(4)
    ours = rule_log_density(W, M, base)(s, rows)
    ref = log_rule_pdf(s, W[:, None], M, base)
    assert torch.isfinite(ref).float().mean() > 0.5  # (a tabulated rule may give a cell density 0)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    # rows pick problems: problem 3's points read problem 3's weights
    torch.testing.assert_close(rule_log_density(W, M, base)(s[:1], rows[3:]), ref[3:], rtol=0, atol=1e-12)
    if M > 1:  # (one value: every weight is 1)
        # an off-by-one cell lookup is caught by the same comparison
        shifted = rule_log_density(W.roll(1, dims=1), M, base)(s, rows)
        both = torch.isfinite(shifted) & torch.isfinite(ref)
        assert not torch.equal(torch.isfinite(shifted), torch.isfinite(ref)) or (shifted - ref)[both].abs().max() > 1e-3


def test_rule_log_density_names_a_bad_argument():
    W = torch.full((2, n_cells("normal"), 2), 0.5, dtype=torch.float64)
    with pytest.raises(ValueError, match="base must be one of"):
        rule_log_density(W, 2, "cauchy")
    with pytest.raises(ValueError, match=r"M must be an int >= 1"):
        rule_log_density(W, 0)
    with pytest.raises(ValueError, match=r"W must have shape \(P, 34, 3\)"):
        rule_log_density(W, 3)
