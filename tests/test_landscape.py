"""The list-coupling bound and the acceptance table (issue #6)."""

import json

import pytest
import torch
from click.testing import CliRunner

from specforest.cli import main
from specforest.couplings import AntitheticCoupling, RankCoupling, rank_weights_lp, rmc_acceptance
from specforest.landscape import COLUMNS, acceptance_table, list_bound, lp_bound


@pytest.mark.parametrize("delta,K", [(0.5, 2), (1.0, 4), (2.0, 8), (1.5, 1)])
def test_closed_form_bound_equals_the_lp_bound(delta, K):
    closed, lp = list_bound(delta, K), lp_bound(delta, K, cells=300)
    # cells only coarsen the constraints: the LP is an upper bound, tight as cells grow
    assert lp >= closed - 1e-9
    assert lp - closed < 1e-3


def test_bound_for_one_proposal_is_total_variation():
    for d in [0.3, 1.0, 3.0]:
        assert list_bound(d, 1) == pytest.approx(float(rmc_acceptance(d)), abs=1e-9)


def test_every_iid_coupling_is_below_the_bound_and_rank_is_near_it():
    rows = acceptance_table([0.5, 1.0, 2.0, 3.0], [2, 4, 8])
    for r in rows:
        assert r["grs"] <= r["rank"] + 1e-6 <= r["bound"] + 2e-6
        if r["delta"] >= 1.0:
            assert r["rank"] >= 0.95 * r["bound"]


def test_antithetic_pair_escapes_the_iid_bound():
    anti = AntitheticCoupling()
    for d in [1.0, 1.5, 2.0, 3.0]:
        assert float(anti.acceptance(d)) > list_bound(d, 2)


def test_rank_acceptance_closed_form_matches_its_lp():
    for d, K in [(0.5, 2), (1.0, 4), (2.0, 3)]:
        _, lp_acc = rank_weights_lp(d, K)
        assert float(RankCoupling().acceptance(torch.tensor(d), K)) == pytest.approx(lp_acc, abs=2e-3)


def test_cli_table_json_keys():
    res = CliRunner().invoke(main, ["couplings", "table", "--json", "--K-values", "1,2", "--deltas", "0,1"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.output.strip().splitlines()]
    assert len(rows) == 4
    for r in rows:
        assert set(r) == {"delta", "K", *COLUMNS}
        assert (r["antithetic"] is None) == (r["K"] != 2)


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
