"""The calibration: a frozen record of what was measured for one kind of run.

A :class:`Calibration` holds, for runs of ``steps`` steps of ``batch`` trajectories of a
chain (the em chain at ``churn``, or another): the target's cost curve, the acceptance recorded by calibration chains per
draft and coupling family, and, per timed configuration, the sampler's own time (a
:class:`Timing` with its :class:`RoundCost`) and the cost of its calls against the
curve. It is built by :class:`specforest.latency.Calibrator` from real runs, or by hand
(a test, a calibration saved elsewhere), and read by :class:`specforest.latency.Predictor`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Optional

import torch

from ..acceptance import acceptance_model
from ..chains import Chain
from ..options import declared_options
from ..sampler import pad_sizes
from ..trees import DraftTree
from ..validation import check_int
from .curve import CostCurve
from .law import DETERMINISTIC_STEPS
from .options import tuned_chain

__all__ = ["AcceptanceRecords", "Calibration", "Config", "RoundCost", "Timing"]

MIN_RECORDS = 8
"""Calibration records a stretch of :meth:`AcceptanceRecords.by_stretch` needs before it borrows its
neighbours'."""


@dataclass(frozen=True, eq=False)
class Config:
    """A configuration of the sampler: what a timing run times and a prediction prices.

    Two configurations are equal when their trees have the same parent list and their
    other fields are equal, so a configuration keys the timings of a :class:`Calibration`.

    Attributes:
        tree: the draft tree, or ``None`` for the standard sampler.
        coupling: the coupling's registered name.
        verify: the verification mode (:data:`specforest.trees.VERIFY_MODES`).
        draft: the draft kind's registered name.
    """

    tree: Optional[DraftTree] = None
    coupling: str = "grs"
    verify: str = "internal"
    draft: str = "velocity"

    @cached_property
    def key(self) -> tuple:
        """``(parent list or None, coupling, verify, draft)``: hashable, what equality compares."""
        parents = None if self.tree is None else tuple(self.tree.parent.tolist())
        return (parents, self.coupling, self.verify, self.draft)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def options(self) -> dict:
        """The options of :func:`specforest.sample` that run it: ``tree``, ``coupling``, ``verify``, ``draft``."""
        return {"tree": self.tree, "coupling": self.coupling, "verify": self.verify, "draft": self.draft}


@dataclass(frozen=True)
class RoundCost:
    """The sampler's own time of a round as ``fixed + per_row * rows`` (seconds), ``rows`` the round's call.

    A round drafts, verifies and commits states in proportion to the rows it
    evaluates, so a round of the whole tree costs more than one near the end of
    the grid, where the tree is truncated. Fitted to the gaps between a timing
    run's calls.
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


@dataclass(frozen=True)
class Timing:
    """What the timing runs of one configuration measured (the median run's numbers).

    Attributes:
        seconds_per_round: the sampler's own time in its rounds over its calls.
        setup_seconds: the sampler's own time per run outside its rounds (set-up, wrap-up).
        round_cost: the same time in rounds, as a function of a round's rows.
        network_seconds: seconds spent inside the run's network calls.
        curve_seconds: the same calls priced on the cost curve.
    """

    seconds_per_round: float
    setup_seconds: float
    round_cost: RoundCost
    network_seconds: float = 0.0
    curve_seconds: float = 0.0

    @property
    def network_factor(self) -> float:
        """The run's calls' cost over their cost on the curve (1 when nothing was priced)."""
        return self.network_seconds / self.curve_seconds if self.curve_seconds > 0 else 1.0


@dataclass(frozen=True, eq=False)
class AcceptanceRecords:
    """The verifications a calibration chain recorded, read as acceptance models.

    Attributes:
        records: ``(n, 3)`` rows ``(depth, parent's step, delta)`` (columns 0-2 of ``stats.deltas``).
    """

    records: torch.Tensor
    _memo: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        r = self.records
        if not isinstance(r, torch.Tensor) or r.ndim != 2 or r.shape[1] != 3:
            raise ValueError("records must be an (n, 3) tensor of (depth, step, delta) rows")

    def whole(self, coupling: str) -> Callable[[int, int], float]:
        """``a(l, k)`` of ``coupling`` from every record (the whole grid)."""
        return acceptance_model(self.records[:, [0, 2]], coupling)

    def by_stretch(
        self, coupling: str, steps: int, bins: Optional[int] = None, first: int = 1, stochastic: Optional[int] = None
    ) -> list:
        """``[(fraction of the stochastic steps, a(l, k))]`` over ``bins`` stretches of a grid of ``steps``
        steps (``None``: one per stochastic step), whose ``stochastic`` steps (default ``steps -``
        :data:`~specforest.latency.law.DETERMINISTIC_STEPS`, the ``em`` chain's) start at step ``first``.

        Acceptance changes along the grid, and rounds in easy stretches reach deep: one
        average over the grid would understate the steps a long round commits. A stretch
        with fewer than :data:`MIN_RECORDS` records takes those of the steps around it as
        well, widened a stretch on each side at a time. Computed once per arguments.

        Raises:
            ValueError: ``bins`` is not ``None`` or an int ``>= 1``.
        """
        stochastic = max(steps - DETERMINISTIC_STEPS, 1) if stochastic is None else max(int(stochastic), 1)
        if bins is None:
            bins = stochastic
        elif not (isinstance(bins, int) and not isinstance(bins, bool) and bins >= 1):
            raise ValueError(f"bins must be an int >= 1 or None (one per stochastic step), got {bins!r}")
        key = (coupling, steps, bins, first, stochastic)
        if key not in self._memo:
            self._memo[key] = self._stretches(coupling, bins, int(first), stochastic)
        return self._memo[key]

    def _stretches(self, coupling: str, bins: int, first: int, stochastic: int) -> list:
        d = self.records
        step = d[:, 1]
        lo, hi = first, first + max(stochastic, 1)
        width = (hi - lo) / bins
        out = []
        for i in range(bins):
            a, b = lo + i * width, lo + (i + 1) * width
            pad = 0.0
            while True:
                last = i == bins - 1 or b + pad >= hi
                sel = (step >= a - pad) & ((step <= b + pad) if last else (step < b + pad))
                if int(sel.sum()) >= MIN_RECORDS or (a - pad <= lo and last):
                    break
                pad += width
            rows = d[sel] if bool(sel.any()) else d
            out.append((1.0 / bins, acceptance_model(rows[:, [0, 2]], coupling)))
        return out


def _family(coupling: str) -> str:
    """The calibration chain a coupling reads: after a rejection RMC commits the reflected draft and
    every other coupling a residual draw (GRS's), so the next rounds' mismatches differ."""
    return "rmc" if coupling == "rmc" else "grs"


@dataclass(frozen=True)
class Calibration:
    """What was measured for runs of ``steps`` steps of ``batch`` trajectories at ``churn`` (or of another chain).

    Attributes:
        steps: grid steps ``T`` of the run.
        churn: its churn (the em chain's; ``None`` with another chain).
        batch: trajectories per run.
        curve: the target's cost curve.
        acceptance: ``{(draft, family): records}``, ``family`` ``"grs"`` or ``"rmc"`` (the
            calibration chain's coupling); a tensor is taken as :class:`AcceptanceRecords`.
        curve_measured: whether the curve times this model here (then the calls of a timing
            run can be compared to it); a curve given from elsewhere may not.
        timings: ``{configuration: its timing}``.
        calls: ``(rows, seconds in a run / seconds on the curve)`` of every timed call.
        pad_rows: the row counts every call is padded to (``sample``'s ``pad_rows``), or ``None``.
        max_rows: the largest call the sampler makes (``sample``'s ``max_rows``), or ``None``.
        prefetch: the sampler's prefetch policy of the runs.
        chain: the chain of the runs: ``"em"`` (the paper's, at ``churn``; the default) or a
            :class:`~specforest.chains.Chain` with its parameters.
        chain_steps: the chain's steps on the run's grid (``None``: ``steps``; a chain of half-steps,
            ``dpmpp_sde``, has ``2 steps - 1``): what a trajectory walks and a tree drafts.
        first_stochastic, stochastic_steps: the first chain step with noise and how many there are, on the
            run's grid (``None``: the ``em`` chain's, from step 1, ``steps -``
            :data:`~specforest.latency.law.DETERMINISTIC_STEPS`); the rest no round verifies.
        standard_calls: the model calls of the standard run on the run's grid
            (:attr:`~specforest.sde.GaussianChain.standard_calls`: Heun's ``2 T - 1``; ``None``: ``chain_steps``
            times the chain's stages).

    Raises:
        TypeError / ValueError: a field of the wrong type or out of range, naming it.
    """

    steps: int
    churn: Optional[float]
    batch: int
    curve: CostCurve
    acceptance: Mapping = field(default_factory=dict)
    curve_measured: bool = False
    timings: Mapping = field(default_factory=dict)
    calls: tuple = ()
    pad_rows: Optional[tuple] = None
    max_rows: Optional[int] = None
    prefetch: str = "nearest"
    chain: "str | Chain" = "em"
    first_stochastic: int = 1
    stochastic_steps: Optional[int] = None
    chain_steps: Optional[int] = None
    standard_calls: Optional[int] = None

    def __post_init__(self) -> None:
        check_int("steps", self.steps, 1)
        if self.standard_calls is not None:
            check_int("standard_calls", self.standard_calls, 1)
        if self.chain_steps is None:
            object.__setattr__(self, "chain_steps", self.steps)
        n = check_int("chain_steps", self.chain_steps, 1)
        check_int("first_stochastic", self.first_stochastic, 0, n)
        if self.stochastic_steps is None:
            object.__setattr__(self, "stochastic_steps", max(n - DETERMINISTIC_STEPS, 0))
        check_int("stochastic_steps", self.stochastic_steps, 0, n - self.first_stochastic)
        churn, chain = tuned_chain(self.churn, self.chain)
        object.__setattr__(self, "churn", churn)
        object.__setattr__(self, "chain", chain)
        check_int("batch", self.batch, 1)
        if self.max_rows is not None:
            check_int("max_rows", self.max_rows, 1)
        policies = declared_options()["prefetch"].allowed()
        if self.prefetch not in policies:
            raise ValueError(f"prefetch must be one of {policies}, got {self.prefetch!r}")
        acc = {k: v if isinstance(v, AcceptanceRecords) else AcceptanceRecords(v) for k, v in self.acceptance.items()}
        if any(not isinstance(k, Config) or not isinstance(v, Timing) for k, v in self.timings.items()):
            raise TypeError("timings must map each Config to its Timing")
        object.__setattr__(self, "acceptance", MappingProxyType(acc))
        object.__setattr__(self, "timings", MappingProxyType(dict(self.timings)))
        object.__setattr__(self, "calls", tuple((float(r), float(f)) for r, f in self.calls))
        object.__setattr__(self, "pad_rows", pad_sizes(self.pad_rows))

    @property
    def drafts(self) -> list:
        """The calibrated draft kinds, in calibration order."""
        return list(dict.fromkeys(d for d, _ in self.acceptance))

    def records(self, coupling: str, draft: str) -> AcceptanceRecords:
        """The acceptance records a configuration of ``coupling`` with ``draft`` reads."""
        return self.acceptance[draft, _family(coupling)]

    def timed(self, config: Config, timing: Timing, calls: Sequence[tuple] = ()) -> "Calibration":
        """This calibration with ``config``'s timing set to ``timing`` and ``calls`` added to :attr:`calls`."""
        return replace(self, timings={**self.timings, config: timing}, calls=self.calls + tuple(calls))

    def untimed(self) -> "Calibration":
        """This calibration without any timing or timed call (the curve and acceptance kept)."""
        return replace(self, timings={}, calls=())
