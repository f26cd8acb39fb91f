"""The predictor: a run's wall time, as a pure function of a calibration and a configuration.

:class:`Predictor` reads a :class:`~specforest.latency.calibration.Calibration` and prices a
configuration with :func:`~specforest.latency.law.predict_seconds`: the cost curve, each
call's network factor by its rows, the configuration's round cost and set-up, and the
acceptance per stretch of the grid. It never runs the sampler and never reads a clock; the
same calibration gives the same answer whatever was asked before.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import NamedTuple, Optional

from ..proposals import get_proposal
from .calibration import Calibration, Config, Timing
from .law import predict_seconds

__all__ = ["Prediction", "Predictor"]

MIN_CALLS_BY_ROWS = 8
"""Timed calls :meth:`Predictor.factor_by_rows` needs before it prices calls by their rows."""


class Prediction(NamedTuple):
    """A configuration's predicted run (a tuple, in this order, as :meth:`Predictor.predict` always gave it).

    Attributes:
        seconds_per_image: wall time per trajectory.
        calls: target calls of the run.
        sampler_seconds_per_round: the sampler's own time per round, as timed.
    """

    seconds_per_image: float
    calls: float
    sampler_seconds_per_round: float


@dataclass(frozen=True)
class Predictor:
    """Predicts any configuration's wall time from a :class:`Calibration`, without running it.

    Attributes:
        calibration: what was measured.
    """

    calibration: Calibration

    @property
    def drafts(self) -> list:
        """The calibrated draft kinds."""
        return self.calibration.drafts

    def _draft(self, draft: str) -> str:
        """``draft``, or the first calibrated draft when ``draft`` was not calibrated."""
        drafts = self.drafts
        if not drafts:
            raise ValueError("the calibration has no acceptance records: nothing to predict a tree with")
        return draft if draft in drafts else drafts[0]

    def acceptance(self, coupling: str, draft: str) -> Callable[[int, int], float]:
        """``a(l, k)`` of ``coupling`` with ``draft``, from that draft's calibration (the whole grid)."""
        return self.calibration.records(coupling, self._draft(draft)).whole(coupling)

    def acceptance_bins(self, coupling: str, draft: str, bins: Optional[int] = None) -> list:
        """``[(fraction of the stochastic steps, a(l, k))]`` over ``bins`` stretches of the grid (``None``:
        one per stochastic step), as :meth:`AcceptanceRecords.by_stretch` gives them."""
        records = self.calibration.records(coupling, self._draft(draft))
        cal = self.calibration
        return records.by_stretch(coupling, cal.chain_steps, bins, cal.first_stochastic, cal.stochastic_steps)

    def network_factor(self, config: Optional[Config] = None) -> float:
        """A network call's cost inside a run over its cost on the curve.

        The curve times calls back to back; inside a run the sampler's work between
        calls evicts the network's weights and activations from the caches. With
        ``config`` it is that configuration's own factor, from its timing runs, or the
        pooled factor when it was not timed. Without, the pooled factor: the median of
        the timed configurations' own factors (one short run measures a factor only
        roughly, and a run in a slow moment would move a mean). Predictions price each
        call by its rows instead (:meth:`factor_by_rows`), with this as the fallback. 1
        when the curve was not measured here (it may not time this model) or nothing was timed.
        """
        cal = self.calibration
        if not cal.curve_measured:
            return 1.0
        if config is not None and config in cal.timings:
            return cal.timings[config].network_factor
        factors = [t.network_factor for t in cal.timings.values() if t.curve_seconds > 0]
        return statistics.median(factors) if factors else 1.0

    def factor_by_rows(self) -> Callable[[float], float]:
        """A call's cost in a run over its cost on the curve, as a function of its rows: what the
        predictions use.

        From every timed call of the calibration: per size of the curve, the median ratio of
        the calls whose rows are nearest that size (in log rows), interpolated in log rows and
        held constant beyond the sizes seen. Small and large calls gain or lose differently
        inside a run, so one factor for every call misprices the configurations at one end;
        and a median over many calls of many runs does not follow one run made in a slow
        moment. The constant :meth:`network_factor` when fewer than :data:`MIN_CALLS_BY_ROWS`
        calls were timed (or the curve was not measured here, then 1).
        """
        return self._by_rows

    @cached_property
    def _by_rows(self) -> Callable[[float], float]:
        # made once per predictor: every prediction and pruning bound reads it
        cal = self.calibration
        if not cal.curve_measured or len(cal.calls) < MIN_CALLS_BY_ROWS:
            f = self.network_factor()
            return lambda rows: f
        logs = [math.log(b) for b in cal.curve.sizes]
        buckets: dict = {}
        for rows, ratio in cal.calls:
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

        return factor

    def call_seconds(self, rows: float) -> float:
        """Seconds of one call of ``rows`` rows on the curve, as the sampler makes it: with ``pad_rows``,
        split at the largest padded size (or ``max_rows``) and each part padded up."""
        cal = self.calibration
        pads = cal.pad_rows
        if not pads:
            return cal.curve(rows)
        top = pads[-1]
        chunk = min(int(cal.max_rows or top), top)
        full, rest = divmod(max(int(math.ceil(rows)), 1), chunk)
        padded = lambda m: next(p for p in pads if p >= m)  # noqa: E731
        return full * cal.curve(padded(chunk)) + (cal.curve(padded(rest)) if rest else 0.0)

    def timing(self, config: Config) -> Timing:
        """The timing of ``config`` (with the first calibrated draft when its draft was not calibrated).

        Raises:
            ValueError: it was not timed (:meth:`specforest.latency.Calibrator.time` times it).
        """
        key = replace(config, draft=self._draft(config.draft))
        hit = self.calibration.timings.get(key)
        if hit is None:
            raise ValueError(f"{key} was not timed: time it first (Calibrator.time, Calibrator.predict)")
        return hit

    def network_seconds(self, config: Config) -> float:
        """Seconds per trajectory of the network calls alone (no sampler time), priced by rows
        (:meth:`factor_by_rows`). Needs no timing of ``config``: the tuner skips timing a
        candidate whose calls alone are slower than a configuration already timed."""
        return self._simulate(config, 0.0, 0.0)[0]

    def predict(self, config: Config) -> Prediction:
        """The predicted run of a timed configuration (see :func:`~specforest.latency.law.predict_seconds`).

        Raises:
            ValueError: ``config`` was not timed.
        """
        t = self.timing(config)
        seconds, calls = self._simulate(config, t.round_cost, t.setup_seconds)
        return Prediction(seconds, calls, t.seconds_per_round)

    def _simulate(self, config: Config, s_round: "float | Callable[[float], float]", setup: float) -> tuple:
        """``(seconds per trajectory, calls)`` of :func:`predict_seconds` under this calibration."""
        cal = self.calibration
        tree = config.tree
        bins = None if tree is None else self.acceptance_bins(config.coupling, config.draft)
        seconds, calls = predict_seconds(
            self.call_seconds if cal.pad_rows else cal.curve,
            cal.chain_steps,
            cal.batch,
            tree,
            config.verify,
            bins,
            s_round,
            self.factor_by_rows(),
            setup,
            cal.prefetch,
            sweeps=get_proposal(self._draft(config.draft)).picard_sweeps if tree is not None else 0,
            deterministic=cal.chain_steps - cal.stochastic_steps,
            stages=getattr(cal.chain, "stages", 1),  # the chain's declaration: its calls a step
            standard_calls=cal.standard_calls,  # (Heun's last step makes one)
        )
        return seconds / cal.batch, calls
