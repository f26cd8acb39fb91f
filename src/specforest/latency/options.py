"""How the tuner treats each option of :func:`specforest.sample`: its own, a constraint, passed on, or refused."""

from __future__ import annotations

from typing import Any, Optional

from ..chains import EM, Chain, get_chain
from ..options import RUN_INPUTS, declared_options
from ..validation import check_churn

__all__ = ["SAMPLE_OPTIONS", "tuned_chain"]

UNSET = object()
"""An option not given (distinct from every value, ``None`` included)."""


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


def sample_options() -> "dict[str, str]":
    """:data:`SAMPLE_OPTIONS` as the options are declared now (each field's ``Option.tune``)."""
    return {**{n: o.tune for n, o in declared_options().items()}, **{n: _RUN_INPUTS[n] for n in RUN_INPUTS}}


SAMPLE_OPTIONS: "dict[str, str]" = sample_options()
"""How :func:`~specforest.latency.tune` treats each option of :func:`specforest.sample` (every field of
:class:`~specforest.options.SamplerOptions`, then every input of a run, :data:`~specforest.options.RUN_INPUTS`):
``tuner`` (its own parameter), ``constraint`` (restricts the search), ``passed`` (given to
every run it makes) or ``refused`` (a ``ValueError`` that says why): each option's as its field declares it
(:class:`~specforest.options.Option`), each run input's here."""

_REFUSED = {  # (an option's reason is declared on its field: Option.refused)
    "generator": "the tuner's runs draw from its seed (give seed=)",
    "sample_index": "it names the samples of a run, and the tuner's runs are its own",
    "callback": "its own time would be timed as the sampler's",
    "process_group": "the cost curve times one process's calls, not a tree-parallel group's",
    "tuned_for": "it is what a Tuned passes to sample, not an option to tune with",
    "noise": "the tuner's runs are speculative, and a speculative run draws its noise from its seed",
}


def tuned_chain(churn: Any, chain: Any) -> "tuple[Optional[float], str | Chain]":
    """``(churn, chain)`` of a run to tune for, as every run the tuner makes takes them: the em chain as
    ``(its churn, "em")`` (``sample``'s options before chains), another chain as ``(None, the Chain)``.

    Raises:
        ValueError / TypeError: as :func:`specforest.sample` for ``churn`` and ``chain`` (a churn given with
            another chain than em, an unknown chain, ...), naming them.
    """
    if isinstance(chain, EM) or (isinstance(chain, str) and chain.lower() == "em"):
        if churn is None:
            if not isinstance(chain, EM):
                raise TypeError("churn is required with the em chain (the default): a float in (0, 1]")
            churn = chain.churn
        churn = check_churn(churn)
        if isinstance(chain, EM) and churn != chain.churn:
            raise ValueError(f"churn={churn:g} disagrees with the chain's churn {chain.churn:g}; give one of them")
        return churn, "em"
    made = get_chain(chain)
    if churn is not None:
        raise ValueError(
            f"churn={churn!r} is the em chain's parameter; chain {made.name!r} takes {made.params} "
            f"(set them on the chain: specforest.chains.get_chain({made.name!r}, ...)); leave churn unset"
        )
    return None, made


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
    roles = sample_options()
    unknown = sorted(k for k in sample_kwargs if roles.get(k) not in ("constraint", "passed", "refused"))
    if unknown:
        raise TypeError(f"tune() got unexpected keyword argument(s) {', '.join(unknown)}: not options of sample")
    constraints, passed = {}, {}
    for k, v in sample_kwargs.items():
        kind = roles[k]
        if kind == "refused":
            if k in ("lazy", "record_deltas") and v is False:
                continue  # what the timed runs do anyway
            declared = declared_options().get(k)
            raise ValueError(f"tune does not take {k}: {declared.refused if declared else _REFUSED[k]}")
        (constraints if kind == "constraint" else passed)[k] = v
    return constraints, passed
