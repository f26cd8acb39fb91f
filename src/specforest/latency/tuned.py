"""The tuner's answer: the chosen configuration with its prediction, and its JSON form."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from ..sampler import TunedFor
from ..trees import DraftTree, from_parents
from .curve import CostCurve

__all__ = ["Tuned"]


def _tree_to_json(tree: Optional[DraftTree]) -> Optional[list]:
    return None if tree is None else tree.parent.tolist()


@dataclass
class Tuned(Mapping):
    """The configuration :func:`~specforest.latency.tune` chose, with its prediction: ``sample(model, x, **tuned)``.

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
            of :func:`~specforest.latency.tune` (interleaved full runs), or ``None`` when there was no race.
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
