"""Compatibility module: the drafts now live in the package :mod:`specforest.drafts`, one module a
draft family plus the registry. Every name this module had is re-exported from there (the same
objects), so ``from specforest.proposals import ...`` keeps working; new code imports from
:mod:`specforest.drafts`.
"""

from __future__ import annotations

from .drafts import (
    AUTO_KINDS,
    DRAFT_KINDS,
    FROZEN_KINDS,
    MODEL_DRAFTS,
    PICARD_DRAFTS,
    AutoDraft,
    CachedDraft,
    DraftModel,
    FrozenPrediction,
    LearnedDraft,
    MemoryDraft,
    PicardDraft,
    Prefetch,
    Proposal,
    SecantDraft,
    available_drafts,
    drafts_serving,
    get_proposal,
    register_draft,
    unregister_draft,
)
from .drafts.base import VelocityFn as VelocityFn

__all__ = [
    "AUTO_KINDS",
    "DRAFT_KINDS",
    "FROZEN_KINDS",
    "AutoDraft",
    "CachedDraft",
    "DraftModel",
    "LearnedDraft",
    "MODEL_DRAFTS",
    "FrozenPrediction",
    "MemoryDraft",
    "PicardDraft",
    "PICARD_DRAFTS",
    "Prefetch",
    "Proposal",
    "SecantDraft",
    "available_drafts",
    "drafts_serving",
    "get_proposal",
    "register_draft",
    "unregister_draft",
]
