"""The natural-image models through the command line (issue 46): ``pixel``, ``generate pixel`` and ``tune``
take ``--model natural32`` (``natural64``), sample unconditional ``3 x 32 x 32`` images with every option a
digits run takes, record the model, refuse ``--draft learned`` where the model declares no draft network,
refuse a ``--resume`` or a ``--tune`` file of another model naming both, and ``tune --drafts all`` searches
the ``cached`` draft wherever the model keeps its deep features.

The slow tier adds a real ``tune`` run and an exactness battery on ``natural32``: the tree runs of the
``velocity``, ``x0`` and ``cached`` drafts against the standard sampler, per-sample statistics compared by a
two-sample test, and a deliberately wrong chain that the same test rejects.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import invoke, refused

import specforest
from specforest import latency, streams, trees
from specforest.chains import get_chain
from specforest.experiments.pixel.models import PIXEL_MODELS, PixelModel
from specforest.latency import CostCurve, Tuned
from specforest.latency.tuner import candidates
from specforest.models import natural
from specforest.proposals import available_drafts, drafts_serving
from specforest.testing import Z_TOL

QUIET = ["--no-progress", "--threads", 1]
TINY = ["--steps", 4, *QUIET]
NATURAL32 = "natural32 3x32x32 (EDM U-Net)"


def _undeclared(monkeypatch) -> None:
    """Every pixel model loads without a declared draft network (``learned_draft``), whatever the shipped
    loaders declare: the refusal reads the object, not a list of names."""
    load = PixelModel.load

    def without(self, device="cpu"):
        v = load(self, device)
        for obj in (v, getattr(v, "denoiser", None)):
            if obj is not None:
                obj.__dict__.pop("learned_draft", None)
        return v

    monkeypatch.setattr(PixelModel, "load", without)


def _declared(monkeypatch) -> None:
    """natural32 loads declaring a draft network: its own denoiser (a perfect draft of the right shape)."""
    load = PixelModel.load

    def with_draft(self, device="cpu"):
        v = load(self, device)
        if self.name == "natural32":
            v.denoiser.learned_draft = lambda: natural.load_denoiser("natural32")
        return v

    monkeypatch.setattr(PixelModel, "load", with_draft)


# -- pixel ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--method", "dgrs", "--K", 2, "--L", 2],
        ["--method", "rmc", "--L", 3, "--draft", "cached"],
        ["--method", "rank", "--K", 2, "--L", 2, "--draft", "x0", "--lazy"],
        ["--method", "rmc", "--L", 2, "--chain", "euler_ancestral", "--eta", 0.7, "--schedule", "karras"],
        ["--method", "standard"],
    ],
    ids=["dgrs", "rmc-cached", "rank-x0-lazy", "euler_ancestral-karras", "standard"],
)
def test_pixel_samples_natural32_unconditionally_and_records_the_model(tmp_path, args):
    dump = tmp_path / "s.npz"
    res = invoke("pixel", "--model", "natural32", "--samples", 2, *TINY, *args, "--json", "--dump-samples", dump)
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)
    assert rec["model"] == NATURAL32 and rec["classifier_accuracy"] is None
    with np.load(dump) as f:
        assert f["samples"].shape == (2, 3, 32, 32) and "labels" not in f.files
        assert json.loads(str(f["result"]))["model"] == NATURAL32
    # the text report says what was sampled and reports no accuracy
    res = invoke("pixel", "--model", "natural32", "--samples", 1, *TINY, "--method", "standard")
    assert res.exit_code == 0 and "images of natural32" in res.output and "classifier" not in res.output


def test_pixel_digits_records_as_before():
    res = invoke("pixel", "--samples", 2, *TINY, "--method", "standard", "--json")
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)
    assert rec["model"] == "digits 1x8x8 (EDM U-Net)" and isinstance(rec["classifier_accuracy"], float)


def test_learned_draft_is_refused_where_the_model_declares_no_draft_network(tmp_path, monkeypatch):
    _undeclared(monkeypatch)
    named = ("--draft learned", "natural32 model declares no draft network")
    refused(invoke("pixel", "--model", "natural32", *TINY, "--draft", "learned"), *named, codes=(1,))
    out = tmp_path / "g.npz"
    res = invoke("generate", "pixel", "--model", "natural32", "--count", 1, *TINY, "--draft", "learned", "--out", out)
    refused(res, *named, codes=(1,))
    res = invoke("tune", "--model", "natural32", "--drafts", "x0,learned", "--out", tmp_path / "t.json", *QUIET)
    refused(res, "--drafts learned", "natural32 model declares no draft network", codes=(1,))
    assert not any(tmp_path.iterdir())  # nothing written


def test_learned_draft_runs_where_the_model_declares_its_network(monkeypatch):
    _declared(monkeypatch)
    args = ["pixel", "--model", "natural32", "--samples", 1, *TINY, "--method", "rmc", "--L", 2]
    res = invoke(*args, "--draft", "learned", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["draft"] == "learned"


# -- generate pixel ---------------------------------------------------------------------------------


def _job(tmp_path, name: str, *args) -> "tuple[dict, dict]":
    out = tmp_path / f"{name}.npz"
    res = invoke("generate", "pixel", "--count", 3, *TINY, *args, "--out", out)
    assert res.exit_code == 0, res.output
    with np.load(out) as f:
        arrays = {k: f[k] for k in f.files}
    return arrays, json.loads(out.with_suffix(".json").read_text())["options"]


def test_generate_natural32_records_the_model_and_each_sample_is_the_same_whatever_the_batch(tmp_path):
    tree = ["--method", "rmc", "--L", 2, "--draft", "cached", "--model", "natural32"]
    one, opts = _job(tmp_path, "one", *tree, "--batch", 1)
    assert opts["model_options"] == {"model": "natural32"}
    assert one["samples"].shape == (3, 3, 32, 32) and "labels" not in one
    three, _ = _job(tmp_path, "three", *tree, "--batch", 3)
    # (a convolution's float32 sums depend on the batch by a few ulps: the same sample, to rounding)
    np.testing.assert_allclose(one["samples"], three["samples"], atol=1e-5, rtol=0)
    # a digits job records what one made before --model existed: no model options, its labels
    digits, opts = _job(tmp_path, "digits", "--method", "standard")
    assert opts["model_options"] == {} and digits["samples"].shape == (3, 1, 8, 8) and "labels" in digits


@pytest.mark.parametrize("first,then", [("natural32", "digits"), ("digits", "natural64")])
def test_a_resume_with_another_model_is_refused_naming_both(tmp_path, first, then):
    out = tmp_path / "g.npz"
    base = ["generate", "pixel", "--count", 1, *TINY, "--method", "standard", "--out", out]
    assert invoke(*base, "--model", first).exit_code == 0
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    refused(
        invoke(*base, "--model", then, "--resume"), f"samples the {first} model", f"for the {then} model", codes=(1,)
    )
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before
    # a job that stopped before its end (its options in the parts folder) is refused the same way
    (tmp_path / "g.json").unlink()
    out.unlink()
    parts = tmp_path / "g.npz.parts"
    parts.mkdir()
    opts = {"model": "pixel", "count": 1, "seed": 0, "sampler": {"method": "standard", "steps": 4}}
    opts["model_options"] = {} if first == "digits" else {"model": first}
    (parts / "options.json").write_text(json.dumps(opts))
    refused(
        invoke(*base, "--model", then, "--resume"), f"samples the {first} model", f"for the {then} model", codes=(1,)
    )


# -- tune -------------------------------------------------------------------------------------------


def _fake_tuner(seen: dict):
    """A tuner that records what the command gave it and returns a chain of 2 with the x0 draft."""

    def tune(model, x, **kw):
        seen.update(kw, model=model, x=x)
        return Tuned(
            label="RMC chain B=2",
            tree=trees.chain(2),
            coupling="rmc",
            verify="internal",
            draft="x0",
            batch=kw["batch"],
            steps=kw["steps"],
            predicted_seconds_per_image=1.0,
            predicted_speedup=1.0,
            standard_seconds_per_image=1.0,
            predicted_calls=3.0,
            curve=CostCurve((1, 4), (1.0, 2.0)),
            churn=kw["churn"],
        )

    return tune


def test_tune_natural32_writes_a_file_that_runs_natural32_only(tmp_path, monkeypatch):
    seen: dict = {}
    monkeypatch.setattr(latency, "tune", _fake_tuner(seen))
    path = tmp_path / "t.json"
    res = invoke("tune", "--model", "natural32", "--steps", 4, "--out", path, *QUIET)
    assert res.exit_code == 0, res.output
    # natural32's own states, unconditional, at pixel's churn
    assert tuple(seen["x"].shape[1:]) == (3, 32, 32) and seen["cond"] is None and seen["churn"] == 0.3
    assert json.loads(path.read_text())["tuned_for"]["model"] == "natural32"
    res = invoke("pixel", "--model", "natural32", "--tune", path, "--json", "--no-progress")
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)
    assert (rec["model"], rec["method"], rec["steps"], rec["samples"]) == (NATURAL32, "rmc", 4, 1)
    # without --model the file's model runs; another model is refused naming both
    res = invoke("pixel", "--tune", path, "--json", "--no-progress")
    assert res.exit_code == 0 and json.loads(res.stdout)["model"] == NATURAL32, res.output
    refused(invoke("pixel", "--model", "digits", "--tune", path), "--model digits here, natural32 in the file")
    res = invoke("generate", "pixel", "--model", "digits", "--count", 1, "--out", tmp_path / "g.npz", "--tune", path)
    refused(res, "--model digits here, natural32 in the file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


@pytest.mark.parametrize("model", ["digits", "natural32"])
def test_tune_drafts_all_searches_cached_where_the_model_keeps_its_features(tmp_path, monkeypatch, model):
    seen: dict = {}
    monkeypatch.setattr(latency, "tune", _fake_tuner(seen))
    res = invoke("tune", "--model", model, "--steps", 8, "--out", tmp_path / "t.json", *QUIET)
    assert res.exit_code == 0, res.output
    assert "cached" in seen["drafts"]
    # and the tuner's candidates hold it, on chains (it remembers the last chain round)
    cands = candidates(lambda depth, k: 0.5, 8, 8, seen["drafts"])
    cached = [c for c in cands if c.config.tree is not None and c.config.draft == "cached"]
    assert cached and all(c.config.tree.budget == c.config.tree.L for c in cached)


def test_tune_drafts_all_leaves_cached_out_for_a_model_without_features(tmp_path, monkeypatch):
    from specforest.cli import tune as cli_tune

    seen: dict = {}
    monkeypatch.setattr(latency, "tune", _fake_tuner(seen))

    def featureless(name, n, device="cpu"):
        v = natural.load_velocity(name)
        x = streams.randn(0, torch.arange(n), (3, 32, 32))
        return (lambda y, s, **cond: v(y, s)), x, None

    monkeypatch.setattr(cli_tune, "tune_target", featureless)
    res = invoke("tune", "--model", "natural32", "--steps", 8, "--out", tmp_path / "t.json", *QUIET)
    assert res.exit_code == 0, res.output
    assert "cached" not in seen["drafts"] and "x0" in seen["drafts"]
    assert "cached" in drafts_serving(list(available_drafts()), (3, 32, 32), natural.load_velocity("natural32"))


def test_every_pixel_model_is_a_choice_of_each_command():
    from specforest.cli import main

    def choices(*path):
        cmd = main
        for name in path:
            cmd = cmd.commands[name]
        return next(p for p in cmd.params if p.name == "model").type.choices

    for path in (("pixel",), ("generate", "pixel")):
        assert list(choices(*path)) == list(PIXEL_MODELS)
    assert set(PIXEL_MODELS) <= set(choices("tune"))


@pytest.mark.slow
def test_a_real_tune_of_natural32_runs_in_pixel(tmp_path, monkeypatch):
    from specforest.latency import measure

    # the cost curve to 64 rows (extended by its last slope): what is checked is the file, not the timing
    monkeypatch.setattr(measure, "DEFAULT_SIZES", (1, 2, 4, 8, 16, 32, 64))
    path = tmp_path / "t.json"
    res = invoke(
        "tune", "--model", "natural32", "--steps", 4, "--budget-max", 2, "--drafts", "x0,cached", "--out", path
    )
    assert res.exit_code == 0, res.output
    data = json.loads(path.read_text())
    assert data["tuned_for"]["model"] == "natural32"
    assert {c["label"].split("draft ")[-1] for c in data["candidates"] if "draft" in c["label"]} == {"x0", "cached"}
    res = invoke("pixel", "--model", "natural32", "--tune", path, "--json", "--no-progress")
    assert res.exit_code == 0 and json.loads(res.stdout)["model"] == NATURAL32, res.output


# -- exactness on natural32 (slow) ------------------------------------------------------------------

_N = 200
"""Samples per run: the standard run's and each tree run's. At 200 the two-sample z of a statistic detects
a shift of ``4.5 * sqrt(2 / 200) = 0.45`` of its standard deviation; eta 0.5 for 1 moves the neighbouring
pixels' squared difference by about ten standard errors."""


def _statistics(samples: torch.Tensor) -> torch.Tensor:
    """Per sample ``(n, 7)``: the mean and standard deviation of its pixels, the mean squared difference of
    horizontally neighbouring pixels (what the chain's noise scale moves first) and four fixed random
    unit projections."""
    s = samples.double().reshape(len(samples), -1)
    u = torch.randn(4, s.shape[1], generator=torch.Generator().manual_seed(123), dtype=torch.float64)
    u = u / u.norm(dim=1, keepdim=True)
    img = s.reshape(len(samples), 3, 32, 32)
    hf = ((img[..., 1:] - img[..., :-1]) ** 2).mean((1, 2, 3))
    return torch.cat([s.mean(1, keepdim=True), s.std(1, keepdim=True), hf[:, None], s @ u.T], 1)


def _two_sample_z(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Welch's z of each statistic's mean, ``(a (n, k), b (m, k)) -> (k,)``."""
    return (a.mean(0) - b.mean(0)) / torch.sqrt(a.var(0) / len(a) + b.var(0) / len(b))


def _run(seed: int, *, eta: float = 1.0, **tree) -> torch.Tensor:
    """``_N`` samples of euler_ancestral on 5 Karras steps (natural32), their statistics."""
    v = PIXEL_MODELS["natural32"].load()
    x = streams.randn(seed, torch.arange(_N), (3, 32, 32))
    chain = get_chain("euler_ancestral", eta=eta)
    out = specforest.sample(v, x, steps=5, schedule="karras", chain=chain, seed=seed, **tree)
    return _statistics(out.samples)


@pytest.fixture(scope="module")
def standard_natural32() -> torch.Tensor:
    return _run(1)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["velocity", "x0", "cached", "corrected", "learned"])
def test_natural32_tree_runs_keep_the_standard_law(standard_natural32, draft):
    """A chain of 3 (RMC) with each draft: every statistic within ``Z_TOL`` of the standard run's."""
    z = _two_sample_z(_run(10 + len(draft), tree=trees.chain(3), coupling="rmc", draft=draft), standard_natural32)
    assert float(z.abs().max()) <= Z_TOL, z


@pytest.mark.slow
def test_the_same_test_rejects_a_wrong_chain(standard_natural32):
    """The tree run of eta 0.5 (a chain with half the ancestral noise) against the standard eta 1."""
    z = _two_sample_z(_run(30, eta=0.5, tree=trees.chain(3), coupling="rmc", draft="x0"), standard_natural32)
    assert float(z.abs().max()) > Z_TOL, z
