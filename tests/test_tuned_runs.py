"""Tuned settings match their run: ``sample(**tuned)`` checks it, every ``--tune`` command reconciles
with its file, the tuner takes every option of ``sample``, and outputs keep the suffix of what they hold."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from click.testing import CliRunner
from helpers import invoke

import specforest
from specforest import latency, streams, trees
from specforest.chains import get_chain
from specforest.cli import main
from specforest.latency import CostCurve, Tuned, TunedFor, measure
from specforest.models import GaussianMixture
from specforest.options import RUN_INPUTS


@pytest.fixture(scope="module")
def gmm():
    return GaussianMixture.paper(dim=4, components=2, seed=0)


def _tuned(tree=None, coupling="grs", *, steps=10, batch=2, churn=0.3, verify="internal", prefetch="nearest") -> Tuned:
    return Tuned(
        label="test",
        tree=tree,
        coupling=coupling,
        verify=verify,
        draft="x0",
        batch=batch,
        steps=steps,
        predicted_seconds_per_image=1.0,
        predicted_speedup=1.0,
        standard_seconds_per_image=1.0,
        predicted_calls=5.0,
        curve=CostCurve((1,), (1.0,)),
        churn=churn,
        prefetch=prefetch,
    )


# -- sample(model, x, **tuned) -------------------------------------------------------------------


def test_a_tuned_configuration_is_refused_on_another_chain_or_chain_setting(gmm):
    """tuned_for records the chain: an em configuration run on ddpm, or one tuned at eta 0.7 run at
    0.5, is refused naming the chain; the chain it was tuned for runs."""
    x = streams.randn(0, torch.arange(2), (4,))
    sigmas = specforest.chains.karras_linear_grid(10, 0.03, 20.0)
    em = _tuned(trees.chain(3), "rmc")
    with pytest.raises(ValueError, match="chain ddpm \\(tuned for em\\)"):
        specforest.sample(gmm, x, sigmas=sigmas, chain="ddpm", seed=0, **em)
    ea = Tuned(**{**em.__dict__, "churn": None, "chain": "euler_ancestral", "chain_params": {"eta": 0.7}})
    assert ea.tuned_for.chain == "euler_ancestral" and ea.tuned_for.chain_params[0][0] == "eta"
    specforest.sample(gmm, x, sigmas=sigmas, seed=0, **ea)  # its own chain, carried by **tuned
    with pytest.raises(ValueError, match="chain euler_ancestral's eta 0.5 \\(tuned for 0.7\\)"):
        specforest.options.check_tuned_for(
            ea.tuned_for, steps=None, sigmas=sigmas, churn=None, batch=2,
            chain=get_chain("euler_ancestral", eta=0.5),
        )  # fmt: skip


def test_sample_with_a_tuned_configuration_takes_its_steps_and_refuses_another_run(gmm):
    tuned = _tuned(trees.chain(3), "rmc", prefetch="parent")
    x = streams.randn(0, torch.arange(3), (4,))
    out = specforest.sample(gmm, x[:2], churn=0.3, seed=0, **tuned)
    assert out.stats.steps == 10 and out.config["prefetch"] == "parent" and out.config["coupling"] == "rmc"
    # the same run as the configuration alone at the tuned steps, bit for bit
    same = specforest.sample(gmm, x[:2], steps=10, churn=0.3, seed=0, **tuned.options())
    assert torch.equal(out.samples, same.samples)
    with pytest.raises(ValueError) as err:
        specforest.sample(gmm, x, steps=12, churn=0.5, seed=0, **tuned)
    msg = str(err.value)
    assert (
        "steps 12 (tuned for 10)" in msg and "churn 0.5 (tuned for 0.3)" in msg and "3 rows of x (tuned for 2)" in msg
    )
    with pytest.raises(ValueError, match=r"steps 12 \(tuned for 10\)"):
        specforest.sample(gmm, x[:2], sigmas=specforest.flow_match_grid(12), churn=0.3, seed=0, **tuned)
    # the configuration alone is not checked
    assert specforest.sample(gmm, x, steps=12, churn=0.5, seed=0, **tuned.options()).stats.steps == 12
    with pytest.raises(TypeError, match="tuned_for must be"):
        specforest.sample(gmm, x, steps=12, churn=0.5, tuned_for={"steps": 12})


def test_a_file_written_before_churn_and_prefetch_were_kept_reads_and_checks_steps_and_batch(gmm):
    data = _tuned(trees.chain(2), "rmc").to_json()
    del data["churn"], data["prefetch"], data["chain"], data["chain_params"]
    old = Tuned.from_json(json.loads(json.dumps(data)))
    assert old.churn is None and old.prefetch == "nearest" and old.tuned_for == TunedFor(10, 2, None, chain="em")
    assert old.chain == "em" and old.chain_params == {} and "chain" not in old
    x = streams.randn(0, torch.arange(2), (4,))
    assert specforest.sample(gmm, x, churn=0.7, seed=0, **old).stats.steps == 10  # churn unknown: unchecked
    with pytest.raises(ValueError, match=r"1 rows of x \(tuned for 2\)"):
        specforest.sample(gmm, x[:1], churn=0.7, seed=0, **old)


def test_generate_with_a_tuned_configuration_fills_its_slots_and_refuses_others(gmm):
    tuned = _tuned(trees.chain(2), "rmc", batch=3)
    make_x = lambda i: streams.randn(0, i, (4,))  # noqa: E731
    gen = specforest.generate(gmm, count=5, make_x=make_x, seed=0, churn=0.3, **tuned)
    assert sum(len(f.index) for f in gen) == 5 and gen.stats.slots == 3
    with pytest.raises(ValueError, match=r"4 slots \(tuned for 3\)"):
        specforest.generate(gmm, count=5, make_x=make_x, seed=0, churn=0.3, batch=4, **tuned)


# -- the tuner takes every option of sample ------------------------------------------------------


# every option (a field of SamplerOptions) and every other keyword of sample (a run's input)
_SIGNATURE = [*specforest.SamplerOptions.names(), *RUN_INPUTS]


def _every_call(key, value):
    return lambda tuned, calls, seen: all(c.get(key) == value for c in calls)


def _tree_runs(calls):
    """The timing and race runs of trees (the calibration chains are lazy)."""
    return [c for c in calls if c.get("tree") is not None and not c.get("lazy")]


# option -> (value, check(tuned, sample calls, what the model saw) or the error it raises)
OPTION_CASES = {
    "steps": (9, lambda t, calls, seen: t.steps == 9 and all(c["steps"] <= 9 for c in calls if "steps" in c)),
    "churn": (0.4, lambda t, calls, seen: t.churn == 0.4 and all(c["churn"] == 0.4 for c in calls)),
    "cond": ({"scale": torch.full((6, 1), 1.5)}, lambda t, calls, seen: seen and all(s == 1.5 for s in seen)),
    "seed": (5, lambda t, calls, seen: calls[0]["seed"] == 5),
    "progress": (True, lambda t, calls, seen: isinstance(t, Tuned)),
    "verify": (
        "drafted",
        lambda t, calls, seen: (
            t.verify == "drafted" and _tree_runs(calls) and all(c["verify"] == "drafted" for c in _tree_runs(calls))
        ),
    ),
    "draft": ("x0", lambda t, calls, seen: t.draft == "x0" and all(c["draft"] == "x0" for c in calls if "draft" in c)),
    "coupling": (
        "rmc",
        lambda t, calls, seen: _tree_runs(calls) and all(c["coupling"] == "rmc" for c in _tree_runs(calls)),
    ),
    "grid": ("uniform", _every_call("grid", "uniform")),
    "shift": (2.0, _every_call("shift", 2.0)),
    "schedule": ("karras", _every_call("schedule", "karras")),
    # (a range without a schedule is refused before any run: the case with one is the schedule's)
    "sigma_min": (0.01, "sigma_min sets the range of a schedule"),
    "sigma_max": (20.0, "sigma_max sets the range of a schedule"),
    "prefetch": (
        "parent",
        lambda t, calls, seen: (
            t.prefetch == "parent" and t["prefetch"] == "parent" and _every_call("prefetch", "parent")(t, calls, seen)
        ),
    ),
    "max_rows": (4, lambda t, calls, seen: _every_call("max_rows", 4)(t, calls, seen) and max(seen) <= 4),
    "model_kwargs": ({"scale": 1.5}, lambda t, calls, seen: seen and all(s == 1.5 for s in seen)),
    "pad_rows": ([4, 8, 64], lambda t, calls, seen: set(seen) <= {4, 8, 64} and t.curve.sizes == (4, 8, 64)),
    "tree": (trees.chain(2), "tree"),
    "chain": (
        "euler_ancestral",
        lambda t, calls, seen: (
            t.chain == "euler_ancestral"
            and t.churn is None
            and t["chain"] == get_chain("euler_ancestral")
            and all(c["churn"] is None and c["chain"] == get_chain("euler_ancestral") for c in calls)
        ),
    ),
    "noise": (lambda n: None, "noise"),
    "sigmas": (torch.linspace(1, 0, 9), "sigmas"),
    "generator": (torch.Generator(), "generator"),
    "sample_index": (torch.arange(2), "sample_index"),
    "callback": (lambda d: None, "callback"),
    "process_group": (object(), "process_group"),
    "tuned_for": (TunedFor(8, 2, 0.3), "tuned_for"),
    "lazy": (True, "lazy"),
    "record_deltas": (True, "record_deltas"),
}
"""What the model sees is the rows of each call (``max_rows``, ``pad_rows``) or its ``scale`` (``cond``,
``model_kwargs``, which the model requires)."""


def test_every_option_of_sample_has_a_tuner_case():
    # a new option of sample without a case here (and a treatment in latency.SAMPLE_OPTIONS) fails
    keywords = inspect.signature(specforest.sample).parameters.values()
    assert [p.name for p in keywords if p.kind is inspect.Parameter.KEYWORD_ONLY] == list(RUN_INPUTS)
    assert set(OPTION_CASES) == set(_SIGNATURE)
    assert set(latency.SAMPLE_OPTIONS) == set(_SIGNATURE)


@pytest.mark.parametrize("name", _SIGNATURE)
def test_the_tuner_takes_every_option_of_sample(gmm, monkeypatch, name):
    value, check = OPTION_CASES[name]
    seen: list = []
    needs_scale = name in ("cond", "model_kwargs")

    def model(x, sigma, scale=None):
        if needs_scale:
            if scale is None:
                raise TypeError("model called without its scale")
            seen.append(float(torch.as_tensor(scale).reshape(-1)[0]))
        else:
            seen.append(x.shape[0])
        return gmm(x, sigma)

    calls: list = []
    real = measure.sample

    def recorded(m, x, **kw):
        calls.append(kw)
        return real(m, x, **kw)

    monkeypatch.setattr(measure, "sample", recorded)
    monkeypatch.setattr(measure, "TIMING_RUNS", 1)
    x = streams.randn(0, torch.arange(6), (4,))
    kw = dict(steps=8, churn=0.3, batch=2, budget_max=6 if name == "verify" else 3, calibration_trajectories=4)
    kw.update(race=0, curve=CostCurve((1, 4096), (1e-4, 1e-1)), drafts=("velocity",))
    if name in ("model_kwargs", "pad_rows"):
        kw.pop("curve")  # measured, with the option
    if name == "draft":
        kw.pop("drafts")
    if name == "progress":
        kw.pop("progress", None)
    kw[name] = value
    if name == "chain":
        kw.pop("churn")  # the em chain's
    if isinstance(check, str):
        with pytest.raises(ValueError, match=check):
            latency.tune(model, x, **kw)
        assert not calls
        return
    tuned = latency.tune(model, x, **kw)
    assert check(tuned, calls, seen), (name, calls[:2], seen[:8])


def test_the_tuner_refuses_what_is_not_an_option_and_constraints_outside_its_search(gmm):
    x = streams.randn(0, torch.arange(4), (4,))
    kw = dict(steps=8, churn=0.3, batch=1, curve=CostCurve((1,), (1.0,)), race=0)
    with pytest.raises(TypeError, match="stepz"):
        latency.tune(gmm, x, stepz=8, **kw)
    with pytest.raises(ValueError, match="coupling must be 'grs'"):
        latency.tune(gmm, x, coupling="rank", **kw)
    with pytest.raises(ValueError, match="verify must be one of"):
        latency.tune(gmm, x, verify="all", **kw)
    with pytest.raises(ValueError, match="not one of drafts"):
        latency.tune(gmm, x, draft="x0", drafts=("velocity",), **kw)
    with pytest.raises(TypeError, match="registered draft name"):
        latency.tune(gmm, x, draft=gmm, **kw)
    # False is what the timed runs do: accepted
    assert isinstance(latency.tune(gmm, x, lazy=False, record_deltas=False, budget_max=2, **kw), Tuned)
    pred = latency.Calibrator.calibrate(gmm, x, steps=8, churn=0.3, batch=1, curve=CostCurve((1,), (1.0,)))
    with pytest.raises(ValueError, match="prefetch: the predictor was calibrated with other values"):
        latency.tune(gmm, x, predictor=pred, prefetch="parent", **kw)
    with pytest.raises(ValueError, match="a predictor prices every configuration"):
        latency.Calibrator.calibrate(gmm, x, steps=8, churn=0.3, verify="drafted", curve=CostCurve((1,), (1.0,)))
    with pytest.raises(TypeError, match="predictor must be a Calibrator"):
        latency.tune(gmm, x, predictor=pred.predictor, **kw)


def test_a_padded_call_is_priced_at_its_padded_rows():
    from specforest.latency import Calibration, Predictor

    curve = CostCurve((4, 8, 64), (1.0, 2.0, 16.0))
    padded = Calibration(steps=8, churn=0.3, batch=1, curve=curve, pad_rows=[4, 8, 64], max_rows=8)
    pred = Predictor(padded)
    # 3 rows pad to 4; 9 rows split at max_rows 8: one call of 8 and one of 1 padded to 4
    assert pred.call_seconds(3) == 1.0 and pred.call_seconds(9) == 2.0 + 1.0
    assert Predictor(Calibration(steps=8, churn=0.3, batch=1, curve=curve)).call_seconds(6) == curve(6)


# -- the CLI -----------------------------------------------------------------------------------


def _file(tmp_path, tuned: Tuned, **made_for) -> str:
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(dict(tuned.to_json(), tuned_for=made_for)))
    return str(path)


def test_tune_defaults_to_the_models_own_command(monkeypatch, tmp_path):
    from specforest.cli import common as cli_common
    from specforest.cli import pixel as cli_pixel
    from specforest.cli import sd3 as cli_sd3

    seen = {}

    def fake_tune(model, x, **kw):
        seen.update(kw)
        raise ValueError("stop here")

    monkeypatch.setattr(latency, "tune", fake_tune)
    res = invoke("tune", "--model", "gmm", "--dim", 2, "--no-progress", "--out", tmp_path / "t.json")
    assert "stop here" in res.output
    assert (seen["steps"], seen["churn"]) == (30, 0.1)
    # the same numbers as the commands' own defaults, read from their options
    defaults = lambda cmd: {p.name: p.default for p in cmd.params}  # noqa: E731
    assert (defaults(cli_pixel.pixel)["steps"], defaults(cli_pixel.pixel)["churn"]) == (100, 0.3)
    assert cli_common.MODEL_DEFAULTS["digits"] == {"steps": 100, "churn": 0.3}
    assert {k: defaults(cli_sd3.sd3)[k] for k in ("steps", "churn")} == cli_common.MODEL_DEFAULTS["sd3"]
    assert {k: defaults(main.commands["gmm"])[k] for k in ("steps", "churn")} == cli_common.MODEL_DEFAULTS["gmm"]
    gen = main.commands["generate"].commands
    assert {k: defaults(gen["pixel"])[k] for k in ("steps", "churn")} == cli_common.MODEL_DEFAULTS["digits"]


def test_tune_for_digits_tunes_at_t_100_churn_03(monkeypatch, tmp_path):
    seen = {}

    def fake_tune(model, x, **kw):
        seen.update(kw)
        raise ValueError("stop here")

    monkeypatch.setattr(latency, "tune", fake_tune)
    res = invoke("tune", "--model", "digits", "--no-progress", "--out", tmp_path / "t.json")
    assert "stop here" in res.output and (seen["steps"], seen["churn"]) == (100, 0.3)


def test_a_run_with_tune_takes_the_files_steps_churn_and_batch(tmp_path):
    path = _file(tmp_path, _tuned(trees.chain(3), "rmc", steps=8, batch=3, churn=0.5), model="gmm", threads=1)
    res = invoke("gmm", "--dim", 4, "--json", "--no-progress", "--tune", path)
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)
    assert (rec["steps"], rec["churn"], rec["trajectories"], rec["method"]) == (8, 0.5, 3, "rmc")
    # given and equal: fine
    res = invoke("gmm", "--dim", 4, "--steps", 8, "--churn", 0.5, "--trajectories", 3, "--json", "--tune", path)
    assert res.exit_code == 0, res.output


def test_a_run_that_differs_from_its_tune_file_lists_every_difference(tmp_path):
    made_for = dict(model="digits", device="cuda", threads=1)
    path = _file(tmp_path, _tuned(trees.chain(3), "rmc", steps=8, batch=3, churn=0.5), **made_for)
    res = invoke("gmm", "--dim", 4, "--steps", 9, "--churn", 0.3, "--trajectories", 2, "--threads", 2, "--tune", path)
    assert res.exit_code == 2 and "Traceback" not in res.output
    out = " ".join(res.output.split())
    for part in (
        "--model gmm here, digits in the file",
        "--steps 9 here, 8 in the file",
        "--churn 0.3 here, 0.5 in the file",
        "--trajectories 2 here, 3 in the file",
        "device cpu here",
        "--threads 2 here, 1 in the file",
    ):
        assert part in out, (part, out)


@pytest.mark.parametrize(
    "args,named",
    [
        (["--method", "dgrs", "--K", "3"], ["--method", "--K"]),
        (["--L", "4", "--tree", "optimal", "--budget", "6"], ["--L", "--tree", "--budget"]),
        (
            ["--draft", "velocity", "--verify", "internal", "--prefetch", "nearest"],
            ["--draft", "--verify", "--prefetch"],
        ),
    ],
)
def test_sampler_options_beside_tune_are_refused_even_at_their_defaults(tmp_path, args, named):
    for cmd, model in ((["pixel"], "digits"), (["gmm", "--dim", "4"], "gmm")):
        path = _file(tmp_path, _tuned(trees.chain(3), "rmc", steps=8, batch=1), model=model)
        res = invoke(*cmd, *args, "--tune", path)
        assert res.exit_code == 2, res.output
        out = " ".join(res.output.split())
        assert "cannot be given with --tune" in out and all(n in out for n in named), out


def test_generate_runs_a_tuned_tree_and_refuses_another_batch(tmp_path):
    path = _file(tmp_path, _tuned(trees.widths([2, 1]), "grs", steps=8, batch=2), model="gmm", device="cpu")
    out = tmp_path / "g.npz"
    res = invoke("generate", "gmm", "--dim", 4, "--count", 3, "--out", out, "--no-progress", "--tune", path)
    assert res.exit_code == 0, res.output
    meta = json.loads(out.with_suffix(".json").read_text())["options"]["sampler"]
    assert meta["tree"] == trees.widths([2, 1]).parent.tolist() and meta["steps"] == 8 and meta["draft"] == "x0"
    res = invoke("generate", "gmm", "--dim", 4, "--count", 3, "--batch", 5, "--out", tmp_path / "h.npz", "--tune", path)
    assert res.exit_code == 2 and "--batch 5 here, 2 in the file" in res.output
    res = invoke("generate", "gmm", "--count", 3, "--K", 3, "--out", tmp_path / "k.npz", "--tune", path)
    assert res.exit_code == 2 and "--K cannot be given with --tune" in " ".join(res.output.split())


@pytest.mark.parametrize(
    "args,suffix",
    [
        (["generate", "pixel", "--count", "1", "--out", "samples.txt"], ".npz"),
        (["generate", "gmm", "--count", "1", "--out", "samples"], ".npz"),
        (["gmm", "--dim", "2", "--dump-samples", "s.txt"], ".npz"),
        (["pixel", "--dump-samples", "s.json"], ".npz"),
        (["tune", "--model", "gmm", "--out", "tuned.txt"], ".json"),
        (["gmm", "drafts", "--out", "d.pdf"], ".png"),
        (["couplings", "plot", "--out", "a.jpg"], ".png"),
    ],
)
def test_an_output_whose_suffix_is_not_what_is_written_is_refused_before_any_work(tmp_path, monkeypatch, args, suffix):
    monkeypatch.chdir(tmp_path)
    res = invoke(*args)
    assert res.exit_code == 2 and f"must end in {suffix}" in res.output and "--" in res.output
    assert not any(tmp_path.iterdir())  # nothing written, no job started


def test_an_sd3_job_is_a_folder_not_an_archive(tmp_path):
    res = invoke(
        "generate", "sd3", "--count", 1, "--out", tmp_path / "x.npz", "--model", tmp_path, "--prompts", __file__
    )
    assert res.exit_code == 2 and "must be a folder" in res.output


def _written_tuned(tree, coupling: str, verify: str) -> Tuned:
    """A tuned configuration as ``specforest tune`` writes one (draft x0), for the --tune tests."""
    return Tuned(
        label="test",
        tree=tree,
        coupling=coupling,
        verify=verify,
        draft="x0",
        batch=1,
        steps=10,
        predicted_seconds_per_image=1.0,
        predicted_speedup=1.0,
        standard_seconds_per_image=1.0,
        predicted_calls=5.0,
        curve=CostCurve((1,), (1.0,)),
    )


@pytest.mark.parametrize(
    "tree,coupling,method",
    [(trees.uniform(2, 2), "grs", "dgrs"), (trees.chain(5), "rmc", "rmc"), (None, "grs", "standard")],
)
def test_gmm_and_pixel_run_a_tuned_file(tmp_path, tree, coupling, method):

    from specforest.cli import main

    tuned = _written_tuned(tree, coupling, "drafted")
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(dict(tuned.to_json(), tuned_for={"model": "gmm"})))
    # the file's steps (10) and batch (1 trajectory) where none are given
    args = ["gmm", "--dim", "8", "--json", "--no-progress", "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        res = CliRunner().invoke(main, [*args, "--tune", str(path)])
        assert res.exit_code == 0, res.output
        rec = json.loads(res.stdout)
        assert rec["method"] == method and rec["steps"] == 10 and rec["trajectories"] == 1
        if tree is not None:
            assert rec["verify"] == "drafted" and rec["draft"] == "x0"
            assert rec["budget"] == tree.budget
        res = CliRunner().invoke(main, ["pixel", "--tune", str(path)])
        assert res.exit_code != 0 and "--model digits here, gmm in the file" in res.output
    finally:
        torch.set_num_threads(threads)


def test_pixel_runs_a_tuned_tree(tmp_path):

    from specforest.cli import main

    tuned = _written_tuned(trees.widths([2, 1]), "grs", "internal")
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(dict(tuned.to_json(), tuned_for={"model": "digits"})))
    threads = torch.get_num_threads()
    try:
        res = CliRunner().invoke(
            main,
            [
                "pixel",
                "--json",
                "--no-progress",
                "--threads",
                "1",
                "--tune",
                str(path),
            ],
        )
    finally:
        torch.set_num_threads(threads)
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)
    assert rec["method"] == "dgrs" and rec["tree"] == "custom" and rec["budget"] == 4 and rec["draft"] == "x0"
    assert rec["steps"] == 10 and rec["samples"] == 1


def test_a_ve_chain_is_tuned_on_its_schedule_from_the_first_check(gmm, monkeypatch):
    # the check that a tree can pay (before the cost curve) built the chain on the named grid, which starts at
    # t = 1, so a VE chain given its schedule was refused there; every run is on the schedule
    calls: list = []
    real = measure.sample
    monkeypatch.setattr(measure, "sample", lambda m, x, **kw: (calls.append(kw), real(m, x, **kw))[1])
    monkeypatch.setattr(measure, "TIMING_RUNS", 1)
    x = streams.randn(0, torch.arange(4), (4,))
    kw = dict(steps=8, batch=2, budget_max=3, calibration_trajectories=4, race=0, drafts=("velocity",))
    tuned = latency.tune(
        gmm, x, chain=get_chain("euler", s_churn=5.0), schedule="karras", curve=CostCurve((1, 4096), (1e-4, 1e-1)), **kw
    )
    assert isinstance(tuned, Tuned) and calls and all(c.get("schedule") == "karras" for c in calls)
    with pytest.raises(ValueError, match="not defined on this grid at step 0"):
        latency.tune(gmm, x, chain=get_chain("euler", s_churn=5.0), curve=CostCurve((1,), (1.0,)), **kw)


def test_a_chain_of_half_steps_is_calibrated_and_predicted_on_its_own_steps(gmm, monkeypatch):
    # dpmpp_sde walks 2 T - 1 half-steps on a grid of T: the calibration counted the grid's T, so its
    # stochastic steps (2 T - 2) were refused as more than the steps and tune stopped before any choice
    monkeypatch.setattr(measure, "TIMING_RUNS", 1)
    x = streams.randn(0, torch.arange(4), (4,))
    tuned = latency.tune(
        gmm,
        x,
        steps=6,
        chain=get_chain("dpmpp_sde"),
        schedule="karras",
        batch=2,
        budget_max=8,
        calibration_trajectories=4,
        race=0,
        drafts=("velocity",),
        curve=CostCurve((1, 4096), (1e-4, 1e-1)),
    )
    assert isinstance(tuned, Tuned) and tuned.steps == 6
    # chains as long as the 11 half-steps are candidates (the grid's 6 would cap them)
    assert "RMC chain B=8, draft velocity" in [c["label"] for c in tuned.candidates]
