"""The tuner's answer: the chosen configuration with its prediction, and its JSON form."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Optional

from ..chains import EM, Chain, get_chain
from ..options import SamplerOptions, check_option
from ..sampler import TunedFor
from ..schedules import MAX_STEPS
from ..trees import DraftTree, from_parents
from ..validation import check_churn, check_int, check_ints, check_number
from .curve import CostCurve

__all__ = ["SCHEDULER", "Tuned"]

SCHEDULER = "scheduler"
"""The chain of a diffusers pipeline's own scheduler (``specforest.diffusers.sample(..., chain="scheduler")``):
not a registered chain (its tables come from the pipeline that runs it), so a configuration tuned for it
records the scheduler's class name and the ``eta`` its steps take, and unpacks as ``chain="scheduler"``
with that ``eta``; the pipeline's sample checks its scheduler against them."""


@dataclass(frozen=True)
class _SchedulerRecord:
    """What a tuned configuration keeps of a pipeline scheduler's chain: its class name and ``eta`` (``None``
    for a scheduler whose step takes none)."""

    scheduler: str
    eta: Optional[float]
    name = SCHEDULER

    @property
    def params(self) -> dict:
        return {"scheduler": self.scheduler, "eta": self.eta}


def _tree_to_json(tree: Optional[DraftTree]) -> Optional[list]:
    return None if tree is None else tree.parent.tolist()


@dataclass
class Tuned(Mapping):
    """The configuration :func:`~specforest.latency.tune` chose, with its prediction: ``sample(model, x, **tuned)``.

    As a mapping it holds :func:`specforest.sample`'s options ``tree``, ``coupling``,
    ``verify``, ``draft`` and ``prefetch`` (:meth:`options`), ``tuned_for``, the run
    it was chosen for (a :class:`~specforest.sampler.TunedFor`: steps, batch, churn), and,
    tuned for another chain than em, ``chain`` (:meth:`run_chain`, so the run samples the chain
    it was tuned for, and a ``chain=`` beside ``**tuned`` is refused as a repeated keyword):
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
            of :func:`~specforest.latency.tune` (interleaved full runs), or ``None`` when there was no race.
        churn: the churn it was tuned for (``None`` when read from a file written before it was kept,
            and with another chain than em).
        chain: the name of the chain it was tuned for (:mod:`specforest.chains`; ``"em"`` in a file
            written before chains were kept).
        chain_params: that chain's parameters (the em chain's: ``{"churn": churn}``, or ``{}`` where the
            churn is not known); a non-finite one (EDM's ``s_tmax = inf``) is ``None``, its default.

    Raises:
        ValueError / TypeError: an unknown chain or parameter, a value the chain refuses, or a churn
            given with another chain than em (or disagreeing with ``chain_params``), naming it.
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
    chain: str = "em"
    chain_params: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.chain, Chain):
            self.chain, self.chain_params = self.chain.name, {**self.chain.params, **(self.chain_params or {})}
        made = _chain_of(self.chain, self.chain_params, self.churn)
        self.chain = made.name
        if isinstance(made, EM):
            known = self.churn is not None or (self.chain_params or {}).get("churn") is not None
            self.churn = made.churn if known else None
            self.chain_params = {} if self.churn is None else {"churn": self.churn}
        else:
            self.chain_params = _json_params(made.params)

    def run_chain(self) -> "Chain | str":
        """The chain it was tuned for, as :func:`specforest.sample`'s ``chain``: a
        :class:`~specforest.chains.Chain` with its parameters, ``"em"`` (its churn is ``churn``), or
        ``"scheduler"`` (:data:`SCHEDULER`: the pipeline's own, its ``eta`` in ``chain_params``)."""
        if self.chain == "em":
            return "em" if self.churn is None else EM(churn=self.churn)
        if self.chain == SCHEDULER:
            return SCHEDULER
        return _chain_of(self.chain, self.chain_params, None)

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
        params = tuple(sorted((k, v) for k, v in (self.chain_params or {}).items() if v is not None))
        return TunedFor(steps=self.steps, batch=self.batch, churn=self.churn, chain=self.chain, chain_params=params)

    def _mapping(self) -> dict:
        # the em chain is sample's default: a Tuned for it unpacks into a pipeline's sample as before
        chain = {} if self.chain == "em" else {"chain": self.run_chain()}
        if self.chain == SCHEDULER and self.chain_params["eta"] is not None:
            chain["eta"] = self.chain_params["eta"]  # (the scheduler's step argument: a pipeline's sample takes it)
        return {**self.options(), **chain, "tuned_for": self.tuned_for}

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
            "chain": self.chain,
            "chain_params": dict(self.chain_params),
            "predicted_seconds_per_image": self.predicted_seconds_per_image,
            "predicted_speedup": self.predicted_speedup,
            "standard_seconds_per_image": self.standard_seconds_per_image,
            "predicted_calls": self.predicted_calls,
            "cost_curve": {"sizes": list(self.curve.sizes), "seconds": list(self.curve.seconds)},
            "candidates": self.candidates,
            "measured_speedup": self.measured_speedup,
        }

    @classmethod
    def from_json(cls, d: Mapping) -> "Tuned":
        """The inverse of :meth:`to_json`, every field checked: a file written by hand or by another
        version runs the configuration it names or is refused, never another sampler.

        A file written before ``churn``, ``prefetch`` and the chain were kept reads with ``churn=None``
        (not checked), ``prefetch="nearest"`` and ``chain="em"`` (what it was tuned with); ``chain`` and
        ``chain_params`` come together (one without the other is refused). ``tuned_for``,
        which ``specforest tune`` writes beside the configuration, is the command line's to read.

        Raises:
            TypeError: if ``d`` is not a mapping, or a field has the wrong type, naming the field.
            ValueError: naming a missing or unknown field, or one out of range with what it accepts
                (a coupling or draft that is not registered, a tree the coupling cannot take, a
                cost curve whose sizes are not ascending, ...).
        """
        if not isinstance(d, Mapping):
            raise TypeError(f"a tuned configuration must be a JSON object (a dict), got {type(d).__name__}")
        unknown = sorted(str(k) for k in d if k not in _FIELDS and k not in _BESIDE)
        if unknown:
            raise ValueError(
                f"unknown field(s) {', '.join(unknown)} in a tuned configuration; its fields are "
                f"{', '.join(_FIELDS)} (and {', '.join(_BESIDE)})"
            )
        missing = [k for k in _FIELDS if k not in d and k not in _OPTIONAL]
        # chain and chain_params were kept together: a file without both predates them (em), one with
        # either holds both
        if ("chain" in d) != ("chain_params" in d):
            missing.append("chain_params" if "chain" in d else "chain")
        if missing:
            raise ValueError(f"a tuned configuration needs the field(s) {', '.join(missing)}")
        get = lambda k: d.get(k, _OPTIONAL.get(k))  # noqa: E731
        if not isinstance(d["label"], str):
            raise TypeError(f"label must be a str, got {type(d['label']).__name__}")
        tree = _tree_from_json(d["tree"])
        # (each option's choices as the sampler's options declare them)
        coupling, draft, verify = (check_option(k, d[k]) for k in ("coupling", "draft", "verify"))
        prefetch = check_option("prefetch", get("prefetch"))
        steps = check_int("steps", d["steps"], 1, MAX_STEPS)
        churn = None if get("churn") is None else check_churn(get("churn"))
        chain_name = SCHEDULER if get("chain") == SCHEDULER else check_option("chain", get("chain"))
        _chain_of(chain_name, get("chain_params"), churn)
        # the sampler's own checks of the configuration: a tree the coupling cannot take (an rmc
        # "chain" with a node of two children, say) is refused here, not run as another sampler
        # (on the em chain at any valid churn: the chain itself was checked above, and where it is
        # defined depends on the run's grid, which the run gives)
        SamplerOptions(
            steps=steps,
            churn=1.0 if churn is None else churn,
            tree=tree,
            coupling=coupling,
            draft=draft,
            verify=verify,
            prefetch=prefetch,
        )
        candidates = get("candidates")
        if not isinstance(candidates, list) or not all(
            isinstance(c, Mapping) and isinstance(c.get("label"), str) for c in candidates
        ):
            raise TypeError("candidates must be a list of objects, each with a str label")
        measured = get("measured_speedup")
        return cls(
            label=d["label"],
            tree=tree,
            coupling=coupling,
            verify=verify,
            draft=draft,
            batch=check_int("batch", d["batch"], 1),
            steps=steps,
            predicted_seconds_per_image=check_number(
                "predicted_seconds_per_image", d["predicted_seconds_per_image"], 0.0
            ),
            predicted_speedup=_speedup("predicted_speedup", d["predicted_speedup"]),
            standard_seconds_per_image=check_number("standard_seconds_per_image", d["standard_seconds_per_image"], 0.0),
            predicted_calls=check_number("predicted_calls", d["predicted_calls"], 0.0),
            curve=_curve_from_json(d["cost_curve"]),
            candidates=candidates,
            measured_speedup=None if measured is None else _speedup("measured_speedup", measured),
            churn=churn,
            prefetch=prefetch,
            chain=chain_name,
            chain_params=get("chain_params"),
        )


def _json_params(params: dict) -> dict:
    """A chain's parameters as JSON holds them: a non-finite number as ``None`` (its default, :func:`_chain_of`)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in params.items()}


def _chain_of(name: Any, params: Any, churn: Optional[float]) -> Chain:
    """The chain ``name`` with ``params`` (a ``None`` parameter: its default), and the em chain's ``churn``.

    Raises:
        ValueError / TypeError: naming the chain, the parameter or the churn.
    """
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise TypeError(f"chain_params must be an object of the chain's parameters, got {type(params).__name__}")
    if name == SCHEDULER:
        return _scheduler_record(params, churn)
    made = get_chain(name, **{k: v for k, v in params.items() if v is not None})
    if isinstance(made, EM):
        if churn is None:
            return made
        churn = check_churn(churn)
        if "churn" in params and params["churn"] is not None and not math.isclose(made.churn, churn):
            raise ValueError(f"churn {churn:g} disagrees with the em chain's chain_params churn {made.churn:g}")
        return EM(churn=churn)
    if churn is not None:
        raise ValueError(
            f"churn is the em chain's parameter; a configuration tuned for chain {made.name!r} has churn null "
            f"(its parameters: {', '.join(made.params)})"
        )
    return made


def _scheduler_record(params: Mapping, churn: Optional[float]) -> _SchedulerRecord:
    """The record of a pipeline scheduler's chain (:data:`SCHEDULER`) from its ``chain_params``.

    Raises:
        ValueError / TypeError: naming the parameter: ``scheduler`` (a class name) and ``eta`` (>= 0, or
            null for a scheduler whose step takes none) only.
    """
    if set(params) != {"scheduler", "eta"}:
        raise ValueError(
            f"chain_params of chain 'scheduler' must hold scheduler (the class name) and eta, got {sorted(params)}"
        )
    name = params["scheduler"]
    if not isinstance(name, str) or not name.isidentifier():
        raise TypeError(f"chain_params.scheduler must be a scheduler's class name, got {name!r}")
    if churn is not None:
        raise ValueError(
            "churn is the em chain's parameter; a configuration tuned for chain 'scheduler' has churn null"
        )
    eta = params["eta"]
    return _SchedulerRecord(name, None if eta is None else check_number("chain_params.eta", eta, 0.0))


_FIELDS = (
    "label",
    "tree",
    "coupling",
    "verify",
    "draft",
    "prefetch",
    "batch",
    "steps",
    "churn",
    "chain",
    "chain_params",
    "predicted_seconds_per_image",
    "predicted_speedup",
    "standard_seconds_per_image",
    "predicted_calls",
    "cost_curve",
    "candidates",
    "measured_speedup",
)
"""The fields of :meth:`Tuned.to_json`, each checked by :meth:`Tuned.from_json`."""

_OPTIONAL = {
    "prefetch": "nearest",
    "churn": None,
    "chain": "em",
    "chain_params": None,
    "candidates": [],
    "measured_speedup": None,
}
"""Fields a file may lack (written before they were kept), with what they read as."""

_BESIDE = ("tuned_for",)
"""What ``specforest tune`` writes beside the configuration (the run it was tuned for, read by the command line)."""


def _tree_from_json(parents: Any) -> Optional[DraftTree]:
    """The tree of a parent list, or ``None`` (the standard sampler); an error names the field ``tree``."""
    if parents is None:
        return None
    try:
        return from_parents(parents)
    except (TypeError, ValueError) as err:
        raise type(err)(f"tree must be null (the standard sampler) or a parent list: {err}") from None


def _speedup(name: str, value: Any) -> float:
    """A ratio of two times, ``>= 0``: infinite where the faster time was 0 (what the tuner writes then)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number >= 0 (inf allowed), got {type(value).__name__}")
    if math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be a number >= 0 (inf allowed), got {value}")
    return float(value)


def _curve_from_json(curve: Any) -> CostCurve:
    """The :class:`CostCurve` of a ``cost_curve`` object ``{"sizes": [...], "seconds": [...]}``."""
    if not isinstance(curve, Mapping) or set(curve) != {"sizes", "seconds"}:
        got = sorted(map(str, curve)) if isinstance(curve, Mapping) else type(curve).__name__
        raise ValueError(f"cost_curve must be an object with sizes and seconds, got {got}")
    sizes = check_ints("cost_curve.sizes", curve["sizes"], 1, nonempty=True)
    if any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
        raise ValueError(f"cost_curve.sizes must be strictly ascending row counts, got {sizes}")
    seconds = curve["seconds"]
    if not isinstance(seconds, list) or len(seconds) != len(sizes):
        raise ValueError(f"cost_curve.seconds must be a list of {len(sizes)} times, one per size, got {seconds!r}")
    return CostCurve(
        tuple(sizes), tuple(check_number(f"cost_curve.seconds[{i}]", t, 0.0) for i, t in enumerate(seconds))
    )
