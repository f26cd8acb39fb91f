"""Every refusal of the command line speaks in flags, before any work (issue 45, items 8, 11 and 13).

A chain without a stochastic step is refused by ``tune`` before the cost curve is measured, and by the
commands that sample before they sample, naming ``--method standard`` (not the library's ``tree=None``);
``--tree optimal`` without ``--budget`` names ``--budget`` (not ``tree='optimal'``); ``--steps`` above the
grid's bound names ``--steps`` and the bound (not ``--chain em`` and ``--grid``); a hand-edited tuned file
whose ``tuned_for`` contradicts the configuration it records beside it is refused, naming both.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import torch
from helpers import invoke, never_called, refused

import specforest
from specforest import latency, streams
from specforest.chains import get_chain
from specforest.latency import CostCurve, Tuned
from specforest.models import GaussianMixture
from specforest.options import NoStochasticStep
from specforest.sde import MAX_STEPS

QUIET = ["--no-progress", "--threads", "1"]
DETERMINISTIC = ["--chain", "ddim", "--eta", "0", "--steps", "6"]

# A Python spelling the command line has no way to type: `name=value` of a library keyword
PYTHON_SPELLING = re.compile(r"\b(tree|budget|lazy|verify|draft|coupling|prefetch|steps|churn|chain|eta)=")


def _in_flags(msg: str) -> str:
    assert "Traceback" not in msg and not PYTHON_SPELLING.search(msg), msg
    return msg


# -- item 11: a chain with no stochastic step ---------------------------------------------------------------


@pytest.mark.parametrize("model", ["gmm", "digits"])
def test_tune_refuses_a_chain_without_a_stochastic_step_before_measuring(tmp_path, no_work, model):
    # it measured the cost curve for minutes, then refused with "Run it with tree=None"
    out = tmp_path / "t.json"
    res = invoke("tune", "--model", model, *DETERMINISTIC, *QUIET, "--out", out)
    msg = _in_flags(refused(res, "--chain ddim", "--eta", "stochastic", "--method standard"))
    assert "nothing to tune" in msg
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "command",
    [
        ["gmm", "--dim", "2", "--trajectories", "2"],
        ["pixel", "--samples", "1"],
    ],
)
def test_a_tree_on_a_chain_without_a_stochastic_step_is_refused_in_flags_before_the_work(no_work, command):
    msg = _in_flags(refused(invoke(*command, *DETERMINISTIC, *QUIET), "--chain ddim", "--eta", "--method standard"))
    assert "stochastic" in msg


def test_generate_refuses_a_tree_on_a_chain_without_a_stochastic_step_in_flags(tmp_path):
    out = tmp_path / "g.npz"
    res = invoke("generate", "gmm", "--dim", 2, "--count", 2, *DETERMINISTIC, *QUIET, "--out", out)
    _in_flags(refused(res, "--chain ddim", "--method standard", codes=(1, 2)))
    assert not any(tmp_path.iterdir())


def test_the_refusal_lists_every_chain_an_option_makes_stochastic():
    """The advice names the chains that take --eta and --s-churn from their declarations: heun's default
    (s_churn 0) is refused with heun among the --s-churn chains, dpmpp_sde among the --eta ones."""
    res = invoke(
        "gmm", "--dim", 2, "--trajectories", 2, "--chain", "heun", "--steps", 6, "--schedule", "karras", *QUIET
    )
    msg = " ".join(_in_flags(refused(res, "--chain heun", "--method standard")).split())
    churned = re.search(r"--s-churn > 0 with --chain ([^;]*);", msg)
    ancestral = re.search(r"--eta > 0 with --chain ([^;]*);", msg)
    assert churned and {"euler", "heun", "dpm_2"} <= set(re.split(r", | or ", churned.group(1)))
    assert ancestral and {"dpm_2_ancestral", "dpmpp_2s_ancestral", "dpmpp_sde"} <= set(
        re.split(r", | or ", ancestral.group(1))
    )


def test_the_standard_sampler_still_runs_a_deterministic_chain():
    res = invoke("gmm", "--dim", 2, "--trajectories", 2, *DETERMINISTIC, *QUIET, "--method", "standard", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["chain"] == "ddim"


def test_the_library_tuner_refuses_a_chain_without_a_stochastic_step_before_calibrating(monkeypatch):
    monkeypatch.setattr(latency.Calibrator, "calibrate", never_called)
    gmm = GaussianMixture.paper(dim=2, components=1, seed=0)
    x = streams.randn(0, torch.arange(2), (2,))
    with pytest.raises(NoStochasticStep, match="no stochastic step.*nothing to tune") as err:
        latency.tune(gmm, x, steps=6, chain=get_chain("ddim", eta=0.0))
    assert isinstance(err.value, ValueError) and err.value.chain == "ddim" and err.value.params == {"eta": 0.0}
    # the sampler's own refusal is the same error, which the command line words in flags
    with pytest.raises(NoStochasticStep, match="tree=None"):
        specforest.sample(gmm, x, steps=6, chain=get_chain("ddim", eta=0.0), tree=specforest.trees.chain(2), seed=0)


# -- the main refusals of the command line name flags -------------------------------------------------------


REFUSALS = [
    (["gmm", "--dim", "2", "--tree", "optimal"], ["--tree optimal", "--budget"]),
    (["pixel", "--tree", "adaptive"], ["--tree adaptive", "--budget"]),
    (["gmm", "--dim", "2", "--method", "antithetic", "--tree", "optimal", "--budget", "4"], ["--method antithetic"]),
    (["gmm", "--dim", "2", "--method", "antithetic", "--K", "3"], ["--K", "--method antithetic"]),
    (["pixel", "--method", "antithetic", "--K", "3"], ["--K", "--method antithetic"]),
    (["gmm", "--dim", "2", "--steps", "2000000"], ["--steps", str(MAX_STEPS)]),
    (["gmm", "--dim", "2", "--chain", "ddim", "--eta", "0", "--steps", "6"], ["--method standard"]),
    (["tune", "--model", "gmm", "--chain", "ddim", "--eta", "0", "--out", "OUT.json"], ["--method standard"]),
    (["tune", "--model", "gmm", "--steps", "2000000", "--out", "OUT.json"], ["--steps", str(MAX_STEPS)]),
    (["generate", "gmm", "--count", "1", "--steps", "2000000", "--out", "OUT.npz"], ["--steps", str(MAX_STEPS)]),
]


@pytest.mark.parametrize("args,named", REFUSALS, ids=[" ".join(a) for a, _ in REFUSALS])
def test_the_main_refusals_name_flags_not_python_keywords(tmp_path, no_work, args, named):
    line = [a.replace("OUT", str(tmp_path / "out")) for a in args]
    _in_flags(refused(invoke(*line, *QUIET), *named, codes=(1, 2)))
    assert not any(tmp_path.iterdir())


LIBRARY_REFUSALS = [
    (["gmm", "--dim", "2", "--steps", "6", "--draft", "learned"], ["--draft learned"]),
    (
        ["gmm", "--dim", "2", "--steps", "6", "--memory-gb", "1e-6"],
        ["--memory-gb 1e-06", "--verify internal", "--lazy"],
    ),
    (["pixel", "--steps", "6", "--memory-gb", "1e-6"], ["--memory-gb 1e-06", "--lazy"]),
]


@pytest.mark.parametrize("args,named", LIBRARY_REFUSALS, ids=[" ".join(a) for a, _ in LIBRARY_REFUSALS])
def test_the_librarys_refusals_reach_a_command_in_its_flags(args, named):
    # draft='learned', verify='internal', lazy=True and memory_gb=1e-06: keywords a user cannot type
    _in_flags(refused(invoke(*args, *QUIET), *named, codes=(1,)))


# -- item 13: --steps above the bound -----------------------------------------------------------------------

STEPS_COMMANDS = [
    ["gmm", "--dim", "2"],
    ["gmm", "sweep", "--out", "OUT"],
    ["pixel"],
    ["pixel", "sweep", "--out", "OUT"],
    ["tune", "--model", "gmm", "--out", "OUT.json"],
    ["generate", "gmm", "--count", "1", "--out", "OUT.npz"],
    ["generate", "pixel", "--count", "1", "--out", "OUT.npz"],
    ["generate", "sd3", "--count", "1", "--model", "PIPE", "--prompts", "PROMPTS", "--out", "OUT"],
    ["generate", "diffusers", "--count", "1", "--pipeline", "PIPE", "--prompts", "PROMPTS", "--out", "OUT"],
    ["sd3", "--model", "PIPE", "--prompts", "PROMPTS", "--out", "OUT"],
    ["diffusers", "--pipeline", "PIPE", "--prompts", "PROMPTS", "--out", "OUT"],
]


def _line(args: list, tmp_path: Path) -> list:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    (tmp_path / "pipeline").mkdir(exist_ok=True)
    subs = {"OUT": str(tmp_path / "out"), "PIPE": str(tmp_path / "pipeline"), "PROMPTS": str(prompts)}
    return [re.sub("OUT|PIPE|PROMPTS", lambda m: subs[m.group(0)], a) for a in args]


@pytest.mark.parametrize("command", STEPS_COMMANDS, ids=[" ".join(c[:2]) for c in STEPS_COMMANDS])
def test_steps_above_the_bound_name_steps_and_the_bound_on_every_command(tmp_path, no_work, command):
    # it blamed --chain em and --grid flow_match
    msg = refused(invoke(*_line(command, tmp_path), "--steps", MAX_STEPS + 1))
    assert "--steps" in msg and f"{MAX_STEPS}" in msg and "--chain" not in msg and "--grid" not in msg, msg
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.json").exists()
    path = list(itertools.takewhile(lambda a: not a.startswith("--"), command))
    help_text = " ".join(invoke(*path, "--help").output.split())
    assert re.search(rf"--steps .*?{MAX_STEPS}", help_text), help_text


# -- item 8: a tuned file that contradicts itself ----------------------------------------------------------


def _tuned_json(**over) -> dict:
    fields = dict(
        label="test",
        tree=None,
        coupling="grs",
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
    )
    fields.update(over)
    return Tuned(**fields).to_json()


def _file(tmp_path: Path, data: dict, **made_for) -> Path:
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(dict(data, tuned_for={"model": "gmm", **made_for})))
    return path


EA = dict(churn=None, chain="euler_ancestral", chain_params={"eta": 0.7})

CONTRADICTIONS = [
    (_tuned_json(), {"chain": "ddim", "chain_params": {"eta": 0.5}, "churn": None}, ["chain", "em", "ddim"]),
    (_tuned_json(**EA), {"chain": "em"}, ["chain", "euler_ancestral", "em"]),
    (_tuned_json(**EA), {"chain": "euler_ancestral", "chain_params": {"eta": 0.5}}, ["chain_params.eta", "0.7", "0.5"]),
    (_tuned_json(**EA), {"chain_params": {"eta": 0.7, "s_noise": 2.0}}, ["chain_params.s_noise", "2.0"]),
    (_tuned_json(), {"steps": 12}, ["steps", "8", "12"]),
    (_tuned_json(), {"batch": 5}, ["batch", "2", "5"]),
    (_tuned_json(), {"churn": 0.5}, ["churn", "0.3", "0.5"]),
]


@pytest.mark.parametrize("data,made_for,named", CONTRADICTIONS, ids=["-".join(sorted(m)) for _, m, _ in CONTRADICTIONS])
def test_a_tuned_file_whose_tuned_for_contradicts_its_configuration_is_refused(
    tmp_path, no_work, data, made_for, named
):
    # the top level won silently: a file whose tuned_for says ddim ran the em chain
    path = _file(tmp_path, data, **made_for)
    msg = refused(invoke("gmm", "--dim", 2, "--tune", path), "--tune", "tuned_for", *named, codes=(1,))
    assert "disagree" in msg


def test_a_tuned_file_whose_duplicated_fields_agree_runs(tmp_path):
    data = _tuned_json(**EA)
    path = _file(tmp_path, data, chain="euler_ancestral", chain_params={"eta": 0.7, "s_noise": 1.0}, steps=8, batch=2)
    res = invoke("gmm", "--dim", 2, "--tune", path, *QUIET, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["chain"] == "euler_ancestral"


# -- docs a user tripped on ----------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def test_tune_help_says_pipeline_takes_any_family():
    # it called --pipeline a StableDiffusion3Pipeline directory, with --model diffusers taking any family
    text = " ".join(invoke("tune", "--help").output.split())
    start = text.index("--pipeline DIRECTORY")
    pipeline = text[start : text.index("--prompts", start)]
    assert "any family" in pipeline and "--model diffusers" in pipeline and "--model sd3" in pipeline, pipeline


def test_the_readme_says_what_make_demo_runs_for_ddpm_on_digits():
    # the README said make demo shows B = 155 (13 calls); the demo runs B = 62
    demo = (ROOT / "examples" / "ddpm_digits.py").read_text()
    budgets = set(re.findall(r"trees\.chain\((\d+)\)", demo))
    assert len(budgets) == 1, budgets
    readme = " ".join((ROOT / "README.md").read_text().split())
    said = re.search(r"`make demo` runs the B = (\d+) chain", readme)
    assert said is not None and said.group(1) in budgets, said
    assert "ddpm_digits.py" in (ROOT / "Makefile").read_text().split("demo:")[1].split("\n\n")[0]
