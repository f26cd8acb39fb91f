"""``benchmarks/chains.py``: its oracle accepts every step of a two-call sampler, its counted calls are
the run's own, its goals' section goes after the ``chains`` section leaving the others as they were,
and ``--samplers`` refuses an unknown name before any work."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("_bench_chains", BENCH / "chains.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("key", ["heun", "dpm_2_ancestral", "dpmpp_3m_sde", "dpmpp_sde"])
def test_the_oracle_accepts_every_step_of_a_two_call_or_multistep_sampler_and_the_calls_are_counted(bench, key):
    from specforest import chains, trees
    from specforest.models import GaussianMixture

    model = GaussianMixture.paper(dim=8, components=3)
    chain = chains.get_chain(key, **({"s_churn": 40.0} if key == "heun" else {}))
    steps = 6
    grid = chains.karras_linear_grid(steps)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)) * float(grid[0])
    std = bench.goal_run(model, x, {}, chain, grid, 0)
    tab = chain.build(grid)
    # two calls a step (or two half-steps), one into 0: counted at the model, as the run reports them
    assert std["counted"] == std["calls"] == std["standard"] == tab.standard_calls
    assert tab.standard_calls == (steps if key == "dpmpp_3m_sde" else 2 * steps - 1)
    # the target as a plain callable draft runs through the chain's stages (a staged draft) and hands on its
    # own predictions (a multistep chain): the oracle
    oracle = bench.goal_run(model, x, {}, chain, grid, 0, trees.chain(4), model)
    assert all(a == pytest.approx(1.0) for a in oracle["acc"] if a == a)  # NaN: a depth never reached
    assert oracle["counted"] == oracle["calls"]
    # acceptance 1 at depth 4: ceil(M / 4) + 1 rounds of s calls, M the chain's steps, but the last step into 0
    # saves what the standard run saves there
    rounds = math.ceil(tab.steps / 4) + 1
    nfe = tab.stages * rounds - (tab.stages * tab.steps - tab.standard_calls)
    assert bench.speedup(std["counted"], oracle["nfe"])[0] == pytest.approx(tab.standard_calls / nfe)


def test_the_goals_section_goes_after_the_chains_section_and_leaves_the_others(bench, tmp_path):
    from specforest.experiments.results import replace_section

    out = tmp_path / "RESULTS.md"
    out.write_text(
        "# r\n\n<!-- chains:begin -->\nold rows\n<!-- chains:end -->\n\n<!-- schedulers:begin -->\ns\n<!-- schedulers:end -->\n"
    )
    bench.ensure_after(out, bench.GOAL_SECTION, "chains")
    replace_section(out, bench.GOAL_SECTION, bench.GOAL_HEADING, "new rows")
    text = out.read_text()
    assert text.index("old rows") < text.index("new rows") < text.index("<!-- schedulers:begin -->")
    bench.ensure_after(out, bench.GOAL_SECTION, "chains")  # present: left where it is
    assert out.read_text() == text


def test_an_unknown_sampler_is_refused_naming_the_flag_before_any_work(tmp_path):
    out = tmp_path / "RESULTS.md"
    run = subprocess.run(
        [sys.executable, str(BENCH / "chains.py"), "--samplers", "heun,dpmpp_9m", "--out", str(out)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    assert run.returncode == 2 and "--samplers must be" in run.stderr and "dpmpp_3m_sde" in run.stderr
    assert not out.exists()
