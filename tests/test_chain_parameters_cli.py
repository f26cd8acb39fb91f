"""A chain's parameters reach the command line from its declaration, on every command that takes ``--chain``.

Each parameter of each registered chain (its dataclass fields) is a flag of ``gmm``, ``pixel``,
``generate`` and ``tune``: its name with dashes (``s_tmin``: ``--s-tmin``; the ``em`` chain's
``churn`` is ``--churn``), described by :data:`specforest.chains.PARAMETERS`. A value given reaches
the chain the command runs and the run's record (``chain_params``).
"""

from __future__ import annotations

import dataclasses
import json
import math

import click
import numpy as np
import pytest
from click.testing import CliRunner
from helpers import invoke

from specforest.chains import PARAMETERS, available_chains, get_chain
from specforest.cli.sampler_options import chain_options, chain_settings, churn_option, run_chain


def _declared() -> list:
    """``(chain, parameter, default)`` of every registered chain's declared parameters."""
    out = []
    for name in available_chains():
        chain = get_chain(name)
        out += [(name, f.name, getattr(chain, f.name)) for f in dataclasses.fields(chain)]
    return out


def _flag(param: str) -> str:
    return "--" + param.replace("_", "-")


def _other(name: str, param: str, default: object) -> object:
    """A value of ``param`` other than its ``default`` that chain ``name`` takes."""
    if isinstance(default, str):
        choices = {"path": ("ve", "linear"), "variance": ("fixed_small", "fixed_large")}
        choices["solver_type"] = ("midpoint", "heun")
        return next(c for c in choices[param] if c != default)
    if math.isinf(default):
        return 40.0
    return 0.25 if default == 0 else default * 0.5


def test_the_declaration_covers_every_parameter_of_every_chain():
    declared = _declared()
    assert {p for _, p, _ in declared} >= {"eta", "s_noise", "s_churn", "s_tmin", "s_tmax", "path", "variance"}
    missing = sorted({p for _, p, _ in declared} - set(PARAMETERS))
    assert not missing, f"chain parameters without a declaration in specforest.chains.PARAMETERS: {missing}"
    kinds: dict = {}
    for name, p, default in declared:
        assert kinds.setdefault(p, type(default)) is type(default), f"{name}.{p}: one type per parameter name"


@click.command()
@churn_option(default=0.3)
@chain_options
def _probe(**o):
    click.echo(json.dumps(chain_settings(run_chain(o))))


@pytest.mark.parametrize(("name", "param", "default"), _declared(), ids=lambda v: str(v))
def test_every_parameter_given_by_its_flag_reaches_the_chain_and_its_record(name, param, default):
    value = _other(name, param, default)
    flag = "--churn" if param == "churn" else _flag(param)
    res = CliRunner().invoke(_probe, ["--chain", name, flag, str(value)])
    assert res.exit_code == 0, res.output
    rec = json.loads(res.output)
    assert rec["chain"] == name and rec["chain_params"][param] == value
    assert rec["chain_params"] == chain_settings(get_chain(name, **{param: value}))["chain_params"]


COMMANDS = {
    "gmm": ["gmm"],
    "pixel": ["pixel"],
    "generate gmm": ["generate", "gmm"],
    "generate pixel": ["generate", "pixel"],
    "tune": ["tune"],
}


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_every_declared_parameter_is_a_flag_of_every_command_with_chain(command):
    out = invoke(*command, "--help").output
    for _, param, _ in _declared():
        assert ("--churn" if param == "churn" else _flag(param)) in out, (command, param)


QUIET = ["--no-progress", "--threads", "1"]
GMM = ["gmm", "--dim", 4, "--components", 2, "--steps", 6, "--trajectories", 2, "--K", 2, "--L", 2, *QUIET]
PIXEL = ["pixel", "--samples", 2, "--steps", 6, "--K", 2, "--L", 2, *QUIET]
GEN_GMM = ["generate", "gmm", "--dim", 4, "--components", 2, "--steps", 6, "--count", 2, "--batch", 2, *QUIET]
TUNE = ["tune", "--model", "gmm", "--dim", 4, "--components", 2, "--steps", 6, "--budget-max", 2]
TUNE += ["--drafts", "velocity", *QUIET]
# the parameters no command line reached before they were read from the declaration
RUNS = {
    "euler": (["--s-churn", "5", "--s-tmin", "0.05", "--s-tmax", "30"], {"s_tmin": 0.05, "s_tmax": 30.0}),
    "ddpm": (["--variance", "fixed_large"], {"variance": "fixed_large"}),
    "euler_ancestral": (["--path", "linear", "--eta", "0.5"], {"path": "linear", "eta": 0.5}),
    "dpmpp_sde": (["--path", "linear", "--r", "0.4"], {"path": "linear", "r": 0.4}),
}


@pytest.mark.parametrize("chain", RUNS)
def test_gmm_and_generate_run_the_chain_with_the_value_and_record_it(chain, tmp_path):
    flags, want = RUNS[chain]
    args = ["--chain", chain, *flags, "--schedule", "karras"]
    res = invoke(*GMM, *args, "--json")
    assert res.exit_code == 0, res.output
    rec = json.loads(res.output)
    assert rec["chain"] == chain and {k: rec["chain_params"][k] for k in want} == want
    out = tmp_path / "a.npz"
    res = invoke(*GEN_GMM, *args, "--out", out)
    assert res.exit_code == 0, res.output
    job = json.loads(out.with_suffix(".json").read_text())["options"]["sampler"]
    assert job["chain"] == chain and {k: job["chain_params"][k] for k in want} == want
    with np.load(out) as z:
        assert np.isfinite(z["samples"]).all()


def test_pixel_and_tune_run_the_chain_with_the_value_and_record_it(tmp_path):
    """On the named grid these commands tune and run (from t = 1): the linear path's form."""
    flags, want = RUNS["euler_ancestral"]
    args = ["--chain", "euler_ancestral", *flags]
    res = invoke(*PIXEL, *args, "--json")
    assert res.exit_code == 0, res.output
    rec = json.loads(res.output)
    assert rec["chain"] == "euler_ancestral" and {k: rec["chain_params"][k] for k in want} == want
    tuned = tmp_path / "t.json"
    res = invoke(*TUNE, *args, "--out", tuned)
    assert res.exit_code == 0, res.output
    data = json.loads(tuned.read_text())
    assert data["chain"] == "euler_ancestral" and {k: data["chain_params"][k] for k in want} == want
