"""Drafting (phase 2 of a round): the speculating trajectories' trees, and the draws they are made of.

:func:`draft` drafts a group's trees to its deepest lookahead ``Lr``: in full
mode every node at once (node states ``Y``, their noise ``Z`` and the draft
means ``Mp``, kept for the coupling), in lazy mode only the roots, the lazy
walk (:class:`~specforest.walk.OnDemand`) drafting the nodes it reaches. Both
draw a node's children through :func:`sibling_noise` from the same addressed
keys (:mod:`specforest.streams`) and ask :func:`chain_draft` which formula a
chain uses, so the two give the same numbers, not only the same law.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import streams
from .carried import NOTHING, Carried
from .records import Draft, Group, RunContext, RunState
from .target import ALL_ROWS

__all__ = [
    "carried_term",
    "chain_draft",
    "draft",
    "is_chain",
    "level_calls",
    "remembers_chain",
    "hand_on",
    "own_hand_on",
    "root_known",
    "root_prediction",
    "runs_full",
    "sibling_noise",
    "tree_draws",
]


def root_prediction(ctx: RunContext, pre, carried: Carried) -> Optional[torch.Tensor]:
    """``(G, D)`` the clean-image prediction a frozen draft's round drafts its states' hand-ons with
    (:func:`carried_term`), and any draft's at a root whose own evaluation was prefetched (:func:`root_known`):
    that of the prefetched evaluation ``pre`` (the root's own where it was evaluated at the root), the root's
    last carried prediction where ``pre`` holds none; ``None`` for a chain that carries nothing.

    It reads only what was evaluated before the round, so draft means made from it keep the law.
    """
    if not carried.history:
        return None
    return torch.where(pre.valid[:, None], ctx.tab.prediction(pre.y, pre.v, pre.step), carried.p[:, 0])


def hand_on(ctx: RunContext, y: torch.Tensor, steps: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """``(G, n, D)`` or ``(G, D)``: what drafted states ``y`` (that shape) at steps ``steps`` (``(G, n)`` or
    ``(G,)``) hand on, their velocities not known yet: the chain's carried quantity with the round's
    prediction ``predicted (G, D)`` (:meth:`~specforest.sde.StepTables.hand_on`), exact at a prefetched root."""
    x0 = predicted if y.dim() == 2 else predicted[:, None]
    return ctx.tab.hand_on(y, x0, steps)


def own_hand_on(
    ctx: RunContext,
    y: torch.Tensor,
    steps: torch.Tensor,
    m: torch.Tensor,
    predicted: torch.Tensor,
    exact: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``(G, n, D)``: what drafted states ``y (G, n, D)`` at steps ``steps (G, n)`` hand on, read from the draft's
    own one-step mean there, ``m = a y + c v^`` (``(G, n, D)``, before its carried term): the chain's carried
    quantity (:meth:`~specforest.sde.StepTables.carry`) of ``y`` with the draft's velocity ``v^ = (m - a y) / c``.

    A draft that evaluates a network at each drafted parent (one that is not affine) so drafts a node's past
    predictions from its own evaluations at the node's drafted ancestors, as the target reads its own: the
    target itself as the draft is then exact at every depth. :func:`hand_on` with the round's prediction
    ``predicted (G, D)`` stands in where ``c`` is 0 (no velocity to read) and in the rows ``exact (G,)`` (the
    roots the target was evaluated at before the round, whose prediction is known). Any draft mean keeps the
    law: these read only the drafted states and the draft's means, made before the verification call.
    """
    ac = ctx.tab.ac[steps]
    a, c = ac[..., :1], ac[..., 1:]
    zero = c == 0
    v = (m - a * y) / torch.where(zero, torch.ones_like(c), c)
    known = zero if exact is None else zero | exact[:, None, None]
    return torch.where(known, hand_on(ctx, y, steps, predicted), ctx.tab.carry(y, v, steps))


def root_known(pre, s0: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
    """``(G,)`` bool: the roots ``root (G, D)`` at steps ``s0 (G,)`` whose own evaluation the round's prefetch
    ``pre`` holds (not a sibling's at the same step, which ``prefetch="nearest"`` reuses after a rejection)."""
    return pre.valid & (pre.step == s0) & (pre.y == root).all(-1)


def carried_term(
    ctx: RunContext, steps: torch.Tensor, carried: Carried, predicted: Optional[torch.Tensor]
) -> Optional[torch.Tensor]:
    """``(G, Lr, D)`` the multistep term of a frozen (affine) draft's means at the parents of every depth
    ``0 .. Lr - 1`` of a chain whose states hand on the prediction alone (:attr:`~specforest.sde.StepTables.hands_on_prediction`),
    at steps ``steps (G, Lr)``; ``None`` for a chain that carries none.

    A parent's past predictions are the roots' carried ones ``carried`` (``(G, h, D)``) where they were made
    at or above the root's parent, and ``predicted`` (``(G, D)``, :func:`root_prediction`) from the root down
    to the parent's parent (:meth:`~specforest.carried.Carried.term_below`): exact for a root's children, and
    for its grandchildren where the root was prefetched. The states between are not evaluated while drafting;
    a draft is any mean (the coupling keeps the law). A chain whose states hand on a combination with their
    own state (``dpmpp_sde``) drafts that combination of each drafted state and ``predicted`` one depth at
    a time instead (:func:`hand_on`, in :func:`draft` and the lazy walk), through the same ops. A draft that
    evaluates each drafted parent hands on its own predictions instead (:func:`own_hand_on`).
    """
    if not carried.history:
        return None
    G, Lr = steps.shape
    return carried.term_below(predicted[:, None].expand(G, Lr, -1), ctx.tab.past[steps])


def level_calls(proposal, tab) -> int:
    """The draft's network calls of one drafted level of a proposal that is not affine: ``s`` for a
    :attr:`~specforest.drafts.Proposal.staged` draft on a chain of ``s`` stages (step tables ``tab``), which
    runs its network through the chain's stage tableau, else one. The full draft and the lazy walk both
    count with it."""
    return tab.stages if proposal.staged else 1


def sibling_noise(ctx: RunContext, keys: torch.Tensor, K: int, D: int) -> torch.Tensor:
    """Standard noise ``(..., n, D)`` of nodes with keys ``(..., n)``, ``n`` a multiple of ``K``.

    The nodes come in blocks of ``K`` siblings (every internal node of a tree a
    coupling with structured siblings accepts has ``K`` children, stored
    together), so the coupling's sibling structure applies block by block; the
    full tree (:func:`draft`) and the lazy walk (:class:`~specforest.walk.OnDemand`)
    both draw through here.
    """
    return _structured(ctx, streams.normal(keys, D, ctx.work, streams.TAG_DRAFT), K)


def is_chain(tt, Lr: int) -> bool:
    """Whether a round to depth ``Lr`` of tree tables ``tt`` has one node a depth (a chain): its
    noise can be keyed by step and its evaluated nodes remembered, whatever the proposal."""
    return tt.size_at(Lr) - 1 == Lr


def chain_draft(proposal, tt, Lr: int) -> bool:
    """Whether a round to depth ``Lr`` of tree tables ``tt`` drafts its nodes with the chain formula:
    an affine proposal on a chain (:func:`is_chain`), node ``l`` being ``A_l y_{l-1} + (C_l +
    scale_l z_l)`` in one op.

    The full draft (:func:`draft`) and the lazy walk (:class:`~specforest.walk.OnDemand`) both ask
    here, so they use the same formula and give the same numbers.
    """
    return proposal.affine and is_chain(tt, Lr)


def remembers_chain(proposal, tree) -> bool:
    """Whether a run of ``proposal`` with ``tree`` (a :class:`~specforest.trees.DraftTree`, a
    :class:`~specforest.trees.TreePolicy` or ``None``) keeps each round's evaluated chain for the
    next (:attr:`~specforest.drafts.Proposal.uses_memory`, in the memory it makes with
    :meth:`~specforest.drafts.Proposal.init_memory`): it must then evaluate every node
    of a chain round, so it runs full. A tree whose first level branches never drafts a chain
    (:func:`chain_draft`), and the standard sampler drafts nothing."""
    return getattr(proposal, "uses_memory", False) and _drafts_chains(tree)


def _drafts_chains(tree) -> bool:
    """Whether a run of ``tree`` (a :class:`~specforest.trees.DraftTree`, a policy or ``None``) can
    draft chain rounds: not the standard sampler, and no branching at the first level (a policy
    may plan chains)."""
    if tree is None:
        return False
    return not hasattr(tree, "size_at_depth") or tree.size_at_depth(1) == 2


def runs_full(proposal, tree) -> bool:
    """Whether a run of ``proposal`` with ``tree`` must run full even when ``lazy`` is asked: it
    remembers its chain (:func:`remembers_chain`), or it refines its chain rounds with Picard
    sweeps (:attr:`~specforest.drafts.Proposal.picard_sweeps`), which evaluate every parent."""
    return remembers_chain(proposal, tree) or (getattr(proposal, "picard_sweeps", 0) > 0 and _drafts_chains(tree))


def _picard(
    ctx: RunContext,
    group: Group,
    Y: torch.Tensor,
    SZ: torch.Tensor,
    steps: torch.Tensor,
    sweeps: int,
    carried: Carried = NOTHING,
):
    """Picard sweeps over a drafted chain: ``(Y, Mp)`` after ``sweeps`` sweeps.

    Each sweep is one batched target call at the chain's parents ``Y[:, :Lr]`` (``(G, Lr)`` rows,
    steps ``steps``), then the chain again from its root with the same noise ``SZ``: node ``l + 1``
    is the exact transition mean at node ``l`` of this sweep with the clean-data prediction the
    target gave at node ``l`` of the last sweep (the ``x0`` kind's formula, frozen per node), plus
    its noise. Node ``l``'s state depends on the noise of nodes ``1 .. l`` only, so the draft of
    node ``l + 1`` never reads its own draw and the coupling stays exact. A multistep chain's term
    reads the last sweep's predictions at the nodes before ``l`` (the root's ``carried`` ones above it).
    """
    G, _, D = Y.shape
    Lr = steps.shape[1]
    tab = ctx.tab
    sig = tab.sig[steps]  # (G, Lr)
    ac = tab.ac[steps]
    k = ac[..., 1:] / sig[..., None]
    A = ac[..., :1] + k  # (G, Lr, 1)
    traj = (ctx.rows_all if group.everyone else group.ids).repeat_interleave(Lr)
    flat_sig, flat_steps = sig.reshape(-1), steps.reshape(-1)
    for _ in range(sweeps):
        V = tab.velocity(ctx.target, Y[:, :Lr].reshape(-1, D), flat_steps, traj, sig=flat_sig)
        V = V.view(G, Lr, D).to(Y.dtype)
        C = torch.addcmul(-k * Y[:, :Lr], k * sig[..., None], V)  # -k x0, x0 = y - sig v at the last sweep
        if carried.history:
            up = (torch.arange(Lr, device=Y.device) - 1).clamp(min=0)  # a chain: node l's parent is l - 1
            C = tab.add_past(C, steps, carried.at_nodes(tab.carry(Y[:, :Lr], V, steps), up))
        W = torch.add(C, SZ[:, :Lr])
        Ynew = torch.empty_like(Y)  # a chain: nodes 0 .. Lr
        Ynew[:, 0] = Y[:, 0]
        for level in range(Lr):
            torch.addcmul(W[:, level], A[:, level], Ynew[:, level], out=Ynew[:, level + 1])
        Y = Ynew
    return Y, torch.addcmul(C, A, Y[:, :Lr])


def _aligned_keys(step_keys: torch.Tensor, s0: torch.Tensor, tt, Vr: int) -> torch.Tensor:
    """``(G, Vr)`` keys of a chain rooted at steps ``s0 (G,)`` whose node at step ``t > s0`` is keyed
    by the transition into ``t``: ``step_keys[t - 1] ^ code[1]``, the root as usual
    (``step_keys[s0] ^ code[0]``). A round rooted at ``s`` then draws its depth-1 node with the key
    an earlier round's node at step ``s + 1`` had; the walk never made a decision with the draws
    of a node past the one it stopped at, so they are fresh for the later round."""
    node = torch.arange(Vr, device=s0.device)
    code = tt.code[:2][(node > 0).long()]
    # nodes past the chain's end (beyond the trajectory's lookahead, never drafted from) share its last key
    at = (s0[:, None] + (node - 1).clamp(min=0)).clamp(max=step_keys.shape[1] - 1)
    return step_keys.gather(1, at) ^ code


def _structured(ctx: RunContext, z: torch.Tensor, K: int) -> torch.Tensor:
    if ctx.coupling.structured_siblings:
        z = ctx.coupling.structure_noise(z.reshape(-1, K, z.shape[-1])).reshape(z.shape)
    return z


def tree_draws(
    ctx: RunContext, keys: torch.Tensor, Vi: int, K: int, D: int
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A full tree's random numbers in one pass of the mixer (:func:`specforest.streams.uniforms`).

    Args:
        keys: ``(G, V_r)`` node keys.
        Vi: the nodes that may be verified (``0 .. V_i - 1``).

    Returns:
        ``(Z, U)``: the noise of nodes ``1 .. V_r - 1``, ``(G, V_r - 1, D)``
        (:func:`sibling_noise`'s numbers), and the coupling's declared uniforms
        (:meth:`~specforest.couplings.Coupling.uniform_draws`) at nodes
        ``0 .. V_i - 1``, ``(G, V_i, C)``, or ``None`` when it declares none.
    """
    layout = ctx.coupling.uniform_draws(K)
    if not layout:
        return sibling_noise(ctx, keys[:, 1:], K, D), None
    at = tuple((streams.SLOT_COUPLE + slot, n) for slot, n in layout)
    u, U = streams.uniforms((keys[:, 1:], ((streams.TAG_DRAFT, D),)), (keys[:, :Vi], at))
    return _structured(ctx, torch.special.ndtri(u).to(ctx.work), K), U


def draft(ctx: RunContext, state: RunState, group: Group) -> Draft:
    """Draft the trees of ``group`` to its deepest lookahead (phase 2)."""
    ids, Ls, Lr, ts = group.ids, group.Ls, group.Lr, group.steps
    tt = ts.tt
    tab = ctx.tab
    carried = state.carried
    memory = state.memory
    if group.everyone:
        s0, pre, x0 = state.step, state.pre, state.x
        keys = state.keys.gather(1, s0[:, None])
    else:
        s0, pre, x0 = state.step[ids], state.pre.take(ids, history=ctx.proposal.uses_history), state.x[ids]
        keys = state.keys[ids, s0][:, None]
        carried = carried.take(ids)
        memory = None if memory is None else memory.take(ids)
    # the proposal's memory, for a proposal that keeps one (one that keeps none need not take it)
    mem = {} if memory is None else {"memory": memory}
    Vr = tt.size_at(Lr)
    prop = ctx.proposal
    if prop.aligned_noise and is_chain(tt, Lr):
        keys = _aligned_keys(state.keys if group.everyone else state.keys[ids], s0, tt, Vr)
    else:
        # a node's key is the step key XOR the node's mixed id: every draw at the node then mixes
        # that key with its own mixed counter (streams.uniform), so no second mixing pass is needed
        keys = keys ^ tt.code[None, :Vr]
    # what the lazy walk and the full draft both hand on
    known = dict(
        steps=ts,
        ids=ids,
        s0=s0,
        Ls=Ls,
        Lr=Lr,
        everyone=group.everyone,
        keys=keys,
        pre=pre,
        carried=carried,
        predicted=root_prediction(ctx, pre, carried),
        memory=memory,
    )
    if ctx.lazy:
        return Draft(**known)
    G, D = ids.numel(), state.x.shape[1]
    Vi = tt.size_at(Lr - 1)
    # (G, Vr - 1, D): noise of nodes 1..Vr-1, drawn with the coupling's uniforms at nodes 0..Vi-1
    Z, U = tree_draws(ctx, keys, Vi, tt.children.shape[1], D)
    # every drafted node's noise times its transition scale, in one op (the lazy walk does the same per node)
    SZ = ts.draft_scale[s0, : Vr - 1] * Z
    Y = torch.empty(G, Vr, D, dtype=ctx.work, device=ctx.device)
    Y[:, 0] = x0
    Mp = torch.empty(G, Vi, D, dtype=ctx.work, device=ctx.device)
    steps = ts.level[s0, :Lr]  # (G, Lr) parents' steps
    calls = 0
    sweeps = 0
    terms = None
    if prop.affine:
        terms = prop.round_terms(tab, steps, pre, **mem)
        if terms is None:
            A, C = prop.coefficients(tab, steps, pre, state.draft_state, **mem)
        else:
            A, C = prop.coefficients(tab, steps, pre, state.draft_state, terms, **mem)
    # the draft means' multistep term: at once where the states hand on the prediction alone, else one
    # depth at a time below (a state's hand-on reads the drafted state itself)
    predicted = known["predicted"]
    # a draft evaluating each drafted parent hands on its own prediction there (own_hand_on), one depth at a time
    own = carried.history > 0 and not prop.affine
    stepwise = carried.history > 0 and (own or not tab.hands_on_prediction)
    extra = None if stepwise else carried_term(ctx, steps, carried, predicted)
    if prop.affine and extra is not None:
        C = C + extra
    if chain_draft(prop, tt, Lr) and stepwise:
        # as the lazy walk: each depth's term from the carried state pushed along the drafted chain
        C = C.expand(G, Lr, D).clone()
        drafted = carried
        for level in range(Lr):
            at = steps[:, level]
            C[:, level] += tab.past_term(at, drafted)
            torch.addcmul(C[:, level] + SZ[:, level], A[:, level], Y[:, level], out=Y[:, level + 1])
            drafted = drafted.pushed(hand_on(ctx, Y[:, level], at, predicted))
        torch.addcmul(C, A, Y[:, :Lr], out=Mp)
        if prop.picard_sweeps:
            Y, Mp = _picard(ctx, group, Y, SZ, steps, prop.picard_sweeps, carried)
            sweeps = prop.picard_sweeps
    elif chain_draft(prop, tt, Lr):
        # one op a depth, and the draft means after it in one op
        # (split_with_sizes: Tensor.split's Python wrapper costs more than the op, docs/engine.md)
        ones = (1,) * Lr
        Yl, Wl, Al = (
            Y.split_with_sizes(ones + (1,), 1),
            torch.add(C, SZ).split_with_sizes(ones, 1),
            A.split_with_sizes(ones, 1),
        )
        for level in range(Lr):
            torch.addcmul(Wl[level], Al[level], Yl[level], out=Yl[level + 1])
        torch.addcmul(C, A, Y[:, :Lr], out=Mp)
        if prop.picard_sweeps:
            Y, Mp = _picard(ctx, group, Y, SZ, steps, prop.picard_sweeps, carried)
            sweeps = prop.picard_sweeps
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
            cond = ctx.target.cond_rows(ids, ALL_ROWS if group.everyone else None)
        if stepwise:
            # what each drafted state hands on, and the node's carried state from its ancestors' (as the lazy walk)
            handed = torch.empty(G, Vi, D, dtype=ctx.work, device=ctx.device)
        for level in range(1, Lr + 1):
            p0, p1, k = tt.layers[level - 1]
            c0, c1, _ = tt.layers[level]
            term = None
            if stepwise:
                at = steps[:, level - 1 : level]
                if not own:
                    handed[:, p0:p1] = hand_on(ctx, Yl[level - 1], at, predicted)
                term = tab.past_term(at, carried.at_nodes(handed[:, :p1], tt.up[:p1])[:, p0:p1])
            if prop.affine:
                c = Cl[level - 1] if term is None else Cl[level - 1] + term
                m = torch.addcmul(c, Al[level - 1], Yl[level - 1], out=Mpl[level - 1])
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
                        **mem,
                    )
                )
                if own:
                    # these parents' hand-ons, read by the next depths (a node's past predictions are its ancestors')
                    exact = root_known(pre, s0, x0) if level == 1 else None
                    handed[:, p0:p1] = own_hand_on(ctx, Yl[level - 1], at, m, predicted, exact)
                if extra is not None:
                    m.add_(extra[:, level - 1 : level])
                elif term is not None:
                    m.add_(term)
                calls += level_calls(prop, tab)
            if k == 1:
                torch.add(m, SZl[level - 1], out=Yl[level])
            elif k:
                view = (G, p1 - p0, k, D)
                torch.add(m[:, :, None], SZl[level - 1].view(view), out=Yl[level].view(view))
            else:
                rep = torch.repeat_interleave(m, tt.tree.num_children[p0:p1].to(ctx.device), dim=1, output_size=c1 - c0)
                torch.add(rep, SZl[level - 1], out=Yl[level])
    drawn = dict(Y=Y, Z=Z, Mp=Mp, U=U, terms=terms, draft_calls=calls, sweeps=sweeps)
    if group.even and tt.eval_prefix[Lr] >= Vi:
        # every tree evaluates the same first nodes, the verified ones among them: a view of Y, no scatter
        return Draft(**known, **drawn, n_first=tt.eval_prefix[Lr])
    # the (trajectory, node) pairs the target evaluates, without a synchronization: their number is known
    emask = torch.nonzero_static(tt.eval_at[Ls][:, :Vr], size=group.rows).T
    return Draft(**known, **drawn, emask=emask)
