"""Drafts: how drafted states are drawn (paper eq. 7, Appendix C.1).

A proposal gives the draft transition mean ``m^p(y)`` at any state and step;
its scale is always the target's (eq. 37), which is what the couplings need.

* :class:`FrozenPrediction` -- the self-speculative *delayed drift*: one target
  evaluation, made at some earlier node ``(y*, sigma*)`` (the prefetched root
  drift), is frozen in a chosen parameterization and every exactly known part
  is recomputed at each drafted state and step.
* :class:`DraftModel` -- an independent cheap model with the target's
  signature, evaluated at every drafted parent.

Any proposal keeps the sampler exact: the couplings correct whatever mean the
draft uses. The proposal only moves the acceptance rate.

One module a draft family, and the registry:

* :mod:`~specforest.drafts.base` -- :class:`Proposal`, the base class every draft subclasses,
  :class:`DraftMemory`, the base of a draft's per-trajectory memory, :class:`EvaluatedChain`,
  what a chain round hands it, and the draft kind names;
* :mod:`~specforest.drafts.prefetch` -- :class:`Prefetch`, the evaluations a draft reads (the
  engine's);
* :mod:`~specforest.drafts.chain_memory` -- :class:`ChainMemory`, the previous chain round of
  each trajectory, and :class:`RemembersChain`, the base of the drafts that read it;
* :mod:`~specforest.drafts.frozen` -- :class:`FrozenPrediction` (``velocity``, ``drift``,
  ``x0``, ``eps``, ``x0_extrap``);
* :mod:`~specforest.drafts.memory` -- :class:`MemoryDraft` (``memory``) and
  :class:`SecantDraft` (``secant``);
* :mod:`~specforest.drafts.auto` -- :class:`AutoDraft` (``auto``);
* :mod:`~specforest.drafts.picard` -- :class:`PicardDraft` (``picard``, ``picard2``);
* :mod:`~specforest.drafts.model` -- :class:`DraftModel`, :class:`LearnedDraft` (``learned``,
  the network a model declares, :func:`declared_draft`) and :class:`CachedDraft` (``cached``);
* :mod:`~specforest.drafts.corrected` -- :class:`CorrectedDraft` (``corrected``), the cached draft
  plus a secant correction of its own error, with :class:`PairedChainMemory`;
* :mod:`~specforest.drafts.registry` -- :func:`get_proposal`, :func:`register_draft`,
  :func:`unregister_draft`, :func:`available_drafts`, :func:`drafts_serving`.

``specforest.proposals`` re-exports the same names.
"""

from .auto import AutoDraft
from .base import (
    AUTO_KINDS,
    DRAFT_KINDS,
    FROZEN_KINDS,
    MODEL_DRAFTS,
    PICARD_DRAFTS,
    DraftMemory,
    EvaluatedChain,
    Proposal,
)
from .chain_memory import ChainMemory, RemembersChain
from .corrected import CorrectedDraft, PairedChainMemory
from .frozen import FrozenPrediction
from .memory import MemoryDraft, SecantDraft
from .model import CachedDraft, DraftModel, LearnedDraft, declared_draft
from .picard import PicardDraft
from .prefetch import Prefetch
from .registry import available_drafts, drafts_serving, get_proposal, register_draft, unregister_draft

__all__ = [
    "AUTO_KINDS",
    "DRAFT_KINDS",
    "FROZEN_KINDS",
    "AutoDraft",
    "CachedDraft",
    "ChainMemory",
    "CorrectedDraft",
    "DraftMemory",
    "DraftModel",
    "EvaluatedChain",
    "LearnedDraft",
    "MODEL_DRAFTS",
    "FrozenPrediction",
    "MemoryDraft",
    "PairedChainMemory",
    "PicardDraft",
    "PICARD_DRAFTS",
    "Prefetch",
    "Proposal",
    "RemembersChain",
    "SecantDraft",
    "available_drafts",
    "declared_draft",
    "drafts_serving",
    "get_proposal",
    "register_draft",
    "unregister_draft",
]
