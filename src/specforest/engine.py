"""The round engine of Algorithm 1: a run's context and state, and the phases of a round.

A run is a :class:`~specforest.records.RunState` (states, steps, keys,
prefetched evaluations, counters, the proposal's learnt state, recorded
verifications, timings) threaded through :func:`run_round`, which applies the
run's round function, chosen once when the context is made
(:func:`make_context`):

* :func:`speculative_round`, for a draft tree or an adaptive policy, applies the
  phases in order, each a function of what it is given:

  1. :func:`schedule` -- which trajectories take a single-row step (a
     deterministic Euler step, or the fetch of the first root evaluation) and
     which speculate, on which tree;
  2. :func:`~specforest.drafting.draft` (:mod:`specforest.drafting`) -- the
     speculating trajectories' trees (all children at once in full mode; only
     the roots in lazy mode), keeping the draft means;
  3. :func:`evaluate` -- **one** batched target call for every row of the round (``s`` sequential
     ones for a chain of ``s`` stages, :mod:`specforest.stages`);
  4. :func:`~specforest.walk.walk` (:mod:`specforest.walk`) -- from each root
     down the tree with the coupling until the first rejection, the residual
     draw there, and the prefetch rule: one walk for both execution modes, which
     differ only in how a node is *realized* (:class:`~specforest.walk.FullTree`
     looks it up in what was drafted and evaluated;
     :class:`~specforest.walk.OnDemand`, the lazy cost simulation, drafts and
     evaluates the visited nodes as the walk reaches them);
  5. :func:`commit` -- the new run state.

* :func:`~specforest.lockstep.lockstep_round`, the standard sampler's
  (``tree=None``): every trajectory at step ``rounds`` takes its exact
  transition (:mod:`specforest.lockstep` states the rule).

Randomness is addressed, not drawn in sequence (:mod:`specforest.streams`):
the noise of a drafted node is keyed by (sample, the round's root step, node
id) and the coupling's draws at a node by the same key at slots from
:data:`~specforest.streams.SLOT_COUPLE` on. So the full tree and the lazy walk read
the same numbers, and a sample is the same in any batch.

Host-device synchronizations of one speculative round in full mode, at most
**two** (``tests/test_syncs.py`` counts them):

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

The lockstep round has none: its trajectories run for exactly ``T`` rounds.
Options that read more: the ``rank`` coupling groups problems by their number
of children (one read), rejection-sampled residuals (``rank``, ``antithetic``)
read once per pass, ``draft="auto"`` and ``record_deltas`` gather the verified
problems, an adaptive tree plans on the host, and the lazy cost simulation
makes one call per depth.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Optional

import torch

from . import lockstep, streams
from .carried import Carried
from .couplings import Coupling
from .drafting import draft, is_chain, remembers_chain, runs_full
from .drafts import DraftMemory, EvaluatedChain, Prefetch, Proposal
from .records import (
    PHASES,
    Counters,
    Draft,
    Evaluations,
    Group,
    Outcome,
    RoundEntry,
    RunContext,
    RunState,
    Schedule,
    TreeSteps,
    WalkResult,
    step_keys,
)
from .sde import StepTables
from .target import Target
from .trees import DraftTree, TreePolicy, TreeTables
from .walk import FullTree, OnDemand, walk

__all__ = [
    "PHASES",
    "PREFETCH_POLICIES",
    "Counters",
    "RunContext",
    "RunState",
    "host_read",
    "init_state",
    "make_context",
    "run_round",
    "speculative_round",
]

PREFETCH_POLICIES = ("nearest", "parent")
"""Which evaluation of a round the next round's draft reuses after a rejection.

``parent``: the node whose children were rejected (one step before the new
state). ``nearest``: among the evaluated nodes at the new state's own step that
were drafted from the same parent (its siblings), the one nearest (Euclidean)
to it; after a reflection that is the rejected child itself. Restricting to
siblings keeps the lazy cost simulation exact (how often the nearest evaluated
node of the whole layer is a sibling is in ``docs/engine.md``). Both fall back
to the parent when no sibling was evaluated. After a fully accepted round both
use the committed node's own evaluation when it exists (``verify="drafted"``),
else its parent's.
"""


# -- the run ---------------------------------------------------------------------------------


def make_context(
    *,
    tab: StepTables,
    tab64: StepTables,
    T: int,
    coupling: Coupling,
    proposal: Proposal,
    target: Target,
    verify: str,
    prefetch: str,
    lazy: bool,
    record: bool,
    tree: Optional[DraftTree],
    policy: Optional[TreePolicy],
    depth: int,
    shape: tuple,
    work: torch.dtype,
    device: torch.device,
    batch: int,
    features: int = 0,
    noise: Optional[Callable[[int], torch.Tensor]] = None,
) -> RunContext:
    """The context of a run of ``batch`` trajectories, with its per-run tables and its round function.

    ``tree`` and ``policy`` both ``None`` make the standard sampler's lockstep run
    (:func:`~specforest.lockstep.lockstep_round`); otherwise rounds are
    :func:`speculative_round`. ``depth`` is the deepest round (``0`` for the standard sampler).
    ``features``: deep-feature numbers a row's evaluation keeps for the proposal (its
    :meth:`~specforest.drafts.Proposal.bind`), used only where it remembers chains.
    """
    # a proposal that remembers the previous round's chain needs all its nodes evaluated
    lazy = lazy and not runs_full(proposal, tree if policy is None else policy)
    rows_all = torch.arange(batch, device=device)
    stoch_at = torch.cat([tab.stochastic, tab.stochastic.new_zeros(1)])
    standard = tree is None and policy is None
    lookaheads: tuple = ()
    if not standard:
        # (depth + 1, T + 1): to the end of each step's stochastic run, at most L, 0 where deterministic
        s = torch.arange(T + 1, device=device)
        L = torch.arange(depth + 1, device=device)[:, None]
        lookaheads = torch.where(stoch_at, torch.minimum(tab.run_end - s, L), 0).unbind(0)
    ctx = RunContext(
        tab=tab,
        tab64=tab64,
        T=T,
        coupling=coupling,
        proposal=proposal,
        target=target,
        verify=verify,
        prefetch=prefetch,
        lazy=lazy,
        record=record,
        tree=tree,
        policy=policy,
        depth=depth,
        shape=shape,
        work=work,
        device=device,
        round_fn=lockstep.lockstep_round if standard else speculative_round,
        lockstep=standard,
        rows_all=rows_all,
        no_fetch=torch.zeros_like(rows_all, dtype=torch.bool),
        depth_cols=torch.arange(max(T, 1), device=device),
        stoch_at=stoch_at,
        lookaheads=lookaheads,
        lockstep_steps=lockstep.lockstep_steps(tab, batch) if standard else (),
        features=features if remembers_chain(proposal, tree if policy is None else policy) else 0,
        noise=noise,
    )
    if tree is None:
        return ctx
    tt = ctx.tables(tree)
    fixed = tree_steps(ctx, tt)
    table = _schedule_table(ctx, tt, fixed.lookahead)
    # every trajectory n times in a row, for the rounds whose trees all evaluate their first n nodes
    rows = [None] * (tt.L + 1)
    if not lazy:
        for Lr in range(1, tt.L + 1):
            n = tt.eval_prefix[Lr]
            if n >= tt.size_at(Lr - 1):
                rows[Lr] = rows_all.repeat_interleave(n)
    return replace(ctx, fixed=fixed, schedule_table=table, tree_rows=tuple(rows))


def tree_steps(ctx: RunContext, tt: TreeTables) -> TreeSteps:
    """What the rounds of tree ``tt`` gather per (root step, node), tabulated (the node tables are
    ``None`` in lazy mode, whose walk gathers per visited node)."""
    if tt.L >= len(ctx.lookaheads):
        raise ValueError(f"the tree policy planned a tree of depth {tt.L}, deeper than its max_depth ({ctx.depth})")
    lookahead = ctx.lookaheads[tt.L]
    if ctx.lazy:
        return TreeSteps(tt=tt, step=None, sig=None, draft_scale=None, level=None, lookahead=lookahead)
    s = torch.arange(ctx.T + 1, device=ctx.device)[:, None]
    last = max(ctx.T - 1, 0)
    step = (s + tt.depth).clamp(max=last)
    return TreeSteps(
        tt=tt,
        step=step,
        sig=ctx.tab.sig[step],
        draft_scale=ctx.tab.scale[(s + tt.step_of[1:]).clamp(max=last)][..., None],
        level=(s + torch.arange(max(tt.L, 1), device=ctx.device)).clamp(max=last),
        lookahead=lookahead,
    )


def _schedule_table(ctx: RunContext, tt: TreeTables, la: torch.Tensor) -> torch.Tensor:
    """:attr:`RunContext.schedule_table` of tree ``tt`` with lookaheads ``la (T + 1,)``. A proposal
    that needs no prefetch speculates either way; one that needs it takes a single step to fetch one first."""
    active = torch.arange(ctx.T + 1, device=ctx.device) < ctx.T
    rows = []
    for valid in (False, True):
        Ls = la if valid or not ctx.proposal.needs_prefetch else torch.zeros_like(la)
        spec = Ls > 0
        fetch = (la > 0) & ~spec
        # a single row's step's calls (a chain of several stages: its last step into 0 makes one)
        calls = torch.where(spec, ctx.tab.stages, ctx.tab.calls)
        rows.append(torch.stack([active, active & ~spec, spec, fetch, tt.rows_spec[Ls], Ls, calls], 1).long())
    return torch.cat(rows)


def chain_start(ctx: RunContext, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The chain's first states from the caller's ``x (n, D)``: ``init_a x + init_scale z`` (EDM's
    churned ``x-hat_0``), ``z`` keyed by each sample's key ``keys (n,)`` (or the run's ``noise(-1)``);
    ``x`` itself for every chain that starts where it is given."""
    if ctx.tab.init_scale == 0.0 and ctx.tab.init_a == 1.0:
        return x
    n, D = x.shape
    z = ctx.noise(-1) if ctx.noise is not None else streams.normal(keys, D, ctx.work, streams.TAG_START)
    return torch.add(x * ctx.tab.init_a, z.reshape(n, D).to(ctx.work), alpha=ctx.tab.init_scale)


def init_state(ctx: RunContext, x: torch.Tensor, keys: torch.Tensor) -> RunState:
    """The state before the first round: ``x (batch, D)`` at step 0, sample keys ``keys (batch,)``."""
    batch, D = x.shape
    x = chain_start(ctx, x, keys)
    W = remembered_states(ctx)
    memory = None
    if W:
        memory = ctx.proposal.init_memory(
            batch, D, width=W, steps=ctx.T, features=ctx.features, dtype=ctx.work, device=ctx.device
        )
    return RunState(
        x=x,
        step=torch.zeros(batch, dtype=torch.long, device=ctx.device),
        keys=step_keys(keys, ctx.T),
        pre=Prefetch.empty(batch, D, ctx.work, ctx.device),
        memory=memory,
        counters=Counters.zeros(batch, ctx.depth, ctx.device),
        draft_state=ctx.proposal.init_state(ctx.device),
        draft_bad=torch.full((), -1, dtype=torch.long, device=ctx.device),
        carried=Carried.start(ctx.tab.history, x),
    )


def remembered_states(ctx: RunContext) -> int:
    """Chain nodes per trajectory a run's proposal may remember of its last chain round, the
    ``width`` of :meth:`~specforest.drafts.Proposal.init_memory`: ``0`` (the run keeps no memory)
    unless it remembers one (:func:`~specforest.drafting.remembers_chain`); a chain never runs past
    the grid."""
    if not remembers_chain(ctx.proposal, ctx.tree if ctx.policy is None else ctx.policy):
        return 0
    return min(ctx.depth, ctx.T)


def run_round(ctx: RunContext, state: RunState) -> Optional[RunState]:
    """One round of the run (its :attr:`~specforest.records.RunContext.round_fn`); ``None`` once all have finished."""
    return ctx.round_fn(ctx, state)


# -- phase 1: schedule -----------------------------------------------------------------------


def host_read(t: torch.Tensor) -> list:
    """The values of a small tensor on the host: the round's one planned synchronization."""
    return t.tolist()


def schedule(ctx: RunContext, state: RunState) -> Optional[Schedule]:
    """Who does what this round (phase 1), or ``None`` when every trajectory has finished.

    The round's sizes (how many trajectories of each kind, the deepest
    lookahead, the rows to evaluate) and the target's finiteness flag of the
    previous round come to the host in **one** read; the index tensors are then
    made without further synchronization (``nonzero_static``).
    """
    T, step = ctx.T, state.step
    if ctx.policy is not None:
        active = step < T
        stoch = ctx.stoch_at[step]  # False once finished
        spec = stoch & state.pre.valid if ctx.proposal.needs_prefetch else stoch
        fetch = stoch & ~spec if ctx.proposal.needs_prefetch else ctx.no_fetch
        single = active & ~spec
        # an adaptive plan reads the records on the host anyway
        bad, bad_draft = bool(ctx.target.bad), int(state.draft_bad)
        if bad or bad_draft >= 0:
            ctx.stop_if_not_finite(bad, bad_draft)
        ctx.target.read_clear()
        if not bool(active.any()):
            return None
        ids1 = single.nonzero()[:, 0]
        ids = spec.nonzero()[:, 0]
        groups = _tree_groups(ctx, state, ids) if ids.numel() else ()
        needs = torch.where(spec, ctx.tab.stages, ctx.tab.calls[step]) * active
        return Schedule(
            single=ids1, fetch=fetch[ids1], groups=groups, n_fetch=int(fetch.sum()), calls=int(needs.max()), needs=needs
        )
    # each trajectory's row of the table: what it does at its step, with or without a prefetch
    table = ctx.schedule_table
    at = table[torch.add(step, state.pre.valid, alpha=T + 1) if ctx.proposal.needs_prefetch else step]
    _, single, spec, fetch, _, Ls, needs = at.unbind(1)
    Lmin, Lmax = Ls.aminmax()
    # (the round's calls: every stage where a tree speculates, else what its single rows' steps make)
    reads = torch.stack([Lmax, Lmin, ctx.target.bad, state.draft_bad, needs.amax()])
    counts = host_read(torch.cat([at[:, :6].sum(0), reads]))
    n_active, n1, ns, nf, rows, _, Lr, Lmin, bad, bad_draft, calls = counts
    if bad or bad_draft >= 0:
        ctx.stop_if_not_finite(bool(bad), bad_draft)
    ctx.target.read_clear()
    if n_active == 0:
        return None
    # (nonzero_static is slow for an empty result: skip it)
    ids1 = torch.nonzero_static(single, size=n1)[:, 0] if n1 else ctx.rows_all[:0]
    if ns == len(ctx.rows_all):
        # every trajectory speculates (one image, or a batch in step): no row selection at all
        group = Group(ids=ctx.rows_all, steps=ctx.fixed, Ls=Ls, Lr=Lr, rows=rows, everyone=True, even=Lmin == Lr)
        return Schedule(single=ids1, fetch=ctx.no_fetch[:0], groups=(group,), n_fetch=nf, calls=calls, needs=needs)
    ids = torch.nonzero_static(spec, size=ns)[:, 0]
    groups = (Group(ids=ids, steps=ctx.fixed, Ls=Ls[ids], Lr=Lr, rows=rows),) if ns else ()
    return Schedule(single=ids1, fetch=fetch[ids1] > 0, groups=groups, n_fetch=nf, calls=calls, needs=needs)


def _tree_groups(ctx: RunContext, state: RunState, ids: torch.Tensor) -> tuple:
    """The groups of an adaptive plan, re-made from the records and, near the end of the chain,
    re-optimized for each remaining horizon shorter than it."""
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
        ts = tree_steps(ctx, ctx.tables(tree))
        Ls = ts.lookahead[state.step[g]]
        groups.append(Group(ids=g, steps=ts, Ls=Ls, Lr=int(Ls.max()), rows=int(ts.tt.rows_at[Ls].sum())))
    return tuple(groups)


# -- phase 3: evaluate -----------------------------------------------------------------------


def evaluate(ctx: RunContext, state: RunState, sched: Schedule, drafts: list) -> Evaluations:
    """One batched target call for every row of the round (phase 3): the single rows and, in full
    mode, the nodes each tree evaluates (``s`` sequential calls of them for a chain of ``s`` stages)."""
    ids1 = sched.single
    xs, sig, steps, traj = [], [], [], []
    if ids1.numel():
        s1 = state.step[ids1]
        xs, sig, steps, traj = [state.x[ids1]], [ctx.tab.sig[s1]], [s1], [ids1]
    key = None  # names the trajectories of the rows, when they are the same in every such round
    sizes = []
    for d in () if ctx.lazy else drafts:
        if d.emask is None:
            n = d.n_first
            xs.append(d.Y[:, :n].reshape(-1, d.Y.shape[2]))
            sig.append(d.steps.sig[d.s0, :n].reshape(-1))
            steps.append(d.steps.step[d.s0, :n].reshape(-1))
            traj.append(ctx.tree_rows[d.Lr])
            key = ("tree", d.Lr)
        else:
            b, u = d.emask
            xs.append(d.Y[b, u])
            sig.append(d.steps.sig[d.s0[b], u])
            steps.append(d.steps.step[d.s0[b], u])
            traj.append(d.ids[b])
        sizes.append(xs[-1].shape[0])
    if not xs:
        return Evaluations(single=state.x[:0], trees=[None] * len(drafts))
    cat = (lambda t: torch.cat(t)) if len(xs) > 1 else (lambda t: t[0])  # noqa: E731
    rows_key = key if len(xs) == 1 else None
    # (a run that keeps features remembers its chains, so it runs full)
    keep = ctx.features > 0 and bool(drafts)
    # (a chain of several stages makes that many sequential calls of these rows: ``tab.velocity``)
    rows = (ctx.target, cat(xs), cat(steps), cat(traj))
    # a round of single rows only at steps of fewer calls (Heun's last, into 0) makes only those
    upto = sched.calls if sched.calls < ctx.tab.stages else None
    if keep:
        # the deep features of every row come back beside its velocity (the cached self-draft)
        v, f = ctx.tab.velocity(*rows, sig=cat(sig), rows_key=rows_key, features=True, upto=upto)
    else:
        v = ctx.tab.velocity(*rows, sig=cat(sig), rows_key=rows_key, upto=upto)
    n1 = ids1.numel()
    if ctx.lazy:
        return Evaluations(single=v[:n1], trees=[None] * len(drafts))
    out, feats, start = [], [], n1
    for d, n in zip(drafts, sizes, strict=True):
        out.append(_per_node(d, v[start : start + n]))
        if keep:
            feats.append(_per_node(d, f[start : start + n]))
        start += n
    return Evaluations(single=v[:n1], trees=out, feats=feats if keep else None)


def _per_node(d: Draft, rows: torch.Tensor) -> torch.Tensor:
    """Draft ``d``'s evaluated rows ``(n, C)`` per tree node: ``(G, n_first, C)``, a view, when every
    tree evaluates its first nodes (the walk reads only evaluated nodes, all among them), else
    ``(G, V_r, C)`` with zeros at the nodes not evaluated."""
    G = d.Y.shape[0]
    if d.emask is None:
        return rows.view(G, d.n_first, -1)
    return rows.new_zeros(G, d.Y.shape[1], rows.shape[1]).index_put(tuple(d.emask), rows)


# -- phase 5: commit -------------------------------------------------------------------------


def commit(
    ctx: RunContext, state: RunState, sched: Schedule, ev: Evaluations, drafts: list, walks: list[WalkResult]
) -> RunState:
    """The run state after the round (phase 5)."""
    x, step, pre, carried, memory = state.x, state.step, state.pre, state.carried, state.memory
    ids1 = sched.single
    committed = torch.zeros_like(step)
    single = None
    if ids1.numel():
        s1 = step[ids1]
        x1 = x[ids1]
        c1 = carried.take(ids1)
        mean = ctx.tab.mean(x1, ev.single, s1, c1)
        move = ~sched.fetch
        x = x.index_put((ids1,), torch.where(move[:, None], mean, x1))
        if c1.history:
            carried = carried.put(ids1, c1.where(move, c1.pushed(ctx.tab.carry(x1, ev.single, s1))))
        committed = committed.index_put((ids1,), move.long())
        single = ids1
        if sched.n_fetch:
            f = torch.nonzero_static(sched.fetch, size=sched.n_fetch)[:, 0]
            pre = pre.with_rows(
                ids1[f], state.x[ids1[f]], ev.single[f], s1[f], keep_prev=False, history=ctx.proposal.uses_history
            )
    records = state.records
    dstate = state.draft_state
    hist = ctx.proposal.uses_history
    draft_bad = state.draft_bad
    outcomes = []
    feats = ev.feats if ev.feats is not None else [None] * len(drafts)
    for w, d, V, Fd in zip(walks, drafts, ev.trees, feats, strict=True):
        ids = d.ids
        if d.everyone:
            x, committed = w.x, w.committed
            carried = w.carried
            pre = pre.replaced(w.pre_y, w.pre_v, w.pre_step, history=hist)
        else:
            x = x.index_put((ids,), w.x)
            carried = carried.put(ids, w.carried)
            committed = committed.index_put((ids,), w.committed)
            pre = pre.with_rows(ids, w.pre_y, w.pre_v, w.pre_step, keep_prev=True, history=hist)
        if memory is not None and is_chain(d.tt, d.Lr):
            memory = _remember(ctx, memory, d, V, Fd)
        Lw = w.act.shape[1]
        cols = ctx.depth_cols[:Lw]
        draft_bad = _first_bad_draft(ctx, w, d, cols, draft_bad)
        rows = d.tt.rows_at[d.Ls] + d.sweeps * d.Lr  # a Picard sweep evaluates the chain's Lr parents
        outcomes.append(
            Outcome(ids=ids, committed=w.committed, rows=rows, act=w.act, acc=w.acc, delta=w.delta, sweeps=d.sweeps)
        )
        if ctx.record or ctx.policy is not None:
            lv = (cols + 1).double()[None].expand(ids.numel(), Lw)
            st = (d.s0[:, None] + cols[None]).double()
            rec = torch.stack([lv, st, w.delta, w.acc.double()], -1)[w.act]
            records = records + (rec.cpu(),)
        o = w.observed
        if o is not None:
            seen = ids[o.rows]
            args = (dstate, ctx.tab, o.y, o.mu_q, o.steps, state.pre.take(seen), ctx.tab64.scale[o.steps])
            kw = {} if state.memory is None else {"memory": state.memory.take(seen)}
            if d.terms is None:
                dstate = ctx.proposal.observe(*args, **kw)
            else:
                terms = ctx.proposal.take_terms(d.terms, o.rows, o.steps - d.s0[o.rows])
                dstate = ctx.proposal.observe(*args, terms, **kw)
    stages = sched.calls  # a round's (and a sweep's) calls: one per stage it makes
    # (each trajectory's NFE counts the calls its own rows need: the same whatever the batch)
    entry = RoundEntry(needs=sched.needs, single=single, outcomes=tuple(outcomes), calls=stages)
    counters = state.counters.with_round(entry)
    sweeps = sum(d.sweeps for d in drafts)
    calls = sum(d.draft_calls for d in drafts) + sum(w.draft_calls for w in walks)
    return RunState(
        x=x,
        step=step + committed,
        keys=state.keys,
        pre=pre,
        counters=counters,
        draft_state=dstate,
        records=records,
        rounds=state.rounds + 1,
        draft_calls=state.draft_calls + calls,
        sweep_calls=state.sweep_calls + sweeps,
        stage_calls=state.stage_calls + (stages - 1) * (1 + sweeps),
        seconds=state.seconds,
        draft_bad=draft_bad,
        carried=carried,
        memory=memory,
    )


def _first_bad_draft(ctx: RunContext, w: WalkResult, d: Draft, cols: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """``bad`` (the first step where the draft's mean was NaN or inf, ``-1`` for none; ``()`` long)
    updated with this walk, on the device: a non-finite draft mean makes the mismatch of its
    verification non-finite (the target's means are checked apart)."""
    at = torch.where(w.act & ~torch.isfinite(w.delta), d.s0[:, None] + cols[None], ctx.T).amin()
    return torch.where((bad < 0) & (at < ctx.T), at, bad)


def _remember(
    ctx: RunContext, memory: DraftMemory, d: Draft, V: torch.Tensor, feats: Optional[torch.Tensor]
) -> DraftMemory:
    """``memory`` after draft ``d``'s chain round: the proposal's
    :meth:`~specforest.drafts.Proposal.remember` of the group's rows the round drafted with, given
    the round's parents ``0 .. Lr - 1`` (full mode: ``V`` holds their velocities), their steps and
    their deep features ``feats (G, V_r, F)`` where the run keeps them; put back at the group's rows."""
    Lr = d.Lr
    chain = EvaluatedChain(
        y=d.Y[:, :Lr],
        v=V[:, :Lr],
        steps=d.steps.level[d.s0, :Lr],
        s0=d.s0,
        n=d.Ls,
        features=None if feats is None else feats[:, :Lr],
    )
    part = ctx.proposal.remember(d.memory, ctx.tab, chain)
    return part if d.everyone else memory.put(d.ids, part)


def speculative_round(ctx: RunContext, state: RunState) -> Optional[RunState]:
    """One round of a tree's run: schedule, draft, evaluate (one target call), walk, commit;
    ``None`` once all have finished."""
    clock = time.perf_counter
    t0 = clock()
    sched = schedule(ctx, state)
    if sched is None:
        return None
    t1 = clock()
    swept = ctx.target.seconds  # Picard sweeps call the target while drafting
    drafts: list[Draft] = [draft(ctx, state, g) for g in sched.groups]
    swept = ctx.target.seconds - swept
    t2 = clock()
    inside = ctx.target.seconds
    ev = evaluate(ctx, state, sched, drafts)
    t3 = clock()
    inside = ctx.target.seconds - inside
    if ctx.lazy:
        walks = [walk(ctx, d, OnDemand(ctx, d, state)) for d in drafts]
    else:
        walks = [walk(ctx, d, FullTree(ctx, d, V)) for d, V in zip(drafts, ev.trees, strict=True)]
    t4 = clock()
    out = commit(ctx, state, sched, ev, drafts, walks)
    # the round's trees are freed inside its time: unmapping large ones is part of a round's cost
    del drafts, walks, ev
    t5 = clock()
    # the lazy walk's own target calls are inside ``walk``; on CUDA ``inside`` is 0 here
    sec = state.seconds
    spent = (t1 - t0, t2 - t1 - swept, t3 - t2 - inside, t4 - t3, t5 - t4)
    return replace(out, seconds=tuple(a + b for a, b in zip(sec, spent, strict=True)))
