"""The command line runs any registered chain: ``--chain NAME`` with the chain's own options (``--eta``,
``--s-noise``, ``--s-churn``, ``--solver-type``) on ``gmm``, ``pixel``, ``generate`` and ``tune``.

Each run records its chain and parameters, and samples another law than the em chain's; an option the
chain does not take is refused naming the flag, the chain and its parameters; a tuned file holds the
chain it was tuned for, and a run on another chain is refused (a file written before chains is em).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import invoke, refused

import specforest
from specforest import streams, trees
from specforest.chains import EM, available_chains, get_chain
from specforest.experiments import generate as gen_exp
from specforest.latency import CostCurve, Tuned
from specforest.models import GaussianMixture

CHAIN = ["--chain", "euler_ancestral", "--eta", "0.7"]
PARAMS = {"eta": 0.7, "s_noise": 1.0, "path": "ve"}
QUIET = ["--no-progress", "--threads", "1"]
GMM = ["gmm", "--dim", 6, "--components", 2, "--steps", 10, "--trajectories", 3, "--K", 2, "--L", 2, *QUIET]
PIXEL = ["pixel", "--samples", 2, "--steps", 8, "--K", 2, "--L", 2, *QUIET]
GEN_GMM = ["generate", "gmm", "--dim", 6, "--components", 2, "--steps", 10, "--count", 4, "--batch", 2, *QUIET]
GEN_PIXEL = ["generate", "pixel", "--steps", 8, "--count", 2, "--batch", 2, *QUIET]
TUNE = ["tune", "--model", "gmm", "--dim", 6, "--components", 2, "--steps", 10, "--budget-max", 3]
TUNE += ["--drafts", "velocity", *QUIET]

# every command that runs the library sampler, with what it needs to run (an image job: a folder that is
# no pipeline, which its chain options are checked before)
COMMANDS = {
    "gmm": ["gmm"],
    "pixel": ["pixel"],
    "generate gmm": ["generate", "gmm", "--count", 1, "--out", "OUT.npz"],
    "generate pixel": ["generate", "pixel", "--count", 1, "--out", "OUT.npz"],
    "tune": ["tune", "--model", "gmm", "--out", "OUT.json"],
}


def _ok(res):
    assert res.exit_code == 0, res.output
    return res


def _record(*args) -> dict:
    return json.loads(_ok(invoke(*args, "--json")).output)


def _samples(path) -> np.ndarray:
    with np.load(path) as z:
        return z["samples"]


# -- --help ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [["gmm"], ["pixel"], ["generate", "gmm"], ["generate", "pixel"], ["generate", "sd3"], ["generate", "diffusers"]]
    + [["tune"]],
)
def test_help_lists_every_registered_chain_and_the_chain_options(command):
    out = _ok(invoke(*command, "--help")).output
    flat = "".join(out.split())
    extra = "|scheduler" if command in (["generate", "diffusers"], ["tune"]) else ""  # (a pipeline's own scheduler)
    assert "[" + "|".join(available_chains()) + extra + "]" in flat, out
    for flag in ("--chain", "--eta", "--s-noise", "--s-churn", "--solver-type"):
        assert flag in out


# -- a run on another chain records it and samples its law ---------------------------------------------


def test_gmm_runs_the_chain_and_records_it(tmp_path):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    rec = _record(*GMM, *CHAIN, "--dump-samples", a)
    em = _record(*GMM, "--dump-samples", b)
    assert rec["chain"] == "euler_ancestral" and rec["chain_params"] == PARAMS and rec["churn"] is None
    assert em["chain"] == "em" and em["chain_params"] == {"churn": 0.1} and em["churn"] == 0.1
    assert not np.array_equal(_samples(a), _samples(b))
    # the record is the library's run of the setting it names
    with np.load(a) as z:
        assert json.loads(str(z["result"]))["chain_params"] == PARAMS
    text = _ok(invoke(*GMM, *CHAIN)).output
    assert "chain euler_ancestral (eta=0.7, s_noise=1, path=ve)" in text


def test_pixel_runs_the_chain_and_records_it(tmp_path):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    rec = _record(*PIXEL, *CHAIN, "--dump-samples", a)
    em = _record(*PIXEL, "--dump-samples", b)
    assert rec["chain"] == "euler_ancestral" and rec["chain_params"] == PARAMS and rec["churn"] is None
    assert em["chain"] == "em" and em["churn"] == 0.3
    assert not np.array_equal(_samples(a), _samples(b))


@pytest.mark.parametrize("job", [GEN_GMM, GEN_PIXEL], ids=["gmm", "pixel"])
def test_generate_runs_the_chain_and_records_it_in_the_job(job, tmp_path):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    _ok(invoke(*job, *CHAIN, "--out", a))
    _ok(invoke(*job, "--out", b))
    sampler = json.loads(a.with_suffix(".json").read_text())["options"]["sampler"]
    assert sampler["chain"] == "euler_ancestral" and sampler["chain_params"] == PARAMS and sampler["churn"] is None
    em = json.loads(b.with_suffix(".json").read_text())["options"]["sampler"]
    assert em["chain"] == "em" and em["chain_params"] == {"churn": em["churn"]}
    assert not np.array_equal(_samples(a), _samples(b))
    # resumed with the same chain: complete; with another: refused, naming it
    assert "nothing to do" in _ok(invoke(*job, *CHAIN, "--out", a, "--resume")).output
    res = invoke(*job, "--chain", "ddim", "--out", a, "--resume")
    assert res.exit_code == 1 and "chain: 'euler_ancestral' on disk, 'ddim' now" in res.output, res.output


@pytest.mark.parametrize("job", [GMM, GEN_GMM], ids=["gmm", "generate gmm"])
def test_a_chain_of_history_two_runs_from_the_command_line_and_is_recorded(job, tmp_path):
    """``--chain dpmpp_3m_sde`` (two past predictions a step) with its options, from the registry's declaration."""
    out = tmp_path / "a.npz"
    args = [*job, "--chain", "dpmpp_3m_sde", "--eta", "0.8", "--s-noise", "1.05", "--schedule", "karras"]
    if job is GMM:
        rec = _record(*args, "--dump-samples", out)
    else:
        _ok(invoke(*args, "--out", out))
        rec = json.loads(out.with_suffix(".json").read_text())["options"]["sampler"]
    assert rec["chain"] == "dpmpp_3m_sde" and rec["chain_params"] == {"eta": 0.8, "s_noise": 1.05}
    assert np.isfinite(_samples(out)).all()


@pytest.mark.parametrize("job", [GMM, GEN_GMM], ids=["gmm", "generate gmm"])
def test_a_chain_of_two_stages_runs_from_the_command_line_and_is_recorded(job, tmp_path):
    """``--chain heun`` (two model calls a step) with its options, from the registry's declaration."""
    out = tmp_path / "a.npz"
    args = [*job, "--chain", "heun", "--s-churn", "5", "--s-noise", "1.01", "--schedule", "karras"]
    if job is GMM:
        rec = _record(*args, "--dump-samples", out)
    else:
        _ok(invoke(*args, "--out", out))
        rec = json.loads(out.with_suffix(".json").read_text())["options"]["sampler"]
    assert rec["chain"] == "heun" and rec["chain_params"]["s_churn"] == 5.0 and rec["chain_params"]["s_noise"] == 1.01
    assert np.isfinite(_samples(out)).all()


@pytest.mark.parametrize("job", [GMM, GEN_GMM, GEN_PIXEL], ids=["gmm", "generate gmm", "generate pixel"])
def test_dpmpp_sde_runs_from_the_command_line_and_is_recorded(job, tmp_path):
    """``--chain dpmpp_sde`` (a chain of half-steps carrying each step's start) with its options, its ``r`` at
    the default, recorded as every chain's parameters are."""
    out = tmp_path / "a.npz"
    args = [*job, "--chain", "dpmpp_sde", "--eta", "0.8", "--s-noise", "1.05", "--schedule", "karras"]
    if job is GMM:
        rec = _record(*args, "--dump-samples", out)
    else:
        _ok(invoke(*args, "--out", out))
        rec = json.loads(out.with_suffix(".json").read_text())["options"]["sampler"]
    assert rec["chain"] == "dpmpp_sde" and rec["chain_params"] == {"eta": 0.8, "s_noise": 1.05, "r": 0.5, "path": "ve"}
    assert np.isfinite(_samples(out)).all()


def test_a_job_started_before_chains_were_recorded_resumes_as_em(tmp_path, monkeypatch):
    # an interrupted job whose options.json has no chain keys (what a job written before chains holds)
    spec = gen_exp.JobSpec(
        "gmm",
        6,
        0,
        dict(method="dgrs", K=2, L=2, steps=10, churn=0.1, grid="flow_match", prefetch="nearest", verify="internal")
        | dict(draft="velocity"),
        dict(dim=6, components=2, mixture_seed=0),
    )
    real = gen_exp.generate

    def interrupted(*args, **kwargs):
        for k, f in enumerate(real(*args, **kwargs)):
            if k == 1:
                raise KeyboardInterrupt
            yield f

    monkeypatch.setattr(gen_exp, "generate", interrupted)
    out = tmp_path / "old.npz"
    with pytest.raises(KeyboardInterrupt):
        gen_exp.run_job(spec, out, batch=2)
    monkeypatch.setattr(gen_exp, "generate", real)
    assert "chain" not in json.loads((tmp_path / "old.npz.parts" / "options.json").read_text())["sampler"]
    job = ["generate", "gmm", "--dim", 6, "--components", 2, "--steps", 10, "--K", 2, "--L", 2, "--count", 6]
    job += [*QUIET, "--out", out]
    res = invoke(*job, "--chain", "euler_ancestral", "--resume")
    assert res.exit_code == 1 and "chain: 'em' on disk, 'euler_ancestral' now" in res.output, res.output
    _ok(invoke(*job, "--resume"))
    ref = tmp_path / "ref.npz"
    _ok(invoke(*job[:-1], ref))
    np.testing.assert_array_equal(_samples(out), _samples(ref))


# -- refusals: each names the flag, the chain and its parameters ----------------------------------------


REFUSALS = [
    (["--chain", "ddpm", "--s-churn", "3"], ["--s-churn is not a parameter of chain 'ddpm'; its parameters: variance"]),
    (["--chain", "ddim", "--churn", "0.5"], ["--churn is not a parameter of chain 'ddim'; its parameters: eta"]),
    (["--eta", "0.5"], ["--eta is not a parameter of chain 'em'; its parameters: churn"]),
    (["--chain", "lcm", "--eta", "1", "--s-churn", "1"], ["--eta, --s-churn are not parameters of chain 'lcm'"]),
    (["--chain", "ddim", "--eta", "-1"], ["--eta", "eta must be a finite number >= 0"]),
    (["--chain", "euler_ancestral", "--s-noise", "0"], ["--s-noise", "s_noise must be"]),
    (["--chain", "dpmpp_2m_sde", "--solver-type", "euler"], ["--solver-type", "solver_type must be one of"]),
    (["--chain", "euler", "--s-churn", "5"], ["--chain euler does not run on", "starts at t = 1"]),
    (
        ["--chain", "dpmpp_sde", "--path", "linear"],
        ["--chain dpmpp_sde does not run on", "starts at t = 1", "percent_to_sigma(1e-4)", "--schedule"],
    ),
    (["--chain", "nope"], ["--chain", "nope"]),
]


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("args,named", REFUSALS, ids=[" ".join(a) for a, _ in REFUSALS])
def test_a_chain_option_the_chain_does_not_take_is_refused_before_the_work(tmp_path, no_work, command, args, named):
    line = [str(a).replace("OUT", str(tmp_path / "out")) for a in COMMANDS[command]]
    refused(invoke(*line, *args), *named)
    assert not list(tmp_path.iterdir())


def test_tune_for_a_pipeline_refuses_the_chain_options(tmp_path, no_work):
    res = invoke("tune", "--model", "sd3", "--chain", "ddim", "--eta", "0.5", "--out", tmp_path / "t.json")
    refused(res, "--chain, --eta apply only to --model gmm, digits, natural32, natural64 or diffusers", "em chain")


# -- tune: the file holds the chain, a run on another chain is refused ----------------------------------


@pytest.fixture(scope="module")
def tuned_files(tmp_path_factory):
    """``(euler_ancestral eta 0.7, em)`` tuned files of the small mixture."""
    tmp = tmp_path_factory.mktemp("tuned")
    paths = tmp / "chain.json", tmp / "em.json"
    _ok(invoke(*TUNE, *CHAIN, "--out", paths[0]))
    _ok(invoke(*TUNE, "--out", paths[1]))
    return paths


def test_tune_records_the_chain_and_a_tuned_run_takes_it(tuned_files, tmp_path):
    path, _ = tuned_files
    data = json.loads(path.read_text())
    assert data["chain"] == "euler_ancestral" and data["chain_params"] == PARAMS and data["churn"] is None
    made_for = data["tuned_for"]
    assert made_for["chain"] == "euler_ancestral" and made_for["chain_params"] == PARAMS and made_for["churn"] is None
    tuned = Tuned.from_json(data)
    assert tuned.run_chain() == get_chain("euler_ancestral", eta=0.7)
    # the chain and its options are taken from the file, as the steps are
    rec = _record("gmm", "--dim", 6, "--components", 2, *QUIET, "--tune", path)
    assert rec["chain"] == "euler_ancestral" and rec["chain_params"] == PARAMS and rec["steps"] == 10
    rec = _record("gmm", "--dim", 6, "--components", 2, *QUIET, *CHAIN, "--tune", path)
    assert rec["chain_params"] == PARAMS
    out = tmp_path / "g.npz"
    _ok(invoke("generate", "gmm", "--dim", 6, "--components", 2, "--count", 2, *QUIET, "--tune", path, "--out", out))
    assert json.loads(out.with_suffix(".json").read_text())["options"]["sampler"]["chain"] == "euler_ancestral"


@pytest.mark.parametrize(
    "args,named",
    [
        (["--chain", "em"], ["--chain em here, euler_ancestral in the file"]),
        (["--chain", "ddim"], ["--chain ddim here, euler_ancestral in the file"]),
        (["--eta", "0.5"], ["--eta 0.5 here, 0.7 in the file (chain euler_ancestral)"]),
        (["--churn", "0.3"], ["--churn is not a parameter of chain 'euler_ancestral'"]),
    ],
)
def test_a_run_on_another_chain_than_the_tuned_one_is_refused(tuned_files, tmp_path, no_work, args, named):
    path, _ = tuned_files
    refused(invoke("gmm", "--dim", 6, "--components", 2, "--tune", path, *args), *named)
    out = tmp_path / "g.npz"
    refused(invoke("generate", "gmm", "--dim", 6, "--components", 2, "--count", 1, "--tune", path, *args, "--out", out))


def test_an_em_tuned_file_refuses_another_chain_and_an_old_file_loads_as_em(tuned_files, tmp_path):
    _, path = tuned_files
    data = json.loads(path.read_text())
    assert data["chain"] == "em" and data["chain_params"] == {"churn": 0.1} and data["churn"] == 0.1
    gmm = ["gmm", "--dim", 6, "--components", 2, *QUIET, "--tune"]
    refused(invoke(*gmm, path, "--chain", "ddim"), "--chain ddim here, em in the file")
    # a file written before chains were kept: no chain keys, read as em
    for d in (data, data["tuned_for"]):
        del d["chain"], d["chain_params"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert Tuned.from_json(data).chain == "em"
    assert _record(*gmm, old)["chain"] == "em"
    refused(invoke(*gmm, old, *CHAIN), "--chain euler_ancestral here, em in the file")


# -- the library: sample(**tuned) runs the chain it was tuned for ----------------------------------------


def _tuned(**chain) -> Tuned:
    return Tuned(
        label="test",
        tree=trees.chain(2),
        coupling="rmc",
        verify="internal",
        draft="x0",
        batch=2,
        steps=8,
        predicted_seconds_per_image=1.0,
        predicted_speedup=1.0,
        standard_seconds_per_image=1.0,
        predicted_calls=5.0,
        curve=CostCurve((1,), (1.0,)),
        **chain,
    )


def test_sample_with_a_tuned_chain_runs_it_and_refuses_another():
    gmm = GaussianMixture.paper(dim=4, components=2, seed=0)
    x = streams.randn(0, torch.arange(2), (4,))
    tuned = _tuned(chain="euler_ancestral", chain_params={"eta": 0.7})
    assert tuned.churn is None and tuned["chain"] == get_chain("euler_ancestral", eta=0.7)
    out = specforest.sample(gmm, x, seed=0, **tuned)
    same = specforest.sample(gmm, x, steps=8, seed=0, chain=get_chain("euler_ancestral", eta=0.7), **tuned.options())
    assert out.config["chain"] == "euler_ancestral" and out.config["eta"] == 0.7
    assert torch.equal(out.samples, same.samples)
    with pytest.raises(TypeError, match="chain"):
        specforest.sample(gmm, x, seed=0, chain="ddim", **tuned)
    with pytest.raises(ValueError, match="churn=0.3 is the em chain's parameter; chain 'euler_ancestral'"):
        specforest.sample(gmm, x, seed=0, churn=0.3, **tuned)
    # an em configuration unpacks as before: no chain, the churn checked
    em = _tuned(churn=0.3)
    assert "chain" not in em and em.chain_params == {"churn": 0.3} and isinstance(em.run_chain(), EM)


def test_a_tuned_file_round_trips_its_chain_and_refuses_a_wrong_one():
    edm = _tuned(chain=get_chain("euler", s_churn=10.0))
    data = json.loads(json.dumps(edm.to_json(), allow_nan=False))  # s_tmax = inf kept as null
    assert data["chain_params"]["s_tmax"] is None
    assert Tuned.from_json(data).run_chain() == get_chain("euler", s_churn=10.0)
    for change, named in [
        ({"chain": "nope"}, "chain"),
        ({"chain": "ddim", "chain_params": {"variance": "fixed_small"}}, "variance"),
        ({"chain": "ddim", "chain_params": {"eta": -1.0}}, "eta"),
        ({"chain": "ddim", "chain_params": {}, "churn": 0.3}, "churn"),
        ({"chain_params": [1]}, "chain_params"),
    ]:
        with pytest.raises((TypeError, ValueError), match=named):
            Tuned.from_json({**data, **change})
    # kept together: a file without both is em (written before them), one with either holds both
    for other in ("chain", "chain_params"):
        with pytest.raises(ValueError, match=f"needs the field\\(s\\) {other}"):
            Tuned.from_json({k: v for k, v in data.items() if k != other})
