"""Warm-up: the row counts it calls the network with are those a run calls it with, and it changes no sample."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import specforest
from specforest import streams, trees
from specforest.cli import main
from specforest.latency import CostCurve, Tuned
from specforest.models import GaussianMixture
from specforest.trees import TreeTables
from specforest.warmup import network_rows, pad_rows_for, warm_up

DIM, T = 8, 16


class Recorder:
    """The mixture's velocity, keeping the row count of every call."""

    def __init__(self) -> None:
        self.gmm = GaussianMixture.paper(dim=DIM, components=3, seed=0)
        self.rows: set = set()

    def __call__(self, x, sigma, **cond):
        self.rows.add(x.shape[0])
        return self.gmm(x, sigma)


def _x(n: int) -> torch.Tensor:
    return streams.randn(0, torch.arange(n), (DIM,))


def _run_rows(model: Recorder, n: int, seeds, **opts) -> set:
    """The row counts the network saw over runs of ``n`` trajectories with these seeds."""
    seen = set()
    for seed in seeds:
        model.rows = set()
        specforest.sample(model, _x(n), seed=seed, **opts)
        seen |= model.rows
    return seen


CASES = {
    "chain": (1, dict(tree=trees.chain(6), coupling="rmc")),
    "tree": (1, dict(tree=trees.uniform(2, 3))),
    "tree-drafted": (1, dict(tree=trees.uniform(2, 3), verify="drafted", draft="x0")),
    "standard-chunked": (5, dict(max_rows=2)),
    "batch-padded": (3, dict(tree=trees.chain(4), coupling="rmc", pad_rows="pow2")),
    "lazy": (3, dict(tree=trees.uniform(2, 2), lazy=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_counts_warmed_are_the_counts_runs_call_the_network_with(case):
    n, opts = CASES[case]
    opts = dict(steps=T, churn=0.3, **opts)
    model = Recorder()
    warm_up(model, _x(n), **opts)
    warmed = model.rows
    assert warmed == set(network_rows(n, **opts))
    # which counts one run meets depends on its acceptances; 24 runs meet every one (the standard
    # sampler accepts nothing: one run meets all its counts)
    runs = 24 if opts.get("tree") is not None else 1
    assert _run_rows(model, n, range(runs), **opts) == warmed


def test_a_batch_of_trajectories_on_a_tree_calls_only_counts_that_were_warmed():
    opts = dict(steps=T, churn=0.3, tree=trees.uniform(2, 2))
    model = Recorder()
    warm_up(model, _x(4), **opts)
    warmed = model.rows
    seen = _run_rows(model, 4, range(6), **opts)
    assert seen <= warmed
    # a warm-up of the full tree's calls alone (every trajectory speculating at full depth, or all
    # taking one row) misses the calls of the truncated trees and of the trajectories that finished
    naive = {4, 4 * int(TreeTables.of(opts["tree"], "internal", torch.device("cpu")).rows_at[2])}
    assert not seen <= naive


def test_the_counts_of_continuous_batching_are_warmed():
    """``generate``'s standard sampler runs full batches of slots and then the rest."""
    model = Recorder()
    opts = dict(steps=T, churn=0.3)
    warm_up(model, _x(3), batch=[3, 1], **opts)
    warmed = model.rows
    model.rows = set()
    make_x = lambda idx: streams.randn(0, idx, (DIM,))  # noqa: E731
    for _ in specforest.generate(model, count=7, make_x=make_x, seed=0, batch=3, **opts):
        pass
    assert model.rows == warmed == {1, 3}


def test_padding_keeps_the_counts_of_a_large_batch_few():
    opts = dict(steps=T, churn=0.3, tree=trees.chain(14), coupling="rmc")
    assert pad_rows_for(1, **opts) is None  # one trajectory: 14 counts, nothing to pad
    exact = network_rows(64, **opts)
    assert len(exact) == 64 * 14
    pad = pad_rows_for(64, **opts)
    padded = network_rows(64, pad_rows=pad, **opts)
    assert len(padded) <= 64 and padded[-1] == exact[-1]
    # a padded call holds at most 2 ** (1 / 4) times its rows
    assert all(next(p for p in padded if p >= m) <= 2**0.25 * m + 1 for m in exact)
    # under a memory limit no padded call exceeds it
    assert max(network_rows(64, pad_rows=pad_rows_for(64, max_rows=100, **opts), max_rows=100, **opts)) == 100
    with pytest.raises(ValueError, match="max_shapes"):
        warm_up(Recorder(), _x(64), **opts)


def test_warm_up_draws_no_random_number_and_changes_no_sample():
    opts = dict(steps=T, churn=0.3, tree=trees.uniform(2, 2), seed=3)
    cold = specforest.sample(Recorder(), _x(4), **opts).samples
    model = Recorder()
    state = torch.random.get_rng_state()
    seconds = warm_up(model, _x(4), **opts)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert isinstance(seconds, float) and seconds >= 0
    warm = specforest.sample(model, _x(4), **opts).samples
    assert torch.equal(cold, warm)


def test_warm_up_passes_the_runs_conditioning_and_model_kwargs():
    seen = []

    def model(x, sigma, *, label, scale):
        assert label.shape == (x.shape[0],) and scale == 2.0
        seen.append(label.tolist())
        return -x

    labels = torch.tensor([5, 7])
    warm_up(model, _x(2), cond={"label": labels}, model_kwargs={"scale": 2.0}, steps=T, churn=0.3)
    assert seen == [[5, 7]]


def test_tree_parallel_warms_this_process_share(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    opts = dict(steps=T, churn=0.3, tree=trees.chain(3), coupling="rmc")
    alone = network_rows(1, **opts)
    assert network_rows(1, process_group=object(), **opts) == tuple(sorted({-(-m // 2) for m in alone}))


def test_bad_input_gets_clear_errors():
    m, x, opts = Recorder(), _x(2), dict(steps=T, churn=0.3)
    with pytest.raises(TypeError, match="model must be callable"):
        warm_up(None, x, **opts)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        warm_up(m, [[0.0]], **opts)
    with pytest.raises(ValueError, match="x must have shape"):
        warm_up(m, torch.zeros(3), **opts)
    with pytest.raises(TypeError, match="floating-point"):
        warm_up(m, torch.zeros(2, DIM, dtype=torch.long), **opts)
    with pytest.raises(ValueError, match="NaN or inf"):
        warm_up(m, torch.full((2, DIM), float("nan")), **opts)
    with pytest.raises(TypeError, match="churn is required"):
        warm_up(m, x, steps=T)
    with pytest.raises(TypeError, match="unexpected option.*budget"):
        warm_up(m, x, budget=3, **opts)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        warm_up(m, x, steps=0, churn=0.3)
    with pytest.raises(ValueError, match="pad_rows"):
        warm_up(m, x, pad_rows=[0], **opts)
    with pytest.raises(ValueError, match="repeats"):
        warm_up(m, x, repeats=0, **opts)
    with pytest.raises(ValueError, match="max_shapes"):
        warm_up(m, x, max_shapes=0, **opts)
    with pytest.raises(ValueError, match="batch"):
        warm_up(m, x, batch=[], **opts)
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        network_rows(0, **opts)
    with pytest.raises(ValueError, match=r"cond\['label'\]"):
        warm_up(m, x, cond={"label": torch.zeros(3)}, **opts)
    with pytest.raises(TypeError, match="model_kwargs"):
        warm_up(m, x, model_kwargs=[1], **opts)
    from specforest.planning import AdaptiveTree

    with pytest.raises(ValueError, match="adaptive tree"):
        network_rows(1, tree=AdaptiveTree(budget=6), **opts)
    # the options of a sample call pass as they are
    assert warm_up(m, x, seed=0, progress=False, **opts) >= 0


def _tuned_file(tmp_path, model: str, tree, coupling: str, steps: int = 10, batch: int = 1) -> str:
    """A file as ``specforest tune --model model --steps steps`` writes one (draft x0)."""
    tuned = Tuned(
        label="test",
        tree=tree,
        coupling=coupling,
        verify="internal",
        draft="x0",
        batch=batch,
        steps=steps,
        predicted_seconds_per_image=1.0,
        predicted_speedup=1.0,
        standard_seconds_per_image=1.0,
        predicted_calls=5.0,
        curve=CostCurve((1,), (1.0,)),
    )
    path = tmp_path / f"{model}.json"
    path.write_text(json.dumps(dict(tuned.to_json(), tuned_for={"model": model})))
    return str(path)


def _invoke(args: list) -> CliRunner:
    threads = torch.get_num_threads()
    try:
        res = CliRunner().invoke(main, args)
    finally:
        torch.set_num_threads(threads)
    assert res.exit_code == 0, res.output
    return res


def test_gmm_and_pixel_with_tune_report_the_warm_up_and_keep_their_samples(tmp_path):
    gmm = ["gmm", "--dim", "8", "--steps", "10", "--trajectories", "3", "--json", "--no-progress", "--threads", "1"]
    tuned = _tuned_file(tmp_path, "gmm", trees.chain(4), "rmc", batch=3)
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    warm = json.loads(_invoke([*gmm, "--tune", tuned, "--dump-samples", str(a)]).stdout)
    same = ["--method", "rmc", "--L", "4", "--draft", "x0", "--verify", "internal"]
    cold = json.loads(_invoke([*gmm, *same, "--dump-samples", str(b)]).stdout)
    assert warm["warmup_seconds"] > 0 and cold["warmup_seconds"] == 0.0 and "wall_seconds" in warm
    with np.load(a) as za, np.load(b) as zb:
        assert np.array_equal(za["samples"], zb["samples"])
    pixel = ["pixel", "--steps", "10", "--samples", "1", "--json", "--no-progress", "--threads", "1"]
    tuned = _tuned_file(tmp_path, "digits", trees.widths([2, 1]), "grs")
    rec = json.loads(_invoke([*pixel, "--tune", tuned]).stdout)
    assert rec["warmup_seconds"] > 0 and rec["tree"] == "custom"
    assert json.loads(_invoke(pixel).stdout)["warmup_seconds"] == 0.0


@pytest.mark.slow
def test_pixel_samples_are_the_same_with_and_without_warm_up():
    from specforest.experiments import pixel

    opts = dict(method="dgrs", tree=trees.widths([2, 1]), samples=2, steps=10, draft="x0")
    cold, warm = pixel.simulate(**opts), pixel.simulate(warmup=True, **opts)
    assert torch.equal(cold.samples, warm.samples) and warm.record["warmup_seconds"] > 0


@pytest.mark.parametrize("model,tree,coupling", [("gmm", trees.uniform(2, 2), "grs"), ("pixel", trees.chain(3), "rmc")])
def test_generate_with_tune_runs_the_tuned_tree_and_reports_the_warm_up(tmp_path, model, tree, coupling):
    args = ["generate", model, "--steps", "10", "--count", "3", "--batch", "2", "--no-progress", "--threads", "1"]
    if model == "gmm":
        args += ["--dim", "8"]
    tuned = _tuned_file(tmp_path, "digits" if model == "pixel" else model, tree, coupling, batch=2)
    out = tmp_path / "out.npz"
    _invoke([*args, "--out", str(out), "--tune", tuned])
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["warmup_seconds"] > 0 and meta["per_process"][0]["warmup_seconds"] >= 0
    sampler = meta["options"]["sampler"]
    if coupling == "rmc":  # a chain is the rmc method's
        assert sampler["method"] == "rmc" and sampler["L"] == tree.budget and "tree" not in sampler
    else:
        assert sampler["tree"] == tree.parent.tolist()
    plain = tmp_path / "plain.npz"
    _invoke([*args, "--out", str(plain)])
    assert json.loads(plain.with_suffix(".json").read_text())["warmup_seconds"] == 0.0


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    pytest.importorskip("diffusers")
    from test_diffusers_sd3 import build_tiny_pipeline

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield build_tiny_pipeline(tmp_path_factory.mktemp("tiny_sd3"))
    finally:
        torch.set_num_threads(threads)


def test_sd3_warm_up_keeps_the_latents_and_the_sd3_command_reports_it(pipe, tmp_path):
    from specforest import diffusers as sd
    from specforest.cli.sd3 import sd3 as sd3_command

    kw = dict(num_inference_steps=6, churn=0.8, tree=trees.chain(3), coupling="rmc", height=8, width=8)
    kw.update(progress=False, max_sequence_length=8, output_type="latent")
    cold = sd.sample(pipe, "a photo of a cat", generator=torch.Generator().manual_seed(0), **kw)
    warm = sd.sample(pipe, "a photo of a cat", generator=torch.Generator().manual_seed(0), warmup=True, **kw)
    assert torch.equal(cold.latents, warm.latents)
    assert cold.warmup_seconds == 0.0 and warm.warmup_seconds > 0 and warm.config["pad_rows"] is None

    model = tmp_path / "tiny-sd3"
    pipe.save_pretrained(str(model))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\na red car on the street\na green tree\n")
    tuned = _tuned_file(tmp_path, "sd3", trees.chain(3), "rmc", steps=6, batch=2)
    out = tmp_path / "out"
    args = ["--model", str(model), "--prompts", str(prompts), "--K-values", "2", "--steps", "6", "--height", "8"]
    args += ["--width", "8", "--max-sequence-length", "8", "--dtype", "float32", "--batch-size", "2"]
    args += ["--out", str(out), "--device", "cpu", "--no-progress", "--threads", "1", "--tune", tuned]
    threads = torch.get_num_threads()
    try:
        res = CliRunner().invoke(sd3_command, args)
    finally:
        torch.set_num_threads(threads)
    assert res.exit_code == 0, res.output
    recs = {r["method"]: r for r in json.loads((out / "results.json").read_text())}
    assert recs["tuned"]["warmup_seconds"] > 0 and recs["standard"]["warmup_seconds"] == 0.0
    assert "warm-up" in res.output
