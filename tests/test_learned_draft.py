"""The digits model's learned draft: its shipped weights, its training command, its law on the real
network, what it saves, and its refusals."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from scipy import stats as sps

import specforest
from specforest import trees
from specforest.cli import main
from specforest.cli.train import train
from specforest.couplings import Coupling
from specforest.experiments import pixel as pixel_exp
from specforest.models import digits
from specforest.models.unet import UNetConfig
from specforest.proposals import LearnedDraft, drafts_serving


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def velocity():
    return digits.load_velocity()


def test_the_shipped_draft_is_checked_small_and_made_from_the_shipped_target():
    man = digits.manifest()
    entry = man[digits.DRAFT_FILE]
    assert digits.sha256_file(digits.WEIGHTS_DIR / digits.DRAFT_FILE) == entry["sha256"]
    # distilled from the target that ships beside it
    assert entry["target_sha256"] == man[digits.UNET_FILE]["sha256"]
    # at least 5x fewer multiply-adds per call than the target, counted from the stored architecture
    cfg = UNetConfig.from_dict(entry["unet_config"])
    assert cfg == digits.DRAFT_CONFIG
    assert digits.multiply_adds(UNetConfig()) >= 5 * digits.multiply_adds(cfg)
    assert entry["multiply_adds"] == digits.multiply_adds(cfg)
    draft = digits.load_draft_velocity()
    x = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    v = draft(x, torch.full((3,), 0.5), class_labels=torch.tensor([1, 2, 3]))
    assert v.shape == x.shape and torch.isfinite(v).all()


def test_a_corrupted_draft_file_is_refused(tmp_path):
    src = digits.WEIGHTS_DIR / digits.DRAFT_FILE
    data = bytearray(src.read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / digits.DRAFT_FILE).write_bytes(bytes(data))
    shutil.copy(digits.WEIGHTS_DIR / digits.MANIFEST, tmp_path / digits.MANIFEST)
    with pytest.raises(digits.ChecksumError, match="does not match"):
        digits.load_draft_velocity(tmp_path / digits.DRAFT_FILE)


def test_train_digits_draft_writes_its_file_and_merges_its_manifest_entry(tmp_path):
    shutil.copy(digits.WEIGHTS_DIR / digits.MANIFEST, tmp_path / digits.MANIFEST)
    res = CliRunner().invoke(
        train,
        ["digits-draft", "--weights-dir", str(tmp_path), "--steps", "3", "--batch", "8", "--no-progress"],
    )
    assert res.exit_code == 0, res.output
    man = json.loads((tmp_path / digits.MANIFEST).read_text())
    # the other files' entries stay; the new file is the one recorded
    assert man[digits.UNET_FILE] == digits.manifest()[digits.UNET_FILE]
    assert man[digits.DRAFT_FILE]["draft"]["steps_done"] == 3
    assert digits.sha256_file(tmp_path / digits.DRAFT_FILE) == man[digits.DRAFT_FILE]["sha256"]
    v = digits.load_draft_velocity(tmp_path / digits.DRAFT_FILE)
    assert v(torch.zeros(2, 1, 8, 8), torch.full((2,), 0.3)).shape == (2, 1, 8, 8)
    for bad in (["--steps", "0"], ["--batch", "0"], ["--max-minutes", "0"], ["--seed", "-1"]):
        out = CliRunner().invoke(train, ["digits-draft", "--weights-dir", str(tmp_path), *bad])
        assert out.exit_code == 2 and bad[0] in out.output, out.output


def _statistics(samples: torch.Tensor) -> np.ndarray:
    s = samples.double()[:, 0]
    sq = s.square().mean((1, 2))
    tv = (s[:, 1:] - s[:, :-1]).abs().mean((1, 2)) + (s[:, :, 1:] - s[:, :, :-1]).abs().mean((1, 2))
    return torch.stack([s.mean((1, 2)), sq, tv, s[:, 3:5, 3:5].mean((1, 2))], 1).numpy()


class AcceptEveryDraft(Coupling):
    """A WRONG rule: accepts the first child always (the draft chain, uncorrected)."""

    name = "accept-all"

    def select(self, s_hat, delta, valid, rng):
        P = s_hat.shape[0]
        return torch.ones(P, dtype=torch.bool), torch.zeros(P, dtype=torch.long)


@pytest.mark.slow
def test_the_learned_draft_keeps_the_real_networks_law_and_the_same_check_sees_a_wrong_one(velocity):
    """Two-sample KS on four statistics of 1500 digits at T = 20: the RMC chain with the learned
    draft against the standard sampler passes; the same chain accepting every draft uncorrected
    fails the same check (p-values of 1e-88 to 0.2 seen, against 0.57-0.94 for the exact one)."""
    n, steps = 1500, 20
    x, labels = pixel_exp.initial_states(n, 3)
    kw = dict(steps=steps, churn=0.3, cond={"class_labels": labels})
    ref = _statistics(specforest.sample(velocity, x, seed=1, **kw).samples)
    alpha = 1e-3 / ref.shape[1]

    def min_p(samples):
        return min(sps.ks_2samp(_statistics(samples)[:, j], ref[:, j]).pvalue for j in range(ref.shape[1]))

    spec = specforest.sample(velocity, x, seed=2, tree=trees.chain(6), coupling="rmc", draft="learned", **kw)
    assert spec.config["draft"] == "learned" and spec.stats.draft_calls > 0
    assert min_p(spec.samples) > alpha
    wrong = specforest.sample(
        velocity, x, seed=2, tree=trees.chain(6), coupling=AcceptEveryDraft(), draft="learned", **kw
    )
    assert min_p(wrong.samples) < alpha


def test_the_learned_draft_cuts_target_calls_below_secant_on_digits(velocity):
    """Not a speed test: on 24 digits (T = 100, RMC chain of 14) the learned draft, anchored at the
    same-step memory, makes fewer target calls than the x0 kind and no more than secant's (a draft
    network anchored wrongly, or not trained, would not)."""
    x, labels = pixel_exp.initial_states(24, 0)
    kw = dict(steps=100, churn=0.3, tree=trees.chain(14), coupling="rmc", cond={"class_labels": labels}, seed=0)
    nfe = {
        d: specforest.sample(velocity, x, draft=d, **kw).stats.nfe.double().mean() for d in ("x0", "secant", "learned")
    }
    assert nfe["learned"] < 0.85 * nfe["x0"]
    assert nfe["learned"] <= nfe["secant"]


def test_the_learned_draft_is_refused_on_the_mixture_and_left_out_of_its_tuning():
    res = CliRunner().invoke(main, ["gmm", "--draft", "learned", "--steps", "6", "--no-progress", "--json"])
    assert res.exit_code != 0
    assert "--draft learned is the digits model's distilled U-Net" in res.output and "(500,)" in res.output
    assert "learned" not in drafts_serving(["x0", "learned", "secant"], (500,))
    assert drafts_serving(["x0", "learned"], (1, 8, 8)) == ["x0", "learned"]
    assert drafts_serving(["x0", "learned"], None) == ["x0"]


def test_pixel_cli_runs_the_learned_draft():
    res = CliRunner().invoke(
        main,
        ["pixel", "--method", "rmc", "--K", "1", "--L", "6", "--draft", "learned", "--samples", "3"]
        + ["--steps", "20", "--json", "--no-progress"],
    )
    assert res.exit_code == 0, res.output
    rec = json.loads(res.output.strip().splitlines()[-1])
    assert rec["draft"] == "learned" and rec["speedup_mean"] > 1


def test_a_learned_draft_of_the_wrong_shape_is_refused_naming_it():
    draft = LearnedDraft(lambda x, s: x, shape=(4,), label="a test network")
    with pytest.raises(
        ValueError, match=r"draft='learned' is a test network: it serves states of shape \(4,\), got \(3,\)"
    ):
        specforest.sample(lambda x, s: x, torch.zeros(2, 3), steps=5, churn=0.3, tree=trees.chain(2), draft=draft)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("steps", 0, "steps must be"),
        ("batch", 0, "batch must be"),
        ("warmup", 0, "warmup must be"),
        ("grid_steps", 2, "grid_steps must be"),
        ("lr", 0.0, "lr must be a finite number > 0"),
        ("ema_decay", 1.5, r"ema_decay must be a finite number in \[0.0, 1.0\]"),
        ("max_minutes", 0.0, "max_minutes must be a finite number > 0"),
        ("churn", 0.0, "churn must be"),
    ],
)
def test_the_draft_training_refuses_a_field_out_of_range_naming_it(field, value, match):
    from specforest.experiments.train_digits_draft import DraftTrainConfig

    with pytest.raises(ValueError, match=match):
        DraftTrainConfig(**{field: value})
