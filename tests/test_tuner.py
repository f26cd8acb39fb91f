"""Measuring and tuning: the calibrator's timing runs on a virtual clock, the network factor, the
race, and the tuner's choices (``tune``, ``specforest tune``, ``plan_tree(objective="latency")``)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import specforest
from specforest import streams, trees
from specforest.latency import CostCurve, Tuned, TunedFor, tune
from specforest.models import GaussianMixture


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
    assert tuned.tuned_for == TunedFor(steps=20, batch=2, churn=0.3, chain="em", chain_params=(("churn", 0.3),))
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


def test_plan_tree_optimizes_latency_on_request(gmm, monkeypatch):
    """``plan_tree(objective="latency")`` is the tuner's tree for one coupling and the run's draft (the
    virtual clock makes both runs of the tuner the same), and ``planning.tune`` is the tuner itself."""
    from specforest import latency, planning

    _virtual_clock(monkeypatch)
    x = streams.randn(0, torch.arange(2), (8,))  # two trajectories: the latency objective tunes for a batch of 2
    kw = dict(budget=14, steps=16, churn=0.3, coupling="grs", seed=0)
    calls = planning.plan_tree(gmm, x, **kw)
    assert calls is not None and calls.budget <= 14
    # a call that costs 1 s per row (and the sampler's own time 0 on the virtual clock): no tree pays in seconds
    linear = CostCurve((1, 4096), (1.0, 4096.0))
    kw["budget"] = 6
    assert planning.plan_tree(gmm, x, objective="latency", curve=linear, **kw) is None
    flat = CostCurve((1, 4096), (1.0, 1.0))
    tree = planning.plan_tree(gmm, x, objective="latency", curve=flat, **kw)
    tuned = tune(gmm, x, steps=16, churn=0.3, budget_max=6, drafts=("velocity",), couplings=("grs",), curve=flat)
    assert tree is not None and tuned.coupling == "grs" and tree.parent.tolist() == tuned.tree.parent.tolist()
    with pytest.raises(ValueError, match="objective must be one of"):
        planning.plan_tree(gmm, x, objective="nfe", **kw)
    assert planning.tune is latency.tune


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


def test_a_draft_that_remembers_its_chain_is_a_candidate_on_chains_only():
    """``memory`` and ``auto`` are calibrated on a chain and remember chain rounds only: the tuner
    pairs them with chains, the frozen drafts with every tree."""
    from specforest.latency import tuner

    cands = tuner.candidates(lambda level, k: 0.7, 62, 30, ["x0", "memory", "auto"])
    by = {d: [c.config.tree for c in cands[1:] if c.config.draft == d] for d in ("x0", "memory", "auto")}
    assert any(t.budget != t.L for t in by["x0"])
    for d in ("memory", "auto"):
        assert by[d] and all(t.budget == t.L for t in by[d])
    assert len(by["memory"]) == sum(t.budget == t.L for t in by["x0"])


def test_the_tune_command_considers_every_registered_draft_and_refuses_an_unknown_one():
    from click.testing import CliRunner

    from specforest.cli import main
    from specforest.cli.tune import parse_drafts
    from specforest.proposals import available_drafts

    assert parse_drafts("all") == list(available_drafts()) and "memory" in parse_drafts("all")
    assert parse_drafts(" x0, memory ") == ["x0", "memory"]
    res = CliRunner().invoke(main, ["tune", "--model", "gmm", "--drafts", "x0,nope", "--out", "t.json"])
    assert res.exit_code == 2 and "--drafts" in res.output and "nope" in res.output


def test_a_picard_chain_is_predicted_with_its_sweeps_calls(gmm):
    """The predictor counts a Picard chain's sweeps: its predicted calls for one trajectory are
    those of a real run (mean over 24 runs, within 4 standard errors plus one call), not the
    rounds alone, which a predictor blind to the sweeps would give."""
    from specforest.latency import Calibrator

    x = torch.randn(24, gmm.dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    opts = dict(steps=30, churn=0.1)
    pred = Calibrator.calibrate(gmm, x, batch=1, drafts=("picard2",), budget_max=14, **opts)
    calls = pred.predict(trees.chain(14), "rmc", "internal", "picard2").calls
    runs = [
        specforest.sample(gmm, x[i : i + 1], tree=trees.chain(14), coupling="rmc", draft="picard2", seed=10 + i, **opts)
        for i in range(24)
    ]
    nfe = torch.tensor([float(r.stats.calls) for r in runs], dtype=torch.float64)
    rounds = torch.tensor([float(r.stats.rounds.sum()) for r in runs], dtype=torch.float64)
    sem = float(nfe.std() / 24**0.5)
    assert abs(calls - float(nfe.mean())) < 4 * sem + 1.0
    assert float(nfe.mean()) > float(rounds.mean()) + 5  # the sweeps are many calls: the check has power


def test_the_cached_draft_is_timed_with_its_features_and_outer_block_calls(gmm):
    """The timing runs wrap the model to time its calls; the wrapper keeps the model's feature
    protocol (a plain wrapper would have the cached draft refused), and a call that keeps features is
    recorded as a target call: the calibrated cached chain predicts fewer calls than the secant one
    (it accepts more on the mixture)."""
    from specforest.latency import Calibrator

    x = torch.randn(4, gmm.dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    pred = Calibrator.calibrate(gmm, x, steps=20, churn=0.1, batch=1, drafts=("cached", "secant"), budget_max=8)
    got = {d: pred.predict(trees.chain(8), "rmc", "internal", d) for d in ("cached", "secant")}
    assert got["cached"].calls < got["secant"].calls


def test_a_calibration_knows_its_chains_stochastic_steps(gmm):
    """The calibrator reads the chain's own noisy steps on the run's grid: em from pure noise has two
    steps without noise, Euler ancestral one (its last); the predictor's calls for a chain of the
    calibrated length follow the chain's count (a real run of Euler ancestral within 4 standard errors
    plus one call)."""
    from specforest.latency import Calibrator

    x = torch.randn(24, gmm.dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    em = Calibrator.calibrate(gmm, x, batch=1, drafts=("x0",), budget_max=8, steps=20, churn=0.3)
    assert (em.calibration.first_stochastic, em.calibration.stochastic_steps) == (1, 18)
    grid = torch.cat([torch.linspace(0.95, 0.05, 20, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)])
    opts = dict(chain="euler_ancestral")
    ea = Calibrator.calibrate(
        gmm, x, batch=1, drafts=("x0",), budget_max=8, steps=20, sigmas_for=lambda n: grid, **opts
    )
    assert (ea.calibration.first_stochastic, ea.calibration.stochastic_steps) == (0, 19)
    calls = ea.predict(trees.chain(8), "rmc", "internal", "x0").calls
    runs = [
        specforest.sample(
            gmm, x[i : i + 1], sigmas=grid, tree=trees.chain(8), coupling="rmc", draft="x0", seed=i, **opts
        )
        for i in range(24)
    ]
    nfe = torch.tensor([float(r.stats.calls) for r in runs], dtype=torch.float64)
    assert abs(calls - float(nfe.mean())) < 4 * float(nfe.std() / 24**0.5) + 1.0
