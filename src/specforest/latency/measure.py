"""Measuring: the real runs that make a calibration (the only part of the tuner that samples or times).

:class:`Calibrator` holds the model and example states of a kind of run and the
:class:`~specforest.latency.calibration.Calibration` measured so far. It measures the cost
curve and the calibration chains (:meth:`Calibrator.calibrate`), times configurations on
short real runs (:meth:`Calibrator.time`), and times full runs side by side
(:meth:`Calibrator.race`). Each measurement replaces :attr:`Calibrator.calibration` by a new
frozen record; a :class:`~specforest.latency.predictor.Predictor` of it prices configurations.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from .. import trees
from ..chains import Chain
from ..options import make_sde, option_default
from ..sampler import pad_sizes, sample
from ..trees import DraftTree
from .calibration import Calibration, Config, RoundCost, Timing
from .curve import DEFAULT_SIZES, CostCurve, measure_cost_curve, no_gc, sync
from .options import split_options, tuned_chain
from .predictor import Prediction, Predictor

__all__ = ["REPEAT_BELOW_SECONDS", "TIMING_RUNS", "Calibrator", "TimingRun"]

TIMING_RUNS = 5
"""Most timing runs of one configuration (:meth:`Calibrator.time`)."""
REPEAT_BELOW_SECONDS = 0.5
"""A configuration's timing run is repeated while its runs so far took less than this."""


@dataclass(frozen=True)
class TimingRun:
    """One short real run of a configuration, as :meth:`Calibrator.time` measured it.

    Attributes:
        seconds_per_round: the sampler's own time in its rounds over its calls.
        setup_seconds: the sampler's own time outside its rounds.
        in_rounds: the sampler's own time in its rounds.
        network_seconds: seconds inside the network calls.
        curve_seconds: the same calls priced on the cost curve.
        calls: ``(rows, entered, left)`` (perf-counter seconds) of each call.
        wall_seconds: the whole run.
    """

    seconds_per_round: float
    setup_seconds: float
    in_rounds: float
    network_seconds: float
    curve_seconds: float
    calls: tuple
    wall_seconds: float


def _grid(sigmas_for: Optional[Callable[[int], torch.Tensor]], steps: int) -> dict:
    """The grid options of a run of ``steps`` steps: the caller's grid when it has one."""
    return {"steps": steps} if sigmas_for is None else {"sigmas": sigmas_for(steps)}


def _stochastic_steps(grid: dict, options: dict, churn: Any, chain: Any) -> dict:
    """:class:`Calibration`'s ``first_stochastic``, ``stochastic_steps``, ``chain_steps`` and ``standard_calls``: the run's chain on its grid
    (``grid``: :func:`_grid`'s; ``options``: the run's, with ``grid`` and ``shift`` where given)."""
    sde = make_sde(
        grid.get("steps"),
        grid.get("sigmas"),
        options.get("grid", option_default("grid")),
        options.get("shift", option_default("shift")),
        churn,
        chain,
        **{k: options[k] for k in ("schedule", "sigma_min", "sigma_max") if k in options},
    )
    noisy = sde.stochastic.nonzero().flatten()
    return {
        "first_stochastic": int(noisy[0]) if noisy.numel() else 0,
        "stochastic_steps": int(noisy.numel()),
        "chain_steps": int(sde.stochastic.numel()),
        "standard_calls": sde.standard_calls,
    }


def _rows(cond: Optional[dict], n: int) -> Optional[dict]:
    return None if cond is None else {k: v[:n] for k, v in cond.items()}


def _config(config: "Config | Sequence") -> Config:
    """A :class:`Config`, or one from a ``(tree, coupling, verify, draft)`` tuple."""
    return config if isinstance(config, Config) else Config(*config)


class Calibrator:
    """Measures the calibration of one kind of run (its model, example states, steps, chain and batch).

    Made by :meth:`calibrate`. :attr:`calibration` is the frozen record of what was
    measured so far; :attr:`predictor` prices configurations from it. :meth:`predict`,
    :meth:`network_factor` and :meth:`network_seconds` read that predictor, :meth:`predict`
    timing the configuration first when it was not timed.

    Args:
        model: the target velocity.
        x: ``(n, *shape)`` example initial states (the first ``batch`` rows time the runs).
        calibration: what was measured so far.
        cond: per-trajectory conditioning of ``x``'s rows.
        sigmas_for: the grid of a run of ``n`` steps (or ``None``: the ``grid`` option).
        seed: seed of the runs it makes.
        options: the options of :func:`specforest.sample` given to every run it makes.
    """

    def __init__(
        self,
        model: Callable,
        x: torch.Tensor,
        *,
        calibration: Calibration,
        cond: Optional[dict] = None,
        sigmas_for: Optional[Callable[[int], torch.Tensor]] = None,
        seed: int = 0,
        options: Optional[dict] = None,
    ) -> None:
        self.model, self.x, self.cond, self.sigmas_for, self.seed = model, x, cond, sigmas_for, seed
        self.sample_kwargs = dict(options or {})
        self.calibration = calibration
        self._warm: set = set()

    @classmethod
    def calibrate(
        cls,
        model: Callable,
        x: torch.Tensor,
        *,
        steps: int,
        churn: Optional[float] = None,
        chain: "str | Chain" = "em",
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
    ) -> "Calibrator":
        """Measure the cost curve (unless given) and calibrate acceptance per draft on a lazy chain.

        Args: as in :func:`~specforest.latency.tune`; ``sample_kwargs`` are the options given to every run.

        Raises:
            ValueError: for a constraint (``verify``, ``draft``, ``coupling``: a calibration prices
                every configuration; give the draft kinds as ``drafts``) or a refused option.
        """
        constraints, sample_kwargs = split_options(sample_kwargs)
        churn, chain = tuned_chain(churn, chain)
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
        shape = _stochastic_steps(_grid(sigmas_for, steps), sample_kwargs, churn, chain)
        # one calibration chain per draft and per coupling family: after a rejection RMC commits the
        # reflected draft and GRS a residual draw, so the next rounds' mismatches differ
        for draft, family in [(d, c) for d in drafts for c in ("grs", "rmc")]:
            cal = sample(
                model,
                x[:n_cal],
                **_grid(sigmas_for, steps),
                churn=churn,
                chain=chain,
                tree=trees.chain(min(budget_max, shape["chain_steps"])),
                coupling=family,
                draft=draft,
                cond=_rows(cond, n_cal),
                lazy=True,
                record_deltas=True,
                seed=seed,
                **sample_kwargs,
            )
            acceptance[draft, family] = cal.stats.deltas[:, :3]  # (depth, step, delta)
        calibration = Calibration(
            steps=steps,
            churn=churn,
            batch=batch,
            curve=curve,
            acceptance=acceptance,
            curve_measured=measured,
            pad_rows=sample_kwargs.get("pad_rows"),
            max_rows=sample_kwargs.get("max_rows"),
            prefetch=sample_kwargs.get("prefetch", "nearest"),
            chain=chain,
            **shape,
        )
        return cls(
            model, x, calibration=calibration, cond=cond, sigmas_for=sigmas_for, seed=seed, options=sample_kwargs
        )

    # -- what was measured ----------------------------------------------------------------------

    @property
    def predictor(self) -> Predictor:
        """The predictor of the calibration measured so far."""
        return Predictor(self.calibration)

    @property
    def curve(self) -> CostCurve:
        """The calibration's cost curve."""
        return self.calibration.curve

    @property
    def steps(self) -> int:
        return self.calibration.steps

    @property
    def churn(self) -> Optional[float]:
        return self.calibration.churn

    @property
    def chain(self) -> "str | Chain":
        """The chain of the runs: ``"em"`` (at :attr:`churn`) or a :class:`~specforest.chains.Chain`."""
        return self.calibration.chain

    @property
    def batch(self) -> int:
        return self.calibration.batch

    @property
    def drafts(self) -> list:
        """The calibrated draft kinds."""
        return self.calibration.drafts

    @property
    def measured_curve(self) -> bool:
        """Whether the curve times this model here (set it for a curve measured on this model before)."""
        return self.calibration.curve_measured

    @measured_curve.setter
    def measured_curve(self, value: bool) -> None:
        self.calibration = replace(self.calibration, curve_measured=bool(value))

    def predict(
        self, tree: Optional[DraftTree], coupling: str = "grs", verify: str = "internal", draft: str = "velocity"
    ) -> Prediction:
        """The configuration's :class:`~specforest.latency.predictor.Prediction`, timed first when it was not
        (with the first calibrated draft when ``draft`` was not calibrated)."""
        config = Config(tree, coupling, verify, draft)
        self.time_missing(config)
        return self.predictor.predict(config)

    def network_factor(
        self,
        tree: Optional[DraftTree] = None,
        coupling: Optional[str] = None,
        verify: str = "internal",
        draft: str = "velocity",
    ) -> float:
        """:meth:`Predictor.network_factor` of the configuration (``coupling=None``: the pooled factor)."""
        config = None if coupling is None else Config(tree, coupling, verify, draft)
        return self.predictor.network_factor(config)

    def network_seconds(
        self, tree: Optional[DraftTree], coupling: str = "grs", verify: str = "internal", draft: str = "velocity"
    ) -> float:
        """:meth:`Predictor.network_seconds` of the configuration (no timing run)."""
        return self.predictor.network_seconds(Config(tree, coupling, verify, draft))

    # -- timing runs ----------------------------------------------------------------------------

    def time_missing(self, config: "Config | Sequence") -> None:
        """Time ``config`` alone unless it was timed (with the first calibrated draft when its draft was not).

        A process's first runs at a batch size pay for growing the allocator and the caches:
        a cheap timing run is repeated, up to :data:`TIMING_RUNS`, while the runs so far took
        less than :data:`REPEAT_BELOW_SECONDS`, and the median of the runs after the first is kept.
        """
        config = _config(config)
        drafts = self.drafts
        if drafts and config.draft not in drafts:
            config = replace(config, draft=drafts[0])
        if config in self.calibration.timings:
            return
        self._warm_up(config)
        runs: list = []
        spent = 0.0
        while len(runs) < TIMING_RUNS and (not runs or spent < REPEAT_BELOW_SECONDS):
            runs.append(self._timing_run(config, len(runs)))
            spent += runs[-1].wall_seconds
        self._settle(config, runs[1:] if len(runs) > 1 else runs)

    def time(
        self, configs: Sequence["Config | Sequence"], min_seconds: float = REPEAT_BELOW_SECONDS, fresh: bool = False
    ) -> None:
        """Time configurations (:class:`Config`, or ``(tree, coupling, verify, draft)``) side by side,
        replacing their earlier timings.

        The configurations take turns: in each of up to :data:`TIMING_RUNS` turns each
        makes an untimed run and then a timed one, so that every timed run follows one of
        its own (as when sampling image after image) and all of them see the same
        stretches of a shared machine, which timing them one after the other does not. A
        configuration whose runs so far took ``min_seconds`` stops taking turns; the median
        timed run is kept.

        ``fresh``: every timing and timed call made before is forgotten, so the network
        factor and every configuration's timing follow the machine as it is now, not as it
        was when it was first timed.

        Raises:
            ValueError: ``min_seconds`` is negative.
        """
        if not min_seconds >= 0.0:
            raise ValueError(f"min_seconds must be >= 0, got {min_seconds!r}")
        todo = list(dict.fromkeys(_config(c) for c in configs))
        if fresh:
            self.calibration = self.calibration.untimed()
        for config in todo:
            self._warm_up(config)
        runs: dict = {config: [] for config in todo}
        spent = dict.fromkeys(todo, 0.0)
        for turn in range(TIMING_RUNS):
            for config in todo:
                if turn and spent[config] >= min_seconds:
                    continue
                spent[config] += self._timing_run(config, 2 * turn).wall_seconds
                runs[config].append(self._timing_run(config, 2 * turn + 1))
                spent[config] += runs[config][-1].wall_seconds
        for config, kept in runs.items():
            self._settle(config, kept)

    def _warm_up(self, config: Config) -> None:
        """One-off costs (rule tables, first calls) are not per-round costs: one short run first (in the
        configuration's verification mode, so that a run constrained to one mode never makes the other)."""
        if (config.coupling, config.draft) in self._warm:
            return
        sample(
            self.model,
            self.x[:1],
            **_grid(self.sigmas_for, min(self.steps, 6)),
            churn=self.churn,
            chain=self.chain,
            **config.options(),
            cond=_rows(self.cond, 1),
            seed=self.seed + 2,
            **self.sample_kwargs,
        )
        self._warm.add((config.coupling, config.draft))

    def _timing_run(self, config: Config, index: int) -> TimingRun:
        """One short real run of ``config``, long enough that most rounds see the whole tree."""
        depth = 0 if config.tree is None else config.tree.L
        calls: list = []
        counted = _Counted(self.model, calls)
        batch = self.batch
        t0 = time.perf_counter()
        with no_gc():
            run = sample(
                counted,
                self.x[:batch],
                **_grid(self.sigmas_for, min(self.steps, max(16, 2 * depth + 4))),
                churn=self.churn,
                chain=self.chain,
                **config.options(),
                cond=_rows(self.cond, batch),
                seed=self.seed + 1 + index,
                **self.sample_kwargs,
            )
        wall = time.perf_counter() - t0
        st = run.stats
        sampler = max(st.sampler_seconds, 0.0)
        in_rounds = min(sum(st.phase_seconds.values()), sampler)
        curve = self.curve
        return TimingRun(
            seconds_per_round=in_rounds / max(st.calls, 1),
            setup_seconds=sampler - in_rounds,
            in_rounds=in_rounds,
            network_seconds=st.target_seconds,
            curve_seconds=sum(curve(c[0]) for c in calls),
            calls=tuple(calls),
            wall_seconds=wall,
        )

    def _settle(self, config: Config, kept: list) -> None:
        """Record the median of the ``kept`` timing runs as the configuration's timing, and every kept
        run's calls against the curve."""
        # the median kept run (the lower one of two): on a shared machine one short run in a few
        # takes a hiccup, which a mean over the runs would take for sampler time
        m = sorted(kept, key=lambda r: r.seconds_per_round)[(len(kept) - 1) // 2]
        timing = Timing(
            seconds_per_round=m.seconds_per_round,
            setup_seconds=m.setup_seconds,
            round_cost=RoundCost.fit([m.calls], m.in_rounds),
            network_seconds=m.network_seconds,
            curve_seconds=m.curve_seconds,
        )
        curve = self.curve
        ratios = [(c[0], (c[2] - c[1]) / curve(c[0])) for r in kept for c in r.calls if curve(c[0]) > 0]
        self.calibration = self.calibration.timed(config, timing, ratios)

    # -- full runs ------------------------------------------------------------------------------

    def race(self, configs: Sequence[Config], repeats: int) -> list:
        """Seconds per trajectory of each repeat of each configuration, in the order given: full runs
        of the calibrated kind, the configurations interleaved ``repeats`` times."""
        times: list = [[] for _ in configs]
        batch = self.batch
        for r in range(repeats):
            for i, config in enumerate(configs):
                t0 = time.perf_counter()
                with no_gc():
                    out = sample(
                        self.model,
                        self.x[:batch],
                        **_grid(self.sigmas_for, self.steps),
                        churn=self.churn,
                        chain=self.chain,
                        **config.options(),
                        cond=_rows(self.cond, batch),
                        seed=self.seed + 10 + r,
                        **self.sample_kwargs,
                    )
                    sync(out.samples.device)
                times[i].append((time.perf_counter() - t0) / batch)
        return times


class _Counted:
    """The model with the rows and the start and end time of each target call recorded in ``calls``;
    its other attributes are the model's (the cached self-draft's feature protocol among them, whose
    ``with_features`` is a target call and recorded as one)."""

    def __init__(self, model, calls: list) -> None:
        self.model, self.calls = model, calls

    def _timed(self, fn, x, sigma, **kw):
        entered = time.perf_counter()
        out = fn(x, sigma, **kw)
        self.calls.append((x.shape[0], entered, time.perf_counter()))
        return out

    def __call__(self, x, sigma, **kw):
        return self._timed(self.model, x, sigma, **kw)

    def __getattr__(self, name: str):
        attr = getattr(self.model, name)
        if name == "with_features":
            return lambda x, sigma, **kw: self._timed(attr, x, sigma, **kw)
        return attr
