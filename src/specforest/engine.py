"""The round engine of Algorithm 1: an explicit run state and the phases of a round.

A run is a :class:`RunState` (states, steps, prefetched evaluations, counters,
the proposal's learnt state, recorded verifications) threaded through
:func:`run_round`, which applies the phases in order, each a function of what
it is given:

1. :func:`schedule` -- which trajectories take a single-row step (a
   deterministic Euler step, an exact standard-sampler step, or the fetch of
   the first root evaluation) and which speculate, on which tree;
2. :func:`draft` -- the speculating trajectories' trees (all children at once
   in full mode; only the roots in lazy mode), keeping the draft means;
3. :func:`evaluate` -- **one** batched target call for every row of the round;
4. :func:`~specforest.walk.walk` (:mod:`specforest.walk`) -- from each root
   down the tree with the coupling until the first rejection, the residual draw
   there, and the prefetch rule: one walk for both execution modes, which differ
   only in how a node is *realized* (:class:`~specforest.walk.FullTree` looks it
   up in what was drafted and evaluated; :class:`~specforest.walk.OnDemand`, the
   lazy cost simulation, drafts and evaluates the visited nodes as the walk
   reaches them);
5. :func:`commit` -- the new run state.

Randomness is addressed, not drawn in sequence (:mod:`specforest.streams`):
the noise of a drafted node is keyed by (sample, the round's root step, node
id) and the coupling's draws at a node by the same key at slots from
:data:`~specforest.streams.SLOT_COUPLE` on. So the full tree and the lazy walk read
the same numbers, and a sample is the same in any batch.

Host-device synchronizations of one round in full mode, at most **two**
(``tests/test_syncs.py`` counts them):

* :func:`schedule`: **one** :func:`host_read` of the round's sizes (how many
  trajectories take a single row, speculate, fetch; the deepest lookahead; the
  rows the trees evaluate) together with the target's finiteness flag of the
  earlier calls: tensor shapes depend on them. Index tensors are then made with
  ``nonzero_static`` and need no further read;
* :func:`~specforest.walk.walk`: the rejected trajectories (``nonzero``),
  whose residual draws have a data-dependent size. The walks themselves follow
  the decisions without reading them (:meth:`~specforest.walk.FullTree.descend`).

On the CPU, where a read costs no synchronization, the GRS residual also reads
which of its branches some draw needs and skips the others (same results).

The standard sampler has none: its trajectories run in lockstep for exactly
``T`` rounds. Options that read more: the ``rank`` coupling groups problems by
their number of children (one read), rejection-sampled residuals (``rank``,
``antithetic``) read once per pass, ``draft="auto"`` and ``record_deltas``
gather the verified problems, an adaptive tree plans on the host, and the lazy
cost simulation makes one call per depth.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from . import streams
from .couplings import Coupling
from .proposals import Prefetch, Proposal
from .sde import StepTables
from .target import Target
from .trees import DraftTree, TreePolicy, TreeTables
from .walk import FullTree, OnDemand, chain_draft, tree_draws, walk

__all__ = ["PHASES", "Counters", "RunContext", "RunState", "host_read", "init_state", "run_round"]

PREFETCH_POLICIES = ("nearest", "parent")
"""Which evaluation of a round the next round's draft reuses after a rejection.

``parent``: the node whose children were rejected (one step before the new
state). ``nearest``: among the evaluated nodes at the new state's own step that
were drafted from the same parent (its siblings), the one nearest (Euclidean)
to it; after a reflection that is the rejected child itself. Restricting to
siblings keeps the lazy cost simulation exact; on the paper's Gaussian mixture
((3,3) and (5,3) trees, 400 trajectories) the nearest evaluated node of the
whole layer was a sibling in every round (identical NFE with either rule).
Both fall back to the parent when no sibling was evaluated. After a fully
accepted round both use the committed node's own evaluation when it exists
(``verify="drafted"``), else its parent's.
"""

PHASES = ("schedule", "draft", "evaluate", "walk", "commit")
"""The phases of a round, as timed in ``SampleStats.phase_seconds`` (``evaluate`` excludes the
target call itself, which is ``target_seconds``). Host wall time: on CUDA, kernel launch time."""


# -- the run ---------------------------------------------------------------------------------


@dataclass
class RunContext:
    """What every round of a run reads and no round changes."""

    tab: StepTables  # the SDE's tables in the working dtype
    tab64: StepTables  # and in float64 (the coupling's scale)
    T: int
    coupling: Coupling
    proposal: Proposal
    target: Target
    verify: str
    prefetch: str
    lazy: bool
    tree: Optional[DraftTree]
    policy: Optional[TreePolicy]
    shape: tuple
    work: torch.dtype
    device: torch.device
    step_keys: torch.Tensor  # (B, T) int64: the key of each trajectory at each step
    record: bool
    phase_seconds: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    depth_cols: torch.Tensor = None  # (L,) arange, made once
    rows_all: torch.Tensor = None  # (B,) arange
    no_fetch: torch.Tensor = None  # (B,) False
    all_active: torch.Tensor = None  # (B,) True
    stoch_at: torch.Tensor = None  # (T + 1,) bool: the step is stochastic (False at T, finished)
    _lookahead: dict = field(default_factory=dict)  # L -> (T + 1,) lookahead by step
    _node_steps: dict = field(default_factory=dict)  # id(tree tables) -> NodeSteps
    _schedule: dict = field(default_factory=dict)  # id(tree tables) -> schedule table
    _each_row: dict = field(default_factory=dict)  # n -> (B n,) trajectory of each target row
    _lockstep: Optional[tuple] = None  # the standard sampler's per-step views (:meth:`lockstep_step`)

    def __post_init__(self) -> None:
        self.depth_cols = torch.arange(max(self.T, 1), device=self.device)
        self.rows_all = torch.arange(self.step_keys.shape[0], device=self.device)
        self.no_fetch = torch.zeros_like(self.rows_all, dtype=torch.bool)
        self.all_active = torch.ones_like(self.no_fetch)
        self.stoch_at = torch.cat([self.tab.stochastic, self.tab.stochastic.new_zeros(1)])

    def lockstep_step(self, s: int) -> tuple:
        """What the standard sampler reads at step ``s``, where every trajectory is: the noise
        level ``(B,)`` and the 0-d ``c``, ``a`` and ``scale`` of the transition, as views made in
        a few ops per run (the noise levels of every step, ``(T + 1, B)``, made once), so a step
        gathers nothing."""
        if self._lockstep is None:
            B = self.rows_all.shape[0]
            tab = self.tab
            self._lockstep = (
                tab.sig[:, None].expand(-1, B).contiguous().unbind(0),
                tab.c.unbind(0),
                tab.a.unbind(0),
                tab.scale.unbind(0),
            )
        sig, c, a, scale = self._lockstep
        return sig[s], c[s], a[s], scale[s]

    def tables(self, tree: DraftTree) -> TreeTables:
        return TreeTables.of(tree, self.verify, self.device)

    def each_row(self, n: int) -> torch.Tensor:
        """``(B n,)`` every trajectory ``n`` times in a row (the target rows of a round whose trees all
        evaluate their first ``n`` nodes), made once per ``n``."""
        hit = self._each_row.get(n)
        if hit is None:
            hit = self._each_row[n] = self.rows_all.repeat_interleave(n)
        return hit

    def node_steps(self, tt: TreeTables) -> "NodeSteps":
        """What a round reads per (root step, node) of tree ``tt``, tabulated once per run."""
        hit = self._node_steps.get(id(tt))
        if hit is None:
            s = torch.arange(self.T + 1, device=self.device)[:, None]
            last = max(self.T - 1, 0)
            step = (s + tt.depth).clamp(max=last)
            hit = self._node_steps[id(tt)] = NodeSteps(
                tt,
                step,
                self.tab.sig[step],
                self.tab.scale[(s + tt.step_of[1:]).clamp(max=last)][..., None],
                (s + torch.arange(max(tt.L, 1), device=self.device)).clamp(max=last),
            )
        return hit

    def schedule_table(self, tt: TreeTables) -> torch.Tensor:
        """``(2 (T + 1), 6)`` long: what a trajectory at step ``s`` does in a round of tree ``tt``,
        at row ``s`` without a prefetched evaluation and ``T + 1 + s`` with one (:func:`schedule`).

        Columns: unfinished, takes a single row, speculates, only fetches its root's evaluation,
        the rows its tree evaluates and its lookahead. A proposal that needs no prefetch speculates
        either way; one that needs it takes a single step to fetch one first.
        """
        hit = self._schedule.get(id(tt))
        if hit is not None and hit[0] is tt:
            return hit[1]
        active = torch.arange(self.T + 1, device=self.device) < self.T
        la = self.lookahead(tt.L)
        rows = []
        for valid in (False, True):
            Ls = la if valid or not self.proposal.needs_prefetch else torch.zeros_like(la)
            spec = Ls > 0
            fetch = (la > 0) & ~spec
            rows.append(torch.stack([active, active & ~spec, spec, fetch, tt.rows_spec[Ls], Ls], 1).long())
        table = torch.cat(rows)
        self._schedule[id(tt)] = (tt, table)  # (the tree's tables kept alive: its id stays its own)
        return table

    def lookahead(self, L: int) -> torch.Tensor:
        """``(T + 1,)`` the lookahead a depth-``L`` tree takes at each step: to the end of its
        stochastic run, at most ``L``; 0 on deterministic steps and at ``T``."""
        hit = self._lookahead.get(L)
        if hit is None:
            s = torch.arange(self.T + 1, device=self.device)
            hit = self._lookahead[L] = torch.where(self.stoch_at, torch.clamp(self.tab.run_end - s, max=L), 0)
        return hit


@dataclass(frozen=True)
class NodeSteps:
    """Per root step ``s`` (``T + 1`` rows) and node of one tree: what its rounds gather.

    Attributes:
        tt: the tree's tables (kept alive with the run's cache).
        step: ``(T + 1, V)`` long, the step of node ``u`` of a tree rooted at ``s``.
        sig: ``(T + 1, V)`` its noise level.
        draft_scale: ``(T + 1, V - 1, 1)`` the transition scale that drafts nodes ``1 .. V - 1``.
        level: ``(T + 1, L)`` long, the parents' step at each depth ``0 .. L - 1``.

    Steps past the end are clamped to ``T - 1`` (their rows are never used).
    """

    tt: TreeTables
    step: torch.Tensor
    sig: torch.Tensor
    draft_scale: torch.Tensor
    level: torch.Tensor


@dataclass(frozen=True)
class Counters:
    """Per-trajectory counters, accumulated in batches of rounds so that a round adds no ops.

    A round appends its outcome to ``pending`` (a Python tuple: no tensor op);
    every :data:`FLUSH_ROUNDS` rounds, and whenever they are read
    (:meth:`flushed`), the pending rounds are added in a few ops for all of
    them together.

    Attributes:
        nfe: ``(B,)`` target calls each trajectory took part in.
        per_traj: ``(B, 3)`` long: speculative rounds, steps they committed, evaluated rows.
        per_depth: ``(B, L, 3)`` float64: verifications met, accepted, summed ``delta`` at each depth.
        commits: ``(B, L + 1)`` long: rounds that committed ``j`` steps.
        pending: rounds not yet added, ``(active (B,), [(ids, committed, rows, act, acc, delta)])``
            per round: a speculating group's trajectories ``(Bs,)``, committed steps ``(Bs,)``, rows
            ``(Bs,)`` and per-depth outcomes ``(Bs, Lw)``; single-row trajectories as ``(ids, None, ...)``.
        lockstep: standard-sampler rounds not yet added (every trajectory evaluated one row): a
            Python int, so that such a round adds no tensor op.

    See :class:`specforest.sampler.SampleStats` for their meaning.
    """

    nfe: torch.Tensor
    per_traj: torch.Tensor
    per_depth: torch.Tensor
    commits: torch.Tensor
    pending: tuple = ()
    lockstep: int = 0

    @classmethod
    def zeros(cls, B: int, L: int, device: torch.device) -> "Counters":
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=device)  # noqa: E731
        return cls(z(B), z(B, 3), torch.zeros(B, L, 3, dtype=torch.float64, device=device), z(B, L + 1))

    def with_round(self, active: torch.Tensor, entries: list) -> "Counters":
        """These counters with one more round: ``active (B,)`` took part, ``entries`` as in ``pending``."""
        out = replace(self, pending=self.pending + ((active, entries),))
        return out.flushed() if len(out.pending) >= FLUSH_ROUNDS else out

    @staticmethod
    def _one_row(ids: torch.Tensor) -> torch.Tensor:
        return torch.tensor([[0, 0, 1]], dtype=torch.long, device=ids.device)

    def with_lockstep_round(self) -> "Counters":
        """These counters with one more standard-sampler round (every trajectory, one row)."""
        return Counters(self.nfe, self.per_traj, self.per_depth, self.commits, self.pending, self.lockstep + 1)

    def flushed(self) -> "Counters":
        """The counters with every pending round added."""
        if self.lockstep:
            n = self.lockstep
            one_row = self._one_row(self.nfe)
            out = Counters(self.nfe + n, self.per_traj + n * one_row, self.per_depth, self.commits, self.pending)
            return out.flushed()
        if not self.pending:
            return self
        actives = [a for a, _ in self.pending]
        entries = [e for _, es in self.pending for e in es]
        nfe = self.nfe + (torch.stack(actives).sum(0) if len(actives) > 1 else actives[0])
        per_traj, per_depth, commits = self.per_traj, self.per_depth, self.commits
        single = [e[0] for e in entries if e[3] is None]
        if single:
            # a single row is not a speculative round: it counts one evaluated row only
            ids = torch.cat(single) if len(single) > 1 else single[0]
            per_traj = per_traj.index_add(0, ids, self._one_row(ids).expand(ids.numel(), 3))
        spec = [e for e in entries if e[3] is not None]
        if spec:
            ids = torch.cat([e[0] for e in spec])
            committed = torch.cat([e[1] for e in spec])
            rows = torch.cat([e[2] for e in spec])
            per_traj = per_traj.index_add(0, ids, torch.stack([torch.ones_like(ids), committed, rows], 1))
            commits = commits.index_put((ids, committed), torch.ones_like(ids), accumulate=True)
            by_depth: dict = {}
            for e in spec:
                by_depth.setdefault(e[3].shape[1], []).append(e)
            for Lw, group in by_depth.items():
                act, acc, delta = (torch.cat([e[i] for e in group]) for i in (3, 4, 5))
                gid = torch.cat([e[0] for e in group])
                cols = torch.arange(Lw, device=gid.device)
                per_depth = per_depth.index_put(
                    (gid[:, None], cols[None]),
                    torch.stack([act.double(), acc.double(), torch.where(act, delta, 0.0)], -1),
                    accumulate=True,
                )
        return Counters(nfe, per_traj, per_depth, commits)


FLUSH_ROUNDS = 16
"""Rounds whose counters are added together (:meth:`Counters.with_round`): memory for ``16 (B, L)`` outcomes."""


@dataclass(frozen=True)
class RunState:
    """The state of a run between rounds.

    Attributes:
        x: ``(B, D)`` current states (working dtype).
        step: ``(B,)`` long step of each state (``T`` when finished).
        pre: the prefetched evaluations.
        counters: per-trajectory statistics.
        draft_state: the proposal's learnt state.
        records: ``(n, 4)`` float64 tensors ``(depth, step, delta, accepted)`` of
            every verification so far (kept when recording or planning adaptively).
        rounds: rounds run (the batch's NFE).
        draft_calls: calls of a non-frozen draft.
        exact_noise: the standard sampler's noise of a block of steps, ``(first step,
            (n, B, D))`` (:func:`_exact_noise`), or ``None``.
    """

    x: torch.Tensor
    step: torch.Tensor
    pre: Prefetch
    counters: Counters
    draft_state: Any
    records: tuple = ()
    rounds: int = 0
    draft_calls: int = 0
    exact_noise: Optional[tuple] = None


def init_state(ctx: RunContext, x: torch.Tensor, L: int) -> RunState:
    """The state before the first round: ``x (B, D)`` at step 0."""
    B, D = x.shape
    return RunState(
        x,
        torch.zeros(B, dtype=torch.long, device=ctx.device),
        Prefetch.empty(B, D, ctx.work, ctx.device),
        Counters.zeros(B, L, ctx.device),
        ctx.proposal.init_state(ctx.device),
    )


# -- phase 1: schedule -----------------------------------------------------------------------


def host_read(t: torch.Tensor) -> list:
    """The values of a small tensor on the host: the round's one planned synchronization."""
    return t.tolist()


@dataclass(frozen=True)
class Schedule:
    """Who does what this round.

    Attributes:
        single: ``(n1,)`` trajectories with one row: a deterministic step, an
            exact step (standard sampler) or the first root fetch.
        fetch: ``(n1,)`` bool, which of them only fetch their root's evaluation.
        groups: ``[(ids (Bs,), tree, Ls (Bs,), Lr, rows, even)]`` the speculating trajectories per
            tree, their lookaheads, the deepest one, the rows their trees evaluate and whether
            every lookahead is ``Lr``.
        active: ``(B,)`` unfinished trajectories, bool or 0/1 long (a column of
            :meth:`RunContext.schedule_table`).
    """

    single: torch.Tensor
    fetch: torch.Tensor
    groups: list
    active: torch.Tensor
    everyone: bool = False  # the standard sampler: single is every trajectory, in order, and no group
    n_fetch: int = 0


def schedule(ctx: RunContext, state: RunState) -> Optional[Schedule]:
    """Who does what this round (phase 1), or ``None`` when every trajectory has finished.

    The round's sizes (how many trajectories of each kind, the deepest
    lookahead, the rows to evaluate) and the target's finiteness flag of the
    previous round come to the host in **one** read; the index tensors are then
    made without further synchronization (``nonzero_static``).
    """
    T, step = ctx.T, state.step
    if ctx.tree is None and ctx.policy is None:
        # the standard sampler moves every trajectory one step a round: all run in lockstep
        # for exactly T rounds, so nothing needs to be read back
        if state.rounds >= T:
            return None
        return Schedule(ctx.rows_all, ctx.no_fetch, [], ctx.all_active, everyone=True)
    if ctx.policy is not None:
        active = step < T
        stoch = ctx.stoch_at[step]  # False once finished
        spec = stoch & state.pre.valid if ctx.proposal.needs_prefetch else stoch
        fetch = stoch & ~spec if ctx.proposal.needs_prefetch else ctx.no_fetch
        single = active & ~spec
        # an adaptive plan reads the records on the host anyway
        ctx.target.check_finite()
        if not bool(active.any()):
            return None
        ids1 = single.nonzero()[:, 0]
        ids = spec.nonzero()[:, 0]
        groups = _tree_groups(ctx, state, ids) if ids.numel() else []
        return Schedule(ids1, fetch[ids1], groups, active, n_fetch=int(fetch.sum()))
    tt = ctx.tables(ctx.tree)
    # each trajectory's row of the table: what it does at its step, with or without a prefetch
    table = ctx.schedule_table(tt)
    at = table[torch.add(step, state.pre.valid, alpha=T + 1) if ctx.proposal.needs_prefetch else step]
    active, single, spec, fetch, _, Ls = at.unbind(1)
    Lmin, Lmax = Ls.aminmax()
    counts = host_read(torch.cat([at.sum(0), torch.stack([Lmax, Lmin, ctx.target.bad])]))
    n_active, n1, ns, nf, rows, _, Lr, Lmin, bad = counts
    if bad:
        ctx.target.raise_not_finite()
    if n_active == 0:
        return None
    # (nonzero_static is slow for an empty result: skip it)
    ids1 = torch.nonzero_static(single, size=n1)[:, 0] if n1 else ctx.rows_all[:0]
    if ns == len(ctx.rows_all):
        # every trajectory speculates (one image, or a batch in step): no row selection at all
        group = (ctx.rows_all, ctx.tree, Ls, Lr, rows, Lmin == Lr)
        return Schedule(ids1, ctx.no_fetch[:0], [group], active, n_fetch=nf)
    ids = torch.nonzero_static(spec, size=ns)[:, 0]
    groups = [(ids, ctx.tree, Ls[ids], Lr, rows, False)] if ns else []
    return Schedule(ids1, fetch[ids1] > 0, groups, active, n_fetch=nf)


def _tree_groups(ctx: RunContext, state: RunState, ids: torch.Tensor) -> list:
    """``[(ids, tree, Ls, Lr, rows, False)]`` of an adaptive plan, re-made from the records and, near
    the end of the chain, re-optimized for each remaining horizon shorter than it."""
    data = torch.cat(state.records) if state.records else None
    base = ctx.policy.plan(data, ctx.coupling, ctx.T)
    if data is None:
        trees = [(ids, base)]
    else:
        s = state.step[ids]
        horizon = ctx.tab.run_end[s] - s
        trees = []
        short = horizon < base.L
        if bool((~short).any()):
            trees.append((ids[~short], base))
        for h in torch.unique(horizon[short]).tolist():
            trees.append((ids[short & (horizon == h)], ctx.policy.plan(data, ctx.coupling, int(h))))
    groups = []
    for g, tree in trees:
        tt = ctx.tables(tree)
        Ls = ctx.lookahead(tt.L)[state.step[g]]
        groups.append((g, tree, Ls, int(Ls.max()), int(tt.rows_at[Ls].sum()), False))
    return groups


# -- phase 2: draft --------------------------------------------------------------------------


@dataclass(frozen=True)
class Draft:
    """One group's drafted trees (trajectory-major: row ``b`` is trajectory ``ids[b]``).

    Attributes:
        tt: the tree's tables.
        ids, s0, Ls: ``(Bs,)`` trajectories, root steps and lookaheads.
        Lr: the deepest lookahead of the group.
        keys: ``(Bs, V_r)`` int64 node keys.
        pre: the group's prefetched evaluations.
        Y: ``(Bs, V_r, D)`` node states (full mode; ``None`` lazy).
        Z: ``(Bs, V_r - 1, D)`` standard noise of the drafted nodes (full mode).
        Mp: ``(Bs, V_i, D)`` draft means at the nodes of depth ``< Lr`` (full mode).
        emask: ``(2, n)`` long ``(row, node)`` pairs the target evaluates (full mode), or ``None``
            when every row evaluates nodes ``0 .. n_first - 1``.
        n_first: see ``emask``.
        U: ``(Bs, V_i, C)`` the coupling's declared uniforms at the nodes of depth ``< Lr``,
            drawn with ``Z`` (:func:`~specforest.walk.tree_draws`; full mode), or ``None``.
        terms: the proposal's :meth:`~specforest.proposals.Proposal.round_terms` at the
            ``(Bs, Lr)`` parent steps (full mode), or ``None``.
    """

    tt: TreeTables
    ids: torch.Tensor
    s0: torch.Tensor
    Ls: torch.Tensor
    Lr: int
    keys: torch.Tensor
    pre: Prefetch
    Y: Optional[torch.Tensor] = None
    Z: Optional[torch.Tensor] = None
    Mp: Optional[torch.Tensor] = None
    emask: Optional[torch.Tensor] = None
    n_first: int = 0
    U: Optional[torch.Tensor] = None
    terms: Any = None


def draft(
    ctx: RunContext,
    state: RunState,
    ids: torch.Tensor,
    tree: DraftTree,
    Ls: torch.Tensor,
    Lr: int,
    rows: int,
    even: bool = False,
) -> tuple[Draft, int]:
    """Draft the trees of trajectories ``ids`` with lookaheads ``Ls`` (phase 2); ``even``: every
    lookahead is ``Lr``.

    Returns the draft and the draft-model calls made.
    """
    tt = ctx.tables(tree)
    tab = ctx.tab
    everyone = ids is ctx.rows_all
    if everyone:
        s0, pre, x0 = state.step, state.pre, state.x
        keys = ctx.step_keys.gather(1, s0[:, None])
    else:
        s0, pre, x0 = state.step[ids], state.pre.take(ids, history=ctx.proposal.uses_history), state.x[ids]
        keys = ctx.step_keys[ids, s0][:, None]
    Vr = tt.size_at(Lr)
    # a node's key is the step key XOR the node's mixed id: every draw at the node then mixes
    # that key with its own mixed counter (streams.uniform), so no second mixing pass is needed
    keys = keys ^ tt.code[None, :Vr]
    if ctx.lazy:
        return Draft(tt, ids, s0, Ls, Lr, keys, pre), 0
    Bs, D = ids.numel(), state.x.shape[1]
    Vi = tt.size_at(Lr - 1)
    # (Bs, Vr - 1, D): noise of nodes 1..Vr-1, drawn with the coupling's uniforms at nodes 0..Vi-1
    Z, U = tree_draws(ctx, keys, Vi, tt.children.shape[1], D)
    # every drafted node's noise times its transition scale, in one op (the lazy walk does the same per node)
    ns = ctx.node_steps(tt)
    SZ = ns.draft_scale[s0, : Vr - 1] * Z
    Y = torch.empty(Bs, Vr, D, dtype=ctx.work, device=ctx.device)
    Y[:, 0] = x0
    Mp = torch.empty(Bs, Vi, D, dtype=ctx.work, device=ctx.device)
    steps = ns.level[s0, :Lr]  # (Bs, Lr) parents' steps
    prop = ctx.proposal
    calls = 0
    terms = None
    if prop.affine:
        terms = prop.round_terms(tab, steps, pre)
        if terms is None:
            A, C = prop.coefficients(tab, steps, pre, state.draft_state)
        else:
            A, C = prop.coefficients(tab, steps, pre, state.draft_state, terms)
    if chain_draft(prop, tt, Lr):
        # one op a depth, and the draft means after it in one op
        # (split_with_sizes: Tensor.split's Python wrapper costs 3x the op)
        ones = (1,) * Lr
        Yl, Wl, Al = (
            Y.split_with_sizes(ones + (1,), 1),
            torch.add(C, SZ).split_with_sizes(ones, 1),
            A.split_with_sizes(ones, 1),
        )
        for level in range(Lr):
            torch.addcmul(Wl[level], Al[level], Yl[level], out=Yl[level + 1])
        torch.addcmul(C, A, Y[:, :Lr], out=Mp)
    else:
        sizes = tt.sizes(Lr)
        # per-layer views, made in one call each
        Yl, SZl, Mpl = (
            Y.split_with_sizes(sizes, 1),
            SZ.split_with_sizes(sizes[1:], 1),
            Mp.split_with_sizes(sizes[:-1], 1),
        )
        if prop.affine:
            Al, Cl = A.split_with_sizes((1,) * Lr, 1), C.split_with_sizes((1,) * Lr, 1)
        else:
            cond = ctx.target.cond_rows(ids)
        for level in range(1, Lr + 1):
            p0, p1, k = tt.layers[level - 1]
            c0, c1, _ = tt.layers[level]
            if prop.affine:
                m = torch.addcmul(Cl[level - 1], Al[level - 1], Yl[level - 1], out=Mpl[level - 1])
            else:
                m = Mpl[level - 1]
                m.copy_(
                    prop.mean(
                        tab,
                        Yl[level - 1],
                        steps[:, level - 1 : level].expand(-1, p1 - p0),
                        pre,
                        cond,
                        ctx.shape,
                        state.draft_state,
                    )
                )
                calls += 1
            if k == 1:
                torch.add(m, SZl[level - 1], out=Yl[level])
            elif k:
                view = (Bs, p1 - p0, k, D)
                torch.add(m[:, :, None], SZl[level - 1].view(view), out=Yl[level].view(view))
            else:
                rep = torch.repeat_interleave(m, tt.tree.num_children[p0:p1].to(ctx.device), dim=1, output_size=c1 - c0)
                torch.add(rep, SZl[level - 1], out=Yl[level])
    if even and tt.eval_prefix[Lr] >= Vi:
        # every tree evaluates the same first nodes, the verified ones among them: a view of Y, no scatter
        return Draft(tt, ids, s0, Ls, Lr, keys, pre, Y, Z, Mp, None, tt.eval_prefix[Lr], U, terms), calls
    # the (trajectory, node) pairs the target evaluates, without a synchronization: their number is known
    emask = torch.nonzero_static(tt.eval_at[Ls][:, :Vr], size=rows).T
    return Draft(tt, ids, s0, Ls, Lr, keys, pre, Y, Z, Mp, emask, 0, U, terms), calls


# -- phase 3: evaluate -----------------------------------------------------------------------


@dataclass(frozen=True)
class Evaluations:
    """The round's target velocities: ``single (n1, D)`` and per draft ``(Bs, V_r, D)`` (``None`` lazy)."""

    single: torch.Tensor
    trees: list


def evaluate(ctx: RunContext, state: RunState, sched: Schedule, drafts: list) -> Evaluations:
    """One batched target call for every row of the round (phase 3)."""
    ids1 = sched.single
    if sched.everyone:
        # the standard sampler (nothing drafted): every trajectory at step ``rounds``, one row each
        return Evaluations(ctx.target(state.x, ctx.lockstep_step(state.rounds)[0], ids1), [])
    xs, sig, traj = [], [], []
    if ids1.numel():
        xs, sig, traj = [state.x[ids1]], [ctx.tab.sig[state.step[ids1]]], [ids1]
    sizes = []
    for d in drafts:
        if d.Y is None:
            continue
        if d.emask is None:
            n = d.n_first
            xs.append(d.Y[:, :n].reshape(-1, d.Y.shape[2]))
            sig.append(ctx.node_steps(d.tt).sig[d.s0, :n].reshape(-1))
            traj.append(ctx.each_row(n) if d.ids is ctx.rows_all else d.ids.repeat_interleave(n))
        else:
            b, u = d.emask
            xs.append(d.Y[b, u])
            sig.append(ctx.node_steps(d.tt).sig[d.s0[b], u])
            traj.append(d.ids[b])
        sizes.append(xs[-1].shape[0])
    if not xs:
        return Evaluations(state.x[:0], [None] * len(drafts))
    cat = (lambda t: torch.cat(t)) if len(xs) > 1 else (lambda t: t[0])  # noqa: E731
    v = ctx.target(cat(xs), cat(sig), cat(traj))
    n1 = ids1.numel()
    out, start, sizes = [], n1, iter(sizes)
    for d in drafts:
        if d.Y is None:
            out.append(None)
            continue
        n = next(sizes)
        if d.emask is None:
            # (Bs, n_first, D): the walk reads only evaluated nodes, all among the first
            V = v[start : start + n].view(d.Y.shape[0], d.n_first, -1)
        else:
            V = torch.zeros_like(d.Y).index_put(tuple(d.emask), v[start : start + n])
        start += n
        out.append(V)
    return Evaluations(v[:n1], out)


# -- phase 5: commit -------------------------------------------------------------------------

NOISE_BLOCK_ELEMENTS = 1 << 20
"""The standard sampler draws its noise for up to 16 steps at once, up to this many numbers."""


def _exact_noise(ctx: RunContext, state: RunState) -> tuple:
    """The standard sampler's ``(B, D)`` noise of this round's step, and the block it was read from.

    Every trajectory is at step ``state.rounds`` (they run in lockstep). The numbers are
    those of one draw per step (each is a function of its key, :mod:`~specforest.streams`),
    drawn for several steps in one pass of the mixer: a draw costs about 20 tensor ops
    whatever its size, half of the standard sampler's ops per step.
    """
    s, block = state.rounds, state.exact_noise
    if block is None or not block[0] <= s < block[0] + block[1].shape[0]:
        B, D = state.x.shape
        n = max(1, min(16, NOISE_BLOCK_ELEMENTS // (B * D)))
        block = (s, streams.normal(ctx.step_keys[:, s : s + n].T, D, ctx.work, streams.TAG_EXACT))
    return block[1][s - block[0]], block


def commit(
    ctx: RunContext, state: RunState, sched: Schedule, ev: Evaluations, drafts: list, walks: list, draft_calls: int
) -> RunState:
    """The run state after the round (phase 5)."""
    x, step, pre, c = state.x, state.step, state.pre, state.counters
    ids1 = sched.single
    if ctx.tree is None and ctx.policy is None:
        # the standard sampler: every trajectory takes its exact transition at step ``rounds``
        # (scale 0 on deterministic steps); nothing else happens in the round. The mean is
        # ``tab.mean``'s ``addcmul(c v, a, y)`` with the step's 0-d coefficients (the same numbers)
        _, cs, a, scale = ctx.lockstep_step(state.rounds)
        noise, block = _exact_noise(ctx, state)
        x = torch.addcmul(torch.addcmul(cs * ev.single, a, x), scale, noise)
        return RunState(
            x,
            step + 1,
            pre,
            c.with_lockstep_round(),
            state.draft_state,
            state.records,
            state.rounds + 1,
            state.draft_calls,
            block,
        )
    committed = torch.zeros_like(step)
    entries: list = []
    if ids1.numel():
        s1 = step[ids1]
        mean = ctx.tab.mean(x[ids1], ev.single, s1)
        move = ~sched.fetch
        x = x.index_put((ids1,), torch.where(move[:, None], mean, x[ids1]))
        committed = committed.index_put((ids1,), move.long())
        entries.append((ids1, None, None, None, None, None))
        if sched.n_fetch:
            f = torch.nonzero_static(sched.fetch, size=sched.n_fetch)[:, 0]
            pre = pre.with_rows(
                ids1[f], state.x[ids1[f]], ev.single[f], s1[f], keep_prev=False, history=ctx.proposal.uses_history
            )
    records = state.records
    dstate = state.draft_state
    hist = ctx.proposal.uses_history
    for w, d in zip(walks, drafts, strict=True):
        ids = d.ids
        if ids is ctx.rows_all:
            x, committed = w.x, w.committed
            pre = pre.replaced(w.pre_y, w.pre_v, w.pre_step, history=hist)
        else:
            x = x.index_put((ids,), w.x)
            committed = committed.index_put((ids,), w.committed)
            pre = pre.with_rows(ids, w.pre_y, w.pre_v, w.pre_step, keep_prev=True, history=hist)
        Lw = w.act.shape[1]
        cols = ctx.depth_cols[:Lw]
        entries.append((ids, w.committed, d.tt.rows_at[d.Ls], w.act, w.acc, w.delta))
        if ctx.record or ctx.policy is not None:
            lv = (cols + 1).double()[None].expand(ids.numel(), Lw)
            st = (d.s0[:, None] + cols[None]).double()
            rec = torch.stack([lv, st, w.delta, w.acc.double()], -1)[w.act]
            records = records + (rec.cpu(),)
        if w.observed is not None:
            y, mu_q, steps_o, rws = w.observed
            args = (dstate, ctx.tab, y, mu_q, steps_o, state.pre.take(ids[rws]), ctx.tab64.scale[steps_o])
            if d.terms is None:
                dstate = ctx.proposal.observe(*args)
            else:
                dstate = ctx.proposal.observe(*args, ctx.proposal.take_terms(d.terms, rws, steps_o - d.s0[rws]))
    counters = c.with_round(sched.active, entries)
    return RunState(
        x,
        step + committed,
        pre,
        counters,
        dstate,
        records,
        state.rounds + 1,
        state.draft_calls + draft_calls + sum(w.draft_calls for w in walks),
    )


def run_round(ctx: RunContext, state: RunState) -> Optional[RunState]:
    """One round: schedule, draft, evaluate (one target call), walk, commit; ``None`` once all have finished."""
    clock, ph = time.perf_counter, ctx.phase_seconds
    t0 = clock()
    sched = schedule(ctx, state)
    if sched is None:
        return None
    t1 = clock()
    drafts, calls = [], 0
    for group in sched.groups:
        d, n = draft(ctx, state, *group)
        drafts.append(d)
        calls += n
    t2 = clock()
    inside = ctx.target.seconds
    ev = evaluate(ctx, state, sched, drafts)
    t3 = clock()
    inside = ctx.target.seconds - inside
    walks = [
        walk(ctx, d, OnDemand(ctx, d, state) if d.Y is None else FullTree(ctx, d, V))
        for d, V in zip(drafts, ev.trees, strict=True)
    ]
    t4 = clock()
    out = commit(ctx, state, sched, ev, drafts, walks, calls)
    # the round's trees are freed inside its time: unmapping large ones is part of a round's cost
    del drafts, walks, ev
    t5 = clock()
    # the lazy walk's own target calls are inside ``walk``; on CUDA ``inside`` is 0 here
    ph["schedule"] += t1 - t0
    ph["draft"] += t2 - t1
    ph["evaluate"] += t3 - t2 - inside
    ph["walk"] += t4 - t3
    ph["commit"] += t5 - t4
    return out
