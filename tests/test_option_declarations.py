"""The sampler's options are declared once, on the fields of :class:`specforest.SamplerOptions`.

Adding an option is one edit: a field declared with :func:`specforest.options.option` is taken by
``sample``, ``generate`` and ``tune`` and appears, with its help, on every command that runs the sampler,
its record key with it (shown in a fresh process, on a test-only subclass put in the module's place before
the command line is built). And the registry-backed choices (``--draft``, ``--chain``, the ``coupling``
option) are the registries', a plug-in registered here offered at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import click
from click.testing import CliRunner

from specforest.chains import EM, available_chains, register_chain, unregister_chain
from specforest.cli import main
from specforest.cli.sampler_options import PLACED, extra_names
from specforest.couplings import GRS, available_couplings, register_coupling, unregister_coupling
from specforest.drafts import FrozenPrediction, available_drafts, register_draft, unregister_draft
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
    assert {n for n, d in declared.items() if d.cli} == set(PLACED)  # each placed by the commands, no extra today
    assert extra_names() == ()
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
            assert tuple(_param(cmd, "--chain").type.choices) == tuple(available_chains()), path
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

    so.SamplerOptions = Extended

    import specforest
    from click.testing import CliRunner
    from specforest.cli import main
    from specforest.cli.sampler_options import extra_values
    from specforest.latency.options import split_options

    out = {}
    model = lambda x, t, **kw: -x
    res = specforest.sample(model, torch.zeros(2, 3), steps=4, churn=0.5, boost=2, seed=0)
    out["sample"] = list(res.samples.shape)
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
