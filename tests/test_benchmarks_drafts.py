"""``benchmarks/drafts.py``: its refusals, its per-depth table, and its dry run end to end (writing nothing)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "drafts.py"
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=ENV, cwd=ROOT)


def test_too_few_trajectories_are_refused_naming_the_option():
    res = _run("--images", "1")
    assert res.returncode == 2 and "--images" in res.stderr


def test_too_few_timing_seeds_are_refused_naming_the_option():
    res = _run("--wall-seeds", "1")
    assert res.returncode == 2 and "--wall-seeds" in res.stderr


def test_the_per_depth_table_pads_short_rows():
    spec = importlib.util.spec_from_file_location("_bench_drafts", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = {"accept_rate_per_depth": [0.5, None], "delta_per_depth": [1.0, None]}
    lines = bench.per_depth_table([("d = 500", "x0", r)])
    assert lines[2] == "| d = 500 | x0 | 0.50 (δ 1.00) | " + " | ".join([""] * 7) + " |"
    assert len(lines[0].split("|")) == len(lines[2].split("|"))


@pytest.mark.slow
def test_the_dry_run_measures_every_draft_and_the_oracle_and_writes_nothing(tmp_path):
    out = tmp_path / "RESULTS.md"
    res = _run("--dry-run", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    from specforest.proposals import DRAFT_KINDS

    for draft in DRAFT_KINDS:
        assert f"| {draft} |" in res.stdout
    assert "oracle (the target)" in res.stdout and "1.000 |" in res.stdout
    assert "ceiling: the target's prediction at same-step memory nodes" in res.stdout
    assert "ceiling: the exact first-order correction" in res.stdout
    # the one-image timing: the standard sampler and every draft, warm and fresh
    table = res.stdout.split("### One digits image in seconds")[1]
    for name in ("standard", *DRAFT_KINDS):
        assert f"| {name} |" in table
    assert not out.exists()
