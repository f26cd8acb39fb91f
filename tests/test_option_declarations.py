"""The sampler's options are declared once, on the fields of :class:`specforest.SamplerOptions`.

Adding an option is one edit: a field declared with :func:`specforest.options.option` is taken by
``sample``, ``generate`` and ``tune`` and appears, with its help, on every command that runs the sampler,
its value reaching the runs of ``gmm``, ``pixel``, ``generate``, ``sd3``, ``diffusers`` (through a pipeline
family's ``sample``) and ``tune``, and their records (``specforest.sample``'s too) under its key (shown in
a fresh process, on a test-only subclass put in the module's place before the command line is built). The
experiments take such further options as given and refuse one they set themselves. And the registry-backed
choices (``--draft``, ``--chain``, the ``coupling`` option) are the registries', a plug-in registered here
offered at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from specforest.chains import EM, available_chains, register_chain, unregister_chain
from specforest.cli import main
from specforest.cli.sampler_options import PLACED, extra_names
from specforest.couplings import GRS, available_couplings, register_coupling, unregister_coupling
from specforest.drafts import FrozenPrediction, available_drafts, register_draft, unregister_draft
from specforest.experiments import generate as gen_exp
from specforest.experiments import gmm as gmm_exp
from specforest.experiments import pixel as pixel_exp
from specforest.experiments import sd3 as sd3_exp
from specforest.experiments.generate_model import _tree_kwargs
from specforest.experiments.sd3 import run as sd3_run
from specforest.options import SamplerOptions, declared_options

ROOT = Path(__file__).resolve().parents[1]

_SAMPLER_COMMANDS = (
    ("gmm",),
    ("pixel",),
    ("generate", "gmm"),
    ("generate", "pixel"),
    ("generate", "sd3"),
    ("tune",),
    ("sd3",),
)
"""The commands that run the sampler with options of their own (``diffusers`` aside: its options are its own)."""


def _command(path: tuple) -> click.Command:
    cmd = main
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def _param(cmd: click.Command, flag: str) -> click.Parameter:
    return next(p for p in cmd.params if flag in p.opts)


def test_every_field_is_declared_with_its_flag_key_and_exposure():
    declared = declared_options()
    assert tuple(declared) == SamplerOptions.names()
    # each placed by the commands but the named schedule's, which every command that runs the sampler takes
    assert {n for n, d in declared.items() if d.cli} == {*PLACED, "schedule", "sigma_min", "sigma_max"}
    assert extra_names() == ("schedule", "sigma_min", "sigma_max")
    for name, d in declared.items():
        assert d.name == name and d.key == name  # run records and tuned files key the options by their names
        assert d.tune in ("tuner", "constraint", "passed", "refused")
        assert (d.tune == "refused") == bool(d.refused)
    gmm = _command(("gmm",))
    for name, d in declared.items():
        if d.cli:
            assert _param(gmm, d.flag).name == name, name


def test_draft_chain_and_coupling_choices_are_the_registries():
    assert declared_options()["coupling"].allowed() == tuple(available_couplings())
    for path in _SAMPLER_COMMANDS:
        cmd = _command(path)
        if path != ("sd3",):  # (the sd3 study runs the em chain only)
            # (tune, which tunes pipelines too, offers their own scheduler's chain beside the registry's)
            extra = ("scheduler",) if path == ("tune",) else ()
            assert tuple(_param(cmd, "--chain").type.choices) == (*available_chains(), *extra), path
        if path != ("tune",):  # (tune takes --drafts, a list)
            assert tuple(_param(cmd, "--draft").type.choices) == tuple(available_drafts()), path
    register_draft("velocity-declared-test", lambda: FrozenPrediction("velocity"))
    register_chain("em-declared-test", lambda: EM(churn=0.5))
    register_coupling("grs-declared-test", GRS)
    try:
        assert "velocity-declared-test" in _param(_command(("gmm",)), "--draft").type.choices
        assert "em-declared-test" in _param(_command(("pixel",)), "--chain").type.choices
        assert "grs-declared-test" in declared_options()["coupling"].allowed()
        help_text = CliRunner().invoke(main, ["gmm", "--help"], terminal_width=400).output
        assert "velocity-declared-test" in help_text and "em-declared-test" in help_text
        # and taken: the parser accepts the plug-in's name (the run itself is not made: --help ends it)
        ctx = _command(("gmm",)).make_context(
            "gmm", ["--draft", "velocity-declared-test", "--chain", "em-declared-test"]
        )
        assert ctx.params["draft"] == "velocity-declared-test" and ctx.params["chain"] == "em-declared-test"
    finally:
        unregister_draft("velocity-declared-test")
        unregister_chain("em-declared-test")
        unregister_coupling("grs-declared-test")
    assert "velocity-declared-test" not in _param(_command(("gmm",)), "--draft").type.choices


_ONE_EDIT = textwrap.dedent(
    """
    import dataclasses, json, sys

    import torch

    import specforest.options as so
    from specforest.options import SamplerOptions, option

    assert "specforest.cli" not in sys.modules  # the command line is built after the edit

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Extended(SamplerOptions):  # the one edit: a field with its declaration
        boost: int = option(0, help="Test-only option: how much to boost (>= 0).", kind=int, low=0, key="boost_level")

    BOOSTS = []  # (not the edit: how the test sees each SamplerOptions a run makes, and its boost)

    def _seen(self):
        SamplerOptions.__post_init__(self)
        BOOSTS.append(self.boost)

    Extended.__post_init__ = _seen
    so.SamplerOptions = Extended

    import pathlib, tempfile

    import specforest
    from click.testing import CliRunner
    from specforest.cli import main
    from specforest.cli.sampler_options import extra_values
    from specforest.latency.options import split_options

    out = {}
    model = lambda x, t, **kw: -x
    res = specforest.sample(model, torch.zeros(2, 3), steps=4, churn=0.5, boost=2, seed=0)
    out["sample"] = list(res.samples.shape)
    out["sample_record"] = res.config.get("boost_level")
    try:
        specforest.sample(model, torch.zeros(2, 3), steps=4, churn=0.5, boosted=2, seed=0)
    except TypeError as e:
        out["unknown"] = str(e)
    gen = specforest.generate(model, count=2, make_x=lambda i: torch.zeros(len(i), 3), seed=0, steps=4, churn=0.5, boost=2)
    out["generate"] = sum(len(f.index) for f in gen)
    out["tune"] = split_options({"boost": 2})[1]
    out["declared"] = {k: v for k, v in dataclasses.asdict(so.declared_options()["boost"]).items() if k not in ("choices", "kind")}
    out["commands"] = {}
    for path in (("gmm",), ("pixel",), ("generate", "gmm"), ("generate", "pixel"), ("generate", "sd3"), ("tune",), ("sd3",)):
        cmd = main
        for name in path:
            cmd = cmd.commands[name]
        param = next((p for p in cmd.params if "--boost" in p.opts), None)
        text = CliRunner().invoke(main, [*path, "--help"], terminal_width=400).output
        parsed = cmd.make_context(path[-1], ["--boost", "3"], resilient_parsing=True).params.get("boost")
        out["commands"][" ".join(path)] = [param is not None and param.name, "Test-only option" in text, parsed]
    out["values"] = extra_values({"boost": 3, "steps": 4})
    out["at_default"] = extra_values({"boost": 0, "steps": 4})

    # the value reaches the run: every SamplerOptions it makes has it, and its record holds it under its key
    tmp = pathlib.Path(tempfile.mkdtemp())
    out["runs"] = {}

    def run(name, *args, record=None):
        del BOOSTS[:]
        res = CliRunner().invoke(main, [str(a) for a in args])
        recorded = res.output
        if res.exit_code == 0 and (record or "--json" in args):
            # the JSON of gmm and pixel, a job's (its sampler options) or the SD3 study's results (its last)
            rec = json.loads(record.read_text()) if record else json.loads(res.stdout)
            rec = rec[-1] if isinstance(rec, list) else rec.get("options", rec)
            rec = rec.get("sampler", rec)  # (a job's sampler options; specforest diffusers' options)
            recorded = rec.get("boost_level", "absent")
        out["runs"][name] = [res.exit_code, BOOSTS[:], recorded]

    SMALL = ["--steps", 4, "--K", 2, "--L", 1, "--no-progress"]
    GMM = [*SMALL, "--dim", 3, "--components", 2]
    JOB = ["--count", 2, "--batch", 2]
    # (a planned tree: its calibration run takes the option too)
    run("gmm", "gmm", *GMM, "--trajectories", 2, "--tree", "optimal", "--budget", 2, "--json", "--boost", 3)
    run("pixel", "pixel", *SMALL, "--samples", 2, "--json", "--boost", 3)
    run("generate gmm", "generate", "gmm", *GMM, *JOB, "--out", tmp / "g.npz", "--boost", 3, record=tmp / "g.json")
    run("generate pixel", "generate", "pixel", *SMALL, *JOB, "--out", tmp / "p.npz", "--boost", 3, record=tmp / "p.json")
    # resumed: the same value goes on; another (here none) is refused like any other changed option
    run("resume same", "generate", "gmm", *GMM, *JOB, "--out", tmp / "g.npz", "--boost", 3, "--resume")
    run("resume other", "generate", "gmm", *GMM, *JOB, "--out", tmp / "g.npz", "--resume")
    # a job without the option at its default holds no key: what a job file written before it existed holds
    run("no boost", "generate", "gmm", *GMM, *JOB, "--out", tmp / "o.npz", record=tmp / "o.json")
    run("old resumed", "generate", "gmm", *GMM, *JOB, "--out", tmp / "o.npz", "--resume")
    run("old boosted", "generate", "gmm", *GMM, *JOB, "--out", tmp / "o.npz", "--resume", "--boost", 3)

    sys.path.insert(0, "tests")
    from test_diffusers_sd3 import SEQ, build_tiny_pipeline

    torch.set_num_threads(1)
    (tmp / "tok").mkdir()
    build_tiny_pipeline(tmp / "tok").save_pretrained(str(tmp / "sd3"))
    (tmp / "captions.txt").write_text("a photo of a cat\\n")
    PIPE = ["--model", tmp / "sd3", "--prompts", tmp / "captions.txt", "--height", 16, "--width", 16]
    PIPE += ["--max-sequence-length", SEQ, "--dtype", "float32"]
    run("generate sd3", "generate", "sd3", *SMALL, *PIPE, "--count", 1, "--out", tmp / "img", "--boost", 3, record=tmp / "img.json")
    STUDY = ["--K-values", 2, "--L", 1, "--steps", 4, "--device", "cpu", "--no-progress", "--out", tmp / "study"]
    run("sd3", "sd3", *PIPE, *STUDY, "--boost", 3, record=tmp / "study" / "results.json")
    FAMILY = ["--pipeline", tmp / "sd3", "--prompts", tmp / "captions.txt", "--height", 16, "--width", 16]
    FAMILY += ["--max-sequence-length", SEQ, "--dtype", "float32", "--device", "cpu"]
    run("diffusers", "diffusers", *FAMILY, *SMALL, "--out", tmp / "fam", "--boost", 3, record=tmp / "fam" / "run.json")
    TUNE = ["--model", "gmm", "--dim", 3, "--components", 2, "--steps", 6, "--budget-max", 2, "--drafts", "velocity"]
    run("tune", "tune", *TUNE, "--no-progress", "--out", tmp / "t.json", "--boost", 3)
    out["tuned_for"] = json.loads((tmp / "t.json").read_text())["tuned_for"].get("boost_level")
    # a run with the file takes the value it was tuned with, and refuses another
    TUNED = ["gmm", "--dim", 3, "--components", 2, "--no-progress", "--tune", tmp / "t.json", "--json"]
    run("gmm tuned", *TUNED)
    run("gmm tuned other", *TUNED, "--boost", 4)
    print(json.dumps(out))
    """
)


def test_adding_an_option_is_one_edit():
    res = subprocess.run(
        [sys.executable, "-c", _ONE_EDIT], capture_output=True, text=True, timeout=600, cwd=ROOT, env=None
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["sample"] == [2, 3]
    assert "boost" in out["unknown"] and "boosted" in out["unknown"]  # the options listed include it
    assert out["generate"] == 2
    assert out["tune"] == {"boost": 2}  # passed to every run the tuner makes, as declared by default
    assert out["declared"]["key"] == "boost_level" and out["declared"]["flag"] == "--boost"
    assert out["declared"]["cli"] is True
    for path, (name, in_help, parsed) in out["commands"].items():
        assert name == "boost" and in_help and parsed == 3, path
    assert out["values"] == {"boost": 3}
    assert out["at_default"] == {}  # (left to the sampler: a record or job made before the option is the same)
    runs = out["runs"]
    for name in ("gmm", "pixel", "generate gmm", "generate pixel", "generate sd3"):
        code, boosts, recorded = runs[name]
        assert code == 0, (name, recorded)
        assert boosts and set(boosts) == {3}, (name, boosts)  # every SamplerOptions the run made had it
        assert recorded == 3, name  # under the declared key, boost_level
    assert len(runs["gmm"][1]) >= 2  # the calibration of the planned tree and the run
    assert runs["resume same"][0] == 0
    assert runs["resume other"][0] != 0 and "boost_level: 3 on disk, None now" in runs["resume other"][2]
    assert runs["no boost"][:1] == [0] and runs["no boost"][2] == "absent"
    assert runs["old resumed"][0] == 0
    assert runs["old boosted"][0] != 0 and "boost_level: None on disk, 3 now" in runs["old boosted"][2]
    # the SD3 study hands the option to specforest.diffusers.sample (every call: test_a_further_option_reaches_...):
    # carried to every run and recorded where that takes further options, else refused naming it; never dropped
    for name in ("sd3", "diffusers"):
        code, boosts, recorded = runs[name]
        assert code == 0 and boosts and set(boosts) == {3} and recorded == 3, (name, runs[name])
    # every run the tuner makes (its calibration, timing runs and race) takes it
    code, boosts, recorded = runs["tune"]
    assert code == 0 and len(boosts) > 3 and set(boosts) == {3}, runs["tune"]
    assert out["sample_record"] == 2  # specforest.sample's record: under its key
    assert out["tuned_for"] == 3  # the tuned file records it; a run with the file takes it, or refuses another
    # (the first SamplerOptions: Tuned.from_json's check of the file's configuration, at the defaults)
    code, boosts, recorded = runs["gmm tuned"]
    assert code == 0 and boosts[0] == 0 and boosts[1:] and set(boosts[1:]) == {3} and recorded == 3, runs["gmm tuned"]
    code, boosts, recorded = runs["gmm tuned other"]
    assert code == 2 and boosts == [0] and "--boost 4 here, 3 in the file" in recorded, runs["gmm tuned other"]


def _gmm_setting() -> "gmm_exp.GMMSetting":
    return gmm_exp.GMMSetting(dim=2, components=1, steps=4, trajectories=2)


def _job(**extra) -> "gen_exp.JobSpec":
    sampler = dict(method="dgrs", K=2, L=1, steps=4, churn=0.5, grid="flow_match")
    sampler.update(prefetch="nearest", verify="internal", draft="velocity", **extra)
    return gen_exp.JobSpec("gmm", 2, 0, sampler, {"dim": 2, "components": 1, "mixture_seed": 0})


def test_a_further_option_a_run_sets_itself_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"options: steps is an option that the gmm experiment's run sets itself"):
        gmm_exp.simulate(_gmm_setting(), options={"steps": 5})
    with pytest.raises(ValueError, match="churn, tree are options that the pixel experiment's run sets itself"):
        pixel_exp.simulate(samples=1, steps=4, options={"churn": 0.2, "tree": None, "record_deltas": True})
    with pytest.raises(ValueError, match="coupling is an option that a generate job sets itself"):
        _job(coupling="rank")
    with pytest.raises(ValueError, match="lazy is an option that the SD3 study sets itself"):
        sd3_exp.SD3Setting(options={"lazy": True})
    # a name that is no option, a key that is no option's, a value the record cannot keep
    with pytest.raises(TypeError, match="unexpected option.*boosted"):
        gmm_exp.simulate(_gmm_setting(), options={"boosted": 1})
    with pytest.raises(ValueError, match="'boost_level': no option of the sampler has this record key"):
        _job(boost_level=1)
    with pytest.raises(TypeError, match="options\\['model_kwargs'\\] must be a value JSON holds"):
        gmm_exp.simulate(_gmm_setting(), options={"model_kwargs": {"w": torch.ones(1)}})


def test_a_further_option_reaches_every_run_and_its_record(monkeypatch):
    # (a field of today's options that no experiment sets: record_deltas)
    rec = gmm_exp.run_config(_gmm_setting(), K=2, L=1, options={"record_deltas": True})
    assert rec["record_deltas"] is True
    assert _tree_kwargs(_job(model_kwargs={"w": 1}).sampler)["model_kwargs"] == {"w": 1}  # (a job's, every image's)
    # the SD3 study: every sampler call gets the setting's options; its records and its id hold them
    plain, deltas = sd3_exp.SD3Setting(), sd3_exp.SD3Setting(options={"record_deltas": True})
    assert deltas.as_dict()["record_deltas"] is True and "options" not in plain.as_dict()
    assert sd3_exp.setting_id(plain, ["a"], "m", "float32") != sd3_exp.setting_id(deltas, ["a"], "m", "float32")
    seen = []

    def spy(pipe, **kw):
        seen.append(kw)
        raise KeyboardInterrupt  # (enough: the call's keywords are what is checked)

    monkeypatch.setattr(sd3_run.sd, "sample", spy)
    with pytest.raises(KeyboardInterrupt):
        sd3_exp.run_config(None, ["a"], deltas, "standard", 0, 0, embeds={})
    assert seen[0]["record_deltas"] is True
