"""The shipped exactness checks (specforest.testing) and the docs example that uses them."""

import re
from pathlib import Path

import pytest
import torch
from scipy import stats as sps

from specforest import testing, trees
from specforest.couplings import GRS, RMC


class KeepFirst(GRS):
    """Keeps its first child whatever the target."""

    name = "keep-first"

    def select(self, s_hat, delta, valid, rng):
        P = s_hat.shape[0]
        return torch.ones(P, dtype=torch.bool), torch.zeros(P, dtype=torch.long)


def test_ks_p_value_agrees_with_scipy():
    g = torch.Generator().manual_seed(0)
    for shift in (0.0, 0.02, 0.05):
        x = torch.randn(5000, generator=g, dtype=torch.float64) + shift
        assert abs(testing._ks_normal_p(x) - sps.kstest(x.numpy(), "norm").pvalue) < 2e-3


def test_check_coupling_passes_exact_rules_at_the_defaults():
    for cp in ("grs", RMC(), "antithetic"):
        rep = testing.check_coupling(cp, draws=20_000)
        rep.assert_exact()
        assert rep.passed and rep.cases


def test_a_rule_that_keeps_its_first_child_fails_at_the_defaults():
    rep = testing.check_coupling(KeepFirst())
    assert not rep.passed
    with pytest.raises(AssertionError, match="keep-first"):
        rep.assert_exact()


def test_check_coupling_validates_its_arguments():
    with pytest.raises(ValueError, match="draws"):
        testing.check_coupling("grs", draws=10)
    with pytest.raises(ValueError, match="deltas"):
        testing.check_coupling("grs", deltas=[-1.0])


def test_check_chain_law_passes_and_fails():
    testing.check_chain_law(trees.uniform(2, 3), "grs").assert_exact()
    # accepting every draft leaves the variance far off (z ~ 14 here)
    assert not testing.check_chain_law(trees.uniform(2, 3), KeepFirst()).passed


@pytest.mark.parametrize("doc", ["docs/writing-a-coupling.md", "CONTRIBUTING.md"])
def test_the_documented_examples_run(doc):
    text = (Path(__file__).resolve().parent.parent / doc).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, doc, "exec"), {})
