"""The draft registry: the shipped drafts by name, :func:`register_draft`,
:func:`unregister_draft`, :func:`available_drafts`, :func:`drafts_serving` and
:func:`get_proposal`, which resolves a run's ``draft``."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .auto import AutoDraft
from .base import DRAFTS, FROZEN_KINDS, Proposal, VelocityFn, available_drafts
from .corrected import CorrectedDraft
from .frozen import FrozenPrediction
from .memory import MemoryDraft, SecantDraft
from .model import CachedDraft, DraftModel, LearnedDraft
from .picard import PicardDraft

__all__ = ["available_drafts", "drafts_serving", "get_proposal", "register_draft", "unregister_draft"]

_SHIPPED: dict[str, Callable[[], Proposal]] = {
    **{k: (lambda k=k: FrozenPrediction(k)) for k in FROZEN_KINDS},
    "auto": AutoDraft,
    "memory": MemoryDraft,
    "secant": SecantDraft,
    "learned": LearnedDraft.of_model,
    "cached": CachedDraft,
    "corrected": CorrectedDraft,
    "picard": lambda: PicardDraft(1),
    "picard2": lambda: PicardDraft(2),
}
"""The shipped drafts, in the order :func:`available_drafts` lists them."""

for _name, _factory in _SHIPPED.items():
    DRAFTS.register(_name, _factory, replace=True)
del _name, _factory


def register_draft(name: str, factory: Callable[[], Proposal], *, replace: bool = False) -> None:
    """Make ``draft=name`` resolve to ``factory()`` everywhere.

    Raises:
        ValueError: if ``name`` is taken and ``replace`` is False.
        TypeError: if ``factory`` is not callable.
    """
    DRAFTS.register(name, factory, replace=replace)


def unregister_draft(name: str) -> None:
    """Remove ``name`` from the draft registry (undoes :func:`register_draft`).

    Raises:
        ValueError: if ``name`` is not registered.
    """
    DRAFTS.unregister(name)


def drafts_serving(
    names: "list[str] | tuple[str, ...]", shape: Optional[tuple[int, ...]], model: Any = None
) -> list[str]:
    """The registered drafts of ``names`` that serve per-sample states of ``shape`` and the target
    ``model`` (:meth:`Proposal.check`); ``shape=None`` (a pipeline's latents, not known here) keeps
    the drafts that serve any shape, dropping draft networks made for one model
    (:class:`LearnedDraft`). A draft that reads the target's deep features (:class:`CachedDraft`)
    is kept only with a ``model`` that keeps them."""
    out = []
    for name in names:
        prop = get_proposal(name)
        if prop.uses_features and model is None:
            continue
        if shape is None:
            if getattr(prop, "serves", None) is None:
                out.append(name)
            continue
        try:
            prop.check(tuple(shape), torch.float32, model)
        except ValueError:
            continue
        out.append(name)
    return out


def get_proposal(draft: "str | Proposal | VelocityFn") -> Proposal:
    """Resolve ``draft``: a registered name, a :class:`Proposal`, or a draft-model callable.

    A name gives a fresh instance (a stateful proposal's state lives in the run anyway).
    """
    if isinstance(draft, Proposal):
        return draft
    if isinstance(draft, str):
        if draft not in DRAFTS:
            raise ValueError(f"draft must be one of {available_drafts()}, a Proposal or a callable, got {draft!r}")
        return DRAFTS.make(draft)
    if callable(draft):
        return DraftModel(draft)
    raise TypeError(f"draft must be one of {available_drafts()}, a Proposal or a callable, got {draft!r}")
