"""What every draft shares: the base class :class:`Proposal` (the draft mean at drafted parents and
the needs a draft declares), the draft kind names, and the table of registered drafts that the
drafts' errors cite (filled with the shipped drafts by :mod:`specforest.drafts.registry`)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..registry import Registry
from ..sde import StepTables
from .prefetch import Prefetch

__all__ = [
    "AUTO_KINDS",
    "DRAFT_KINDS",
    "FROZEN_KINDS",
    "MODEL_DRAFTS",
    "PICARD_DRAFTS",
    "Proposal",
    "VelocityFn",
    "available_drafts",
]

DRAFT_KINDS = ("velocity", "drift", "x0", "eps", "x0_extrap", "auto", "memory", "secant")
"""Parameterizations a frozen prediction can be held fixed in; ``auto`` picks one
per draft offset from the mismatch observed in earlier rounds (:class:`AutoDraft`); ``memory``
drafts each step from the previous round's evaluation at that step (:class:`MemoryDraft`);
``secant`` moves that evaluation to the drafted state by a fitted gain (:class:`SecantDraft`)."""

FROZEN_KINDS = DRAFT_KINDS[:5]
MODEL_DRAFTS = ("learned", "cached")
"""Registered drafts that make network calls of their own while drafting (counted in
``draft_calls``) and serve only the models that have what they need: ``learned``, the digits
model's distilled U-Net (:class:`LearnedDraft`), and ``cached``, the target's own outer blocks
with its deep features reused (:class:`CachedDraft`, for a model that keeps them)."""

PICARD_DRAFTS = ("picard", "picard2")
"""Registered drafts that refine each chain round with Picard sweeps of the target (``J = 1, 2``;
:class:`PicardDraft`): each sweep is one more target call a round, counted in the NFE."""

AUTO_KINDS = (*FROZEN_KINDS, "memory", "secant")
"""What ``auto`` chooses among, in its state's column order."""

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Proposal:
    """Base class: the draft transition mean ``m^p(y)`` at drafted parents.

    States are flattened and trajectory-major: ``y (G, n, D)`` holds ``n``
    parents of each of ``G`` trajectories, all at the step ``steps (G, n)``.

    Declared needs (class attributes, read by the sampler):
        needs_prefetch: the proposal needs a target evaluation per round (the
            sampler prefetches it, see ``prefetch`` in :func:`specforest.sample`).
        affine: the mean is affine in the parent, ``A(step) y + C(prefetch, step)``,
            given by :meth:`coefficients` (frozen predictions). Otherwise
            :meth:`mean` is called, once per drafted parent.
        observes: :meth:`observe` must be called with the exact target means
            of each round's verified parents.
        uses_history: the proposal reads the evaluation prefetched before the
            last one (``Prefetch.prev_*``); otherwise the sampler does not track it.
        uses_memory: the proposal reads the previous round's evaluated chain
            (``Prefetch.mem_*``, kept by the sampler only then); such a run
            evaluates every node of its rounds, so ``lazy`` runs it as a full round.
        aligned_noise: a chain draws its node at step ``t`` from the key of the
            transition into ``t`` (the same in every round) rather than from
            the round's root, so a node redrafted in a later round gets the
            noise it had before (:class:`MemoryDraft`).
        uses_states: with :attr:`uses_memory`, the proposal also reads the remembered nodes'
            states and the per-step gain sums fitted from them (``Prefetch.mem_y``,
            ``gain_num``, ``gain_den``, :class:`SecantDraft`); the sampler keeps them only then.
        picard_sweeps: Picard sweeps over each drafted chain before its verification, each one
            batched target call counted in the NFE (:class:`PicardDraft`); such a run goes full.
        uses_features: with :attr:`uses_memory`, the round's verification call also keeps the
            target's deep features of every row (the model's ``with_features``), and the proposal
            reads those of the remembered nodes (``Prefetch.mem_f``, :class:`CachedDraft`).
        name: short name recorded in results.

    A proposal's learnt state (if any) is an explicit value: :meth:`init_state`
    makes it, :meth:`observe` returns the next one, and a round drafts with the
    state it started with, so the draft of a round depends only on earlier
    rounds and the sampler stays exact.
    """

    needs_prefetch: bool = True
    affine: bool = False
    observes: bool = False
    uses_history: bool = False
    uses_memory: bool = False
    aligned_noise: bool = False
    uses_states: bool = False
    picard_sweeps: int = 0
    uses_features: bool = False
    name: str = "proposal"

    def init_state(self, device: torch.device) -> Any:
        """The state before any round (``None`` for stateless proposals)."""
        return None

    def check(self, shape: tuple[int, ...], dtype: torch.dtype, model: Any = None) -> None:
        """Refuse, before sampling, a run whose per-sample state ``shape``, working ``dtype`` or
        target ``model`` (``None``: not known yet) the proposal cannot serve (a draft network made
        for another model, a target without what the draft reads), with an error naming the draft
        and why; the default accepts every run.

        Raises:
            ValueError: naming the draft, what it serves and what it was given.
        """

    def bind(self, model: Any, shape: tuple[int, ...], model_kwargs: Optional[dict] = None) -> int:
        """Called once per run, after :meth:`check`, with the run's target velocity, per-sample
        state ``shape`` and the ``model_kwargs`` its calls get; returns the deep-feature numbers a
        remembered node keeps (``0``, the default: none). :class:`CachedDraft` keeps the model to
        call its cheap evaluation."""
        return 0

    def coefficients(
        self, tab: StepTables, steps: torch.Tensor, pre: Prefetch, state: Any, terms: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, C)`` with ``mean = A * y + C`` (affine proposals only).

        Args:
            tab: the SDE's step tables in the states' dtype.
            steps: ``(G, n)`` long steps of the parents.
            pre: the ``G`` trajectories' prefetched evaluations.
            state: the proposal's state.
            terms: :meth:`round_terms` of the same ``steps`` and ``pre`` when the
                sampler made them (a drafted round), else ``None``.

        Returns:
            ``A (G, n, 1)`` and ``C (G, n, D)``.
        """
        raise NotImplementedError

    def round_terms(self, tab: StepTables, steps: torch.Tensor, pre: Prefetch) -> Any:
        """What :meth:`coefficients` and :meth:`observe` both compute from the parents' steps
        ``(G, n)`` and prefetch, made once per drafted round; ``None`` (the default) when nothing is
        shared. The sampler passes it to :meth:`coefficients`, and :meth:`take_terms` of it at the
        verified parents to :meth:`observe`."""
        return None

    def take_terms(self, terms: Any, rows: torch.Tensor, cols: torch.Tensor) -> Any:
        """:meth:`round_terms` at parents ``(rows[i], cols[i])`` of its ``(G, n)`` grid, ``(P,)`` each."""
        raise NotImplementedError

    def mean(
        self,
        tab: StepTables,
        y: torch.Tensor,
        steps: torch.Tensor,
        pre: Optional[Prefetch],
        cond: dict,
        shape: tuple[int, ...],
        state: Any,
    ) -> torch.Tensor:
        """Draft means ``(G, n, D)`` at parents ``y (G, n, D)`` at ``steps (G, n)``.

        ``cond`` holds the ``G`` trajectories' per-trajectory conditioning
        (``(G, ...)`` tensors); ``shape`` is the per-sample state shape.
        """
        A, C = self.coefficients(tab, steps, pre, state)
        return torch.addcmul(C, A, y)

    def observe(
        self,
        state: Any,
        tab: StepTables,
        y: torch.Tensor,
        mu_q: torch.Tensor,
        steps: torch.Tensor,
        pre: Prefetch,
        scale: torch.Tensor,
        terms: Any = None,
    ) -> Any:
        """The next state, given one round's verified parents (only if :attr:`observes`).

        Args:
            y: ``(P, D)`` verified parents; mu_q: ``(P, D)`` their exact target
            means; steps: ``(P,)``; pre: their trajectories' prefetch (``P``
            rows); scale: ``(P,)`` transition std; terms: :meth:`take_terms` of
            the round's :meth:`round_terms` at these parents, or ``None``
            (then compute what is needed).
        """
        return state


_DRAFTS: Registry[Proposal] = Registry("draft", {})
"""The registered drafts, by name: the shipped ones (:mod:`specforest.drafts.registry`) and those
of :func:`~specforest.drafts.registry.register_draft`."""


def available_drafts() -> tuple[str, ...]:
    """The registered draft names."""
    return tuple(_DRAFTS.names())
