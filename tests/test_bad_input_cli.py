"""Bad input on the command line and in ``generate``/``tune`` (issue 40, items 1, 2, 4 and 12): each is
refused with a clear error naming the option or field and what it accepts, before any work and before
anything is written.

Every command here that could start work has its work replaced (the ``no_work`` fixture of
``conftest.py``) by one that raises: a run that reaches it was not refused in time.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import invoke, never_called, refused

import specforest
from specforest import latency, streams, trees
from specforest.experiments import generate as gen_exp
from specforest.latency import CostCurve, Tuned
from specforest.models import GaussianMixture

GAUSS = GaussianMixture(torch.tensor([[2.0, -1.0, 0.5]], dtype=torch.float64), torch.tensor([0.3]))
TINY_GMM = ["gmm", "--dim", "2", "--steps", "4", "--trajectories", "2", "--no-progress"]


def _tuned(tree=None, coupling="grs", **over) -> Tuned:
    fields = dict(
        label="test",
        tree=tree,
        coupling=coupling,
        verify="internal",
        draft="x0",
        batch=2,
        steps=8,
        predicted_seconds_per_image=1.0,
        predicted_speedup=1.0,
        standard_seconds_per_image=1.0,
        predicted_calls=5.0,
        curve=CostCurve((1, 4), (1.0, 2.0)),
        churn=0.3,
        prefetch="nearest",
    )
    fields.update(over)
    return Tuned(**fields)


def _tune_file(tmp_path: Path, data: dict, **made_for) -> Path:
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(dict(data, tuned_for={"model": "gmm", **made_for})))
    return path


# -- item 1: --count and generate(count=...) ----------------------------------------------------------


@pytest.fixture
def shards_unread(monkeypatch):
    """Reading the shards (which comes after the options are written) raises: a job that gets there
    with a count it cannot hold would otherwise list every index in memory."""
    monkeypatch.setattr(gen_exp, "done_indices", never_called)


def test_generate_refuses_a_count_it_cannot_hold_and_writes_nothing(tmp_path, shards_unread):
    out = tmp_path / "gh.npz"
    args = ["generate", "gmm", "--dim", 2, "--steps", 4, "--count", 10**10, "--out", out, "--no-progress"]
    msg = refused(invoke(*args), "--count", "[1, ")
    assert "memory" in msg
    assert not Path(str(out) + ".parts").exists() and not any(tmp_path.iterdir())
    # beyond a sample index (int64): the same refusal, never an empty "Error: "
    args[args.index(10**10)] = 2**64
    refused(invoke(*args), "--count", "[1, ")
    assert not any(tmp_path.iterdir())


def test_run_job_refuses_a_count_it_cannot_hold_before_writing(tmp_path, shards_unread):
    sampler = dict(method="standard", K=1, L=1, steps=4, churn=0.5, grid="flow_match")
    sampler.update(prefetch="nearest", verify="internal", draft="velocity")
    spec = gen_exp.JobSpec("gmm", 10**10, 0, sampler, {"dim": 2, "components": 1, "mixture_seed": 0})
    with pytest.raises(ValueError, match=r"count must be an int in \[1, \d+\]"):
        gen_exp.run_job(spec, tmp_path / "g.npz")
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="count must be an int in"):
        gen_exp.JobSpec("gmm", 2**63, 0, sampler, {"dim": 2, "components": 1, "mixture_seed": 0})


def test_a_refusal_after_the_model_is_loaded_still_writes_nothing(tmp_path):
    # the memory check of the slots came after PATH.parts/options.json: the next run said "exists; pass --resume"
    out = tmp_path / "x.npz"
    res = invoke("generate", "gmm", "--dim", 2, "--steps", 4, "--count", 2, "--memory-gb", 1e-3, "--out", out)
    refused(res, "memory limit", codes=(1,))
    assert not any(tmp_path.iterdir())


def test_library_generate_streams_a_huge_count_and_refuses_one_beyond_int64():
    opts = dict(make_x=lambda i: streams.randn(0, i, (3,), dtype=torch.float64), seed=0, steps=3, churn=0.5)
    # 10**12 indices would be 8 TB as a tensor: the slots take them as they go
    first = next(iter(specforest.generate(GAUSS, count=10**12, batch=2, **opts)))
    assert sorted(first.index.tolist()) == [0, 1]
    with pytest.raises(ValueError, match=r"count must be an int >= 0 and <= 2\*\*63 - 1"):
        specforest.generate(GAUSS, count=2**63, **opts)


# -- item 2: every field of a tuned file ---------------------------------------------------------------

BAD_TUNED_FIELDS = [
    ("coupling", "bogus", "coupling must be one of"),
    ("coupling", 3, "coupling must be one of"),
    ("draft", "bogus", "draft must be one of"),
    ("verify", "all", "verify must be one of"),
    ("prefetch", "child", "prefetch must be one of"),
    ("tree", [0, 0], "tree"),
    ("tree", "chain", "tree"),
    ("label", 3, "label"),
    ("batch", 0, "batch"),
    ("batch", 2.5, "batch"),
    ("steps", 0, "steps"),
    ("steps", "8", "steps"),
    ("churn", 1.5, "churn"),
    ("churn", "0.3", "churn"),
    ("predicted_seconds_per_image", -1.0, "predicted_seconds_per_image"),
    ("predicted_speedup", "fast", "predicted_speedup"),
    ("standard_seconds_per_image", math.nan, "standard_seconds_per_image"),
    ("predicted_calls", -2.0, "predicted_calls"),
    ("measured_speedup", "x", "measured_speedup"),
    ("cost_curve", [1, 2], "cost_curve"),
    ("cost_curve", {"sizes": [4, 1], "seconds": [1.0, 2.0]}, "cost_curve"),
    ("cost_curve", {"sizes": [1, 4], "seconds": [1.0]}, "cost_curve"),
    ("candidates", "none", "candidates"),
    ("candidates", [3], "candidates"),
    ("prefech", "parent", "prefech"),  # a misspelt field read as its default before
    ("chain", "nope", "chain"),
    ("chain", 3, "chain"),
    ("chain", "ddim", "churn"),  # a churn with another chain than em
    ("chain_params", [1], "chain_params"),
    ("chain_params", {"eta": 1.0}, "eta"),  # not a parameter of the em chain
    ("chain_params", {"churn": 0.5}, "churn"),  # the em chain's, disagreeing with churn
]


@pytest.mark.parametrize("field,value,named", BAD_TUNED_FIELDS)
def test_every_field_of_a_tuned_file_is_checked_by_name(field, value, named):
    data = _tuned(trees.uniform(2, 2)).to_json()
    data[field] = value
    with pytest.raises((ValueError, TypeError)) as err:
        Tuned.from_json(data)
    assert named in str(err.value), str(err.value)


def test_a_tuned_file_missing_a_field_or_not_an_object_is_refused_by_name():
    data = _tuned().to_json()
    del data["coupling"]
    with pytest.raises(ValueError, match="coupling"):
        Tuned.from_json(data)
    with pytest.raises(TypeError, match="a JSON object"):
        Tuned.from_json([1, 2])
    # a file written before churn and prefetch were kept still reads
    old = _tuned().to_json()
    del old["churn"], old["prefetch"]
    assert Tuned.from_json(old).prefetch == "nearest"


def test_a_tune_file_with_an_unknown_coupling_runs_nothing(tmp_path, no_work):
    # it ran dgrs on the file's tree
    path = _tune_file(tmp_path, dict(_tuned(trees.uniform(2, 2)).to_json(), coupling="bogus"))
    refused(invoke("gmm", "--dim", 2, "--tune", path), "--tune", "coupling must be one of", "bogus", codes=(1,))


def test_a_tune_file_whose_rmc_tree_is_not_a_chain_is_refused(tmp_path, no_work):
    # it ran an RMC chain of the tree's budget
    path = _tune_file(tmp_path, _tuned(trees.uniform(2, 2), "rmc").to_json())
    refused(invoke("gmm", "--dim", 2, "--tune", path), "--tune", "rmc", codes=(1,))


@pytest.mark.parametrize(
    "made_for,named",
    [
        ({"threads": "two"}, "threads"),
        ({"threads": 0}, "threads"),
        ({"grid": "karras"}, "grid"),
        ({"chain": "nope"}, "chain"),
        ({"chain_params": 3}, "chain_params"),
    ],
)
def test_the_run_a_tune_file_records_is_checked_before_it_is_taken(tmp_path, no_work, made_for, named):
    path = _tune_file(tmp_path, _tuned().to_json(), **made_for)
    refused(invoke("gmm", "--dim", 2, "--tune", path), "--tune", f"tuned_for.{named}", codes=(1,))


# -- item 4: every output path, before the work -----------------------------------------------------------

UNWRITABLE = ["under-a-file", "a-folder"] + (["proc"] if Path("/proc/self").is_dir() else [])


def _output_cases(tmp_path: Path) -> list:
    """(arguments with OUT for the output path, the option, whether it is a folder)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    folder = tmp_path / "pipeline"
    folder.mkdir()
    return [
        (["pixel", "--dump-samples", "OUT.npz"], "--dump-samples", False),
        (["gmm", "--dim", "2", "--dump-samples", "OUT.npz"], "--dump-samples", False),
        (["gmm", "sweep", "--out", "OUT"], "--out", True),
        (["gmm", "drafts", "--out", "OUT.png"], "--out", False),
        (["pixel", "sweep", "--out", "OUT"], "--out", True),
        (["couplings", "plot", "--out", "OUT.png"], "--out", False),
        (["tune", "--model", "gmm", "--dim", "2", "--out", "OUT.json"], "--out", False),
        (["generate", "gmm", "--count", "1", "--out", "OUT.npz"], "--out", False),
        (["generate", "pixel", "--count", "1", "--out", "OUT.npz"], "--out", False),
        (["generate", "sd3", "--count", "1", "--model", folder, "--prompts", prompts, "--out", "OUT"], "--out", True),
        (
            ["generate", "diffusers", "--count", "1", "--pipeline", folder, "--prompts", prompts, "--out", "OUT"],
            "--out",
            True,
        ),
        (["sd3", "--model", folder, "--prompts", prompts, "--out", "OUT"], "--out", True),
        (["diffusers", "--pipeline", folder, "--prompts", prompts, "--out", "OUT"], "--out", True),
        (["train", "digits", "--out", "OUT"], "--out", True),
        (["train", "digits", "--weights-dir", "OUT"], "--weights-dir", True),
        (["train", "digits-draft", "--weights-dir", "OUT"], "--weights-dir", True),
        (["train", "natural32", "--out", "OUT"], "--out", True),
        (["train", "natural64", "--weights-dir", "OUT"], "--weights-dir", True),
        (["train", "natural32-draft", "--out", "OUT"], "--out", True),
        (["train", "natural64-draft", "--weights-dir", "OUT"], "--weights-dir", True),
    ]


@pytest.mark.parametrize("kind", UNWRITABLE)
def test_every_output_path_is_checked_before_the_work(tmp_path, no_work, kind):
    regular = tmp_path / "file.txt"
    regular.write_text("x")
    for args, option, folder in _output_cases(tmp_path):
        if kind == "a-folder" and folder:
            base = str(regular)  # a folder output that is a regular file
        elif kind == "a-folder":
            base = str(tmp_path / "dir")  # a file output that is a folder
        elif kind == "under-a-file":
            base = str(regular / "sub")
        else:
            base = "/proc/specforest-test/sub"
        given = [str(a).replace("OUT", base) for a in args]
        if kind == "a-folder" and not folder:
            Path(given[given.index(option) + 1]).mkdir(exist_ok=True)
        before = sorted(tmp_path.rglob("*"))
        msg = refused(invoke(*given), option)
        assert "Traceback" not in msg and any(w in msg.lower() for w in ("write", "folder", "file", "directory")), msg
        assert sorted(tmp_path.rglob("*")) == before, given  # nothing written, not even the probe


def test_a_writable_output_is_accepted_and_the_check_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "new" / "deeper" / "s.npz"
    res = invoke(*TINY_GMM, "--json", "--dump-samples", out)
    assert res.exit_code == 0, res.output
    assert out.exists() and sorted(p.name for p in out.parent.iterdir()) == ["s.npz"]


# -- item 12: options that would not apply ----------------------------------------------------------------


@pytest.mark.parametrize(
    "args,named",
    [
        (["--budget", "4"], "--budget"),
        (["--tree", "uniform", "--budget", "4"], "--budget"),
        (["--method", "standard", "--tree", "optimal", "--budget", "4"], "--tree"),
        (["--method", "standard", "--tree", "adaptive", "--budget", "4"], "--tree"),
    ],
)
def test_tree_options_that_would_not_apply_are_refused(no_work, args, named):
    for cmd in (["gmm", "--dim", "2"], ["pixel"]):
        refused(invoke(*cmd, *args), named)


UNUSED = ["--method", "standard", "--draft", "secant", "--prefetch", "parent", "--verify", "drafted"]


def test_a_standard_run_records_the_draft_options_as_not_applied(tmp_path):
    # it recorded draft: secant, prefetch: parent as if they had run
    for cmd in (TINY_GMM, ["pixel", "--samples", "1", "--steps", "3", "--no-progress"]):
        res = invoke(*cmd, "--json", *UNUSED, "--lazy")
        assert res.exit_code == 0, res.output
        rec = json.loads(res.stdout)
        assert rec["method"] == "standard" and rec["mode"] == "full"
        assert [rec[k] for k in ("coupling", "draft", "prefetch", "verify")] == [None] * 4, rec
    out = tmp_path / "g.npz"
    res = invoke("generate", "gmm", "--dim", 2, "--steps", 4, "--count", 2, "--out", out, "--no-progress", *UNUSED)
    assert res.exit_code == 0, res.output
    sampler = json.loads(out.with_suffix(".json").read_text())["options"]["sampler"]
    assert sampler["method"] == "standard" and [sampler[k] for k in ("draft", "prefetch", "verify")] == [None] * 3


def test_every_command_records_a_standard_run_through_one_helper():
    from specforest.cli.common import as_ran

    given = {
        "method": "standard",
        "draft": "secant",
        "prefetch": "parent",
        "verify": "drafted",
        "lazy": True,
        "seed": 3,
    }
    assert as_ran(given) == {**dict.fromkeys(("draft", "prefetch", "verify", "lazy")), "method": "standard", "seed": 3}
    assert as_ran({**given, "method": "rmc"}) == {**given, "method": "rmc"}


def test_a_standard_job_recorded_with_the_unused_defaults_still_resumes(tmp_path):
    # a job written before recorded the draft's options of a standard job as the defaults
    out = tmp_path / "g.npz"
    args = ["generate", "gmm", "--dim", 2, "--steps", 4, "--count", 2, "--method", "standard", "--out", out]
    assert invoke(*args, "--no-progress").exit_code == 0
    meta = json.loads(out.with_suffix(".json").read_text())
    meta["options"]["sampler"].update(draft="velocity", prefetch="nearest", verify="internal")
    out.with_suffix(".json").write_text(json.dumps(meta))
    res = invoke(*args, "--resume", "--no-progress")
    assert res.exit_code == 0 and "complete; nothing to do" in res.output, res.output


def test_the_api_runs_the_standard_sampler_whatever_the_unused_options():
    # tree=None: the draft, coupling, verification, prefetch and lazy are not used (a tuned standard
    # configuration carries them), documented in SamplerOptions
    x = streams.randn(0, torch.arange(4), (3,), dtype=torch.float64)
    plain = specforest.sample(GAUSS, x, steps=6, churn=0.5, seed=0)
    given = specforest.sample(
        GAUSS, x, steps=6, churn=0.5, seed=0, draft="x0", coupling="rmc", verify="drafted", prefetch="parent", lazy=True
    )
    assert torch.equal(plain.samples, given.samples) and torch.equal(plain.stats.nfe, given.stats.nfe)


def test_a_tune_file_is_checked_against_the_grid_and_shift_of_the_run(tmp_path, no_work):
    # --grid uniform ran a configuration tuned on flow_match
    path = _tune_file(tmp_path, _tuned().to_json(), grid="flow_match", shift=1.0)
    refused(invoke("gmm", "--dim", 2, "--grid", "uniform", "--tune", path), "--grid uniform here, flow_match")
    refused(invoke("pixel", "--grid", "uniform", "--tune", path), "--grid uniform here")
    path = _tune_file(tmp_path, _tuned().to_json(), grid="flow_match", shift=3.0)
    refused(invoke("gmm", "--dim", 2, "--tune", path), "shift 1.0 here")


def test_tune_records_the_grid_and_shift_it_tuned_on(tmp_path, monkeypatch):
    monkeypatch.setattr(latency, "tune", lambda *a, **k: _tuned())
    out = tmp_path / "t.json"
    res = invoke("tune", "--model", "gmm", "--dim", 2, "--no-progress", "--out", out)
    assert res.exit_code == 0, res.output
    made_for = json.loads(out.read_text())["tuned_for"]
    assert made_for["grid"] == "flow_match" and made_for["shift"] == 1.0


@pytest.mark.parametrize(
    "args,named",
    [
        (["--model", "gmm", "--guidance", "3"], "--guidance"),
        (["--model", "digits", "--dim", "8"], "--dim"),
        (["--model", "gmm", "--pipeline", "."], "--pipeline"),
        (["--model", "sd3", "--negative-prompt", "blurry"], "--negative-prompt"),
    ],
)
def test_tune_refuses_options_of_another_model(tmp_path, no_work, args, named):
    refused(invoke("tune", *args, "--out", tmp_path / "t.json"), named, "--model")
