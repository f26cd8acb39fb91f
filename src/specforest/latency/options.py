"""How the tuner treats each option of :func:`specforest.sample`: its own, a constraint, passed on, or refused."""

from __future__ import annotations

from typing import Any

from ..options import RUN_INPUTS, SamplerOptions

__all__ = ["SAMPLE_OPTIONS"]

UNSET = object()
"""An option not given (distinct from every value, ``None`` included)."""


_OPTIONS = {
    # tune's own parameters, of the same name and meaning
    "steps": "tuner",
    "churn": "tuner",
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
    "chain": "refused",
    "lazy": "refused",
    "record_deltas": "refused",
}
_RUN_INPUTS = {
    "cond": "tuner",
    "seed": "tuner",
    "progress": "tuner",
    "generator": "refused",
    "sample_index": "refused",
    "callback": "refused",
    "process_group": "refused",
    "tuned_for": "refused",
    "noise": "refused",
}
SAMPLE_OPTIONS: "dict[str, str]" = {
    **{name: _OPTIONS[name] for name in SamplerOptions.names()},
    **{name: _RUN_INPUTS[name] for name in RUN_INPUTS},
}
"""How :func:`~specforest.latency.tune` treats each option of :func:`specforest.sample` (every field of
:class:`~specforest.options.SamplerOptions`, then every input of a run, :data:`~specforest.options.RUN_INPUTS`):
``tuner`` (its own parameter), ``constraint`` (restricts the search), ``passed`` (given to
every run it makes) or ``refused`` (a ``ValueError`` that says why)."""

_REFUSED = {
    "tree": "the tree is what tune chooses (Predictor.predict prices one given tree)",
    "chain": "tune calibrates the em chain (its churn) only: the calibration and tuned files of other chains are "
    "not built yet; tune with churn, or run another chain with a tree you choose",
    "sigmas": "give sigmas_for, the grid as a function of its steps: the timing runs are shorter than the run",
    "generator": "the tuner's runs draw from its seed (give seed=)",
    "sample_index": "it names the samples of a run, and the tuner's runs are its own",
    "callback": "its own time would be timed as the sampler's",
    "process_group": "the cost curve times one process's calls, not a tree-parallel group's",
    "tuned_for": "it is what a Tuned passes to sample, not an option to tune with",
    "noise": "the tuner's runs are speculative, and a speculative run draws its noise from its seed",
    "lazy": "lazy=True is a cost simulation whose wall time is not a run's (the calibration chains are lazy already)",
    "record_deltas": "the calibration chains record their deltas already; a timed run would pay for it",
}


def same(a: Any, b: Any) -> bool:
    """Whether two option values are the same (identical, or equal where they compare to one bool)."""
    try:
        return a is b or bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # tensors compare elementwise
        return False


def split_options(sample_kwargs: dict) -> "tuple[dict, dict]":
    """``(constraints, passed)`` of the :func:`specforest.sample` options given to :func:`~specforest.latency.tune`.

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
