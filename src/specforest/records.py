"""The round engine's records: what a run reads, what it carries between rounds, what a round hands on.

Every record has named fields and is built with keywords. The ones a round
makes (:class:`Group`, :class:`Schedule`, :class:`Draft`, :class:`Evaluations`,
:class:`Observed`, :class:`WalkResult`, and the counters' :class:`Outcome`, :class:`RoundEntry`,
kept in :mod:`specforest.counters`) and the run's state (:class:`RunState`, :class:`Counters`) are frozen values: a
phase returns a new one instead of changing the one it was given.
:class:`RunContext` is frozen too, and nothing in it is filled in by a round:
what a round reads per tree and per step is tabulated when the context is made
(:func:`specforest.engine.make_context`) or when an adaptive policy plans a tree
(:class:`TreeSteps`).

Shapes: ``batch`` trajectories of state dimension ``D``; a group of ``G`` of them
speculating on one tree of ``V`` nodes (``V_r`` within the round's deepest
lookahead ``Lr``, ``V_i`` of depth below it); ``T`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from . import streams
from .carried import NOTHING, Carried
from .counters import FLUSH_ROUNDS as FLUSH_ROUNDS
from .counters import Counters, Outcome, RoundEntry
from .couplings import Coupling
from .drafts import DraftMemory, Prefetch, Proposal
from .sde import StepTables
from .target import Target
from .trees import DraftTree, TreePolicy, TreeTables

__all__ = [
    "PHASES",
    "Counters",
    "Draft",
    "Evaluations",
    "Group",
    "LockstepStep",
    "NoiseBlock",
    "Observed",
    "Outcome",
    "RoundEntry",
    "RunContext",
    "RunState",
    "Schedule",
    "TreeSteps",
    "WalkResult",
    "step_keys",
]

PHASES = ("schedule", "draft", "evaluate", "walk", "commit")
"""The phases of a round, as timed in ``SampleStats.phase_seconds`` (``evaluate`` excludes the
target call itself, which is ``target_seconds``). Host wall time: on CUDA, kernel launch time."""


def step_keys(keys: torch.Tensor, T: int) -> torch.Tensor:
    """``(n, T)`` int64 key of each trajectory at each step, from its sample key ``keys (n,)``."""
    return streams.fold(keys[:, None], torch.arange(T, device=keys.device)[None])


# -- what a run reads ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeSteps:
    """One tree's tables with what its rounds gather per root step ``s`` (``T + 1`` rows).

    Made once per run for a fixed tree (with the context) and once per planned tree for an
    adaptive policy (in the schedule); steps past the end are clamped to ``T - 1`` (their rows
    are never used). In lazy mode only ``tt`` and ``lookahead`` are made (the lazy walk gathers
    per visited node); the node tables are ``None``.

    Attributes:
        tt: the tree's tables.
        step: ``(T + 1, V)`` long, the step of node ``u`` of a tree rooted at ``s``.
        sig: ``(T + 1, V)`` its noise level.
        draft_scale: ``(T + 1, V - 1, 1)`` the transition scale that drafts nodes ``1 .. V - 1``.
        level: ``(T + 1, L)`` long, the parents' step at each depth ``0 .. L - 1``.
        lookahead: ``(T + 1,)`` long, the lookahead the tree takes at each step
            (:attr:`RunContext.lookaheads` at its depth).
    """

    tt: TreeTables
    step: Optional[torch.Tensor]
    sig: Optional[torch.Tensor]
    draft_scale: Optional[torch.Tensor]
    level: Optional[torch.Tensor]
    lookahead: torch.Tensor


@dataclass(frozen=True)
class LockstepStep:
    """What the lockstep round reads at one step, where every trajectory is: the noise level
    ``sig (batch,)`` and the transition's 0-d ``c``, ``a`` and ``scale`` (views made once per run),
    and ``past (h,)``, the past predictions' (``None`` for a chain of history 0)."""

    sig: torch.Tensor
    c: torch.Tensor
    a: torch.Tensor
    scale: torch.Tensor
    past: Optional[torch.Tensor] = None


@dataclass(frozen=True, eq=False)
class RunContext:
    """What every round of a run reads; no round changes it.

    Made by :func:`specforest.engine.make_context`, which also tabulates the
    per-run tables below and picks the run's round function once. The tensors are
    never written; the one collaborator with state of its own is the
    :class:`~specforest.target.Target`, which counts, times and checks its calls
    and holds the trajectories' conditioning.

    Attributes:
        tab, tab64: the SDE's tables in the working dtype and in float64 (the coupling's scale).
        T: steps of the grid.
        coupling, proposal, target, verify, prefetch, lazy, record: the run's options.
        tree, policy: the fixed tree or the adaptive policy (both ``None``: the standard sampler).
        depth: the deepest round ``L`` (columns of the per-depth counters).
        shape, work, device: the per-sample state shape, working dtype and device.
        round_fn: the run's round, :func:`~specforest.engine.speculative_round` or
            :func:`~specforest.lockstep.lockstep_round`, chosen once.
        lockstep: the run is the standard sampler's: every trajectory at step ``rounds``.
        rows_all: ``(batch,)`` arange.
        no_fetch: ``(batch,)`` False.
        depth_cols: ``(max(T, 1),)`` arange.
        stoch_at: ``(T + 1,)`` bool, the step is stochastic (False at ``T``, finished).
        lookaheads: per depth ``L`` (up to ``depth``), ``(T + 1,)`` the lookahead a depth-``L``
            tree takes at each step: to the end of its stochastic run, at most ``L``; 0 on
            deterministic steps and at ``T``.
        fixed: the fixed tree's :class:`TreeSteps`, or ``None``.
        schedule_table: with a fixed tree, ``(2 (T + 1), 7)`` long: what a trajectory at step ``s``
            does in a round, at row ``s`` without a prefetched evaluation and ``T + 1 + s`` with
            one. Columns: unfinished, takes a single row, speculates, only fetches its root's
            evaluation, the rows its tree evaluates, its lookahead, the model calls its rows need
            (every stage where it speculates; its step's where it takes a single row).
        tree_rows: with a fixed tree, per lookahead ``Lr``: ``(batch n,)`` every trajectory ``n``
            times in a row, the trajectories of the target rows of a round where every trajectory
            evaluates the first ``n`` nodes (``None`` where no round does).
        lockstep_steps: the lockstep round's :class:`LockstepStep` per step (empty otherwise).
        features: deep-feature numbers the target keeps per row for the proposal
            (:meth:`~specforest.drafts.Proposal.bind`; ``0``: the verification call keeps none).
        noise: the standard sampler's noise given by the caller instead of the streams:
            ``noise(n)`` is step ``n``'s ``(batch, D)`` standard normal draws (``n = -1``: the
            chain's start), called once per step in order (a parity test's noise sampler).
    """

    tab: StepTables
    tab64: StepTables
    T: int
    coupling: Coupling
    proposal: Proposal
    target: Target
    verify: str
    prefetch: str
    lazy: bool
    record: bool
    tree: Optional[DraftTree]
    policy: Optional[TreePolicy]
    depth: int
    shape: tuple
    work: torch.dtype
    device: torch.device
    round_fn: Callable[[RunContext, RunState], Optional[RunState]]
    lockstep: bool
    rows_all: torch.Tensor
    no_fetch: torch.Tensor
    depth_cols: torch.Tensor
    stoch_at: torch.Tensor
    lookaheads: tuple
    fixed: Optional[TreeSteps] = None
    schedule_table: Optional[torch.Tensor] = None
    tree_rows: tuple = ()
    lockstep_steps: tuple = ()
    features: int = 0
    noise: Optional[Callable[[int], torch.Tensor]] = None

    def raise_bad_draft(self, step: int) -> None:
        """Stop the run: the draft's mean was NaN or inf at ``step``."""
        raise FloatingPointError(
            f"draft {self.proposal.name!r} gave a NaN or inf mean at step {step}; refusing to continue"
        )

    def stop_if_not_finite(self, target_bad: bool, draft_step: int) -> None:
        """Stop the run if the model's output or the draft's mean went NaN or inf, as the round's host
        read found them: ``target_bad``, the target's flag, and ``draft_step``, the first step of a
        non-finite draft mean (``-1`` for none).

        A NaN output of the model makes the mismatch at its node non-finite too, at the node's own
        step, so it also looks like a bad draft there; a draft's NaN mean makes the model's output
        at the drafted state NaN one step later. So the model is blamed (its name, step and rows)
        unless the draft went bad at an earlier step than the model's output first did.
        """
        if target_bad and (draft_step < 0 or self.target.first_bad()[0] <= draft_step):
            self.target.raise_not_finite()
        if draft_step >= 0:
            self.raise_bad_draft(draft_step)

    def tables(self, tree: DraftTree) -> TreeTables:
        """The device tables of ``tree`` (made once per tree and kept on it)."""
        return TreeTables.of(tree, self.verify, self.device)


# -- the state between rounds ------------------------------------------------------------------


@dataclass(frozen=True)
class NoiseBlock:
    """The lockstep round's noise of steps ``first .. first + n - 1``: ``noise (n, batch, D)``."""

    first: int
    noise: torch.Tensor


@dataclass(frozen=True)
class RunState:
    """The state of a run between rounds.

    Per trajectory (one row each, reset by :meth:`restart`): ``x``, ``step``, ``keys``, ``pre``,
    ``memory`` and ``counters``. The rest belongs to the run.

    Attributes:
        x: ``(batch, D)`` current states (working dtype).
        step: ``(batch,)`` long step of each state (``T`` when finished).
        keys: ``(batch, T)`` int64 key of each trajectory at each step (:func:`step_keys`).
        pre: the prefetched evaluations.
        counters: per-trajectory statistics.
        memory: the proposal's per-trajectory memory of earlier rounds
            (:meth:`~specforest.drafts.Proposal.init_memory`; ``None``: it keeps none). The engine
            carries it (``take``, ``put``, ``restart``) without reading it.
        draft_state: the proposal's learnt state.
        draft_bad: ``()`` long, the first step at which the draft's mean came out NaN or inf
            (``-1``: none so far); set on the device by the rounds, read with the round's one
            synchronization (:func:`~specforest.engine.schedule`).
        records: ``(n, 4)`` float64 tensors ``(depth, step, delta, accepted)`` of
            every verification so far (kept when recording or planning adaptively).
        rounds: rounds run (the batch's NFE, with ``sweep_calls`` and ``stage_calls``).
        draft_calls: calls of a non-frozen draft.
        sweep_calls: batched target calls of Picard sweeps, made before the rounds' verification calls.
        stage_calls: the further batched calls of a chain of several stages (each round's and sweep's
            calls beyond its first; :mod:`specforest.stages`).
        noise: the lockstep round's :class:`NoiseBlock`, or ``None``.
        seconds: host seconds spent in each of the :data:`PHASES` so far.
        carried: the past clean-image predictions each state's mean reads, as many as the chain's
            :attr:`~specforest.sde.StepTables.history` (:class:`~specforest.carried.Carried`,
            ``(batch, h, D)``; nothing for a one-step chain). Zero at step 0, where the chain reads none.
    """

    x: torch.Tensor
    step: torch.Tensor
    keys: torch.Tensor
    pre: Prefetch
    counters: Counters
    draft_state: Any
    draft_bad: torch.Tensor
    records: tuple = ()
    rounds: int = 0
    draft_calls: int = 0
    sweep_calls: int = 0
    stage_calls: int = 0
    noise: Optional[NoiseBlock] = None
    seconds: tuple = (0.0,) * len(PHASES)
    carried: Carried = NOTHING
    memory: Optional[DraftMemory] = None

    @property
    def phase_seconds(self) -> dict:
        """``seconds`` by phase name."""
        return dict(zip(PHASES, self.seconds, strict=True))

    def restart(self, rows: torch.Tensor, x: torch.Tensor, keys: torch.Tensor) -> RunState:
        """The state with trajectories ``rows (n,)`` started afresh from states ``x (n, D)`` with
        sample keys ``keys (n,)``: every per-trajectory field of those rows as :func:`init_state`
        makes it (step 0, no prefetched evaluation, no memory, zero counters); the other rows and the run's
        own fields (the proposal's state, the records, the rounds, the timings) unchanged.

        For a speculative run (:func:`specforest.generate` refills finished slots); a lockstep
        run's trajectories all finish at round ``T`` and start again as a new run. The noise
        block of a lockstep run is dropped (it holds the old keys' numbers).
        """
        return RunState(
            x=self.x.index_copy(0, rows, x),
            step=self.step.index_fill(0, rows, 0),
            keys=self.keys.index_copy(0, rows, step_keys(keys, self.keys.shape[1])),
            pre=self.pre.restart(rows),
            counters=self.counters.restart(rows),
            draft_state=self.draft_state,
            records=self.records,
            rounds=self.rounds,
            draft_calls=self.draft_calls,
            sweep_calls=self.sweep_calls,
            stage_calls=self.stage_calls,
            noise=None,
            seconds=self.seconds,
            draft_bad=self.draft_bad,
            carried=self.carried.restart(rows),
            memory=None if self.memory is None else self.memory.restart(rows),
        )


# -- what a round hands on -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Group:
    """Trajectories that speculate on one tree this round.

    Attributes:
        ids: ``(G,)`` the trajectories.
        steps: the tree's :class:`TreeSteps`.
        Ls: ``(G,)`` their lookaheads.
        Lr: the deepest one.
        rows: the rows their trees evaluate.
        everyone: every trajectory of the run speculates, in order (``ids`` is
            :attr:`RunContext.rows_all`): no row is selected.
        even: ``everyone`` and every lookahead is ``Lr``.
    """

    ids: torch.Tensor
    steps: TreeSteps
    Ls: torch.Tensor
    Lr: int
    rows: int
    everyone: bool = False
    even: bool = False


@dataclass(frozen=True, slots=True)
class Schedule:
    """Who does what this round.

    Attributes:
        single: ``(n1,)`` trajectories with one row: a deterministic step or the first root fetch.
        fetch: ``(n1,)`` bool, which of them only fetch their root's evaluation.
        groups: the speculating trajectories, one :class:`Group` per tree.
        n_fetch: how many fetch.
        calls: the sequential model calls of the round's batched evaluation: the chain's stages, or
            fewer where every row is a single row at a step of fewer (Heun's last step, into 0, makes one).
        needs: ``(batch,)`` long, the calls each trajectory's rows need this round, 0 where it has finished
            (a column of :attr:`RunContext.schedule_table`): the chain's stages where it speculates, its
            step's where it takes a single row.
    """

    single: torch.Tensor
    fetch: torch.Tensor
    groups: tuple
    calls: int
    needs: torch.Tensor
    n_fetch: int = 0


@dataclass(frozen=True, slots=True)
class Draft:
    """One group's drafted trees (trajectory-major: row ``b`` is trajectory ``ids[b]``).

    Attributes:
        steps: the tree's :class:`TreeSteps` (its tables: :attr:`tt`).
        ids, s0, Ls: ``(G,)`` trajectories, root steps and lookaheads.
        Lr: the deepest lookahead of the group.
        everyone: as in :class:`Group`.
        keys: ``(G, V_r)`` int64 node keys.
        pre: the group's prefetched evaluations.
        memory: the group's rows of the proposal's memory (:attr:`RunState.memory`) the round
            drafts with, or ``None``.
        Y: ``(G, V_r, D)`` node states (full mode; ``None`` lazy).
        Z: ``(G, V_r - 1, D)`` standard noise of the drafted nodes (full mode).
        Mp: ``(G, V_i, D)`` draft means at the nodes of depth ``< Lr`` (full mode).
        emask: ``(2, n)`` long ``(row, node)`` pairs the target evaluates (full mode), or ``None``
            when every row evaluates nodes ``0 .. n_first - 1``.
        n_first: see ``emask``.
        U: ``(G, V_i, C)`` the coupling's declared uniforms at the nodes of depth ``< Lr``,
            drawn with ``Z`` (:func:`~specforest.drafting.tree_draws`; full mode), or ``None``.
        terms: the proposal's :meth:`~specforest.drafts.Proposal.round_terms` at the
            ``(G, Lr)`` parent steps (full mode), or ``None``.
        draft_calls: calls of a draft model made drafting it.
        sweeps: Picard sweeps made drafting it (:class:`~specforest.drafts.PicardDraft`):
            sequential target calls before the verification's, each of ``Lr`` rows a trajectory.
        carried: the roots' carried predictions (:attr:`RunState.carried`).
        predicted: ``(G, D)`` the prediction the round drafts its states' hand-ons with
            (:func:`~specforest.drafting.root_prediction`), the draft means' multistep term below the
            root's children; ``None`` for a chain that carries nothing.
    """

    steps: TreeSteps
    ids: torch.Tensor
    s0: torch.Tensor
    Ls: torch.Tensor
    Lr: int
    everyone: bool
    keys: torch.Tensor
    pre: Prefetch
    Y: Optional[torch.Tensor] = None
    Z: Optional[torch.Tensor] = None
    Mp: Optional[torch.Tensor] = None
    emask: Optional[torch.Tensor] = None
    n_first: int = 0
    U: Optional[torch.Tensor] = None
    terms: Any = None
    draft_calls: int = 0
    carried: Carried = NOTHING
    predicted: Optional[torch.Tensor] = None
    sweeps: int = 0
    memory: Optional[DraftMemory] = None

    @property
    def tt(self) -> TreeTables:
        """The tree's tables."""
        return self.steps.tt


@dataclass(frozen=True, slots=True)
class Evaluations:
    """The round's target velocities: ``single (n1, D)`` and per draft ``(G, V_r, D)`` (``None`` lazy);
    ``feats``, per draft, the target's deep features of the same rows ``(G, V_r, F)`` where the
    run keeps them (:attr:`RunContext.features`), else ``None``."""

    single: torch.Tensor
    trees: list
    feats: Optional[list] = None


@dataclass(frozen=True, slots=True)
class Observed:
    """A group's verified parents, level-major, for a proposal that observes
    (:meth:`~specforest.drafts.Proposal.observe`).

    Attributes:
        y: ``(P, D)`` the parents.
        mu_q: ``(P, D)`` their exact target means.
        steps: ``(P,)`` their steps.
        rows: ``(P,)`` their rows in the group.
    """

    y: torch.Tensor
    mu_q: torch.Tensor
    steps: torch.Tensor
    rows: torch.Tensor


@dataclass(frozen=True, slots=True)
class WalkResult:
    """One group's outcome (rows as in its :class:`Draft`).

    Attributes:
        x: ``(G, D)`` new states.
        committed: ``(G,)`` steps committed.
        pre_y, pre_v, pre_step: ``(G, D)``, ``(G, D)``, ``(G,)`` the evaluation the next round
            drafts from (:data:`~specforest.engine.PREFETCH_POLICIES`).
        act: ``(G, Lw)`` bool, a verification problem met at each depth walked.
        acc: ``(G, Lw)`` bool, ... and a child accepted.
        delta: ``(G, Lw)`` float64 mismatch of the problem met (junk where not ``act``).
        observed: the verified parents, when the proposal observes.
        draft_calls: calls of a draft model the walk made (the lazy walk's).
        carried: the new states' carried predictions (:attr:`RunState.carried`).
    """

    x: torch.Tensor
    committed: torch.Tensor
    pre_y: torch.Tensor
    pre_v: torch.Tensor
    pre_step: torch.Tensor
    act: torch.Tensor
    acc: torch.Tensor
    delta: torch.Tensor
    observed: Optional[Observed] = None
    draft_calls: int = 0
    carried: Carried = NOTHING
