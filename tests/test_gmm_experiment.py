"""The Gaussian-mixture experiment: CLI, sweep, result files, and the mixture's law.

Tiny settings (d = 8..20, T ~ 10, few trajectories) keep these fast; the two
statistical tests use a few thousand trajectories in d = 10..20 and a fixed seed.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from scipy import stats as sps

from specforest import memory, trees
from specforest.cli import main
from specforest.experiments import common
from specforest.experiments import gmm as gmm_exp
from specforest.experiments.io import atomic_write, atomic_write_text

TINY = ["--dim", "8", "--steps", "10", "--trajectories", "6", "--no-progress"]
REQUIRED = {
    "method",
    "K",
    "L",
    "budget",
    "trajectories",
    "nfe_mean",
    "nfe_sem",
    "speedup_mean",
    "speedup_sem",
    "speedup_paper_mean",
    "speedup_paper_sem",
    "accept_rate_per_depth",
    "delta_per_depth",
    "accept_rate",
    "wall_seconds",
    "target_seconds",
    "grid",
    "churn",
    "steps",
    "dim",
    "components",
    "prefetch",
    "verify",
    "seed",
    "mixture_seed",
    "mode",
    "chunk_size",
}


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def run_json(*args: str) -> dict:
    res = invoke("gmm", *TINY, "--json", *args)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


# -- one configuration ------------------------------------------------------------------


@pytest.mark.parametrize("method,extra", [("standard", []), ("rmc", ["--L", "14"]), ("dgrs", ["--K", "2", "--L", "3"])])
def test_json_one_object_with_required_keys(method, extra):
    rec = run_json("--method", method, *extra)
    assert REQUIRED <= rec.keys()
    assert rec["method"] == method and rec["trajectories"] == 6 and rec["dim"] == 8
    assert rec["grid"] == "flow_match" and rec["mode"] == "full"
    assert 1 <= rec["nfe_mean"] <= 10
    if method == "standard":
        assert rec["nfe_mean"] == 10 and rec["speedup_mean"] == 1 and rec["speedup_paper_mean"] == 1
        assert (rec["K"], rec["L"], rec["budget"]) == (0, 0, 0)
    elif method == "rmc":
        assert (rec["K"], rec["L"], rec["budget"]) == (1, 14, 14)
    else:
        assert (rec["K"], rec["L"], rec["budget"]) == (2, 3, 14)
        assert len(rec["accept_rate_per_depth"]) == 3 and 0 < rec["accept_rate"] < 1


def test_speedup_accountings_are_consistent():
    setting = gmm_exp.GMMSetting(dim=8, steps=10, trajectories=1)
    rec = gmm_exp.run_config(setting, method="dgrs", K=2, L=3)
    nfe = rec["nfe_mean"]
    assert rec["speedup_mean"] == pytest.approx(10 / nfe)
    assert rec["speedup_paper_mean"] == pytest.approx(8 / (nfe - 2))
    assert rec["nfe_sem"] is None  # one trajectory has no standard error


def test_uniform_grid_is_recorded():
    rec = run_json("--grid", "uniform", "--method", "rmc", "--L", "3")
    assert rec["grid"] == "uniform" and rec["deterministic_steps"] == 2


def test_json_stdout_stays_clean_with_progress():
    res = invoke("gmm", "--dim", "8", "--steps", "10", "--trajectories", "3", "--K", "2", "--L", "2", "--json")
    assert res.exit_code == 0
    assert json.loads(res.stdout)["method"] == "dgrs"


def test_lazy_mode_is_recorded():
    rec = run_json("--lazy", "--K", "2", "--L", "3")
    assert rec["mode"] == "lazy" and 1 <= rec["nfe_mean"] <= 10
    # the children drawn at one node and scratch, in float32 states; the tree's 15 int64 keys
    assert rec["bytes_per_trajectory"] == (7 * 2 + 8) * 8 * 4 + 8 * 15
    # nothing to realize lazily without a tree
    assert run_json("--lazy", "--method", "standard")["mode"] == "full"


@pytest.mark.parametrize(
    "method,extra,title",
    [
        ("dgrs", [], "D-GRS, K=2 L=2 (B=6)"),
        ("rank", [], "rank coupling, K=2 L=2 (B=6)"),
        ("antithetic", [], "antithetic pairs, K=2 L=2 (B=6)"),
        ("rmc", [], "RMC, chain B=2"),
        ("standard", [], "standard sampler"),
        ("rank", ["--tree", "optimal", "--budget", "4"], "rank coupling, optimal tree DraftTree("),
    ],
)
def test_human_summary_without_json(method, extra, title):
    res = invoke("gmm", *TINY, "--method", method, "--K", "2", "--L", "2", *extra)
    assert res.exit_code == 0, res.output
    assert title in res.stdout and "speedup" in res.stdout


def test_dump_samples_are_the_runs_samples(tmp_path):
    path = tmp_path / "s.npz"
    rec = run_json("--dump-samples", str(path), "--K", "2", "--L", "2")
    # the library's run of the configuration the record describes
    fields = ("dim", "components", "steps", "churn", "trajectories", "grid", "mixture_seed")
    setting = gmm_exp.GMMSetting(**{k: rec[k] for k in fields})
    run = gmm_exp.simulate(setting, **{k: rec[k] for k in ("method", "K", "L", "prefetch", "verify", "seed")})
    with np.load(path) as z:
        assert z["samples"].dtype == np.float32
        assert np.array_equal(z["samples"], run.samples.numpy())
        assert json.loads(str(z["result"]))["speedup_mean"] == rec["speedup_mean"] == run.record["speedup_mean"]
    assert [p.name for p in tmp_path.iterdir()] == ["s.npz"]


def test_seed_changes_noise_not_mixture(tmp_path):
    a, b, c = (tmp_path / f"{n}.npz" for n in "abc")
    small = ["--K", "2", "--L", "2"]
    ra = run_json("--seed", "1", "--dump-samples", str(a), *small)
    rb = run_json("--seed", "2", "--dump-samples", str(b), *small)
    run_json("--seed", "1", "--dump-samples", str(c), *small)
    assert ra["mixture_fingerprint"] == rb["mixture_fingerprint"]
    assert not np.array_equal(np.load(a)["samples"], np.load(b)["samples"])
    assert np.array_equal(np.load(a)["samples"], np.load(c)["samples"])
    assert run_json("--mixture-seed", "3", *small)["mixture_fingerprint"] != ra["mixture_fingerprint"]
    s1 = gmm_exp.GMMSetting(dim=8, mixture_seed=0).mixture()
    s2 = gmm_exp.GMMSetting(dim=8, mixture_seed=0, trajectories=3).mixture()
    assert torch.equal(s1.means, s2.means)


@pytest.mark.parametrize(
    "args,name",
    [
        (["--K", "0"], "--K"),
        (["--L", "-1"], "--L"),
        (["--churn", "0"], "--churn"),
        (["--churn", "1.5"], "--churn"),
        (["--method", "magic"], "--method"),
        (["--grid", "cosine"], "--grid"),
        (["--trajectories", "0"], "--trajectories"),
        (["--steps", "2"], "--steps"),
        (["--prefetch", "child"], "--prefetch"),
        (["--verify", "all"], "--verify"),
        (["--memory-gb", "0"], "--memory-gb"),
        (["--seed", "-3"], "--seed"),
    ],
)
def test_bad_values_exit_nonzero_naming_the_option(args, name):
    res = CliRunner().invoke(main, ["gmm", *TINY, *args])
    assert res.exit_code != 0
    assert name in res.output


def test_sweep_rejects_bad_lists(tmp_path):
    res = CliRunner().invoke(main, ["gmm", "sweep", "--out", str(tmp_path), "--K-values", "0,2"])
    assert res.exit_code != 0 and "--K-values" in res.output
    res = CliRunner().invoke(main, ["gmm", "sweep", "--out", str(tmp_path), "--L-values", "a"])
    assert res.exit_code != 0 and "--L-values" in res.output


def test_group_options_before_subcommand_are_refused(tmp_path):
    res = CliRunner().invoke(main, ["gmm", "--K", "3", "sweep", "--out", str(tmp_path)])
    assert res.exit_code != 0 and "--K" in res.output


# -- chunking and memory --------------------------------------------------------------------


def test_chunked_run_is_valid_and_equals_the_unchunked_run(monkeypatch):
    # the chunking arithmetic, with the process's own memory taken out (it drifts from call to call)
    monkeypatch.setattr(memory, "held_bytes", lambda device="cpu": 0)
    setting = gmm_exp.GMMSetting(dim=8, steps=10, trajectories=7)
    tree = gmm_exp.method_tree("dgrs", 2, 2, 10)
    one = memory.estimate(
        trajectories=1,
        state_numel=8,
        tree=tree,
        steps=10,
        model=setting.mixture(),
        limit_bytes=10**12,
        history=0,
        stages=1,
    )
    whole_call = one.trajectory_bytes + one.rows * one.row_bytes
    # two trajectories fit with their whole calls, three do not
    dynamic = int(2.5 * whole_call)
    limit = (one.fixed_bytes + dynamic + memory.allocator_slack(dynamic)) / 1e9
    rec = gmm_exp.run_config(setting, method="dgrs", K=2, L=2, memory_gb=limit)
    assert rec["chunk_size"] == 2 and rec["chunks"] == 4
    assert rec["trajectories"] == 7 and 1 <= rec["nfe_mean"] <= 10 and rec["speedup_sem"] > 0
    run = gmm_exp.simulate(setting, method="dgrs", K=2, L=2, memory_gb=limit)
    whole = gmm_exp.simulate(setting, method="dgrs", K=2, L=2)
    assert whole.record["chunks"] == 1
    # per-sample streams: the memory limit's chunking changes no sample
    torch.testing.assert_close(run.samples, whole.samples, atol=1e-6, rtol=0)
    assert run.record["nfe_mean"] == whole.record["nfe_mean"]
    # the CLI takes the same path
    rec2 = run_json("--K", "2", "--L", "2", "--verify", "internal", "--memory-gb", f"{limit:.12f}")
    assert rec2["chunks"] == 3 and rec2["trajectories"] == 6 and rec2["memory_estimate_gb"] <= limit


def test_a_run_that_cannot_fit_is_refused_with_a_clear_error():
    res = CliRunner().invoke(main, ["gmm", *TINY, "--K", "3", "--L", "3", "--memory-gb", "1e-9"])
    assert res.exit_code != 0 and "--lazy" in res.output and "memory limit" in res.output


# -- sweep ----------------------------------------------------------------------------


SWEEP = [
    "gmm",
    "sweep",
    "--dim",
    "8",
    "--steps",
    "8",
    "--trajectories",
    "4",
    "--K-values",
    "1,2",
    "--L-values",
    "2,3",
    "--no-progress",
]


def test_sweep_writes_files_and_resumes(tmp_path):
    out = tmp_path / "sweep"
    res = invoke(*SWEEP, "--out", str(out))
    assert res.exit_code == 0, res.output
    # D-GRS at 4 cells + RMC at the distinct budgets {2, 3, 6, 14}
    assert "ran 8 configuration(s), skipped 0" in res.stdout
    for name in ("results.csv", "results.json", "heatmap.png", "speedup_vs_K.png"):
        assert (out / name).stat().st_size > 0
        assert (out / name).read_bytes()[:4] == b"\x89PNG" or not name.endswith(".png")
    first = json.loads((out / "results.json").read_text())
    assert len(first) == 8 and {r["method"] for r in first} == {"rmc", "dgrs"}
    assert sorted(r["budget"] for r in first if r["method"] == "rmc") == [2, 3, 6, 14]
    lines = (out / "results.csv").read_text().splitlines()
    assert len(lines) == 9 and lines[0].startswith("method,K,L,budget")
    # cheapest first: budgets never shrink along a method's run order
    dg = [r["budget"] for r in first if r["method"] == "dgrs"]
    assert dg == sorted(dg)

    res2 = invoke(*SWEEP, "--out", str(out))
    assert res2.exit_code == 0
    assert "ran 0 configuration(s), skipped 8" in res2.stdout
    assert json.loads((out / "results.json").read_text()) == first

    # a different setting in the same directory is a new configuration set
    res3 = invoke(*[a if a != "4" else "5" for a in SWEEP], "--out", str(out), "--L-values", "2", "--K-values", "1")
    assert "ran 2 configuration(s), skipped 0" in res3.stdout
    assert len(json.loads((out / "results.json").read_text())) == 10


def test_sweep_library_call_and_summary(tmp_path):
    setting = gmm_exp.GMMSetting(dim=8, steps=8, trajectories=3)
    logged = []
    res = gmm_exp.run_sweep(setting, tmp_path, K_values=[2], L_values=[2], progress=False, log=logged.append)
    assert res.ran == 2 and res.skipped == 0 and len(logged) == 2
    table = gmm_exp.format_summary(res.records)
    assert " 2  2        6" in table


def test_sweep_configs_order_and_dedup():
    cfg = gmm_exp.sweep_configs([2, 5], [2, 4], steps=30)
    # (2,4) and (5,2) both have B = 30: one RMC run serves both
    assert cfg.count(("rmc", 1, 30)) == 1
    assert len(cfg) == 4 + 3
    assert cfg.index(("dgrs", 2, 2)) < cfg.index(("dgrs", 5, 2)) < cfg.index(("dgrs", 5, 4))


# -- crash safety -----------------------------------------------------------------------


def test_interrupted_write_leaves_old_file(tmp_path):
    path = tmp_path / "results.json"
    atomic_write_text(path, "old")

    def boom(f):
        f.write("partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, boom)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["results.json"]


def test_sweep_interrupted_while_writing_keeps_valid_results(tmp_path, monkeypatch):
    setting = gmm_exp.GMMSetting(dim=8, steps=8, trajectories=3)
    gmm_exp.run_sweep(setting, tmp_path, K_values=[1], L_values=[2], progress=False)
    before = (tmp_path / "results.json").read_text()
    real = common.records_csv

    def crash(records):
        if len(records) > 2:
            raise OSError("disk full")
        return real(records)

    monkeypatch.setattr(common, "records_csv", crash)
    with pytest.raises(OSError):
        gmm_exp.run_sweep(setting, tmp_path, K_values=[1, 2], L_values=[2], progress=False)
    recs = json.loads((tmp_path / "results.json").read_text())  # still parses
    assert len(recs) == 3 and json.loads(before) == recs[:2]
    assert len((tmp_path / "results.csv").read_text().splitlines()) == 3
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    monkeypatch.undo()
    res = gmm_exp.run_sweep(setting, tmp_path, K_values=[1, 2], L_values=[2], progress=False)
    assert res.skipped == 3 and res.ran == 1


# -- the mixture's law (issue item 4) ----------------------------------------------------------


def test_standard_sampler_component_weights():
    """Samples of the standard sampler fall into each component with its weight."""
    setting = gmm_exp.GMMSetting(dim=20, steps=30, trajectories=2000, mixture_seed=1)
    gmm = setting.mixture()
    run = gmm_exp.simulate(setting, method="standard", seed=0)
    comp = gmm.assign(run.samples)
    counts = torch.bincount(comp, minlength=gmm.num_components).numpy()
    expected = gmm.weights.numpy() * counts.sum()
    p = sps.chisquare(counts, expected).pvalue
    assert p > 1e-4, (counts, p)
    # samples sit at their component's scale: normalized squared distance ~ chi2_d / d
    # (0.88 here: the Euler-Maruyama chain's own bias at T = 30, not sampling noise)
    z2 = ((run.samples.double() - gmm.means[comp]) ** 2).sum(1) / (gmm.stds[comp] ** 2 * gmm.dim)
    assert abs(z2.mean().item() - 1) < 0.25


def projection_ks_pvalue(a: torch.Tensor, b: torch.Tensor, n_proj: int = 8, seed: int = 123) -> float:
    """Bonferroni-corrected min p-value of two-sample KS tests on fixed random projections."""
    g = torch.Generator().manual_seed(seed)
    dirs = torch.randn(a.shape[1], n_proj, generator=g, dtype=torch.float64)
    dirs /= dirs.norm(dim=0, keepdim=True)
    pa, pb = (a.double() @ dirs).numpy(), (b.double() @ dirs).numpy()
    p = min(sps.ks_2samp(pa[:, j], pb[:, j]).pvalue for j in range(n_proj))
    return min(1.0, p * n_proj)


def test_speculative_matches_standard_in_law():
    """D-GRS (3, 3) and the standard sampler are indistinguishable; a biased sample is not."""
    setting = gmm_exp.GMMSetting(dim=10, steps=20, trajectories=3000, mixture_seed=2)
    std = gmm_exp.simulate(setting, method="standard", seed=1).samples
    spec_run = gmm_exp.simulate(setting, method="dgrs", K=3, L=3, seed=2)
    spec = spec_run.samples
    assert spec_run.record["speedup_mean"] > 1.1
    assert projection_ks_pvalue(std, spec) > 1e-4
    # power check: keeping a third of one component's samples (weight 0.2 -> 0.08) is detected
    gmm = setting.mixture()
    comp = gmm.assign(spec)
    keep = (comp != 0) | (torch.arange(len(comp)) % 3 == 0)
    assert projection_ks_pvalue(std, spec[keep]) < 1e-4


def test_a_draft_tree_runs_as_given_and_is_recorded_as_custom():
    setting = gmm_exp.GMMSetting(dim=8, steps=10, trajectories=4)
    tree = trees.widths([2, 3, 1])
    run = gmm_exp.simulate(setting, method="rank", tree=tree, lazy=True)
    r = run.record
    assert run.tree is tree
    assert (r["tree"], r["K"], r["L"], r["budget"]) == ("custom", 3, 3, tree.budget)
    assert r["nfe_mean"] < setting.steps
    with pytest.raises(ValueError, match="tree method"):
        gmm_exp.run_config(setting, method="rmc", tree=tree)
    with pytest.raises(ValueError, match="even number"):
        gmm_exp.run_config(setting, method="antithetic", tree=trees.uniform(3, 2))


def test_sweep_runs_the_new_couplings_as_methods(tmp_path):
    configs = gmm_exp.sweep_configs([1, 2, 3], [2], 10, methods=["dgrs", "rank", "antithetic"])
    assert (
        ("antithetic", 2, 2) in configs and ("antithetic", 3, 2) not in configs and ("antithetic", 1, 2) not in configs
    )
    assert {("rank", k, 2) for k in (1, 2, 3)} <= set(configs)
    with pytest.raises(ValueError, match="methods"):
        gmm_exp.sweep_configs([2], [2], 10, methods=["bogus"])
    res = invoke(
        "gmm",
        "sweep",
        "--methods",
        "rank,antithetic",
        "--K-values",
        "2",
        "--L-values",
        "2",
        "--dim",
        "8",
        "--steps",
        "10",
        "--trajectories",
        "4",
        "--lazy",
        "--no-progress",
        "--out",
        str(tmp_path),
    )
    assert res.exit_code == 0, res.output
    recs = json.loads((tmp_path / "results.json").read_text())
    assert sorted(r["method"] for r in recs) == ["antithetic", "rank", "rmc"]
    assert "rank T/NFE" in res.stdout and "antithetic T/NFE" in res.stdout
    res = invoke("gmm", "sweep", "--methods", "rank,nope", "--out", str(tmp_path))
    assert res.exit_code != 0 and "methods" in res.output


@pytest.mark.parametrize("method,extra", [("standard", []), ("dgrs", ["--K", "2", "--L", "2"])])
def test_speedup_is_over_the_chains_standard_calls(method, extra):
    # heun makes two calls a step and one into 0 (2 T - 1 = 19 at T = 10), and its last step is its only
    # deterministic one: a record's speedups count those calls (one trajectory: its own ratios)
    chain = ["--chain", "heun", "--s-churn", "1", "--schedule", "karras", "--trajectories", "1"]
    rec = run_json("--method", method, *extra, *chain)
    assert rec["standard_calls"] == 19 and rec["deterministic_steps"] == 1
    nfe = rec["nfe_mean"]
    if method == "standard":
        assert nfe == 19
    assert rec["speedup_mean"] == pytest.approx(19 / nfe)
    assert rec["speedup_paper_mean"] == pytest.approx(18 / (nfe - 1))


def test_a_chain_of_half_steps_records_its_deterministic_steps():
    # dpmpp_sde walks 2 T - 1 half-steps (11 at T = 6), the last into 0 without noise: one deterministic
    # step, not T minus its 10 noisy half-steps (-4)
    rec = run_json("--chain", "dpmpp_sde", "--steps", "6", "--schedule", "karras", "--method", "standard")
    assert rec["deterministic_steps"] == 1 and rec["standard_calls"] == rec["nfe_mean"] == 11


def test_a_chain_of_half_steps_keeps_the_length_asked_for():
    # dpmpp_sde at T = 6 walks 11 half-steps: --method rmc --L 10 drafts a chain of 10, not one cut to T = 6
    rec = run_json("--chain", "dpmpp_sde", "--steps", "6", "--schedule", "karras", "--method", "rmc", "--L", "10")
    assert rec["L"] == rec["budget"] == 10 and "DraftTree(L=10, budget=10" in rec["tree_layers"]
