"""The wall-clock cost model: the cost curve, expected steps against closed forms, and tuning decisions."""

from __future__ import annotations

import json
import math

import pytest
import torch
from scipy import stats as sps

import specforest
from specforest import streams, trees
from specforest.latency import CostCurve, Tuned, TunedFor, expected_steps, predict_seconds, steps_moments, tune
from specforest.models import GaussianMixture


def test_cost_curve_interpolates_and_extends_by_the_last_slope():
    c = CostCurve((1, 2, 4), (1.0, 1.5, 3.5))
    assert c(1) == 1.0 and c(2) == 1.5 and c(3) == pytest.approx(2.5) and c(0.5) == 1.0
    assert c(8) == pytest.approx(3.5 + 1.0 * 4)  # slope (3.5 - 1.5) / 2 per row
    assert c.relative() == [1.0, 1.5, 3.5]


@pytest.mark.parametrize("a", [0.0, 0.3, 0.8, 1.0])
@pytest.mark.parametrize("L", [1, 3, 7])
def test_steps_of_a_chain_match_the_truncated_geometric_law(a, L):
    # Z = min(G, L) with P(Z >= j) = a^(j - 1): E[Z] = sum a^(j-1), E[Z^2] = sum (2j - 1) a^(j-1)
    mean, var = steps_moments(trees.chain(L), lambda level, k: a)
    m1 = sum(a ** (j - 1) for j in range(1, L + 1))
    m2 = sum((2 * j - 1) * a ** (j - 1) for j in range(1, L + 1))
    assert mean == pytest.approx(m1) and var == pytest.approx(m2 - m1 * m1, abs=1e-12)


def test_expected_steps_of_a_tree_use_its_widths_per_depth():
    def acc(level, k):
        return {1: 0.5, 2: 0.9}[k] * (0.9 ** (level - 1))

    t = trees.uniform(2, 3)
    a1, a2, a3 = (acc(level, 2) for level in (1, 2, 3))
    assert expected_steps(t, acc) == pytest.approx(1 + a1 * (1 + a2 * (1 + a3 * 0)))
    irregular = trees.widths([2, 1])
    b1, b2 = acc(1, 2), acc(2, 1)
    assert expected_steps(irregular, acc) == pytest.approx(1 + b1 * 1) and b2 > 0


def test_a_batch_is_predicted_to_take_as_long_as_its_slowest_trajectory():
    curve = CostCurve((1, 1024), (1.0, 1.0))
    one = predict_seconds(curve, 30, 1, trees.chain(4), "internal", lambda level, k: 0.7, 0.0)
    many = predict_seconds(curve, 30, 64, trees.chain(4), "internal", lambda level, k: 0.7, 0.0)
    assert many[1] > one[1]
    assert predict_seconds(curve, 30, 64, None, "internal", None, 0.0) == (30.0, 30.0)


def test_a_round_takes_each_verification_s_acceptance_from_the_stretch_it_falls_in():
    """Acceptance 1 on the first half of the stochastic steps and 0 on the second: a chain of 15
    from the start accepts its first 10 children and rejects the 11th (11 steps), then every
    round commits one residual step: 2 + 1 + 9 + 1 = 13 calls. Taking the whole round's
    acceptance from the stretch it starts in would accept all 15 and predict 2 + 1 + 5 + 1 = 9."""
    curve = CostCurve((1, 1024), (1.0, 1.0))
    bins = [(0.5, lambda level, k: 1.0), (0.5, lambda level, k: 0.0)]
    seconds, calls = predict_seconds(curve, 22, 1, trees.chain(15), "internal", bins, 0.0)
    assert calls == 13 and seconds == 13.0
    # all easy: one round of 15 and one of 5
    easy = [(0.5, lambda level, k: 1.0)] * 2
    assert predict_seconds(curve, 22, 1, trees.chain(15), "internal", easy, 0.0)[1] == 2 + 2 + 1


def test_a_round_drafts_from_the_evaluation_the_previous_round_left():
    """A chain of 2 whose first child is accepted and second rejected, from a sibling's or the root's own
    evaluation (acceptance 1 at depth 1, 0 at depth 2). Internal mode: a 2-step round is rejected at the
    unevaluated leaf level, so the next round drafts from an evaluation one step older, meets depth 2's
    mismatch at depth 1 and commits 1 step; its rejected child was evaluated, so the round after drafts
    from a sibling again: 2, 1, 2, 1, ... over 20 stochastic steps is 13 rounds, 16 calls. Drafted mode:
    the leaves are evaluated, every round commits 2 (10 rounds, 13 calls). ``prefetch="parent"``: after
    the first round every draft starts one step old (1 + 18 rounds, 22 calls)."""
    curve = CostCurve((1, 1024), (1.0, 1.0))
    acc = [(1.0, lambda level, k: 1.0 if level == 1 else 0.0)]
    tree = trees.chain(2)
    assert predict_seconds(curve, 22, 1, tree, "internal", acc, 0.0)[1] == 16
    assert predict_seconds(curve, 22, 1, tree, "drafted", acc, 0.0)[1] == 13
    assert predict_seconds(curve, 22, 1, tree, "internal", acc, 0.0, prefetch="parent")[1] == 22
    with pytest.raises(ValueError, match="prefetch must be one of"):
        predict_seconds(curve, 22, 1, tree, "internal", acc, 0.0, prefetch="sibling")


@pytest.mark.parametrize("verify", ["internal", "drafted"])
@pytest.mark.parametrize("tree", [trees.chain(6), trees.uniform(2, 3)], ids=str)
def test_one_trajectory_is_predicted_by_its_expectation_which_simulated_runs_approach(tree, verify):
    """The exact expectation of one trajectory's run against 3000 simulated runs of the same law
    (within 4 standard errors), with a curve that prices rows, two stretches and a row-dependent round."""
    from specforest.latency import law

    curve = CostCurve((1, 1024), (1.0, 3.0))
    bins = [(0.4, lambda level, k: 0.95 - 0.1 * level), (0.6, lambda level, k: 0.7 - 0.05 * level + 0.05 * k)]
    seconds, calls = predict_seconds(curve, 40, 1, tree, verify, bins, lambda rows: 0.01 * rows)
    captured = {}
    real = law._simulated

    def spy(*args, **kwargs):
        captured["args"] = args[1:5]
        return real(*args, **kwargs)

    law._simulated = spy
    try:
        predict_seconds(curve, 40, 2, tree, verify, bins, lambda rows: 0.01 * rows)  # the same law, simulated
    finally:
        law._simulated = real
    many = 3000
    runs = [real(1, *captured["args"], runs=1, seed=i) for i in range(many)]
    ends = 3 * (curve(1) + 0.01)  # the first step, the fetch and the last step
    for exact, sim in ((seconds - ends, [r[0] for r in runs]), (calls - 3, [r[1] for r in runs])):
        m = sum(sim) / many
        se = (sum((v - m) ** 2 for v in sim) / (many - 1) / many) ** 0.5
        assert abs(exact - m) < 4 * se + 1e-12


@pytest.mark.parametrize("verify", ["internal", "drafted"])
@pytest.mark.parametrize("tree", [trees.chain(5), trees.uniform(2, 3), trees.widths([3, 1, 2])], ids=str)
def test_the_round_law_with_the_next_prefetch_sums_to_the_law_of_committed_steps(tree, verify):
    from specforest.latency.law import PREFETCH_KINDS, _round_law, _steps_law

    def acc(level, k):
        return 0.9 - 0.1 * level + 0.02 * k

    joint = _round_law(tree, acc, verify, "nearest")
    assert len(joint) == len(PREFETCH_KINDS)
    marginal = [sum(row[j] for row in joint) for j in range(len(joint[0]))]
    assert marginal == pytest.approx(_steps_law(tree, acc), abs=1e-12)
    # ... and has the closed-form moments of the steps, in either mode
    mean, var = steps_moments(tree, acc)
    m1 = sum(j * pj for j, pj in enumerate(marginal))
    m2 = sum(j * j * pj for j, pj in enumerate(marginal))
    assert sum(marginal) == pytest.approx(1.0) and m1 == pytest.approx(mean) and m2 - m1 * m1 == pytest.approx(var)
    # a round ends at an unevaluated node only in internal mode
    assert (sum(joint[PREFETCH_KINDS.index("own")]) > 0) == (verify == "drafted")


@pytest.fixture(scope="module")
def gmm():
    return GaussianMixture.paper(dim=8, components=3, seed=0)


def _virtual_clock(monkeypatch) -> list:
    """``time.perf_counter`` on a virtual clock ``[seconds]`` that stands still unless the test moves it: the
    sampler's own time is then 0 and a call costs what the test says, so no decision or number of the
    tuner depends on how fast or loaded the machine is."""
    import time

    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    return clock


def test_tuning_follows_the_hardware(gmm, monkeypatch):
    _virtual_clock(monkeypatch)
    x = streams.randn(0, torch.arange(8), (8,))
    opts = dict(steps=20, churn=0.3, drafts=("velocity",), budget_max=14)
    # a network whose call costs 1 s whatever its rows: speculation pays
    flat = tune(gmm, x, batch=1, curve=CostCurve((1, 4096), (1.0, 1.0)), **opts)
    assert flat.tree is not None and flat.predicted_speedup > 1.5
    # a call that costs 1 s per row: nothing beats one row per step
    linear = tune(gmm, x, batch=1, curve=CostCurve((1, 4096), (1.0, 4096.0)), **opts)
    assert linear.tree is None and linear.label == "standard" and linear.predicted_speedup == 1.0
    assert [c["label"] for c in linear.candidates][0] == "standard"
    # most trees' calls alone cost more than the standard sampler's: they are not timed
    untimed = [c for c in linear.candidates if not c["timed"]]
    assert len(untimed) > len(linear.candidates) / 2
    assert all(c["network_seconds_per_image_at_least"] > linear.standard_seconds_per_image for c in untimed)
    # an untimed candidate's calls alone cost more than the chosen configuration's whole prediction
    best = flat.predicted_seconds_per_image
    assert all(c["network_seconds_per_image_at_least"] > best for c in flat.candidates if not c["timed"])
    assert any(c["timed"] and c["label"] == flat.label for c in flat.candidates)


def test_a_tuned_configuration_runs_and_survives_json(gmm):
    x = streams.randn(0, torch.arange(8), (8,))
    tuned = tune(
        gmm,
        x,
        steps=20,
        churn=0.3,
        batch=2,
        curve=CostCurve((1, 4096), (1.0, 1.0)),
        drafts=("velocity",),
        budget_max=6,
    )
    assert set(tuned) == {"tree", "coupling", "verify", "draft", "prefetch", "tuned_for"}
    assert set(tuned.options()) == {"tree", "coupling", "verify", "draft", "prefetch"}
    assert tuned.tuned_for == TunedFor(steps=20, batch=2, churn=0.3)
    back = Tuned.from_json(json.loads(json.dumps(tuned.to_json())))
    assert back.label == tuned.label and back.predicted_seconds_per_image == tuned.predicted_seconds_per_image
    assert (back.tree is None) == (tuned.tree is None)
    if tuned.tree is not None:
        assert back.tree.parent.tolist() == tuned.tree.parent.tolist()
    assert back.tuned_for == tuned.tuned_for and back.prefetch == tuned.prefetch
    out = specforest.sample(gmm, x[:2], steps=20, churn=0.3, seed=0, **back)
    assert torch.isfinite(out.samples).all() and math.isfinite(back.predicted_speedup)
    with pytest.raises(ValueError, match="batch must be in"):
        tune(gmm, x, steps=20, churn=0.3, batch=9, curve=CostCurve((1,), (1.0,)))


def test_the_tune_command_writes_its_choice_and_prediction(tmp_path):
    from click.testing import CliRunner

    from specforest.cli import main

    out = tmp_path / "tuned.json"
    threads = torch.get_num_threads()
    try:
        res = CliRunner().invoke(
            main,
            [
                "tune",
                "--model",
                "gmm",
                "--dim",
                "8",
                "--components",
                "3",
                "--steps",
                "12",
                "--budget-max",
                "6",
                "--drafts",
                "velocity",
                "--threads",
                "1",
                "--no-progress",
                "--out",
                str(out),
            ],
        )
    finally:
        torch.set_num_threads(threads)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert {"predicted_seconds_per_image", "predicted_speedup", "coupling", "verify", "draft", "tree"} <= set(data)
    assert data["predicted_seconds_per_image"] > 0 and data["tuned_for"]["threads"] == 1
    assert "chosen:" in res.output and Tuned.from_json(data).label == data["label"]


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
    from click.testing import CliRunner

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
    from click.testing import CliRunner

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


def test_plan_tree_optimizes_latency_on_request(gmm, monkeypatch):
    from specforest import planning

    _virtual_clock(monkeypatch)
    x = streams.randn(0, torch.arange(2), (8,))  # two trajectories: the latency objective tunes for a batch of 2
    kw = dict(budget=14, steps=16, churn=0.3, coupling="grs", seed=0)
    calls = planning.plan_tree(gmm, x, **kw)
    assert calls is not None and calls.budget <= 14
    # a call that costs 1 s per row (and the sampler's own time 0 on the virtual clock): no tree pays in seconds
    linear = CostCurve((1, 4096), (1.0, 4096.0))
    assert planning.plan_tree(gmm, x, objective="latency", curve=linear, **kw) is None
    flat = CostCurve((1, 4096), (1.0, 1.0))
    assert planning.plan_tree(gmm, x, objective="latency", curve=flat, **kw) is not None
    with pytest.raises(ValueError, match="objective must be one of"):
        planning.plan_tree(gmm, x, objective="nfe", **kw)
    tuned = planning.tune(gmm, x, steps=16, churn=0.3, batch=1, drafts=("velocity",), budget_max=6, curve=flat)
    assert isinstance(tuned, Tuned)


@pytest.mark.parametrize("tree", [trees.chain(6), trees.uniform(2, 3), trees.widths([3, 1, 2])], ids=str)
def test_the_simulated_law_of_committed_steps_has_the_closed_form_moments(tree):
    from specforest.latency.law import _steps_law

    def acc(level, k):
        return 0.9 - 0.1 * level + 0.02 * k

    p = _steps_law(tree, acc)
    mean, var = steps_moments(tree, acc)
    m1 = sum(j * pj for j, pj in enumerate(p))
    m2 = sum(j * j * pj for j, pj in enumerate(p))
    assert sum(p) == pytest.approx(1.0) and m1 == pytest.approx(mean) and m2 - m1 * m1 == pytest.approx(var)


def test_the_network_factor_scales_the_calls_only():
    curve = CostCurve((1, 1024), (1.0, 1.0))
    assert predict_seconds(curve, 30, 1, None, "internal", None, 0.5, 2.0) == (30 * (2.0 + 0.5), 30.0)
    assert predict_seconds(curve, 30, 1, None, "internal", None, 0.5, 2.0, 1.5) == (1.5 + 30 * 2.5, 30.0)
    one = predict_seconds(curve, 30, 1, trees.chain(4), "internal", lambda level, k: 0.7, 0.0)
    two = predict_seconds(curve, 30, 1, trees.chain(4), "internal", lambda level, k: 0.7, 0.0, 2.0)
    assert two == (pytest.approx(2 * one[0]), one[1])


def test_a_rounds_cost_grows_with_its_rows_and_adds_up_to_the_measured_time():
    from specforest.latency import RoundCost

    def run(rows, fixed, per_row, t=0.0):
        calls = []
        for r in rows:  # a call of 1 ms, then the sampler's gap before the next one
            calls.append((r, t, t + 1e-3))
            t += 1e-3 + fixed + per_row * r
        return calls

    rows = [8, 8, 60, 60, 60, 40, 20, 8]
    runs = [run(rows, 2e-3, 1e-4), run(rows[::-1], 2e-3, 1e-4, t=5.0)]
    total = 2 * (len(rows) * 2e-3 + 1e-4 * sum(rows))
    cost = RoundCost.fit(runs, total)
    assert cost.fixed == pytest.approx(2e-3, rel=1e-6) and cost.per_row == pytest.approx(1e-4, rel=1e-6)
    # scaled to the runs' measured time in rounds (the gaps miss the first round's start)
    half = RoundCost.fit(runs, total / 2)
    assert half(10) == pytest.approx(cost(10) / 2)
    # rows that never change: a constant per round, the measured mean
    flat = RoundCost.fit([run([5] * 6, 3e-3, 0.0)], 6 * 3e-3)
    assert flat.per_row == 0.0 and flat(5) == pytest.approx(3e-3)
    # the constant model (what a fit that ignored the rows would give) mispredicts a short round
    assert abs(cost(8) - total / (2 * len(rows))) > 0.5e-3
    # the prediction costs each simulated call at its rows
    curve = CostCurve((1, 1024), (1.0, 1.0))
    assert predict_seconds(curve, 30, 4, None, "internal", None, cost)[0] == pytest.approx(30 * (1.0 + cost(4)))


def test_the_allocator_keeps_freed_memory_on_linux():
    import sys

    from specforest.allocator import keep_freed_memory

    assert keep_freed_memory() is sys.platform.startswith("linux")
    assert keep_freed_memory() is keep_freed_memory()  # once per process


def _virtually_timed(gmm, monkeypatch, cost, runs=None):
    """The mixture as a model whose calls take ``cost(inside a sampling run, rows)`` seconds on the
    virtual clock of :func:`_virtual_clock` (everything else takes none), as the tuner sees it.
    With ``runs`` a list, each run the tuner makes is appended to it as ``(its options, its stats)``."""
    from specforest.latency import measure

    inside = [False]
    real_sample = measure.sample

    def in_run(*args, **kwargs):
        inside[0] = True
        try:
            out = real_sample(*args, **kwargs)
        finally:
            inside[0] = False
        if runs is not None:
            runs.append((kwargs, out.stats))
        return out

    virtual = _virtual_clock(monkeypatch)
    monkeypatch.setattr(measure, "sample", in_run)

    def model(x, sigma, **kw):
        virtual[0] += cost(inside[0], x.shape[0])
        return gmm(x, sigma, **kw)

    return model


def _timing(calibrator, tree=None, coupling="grs"):
    """The timing a calibrator recorded for a configuration (verified ``internal``, draft ``velocity``)."""
    from specforest.latency import Config

    return calibrator.calibration.timings[Config(tree, coupling)]


def test_calls_slower_inside_a_run_are_measured_and_predicted(gmm, monkeypatch):
    """A model whose calls cost 4 s inside a run and 2 s back to back on the virtual clock (as when the sampler's work
    between calls evicts the network from the caches): the factor is 2, and the standard sampler's
    prediction carries it; with a given curve nothing is assumed about the model (factor 1)."""
    from specforest import latency

    model = _virtually_timed(gmm, monkeypatch, lambda in_run, rows: 4.0 if in_run else 2.0)
    x = streams.randn(0, torch.arange(2), (8,))
    pred = latency.Calibrator.calibrate(model, x, steps=6, churn=0.3, batch=1, budget_max=2)
    assert pred.network_factor() == 1.0  # nothing timed yet
    seconds, calls, s_round = pred.predict(None)
    factor = pred.network_factor()
    assert factor == pytest.approx(2.0, rel=1e-12) and pred.curve(1) == 2.0
    setup = _timing(pred).setup_seconds
    assert setup >= 0 and seconds == pytest.approx(setup + 6 * (factor * pred.curve(1) + s_round))
    given = latency.Calibrator.calibrate(model, x, steps=6, churn=0.3, batch=1, budget_max=2, curve=pred.curve)
    given.predict(None)
    assert given.network_factor() == 1.0


def test_configurations_timed_side_by_side_take_turns_and_keep_their_timed_runs(gmm, monkeypatch):
    """``Calibrator.time``: each turn makes an untimed then a timed run of every configuration in
    turn (up to TIMING_RUNS turns while a configuration's runs are cheap); the median of the timed
    runs replaces the earlier timing, and the untimed runs count for nothing."""
    from dataclasses import replace

    from specforest import latency
    from specforest.latency import Config, TimingRun

    x = streams.randn(0, torch.arange(2), (8,))
    pred = latency.Calibrator.calibrate(gmm, x, steps=6, churn=0.3, batch=1, budget_max=2)
    chain = trees.chain(2)
    pred.predict(chain, "rmc")  # an earlier, sequential timing
    order = []

    def run(per_round, wall):
        return TimingRun(per_round, 0.0, per_round, 0.0, 0.0, (), wall)

    def fake(self, config, index):
        order.append((config.coupling, index))
        return run(100.0 if index % 2 == 0 else 0.001 * (index // 2 + 1) * (2 if config.coupling == "rmc" else 1), 0.01)

    monkeypatch.setattr(latency.Calibrator, "_timing_run", fake)
    standard, chained = Config(None, "grs"), (chain, "rmc", "internal", "velocity")  # a Config or its tuple
    pred.time([standard, chained])
    turns = latency.TIMING_RUNS
    assert order == [(c, i) for t in range(turns) for c in ("grs", "rmc") for i in (2 * t, 2 * t + 1)]
    # the timed runs' median: 0.001 x (1 .. turns), twice that for the chain
    mid = (turns - 1) // 2 + 1
    assert _timing(pred).seconds_per_round == pytest.approx(0.001 * mid)
    assert _timing(pred, chain, "rmc").seconds_per_round == pytest.approx(0.002 * mid)
    # a configuration whose runs took long enough stops after its first turn
    order.clear()

    def slow(self, config, index):
        order.append((config.coupling, index))
        return run(0.001, latency.REPEAT_BELOW_SECONDS if config.coupling == "rmc" else 0.01)

    monkeypatch.setattr(latency.Calibrator, "_timing_run", slow)
    pred.time([standard, chained])
    assert [o for o in order if o[0] == "rmc"] == [("rmc", 0), ("rmc", 1)]
    assert len([o for o in order if o[0] == "grs"]) == 2 * turns
    order.clear()
    pred.time([chained], min_seconds=10 * latency.REPEAT_BELOW_SECONDS)
    assert len(order) == 2 * turns  # a longer budget: every turn
    # fresh: the calls and timings of before are forgotten (the factor follows the machine now)
    pred.calibration = replace(pred.calibration, calls=((1, 5.0),) * 10)
    assert pred.predictor.factor_by_rows()(1) == 5.0
    pred.time([standard], fresh=True)
    assert pred.calibration.calls == () and pred.predictor.factor_by_rows()(1) == 1.0  # the fakes time no call
    with pytest.raises(ValueError, match="min_seconds must be >= 0"):
        pred.time([standard], min_seconds=-1.0)
    assert set(pred.calibration.timings) == {standard}


def test_the_network_factor_is_measured_per_configuration_and_priced_by_rows(gmm, monkeypatch):
    """Calls of one row cost 3x the curve inside a run, calls of more rows 1x (6 s and 2 s of virtual
    clock): the standard sampler's own factor is 3, a chain's (whose rounds evaluate up to three rows) less, their
    median is the pooled factor, and the predictions price each call by its rows (3 at one row,
    1 at more), which no single factor does."""
    from specforest.latency import Calibrator, Config, Predictor, RoundCost, Timing, measure

    model = _virtually_timed(gmm, monkeypatch, lambda in_run, rows: 6.0 if in_run and rows == 1 else 2.0)
    monkeypatch.setattr(measure, "TIMING_RUNS", 1)
    x = streams.randn(0, torch.arange(2), (8,))
    pred = Calibrator.calibrate(model, x, steps=8, churn=0.3, batch=1, budget_max=2)
    pred.predict(None)
    chain = trees.chain(3)
    pred.predict(chain, "rmc")
    standard, own = pred.network_factor(None, "grs"), pred.network_factor(chain, "rmc")
    assert standard == pytest.approx(3.0, rel=1e-12)
    assert 1.0 < own < 0.8 * standard, (own, standard)
    assert pred.network_factor() == pytest.approx((own + standard) / 2)
    # a configuration not timed yet is priced at the pooled factor
    assert pred.network_factor(trees.chain(2), "rmc") == pred.network_factor()
    # the predictions price a call by its rows, from every timed call
    by_rows = pred.predictor.factor_by_rows()
    assert by_rows(1) == pytest.approx(3.0, rel=1e-12) and by_rows(3) == pytest.approx(1.0, rel=1e-12)
    seconds, _, s_round = pred.predict(None)
    assert seconds == pytest.approx(_timing(pred).setup_seconds + 8 * (by_rows(1) * pred.curve(1) + s_round))
    # one slow configuration's runs move its own factor and the pool's median, not the per-row prices
    slow = Timing(0.0, 0.0, RoundCost(0.0), network_seconds=50.0, curve_seconds=1.0)
    more = Predictor(pred.calibration.timed(Config(trees.chain(5), "rmc"), slow))
    assert more.network_factor() == pytest.approx(max(own, standard))
    assert more.factor_by_rows()(1) == by_rows(1)
    assert pred.network_factor() == pytest.approx((own + standard) / 2)  # a new record: this one is as it was


def _racing(gmm, monkeypatch, runs=None):
    """A model whose call costs 5 s on the virtual clock whatever its rows (and a round's own time 0), so that
    trees are predicted faster than the standard sampler and reach the race."""
    model = _virtually_timed(gmm, monkeypatch, lambda in_run, rows: 5.0, runs)
    x = streams.randn(0, torch.arange(4), (8,))
    return model, x, dict(steps=12, churn=0.3, batch=1, budget_max=4, drafts=("velocity",))


def test_a_finalist_must_beat_the_standard_sampler_in_every_repeat_of_the_race(gmm, monkeypatch):
    """A finalist 25% faster at the median of three repeats but 2% slower in one is not chosen (its
    median gain is within the machine's noise); one at least 6% faster in every repeat is."""
    from specforest import latency

    model, x, opts = _racing(gmm, monkeypatch)

    def fake_race(times_of_first):
        def race(self, configs, repeats):
            out = [[1.0, 1.0, 1.0] for _ in configs]
            out[1] = list(times_of_first)  # the finalist predicted fastest
            return out

        return race

    pred = latency.Calibrator.calibrate(model, x, **{k: v for k, v in opts.items() if k != "budget_max"})
    monkeypatch.setattr(latency.Calibrator, "race", fake_race([0.8, 0.8, 1.02]))
    assert tune(model, x, predictor=pred, **opts).label == "standard"
    monkeypatch.setattr(latency.Calibrator, "race", fake_race([0.9, 0.9, 0.94]))
    chosen = tune(model, x, predictor=pred, **opts)
    assert chosen.label != "standard" and chosen.measured_speedup == pytest.approx(1.0 / 0.9)


def test_the_race_measures_the_finalists_side_by_side(gmm, monkeypatch):
    """With a measured curve the finalists race the standard sampler in full runs, interleaved, and
    what the race records for each is the time of its own full runs: 5 s of virtual clock per call
    of that run."""
    from specforest import latency

    runs: list = []
    model, x, opts = _racing(gmm, monkeypatch, runs)
    races: list = []
    real_race = latency.Calibrator.race

    def recorded(self, configs, repeats):
        first = len(runs)
        times = real_race(self, configs, repeats)
        races.append((configs, times, runs[first:]))
        return times

    monkeypatch.setattr(latency.Calibrator, "race", recorded)
    tuned = tune(model, x, **opts)
    raced = [c for c in tuned.candidates if c.get("measured_seconds_per_image") is not None]
    assert tuned.measured_speedup is not None and {"standard"} < {c["label"] for c in raced} and len(raced) <= 4
    back = Tuned.from_json(json.loads(json.dumps(tuned.to_json())))
    assert back.measured_speedup == tuned.measured_speedup
    # the race ran, repeat after repeat, each entry's full run (all 12 steps, the tuned batch, the
    # entry's own configuration) and timed that run: 5 s per call it made
    ((configs, times, made),) = races
    assert len(made) == 3 * len(configs) and configs[0].tree is None and len(configs) == len(raced)
    for k, (kw, stats) in enumerate(made):
        config = configs[k % len(configs)]
        assert kw["steps"] == 12 and stats.steps == 12 and kw["tree"] is config.tree
        assert (kw["coupling"], kw["verify"], kw["draft"]) == (config.coupling, config.verify, config.draft)
        assert times[k % len(configs)][k // len(configs)] == pytest.approx(5.0 * stats.calls, rel=1e-12)
    assert times[0] == pytest.approx([5.0 * 12] * 3, rel=1e-12)  # the standard sampler: one call a step
    # the table's measured seconds are the medians of those runs, and the speedup their ratio
    medians = sorted(sorted(t)[1] for t in times)
    assert sorted(c["measured_seconds_per_image"] for c in raced) == pytest.approx(medians)
    chosen = next(c for c in raced if c["label"] == tuned.label)
    assert tuned.measured_speedup == pytest.approx(sorted(times[0])[1] / chosen["measured_seconds_per_image"])
    no_race = tune(model, x, race=0, **opts)
    assert no_race.measured_speedup is None
    with pytest.raises(ValueError, match=r"race must be an int >= 0"):
        tune(model, x, race=-1, **opts)
    with pytest.raises(ValueError, match=r"race_repeats must be an int >= 1"):
        tune(model, x, race_repeats=0, **opts)
    with pytest.raises(TypeError, match="sigmas_for must be callable"):
        tune(model, x, sigmas_for=[1.0, 0.0], **opts)
    races.clear()
    tune(model, x, curve=CostCurve((1, 4096), (1.0, 1.0)), **opts)  # a given curve: no race
    assert races == []


def _predictor_with_records(records: torch.Tensor, steps: int):
    """A predictor whose RMC calibration is ``records (n, 3)`` rows ``(depth, step, delta)``, nothing timed."""
    from specforest.latency import Calibration, Predictor

    curve = CostCurve((1,), (1.0,))
    return Predictor(
        Calibration(steps=steps, churn=0.3, batch=1, curve=curve, acceptance={("velocity", "rmc"): records})
    )


def test_acceptance_bins_resolve_each_step_and_borrow_where_records_are_few():
    # 12 steps, 10 stochastic: 8 records at each parent step 1..10, easy (delta 0) on steps 1-5 and
    # hard (delta 6) on 6-10, except step 3, which has 2 hard records only
    rows = []
    for s in range(1, 11):
        n, d = (2, 6.0) if s == 3 else (8, 0.0 if s <= 5 else 6.0)
        rows += [(1.0, float(s), d)] * n
    pred = _predictor_with_records(torch.tensor(rows, dtype=torch.float64), steps=12)
    bins = pred.acceptance_bins("rmc", "velocity")
    assert len(bins) == 10 and all(abs(w - 0.1) < 1e-12 for w, _ in bins)
    acc = [a(1, 1) for _, a in bins]
    rmc = lambda d: 2 * sps.norm.sf(d / 2)  # noqa: E731
    assert acc[0] == pytest.approx(1.0, abs=1e-3) and acc[4] == pytest.approx(1.0, abs=1e-3)
    assert acc[5] == pytest.approx(rmc(6.0), abs=1e-3) and acc[9] == pytest.approx(rmc(6.0), abs=1e-3)
    # step 3 borrows steps 2 and 4 (16 easy records beside its 2 hard ones), not its own 2 alone
    assert acc[2] == pytest.approx((16 * 1.0 + 2 * rmc(6.0)) / 18, abs=2e-3)
    # one stretch for the whole grid cannot tell the halves apart
    whole = [a(1, 1) for _, a in pred.acceptance_bins("rmc", "velocity", bins=1)]
    assert len(whole) == 1 and 0.3 < whole[0] < 0.7
    with pytest.raises(ValueError, match="bins must be an int >= 1"):
        pred.acceptance_bins("rmc", "velocity", bins=0)


def _records(steps: int) -> torch.Tensor:
    """Made-up calibration records ``(depth, step, delta)``: 4 a depth at each stochastic step, easier early."""
    rows = [(float(d), float(s), 0.2 * d + 0.1 * s) for s in range(1, steps - 1) for d in range(1, 5)]
    return torch.tensor(rows, dtype=torch.float64)


def test_a_prediction_is_a_pure_function_of_a_calibration_built_by_hand():
    from dataclasses import FrozenInstanceError

    from specforest.latency import Calibration, Config, Predictor, RoundCost, Timing

    chain, standard = Config(trees.chain(4), "rmc"), Config()
    cal = Calibration(
        steps=20,
        churn=0.3,
        batch=2,
        curve=CostCurve((1, 64), (1.0, 3.0)),
        acceptance={("velocity", "grs"): _records(20), ("velocity", "rmc"): _records(20)},
        curve_measured=True,
        timings={
            standard: Timing(0.1, 0.5, RoundCost(0.1), network_seconds=2.4, curve_seconds=2.0),
            chain: Timing(0.2, 0.5, RoundCost(0.05, 0.01), network_seconds=3.0, curve_seconds=2.0),
        },
        calls=((1, 1.2),) * 8 + ((64, 0.9),) * 8,
    )
    pred = Predictor(cal)
    first = pred.predict(chain)
    # predict_seconds on the calibration's ingredients: the stretches' acceptance, the chain's round
    # cost and set-up, the calls priced by their rows (1.2 at one row, 0.9 at 64)
    by_rows = pred.factor_by_rows()
    assert by_rows(1) == pytest.approx(1.2) and by_rows(64) == pytest.approx(0.9)
    bins = pred.acceptance_bins("rmc", "velocity")
    assert len(bins) == 18 and bins[0][1](1, 1) > bins[-1][1](1, 1)  # easier early
    seconds, calls = predict_seconds(
        cal.curve, 20, 2, chain.tree, "internal", bins, RoundCost(0.05, 0.01), by_rows, 0.5
    )
    assert first.seconds_per_image == seconds / 2 and first.calls == calls and first.sampler_seconds_per_round == 0.2
    # what was asked before changes nothing, and a second predictor of the same record answers the same
    pred.predict(standard), pred.network_seconds(Config(trees.uniform(2, 2))), pred.network_factor()
    assert pred.predict(chain) == first == Predictor(cal).predict(chain)
    assert pred.network_factor(chain) == 1.5 and pred.network_factor() == pytest.approx(1.35)
    # a configuration the calibration did not time is refused, not timed
    with pytest.raises(ValueError, match="was not timed"):
        pred.predict(Config(trees.uniform(2, 2)))
    # the record cannot change under a predictor; a new timing is a new record
    with pytest.raises(FrozenInstanceError):
        cal.steps = 30
    with pytest.raises(TypeError):
        cal.timings[standard] = None
    more = cal.timed(Config(trees.uniform(2, 2)), Timing(0.3, 0.0, RoundCost(0.3), 10.0, 2.0))
    assert Predictor(more).network_factor() == pytest.approx(1.5) and pred.network_factor() == pytest.approx(1.35)
    assert Config(trees.chain(4), "rmc") == chain and len({chain, Config(trees.chain(4), "rmc"), standard}) == 2
    with pytest.raises(TypeError, match="timings must map each Config"):
        Calibration(steps=20, churn=0.3, batch=2, curve=cal.curve, timings={"standard": cal.timings[standard]})


def test_tune_predicts_every_candidate_from_its_final_calibration(gmm, monkeypatch):
    """Calls that cost more inside a run, and more with their rows (virtual clock): the network factor by
    rows moves as candidates are timed, and the table, the choice and its prediction are the predictor's
    of the calibration with every timing run in it; the pruned candidates were never timed."""
    from specforest.latency import Calibrator, tuner

    model = _virtually_timed(gmm, monkeypatch, lambda in_run, rows: (3.0 if in_run else 2.0) + 0.5 * rows)
    x = streams.randn(0, torch.arange(4), (8,))
    opts = dict(steps=12, churn=0.3, batch=2, drafts=("velocity",))
    meter = Calibrator.calibrate(model, x, **opts)
    tuned = tune(model, x, predictor=meter, budget_max=6, race=0, **opts)
    pred = meter.predictor
    cands = {c.name: c.config for c in tuner.candidates(pred.acceptance("grs", "velocity"), 6, 12, ["velocity"])}
    timed = [c for c in tuned.candidates if c["timed"]]
    assert timed and len(timed) < len(tuned.candidates)  # some were pruned
    assert set(meter.calibration.timings) == {cands[c["label"]] for c in timed}
    for c in timed:
        p = pred.predict(cands[c["label"]])
        assert (c["seconds_per_image"], c["calls"], c["sampler_seconds_per_round"]) == tuple(p), c["label"]
    chosen = pred.predict(cands[tuned.label])
    assert (tuned.predicted_seconds_per_image, tuned.predicted_calls) == (chosen.seconds_per_image, chosen.calls)
    assert tuned.standard_seconds_per_image == pred.predict(cands["standard"]).seconds_per_image
