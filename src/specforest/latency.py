"""Seconds, not calls: a measured cost model of a round, and the configuration that minimizes wall time.

A speculative round evaluates many states in one call. Whether that saves time
depends on how the call's cost grows with its rows on *this* hardware and on
the sampler's own time per round. :func:`tune` measures both:

* the target's batch-cost curve ``time(rows)`` (:func:`measure_cost_curve`,
  a median of a few calls per size, in seconds);
* the acceptance per depth, from a short lazy calibration chain (as
  :func:`specforest.planning.plan_tree` does);
* the sampler's own time per round of each candidate, from a short real run,
  and on the same run the network calls' cost inside a run relative to the
  curve (:meth:`Predictor.network_factor`: calls between sampler work cost
  more than calls back to back).

For a configuration (tree, coupling, verification mode) the predicted time of a
run of ``T`` steps for ``batch`` trajectories is

    set-up + sum over its calls of (factor x time(rows of the call) + sampler time per round),

the calls simulated by :func:`predict_seconds`: the two deterministic steps and
the first root's fetch, then rounds whose committed steps are drawn from the
tree's law under the calibrated acceptance (on average :func:`expected_steps`,
the value :func:`specforest.trees.optimal` maximizes). The standard sampler
takes ``T`` calls of ``batch`` rows. :func:`tune` races the few candidates predicted
fastest against the standard sampler (interleaved full runs) and returns the
fastest measured, or the standard sampler when no tree pays; it states its
prediction before the run.
The choice is fixed before sampling, so the sampler stays exact.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .engine import PREFETCH_POLICIES
from .planning import acceptance_model
from .sampler import TunedFor, pad_sizes, sample
from .trees import VERIFY_MODES, DraftTree, chain, from_parents, optimal, uniform
from .validation import check_int

__all__ = [
    "PREFETCH_KINDS",
    "CostCurve",
    "Predictor",
    "RoundCost",
    "SAMPLE_OPTIONS",
    "Tuned",
    "TunedFor",
    "expected_steps",
    "measure_cost_curve",
    "predict_seconds",
    "steps_moments",
    "tune",
]

CURVE_PASSES = 3
"""Passes over the sizes that :func:`measure_cost_curve` spreads its calls over."""
DEFAULT_SIZES = tuple(2**k for k in range(10))
"""Row counts the cost curve is measured at: 1, 2, 4, ..., 512."""

_UNSET = object()
_DETERMINISTIC = 2  # the first step (from noise level 1) and the last (into 0)

_MIN_RECORDS = 8
"""Calibration records a stretch of :meth:`Predictor.acceptance_bins` needs before it borrows its
neighbours'."""

_PRUNE_MARGIN = 0.8
"""A candidate is not timed when 0.8 x its network calls' predicted time already exceeds the best
timed prediction: the network factor, pooled from the runs timed so far, would have to fall by
20% for it to become competitive, and its own sampler time only adds."""


@dataclass(frozen=True)
class CostCurve:
    """The target's measured time per call against its number of rows.

    Attributes:
        sizes: ascending row counts measured.
        seconds: median seconds of one call at each size.
    """

    sizes: tuple
    seconds: tuple

    def __call__(self, rows: float) -> float:
        """Seconds of one call of ``rows`` rows: piecewise linear in the rows, extended by the last slope."""
        s, t = self.sizes, self.seconds
        if rows <= s[0]:
            return t[0]
        for i in range(1, len(s)):
            if rows <= s[i]:
                w = (rows - s[i - 1]) / (s[i] - s[i - 1])
                return t[i - 1] + w * (t[i] - t[i - 1])
        slope = (t[-1] - t[-2]) / (s[-1] - s[-2]) if len(s) > 1 else t[-1] / s[-1]
        return t[-1] + slope * (rows - s[-1])

    def relative(self) -> list:
        """``time(b) / time(1)`` at each measured size."""
        return [x / self.seconds[0] for x in self.seconds]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_cost_curve(
    model: Callable,
    x: torch.Tensor,
    *,
    cond: Optional[dict] = None,
    sigma: float = 0.5,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 7,
    progress: bool = False,
    model_kwargs: Optional[dict] = None,
) -> CostCurve:
    """Time the target at each row count: the median of about ``repeats`` calls, made in
    :data:`CURVE_PASSES` passes over the sizes, each after an untimed call at that size.

    Args:
        model: the velocity ``v(x, sigma, **cond)``.
        x: ``(1, *shape)`` one state (repeated to each size).
        cond: conditioning of that state, tensors ``(1, ...)``.
        sigma: the noise level of the calls.
        sizes: ascending row counts.
        repeats: calls timed per size, ``>= 1``.
        progress: a progress bar over the sizes.
        model_kwargs: keyword arguments of every call (as :func:`specforest.sample` passes them).

    Returns:
        A :class:`CostCurve` in seconds.
    """
    if x.ndim < 2 or x.shape[0] != 1:
        raise ValueError(f"x must be one state (1, *shape), got {tuple(x.shape)}")
    sizes = tuple(sorted({int(s) for s in sizes}))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"sizes must be integers >= 1, got {sizes}")
    cond = cond or {}
    if model_kwargs is not None and not isinstance(model_kwargs, dict):
        raise TypeError(f"model_kwargs must be a dict or None, got {type(model_kwargs).__name__}")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(sizes) * CURVE_PASSES, desc="cost curve", unit="size")
    inputs = []
    for b in sizes:
        xb = x.expand(b, *x.shape[1:]).contiguous()
        sb = torch.full((b,), float(sigma), dtype=x.dtype, device=x.device)
        cb = {k: v.expand(b, *v.shape[1:]).contiguous() for k, v in cond.items()}
        cb.update(model_kwargs or {})
        inputs.append((xb, sb, cb))
    # three passes over the sizes, each timing a few calls after an untimed one at that size: a
    # slow moment of a shared machine then costs a few calls of several sizes, which the medians
    # drop, instead of bending the curve at one size; and no timed call follows a call of another
    # size (one of one row right after one of 512 rows runs with cold caches, 25-30% slower)
    per_pass = -(-max(1, int(repeats)) // CURVE_PASSES)
    times: list = [[] for _ in sizes]
    with _no_gc():
        for _ in range(CURVE_PASSES):
            for i, (xb, sb, cb) in enumerate(inputs):
                model(xb, sb, **cb)
                for _ in range(per_pass):
                    _sync(x.device)
                    t0 = time.perf_counter()
                    model(xb, sb, **cb)
                    _sync(x.device)
                    times[i].append(time.perf_counter() - t0)
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    return CostCurve(sizes, tuple(statistics.median(t) for t in times))


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
        return setup_seconds + steps * (curve(batch) + s_round(batch)), float(steps)
    stoch = max(steps - _DETERMINISTIC, 0)
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

    # the first deterministic step, the first root's fetch and the last step: one call each
    ends = 3 * (curve(batch) + s_round(batch))
    if batch == 1:
        # one trajectory: the expectation itself, over (stochastic steps left, the start of the
        # round's draft), from the end of the grid back
        value = [[(0.0, 0.0)] * len(PREFETCH_KINDS)]
        for h in range(1, stoch + 1):
            row = []
            for kind in range(len(PREFETCH_KINDS)):
                probs, _, outcomes = law(h, stoch - h, kind)
                seconds, calls = curve(rows_at(h)) + s_round(rows_at(h)), 1.0
                for p, (j, nxt) in zip(probs, outcomes, strict=True):
                    later = value[h - max(j, 1)][nxt]
                    seconds += p * later[0]
                    calls += p * later[1]
                row.append((seconds, calls))
            value.append(row)
        seconds, calls = value[stoch][_FROM_OWN]
        return setup_seconds + ends + seconds, 3.0 + calls
    seconds, calls = _simulated(batch, stoch, law, rows_at, lambda rows: curve(rows) + s_round(rows))
    return setup_seconds + ends + seconds, 3.0 + calls


def _simulated(
    batch: int, stoch: int, law: Callable, rows_at: Callable, round_seconds: Callable, runs: int = 8, seed: int = 0
) -> "tuple[float, float]":
    """Mean ``(seconds, calls)`` of the speculative rounds of ``runs`` simulated runs of ``batch``
    trajectories in lockstep (a fixed seed: the prediction is deterministic)."""
    rng = random.Random(seed)
    calls_sum, seconds_sum = 0.0, 0.0
    for _ in range(runs):
        left = [stoch] * batch  # stochastic steps left per trajectory
        # the first round drafts from the root's own evaluation, made by the fetch
        kinds = [_FROM_OWN] * batch
        seconds, calls = 0.0, 0
        while any(h > 0 for h in left):
            rows = 0
            for i, h in enumerate(left):
                if h <= 0:
                    continue
                _, cum, outcomes = law(h, stoch - h, kinds[i])
                u = rng.random()
                j, kinds[i] = outcomes[min(bisect.bisect_left(cum, u), len(cum) - 1)]
                rows += rows_at(h)
                left[i] = h - max(j, 1)
            seconds += round_seconds(rows)
            calls += 1
        calls_sum += calls
        seconds_sum += seconds
    return seconds_sum / runs, calls_sum / runs


PREFETCH_KINDS = ("sibling", "older", "own")
"""The evaluation a round's draft starts from, as :func:`predict_seconds` models it: a sibling's
at the root's own step (after a rejection whose children were evaluated, ``prefetch="nearest"``),
an older one (the parent of the committed node: after a rejection whose children were not
evaluated, after any rejection with ``prefetch="parent"``, after a fully accepted round whose
last node was not evaluated), or the root's own (after the fetch, after a fully accepted round
whose last node was evaluated, ``verify="drafted"``)."""
_FROM_SIBLING, _FROM_OLDER, _FROM_OWN = range(3)


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


def _tree_to_json(tree: Optional[DraftTree]) -> Optional[list]:
    return None if tree is None else tree.parent.tolist()


@dataclass
class Tuned(Mapping):
    """The configuration :func:`tune` chose, with its prediction; ``sample(model, x, **tuned)`` runs it.

    As a mapping it holds :func:`specforest.sample`'s options ``tree``, ``coupling``,
    ``verify``, ``draft`` and ``prefetch`` (:meth:`options`) and ``tuned_for``, the run
    it was chosen for (a :class:`~specforest.sampler.TunedFor`: steps, batch, churn):
    :func:`specforest.sample` then takes the tuned steps when given none and refuses a
    run whose steps, churn or batch differ. ``sample(model, x, **tuned.options(), ...)``
    runs the configuration without that check.

    Attributes:
        label: a short name (``standard``, ``RMC chain B=8``, ``D-GRS (2,3)``, ...).
        tree, coupling, verify, draft, prefetch: the options.
        batch: trajectories per run it was tuned for.
        steps: grid steps ``T``.
        predicted_seconds_per_image: predicted wall time per trajectory.
        predicted_speedup: the standard sampler's predicted time over this one's.
        standard_seconds_per_image: the standard sampler's predicted time per trajectory.
        predicted_calls: predicted target calls of a run.
        curve: the measured cost curve.
        candidates: every candidate's ``(label, predicted seconds per image, calls, sampler s/round)``.
        measured_speedup: the standard sampler's measured time over this one's in the final race
            of :func:`tune` (interleaved full runs), or ``None`` when there was no race.
        churn: the churn it was tuned for (``None`` when read from a file written before it was kept).
    """

    label: str
    tree: Optional[DraftTree]
    coupling: str
    verify: str
    draft: str
    batch: int
    steps: int
    predicted_seconds_per_image: float
    predicted_speedup: float
    standard_seconds_per_image: float
    predicted_calls: float
    curve: CostCurve
    candidates: list = field(default_factory=list)
    measured_speedup: Optional[float] = None
    churn: Optional[float] = None
    prefetch: str = "nearest"

    def options(self) -> dict:
        """The sampler options alone: ``tree``, ``coupling``, ``verify``, ``draft``, ``prefetch`` (no check)."""
        return {
            "tree": self.tree,
            "coupling": self.coupling,
            "verify": self.verify,
            "draft": self.draft,
            "prefetch": self.prefetch,
        }

    @property
    def tuned_for(self) -> TunedFor:
        """The run it was tuned for, as :func:`specforest.sample` checks it."""
        return TunedFor(steps=self.steps, batch=self.batch, churn=self.churn)

    def _mapping(self) -> dict:
        return {**self.options(), "tuned_for": self.tuned_for}

    def __getitem__(self, key: str) -> Any:
        return self._mapping()[key]

    def __iter__(self):
        return iter(self._mapping())

    def __len__(self) -> int:
        return len(self._mapping())

    def to_json(self) -> dict:
        """A JSON-able dict (the tree as its parent list)."""
        return {
            "label": self.label,
            "tree": _tree_to_json(self.tree),
            "coupling": self.coupling,
            "verify": self.verify,
            "draft": self.draft,
            "prefetch": self.prefetch,
            "batch": self.batch,
            "steps": self.steps,
            "churn": self.churn,
            "predicted_seconds_per_image": self.predicted_seconds_per_image,
            "predicted_speedup": self.predicted_speedup,
            "standard_seconds_per_image": self.standard_seconds_per_image,
            "predicted_calls": self.predicted_calls,
            "cost_curve": {"sizes": list(self.curve.sizes), "seconds": list(self.curve.seconds)},
            "candidates": self.candidates,
            "measured_speedup": self.measured_speedup,
        }

    @classmethod
    def from_json(cls, d: dict) -> "Tuned":
        """The inverse of :meth:`to_json`; a file written before ``churn`` and ``prefetch`` were kept
        reads with ``churn=None`` (not checked) and ``prefetch="nearest"`` (what it was tuned with)."""
        tree = None if d["tree"] is None else from_parents(d["tree"])
        curve = CostCurve(tuple(d["cost_curve"]["sizes"]), tuple(d["cost_curve"]["seconds"]))
        keys = ("label", "coupling", "verify", "draft", "batch", "steps", "predicted_seconds_per_image")
        keys += ("predicted_speedup", "standard_seconds_per_image", "predicted_calls")
        churn = d.get("churn")
        return cls(
            tree=tree,
            curve=curve,
            candidates=d.get("candidates", []),
            measured_speedup=d.get("measured_speedup"),
            churn=None if churn is None else float(churn),
            prefetch=d.get("prefetch", "nearest"),
            **{k: d[k] for k in keys},
        )


@dataclass(frozen=True)
class RoundCost:
    """The sampler's own time of a round as ``fixed + per_row * rows`` (seconds), ``rows`` the round's call.

    A round drafts, verifies and commits states in proportion to the rows it
    evaluates: on the mixture with 64 trajectories of dimension 500 a D-GRS
    round of the whole tree costs twice one near the end of the grid, where
    the tree is truncated. Fitted to the gaps between a timing run's calls.
    """

    fixed: float
    per_row: float = 0.0

    def __call__(self, rows: float) -> float:
        return self.fixed + self.per_row * rows

    @classmethod
    def fit(cls, runs: Sequence[Sequence[tuple]], in_rounds: float) -> "RoundCost":
        """From the calls ``[(rows, entered, left)]`` (perf-counter seconds) of each of ``runs``, whose
        rounds took ``in_rounds`` seconds of sampler time in all: the gap between two calls of a run
        is the sampler's work after the first and before the second, regressed on their mean rows;
        the line is then scaled so that over the calls it adds up to ``in_rounds``."""
        x, y, rows = [], [], []
        for calls in runs:
            rows += [c[0] for c in calls]
            for (r0, _, left), (r1, entered, _) in zip(calls[:-1], calls[1:], strict=True):
                x.append(0.5 * (r0 + r1))
                y.append(entered - left)
        if len(set(x)) >= 3:
            slope = max(statistics.linear_regression(x, y).slope, 0.0)
            icept = statistics.fmean(y) - slope * statistics.fmean(x)
            if icept < 0:  # a line through the origin
                slope, icept = sum(y) / max(sum(x), 1e-300), 0.0
        else:
            slope, icept = 0.0, 1.0
        total = len(rows) * icept + slope * sum(rows)
        scale = in_rounds / total if total > 0 else 0.0
        return cls(icept * scale, slope * scale)


TIMING_RUNS = 5
"""Most timing runs of one configuration (:meth:`Predictor.sampler_seconds_per_round`)."""
REPEAT_BELOW_SECONDS = 0.5
"""A configuration's timing run is repeated while its runs so far took less than this."""


def _candidates(acc: Callable, budget_max: int, steps: int, verify: Optional[str] = None) -> list:
    """``(label, tree, coupling, verify)`` considered by :func:`tune`; with ``verify`` given, every tree
    is verified that way (the standard sampler verifies nothing)."""
    tag = "" if verify in (None, "internal") else f" {verify}"
    out: list = [("standard", None, "grs", verify or "internal")]
    for B in (2, 3, 4, 6, 8, 10, 14, 20, 30):
        if B <= min(budget_max, steps):
            out.append((f"RMC chain B={B}{tag}", chain(B), "rmc", verify or "internal"))
    for K, L in ((2, 2), (2, 3), (2, 4), (3, 2), (3, 3), (4, 2)):
        t = uniform(K, L)
        if t.budget <= budget_max:
            for mode in ("internal", "drafted") if verify is None else (verify,):
                out.append((f"D-GRS ({K},{L}) {mode}", t, "grs", mode))
    for B in (6, 14, 30, 62):
        if B <= budget_max:
            t = optimal(acc, B, min(B, steps), kmax=8)
            out.append((f"D-GRS optimal B={B}{tag}", t, "grs", verify or "internal"))
    return out


class Predictor:
    """The calibrated cost model of a run: predicts any configuration's wall time before running it.

    Made by :meth:`calibrate`. :meth:`predict` times the sampler's own work per
    round on a short real run of the configuration and combines it with the cost
    curve and the calibrated acceptance (see the module docstring).
    """

    def __init__(
        self,
        model,
        x,
        cond,
        steps,
        churn,
        batch,
        curve,
        acceptance,
        seed,
        sample_kwargs,
        measured_curve=False,
        sigmas_for=None,
    ) -> None:
        self.model, self.x, self.cond = model, x, cond
        self.sigmas_for = sigmas_for
        self.measured_curve = measured_curve  # the curve times this model: calls in a run can be compared to it
        self.steps, self.churn, self.batch = steps, churn, batch
        self.curve, self.acceptance, self.seed = curve, acceptance, seed
        self.sample_kwargs = sample_kwargs
        # with pad_rows every call runs at one of these sizes: a call is priced at its padded rows
        self._pads = pad_sizes(sample_kwargs.get("pad_rows"))
        self._sampler_time: dict = {}  # key -> (per round, per run outside the rounds, RoundCost)
        self._network_of: dict = {}  # key -> (seconds inside its timing runs' calls, their cost on the curve)
        self._calls: list = []  # (rows, seconds in a run / seconds on the curve) of every timed call
        self._by_rows: Optional[tuple] = None  # (calls it was made from, factor_by_rows)
        self._warm: set = set()
        self._bins: dict = {}  # (coupling, draft, bins) -> acceptance_bins, computed once

    @classmethod
    def calibrate(
        cls,
        model: Callable,
        x: torch.Tensor,
        *,
        steps: int,
        churn: float,
        cond: Optional[dict] = None,
        batch: Optional[int] = None,
        drafts: Sequence[str] = ("velocity",),
        budget_max: int = 62,
        curve: Optional[CostCurve] = None,
        calibration_trajectories: int = 16,
        seed: int = 0,
        progress: bool = False,
        sigmas_for: Optional[Callable[[int], torch.Tensor]] = None,
        **sample_kwargs: Any,
    ) -> "Predictor":
        """Measure the cost curve (unless given) and calibrate acceptance per draft on a lazy chain.

        Args: as in :func:`tune`; ``sample_kwargs`` are the options :func:`tune` passes to every run.

        Raises:
            ValueError: for a constraint (``verify``, ``draft``, ``coupling``: a predictor prices
                every configuration; give the draft kinds as ``drafts``) or a refused option.
        """
        constraints, sample_kwargs = _split_options(sample_kwargs)
        if constraints:
            raise ValueError(
                f"{', '.join(constraints)}: a predictor prices every configuration; give the draft kinds as drafts= "
                "and the rest to predict() or as constraints of tune()"
            )
        batch = len(x) if batch is None else int(batch)
        if not 1 <= batch <= len(x):
            raise ValueError(f"batch must be in [1, {len(x)}] (rows of x), got {batch}")
        drafts = list(dict.fromkeys(drafts))
        if not drafts:
            raise ValueError("drafts must name at least one draft kind")
        measured = curve is None
        if measured:
            top = max(512, batch * 63)
            if sample_kwargs.get("max_rows"):
                # the sampler splits larger calls: measured up to there, extended linearly
                top = min(top, int(sample_kwargs["max_rows"]))
            pads = pad_sizes(sample_kwargs.get("pad_rows"))
            if pads:
                # every call runs at a padded size: those sizes, up to the first that holds the largest call
                top = min(top, pads[-1])
                sizes = tuple(p for i, p in enumerate(pads) if i == 0 or pads[i - 1] < top)
            else:
                sizes = tuple(s for s in (*DEFAULT_SIZES, 1024, 2048, 4096) if s <= top)
            curve = measure_cost_curve(
                model,
                x[:1],
                cond=_rows(cond, 1),
                sizes=sizes,
                progress=progress,
                model_kwargs=sample_kwargs.get("model_kwargs"),
            )
        n_cal = min(calibration_trajectories, len(x))
        acceptance: dict = {}
        # one calibration chain per draft and per coupling family: after a rejection RMC commits the
        # reflected draft and GRS a residual draw, so the next rounds' mismatches differ
        for draft, family in [(d, c) for d in drafts for c in ("grs", "rmc")]:
            cal = sample(
                model,
                x[:n_cal],
                **_grid(sigmas_for, steps),
                churn=churn,
                tree=chain(min(budget_max, steps)),
                coupling=family,
                draft=draft,
                cond=_rows(cond, n_cal),
                lazy=True,
                record_deltas=True,
                seed=seed,
                **sample_kwargs,
            )
            acceptance[draft, family] = cal.stats.deltas[:, :3]  # (depth, step, delta)
        return cls(model, x, cond, steps, churn, batch, curve, acceptance, seed, sample_kwargs, measured, sigmas_for)

    @property
    def drafts(self) -> list:
        """The calibrated draft kinds."""
        return list(dict.fromkeys(d for d, _ in self.acceptance))

    def _calibration(self, coupling: str, draft: str) -> torch.Tensor:
        return self.acceptance[draft, "rmc" if coupling == "rmc" else "grs"]

    def acceptance_of(self, coupling: str, draft: str) -> Callable[[int, int], float]:
        """``a(l, k)`` of a coupling with a draft, from that draft's calibration (the whole grid)."""
        return acceptance_model(self._calibration(coupling, draft)[:, [0, 2]], coupling)

    def acceptance_bins(self, coupling: str, draft: str, bins: Optional[int] = None) -> list:
        """``[(fraction of the stochastic steps, a(l, k))]`` over ``bins`` stretches of the grid
        (``None``: one per stochastic step).

        Acceptance changes along the grid, and rounds in easy stretches reach deep: one
        average over the grid would understate the steps a long round commits. On the digits
        model it falls from 0.9-1.0 in the first tenth of the grid to 0.45 in the last: 8
        stretches over-predict an RMC chain of 14 by 2-3% in calls, one a step by under 1%.
        A stretch with fewer than 8 calibration records takes those of the steps around it
        as well, widened a stretch on each side at a time.
        """
        if bins is None:
            bins = max(self.steps - _DETERMINISTIC, 1)
        elif not (isinstance(bins, int) and bins >= 1):
            raise ValueError(f"bins must be an int >= 1 or None (one per stochastic step), got {bins!r}")
        key = (coupling, draft, bins)
        if key in self._bins:
            return self._bins[key]
        d = self._calibration(coupling, draft)
        step = d[:, 1]
        lo, hi = 1, max(self.steps - 1, 2)
        width = (hi - lo) / bins
        out = []
        for i in range(bins):
            a, b = lo + i * width, lo + (i + 1) * width
            pad = 0.0
            while True:
                last = i == bins - 1 or b + pad >= hi
                sel = (step >= a - pad) & ((step <= b + pad) if last else (step < b + pad))
                if int(sel.sum()) >= _MIN_RECORDS or (a - pad <= lo and last):
                    break
                pad += width
            out.append((1.0 / bins, acceptance_model(d[sel][:, [0, 2]] if bool(sel.any()) else d[:, [0, 2]], coupling)))
        self._bins[key] = out
        return out

    def sampler_seconds_per_round(self, tree: Optional[DraftTree], coupling: str, verify: str, draft: str) -> float:
        """The sampler's own time per round of a structure: a short real run (``max(16, 2 L + 4)`` steps), cached.

        The time of its rounds' phases over its calls; what the run spends outside its
        rounds (set-up, wrap-up) is :meth:`setup_seconds`, paid once per run. The same run
        adds to :meth:`network_factor`.
        """
        return self._timed(tree, coupling, verify, draft)[0]

    def setup_seconds(self, tree: Optional[DraftTree], coupling: str, verify: str, draft: str) -> float:
        """The sampler's own time per run outside its rounds, from the run of :meth:`sampler_seconds_per_round`."""
        return self._timed(tree, coupling, verify, draft)[1]

    def _timed(self, tree: Optional[DraftTree], coupling: str, verify: str, draft: str) -> tuple:
        key = self._key(tree, coupling, verify, draft)
        if key not in self._sampler_time:
            self._warm_up(tree, coupling, draft, verify)
            # a run's first times at a batch size pay for growing the allocator and the caches
            # (the mixture's first two 64-trajectory chain runs: 45% and 25% more per round): a
            # cheap timing run is repeated, up to TIMING_RUNS, and the median of the runs after the
            # first is kept
            runs: list = []
            spent = 0.0
            while len(runs) < TIMING_RUNS and (not runs or spent < REPEAT_BELOW_SECONDS):
                runs.append(self._timing_run(tree, coupling, verify, draft, len(runs)))
                spent += runs[-1][-1]
            self._settle(key, runs, list(range(1, len(runs))) if len(runs) > 1 else [0])
        return self._sampler_time[key]

    def time(self, configs: Sequence[tuple], min_seconds: float = REPEAT_BELOW_SECONDS, fresh: bool = False) -> None:
        """Time configurations ``(tree, coupling, verify, draft)`` side by side, replacing earlier timings.

        The configurations take turns: in each of up to :data:`TIMING_RUNS` turns each
        makes an untimed run and then a timed one, so that every timed run follows one of
        its own (as when sampling image after image) and all of them see the same
        stretches of a shared machine. Timed one after the other, a configuration timed
        in a slow moment and one in a quiet moment were predicted 27% slow and 26% fast
        in the same table. A configuration whose runs so far took ``min_seconds`` stops
        taking turns; the median timed run is kept (one run of 64 mixture trajectories
        varies by +-15% from the next: more turns, a steadier median).

        ``fresh``: every timing and timed call made before is forgotten, so the network
        factor (:meth:`factor_by_rows`) and every configuration's timing follow the
        machine as it is now, not as it was at tuning (on this shared CPU its speed
        drifts by 15-25% within a minute).
        """
        if not min_seconds >= 0.0:
            raise ValueError(f"min_seconds must be >= 0, got {min_seconds!r}")
        todo = {self._key(*c): tuple(c) for c in configs}
        if fresh:
            self._calls, self._by_rows = [], None
            self._sampler_time.clear()
            self._network_of.clear()
        for tree, coupling, verify, draft in todo.values():
            self._warm_up(tree, coupling, draft, verify)
        runs: dict = {key: [] for key in todo}
        spent = dict.fromkeys(todo, 0.0)
        for turn in range(TIMING_RUNS):
            for key, config in todo.items():
                if turn and spent[key] >= min_seconds:
                    continue
                spent[key] += self._timing_run(*config, 2 * turn)[-1]
                runs[key].append(self._timing_run(*config, 2 * turn + 1))
                spent[key] += runs[key][-1][-1]
        for key, kept in runs.items():
            self._settle(key, kept, list(range(len(kept))))

    def _warm_up(self, tree: Optional[DraftTree], coupling: str, draft: str, verify: str = "internal") -> None:
        """One-off costs (rule tables, first calls) are not per-round costs: one short run first (in the
        configuration's verification mode, so that a run constrained to one mode never makes the other)."""
        if (coupling, draft) in self._warm:
            return
        sample(
            self.model,
            self.x[:1],
            **_grid(self.sigmas_for, min(self.steps, 6)),
            churn=self.churn,
            tree=tree,
            coupling=coupling,
            draft=draft,
            verify=verify,
            cond=_rows(self.cond, 1),
            seed=self.seed + 2,
            **self.sample_kwargs,
        )
        self._warm.add((coupling, draft))

    def _timing_run(self, tree: Optional[DraftTree], coupling: str, verify: str, draft: str, index: int) -> tuple:
        """One short real run: ``(seconds per round, set-up, in rounds, inside the network, on the curve,
        its calls, wall seconds)``."""
        depth = 0 if tree is None else tree.L
        calls: list = []

        def counted(x, sigma, **kw):
            entered = time.perf_counter()
            out = self.model(x, sigma, **kw)
            calls.append((x.shape[0], entered, time.perf_counter()))
            return out

        t0 = time.perf_counter()
        with _no_gc():
            run = sample(
                counted,
                self.x[: self.batch],
                # long enough that most rounds see the whole tree
                **_grid(self.sigmas_for, min(self.steps, max(16, 2 * depth + 4))),
                churn=self.churn,
                tree=tree,
                coupling=coupling,
                draft=draft,
                verify=verify,
                cond=_rows(self.cond, self.batch),
                seed=self.seed + 1 + index,
                **self.sample_kwargs,
            )
        wall = time.perf_counter() - t0
        st = run.stats
        sampler = max(st.sampler_seconds, 0.0)
        in_rounds = min(sum(st.phase_seconds.values()), sampler)
        on_curve = sum(self.curve(c[0]) for c in calls)
        return in_rounds / max(st.calls, 1), sampler - in_rounds, in_rounds, st.target_seconds, on_curve, calls, wall

    def _settle(self, key: tuple, runs: list, kept: list) -> None:
        """Keep the median of the ``kept`` timing runs as the configuration's timing."""
        # the median kept run (the lower one of two): on a shared machine one short run in a few
        # takes a hiccup of tens of ms, which a mean over the runs would take for sampler time
        m = sorted(kept, key=lambda i: runs[i][0])[(len(kept) - 1) // 2]
        per_round, setup, in_rounds, inside, on_curve, calls, _ = runs[m]
        self._sampler_time[key] = (per_round, setup, RoundCost.fit([calls], in_rounds))
        self._network_of[key] = (inside, on_curve)
        for i in kept:
            self._calls += [(c[0], (c[2] - c[1]) / self.curve(c[0])) for c in runs[i][5] if self.curve(c[0]) > 0]

    def network_factor(
        self,
        tree: Optional[DraftTree] = None,
        coupling: Optional[str] = None,
        verify: str = "internal",
        draft: str = "velocity",
    ) -> float:
        """A network call's cost inside a run over its cost on the curve.

        The curve times calls back to back; inside a run the sampler's work between
        calls evicts the network's weights and activations from the caches (on this
        CPU a call then costs 10-25% more). With ``coupling`` given (``tree=None``:
        the standard sampler) it is that configuration's own, from its timing runs
        (:meth:`sampler_seconds_per_round`), or the pooled factor before it is timed.
        Without, the pooled factor: the median of the timed configurations' own
        factors (one short run measures a factor only to about ±20% on this machine,
        and a run in a slow moment once put its configuration's at +51%). Predictions
        price each call by its rows instead (:meth:`factor_by_rows`), with this as
        the fallback before enough calls are timed. 1 when the curve was given rather
        than measured here (it may not time this model) or nothing was timed.
        """
        if not self.measured_curve:
            return 1.0
        if coupling is not None:
            own = self._network_of.get(self._key(tree, coupling, verify, draft))
            if own is not None:
                return own[0] / own[1] if own[1] > 0 else 1.0
        factors = [inside / curve for inside, curve in self._network_of.values() if curve > 0]
        return statistics.median(factors) if factors else 1.0

    def factor_by_rows(self) -> Callable[[float], float]:
        """A call's cost in a run over its cost on the curve, as a function of its rows: what the
        predictions use.

        Every timing run's calls are timed one by one; per size of the curve, the median
        ratio of the calls whose rows are nearest that size (in log rows), interpolated in
        log rows and held constant beyond the sizes seen. Calls of one row cost less in a
        run than back to back on this CPU (0.9x on the digits model) and calls of 64 rows
        more (1.2x), so one factor for every call misprices the configurations at one end;
        and a median over many calls of many runs does not follow one run made in a slow
        moment. The constant :meth:`network_factor` when fewer than 8 calls were timed (or
        the curve was given, then 1).
        """
        # made once per set of timed calls: every prediction and pruning bound reads it
        if self._by_rows is not None and self._by_rows[0] == len(self._calls):
            return self._by_rows[1]
        if not self.measured_curve or len(self._calls) < 8:
            f = self.network_factor()
            return lambda rows: f
        logs = [math.log(b) for b in self.curve.sizes]
        buckets: dict = {}
        for rows, ratio in self._calls:
            lr = math.log(max(rows, 1))
            k = min(range(len(logs)), key=lambda i: abs(logs[i] - lr))
            buckets.setdefault(k, []).append(ratio)
        pts = sorted((logs[k], statistics.median(v)) for k, v in buckets.items())
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]

        def factor(rows: float) -> float:
            lr = math.log(max(rows, 1.0))
            if lr <= xs[0]:
                return ys[0]
            if lr >= xs[-1]:
                return ys[-1]
            j = next(i for i in range(1, len(xs)) if xs[i] >= lr)
            w = (lr - xs[j - 1]) / (xs[j] - xs[j - 1])
            return ys[j - 1] + w * (ys[j] - ys[j - 1])

        self._by_rows = (len(self._calls), factor)
        return factor

    @staticmethod
    def _key(tree: Optional[DraftTree], coupling: str, verify: str, draft: str) -> tuple:
        return (None if tree is None else tuple(tree.parent.tolist()), coupling, verify, draft)

    def network_seconds(
        self, tree: Optional[DraftTree], coupling: str = "grs", verify: str = "internal", draft: str = "velocity"
    ) -> float:
        """Seconds per trajectory of the network calls alone (no sampler time), priced by rows from the
        calls timed so far (:meth:`factor_by_rows`).

        Needs no timing run: :func:`tune` skips timing a candidate whose calls alone are
        slower than a configuration already timed.
        """
        return self._simulate(tree, coupling, verify, self._draft(draft), 0.0, 0.0)[0]

    def _draft(self, draft: str) -> str:
        """``draft``, or the first calibrated draft when ``draft`` was not calibrated."""
        return draft if draft in self.drafts else self.drafts[0]

    def call_seconds(self, rows: float) -> float:
        """Seconds of one call of ``rows`` rows on the curve, as the sampler makes it: with ``pad_rows``,
        split at the largest padded size (or ``max_rows``) and each part padded up."""
        if not self._pads:
            return self.curve(rows)
        top = self._pads[-1]
        chunk = min(int(self.sample_kwargs.get("max_rows") or top), top)
        full, rest = divmod(max(int(math.ceil(rows)), 1), chunk)
        padded = lambda m: next(p for p in self._pads if p >= m)  # noqa: E731
        return full * self.curve(padded(chunk)) + (self.curve(padded(rest)) if rest else 0.0)

    def _simulate(self, tree, coupling: str, verify: str, draft: str, s_round, setup: float) -> tuple:
        """``(seconds per trajectory, calls)`` of :func:`predict_seconds` with this predictor's calibration."""
        a = None if tree is None else self.acceptance_bins(coupling, draft)
        seconds, calls = predict_seconds(
            self.call_seconds if self._pads else self.curve,
            self.steps,
            self.batch,
            tree,
            verify,
            a,
            s_round,
            self.factor_by_rows(),
            setup,
            self.sample_kwargs.get("prefetch", "nearest"),
        )
        return seconds / self.batch, calls

    def predict(
        self, tree: Optional[DraftTree], coupling: str = "grs", verify: str = "internal", draft: str = "velocity"
    ) -> "tuple[float, float, float]":
        """``(seconds per trajectory, calls, sampler seconds per round)`` predicted for a configuration.

        The sampler's time is measured with the first calibrated draft when ``draft`` was not calibrated.
        """
        d = self._draft(draft)
        s_round, setup, cost = self._timed(tree, coupling, verify, d)
        seconds, calls = self._simulate(tree, coupling, verify, d, cost, setup)
        return seconds, calls, s_round


def _grid(sigmas_for: Optional[Callable[[int], torch.Tensor]], steps: int) -> dict:
    """The grid options of a run of ``steps`` steps: the caller's grid when it has one."""
    return {"steps": steps} if sigmas_for is None else {"sigmas": sigmas_for(steps)}


def _rows(cond: Optional[dict], n: int) -> Optional[dict]:
    return None if cond is None else {k: v[:n] for k, v in cond.items()}


SAMPLE_OPTIONS: "dict[str, str]" = {
    # tune's own parameters, of the same name and meaning
    "steps": "tuner",
    "churn": "tuner",
    "cond": "tuner",
    "seed": "tuner",
    "progress": "tuner",
    # constraints on the search
    "verify": "constraint",
    "draft": "constraint",
    "coupling": "constraint",
    # passed to every run the tuner makes (model_kwargs also to every call of the cost curve)
    "grid": "passed",
    "shift": "passed",
    "prefetch": "passed",
    "max_rows": "passed",
    "model_kwargs": "passed",
    "pad_rows": "passed",
    # refused, for the reasons of _REFUSED (lazy and record_deltas only when True)
    "tree": "refused",
    "sigmas": "refused",
    "generator": "refused",
    "sample_index": "refused",
    "callback": "refused",
    "process_group": "refused",
    "tuned_for": "refused",
    "lazy": "refused",
    "record_deltas": "refused",
}
"""How :func:`tune` treats each option of :func:`specforest.sample` (``model`` and ``x`` aside):
``tuner`` (its own parameter), ``constraint`` (restricts the search), ``passed`` (given to
every run it makes) or ``refused`` (a ``ValueError`` that says why)."""

_REFUSED = {
    "tree": "the tree is what tune chooses (Predictor.predict prices one given tree)",
    "sigmas": "give sigmas_for, the grid as a function of its steps: the timing runs are shorter than the run",
    "generator": "the tuner's runs draw from its seed (give seed=)",
    "sample_index": "it names the samples of a run, and the tuner's runs are its own",
    "callback": "its own time would be timed as the sampler's",
    "process_group": "the cost curve times one process's calls, not a tree-parallel group's",
    "tuned_for": "it is what a Tuned passes to sample, not an option to tune with",
    "lazy": "lazy=True is a cost simulation whose wall time is not a run's (the calibration chains are lazy already)",
    "record_deltas": "the calibration chains record their deltas already; a timed run would pay for it",
}


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # tensors compare elementwise
        return False


def _split_options(sample_kwargs: dict) -> "tuple[dict, dict]":
    """``(constraints, passed)`` of the :func:`specforest.sample` options given to :func:`tune`.

    Raises:
        TypeError: for a name that is not an option of :func:`specforest.sample`.
        ValueError: for a refused option, saying why.
    """
    unknown = sorted(k for k in sample_kwargs if SAMPLE_OPTIONS.get(k) not in ("constraint", "passed", "refused"))
    if unknown:
        raise TypeError(f"tune() got unexpected keyword argument(s) {', '.join(unknown)}: not options of sample")
    constraints, passed = {}, {}
    for k, v in sample_kwargs.items():
        kind = SAMPLE_OPTIONS[k]
        if kind == "refused":
            if k in ("lazy", "record_deltas") and v is False:
                continue  # what the timed runs do anyway
            raise ValueError(f"tune does not take {k}: {_REFUSED[k]}")
        (constraints if kind == "constraint" else passed)[k] = v
    return constraints, passed


def tune(
    model: Callable,
    x: torch.Tensor,
    *,
    steps: int,
    churn: float,
    cond: Optional[dict] = None,
    batch: Optional[int] = None,
    budget_max: int = 62,
    drafts: Optional[Sequence[str]] = None,
    curve: Optional[CostCurve] = None,
    calibration_trajectories: int = 16,
    seed: int = 0,
    progress: bool = False,
    predictor: Optional[Predictor] = None,
    min_gain: float = 0.05,
    couplings: Optional[Sequence[str]] = None,
    sigmas_for: Optional[Callable[[int], torch.Tensor]] = None,
    race: int = 3,
    race_repeats: int = 3,
    **sample_kwargs: Any,
) -> Tuned:
    """Choose the tree, coupling, verification mode and draft that minimize predicted wall time here.

    Searches chains (RMC), uniform trees (D-GRS, both verification modes) and
    budget-optimal trees against the standard sampler, for each draft of
    ``drafts``; answers the standard sampler when no tree pays. The standard
    sampler is timed first; a candidate whose network calls alone are predicted
    slower than the best timed one (at 0.8 of the pooled network factor) is not
    timed (``candidates`` lists it with ``timed: False`` and that bound).

    Args:
        model: the target velocity.
        x: ``(n, *shape)`` example initial states; the first ``batch`` rows time the
            candidates, the first ``calibration_trajectories`` calibrate acceptance.
        steps, churn: the run's grid steps and churn.
        cond: per-trajectory conditioning of ``x``'s rows.
        batch: trajectories per run to tune for (default ``len(x)``).
        budget_max: the largest budget considered.
        drafts: the draft kinds considered (each calibrated on its own chain; default
            ``velocity`` and ``x0``, or the ``draft`` option alone).
        curve: a cost curve measured before (default: measured now).
        seed: seed of the calibration runs (independent of the real run's).
        progress: progress bars while measuring.
        predictor: a calibrated :class:`Predictor` to reuse (then the arguments above
            but ``budget_max`` and ``progress`` are its own).
        couplings: restrict the candidates to these couplings (``rmc`` chains, ``grs``
            trees); default all.
        min_gain: a tree is chosen only if it is predicted at least this much faster
            than the standard sampler (the predictions carry noise; a tie goes to the
            standard sampler, which has nothing to lose).
        sigmas_for: the grid of a run of ``n`` steps, ``(n + 1,)`` noise levels (a pipeline's
            scheduler grid, say); default the ``grid`` option of :func:`specforest.sample`.
        race: the finalists: up to this many candidates predicted fastest (within 25% of the
            best prediction, and faster than the standard sampler) run ``race_repeats`` full
            runs each, interleaved with the standard sampler's; the fastest measured (median)
            of those that beat the standard sampler by ``min_gain`` in every repeat, each against
            the standard sampler's run beside it, wins. Predictions from separate short
            measurements carry the machine's drift (10-25% on a shared CPU); an interleaved
            race cancels most of it. 0, or a ``curve`` given rather than measured here: choose
            on the predictions alone.
        sample_kwargs: options of :func:`specforest.sample`, each treated as
            :data:`SAMPLE_OPTIONS` says:

            * constraints on the search: ``verify`` (every tree is verified that way:
              ``verify="drafted"`` times only drafted verification), ``draft`` (a
              registered draft name: only that draft is calibrated and considered; with
              ``drafts`` given it must be one of them), ``coupling`` (``grs``: D-GRS trees
              only, ``rmc``: RMC chains only; with ``couplings`` it must be one of them);
            * passed to every run the tuner makes (calibration, timing, race), so that the
              choice is made for the run that uses them: ``grid``, ``shift``, ``prefetch``
              (recorded in :attr:`Tuned.prefetch`), ``max_rows`` (the curve is measured up to
              it), ``model_kwargs`` (also given to every call of the cost curve), ``pad_rows``
              (the curve is measured at the padded sizes and a call priced at its padded rows).
              Give them to :func:`specforest.sample` again (all but ``prefetch``, which
              ``**tuned`` carries);
            * ``steps``, ``churn``, ``cond``, ``seed`` and ``progress`` are this function's own;
            * refused with a ``ValueError`` that says why: ``tree`` (what is chosen),
              ``sigmas`` (give ``sigmas_for``), ``generator`` and ``sample_index`` (the
              tuner's runs draw from ``seed``), ``callback`` (its time would be timed),
              ``process_group`` (the curve times one process), ``tuned_for``, and
              ``lazy=True`` / ``record_deltas=True`` (``False`` is accepted: what the
              timed runs do).

            With a ``predictor``, a passed option must be the one it was calibrated with.

    Returns:
        A :class:`Tuned`: ``sample(model, x, **tuned, ...)`` runs the choice and checks the run
        against the steps, churn and batch it was chosen for.

    Raises:
        TypeError: a keyword that is not an option of :func:`specforest.sample`.
        ValueError: a refused option, a constraint outside the search (``coupling``
            not ``grs`` or ``rmc``, ``draft`` not in ``drafts``), or a bad value, naming it.
    """
    race, race_repeats = check_int("race", race, 0), check_int("race_repeats", race_repeats, 1)
    constraints, sample_kwargs = _split_options(sample_kwargs)
    verify = constraints.get("verify")
    if verify is not None and verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    draft = constraints.get("draft")
    if draft is not None:
        if not isinstance(draft, str):
            raise TypeError(
                "draft must be a registered draft name for tune (each draft is calibrated and recorded by name; "
                f"register a draft model with specforest.register_draft), got {type(draft).__name__}"
            )
        if drafts is not None and draft not in drafts:
            raise ValueError(f"draft={draft!r} is not one of drafts={list(drafts)}")
        drafts = (draft,)
    coupling = constraints.get("coupling")
    if coupling is not None:
        if coupling not in ("grs", "rmc"):
            raise ValueError(
                f"coupling must be 'grs' (D-GRS trees) or 'rmc' (RMC chains), what tune searches; got {coupling!r}"
            )
        if couplings is not None and coupling not in couplings:
            raise ValueError(f"coupling={coupling!r} is not one of couplings={list(couplings)}")
        couplings = (coupling,)
    if predictor is not None:
        differ = [k for k, v in sample_kwargs.items() if not _same(v, predictor.sample_kwargs.get(k, _UNSET))]
        if differ:
            raise ValueError(
                f"{', '.join(differ)}: the predictor was calibrated with other values; give them to Predictor.calibrate"
            )
        if draft is not None and draft not in predictor.drafts:
            raise ValueError(f"draft={draft!r} was not calibrated by the predictor (it has {predictor.drafts})")
    if sigmas_for is not None and not callable(sigmas_for):
        raise TypeError(
            f"sigmas_for must be callable as sigmas_for(steps) -> (steps + 1,) noise levels, got {sigmas_for!r}"
        )
    pred = predictor or Predictor.calibrate(
        model,
        x,
        steps=steps,
        churn=churn,
        cond=cond,
        batch=batch,
        drafts=("velocity", "x0") if drafts is None else drafts,
        budget_max=budget_max,
        curve=curve,
        calibration_trajectories=calibration_trajectories,
        seed=seed,
        progress=progress,
        sigmas_for=sigmas_for,
        **sample_kwargs,
    )
    drafts = pred.drafts if draft is None else [draft]
    cands = _candidates(pred.acceptance_of("grs", drafts[0]), budget_max, pred.steps, verify)
    if couplings is not None:
        cands = [c for c in cands if c[1] is None or c[2] in couplings]
    runs = [(label, tree, coupling, verify, draft) for label, tree, coupling, verify in cands for draft in drafts]
    runs = [r for r in runs if r[1] is not None or r[4] == drafts[0]]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(runs), desc="candidates", unit="config")
    # the standard sampler first; a candidate whose network calls alone (at a discounted
    # factor) are predicted slower than the best so far is not timed at all
    runs.sort(key=lambda r: r[1] is not None)
    timed, pruned, best_so_far = [], [], math.inf
    for run in runs:
        _, tree, coupling, verify, draft = run
        if tree is not None:
            bound = _PRUNE_MARGIN * pred.network_seconds(tree, coupling, verify, draft)
            if bound > best_so_far:
                pruned.append((run, bound))
                if bar is not None:
                    bar.update(1)
                continue
        pred.sampler_seconds_per_round(tree, coupling, verify, draft)
        best_so_far = min(best_so_far, pred.predict(tree, coupling, verify, draft)[0])
        timed.append(run)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    # predicted again now that the pooled network factor has every timing run
    results = []
    for label, tree, coupling, verify, draft in timed:
        sec, calls, s_round = pred.predict(tree, coupling, verify, draft)
        name = label if tree is None else f"{label}, draft {draft}"
        results.append((sec, calls, s_round, name, tree, coupling, verify, draft))
    standard = next(r for r in results if r[3] == "standard")
    best = min(results, key=lambda r: r[0])
    measured: dict = {}
    finalists = [r for r in sorted(results, key=lambda r: r[0]) if r is not standard]
    finalists = [r for r in finalists if r[0] < standard[0] and r[0] <= 1.25 * best[0]][:race]
    # (a given curve may not time this model, here: then the predictions decide)
    if finalists and pred.measured_curve:
        times = _race(pred, [standard] + finalists, race_repeats)
        measured = {label: statistics.median(t) for label, t in times.items()}
        # a finalist must beat the standard sampler by min_gain in every repeat, each against the
        # standard sampler's run next to it: a median gain of a few percent over three repeats is
        # within a shared machine's noise, and a tree that is in truth slower would then be chosen
        paired = {r[3]: min(s / t for s, t in zip(times[standard[3]], times[r[3]], strict=True)) for r in finalists}
        eligible = [r for r in finalists if paired[r[3]] >= 1.0 + min_gain]
        best = min(eligible, key=lambda r: measured[r[3]]) if eligible else standard
    elif best[0] * (1.0 + min_gain) > standard[0]:
        best = standard
    table = [
        {
            "label": r[3],
            "seconds_per_image": r[0],
            "calls": r[1],
            "sampler_seconds_per_round": r[2],
            "timed": True,
            "measured_seconds_per_image": measured.get(r[3]),
        }
        for r in sorted(results, key=lambda r: r[0])
    ]
    for (label, _, _, _, draft), bound in sorted(pruned, key=lambda p: p[1]):
        table.append(
            {
                "label": f"{label}, draft {draft}",
                "seconds_per_image": None,
                "network_seconds_per_image_at_least": bound,
                "calls": None,
                "sampler_seconds_per_round": None,
                "timed": False,
            }
        )
    return Tuned(
        label=best[3],
        tree=best[4],
        coupling=best[5],
        verify=best[6],
        draft=best[7],
        batch=pred.batch,
        steps=pred.steps,
        predicted_seconds_per_image=best[0],
        predicted_speedup=standard[0] / best[0] if best[0] > 0 else math.inf,
        standard_seconds_per_image=standard[0],
        predicted_calls=best[1],
        curve=pred.curve,
        candidates=table,
        measured_speedup=measured[standard[3]] / measured[best[3]] if measured else None,
        churn=float(pred.churn),
        prefetch=pred.sample_kwargs.get("prefetch", "nearest"),
    )


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Python's cyclic collector off for one timed run, as :mod:`timeit` does: a full collection
    (80 ms with torch loaded) landing in a short timing run would be taken for sampler time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _race(pred: Predictor, entries: list, repeats: int) -> dict:
    """``{label: [seconds per trajectory of each repeat]}``: full runs of each entry, interleaved ``repeats`` times."""
    times: dict = {e[3]: [] for e in entries}
    batch = pred.batch
    for r in range(repeats):
        for _, _, _, label, tree, coupling, verify, draft in entries:
            t0 = time.perf_counter()
            with _no_gc():
                out = sample(
                    pred.model,
                    pred.x[:batch],
                    **_grid(pred.sigmas_for, pred.steps),
                    churn=pred.churn,
                    tree=tree,
                    coupling=coupling,
                    verify=verify,
                    draft=draft,
                    cond=_rows(pred.cond, batch),
                    seed=pred.seed + 10 + r,
                    **pred.sample_kwargs,
                )
                _sync(out.samples.device)
            times[label].append((time.perf_counter() - t0) / batch)
    return times
