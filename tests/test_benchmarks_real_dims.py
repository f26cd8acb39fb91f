"""``benchmarks/real_dims.py``: its oracle is a perfect draft, its error per dimension is the
coupling's ``delta`` over ``sqrt(d)``, and its command line refuses bad input by flag."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def real_dims():
    spec = importlib.util.spec_from_file_location("_bench_real_dims", BENCH / "real_dims.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_oracle_accepts_every_draft_and_the_search_keeps_its_best(real_dims):
    from specforest.models import GaussianMixture

    tgt = real_dims.Target("mixture", 16, (16,), "velocity", GaussianMixture.paper(dim=16, components=3))
    cell = real_dims.measure_cell(tgt, "lcm 8", 2)
    assert all(a == 1.0 for a in cell["oracle"]["acc"] if not math.isnan(a))
    assert cell["oracle"]["speedup"] > 1.0  # the perfect draft commits several steps per call
    assert cell["best"]["speedup"] == max(s["speedup"] for s in cell["tried"])
    assert {(s["L"], s["draft"]) for s in cell["tried"]} == {
        (L, d) for L in real_dims.DEPTHS for d in ("velocity", "x0")
    }
    for s in cell["tried"]:
        for e, dl in zip(s["per_dim"], s["delta"], strict=True):
            assert math.isnan(dl) or e == pytest.approx(dl / 4.0)  # sqrt(16)


@pytest.mark.parametrize(
    "argv, flag",
    [(["--samples", "0"], "--samples"), (["--samplers", "euler 7"], "--samplers"), (["--repeats", "0"], "--repeats")],
)
def test_bad_input_is_refused_naming_the_flag_before_any_work(tmp_path, argv, flag):
    out = tmp_path / "RESULTS.md"
    run = subprocess.run(
        [sys.executable, str(BENCH / "real_dims.py"), *argv, "--out", str(out)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    assert run.returncode == 2 and flag in run.stderr and not out.exists()


def test_the_search_tries_the_feature_drafts_on_a_network_that_keeps_its_features(real_dims):
    """A denoiser with ``deep`` and ``shallow`` methods (the digits model's) is searched with ``cached``
    and ``corrected`` beside the frozen drafts, and ``learned`` where it declares its draft network (digits
    does; the same network without the declaration is not); the mixture, a velocity, with the frozen ones only."""
    from specforest.models import GaussianMixture
    from specforest.models.digits import load_denoiser

    net = real_dims.Target("digits", 64, (1, 8, 8), "denoiser", load_denoiser())
    assert real_dims.drafts_for(net) == ["velocity", "x0", "cached", "corrected", "learned"]
    bare = load_denoiser()
    del bare.learned_draft
    plain = real_dims.Target("digits", 64, (1, 8, 8), "denoiser", bare)
    assert real_dims.drafts_for(plain) == ["velocity", "x0", "cached", "corrected"]
    mix = real_dims.Target("mixture", 16, (16,), "velocity", GaussianMixture.paper(dim=16, components=3))
    assert real_dims.drafts_for(mix) == ["velocity", "x0"]
