"""Seconds, not calls: a measured cost model of a round, and the configuration that minimizes wall time.

A speculative round evaluates many states in one call. Whether that saves time
depends on how the call's cost grows with its rows on *this* hardware and on
the sampler's own time per round. :func:`tune` measures both, then predicts:

* measuring (:class:`Calibrator`, module :mod:`~specforest.latency.measure`): the
  target's batch-cost curve ``time(rows)`` (:func:`measure_cost_curve`, module
  :mod:`~specforest.latency.curve`), the acceptance per depth and stretch of the
  grid from short lazy calibration chains, and each candidate's own time per round
  on short real runs, which also time every network call against the curve;
* the record of what was measured (:class:`Calibration`, module
  :mod:`~specforest.latency.calibration`): frozen, and buildable by hand;
* predicting (:class:`Predictor`, module :mod:`~specforest.latency.predictor`): a
  pure function of a calibration and a configuration (:class:`Config`), which
  never runs the sampler. For a run of ``T`` steps for ``batch`` trajectories it is

      set-up + sum over its calls of (factor(rows) x time(rows) + round cost(rows)),

  the calls simulated by :func:`predict_seconds` (module :mod:`~specforest.latency.law`):
  the two deterministic steps and the first root's fetch, then rounds whose committed
  steps are drawn from the tree's law under the calibrated acceptance (on average
  :func:`expected_steps`, the value :func:`specforest.trees.optimal` maximizes). The
  standard sampler takes ``T`` calls of ``batch`` rows;
* choosing (:func:`tune`, module :mod:`~specforest.latency.tuner`): the candidates
  (:class:`Candidate`), the search, and the race of the few predicted fastest against
  the standard sampler (interleaved full runs). It returns the fastest measured, or the
  standard sampler when no tree pays, as a :class:`Tuned` (module
  :mod:`~specforest.latency.tuned`) that states its prediction before the run.

The choice is fixed before sampling, so the sampler stays exact.
"""

from ..sampler import TunedFor
from .calibration import AcceptanceRecords, Calibration, Config, RoundCost, Timing
from .curve import CURVE_PASSES, DEFAULT_SIZES, CostCurve, measure_cost_curve
from .law import PREFETCH_KINDS, expected_steps, predict_seconds, steps_moments
from .measure import REPEAT_BELOW_SECONDS, TIMING_RUNS, Calibrator, TimingRun
from .options import SAMPLE_OPTIONS
from .predictor import Prediction, Predictor
from .tuned import Tuned
from .tuner import Candidate, tune

__all__ = [
    "CURVE_PASSES",
    "DEFAULT_SIZES",
    "PREFETCH_KINDS",
    "REPEAT_BELOW_SECONDS",
    "SAMPLE_OPTIONS",
    "TIMING_RUNS",
    "AcceptanceRecords",
    "Calibration",
    "Calibrator",
    "Candidate",
    "Config",
    "CostCurve",
    "Prediction",
    "Predictor",
    "RoundCost",
    "Timing",
    "TimingRun",
    "Tuned",
    "TunedFor",
    "expected_steps",
    "measure_cost_curve",
    "predict_seconds",
    "steps_moments",
    "tune",
]
