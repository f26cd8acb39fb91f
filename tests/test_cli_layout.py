"""The command line's shape: every command and subcommand, each with its flags in order, as ``specforest
--help`` listed them when the CLI became the ``specforest.cli`` package; and the two ways in (the console
script of ``pyproject.toml`` and ``python -m specforest``).

A command or flag lost (or renamed, or moved in ``--help``) in a refactor fails here; one added on purpose is
added to :data:`COMMANDS` with it.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import click
import pytest
import tomllib

from specforest.cli import main

ROOT = Path(__file__).resolve().parents[1]

# each command's path -> its options in --help order, as typed (``--a/--b``: an on/off pair)
_PIPELINE_JOB = (
    "--method --K --L --steps --churn --chain --eta --s-noise --path --s-churn --s-tmin --s-tmax --variance --solver-type --r --grid --prefetch --verify --draft --count --seed --out --batch --memory-gb "
    "--resume --tree-parallel --progress/--no-progress --threads --compile --tune"
)
# (the pipelines' commands do not offer the options that make the grid: their grid is the scheduler's)
_JOB = f"{_PIPELINE_JOB} --schedule --sigma-min --sigma-max"
COMMANDS = {
    "": "--version",
    "couplings": "",
    "couplings plot": "--out --K-values",
    "couplings table": "--json --K-values --deltas",
    "diffusers": "--pipeline --prompts --num-prompts --negative-prompt --guidance --true-cfg-scale --shift --height "
    "--width --max-sequence-length --dtype --device --num-images-per-prompt --method --K --L --steps --churn --chain "
    "--eta --s-noise --path --s-churn --s-tmin --s-tmax --variance --solver-type --r --scheduler --draft "
    "--verify --prefetch --lazy --seed --batch-size --max-memory-gb --out --json --progress/--no-progress --threads "
    "--tune",
    "generate": "",
    "generate diffusers": f"{_PIPELINE_JOB} --pipeline --prompts --num-prompts --negative-prompt --guidance --true-cfg-scale "
    "--shift --height --width --max-sequence-length --dtype --device --scheduler",
    "generate gmm": f"{_JOB} --device --dim --components --mixture-seed",
    "generate pixel": f"{_JOB} --device --model",
    "generate sd3": f"{_PIPELINE_JOB} --model --prompts --num-prompts --guidance --shift --height --width "
    "--max-sequence-length --dtype --device",
    "gmm": "--method --K --L --components --dim --steps --churn --trajectories --seed --mixture-seed --grid "
    "--prefetch --verify --tree --budget --draft --memory-gb --chain --eta --s-noise --path --s-churn --s-tmin --s-tmax --variance --solver-type --r --lazy --json --dump-samples "
    "--progress/--no-progress --threads --compile --tune --schedule --sigma-min --sigma-max",
    "gmm drafts": "--out --model --trajectories --depth --seed",
    "gmm sweep": "--out --K-values --L-values --methods --components --dim --steps --churn --trajectories --seed "
    "--mixture-seed --grid --prefetch --verify --tree --budget --draft --memory-gb --lazy --progress/--no-progress "
    "--threads",
    "pixel": "--model --method --draft --tree --budget --K --L --churn --chain --eta --s-noise --path --s-churn --s-tmin --s-tmax --variance --solver-type --r --steps --samples --seed --grid --prefetch --verify "
    "--lazy --memory-gb --json --dump-samples --progress/--no-progress --threads --compile --tune --schedule "
    "--sigma-min --sigma-max",
    "pixel sweep": "--out --trees --churns --methods --steps --samples --seed --grid --prefetch --verify "
    "--lazy/--full --progress/--no-progress --threads",
    "sd3": "--model --prompts --num-prompts --guidance --shift --height --width --max-sequence-length --dtype "
    "--device --K-values --L --steps --churn --seed --verify --prefetch --draft --batch-size --out --clip --max-memory-gb "
    "--lazy --save-images --progress/--no-progress --threads --tune",
    "train": "",
    "train digits": "--out --weights-dir --steps --max-minutes --seed --eval-samples --threads "
    "--progress/--no-progress",
    "train digits-draft": "--weights-dir --steps --batch --max-minutes --seed --threads --progress/--no-progress",
    "train natural32": "--out --weights-dir --steps --batch --channels --checkpoint-every --eval-crops "
    "--figure-samples --max-minutes --seed --threads --progress/--no-progress",
    "train natural64": "--out --weights-dir --steps --batch --channels --checkpoint-every --eval-crops "
    "--figure-samples --max-minutes --seed --threads --progress/--no-progress",
    "train natural32-draft": "--out --weights-dir --steps --batch --checkpoint-every --eval-crops --max-minutes --seed "
    "--threads --progress/--no-progress",
    "train natural64-draft": "--out --weights-dir --steps --batch --checkpoint-every --eval-crops --max-minutes --seed "
    "--threads --progress/--no-progress",
    "tune": "--model --steps --churn --chain --eta --s-noise --path --s-churn --s-tmin --s-tmax --variance --solver-type --r --scheduler --batch --device --dim --components --mixture-seed --drafts --budget-max --out "
    "--pipeline --prompts --num-prompts --guidance --shift --height --width --max-sequence-length --dtype "
    "--true-cfg-scale --negative-prompt --max-memory-gb --threads --progress/--no-progress --schedule --sigma-min "
    "--sigma-max",
}


def _flags(param: click.Parameter) -> str:
    on_off = [", ".join(param.opts)] + ([", ".join(param.secondary_opts)] if param.secondary_opts else [])
    return "/".join(on_off)


def _tree(command: click.Command, path: tuple = ()) -> dict:
    """Each command's path -> its options, walking the groups."""
    tree = {" ".join(path): " ".join(_flags(p) for p in command.params)}
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            tree.update(_tree(sub, (*path, name)))
    return tree


def _listed(help_text: str) -> list:
    """The commands a ``--help`` lists (its ``Commands:`` section, one a line)."""
    return [line.split()[0] for line in help_text.split("Commands:\n")[1].splitlines() if line.strip()]


def test_every_command_keeps_its_flags():
    tree = _tree(main)
    assert sorted(tree) == sorted(COMMANDS), "commands lost or added"
    for path, flags in COMMANDS.items():
        assert tree[path].split() == flags.split(), f"specforest {path}: its flags changed"


def test_the_console_script_runs_the_command_line(monkeypatch, capsys):
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["specforest"]
    module, attr = target.split(":")
    monkeypatch.setattr(sys, "argv", ["specforest", "--help"])
    with pytest.raises(SystemExit) as end:
        getattr(importlib.import_module(module), attr)()
    assert end.value.code == 0
    assert _listed(capsys.readouterr().out) == sorted(main.commands)


def test_python_dash_m_specforest_runs_the_command_line():
    res = subprocess.run(
        [sys.executable, "-m", "specforest", "--help"], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr
    assert _listed(res.stdout) == sorted(main.commands), res.stdout
