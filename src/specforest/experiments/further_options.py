"""The further options of :func:`specforest.sample` an experiment's runs take beside their own.

Every runner sets the options of its protocol itself (:data:`SET_BY_RUNS`: its grid, chain, tree,
coupling, draft, rows per call, ...) and takes any other option of
:class:`~specforest.options.SamplerOptions` as given, by name: :func:`specforest.experiments.gmm.simulate`
and :func:`specforest.experiments.pixel.simulate` (``options=``), the SD3 study
(:class:`~specforest.experiments.sd3.SD3Setting`'s ``options``) and a ``generate`` job (its sampler options,
by record key). :func:`further_options` checks them, every run the runner makes gets them, and its record
holds each under its declared key (:func:`options_record`, :func:`with_options`). A field added to
:class:`~specforest.options.SamplerOptions` so reaches every experiment without another edit, and the
command line's extra options (:func:`specforest.cli.sampler_options.extra_values`) with it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Optional

from ..options import check_names, declared_options

__all__ = ["SET_BY_RUNS", "further_options", "options_of_record", "options_record", "with_options"]

SET_BY_RUNS = (
    "steps",
    "churn",
    "chain",
    "sigmas",
    "grid",
    "shift",
    "tree",
    "coupling",
    "draft",
    "prefetch",
    "verify",
    "max_rows",
    "lazy",
    "pad_rows",
)
"""The options an experiment's run sets itself, from its own arguments: its grid (``steps`` on a named grid
or the pipeline's, with its ``shift``; no ``sigmas``), its chain (``churn``, ``chain``), its method's tree
and ``coupling``, the draft's options, the rows per call of its memory limit and their padding, its lazy
mode. Given among the further options, one is refused, not overridden."""


def _them(names: list) -> str:
    return "it" if len(names) == 1 else "them"


def further_options(options: Optional[dict], *, by: str) -> dict:
    """The further options of :func:`specforest.sample` a runner was given, checked: each an option's name,
    none one the runner sets itself (:data:`SET_BY_RUNS`), each value one that JSON holds (the run's record
    keeps it).

    Args:
        options: the options by name (``None``: none).
        by: the runner, for the messages (``"the gmm experiment's run"``).

    Returns:
        A copy of ``options`` (``{}`` for ``None``).

    Raises:
        TypeError: ``options`` not a dict, a name that is no option (listing the options), or a value JSON
            does not hold, naming it.
        ValueError: naming each option the runner sets itself.
    """
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(
            f"options must be a dict of further sampler options by name, or None; got {type(options).__name__}"
        )
    check_names(options)
    taken = [n for n in options if n in SET_BY_RUNS]
    if taken:
        verb = "is an option" if len(taken) == 1 else "are options"
        raise ValueError(
            f"options: {', '.join(taken)} {verb} that {by} sets itself (from its own arguments); leave "
            f"{_them(taken)} out of options"
        )
    for name, value in options.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            raise TypeError(
                f"options[{name!r}] must be a value JSON holds (the run's record keeps it), got {value!r}"
            ) from None
    return dict(options)


def options_record(options: dict) -> dict:
    """The options as a run's record holds them: each under its declared key (``declared_options()[name].key``)."""
    declared = declared_options()
    return {declared[name].key: value for name, value in options.items()}


def with_options(record: dict, options: dict) -> dict:
    """``record`` with the further ``options`` under their keys (:func:`options_record`).

    Raises:
        ValueError: naming an option whose key is a field of the record already (its declaration's ``key``
            must be another).
    """
    added = options_record(options)
    clash = [k for k in added if k in record]
    if clash:
        raise ValueError(f"the record key(s) {', '.join(clash)} of further options are fields of the run's record")
    return {**record, **added}


def options_of_record(record: dict, own: Iterable[str]) -> dict:
    """The further options a record holds, by name: its keys beside ``own`` (the runner's fields), each an
    option's declared key (the inverse of :func:`options_record`).

    Raises:
        ValueError: naming a key that is neither one of ``own`` nor an option's key.
    """
    own = set(own)
    names = {d.key: name for name, d in declared_options().items()}
    unknown = [k for k in record if k not in own and k not in names]
    if unknown:
        raise ValueError(
            f"{', '.join(map(repr, unknown))}: no option of the sampler has {'this' if len(unknown) == 1 else 'these'} "
            "record key(s); the keys are the options' (specforest.options.declared_options)"
        )
    return {names[k]: v for k, v in record.items() if k not in own}
