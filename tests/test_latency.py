"""The wall-clock cost model: the cost curve, the round law and the run's simulation against closed
forms, the sampler-time fit, and the predictor as a pure function of a calibration."""

from __future__ import annotations

import pytest
import torch
from scipy import stats as sps

from specforest import trees
from specforest.latency import CostCurve, expected_steps, predict_seconds, steps_moments


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


@pytest.mark.parametrize("sweeps", [1, 2])
def test_picard_sweeps_add_their_calls_to_every_chain_round_and_none_to_a_tree(sweeps):
    """Closed form for one trajectory: a chain round with ``J`` sweeps makes ``1 + J`` calls, so the
    speculative calls scale by ``1 + J`` (the first step, the fetch and the last step stay one
    each), and each sweep costs its rows on the curve; a branching tree makes no sweep."""
    curve = CostCurve((1, 1024), (1.0, 1024.0))  # time = rows
    acc = lambda level, k: 0.7  # noqa: E731
    base = predict_seconds(curve, 30, 1, trees.chain(4), "internal", acc, 0.0)
    swept = predict_seconds(curve, 30, 1, trees.chain(4), "internal", acc, 0.0, sweeps=sweeps)
    assert swept[1] - 3 == pytest.approx((1 + sweeps) * (base[1] - 3))
    assert swept[0] > base[0] + sweeps * (base[1] - 3)  # each sweep at least one row a round
    tree = trees.uniform(2, 2)
    assert predict_seconds(curve, 30, 1, tree, "internal", acc, 0.0, sweeps=sweeps) == predict_seconds(
        curve, 30, 1, tree, "internal", acc, 0.0
    )
    # a batch's simulation counts them the same way
    many = predict_seconds(curve, 30, 8, trees.chain(4), "internal", acc, 0.0)
    many_swept = predict_seconds(curve, 30, 8, trees.chain(4), "internal", acc, 0.0, sweeps=sweeps)
    assert many_swept[1] - 3 == pytest.approx((1 + sweeps) * (many[1] - 3))


@pytest.mark.parametrize("chain,deterministic", [("em", 2), ("euler_ancestral", 1)])
def test_the_predicted_calls_count_the_chains_own_deterministic_steps(chain, deterministic):
    """em's first (from pure noise) and last steps carry no noise, Euler ancestral's last only: a run of 10 steps on a chain
    of 3 that accepts every draft (a constant velocity: the frozen draft is exact) makes 1 + 1 + ceil(8 / 3)
    + 1 = 6 calls on em and 1 + ceil(9 / 3) + 1 = 5 on Euler ancestral. The prediction with the chain's
    count is the run's; the em count on Euler ancestral would be off by one."""
    import math

    import torch

    from specforest import sample
    from specforest.options import make_sde

    # (em from pure noise, whose first step is a plain Euler step; Euler ancestral's VE levels need t < 1)
    grid = torch.linspace(1.0 if chain == "em" else 0.9, 0.0, 11, dtype=torch.float64)
    churn = 0.5 if chain == "em" else None
    sde = make_sde(None, grid, "flow_match", 1.0, churn, chain)
    assert int((~sde.stochastic).sum()) == deterministic
    run = sample(
        lambda x, t, **kw: torch.full_like(x, 0.3), torch.randn(1, 4, dtype=torch.float64),
        sigmas=grid, churn=churn, chain=chain, tree=trees.chain(3), coupling="rmc", seed=0,
    )  # fmt: skip
    rounds = math.ceil((10 - deterministic) / 3)
    assert int(run.stats.calls) == deterministic + 1 + rounds
    curve = CostCurve((1, 1024), (1.0, 1.0))
    always = lambda level, k: 1.0  # noqa: E731
    _, calls = predict_seconds(curve, 10, 1, trees.chain(3), "internal", always, 0.0, deterministic=deterministic)
    assert calls == int(run.stats.calls)
    if deterministic != 2:
        assert predict_seconds(curve, 10, 1, trees.chain(3), "internal", always, 0.0)[1] != calls


def test_a_chain_of_two_stages_costs_and_counts_two_calls_a_call():
    """Heun (two model calls a step, one into 0) with a constant clean prediction (the ``x0`` draft is exact,
    so every draft is accepted): a run of 10 steps on a chain of 3 makes two calls for each of the fetch and
    ceil(9 / 3) rounds, and one for the last step (into 0), as the standard run's 2 T - 1 do; the prediction
    with the chain's ``stages`` and standard calls is the run's, and costs each call of two stages twice."""
    import math

    from specforest import chains, sample

    grid = torch.linspace(0.9, 0.0, 11, dtype=torch.float64)
    heun = chains.HeunChurn(s_churn=5.0)
    model = lambda x, t, **kw: (x - 0.3) / t[:, None]  # noqa: E731
    x = torch.randn(1, 4, dtype=torch.float64)
    run = sample(model, x, sigmas=grid, chain=heun, tree=trees.chain(3), coupling="rmc", draft="x0", seed=0)
    assert int(run.stats.calls) == 2 * (1 + math.ceil(9 / 3)) + 1
    standard = sample(model, x, sigmas=grid, chain=heun, seed=0)
    calls = heun.build(grid).standard_calls
    assert standard.stats.calls == calls == 19
    curve = CostCurve((1, 1024), (1.0, 1.0))
    always = lambda level, k: 1.0  # noqa: E731
    one = predict_seconds(curve, 10, 1, trees.chain(3), "internal", always, 0.0, deterministic=1)
    kw = dict(deterministic=1, stages=2, standard_calls=calls)
    two = predict_seconds(curve, 10, 1, trees.chain(3), "internal", always, 0.0, **kw)
    assert two == (pytest.approx(2 * one[0] - 1), int(run.stats.calls))
    assert predict_seconds(curve, 10, 1, None, "internal", None, 0.5, stages=2, standard_calls=calls) == (
        pytest.approx(19 + 10 * 0.5),
        19.0,
    )


def test_a_calibrated_chain_of_two_stages_prices_the_standard_run_at_its_own_calls():
    """The tuner's standard run on Heun (two calls a step, one into 0): the calibration records the chain's
    standard calls, 2 T - 1 = 19 at T = 10, and the predictor prices that many (not 2 T), as the run makes."""
    from specforest import chains
    from specforest.latency import Calibrator, Config

    grid = torch.linspace(0.9, 0.0, 11, dtype=torch.float64)
    model = lambda x, t, **kw: (x - 0.3) / t[:, None]  # noqa: E731
    x = torch.randn(2, 4, dtype=torch.float64)
    cal = Calibrator.calibrate(
        model, x, steps=10, chain=chains.HeunChurn(s_churn=5.0), batch=1, budget_max=3,
        curve=CostCurve((1, 1024), (1.0, 1.0)), calibration_trajectories=2, sigmas_for=lambda n: grid,
    )  # fmt: skip
    assert cal.calibration.standard_calls == 19
    assert cal.predictor.network_seconds(Config()) == pytest.approx(19.0)
