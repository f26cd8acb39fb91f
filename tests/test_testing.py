"""The shipped exactness checks (specforest.testing), the docs example that uses them, and the suite's
rule that the fast tier runs a test of every file (tests/conftest.py)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import KeepFirst
from scipy import stats as sps

from specforest import chains, testing, trees
from specforest.couplings import RMC, available_couplings, unregister_coupling
from specforest.proposals import available_drafts, unregister_draft


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
    registries = [
        (chains.available_chains, chains.unregister_chain),
        (available_couplings, unregister_coupling),
        (available_drafts, unregister_draft),
    ]
    before = [set(names()) for names, _ in registries]
    try:
        for code in blocks:
            exec(compile(code, doc, "exec"), {})
    finally:
        # the examples register plug-ins: leave the registries as they were for the tests after this one
        for (names, unregister), old in zip(registries, before, strict=True):
            for name in set(names()) - old:
                unregister(name)


def test_a_test_file_left_out_of_the_fast_tier_stops_the_run(tmp_path):
    """tests/conftest.py in a suite of two files: the whole suite runs while each file has a fast test,
    and refuses to, naming the file, once every test of one is marked slow."""
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n")
    (tmp_path / "test_a.py").write_text("def test_fast():\n    pass\n")
    mixed = "import pytest\n\n\n@pytest.mark.slow\ndef test_slow():\n    pass\n"

    def collect(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", *args]
        env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # (the installed plugins: seconds a start)
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    (tmp_path / "test_b.py").write_text(mixed + "\n\ndef test_fast():\n    pass\n")
    ok = collect("-m", "not slow")
    assert ok.returncode == 0 and "test_b.py::test_fast" in ok.stdout, ok.stdout + ok.stderr
    (tmp_path / "test_b.py").write_text(mixed)
    refused = collect("-m", "not slow")
    assert refused.returncode == pytest.ExitCode.USAGE_ERROR, refused.stdout + refused.stderr
    assert "every test of test_b.py is marked slow" in refused.stderr, refused.stderr
    # a run of one file checks nothing: the other files are left out on purpose
    assert collect("test_b.py").returncode == 0
