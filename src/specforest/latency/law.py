"""The round law and the run's simulation: pure functions of a tree, an acceptance and a cost.

A round of a tree commits a random number of steps, whose law (:func:`_round_law`,
:func:`_steps_law`) and moments (:func:`steps_moments`, :func:`expected_steps`, the value
:func:`specforest.trees.optimal` maximizes) follow from the acceptance ``a(l, k)`` of each
verification. :func:`predict_seconds` simulates a run of ``batch`` trajectories through the
grid under that law and prices each call on a cost curve. Nothing here measures anything.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable, Sequence
from typing import Optional

from ..engine import PREFETCH_POLICIES
from ..trees import DraftTree
from .curve import CostCurve

__all__ = ["DETERMINISTIC_STEPS", "PREFETCH_KINDS", "expected_steps", "predict_seconds", "steps_moments"]

DETERMINISTIC_STEPS = 2
"""Steps of an ``em`` run that no round verifies: the first (from noise level 1) and the last (into 0).
Another chain has its own (:attr:`~specforest.sde.GaussianChain.stochastic`; Euler ancestral's last step
only): :func:`predict_seconds` takes the run's count."""


PREFETCH_KINDS = ("sibling", "older", "own")
"""The evaluation a round's draft starts from, as :func:`predict_seconds` models it: a sibling's
at the root's own step (after a rejection whose children were evaluated, ``prefetch="nearest"``),
an older one (the parent of the committed node: after a rejection whose children were not
evaluated, after any rejection with ``prefetch="parent"``, after a fully accepted round whose
last node was not evaluated), or the root's own (after the fetch, after a fully accepted round
whose last node was evaluated, ``verify="drafted"``)."""
_FROM_SIBLING, _FROM_OLDER, _FROM_OWN = range(3)


def _child_lists(tree: DraftTree) -> list:
    """Each node's children, as lists (from the tree's padded ``children`` table)."""
    return [[c for c in row if c >= 0] for row in tree.children.tolist()]


def steps_moments(tree: DraftTree, acceptance: Callable[[int, int], float]) -> "tuple[float, float]":
    """Mean and variance of the steps a round of ``tree`` commits (see :func:`expected_steps`).

    With ``Z = 1 + A Z_child`` (``A`` the acceptance indicator, probability ``a``):
    ``E[Z] = 1 + a E[Z_c]`` and ``E[Z^2] = 1 + 2 a E[Z_c] + a E[Z_c^2]``, children averaged.
    """
    depth, kids = tree.depth.tolist(), _child_lists(tree)
    m1, m2 = [0.0] * len(kids), [0.0] * len(kids)
    for v in range(len(kids) - 1, -1, -1):
        if kids[v]:
            k = len(kids[v])
            a = float(acceptance(depth[v] + 1, k))
            c1 = sum(m1[c] for c in kids[v]) / k
            c2 = sum(m2[c] for c in kids[v]) / k
            m1[v] = 1.0 + a * c1
            m2[v] = 1.0 + 2.0 * a * c1 + a * c2
    return m1[0], max(m2[0] - m1[0] ** 2, 0.0)


def expected_steps(tree: DraftTree, acceptance: Callable[[int, int], float]) -> float:
    """Expected steps a round of ``tree`` commits: ``V(root)`` with ``V = 1 + a(l, k) mean V(children)``.

    A node at depth ``l - 1`` with ``k`` children commits one step at depth ``l``
    (an accepted child, or the residual draw) and goes on from the accepted
    child with probability ``acceptance(l, k)``; a leaf commits nothing more.
    """
    return steps_moments(tree, acceptance)[0]


def predict_seconds(
    curve: CostCurve,
    steps: int,
    batch: int,
    tree: Optional[DraftTree],
    verify: str,
    acceptance: "Optional[Callable[[int, int], float] | Sequence[tuple[float, Callable[[int, int], float]]]]",
    sampler_seconds_per_round: "float | Callable[[int], float]",
    network_factor: "float | Callable[[float], float]" = 1.0,
    setup_seconds: float = 0.0,
    prefetch: str = "nearest",
    sweeps: int = 0,
    deterministic: int = DETERMINISTIC_STEPS,
    stages: int = 1,
    standard_calls: Optional[int] = None,
) -> "tuple[float, float]":
    """``(seconds of the run, calls)`` predicted for ``batch`` trajectories of ``steps`` steps.

    Args:
        curve: the target's cost curve.
        steps: grid steps ``T``.
        batch: trajectories of the run.
        tree, verify: the configuration (``tree=None``: the standard sampler).
        acceptance: ``a(l, k)``, or ``[(fraction of the stochastic steps, a(l, k))]`` per stretch
            of the grid (acceptance changes along the grid; a round's verification at depth ``l``
            uses the stretch of its parent's step).
        sampler_seconds_per_round: the sampler's own time per round, or a function of the
            round's rows (a :class:`RoundCost`: the drafted states, and so the sampler's
            work, grow with them).
        network_factor: a call's cost inside a run over its cost on the curve (measured
            back to back), or a function of the call's rows; every call's curve cost is
            multiplied by it.
        setup_seconds: the sampler's own time per run outside its rounds (set-up, wrap-up).
        prefetch: the sampler's prefetch policy (:data:`~specforest.engine.PREFETCH_POLICIES`).
        sweeps: Picard sweeps of the draft (:attr:`~specforest.proposals.Proposal.picard_sweeps`):
            a round whose tree (truncated to the steps left) is a chain makes that many more
            sequential calls before its verification, each of the chain's parents (its depth
            rows a trajectory), costed on the curve and counted as calls.
        deterministic: the run's steps that no round verifies (its chain's steps of no noise:
            :data:`DETERMINISTIC_STEPS` for ``em``), one call each.
        stages: the model calls a step of the run's chain makes (:attr:`~specforest.sde.GaussianChain.stages`):
            every call of a speculative run is that many sequential calls of its rows (costed and counted
            so); the standard run makes ``standard_calls`` (default ``steps * stages``), each of the batch,
            and the speculative run saves as many of its deterministic steps' calls as the standard run does
            (Heun's last step, into 0, makes one call).

    The run is simulated: ``batch`` trajectories step through the grid in
    lockstep calls (the first step, the first root's fetch, speculative rounds
    whose committed steps are drawn from the tree's law under the acceptance of
    the stretch each verification falls in, with the tree truncated to the steps left, and
    the last step). Each call is costed at the rows of the trajectories still
    running; the batch waits for its slowest trajectory. For one trajectory the
    expectation is computed exactly, backwards over the steps left; for a batch it
    is the mean over a few simulated runs (a fixed seed: the prediction is
    deterministic).

    A round's first verifications depend on the evaluation its draft starts from,
    which the previous round's end decides (:data:`PREFETCH_KINDS`): ``acceptance``
    is that of a draft from an evaluation at the root's own step (a sibling's, as
    in the calibration chain); a draft from an evaluation one step older meets at
    depth ``l`` the mismatch of depth ``l + 1``; one from the root's own
    evaluation accepts its first child for certain.
    """
    if prefetch not in PREFETCH_POLICIES:
        raise ValueError(f"prefetch must be one of {PREFETCH_POLICIES}, got {prefetch!r}")
    if callable(network_factor):
        base, by_rows = curve, network_factor
        curve = lambda rows: by_rows(rows) * base(rows)  # noqa: E731
    elif network_factor != 1.0:
        base = curve
        curve = lambda rows: network_factor * base(rows)  # noqa: E731
    per_round = sampler_seconds_per_round
    s_round = per_round if callable(per_round) else (lambda rows: per_round)
    if tree is None:
        n = steps * stages if standard_calls is None else standard_calls
        return setup_seconds + n * curve(batch) + steps * s_round(batch), float(n)
    if stages != 1:
        # a round's (and a sweep's) call is ``stages`` sequential calls of the same rows
        one = curve
        curve = lambda rows: stages * one(rows)  # noqa: E731
        seconds, calls = predict_seconds(
            curve, steps, batch, tree, verify, acceptance, sampler_seconds_per_round, 1.0, setup_seconds,
            prefetch, sweeps, deterministic,
        )  # fmt: skip
        # the calls a step of fewer calls saves (Heun's last, into 0: one), on steps no round verifies,
        # which the speculative run takes as the standard run does
        saved = 0 if standard_calls is None else steps * stages - standard_calls
        return seconds - saved * one(batch), stages * calls - saved
    deterministic = min(int(deterministic), steps)
    stoch = steps - deterministic
    bins = [(1.0, acceptance)] if callable(acceptance) else list(acceptance)
    edges = []
    acc_at = 0.0
    for w, _ in bins:
        acc_at += w * stoch
        edges.append(acc_at)
    laws: dict = {}
    by_round: dict = {}  # (h, done, kind) -> law: a batch's simulation asks for the same ones again and again
    rows_of: dict = {}

    def stretch(done: int) -> int:
        return min(bisect.bisect_right(edges, done), len(edges) - 1)

    def law(h: int, done: int, kind: int) -> tuple:
        hit = by_round.get((h, done, kind))
        if hit is None:
            hit = by_round[h, done, kind] = _law(h, done, kind)
        return hit

    def _law(h: int, done: int, kind: int) -> tuple:
        # the joint law of (committed steps, next round's prefetch kind) of the tree truncated to
        # h steps for a round after ``done`` stochastic steps, as ``(probabilities, cumulative
        # probabilities, outcomes)``: the verification at depth l happens at its parent's step, ``done + l - 1``,
        # and takes that stretch's acceptance (a round that starts in an easy stretch does not
        # carry its acceptance into a hard one)
        depth = min(h, tree.L)
        at = tuple(stretch(done + level - 1) for level in range(1, depth + 1))
        key = (depth, at, kind)
        if key not in laws:

            def acc(level: int, k: int) -> float:
                a = bins[at[level - 1]][1]
                if kind == _FROM_OWN:
                    return 1.0 if level == 1 else a(level, k)
                return a(level + 1, k) if kind == _FROM_OLDER else a(level, k)

            cut = tree.truncate(depth)
            joint = _round_law(cut, acc, verify, prefetch)
            outcomes = [(j, nxt) for nxt, p in enumerate(joint) for j in range(len(p)) if p[j] > 0.0]
            probs = [joint[nxt][j] for j, nxt in outcomes]
            laws[key] = (probs, list(itertools.accumulate(probs)), outcomes)
        return laws[key]

    def rows_at(h: int) -> int:
        if h not in rows_of:
            rows_of[h] = tree.truncate(min(h, tree.L)).verification_budget(verify)
        return rows_of[h]

    def swept(h: int) -> int:
        # rows a trajectory adds to each Picard sweep of a round with h steps left (0: no sweep)
        depth = min(h, tree.L)
        return depth if sweeps and tree.truncate(depth).max_children == 1 else 0

    # each deterministic step (em's first and last) and the first root's fetch: one call each
    ends = (deterministic + 1) * (curve(batch) + s_round(batch))
    if batch == 1:
        # one trajectory: the expectation itself, over (stochastic steps left, the start of the
        # round's draft), from the end of the grid back
        value = [[(0.0, 0.0)] * len(PREFETCH_KINDS)]
        for h in range(1, stoch + 1):
            row = []
            for kind in range(len(PREFETCH_KINDS)):
                probs, _, outcomes = law(h, stoch - h, kind)
                seconds, calls = curve(rows_at(h)) + s_round(rows_at(h)), 1.0
                if swept(h):
                    seconds, calls = seconds + sweeps * curve(swept(h)), calls + sweeps
                for p, (j, nxt) in zip(probs, outcomes, strict=True):
                    later = value[h - max(j, 1)][nxt]
                    seconds += p * later[0]
                    calls += p * later[1]
                row.append((seconds, calls))
            value.append(row)
        seconds, calls = value[stoch][_FROM_OWN]
        return setup_seconds + ends + seconds, deterministic + 1.0 + calls
    seconds, calls = _simulated(
        batch, stoch, law, rows_at, lambda rows: curve(rows) + s_round(rows), swept=swept, sweeps=sweeps, curve=curve
    )
    return setup_seconds + ends + seconds, deterministic + 1.0 + calls


def _simulated(
    batch: int,
    stoch: int,
    law: Callable,
    rows_at: Callable,
    round_seconds: Callable,
    runs: int = 8,
    seed: int = 0,
    swept: Optional[Callable] = None,
    sweeps: int = 0,
    curve: Optional[Callable] = None,
) -> "tuple[float, float]":
    """Mean ``(seconds, calls)`` of the speculative rounds of ``runs`` simulated runs of ``batch``
    trajectories in lockstep (a fixed seed: the prediction is deterministic); with ``sweeps``, a
    round whose trajectories add ``swept(h)`` rows makes that many more calls of those rows."""
    rng = random.Random(seed)
    calls_sum, seconds_sum = 0.0, 0.0
    for _ in range(runs):
        left = [stoch] * batch  # stochastic steps left per trajectory
        # the first round drafts from the root's own evaluation, made by the fetch
        kinds = [_FROM_OWN] * batch
        seconds, calls = 0.0, 0
        while any(h > 0 for h in left):
            rows = sweep_rows = 0
            for i, h in enumerate(left):
                if h <= 0:
                    continue
                _, cum, outcomes = law(h, stoch - h, kinds[i])
                u = rng.random()
                j, kinds[i] = outcomes[min(bisect.bisect_left(cum, u), len(cum) - 1)]
                rows += rows_at(h)
                sweep_rows += swept(h) if swept is not None else 0
                left[i] = h - max(j, 1)
            seconds += round_seconds(rows)
            calls += 1
            if sweep_rows:
                seconds += sweeps * curve(sweep_rows)
                calls += sweeps
        calls_sum += calls
        seconds_sum += seconds
    return seconds_sum / runs, calls_sum / runs


def _round_law(tree: DraftTree, acceptance: Callable[[int, int], float], verify: str, prefetch: str) -> list:
    """``P(Z = j, next = n)`` as ``[n][j]``: the steps a round of ``tree`` commits and the
    :data:`PREFETCH_KINDS` index ``n`` of the evaluation the next round starts from.

    Summed over ``n`` it is :func:`_steps_law`, whatever ``verify`` and ``prefetch``.
    """
    depth, kids = tree.depth.tolist(), _child_lists(tree)
    evaluated = tree.internal.tolist() if verify == "internal" else [True] * len(kids)
    L = max(depth)
    dist: list = [None] * len(kids)
    for v in range(len(kids) - 1, -1, -1):
        d = [[0.0] * (L + 1) for _ in PREFETCH_KINDS]
        if not kids[v]:
            d[_FROM_OWN if evaluated[v] else _FROM_OLDER][0] = 1.0
        else:
            k = len(kids[v])
            a = float(acceptance(depth[v] + 1, k))
            # a rejection commits the residual draw next to its siblings
            sib = prefetch == "nearest" and any(evaluated[c] for c in kids[v])
            d[_FROM_SIBLING if sib else _FROM_OLDER][1] += 1.0 - a
            for c in kids[v]:
                for n, row in enumerate(dist[c]):
                    for j, pj in enumerate(row):
                        if j + 1 <= L:
                            d[n][j + 1] += a * pj / k
        dist[v] = d
    return dist[0]


def _steps_law(tree: DraftTree, acceptance: Callable[[int, int], float]) -> list:
    """``P(Z = j)``, ``j = 0 .. L``: the law of the steps a round of ``tree`` commits (see :func:`steps_moments`),
    :func:`_round_law` summed over where the next round starts (which does not change the steps)."""
    joint = _round_law(tree, acceptance, "internal", "nearest")
    return [sum(row[j] for row in joint) for j in range(len(joint[0]))]
