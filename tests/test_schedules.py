"""Named noise schedules (``schedule=``, ``--schedule``): the grids of the schedules users know (issue 45, item 16).

The named grids (``--grid flow_match|uniform``) start at ``t = 1`` (``sigma = inf``), where the samplers on
VE noise levels are not defined, so ``--chain euler|ddpm|dpmpp_2m_sde|...`` could never run from the command
line. A schedule (``karras``, ``exponential``, ``ddpm``, ``vp``) makes a grid of ``steps`` VE levels, then 0,
mapped to the linear path: every listed chain runs on it. Here: the grids against k-diffusion's own schedule
functions, the option's refusals naming both sides, every chain the CLI lists running on ``gmm`` and
``pixel`` with a schedule (recorded in run.json), a ``generate`` job recording it and resuming bitwise
(an old job without the key resumes unchanged; another schedule is refused naming both), and the bad
values refused naming the flag and range before any work.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import invoke, refused
from kdiff_reference import sampling

import specforest
from specforest import chains, trees
from specforest.chains import available_chains, get_chain
from specforest.cli.sampler_options import CHAIN_FLAGS, extra_names, grid_flags
from specforest.experiments import generate as gen_exp
from specforest.models import GaussianMixture
from specforest.schedules import SCHEDULES, ddpm_discrete_sigmas, schedule_grid

QUIET = ["--no-progress", "--threads", "1"]
GMM = ["gmm", "--dim", 4, "--components", 2, "--steps", 6, "--trajectories", 3, "--K", 2, "--L", 2, *QUIET]
PIXEL = ["pixel", "--samples", 2, "--steps", 6, "--K", 2, "--L", 2, *QUIET]
GEN_GMM = ["generate", "gmm", "--dim", 4, "--components", 2, "--steps", 6, "--count", 6, "--batch", 2, *QUIET]
GEN_PIXEL = ["generate", "pixel", "--steps", 6, "--count", 2, "--batch", 2, *QUIET]


def _ok(res):
    assert res.exit_code == 0, res.output
    return res


def _samples(path) -> np.ndarray:
    with np.load(path) as z:
        return z["samples"]


def _chain_flags(name: str) -> list:
    """The flags that give chain ``name`` its stochastic setting (:meth:`Chain.example`), e.g. ``--s-churn``
    for EDM's Euler, whose default (``s_churn = 0``) has no noise to speculate on."""
    default, example = get_chain(name).params, get_chain(name).example().params
    out = []
    for param, value in example.items():
        if param == "churn":
            out += ["--churn", value]
        elif value != default[param] and param in CHAIN_FLAGS:
            out += [CHAIN_FLAGS[param], value]
    return out


# -- the grids -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule, kdiff",
    [
        ("karras", lambda n: sampling().get_sigmas_karras(n, 0.002, 80.0)),
        ("exponential", lambda n: sampling().get_sigmas_exponential(n, 0.002, 80.0)),
        ("vp", lambda n: sampling().get_sigmas_vp(n)),
    ],
)
def test_a_schedules_grid_is_k_diffusions_schedule_on_the_linear_path(schedule, kdiff):
    torch.set_default_dtype(torch.float64)  # k-diffusion's functions in float64, as the grid is made
    try:
        ref = kdiff(9)
    finally:
        torch.set_default_dtype(torch.float32)
    grid = schedule_grid(schedule, 9)
    assert grid.dtype == torch.float64 and grid.shape == (10,) and grid[-1] == 0 and grid[0] < 1
    assert torch.allclose(grid, ref / (1 + ref), rtol=1e-14, atol=0)


def test_the_ddpm_schedule_is_ddpms_training_schedule():
    """At 1000 steps every training step is a level (DDPM's own grid); at fewer, the levels are those
    training levels at evenly spaced timesteps, interpolated in log sigma."""
    assert torch.allclose(schedule_grid("ddpm", 1000), chains.ddpm_linear_grid(1000), rtol=1e-12, atol=0)
    full = ddpm_discrete_sigmas(1000)
    few = ddpm_discrete_sigmas(4)  # timesteps 999, 666, 333, 0: training levels
    assert torch.allclose(few[:-1], full[[0, 333, 666, 999]], rtol=1e-12) and few[-1] == 0


def test_a_run_on_a_schedule_is_the_run_on_its_grid():
    g = GaussianMixture.paper(dim=3, components=2, seed=0)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    kw = dict(chain="euler_ancestral", tree=trees.chain(3), coupling="rmc", seed=2)
    a = specforest.sample(g, x, steps=7, schedule="karras", sigma_min=0.05, sigma_max=30.0, **kw)
    b = specforest.sample(g, x, sigmas=schedule_grid("karras", 7, 0.05, 30.0), **kw)
    assert torch.equal(a.samples, b.samples)
    assert a.config["schedule"] == "karras" and a.config["grid"] == "karras"
    assert (a.config["sigma_min"], a.config["sigma_max"]) == (0.05, 30.0)


@pytest.mark.parametrize(
    "kw, named",
    [
        (dict(schedule="karras", grid="uniform"), ["schedule='karras'", "grid='uniform'"]),
        (dict(schedule="karras", shift=3.0), ["shift=3.0", "schedule='karras'"]),
        (dict(sigma_min=0.1), ["sigma_min", "schedule="]),
        (dict(schedule="vp", sigma_max=5.0), ["sigma_max", "'vp'"]),
        (dict(schedule="karras", sigma_min=1.0, sigma_max=0.5), ["sigma_max must be a finite number > 1.0"]),
        (dict(schedule="cosine"), ["schedule must be one of karras, exponential, ddpm, vp"]),
    ],
)
def test_the_schedule_option_refuses_what_it_leaves_no_room_for_naming_both(kw, named):
    with pytest.raises(ValueError) as err:
        specforest.SamplerOptions(steps=6, churn=0.3, **kw)
    for name in named:
        assert name in str(err.value), (name, str(err.value))
    with pytest.raises(ValueError, match="schedule='karras' makes the grid from steps, and sigmas is a grid"):
        specforest.SamplerOptions(sigmas=schedule_grid("karras", 6), churn=0.3, schedule="karras")


# -- the command line ------------------------------------------------------------------------------------


@pytest.mark.parametrize("chain", available_chains())
@pytest.mark.parametrize("command", [GMM, PIXEL], ids=["gmm", "pixel"])
def test_every_listed_chain_runs_from_the_cli_on_a_schedule_and_records_it(command, chain):
    res = _ok(invoke(*command, "--chain", chain, *_chain_flags(chain), "--schedule", "karras", "--json"))
    rec = json.loads(res.output)
    assert rec["chain"] == chain and rec["schedule"] == "karras" and rec["grid"] == "karras"
    assert "sigma_min" not in rec and "sigma_max" not in rec  # (at their defaults, the schedule's: left out)


def test_the_schedules_range_is_the_runs_and_in_its_record(tmp_path):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    args = [*GMM, "--chain", "ddpm", "--schedule", "exponential", "--json"]
    rec = json.loads(_ok(invoke(*args, "--sigma-min", 0.05, "--sigma-max", 20, "--dump-samples", a)).output)
    assert (rec["schedule"], rec["sigma_min"], rec["sigma_max"]) == ("exponential", 0.05, 20.0)
    assert rec["deterministic_steps"] == 1  # only the step into 0: the first level is below t = 1
    _ok(invoke(*args, "--dump-samples", b))
    assert not np.array_equal(_samples(a), _samples(b))


@pytest.mark.parametrize("job", [GEN_GMM, GEN_PIXEL], ids=["gmm", "pixel"])
def test_a_generate_job_records_its_schedule_and_refuses_another_on_resume(job, tmp_path):
    out = tmp_path / "a.npz"
    args = [*job, "--chain", "dpmpp_2m_sde", "--schedule", "vp", "--out", out]
    _ok(invoke(*args))
    sampler = json.loads(out.with_suffix(".json").read_text())["options"]["sampler"]
    assert sampler["schedule"] == "vp" and "sigma_min" not in sampler  # (an option at its default is left out)
    assert "nothing to do" in _ok(invoke(*args, "--resume")).output
    res = invoke(*job, "--chain", "dpmpp_2m_sde", "--schedule", "karras", "--out", out, "--resume")
    assert res.exit_code == 1 and "schedule: 'vp' on disk, 'karras' now" in res.output, res.output


def _interrupt_after(monkeypatch, frames: int) -> None:
    real = gen_exp.generate

    def interrupted(*args, **kwargs):
        for k, f in enumerate(real(*args, **kwargs)):
            if k == frames:
                raise KeyboardInterrupt
            yield f

    monkeypatch.setattr(gen_exp, "generate", interrupted)


def test_an_interrupted_job_on_a_schedule_resumes_to_the_uninterrupted_samples(tmp_path, monkeypatch):
    out, ref = tmp_path / "job.npz", tmp_path / "ref.npz"
    args = [*GEN_GMM, "--chain", "euler", "--s-churn", 2, "--schedule", "karras", "--sigma-max", 20]
    _interrupt_after(monkeypatch, 1)
    assert invoke(*args, "--out", out).exit_code == 130  # (the command reports the interrupt, as SIGINT)
    monkeypatch.undo()
    parts = json.loads((tmp_path / "job.npz.parts" / "options.json").read_text())["sampler"]
    assert (parts["schedule"], parts["sigma_max"]) == ("karras", 20.0)
    _ok(invoke(*args, "--out", out, "--resume"))
    _ok(invoke(*args, "--out", ref))
    np.testing.assert_array_equal(_samples(out), _samples(ref))


def test_a_job_made_before_schedules_resumes_unchanged(tmp_path, monkeypatch):
    """A job's options written before the option existed have no ``schedule`` key: it resumes as it was
    (on its named grid), and a resume that gives a schedule is refused, naming both."""
    spec = gen_exp.JobSpec(
        "gmm",
        6,
        0,
        dict(method="dgrs", K=2, L=3, steps=6, churn=0.1, grid="flow_match", prefetch="nearest", verify="internal")
        | dict(draft="velocity", chain="em", chain_params={"churn": 0.1}),
        dict(dim=4, components=2, mixture_seed=0),
    )
    _interrupt_after(monkeypatch, 1)
    out = tmp_path / "old.npz"
    with pytest.raises(KeyboardInterrupt):
        gen_exp.run_job(spec, out, batch=2)
    monkeypatch.undo()
    assert "schedule" not in json.loads((tmp_path / "old.npz.parts" / "options.json").read_text())["sampler"]
    res = invoke(*GEN_GMM, "--schedule", "karras", "--out", out, "--resume")
    assert res.exit_code == 1 and "schedule: None on disk, 'karras' now" in res.output, res.output
    _ok(invoke(*GEN_GMM, "--out", out, "--resume"))
    ref = tmp_path / "ref.npz"
    _ok(invoke(*GEN_GMM, "--out", ref))
    np.testing.assert_array_equal(_samples(out), _samples(ref))


COMMANDS = {
    "gmm": ["gmm"],
    "pixel": ["pixel"],
    "generate gmm": ["generate", "gmm", "--count", 1, "--out", "OUT.npz"],
    "generate pixel": ["generate", "pixel", "--count", 1, "--out", "OUT.npz"],
}

REFUSALS = [
    (["--schedule", "karras", "--grid", "uniform"], ["--grid uniform and --schedule karras both choose the grid"]),
    (["--sigma-min", "0.1"], ["--sigma-min sets the range of --schedule karras or exponential"]),
    (["--schedule", "vp", "--sigma-max", "3"], ["--sigma-max", "--schedule vp has its own levels"]),
    (["--schedule", "ddpm", "--sigma-min", "1", "--sigma-max", "3"], ["--sigma-min and --sigma-max set", "ddpm"]),
    (["--schedule", "karras", "--sigma-max", "0.001"], ["--sigma-max", "must be > --sigma-min (0.002, its default)"]),
    (["--schedule", "exponential", "--sigma-min", "2", "--sigma-max", "1"], ["--sigma-max", "> --sigma-min (2)"]),
    (["--schedule", "karras", "--sigma-min", "0"], ["--sigma-min", "x>0.0"]),
    (["--schedule", "karras", "--sigma-max", "nan"], ["--sigma-max"]),
    (["--schedule", "cosine"], ["--schedule", "cosine", *SCHEDULES]),
    (["--chain", "ddpm"], ["--chain ddpm does not run on --grid flow_match", "--schedule karras|exponential|ddpm|vp"]),
]


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("args,named", REFUSALS, ids=[" ".join(a) for a, _ in REFUSALS])
def test_a_bad_schedule_is_refused_naming_the_flags_before_the_work(tmp_path, no_work, command, args, named):
    line = [str(a).replace("OUT", str(tmp_path / "out")) for a in COMMANDS[command]]
    refused(invoke(*line, *args), *named)
    assert not list(tmp_path.iterdir())


PIPELINE_COMMANDS = (["diffusers"], ["sd3"], ["generate", "diffusers"], ["generate", "sd3"])


@pytest.mark.parametrize("command", PIPELINE_COMMANDS, ids=lambda c: "-".join(c))
def test_the_pipeline_commands_do_not_offer_the_grid_options(command):
    """A pipeline's grid is its scheduler's: --schedule and its range are not offered there (offered, they
    were refused only after the pipeline loaded), while the other further options still are."""
    assert grid_flags() == {"schedule": "--schedule", "sigma_min": "--sigma-min", "sigma_max": "--sigma-max"}
    shown = {w.strip(",") for w in invoke(*command, "--help").output.split()}
    for flag in grid_flags().values():
        assert flag not in shown, (command, flag)
        res = invoke(*command, flag, "1")
        assert res.exit_code == 2 and f"No such option '{flag}'" in res.output, res.output
    assert set(extra_names()) - set(extra_names(pipeline=True)) == set(grid_flags())


def test_a_pipelines_sample_and_tune_refuse_the_grid_options_before_any_work(no_work, tmp_path):
    from specforest.diffusers.flow import further_options

    for name in grid_flags():
        with pytest.raises(ValueError, match=f"{name} is set by the pipeline's run \\(the scheduler's grid\\)"):
            further_options({name: "karras" if name == "schedule" else 1.0})
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    for model in ("diffusers", "sd3"):
        out = tmp_path / "tuned.json"
        res = invoke(
            "tune", "--model", model, "--pipeline", tmp_path, "--prompts", prompts, "--out", out, "--schedule", "karras"
        )
        assert res.exit_code == 2, res.output
        assert "--schedule applies only to --model gmm, digits, natural32 or natural64" in res.output, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.txt"]
