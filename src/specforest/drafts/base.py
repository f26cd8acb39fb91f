"""What every draft shares: the base class :class:`Proposal` (the draft mean at drafted parents and
the needs a draft declares), a draft's per-trajectory memory (:class:`DraftMemory`) and what a chain
round hands it (:class:`EvaluatedChain`), the draft kind names, and the table of registered drafts
that the drafts' errors cite (filled with the shipped drafts by :mod:`specforest.drafts.registry`)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Optional, TypeVar

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
    "DraftMemory",
    "EvaluatedChain",
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
MODEL_DRAFTS = ("learned", "cached", "corrected")
"""Registered drafts that make network calls of their own while drafting (counted in
``draft_calls``) and serve only the models that have what they need: ``learned``, the draft
network the model declares, else the digits model's distilled U-Net (:class:`LearnedDraft`), ``cached``, the target's own outer blocks
with its deep features reused (:class:`CachedDraft`, for a model that keeps them), and ``corrected``,
the cached draft plus a secant correction of its own error from the last rounds (:class:`CorrectedDraft`)."""

PICARD_DRAFTS = ("picard", "picard2")
"""Registered drafts that refine each chain round with Picard sweeps of the target (``J = 1, 2``;
:class:`PicardDraft`): each sweep is one more target call a round, counted in the NFE."""

AUTO_KINDS = (*FROZEN_KINDS, "memory", "secant")
"""What ``auto`` chooses among, in its state's column order."""

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

NetworkFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""A draft's network at other points of its rows (:meth:`Proposal.stage_velocity`): velocities ``(G, m, D)``
at states ``(G, m, D)`` of levels ``(G, m)``, the ``G m`` rows' conditioning bound."""

M = TypeVar("M", bound="DraftMemory")


@dataclass(frozen=True)
class DraftMemory:
    """Base of a draft's per-trajectory memory (:meth:`Proposal.init_memory`): a frozen dataclass
    whose fields are tensors with one row per trajectory (``(batch, ...)``), or ``None`` for a part
    the run does not keep. Subclass it with the fields; the engine carries it without reading them
    (:attr:`specforest.records.RunState.memory`) through the three methods here, which act on every
    field that is not ``None``.
    """

    def _parts(self) -> dict:
        """``{name: tensor}`` of the fields that are kept (not ``None``)."""
        return {f.name: t for f in fields(self) if (t := getattr(self, f.name)) is not None}

    def take(self: M, idx: torch.Tensor) -> M:
        """The rows ``idx (G,)`` (a group's trajectories, in its order)."""
        return replace(self, **{k: t[idx] for k, t in self._parts().items()})

    def put(self: M, idx: torch.Tensor, part: M) -> M:
        """Rows ``idx (G,)`` replaced by ``part``'s ``G`` rows (a group's new memory), the others kept."""
        return replace(self, **{k: t.index_put((idx,), getattr(part, k)) for k, t in self._parts().items()})

    def restart(self: M, rows: torch.Tensor) -> M:
        """Rows ``rows`` as a fresh trajectory's (every number 0, as :meth:`Proposal.init_memory`
        makes them), the others kept (continuous batching refills a slot with it)."""
        return replace(self, **{k: t.index_fill(0, rows, 0) for k, t in self._parts().items()})


@dataclass(frozen=True, slots=True)
class EvaluatedChain:
    """What one chain round evaluated for its group of ``G`` trajectories, as the engine hands it to
    :meth:`Proposal.remember` (views of the round's tensors: never write them). ``Lr`` is the
    round's deepest lookahead.

    Attributes:
        y: ``(G, Lr, D)`` the chain's parents, node ``j`` at step ``s0 + j`` (working dtype).
        v: ``(G, Lr, D)`` the target's velocities there, from the round's verification call (the
            target's dtype; meaningless at nodes ``j >= n``).
        steps: ``(G, Lr)`` long, the parents' steps.
        s0: ``(G,)`` long, the roots' steps.
        n: ``(G,)`` long, each trajectory's lookahead: its parents ``j < n`` are its own.
        features: ``(G, Lr, F)`` the target's deep features at the parents where the run keeps
            them (:attr:`Proposal.uses_features`, ``F`` from :meth:`Proposal.bind`), else ``None``.
    """

    y: torch.Tensor
    v: torch.Tensor
    steps: torch.Tensor
    s0: torch.Tensor
    n: torch.Tensor
    features: Optional[torch.Tensor] = None


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
        uses_memory: the proposal keeps a memory of each trajectory's last chain round (below:
            :meth:`init_memory`, :meth:`remember`); such a run evaluates every node of its
            rounds, so ``lazy`` runs it as a full round.
        aligned_noise: a chain draws its node at step ``t`` from the key of the
            transition into ``t`` (the same in every round) rather than from
            the round's root, so a node redrafted in a later round gets the
            noise it had before (:class:`MemoryDraft`).
        uses_states: with :attr:`uses_memory`, the memory also keeps the remembered nodes'
            states (and, for the shipped drafts, the per-step gain sums fitted from them:
            :class:`SecantDraft`); the memory estimate counts them twice.
        picard_sweeps: Picard sweeps over each drafted chain before its verification, each one
            batched target call counted in the NFE (:class:`PicardDraft`); such a run goes full.
        uses_features: with :attr:`uses_memory`, the round's verification call also keeps the
            target's deep features of every row (the model's ``with_features``), handed to
            :meth:`remember` (:class:`CachedDraft`).
        keeps_pairs: with :attr:`uses_memory`, each remembered node also keeps the node the round
            before evaluated at its step: a state (the offset of the two) and, with
            :attr:`uses_features`, its deep features (:class:`CorrectedDraft`); the memory estimate
            counts them.
        staged: the mean evaluates a network of the draft's own at the drafted parents (a draft model,
            :class:`LearnedDraft`, :class:`CachedDraft`) and runs it through the chain's stage tableau
            as the target's velocity is run (:meth:`stage_velocity`): on a chain of ``s`` stages a drafted
            level makes ``s`` sequential network calls, and the engine counts ``s`` in ``draft_calls``
            (one for a chain of one stage). A frozen prediction (the affine drafts) is the same at every
            stage, so its ``v_eff`` needs no call.
        name: short name recorded in results.

    A proposal's learnt state (if any) is an explicit value: :meth:`init_state`
    makes it, :meth:`observe` returns the next one, and a round drafts with the
    state it started with, so the draft of a round depends only on earlier
    rounds and the sampler stays exact.

    Memory: a proposal may keep, per trajectory, what earlier rounds evaluated. The engine carries
    it without knowing its fields:

    * :meth:`init_memory` makes it before the first round (``None``, the default: none), for a run
      whose rounds may be chains (:attr:`uses_memory` and a tree whose first level does not
      branch); it is a :class:`DraftMemory` (rows taken for a group with ``take``, a group's rows
      replaced with ``put``, a refilled slot cleared with ``restart``), kept in
      :attr:`specforest.records.RunState.memory` beside the prefetch;
    * :meth:`remember` gets it back after every chain round with what the round evaluated
      (:class:`EvaluatedChain`) and returns the next one, for the round's group only;
    * :meth:`coefficients`, :meth:`round_terms`, :meth:`mean` and :meth:`observe` get the
      memory of their ``G`` (``P``) trajectories as the keyword ``memory``, the one the round
      started with, and only when :meth:`init_memory` made one: a proposal that keeps none need
      not take the keyword.

    The memory holds evaluations of earlier rounds only (never the drafted nodes' own draws), so
    the draft of a round depends only on earlier rounds and the sampler stays exact.
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
    keeps_pairs: bool = False
    staged: bool = False
    name: str = "proposal"

    def init_state(self, device: torch.device) -> Any:
        """The state before any round (``None`` for stateless proposals)."""
        return None

    def init_memory(
        self, batch: int, D: int, width: int, steps: int, features: int, dtype: torch.dtype, device: torch.device
    ) -> Optional[DraftMemory]:
        """The memory of ``batch`` trajectories of state dimension ``D`` before any round, or ``None``
        (the default) for a proposal that keeps none.

        Args:
            width: the most chain nodes a round evaluates per trajectory (its deepest lookahead,
                at most the ``steps`` of the grid).
            steps: steps of the grid.
            features: the deep-feature numbers the verification call keeps per row
                (:meth:`bind`; ``0``: none).
            dtype, device: the run's working dtype and device.
        """
        return None

    def remember(self, memory: DraftMemory, tab: StepTables, chain: EvaluatedChain) -> DraftMemory:
        """The memory of a chain round's ``G`` trajectories after it: ``memory`` holds their rows
        before the round (``take`` of the run's), ``chain`` what the round evaluated. Called by the
        engine after every chain round of a run that keeps a memory; the result has ``G`` rows."""
        raise NotImplementedError(f"draft {self.name!r} keeps a memory: it must implement remember")

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
        self,
        tab: StepTables,
        steps: torch.Tensor,
        pre: Prefetch,
        state: Any,
        terms: Any = None,
        memory: Optional[DraftMemory] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, C)`` with ``mean = A * y + C`` (affine proposals only).

        Args:
            tab: the SDE's step tables in the states' dtype.
            steps: ``(G, n)`` long steps of the parents.
            pre: the ``G`` trajectories' prefetched evaluations.
            state: the proposal's state.
            terms: :meth:`round_terms` of the same ``steps`` and ``pre`` when the
                sampler made them (a drafted round), else ``None``.
            memory: the ``G`` trajectories' memory (only given where :meth:`init_memory` made one).

        Returns:
            ``A (G, n, 1)`` and ``C (G, n, D)``.
        """
        raise NotImplementedError

    def round_terms(
        self, tab: StepTables, steps: torch.Tensor, pre: Prefetch, memory: Optional[DraftMemory] = None
    ) -> Any:
        """What :meth:`coefficients` and :meth:`observe` both compute from the parents' steps
        ``(G, n)``, prefetch and memory, made once per drafted round; ``None`` (the default) when
        nothing is shared. The sampler passes it to :meth:`coefficients`, and :meth:`take_terms` of
        it at the verified parents to :meth:`observe`."""
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
        memory: Optional[DraftMemory] = None,
    ) -> torch.Tensor:
        """Draft means ``(G, n, D)`` at parents ``y (G, n, D)`` at ``steps (G, n)``.

        ``cond`` holds the ``G`` trajectories' per-trajectory conditioning
        (``(G, ...)`` tensors); ``shape`` is the per-sample state shape; ``memory`` the ``G``
        trajectories' memory (only given where :meth:`init_memory` made one).
        """
        if memory is None:
            A, C = self.coefficients(tab, steps, pre, state)
        else:
            A, C = self.coefficients(tab, steps, pre, state, memory=memory)
        return torch.addcmul(C, A, y)

    def stage_velocity(
        self, tab: StepTables, network: NetworkFn, y: torch.Tensor, steps: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """The effective velocity ``v_eff (G, m, D)`` the chain's mean reads, of the draft's own network at
        states ``y (G, m, D)`` at ``steps (G, m)``, given its velocity ``v (G, m, D)`` there.

        For a :attr:`staged` draft on a chain of ``s > 1`` stages, :meth:`specforest.stages.Stages.velocity`
        with ``network`` as the target: each later stage is one batched call
        ``network(points (G, m, D), levels (G, m)) -> (G, m, D)`` at the point the draft's own earlier
        predictions give, and ``v_eff`` weighs the predictions as the tableau does; so a network equal to
        the target gives the target's ``v_eff``. Otherwise (one stage, or a draft that is not
        :attr:`staged`) ``v`` itself, and ``network`` is not called. Any network keeps the law: it reads
        only the drafted parents and what earlier rounds evaluated.
        """
        stages = tab.tableau
        if not self.staged or stages is None:
            return v
        G, m, D = y.shape

        def target(points: torch.Tensor, levels: torch.Tensor, traj: Any, rows_key: Any = None) -> torch.Tensor:
            return network(points.view(G, m, D), levels.view(G, m)).reshape(G * m, D)

        flat = lambda t: t.reshape(G * m, D)  # noqa: E731
        out = stages.velocity(target, flat(y), steps.reshape(-1), None, flat(v), tab.sig[steps].reshape(-1))
        return out.view(G, m, D)

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
        memory: Optional[DraftMemory] = None,
    ) -> Any:
        """The next state, given one round's verified parents (only if :attr:`observes`).

        Args:
            y: ``(P, D)`` verified parents; mu_q: ``(P, D)`` their exact target
            means; steps: ``(P,)``; pre: their trajectories' prefetch (``P``
            rows); scale: ``(P,)`` transition std; terms: :meth:`take_terms` of
            the round's :meth:`round_terms` at these parents, or ``None``
            (then compute what is needed); memory: their trajectories' memory the round
            drafted with (``P`` rows; only given where :meth:`init_memory` made one).
        """
        return state


DRAFTS: Registry[Proposal] = Registry("draft", {})
"""The registered drafts, by name: the shipped ones (:mod:`specforest.drafts.registry`) and those
of :func:`~specforest.drafts.registry.register_draft`."""


def available_drafts() -> tuple[str, ...]:
    """The registered draft names."""
    return tuple(DRAFTS.names())
