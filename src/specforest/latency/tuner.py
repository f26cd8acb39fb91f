"""The tuner: the candidates, the search, the race, and the choice of :func:`tune`."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import trees
from ..chains import Chain
from ..options import check_stochastic, options_sde, resolve
from ..proposals import get_proposal
from ..trees import optimal, uniform
from ..validation import check_int
from .calibration import Config
from .curve import CostCurve
from .measure import Calibrator
from .options import UNSET, same, split_options, tuned_chain
from .predictor import Prediction
from .tuned import Tuned

__all__ = ["Candidate", "tune"]

PRUNE_MARGIN = 0.8
"""A candidate is not timed when 0.8 x its network calls' predicted time already exceeds the best
timed prediction: the network factor, pooled from the runs timed so far, would have to fall by
20% for it to become competitive, and its own sampler time only adds."""
RACE_WINDOW = 1.25
"""A finalist's prediction is within this factor of the best prediction."""

CHAIN_BUDGETS = (2, 3, 4, 6, 8, 10, 14, 20, 30)
"""The RMC chains searched, by budget."""
UNIFORM_SHAPES = ((2, 2), (2, 3), (2, 4), (3, 2), (3, 3), (4, 2))
"""The uniform D-GRS trees searched, as ``(K, L)``."""
OPTIMAL_BUDGETS = (6, 14, 30, 62)
"""The budget-optimal D-GRS trees searched, by budget."""


@dataclass(frozen=True)
class Candidate:
    """A configuration the tuner considers.

    Attributes:
        label: the search's name of its tree (``standard``, ``RMC chain B=8``, ``D-GRS (2,3) internal``, ...).
        config: the configuration.
    """

    label: str
    config: Config

    @property
    def name(self) -> str:
        """The name in the tuner's table and in :attr:`Tuned.label`: the label, and the draft of a tree."""
        return self.label if self.config.tree is None else f"{self.label}, draft {self.config.draft}"


@dataclass(frozen=True)
class _Priced:
    """A timed candidate and its prediction."""

    candidate: Candidate
    prediction: Prediction

    @property
    def seconds(self) -> float:
        return self.prediction.seconds_per_image


def candidates(
    acceptance: Callable[[int, int], float],
    budget_max: int,
    steps: int,
    drafts: Sequence[str],
    verify: Optional[str] = None,
    couplings: Optional[Sequence[str]] = None,
) -> list:
    """The :class:`Candidate` list of :func:`tune`, the standard sampler first.

    Args:
        acceptance: ``a(l, k)`` the budget-optimal trees are planned with.
        budget_max: the largest budget ``B`` considered.
        steps: the chain's steps on the grid (an RMC chain is no longer; a chain of half-steps has more than the grid).
        drafts: the draft kinds; every tree is considered with each (a draft that remembers the last
            chain round, :attr:`~specforest.proposals.Proposal.uses_memory`, with chains only), the
            standard sampler with the first.
        verify: every tree verified this way (``None``: both modes for uniform trees, ``internal`` otherwise).
        couplings: only trees of these couplings (``None``: all).
    """
    tag = "" if verify in (None, "internal") else f" {verify}"
    mode = verify or "internal"
    found: list = []
    for B in CHAIN_BUDGETS:
        if B <= min(budget_max, steps):
            found.append((f"RMC chain B={B}{tag}", trees.chain(B), "rmc", mode))
    for K, L in UNIFORM_SHAPES:
        t = uniform(K, L)
        if t.budget <= budget_max:
            for m in ("internal", "drafted") if verify is None else (verify,):
                found.append((f"D-GRS ({K},{L}) {m}", t, "grs", m))
    for B in OPTIMAL_BUDGETS:
        if B <= budget_max:
            t = optimal(acceptance, B, min(B, steps), kmax=8)
            found.append((f"D-GRS optimal B={B}{tag}", t, "grs", mode))
    if couplings is not None:
        found = [t for t in found if t[2] in couplings]
    out = [Candidate("standard", Config(None, "grs", mode, drafts[0]))]
    # a draft that remembers the last chain round is calibrated on chains and drafts like x0 in a tree
    chains_only = {d for d in drafts if get_proposal(d).uses_memory}
    out += [
        Candidate(label, Config(t, c, m, d))
        for label, t, c, m in found
        for d in drafts
        if d not in chains_only or t.budget == t.L
    ]
    return out


def tune(
    model: Callable,
    x: torch.Tensor,
    *,
    steps: int,
    churn: Optional[float] = None,
    chain: "str | Chain" = "em",
    cond: Optional[dict] = None,
    batch: Optional[int] = None,
    budget_max: int = 62,
    drafts: Optional[Sequence[str]] = None,
    curve: Optional[CostCurve] = None,
    calibration_trajectories: int = 16,
    seed: int = 0,
    progress: bool = False,
    predictor: Optional[Calibrator] = None,
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

    Measuring and predicting are separate steps: the :class:`~specforest.latency.Calibrator`
    measures (the cost curve, the calibration chains, the candidates' timing runs, the race)
    and every prediction is :class:`~specforest.latency.Predictor`'s, a pure function of the
    calibration measured. The choice is predicted from the final calibration, with every
    timing run in it.

    Args:
        model: the target velocity.
        x: ``(n, *shape)`` example initial states; the first ``batch`` rows time the
            candidates, the first ``calibration_trajectories`` calibrate acceptance.
        steps, churn: the run's grid steps and churn (the em chain's; required with it, ``None`` with another).
        chain: the run's chain (:mod:`specforest.chains`): ``"em"`` (the default), or another registered
            name or :class:`~specforest.chains.Chain` with its parameters. Every run the tuner makes
            samples it, and the :class:`Tuned` records it.
        cond: per-trajectory conditioning of ``x``'s rows.
        batch: trajectories per run to tune for (default ``len(x)``).
        budget_max: the largest budget considered.
        drafts: the draft kinds considered (each calibrated on its own chain; default
            ``velocity`` and ``x0``, or the ``draft`` option alone).
        curve: a cost curve measured before (default: measured now).
        seed: seed of the calibration runs (independent of the real run's).
        progress: progress bars while measuring.
        predictor: a :class:`~specforest.latency.Calibrator` made before, to reuse its
            calibration and timings (then the arguments above but ``budget_max`` and
            ``progress`` are its own); it goes on measuring what this search needs.
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
            measurements carry the machine's drift between them; an interleaved race
            cancels most of it. 0, or a ``curve`` given rather than measured here: choose
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
            * ``steps``, ``churn``, ``chain``, ``cond``, ``seed`` and ``progress`` are this function's own;
            * refused with a ``ValueError`` that says why: ``tree`` (what is chosen),
              ``sigmas`` (give ``sigmas_for``), ``generator`` and ``sample_index`` (the
              tuner's runs draw from ``seed``), ``callback`` (its time would be timed),
              ``process_group`` (the curve times one process), ``tuned_for``, and
              ``lazy=True`` / ``record_deltas=True`` (``False`` is accepted: what the
              timed runs do).

            With a ``predictor``, a passed option must be the one it was calibrated with.

    Returns:
        A :class:`Tuned`: ``sample(model, x, **tuned, ...)`` runs the choice on the chain it was tuned
        for and checks the run against the steps, churn and batch it was chosen for.

    Raises:
        TypeError: a keyword that is not an option of :func:`specforest.sample`.
        ValueError: a refused option, a constraint outside the search (``coupling``
            not ``grs`` or ``rmc``, ``draft`` not in ``drafts``), or a bad value, naming it.
        NoStochasticStep: a chain with no stochastic step on the run's grid (a ``ValueError``; no tree
            can pay there), before anything is measured.
    """
    race, race_repeats = check_int("race", race, 0), check_int("race_repeats", race_repeats, 1)
    constraints, sample_kwargs = split_options(sample_kwargs)
    # the sampler's own checks of every option given (the tree aside: it is what is chosen)
    churn, chain = tuned_chain(churn, chain)
    # (on the run's own grid where it has one: a VE chain refuses the named grids, which start at t = 1)
    grid = {"sigmas": sigmas_for(steps)} if callable(sigmas_for) else {"steps": steps}
    run = resolve(None, dict(churn=churn, chain=chain, **grid, **constraints, **sample_kwargs))
    # before the cost curve is measured (minutes): on a chain without noise no tree can pay
    sde = options_sde(run)  # (its schedule too: a VE chain is refused on the named grids)
    check_stochastic(sde, "There is nothing to tune: run the standard sampler (tree=None)")
    verify = constraints.get("verify")
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
        if not isinstance(predictor, Calibrator):
            raise TypeError(
                f"predictor must be a Calibrator (Calibrator.calibrate) or None, got {type(predictor).__name__}"
            )
        differ = [k for k, v in sample_kwargs.items() if not same(v, predictor.sample_kwargs.get(k, UNSET))]
        if differ:
            raise ValueError(
                f"{', '.join(differ)}: the predictor was calibrated with other values; "
                "give them to Calibrator.calibrate"
            )
        if draft is not None and draft not in predictor.drafts:
            raise ValueError(f"draft={draft!r} was not calibrated by the predictor (it has {predictor.drafts})")
    if sigmas_for is not None and not callable(sigmas_for):
        raise TypeError(
            f"sigmas_for must be callable as sigmas_for(steps) -> (steps + 1,) noise levels, got {sigmas_for!r}"
        )
    meter = predictor or Calibrator.calibrate(
        model,
        x,
        steps=steps,
        churn=churn,
        chain=chain,
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
    drafts = meter.drafts if draft is None else [draft]
    cands = candidates(
        meter.predictor.acceptance("grs", drafts[0]),
        budget_max,
        meter.calibration.chain_steps,
        drafts,
        verify,
        couplings,
    )
    timed, pruned = _search(meter, cands, progress)
    # every prediction from the final calibration, with every timing run in it
    pred = meter.predictor
    results = [_Priced(c, pred.predict(c.config)) for c in timed]
    standard = results[0]
    best = min(results, key=lambda r: r.seconds)
    measured: dict = {}
    finalists = [r for r in sorted(results, key=lambda r: r.seconds) if r is not standard]
    finalists = [r for r in finalists if r.seconds < standard.seconds and r.seconds <= RACE_WINDOW * best.seconds]
    finalists = finalists[:race]
    # (a given curve may not time this model, here: then the predictions decide)
    if finalists and pred.calibration.curve_measured:
        entries = [standard, *finalists]
        times = dict(zip(entries, meter.race([r.candidate.config for r in entries], race_repeats), strict=True))
        measured = {r: statistics.median(t) for r, t in times.items()}
        # a finalist must beat the standard sampler by min_gain in every repeat, each against the
        # standard sampler's run next to it: a median gain of a few percent over three repeats is
        # within a shared machine's noise, and a tree that is in truth slower would then be chosen
        paired = {r: min(s / t for s, t in zip(times[standard], times[r], strict=True)) for r in finalists}
        eligible = [r for r in finalists if paired[r] >= 1.0 + min_gain]
        best = min(eligible, key=lambda r: measured[r]) if eligible else standard
    elif best.seconds * (1.0 + min_gain) > standard.seconds:
        best = standard
    table = [
        {
            "label": r.candidate.name,
            "seconds_per_image": r.seconds,
            "calls": r.prediction.calls,
            "sampler_seconds_per_round": r.prediction.sampler_seconds_per_round,
            "timed": True,
            "measured_seconds_per_image": measured.get(r),
        }
        for r in sorted(results, key=lambda r: r.seconds)
    ]
    for cand, bound in sorted(pruned, key=lambda p: p[1]):
        table.append(
            {
                "label": cand.name,
                "seconds_per_image": None,
                "network_seconds_per_image_at_least": bound,
                "calls": None,
                "sampler_seconds_per_round": None,
                "timed": False,
            }
        )
    chosen = best.candidate.config
    cal = pred.calibration
    return Tuned(
        label=best.candidate.name,
        tree=chosen.tree,
        coupling=chosen.coupling,
        verify=chosen.verify,
        draft=chosen.draft,
        batch=cal.batch,
        steps=cal.steps,
        predicted_seconds_per_image=best.seconds,
        predicted_speedup=standard.seconds / best.seconds if best.seconds > 0 else math.inf,
        standard_seconds_per_image=standard.seconds,
        predicted_calls=best.prediction.calls,
        curve=cal.curve,
        candidates=table,
        measured_speedup=measured[standard] / measured[best] if measured else None,
        churn=cal.churn,
        prefetch=cal.prefetch,
        chain=cal.chain if isinstance(cal.chain, Chain) else "em",
    )


def _search(meter: Calibrator, cands: list, progress: bool) -> "tuple[list, list]":
    """``(timed candidates, [(pruned candidate, its bound)])``: the standard sampler first, then each
    candidate timed unless its network calls alone, at :data:`PRUNE_MARGIN`, are predicted slower
    than the best timed prediction so far (each bound and prediction from the calibration as it is then)."""
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(cands), desc="candidates", unit="config")
    timed, pruned, best_so_far = [], [], math.inf
    for cand in cands:
        if cand.config.tree is not None:
            bound = PRUNE_MARGIN * meter.predictor.network_seconds(cand.config)
            if bound > best_so_far:
                pruned.append((cand, bound))
                if bar is not None:
                    bar.update(1)
                continue
        meter.time_missing(cand.config)
        best_so_far = min(best_so_far, meter.predictor.predict(cand.config).seconds_per_image)
        timed.append(cand)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return timed, pruned
