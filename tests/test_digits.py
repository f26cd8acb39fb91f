"""The shipped digits model and the pixel-space experiment.

Loads the committed weights (never trains), checks their checksum handling,
checks that speculative sampling of the real network has the law of the
standard sampler at a small scale (with a deliberately wrong sampler that the
same test rejects), and smoke-tests the CLI.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from scipy import stats as sps

import specforest
from specforest import memory, trees
from specforest.chains import get_chain
from specforest.cli.pixel import pixel
from specforest.cli.train import train
from specforest.couplings import Coupling
from specforest.experiments import pixel as pixel_exp
from specforest.models import digits
from specforest.models.edm import EDMDenoiserVelocity


@pytest.fixture(scope="module")
def velocity() -> EDMDenoiserVelocity:
    return digits.load_velocity()


@pytest.fixture(scope="module")
def classifier() -> digits.DigitsClassifier:
    return digits.load_classifier()


@pytest.fixture(scope="module")
def real() -> tuple[torch.Tensor, torch.Tensor]:
    return digits.load_digits_data()


# -- weights ---------------------------------------------------------------------------


def test_manifest_matches_the_shipped_files():
    man = digits.manifest()
    for name in (digits.UNET_FILE, digits.CLASSIFIER_FILE):
        path = digits.WEIGHTS_DIR / name
        assert digits.sha256_file(path) == man[name]["sha256"]
        assert path.stat().st_size < 8 * 2**20


def test_checksum_mismatch_raises(tmp_path):
    src = digits.WEIGHTS_DIR / digits.UNET_FILE
    bad = tmp_path / digits.UNET_FILE
    data = bytearray(src.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit pattern in the last tensor's bytes
    bad.write_bytes(bytes(data))
    shutil.copy(digits.WEIGHTS_DIR / digits.MANIFEST, tmp_path / digits.MANIFEST)
    with pytest.raises(digits.ChecksumError, match="SHA-256"):
        digits.load_denoiser(bad)
    with pytest.raises(digits.ChecksumError):
        digits.load_denoiser(src, sha256="0" * 64)
    good = tmp_path / "copy.safetensors"
    shutil.copy(src, good)
    with pytest.raises(digits.ChecksumError, match="no SHA-256 recorded"):
        digits.load_denoiser(good)  # not listed in the manifest next to it
    digits.load_denoiser(good, sha256=digits.manifest()[digits.UNET_FILE]["sha256"])
    with pytest.raises(FileNotFoundError):
        digits.load_classifier(tmp_path / "missing.safetensors", sha256="0" * 64)


def test_classifier_recognizes_real_digits(classifier, real):
    x, y = real
    assert (classifier.predict(x) == y).float().mean() > 0.95
    assert classifier.embed(x[:5]).shape == (5, classifier.feature_dim)


def test_velocity_shapes_endpoints_and_labels(velocity):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1, 8, 8, generator=g)
    for s in (0.0, 1e-3, 0.5, 0.99, 1.0):
        v = velocity(x, torch.full((6,), s), class_labels=torch.arange(6))
        assert v.shape == x.shape and torch.isfinite(v).all()
    sig = torch.full((6,), 0.4)
    per_row = velocity(x, sig, class_labels=torch.full((6,), 3))
    torch.testing.assert_close(per_row, velocity(x, sig, class_labels=3))
    assert (velocity(x, sig, class_labels=None) - per_row).abs().max() > 1e-4  # the label matters


# -- exactness of speculative sampling on the real network -----------------------------


class AcceptEveryDraft(Coupling):
    """A WRONG rule: accepts the first child always (the draft chain, uncorrected)."""

    name = "accept-all"

    def select(self, s_hat, delta, valid, rng):
        P = s_hat.shape[0]
        return torch.ones(P, dtype=torch.bool), torch.zeros(P, dtype=torch.long)


N, T, CHURN = 400, 12, 0.6
ALPHA = 1e-4


def _run(velocity, tree, coupling, seed):
    x_T, labels = pixel_exp.initial_states(N, 7)  # the same labels for every sampler
    g = torch.Generator().manual_seed(seed)
    return specforest.sample(
        velocity,
        x_T,
        steps=T,
        churn=CHURN,
        tree=tree,
        coupling=coupling,
        generator=g,
        cond={"class_labels": labels},
        lazy=tree is not None,
    ).samples


def _statistics(real, samples) -> np.ndarray:
    """Scalar summaries of each sample: its projections on the real digits' top 4
    principal directions (fixed by the data, not by the samples), its mean square
    and its total variation (roughness, sensitive to a wrong noise level)."""
    x = real[0].reshape(len(real[0]), -1).double()
    mu = x.mean(0)
    _, _, vt = torch.linalg.svd(x - mu, full_matrices=False)
    s = samples.double()[:, 0]
    proj = (s.reshape(len(s), -1) - mu) @ vt[:4].T
    sq = s.square().mean((1, 2))
    tv = (s[:, 1:] - s[:, :-1]).abs().mean((1, 2)) + (s[:, :, 1:] - s[:, :, :-1]).abs().mean((1, 2))
    return torch.cat([proj, sq[:, None], tv[:, None]], 1).numpy()


def _min_p(a, b) -> float:
    """Smallest two-sample KS p-value over the statistics (compare with ALPHA / their number)."""
    return min(sps.ks_2samp(a[:, j], b[:, j]).pvalue for j in range(a.shape[1]))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # many small network calls: one thread is faster than two on a shared 2-core machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def standard_statistics(velocity, real):
    return _statistics(real, _run(velocity, None, "grs", seed=1))


@pytest.mark.parametrize(
    "tree,coupling",
    [(trees.uniform(2, 3), "grs"), pytest.param(trees.chain(6), "rmc", marks=pytest.mark.slow)],
    ids=["dgrs-2x3", "rmc-6"],
)
def test_speculative_has_the_standard_law(velocity, real, standard_statistics, tree, coupling):
    spec = _statistics(real, _run(velocity, tree, coupling, seed=2))
    assert _min_p(spec, standard_statistics) > ALPHA / spec.shape[1]  # Bonferroni


def test_the_same_check_rejects_an_unverified_draft(velocity, real, standard_statistics):
    """The same tree with the verification replaced by 'accept every draft' fails the check."""
    wrong = _statistics(real, _run(velocity, trees.uniform(2, 3), AcceptEveryDraft(), seed=2))
    assert _min_p(wrong, standard_statistics) < ALPHA / wrong.shape[1]


@pytest.fixture(scope="module")
def velocity_bf16():
    return digits.load_velocity(dtype=torch.bfloat16)


def test_a_bf16_network_keeps_its_dtype_and_the_sampler_its_precision(velocity_bf16):
    assert next(velocity_bf16.denoiser.net.parameters()).dtype == torch.bfloat16
    x_T, labels = pixel_exp.initial_states(4, 0)
    out = specforest.sample(
        velocity_bf16, x_T, steps=6, churn=0.5, tree=trees.uniform(2, 2), seed=0, cond={"class_labels": labels}
    )
    assert out.samples.dtype == torch.float32 and torch.isfinite(out.samples).all()


@pytest.mark.slow
def test_bf16_speculative_has_the_bf16_standard_law(velocity_bf16, real):
    """The same bf16 network through D-GRS and through the standard sampler: the same law;
    the unverified draft fails the same check."""
    standard = _statistics(real, _run(velocity_bf16, None, "grs", seed=1))
    spec = _statistics(real, _run(velocity_bf16, trees.uniform(2, 3), "grs", seed=2))
    assert _min_p(spec, standard) > ALPHA / spec.shape[1]
    wrong = _statistics(real, _run(velocity_bf16, trees.uniform(2, 3), AcceptEveryDraft(), seed=2))
    assert _min_p(wrong, standard) < ALPHA / wrong.shape[1]


# -- the experiment's library functions ----------------------------------------------------


def test_simulate_sizes_the_run_with_the_one_memory_estimator(velocity, classifier, monkeypatch):
    # the process's own memory taken out: it drifts from call to call
    monkeypatch.setattr(memory, "held_bytes", lambda device="cpu": 0)
    kw = dict(method="dgrs", K=2, L=2, samples=4, steps=6, seed=3, model=velocity, classifier=classifier)
    rec = pixel_exp.simulate(**kw).record
    assert velocity.row_bytes == digits.ROW_BYTES_FLOAT32  # the shipped model declares its measured figure
    est = memory.estimate(
        trajectories=4,
        state_numel=64,
        tree=trees.uniform(2, 2),
        steps=6,
        row_bytes=velocity.row_bytes,
        chunked=False,
        history=0,
        stages=1,
    )
    assert rec["max_rows"] == est.max_rows and rec["memory_peak_gb"] == est.total_bytes / 1e9
    # a limit that holds the states and 5 rows splits the calls into sub-batches of 5
    dyn = est.sampler_bytes + int(5.5 * est.row_bytes)
    limit = (est.fixed_bytes + dyn + memory.allocator_slack(dyn)) / 1e9
    assert pixel_exp.simulate(**kw, memory_gb=limit).record["max_rows"] == 5
    assert rec["budget"] == 6 and {"speedup_paper_sem", "steps_per_round", "rows_mean"} <= rec.keys()
    again = pixel_exp.simulate(**kw)
    assert {k: v for k, v in again.record.items() if not k.endswith("_seconds")} == {
        k: v for k, v in rec.items() if not k.endswith("_seconds")
    }


def test_speedup_is_over_the_chains_standard_calls(velocity, classifier):
    # heun at T = 5 on karras: 2 T - 1 = 9 standard calls, its last step the only one without noise; the
    # standard run's speedups are 1 in both accountings (not T / NFE = 5 / 9)
    chain = get_chain("heun", s_churn=1.0)
    kw = dict(samples=2, steps=5, model=velocity, classifier=classifier, chain=chain, churn=None)
    rec = pixel_exp.simulate(method="standard", K=0, L=0, options={"schedule": "karras"}, **kw).record
    assert rec["nfe_mean"] == rec["standard_calls"] == 9
    assert rec["speedup_mean"] == rec["speedup_paper_mean"] == 1 and rec["speedup_std"] == 0


def test_a_chain_of_half_steps_keeps_the_length_asked_for(velocity, classifier):
    # dpmpp_sde at T = 5 walks 9 half-steps: an RMC chain of 8 is drafted as asked, not cut to T = 5
    kw = dict(samples=1, steps=5, model=velocity, classifier=classifier, chain="dpmpp_sde", churn=None)
    rec = pixel_exp.simulate(method="rmc", K=1, L=8, options={"schedule": "karras"}, **kw).record
    assert rec["standard_calls"] == 9 and rec["tree_layers"].startswith("DraftTree(L=8, budget=8")


# -- CLI ---------------------------------------------------------------------------------

TINY = ["--samples", "4", "--steps", "6", "--no-progress", "--json"]
REQUIRED = {
    "method",
    "K",
    "L",
    "budget",
    "samples",
    "churn",
    "steps",
    "nfe_mean",
    "speedup_mean",
    "speedup_std",
    "speedup_sem",
    "accept_rate_per_depth",
    "delta_per_depth",
    "wall_seconds",
    "target_seconds",
    "classifier_accuracy",
}


def _invoke(cmd, *args):
    res = CliRunner().invoke(cmd, list(args), catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res


@pytest.mark.parametrize(
    "args,budget",
    [
        (["--method", "dgrs", "--K", "2", "--L", "2"], 6),
        (["--method", "rmc", "--L", "5", "--lazy"], 5),
        (["--method", "standard"], 0),
    ],
)
def test_cli_json(args, budget):
    rec = json.loads(_invoke(pixel, *TINY, *args).stdout)
    assert REQUIRED <= rec.keys()
    assert rec["budget"] == budget and rec["samples"] == 4 and rec["steps"] == 6
    assert 0.0 <= rec["classifier_accuracy"] <= 1.0 and rec["nfe_mean"] <= 6


def test_cli_dump_samples(tmp_path):
    path = tmp_path / "out.npz"
    rec = json.loads(_invoke(pixel, *TINY, "--seed", "3", "--dump-samples", str(path)).stdout)
    with np.load(path) as z:
        s, y = z["samples"], z["labels"]
        assert s.shape == (4, 1, 8, 8) and s.dtype == np.float32
        assert s.min() >= -1.0 and s.max() <= 1.0
        assert np.array_equal(y, pixel_exp.initial_states(4, 3)[1].numpy())
        assert json.loads(str(z["result"]))["seed"] == rec["seed"] == 3


def test_cli_rejects_bad_options():
    res = CliRunner().invoke(pixel, ["--churn", "0", "--no-progress"])
    assert res.exit_code != 0 and "churn" in res.output.lower()
    res = CliRunner().invoke(pixel, ["--method", "nope"])
    assert res.exit_code != 0


def test_cli_sweep_runs_the_new_couplings_as_methods(tmp_path):
    out = tmp_path / "sweep"
    res = _invoke(
        pixel,
        "sweep",
        "--out",
        str(out),
        "--trees",
        "2x2,3x1",
        "--churns",
        "0.5",
        "--samples",
        "3",
        "--steps",
        "6",
        "--no-progress",
        "--methods",
        "rank,antithetic",
    )
    recs = json.loads((out / "results.json").read_text())
    got = sorted((r["method"], r["K"]) for r in recs if r["method"] not in ("standard", "rmc"))
    assert got == [("antithetic", 2), ("rank", 2), ("rank", 3)]
    assert "antithetic" in res.output and "rank" in res.output


def test_cli_sweep_writes_results_and_figures(tmp_path):
    out = tmp_path / "sweep"
    _invoke(
        pixel,
        "sweep",
        "--out",
        str(out),
        "--trees",
        "2x2",
        "--churns",
        "0.5",
        "--samples",
        "3",
        "--steps",
        "6",
        "--no-progress",
    )
    recs = json.loads((out / "results.json").read_text())
    assert sorted(r["method"] for r in recs) == ["dgrs", "rmc", "standard"]
    assert {r["budget"] for r in recs if r["method"] != "standard"} == {6}
    for name in ("results.csv", "speedup_vs_budget.png", "samples_grid.png"):
        assert (out / name).stat().st_size > 0
    again = _invoke(
        pixel,
        "sweep",
        "--out",
        str(out),
        "--trees",
        "2x2",
        "--churns",
        "0.5",
        "--samples",
        "3",
        "--steps",
        "6",
        "--no-progress",
    )
    assert "skipped 3" in again.output and "ran 0" in again.output


def test_train_cli_hands_its_options_to_the_training_and_refuses_bad_ones(tmp_path, monkeypatch):
    """The command's options reach ``main_train`` as they were given, its defaults are the library's (the
    shipped weights' directory included), and a bad value is refused before any training starts."""
    from specforest.experiments import train_digits

    calls = []
    monkeypatch.setattr(train_digits, "main_train", lambda out, **kw: calls.append((out, kw)))
    args = ["--out", str(tmp_path / "o"), "--weights-dir", str(tmp_path / "w"), "--steps", "7"]
    _invoke(train, "digits", *args, "--max-minutes", "0.5", "--seed", "3", "--eval-samples", "0", "--no-progress")
    ((out, kw),) = calls
    assert out == str(tmp_path / "o") and kw["weights_dir"] == tmp_path / "w" and kw["progress"] is False
    assert kw["config"] == train_digits.TrainConfig(steps=7, max_minutes=0.5, seed=3, eval_samples=0)
    _invoke(train, "digits")
    assert calls[1][1]["weights_dir"] == digits.WEIGHTS_DIR and calls[1][1]["config"] == train_digits.TrainConfig()
    for bad in (["--steps", "0"], ["--max-minutes", "0"], ["--seed", "-1"], ["--threads", "0"]):
        res = CliRunner().invoke(train, ["digits", *bad])
        assert res.exit_code == 2 and bad[0] in res.output, res.output
    assert len(calls) == 2


def test_pixel_cli_planned_and_adaptive_trees_and_new_methods():
    from click.testing import CliRunner

    from specforest.cli import main

    for extra in (
        ["--tree", "optimal", "--budget", "6"],
        ["--tree", "adaptive", "--budget", "6"],
        ["--method", "rank", "--draft", "auto"],
        ["--method", "antithetic", "--K", "2", "--L", "2"],
    ):
        args = ["pixel", "--samples", "4", "--steps", "8", "--lazy", "--json", "--no-progress", *extra]
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 0, (extra, res.output)
        rec = json.loads(res.output)
        assert rec["nfe_mean"] <= 8
    res = CliRunner().invoke(main, ["pixel", "--tree", "optimal", "--samples", "4", "--steps", "8", "--no-progress"])
    assert res.exit_code != 0 and "budget" in res.output
    for method, title in (("rank", "rank coupling, K=2 L=2"), ("antithetic", "antithetic pairs, K=2 L=2")):
        args = [
            "pixel",
            "--samples",
            "2",
            "--steps",
            "6",
            "--lazy",
            "--no-progress",
            "--method",
            method,
            "--K",
            "2",
            "--L",
            "2",
        ]
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 0 and title in res.output, res.output
