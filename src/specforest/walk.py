"""The walk of a round (phase 4 of Algorithm 1): from each root down the tree until the first rejection.

For every speculating trajectory of a group (``G`` of them, the rows of a
:class:`~specforest.records.Draft`), :func:`walk` starts at the root (node 0)
and, depth after depth up to the group's deepest lookahead ``Lr``, meets the
verification problem at its current node: the ``K`` drafted children
(``K = K_max``, the tree's widest node; padding marked by ``valid (.., K)``),
their draft mean ``mu_p (D,)``, the target's mean ``mu_q (D,)`` and the
transition scale. The coupling accepts one child (the walk moves there) or
rejects them all (the walk stops, and its new state is the coupling's residual
draw at that node). A walk also stops at a leaf and at its own lookahead
``Ls``. Then the prefetch rule (:data:`~specforest.engine.PREFETCH_POLICIES`)
picks the evaluation the next round drafts from, and the walk returns a
:class:`~specforest.records.WalkResult`: new states ``(G, D)``, committed steps
``(G,)`` and the per-depth statistics ``(G, Lw)`` over the ``Lw <= Lr`` depths walked.

There is one walk for both execution strategies of a round; they differ only
in the *realizer* (:class:`Realizer`) that the walk asks for a node's decision,
state and evaluation:

* :class:`FullTree`: the tree truncated to depth ``Lr`` (``V_r`` nodes) was
  drafted (``Y (G, V_r, D)``) and the nodes the round evaluates were evaluated
  (``V (G, V_r, D)``) before the walk, in the round's one target call. It
  decides every verification problem (the ``V_i`` nodes of depth ``< Lr``) in
  **one** coupling call, so the walk only follows the decisions, all depths
  at once;
* :class:`OnDemand`, the lazy cost simulation: drafts and evaluates only the
  nodes the walk reaches, one depth at a time (one target call per depth), and
  evaluates a prefetch source (a sibling, the committed leaf) only when the
  full round would have had it evaluated.

The full round's draft (:func:`specforest.drafting.draft`) and :class:`OnDemand`
draw a node's children through :func:`~specforest.drafting.sibling_noise` from
the same addressed keys (:mod:`specforest.streams`), so the two give the same
numbers, not only the same law. Acceptance, statistics, the residual's
reconstruction and the prefetch rule are written once, here.

Host-device synchronizations of a full walk: one, the rejected trajectories
(``nonzero``), whose residual draws have a data-dependent size; the full tree's
descent is closed form (:meth:`FullTree.descend`). The lazy walk reads once per
depth, to stop when every walk has ended.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from . import streams
from .carried import Carried
from .couplings import project
from .drafting import chain_draft, hand_on, level_calls, own_hand_on, root_known, sibling_noise
from .records import Draft, Observed, RunContext, RunState, WalkResult

__all__ = ["Descent", "FullTree", "Level", "OnDemand", "Problem", "Realizer", "coupling_stream", "walk"]


def coupling_stream(ctx: RunContext, keys: torch.Tensor, U: Optional[torch.Tensor], K: int) -> streams.Stream:
    """The coupling's stream of problems with node keys ``keys (P,)`` and declared uniforms ``U (P, C)``."""
    if U is None:
        return streams.Stream(keys, streams.SLOT_COUPLE)
    return streams.Stream(keys, streams.SLOT_COUPLE, U, ctx.coupling.uniform_draws(K))


@dataclass(frozen=True)
class Level:
    """What the lazy walk learns at one depth for every trajectory of a group (``(G,)`` each; rows
    not active are junk)."""

    verified: torch.Tensor  # a verification problem met at this depth
    accepted: torch.Tensor  # ... and a child accepted (implies verified)
    next: torch.Tensor  # the accepted child
    delta: torch.Tensor
    y: Optional[torch.Tensor] = None  # (G, D) verified parent, when the proposal observes
    mu_q: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class Descent:
    """Where the walks of a group went: ``Lw <= Lr`` depths, rows as in the :class:`~specforest.records.Draft`.

    Attributes:
        cur: ``(G,)`` the node each walk ended at (a rejected walk: the parent of the rejected children).
        act: ``(G, Lw)`` bool, a verification problem met at depth ``l``.
        acc: ``(G, Lw)`` bool, ... and a child accepted.
        delta: ``(G, Lw)`` float64 mismatch of the problem met (junk where not ``act``).
        observed: the verified parents, when the proposal observes.
    """

    cur: torch.Tensor
    act: torch.Tensor
    acc: torch.Tensor
    delta: torch.Tensor
    observed: Optional[Observed] = None


@dataclass(frozen=True)
class Problem:
    """The verification problems where ``P`` walks stopped: the inputs of the coupling's
    :meth:`~specforest.couplings.Coupling.rejected_state`.

    Attributes:
        s_hat: ``(P, K)`` the children's projections.
        delta: ``(P,)`` the mismatch.
        valid: ``(P, K)`` bool, real children.
        idx: ``(P,)`` the child the coupling kept.
        stream: the problems' random stream.
        e: ``(P, D)`` the direction of the mismatch.
        scale: ``(P,)`` float64 transition scale.
        kids: ``(P, K, D)`` the children's states.
    """

    s_hat: torch.Tensor
    delta: torch.Tensor
    valid: torch.Tensor
    idx: torch.Tensor
    stream: streams.Stream
    e: torch.Tensor
    scale: torch.Tensor
    kids: torch.Tensor


class Realizer(Protocol):
    """How the walk reaches a group's nodes (rows as in its :class:`~specforest.records.Draft`).

    Attributes:
        draft_calls: calls of a draft model the realizer made (read after the walk).
    """

    draft_calls: int

    def descend(self) -> Descent:
        """Every walk of the group from its root to where it ends."""
        ...

    def problem(self, rows: torch.Tensor, nodes: torch.Tensor) -> Problem:
        """The verification problem whose children walk ``rows (P,)`` rejected at ``nodes (P,)``."""
        ...

    def state(self, nodes: torch.Tensor) -> torch.Tensor:
        """``(G, D)`` the state of each walk's node ``nodes (G,)`` (on its path or a child of its last node)."""
        ...

    def velocity(self, nodes: torch.Tensor) -> torch.Tensor:
        """``(G, D)`` the target velocity at each walk's node ``nodes (G,)``, one the full round evaluates."""
        ...

    def children_states(self, rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        """``(P, K, D)`` the states of the children of ``nodes (P,)`` of walks ``rows (P,)``."""
        ...

    def carried(self, nodes: torch.Tensor) -> Carried:
        """The carried predictions of each walk's node ``nodes (G,)`` (a node on its path whose
        children it met, or its parent), ``(G, h, D)``."""
        ...


def _problem_inputs(ctx, zk, mu_p, mu_q, scale, valid, keys, U=None):
    """Projections, mismatches, directions and decisions of a batch of problems (any leading shape)."""
    s_hat, delta, e = project(zk, mu_q - mu_p, scale)
    K = valid.shape[-1]
    lead = valid.shape[:-1]
    acc, idx = ctx.coupling.select(
        s_hat.reshape(-1, K),
        delta.reshape(-1),
        valid.reshape(-1, K),
        coupling_stream(ctx, keys.reshape(-1), None if U is None else U.reshape(-1, U.shape[-1]), K),
    )
    return s_hat, delta, e, acc.reshape(lead), idx.reshape(lead)


class FullTree:
    """Realizer of a fully drafted and evaluated round: every verification problem is decided at once.

    The decisions of every node of depth ``< Lr`` are computed in one coupling
    call before the walk (the walk then only follows them); the residual is
    drawn only where a walk stopped.
    """

    draft_calls = 0

    def __init__(self, ctx: RunContext, d: Draft, V: torch.Tensor) -> None:
        tt, G = d.tt, d.ids.numel()
        Vi = d.Mp.shape[1]
        self.ctx, self.d, self.V = ctx, d, V
        steps = d.steps.step[d.s0, :Vi]
        # nodes a walk never verifies (leaves, beyond a trajectory's lookahead) get junk but finite
        # problems: their velocity is 0 and their scale at least positive (``scale_safe``)
        # a multistep chain: each node's mean reads its ancestors' predictions (the root's carried ones above it)
        self.nodes_carried = d.carried
        if d.carried.history:
            self.nodes_carried = d.carried.at_nodes(ctx.tab.carry(d.Y[:, :Vi], V[:, :Vi], steps), tt.up[:Vi])
        self.mu_q = ctx.tab.mean(d.Y[:, :Vi], V[:, :Vi], steps, self.nodes_carried)
        ch = tt.children[:Vi]  # (Vi, K)
        K = ch.shape[1]
        Vr = d.Y.shape[1]
        if Vr - 1 == Vi * K and all(lay[2] == K for lay in tt.layers[: d.Lr]):
            zk = d.Z.reshape(G, Vi, K, -1)
            self.chain = K == 1
        else:
            zk = d.Z[:, (ch.clamp(min=0) - 1).clamp(max=Vr - 2)]
            self.chain = False
        self.scale = ctx.tab64.scale_safe[steps]
        self.ckeys = d.keys[:, :Vi]
        self.valid = tt.valid[None, :Vi].expand(G, Vi, K)
        self.s_hat, self.delta, self.e, acc, self.idx = _problem_inputs(
            ctx, zk, d.Mp, self.mu_q, self.scale, self.valid, self.ckeys, d.U
        )
        # a walk at a node goes to its accepted child if the node is verified (not a leaf, within
        # the trajectory's lookahead), else stays there: ``moved``, and ``next`` the node it goes to
        self.verified = tt.verify_at[d.Ls][:, :Vi]
        self.moved = self.verified & acc
        if not self.chain:  # (a chain's accepted child is the next node)
            child = ch.expand(G, Vi, K).gather(2, self.idx[..., None])[..., 0]
            self.next = torch.where(self.moved, child, tt.node_ids[:Vi])
        self.rows = ctx.rows_all[:G]

    def descend(self) -> Descent:
        """Every walk of the group at once, from the decisions: no synchronization.

        A walk follows ``next`` from the root, one gather per depth (a node that
        does not move is its own ``next``), so its node at each depth is its path
        and its last node is where it ended.
        """
        d, tt = self.d, self.d.tt
        Lr = d.Lr
        cols = self.ctx.depth_cols[None, :Lr]
        if self.chain:
            # node l is at depth l: a walk goes on while each node accepted the next one
            cur = self.moved.long().cumprod(1).sum(1)
            path = None
            verified, ended, delta = self.verified, cur[:, None], self.delta  # past ``cur``, junk that ``act`` masks
        else:
            node = torch.zeros(self.rows.shape[0], 1, dtype=torch.long, device=self.rows.device)
            nodes = [node]
            for _ in range(Lr):
                node = self.next.gather(1, node)
                nodes.append(node)
            walked = torch.cat(nodes, 1)  # (G, Lr + 1): the node at each depth, the last one after the end
            cur, path = walked[:, Lr], walked[:, :Lr]
            verified = self.verified.gather(1, path)
            ended = tt.depth[cur][:, None]
            delta = self.delta.gather(1, path)
        act = verified & (cols <= ended)
        acc = cols < ended
        observed = None
        if self.ctx.proposal.observes:
            # level-major, as the lazy walk observes them
            if path is None:
                path = torch.minimum(cols, ended)
            m = act.T.reshape(-1)
            nodes = path.T.reshape(-1)[m]
            rows = self.rows.repeat(Lr)[m]
            steps = (d.s0[None] + self.ctx.depth_cols[:Lr, None]).reshape(-1)[m]
            observed = Observed(y=d.Y[rows, nodes], mu_q=self.mu_q[rows, nodes], steps=steps, rows=rows)
        return Descent(cur=cur, act=act, acc=acc, delta=delta, observed=observed)

    def problem(self, rows: torch.Tensor, nodes: torch.Tensor) -> Problem:
        r, u = rows, nodes
        return Problem(
            s_hat=self.s_hat[r, u],
            delta=self.delta[r, u],
            valid=self.valid[r, u],
            idx=self.idx[r, u],
            stream=coupling_stream(
                self.ctx, self.ckeys[r, u], None if self.d.U is None else self.d.U[r, u], self.valid.shape[2]
            ),
            e=self.e[r, u],
            scale=self.scale[r, u],
            kids=self.d.Y[r[:, None], self.d.tt.kids[u]],
        )

    def state(self, nodes: torch.Tensor) -> torch.Tensor:
        return self.d.Y[self.rows, nodes]

    def velocity(self, nodes: torch.Tensor) -> torch.Tensor:
        return self.V[self.rows, nodes]

    def children_states(self, rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        return self.d.Y[rows[:, None], self.d.tt.kids[nodes]]

    def carried(self, nodes: torch.Tensor) -> Carried:
        return self.nodes_carried[self.rows, nodes]


class OnDemand:
    """Realizer of the lazy cost simulation: drafts and evaluates only the nodes the walk visits.

    The law of everything observed is that of the full round, and with the
    addressed noise even the numbers are: a node's children are drawn from the
    same keys as in the full tree, and nodes off the walked path influence
    nothing. NFE and rows are accounted as for the full tree; the model is
    called once per depth with the visited rows.
    """

    def __init__(self, ctx: RunContext, d: Draft, state: RunState) -> None:
        self.ctx, self.d, self.draft_state = ctx, d, state.draft_state
        G, D = d.ids.numel(), state.x.shape[1]
        self.rows = ctx.rows_all[:G]
        self.cur = torch.zeros(G, dtype=torch.long, device=ctx.device)
        self.cur_y = state.x[d.ids].clone()
        self.cur_v = torch.zeros_like(self.cur_y)
        self.cur_evaluated = torch.zeros_like(self.cur, dtype=torch.bool)  # cur_v holds cur's velocity
        self.par = torch.full_like(self.cur, -1)
        self.par_y, self.par_v = self.cur_y.clone(), torch.zeros_like(self.cur_y)
        # a multistep chain: the carried predictions of each walk's current node and of its parent
        self.cur_carried = self.par_carried = d.carried
        # ... and the one the draft reads there, pushed with what each drafted state hands on (drafting.hand_on)
        self.drafted = d.carried
        K = d.tt.children.shape[1]
        self.kids = torch.zeros(G, K, D, dtype=ctx.work, device=ctx.device)
        self.kid_nodes = torch.full((G, K), -1, dtype=torch.long, device=ctx.device)
        self.prob: Optional[dict] = None  # the last problem met by each row, by Problem's field names
        self.draft_calls = 0

    def level(self, level: int, cur: torch.Tensor, alive: torch.Tensor) -> Optional[Level]:
        ctx, d, tt = self.ctx, self.d, self.d.tt
        act = alive & tt.verify_at[d.Ls, cur]
        a = act.nonzero()[:, 0]
        if a.numel() == 0:
            return None
        u = cur[a]
        sa = (d.s0[a] + level - 1).clamp(max=ctx.T - 1)
        yu = self.cur_y[a]
        vu = ctx.tab.velocity(ctx.target, yu, sa, d.ids[a])
        self.cur_v[a] = vu
        self.cur_evaluated[a] = True
        carried = self.cur_carried.take(a)
        mu_q = ctx.tab.mean(yu[:, None], vu[:, None], sa[:, None], carried[:, None])[:, 0]
        pre = d.pre.take(a)
        mem = {} if d.memory is None else {"memory": d.memory.take(a)}
        prop = ctx.proposal
        # the draft's multistep term, as the full draft makes it: the carried state the draft pushed along the path
        drafted = self.drafted.take(a)
        extra = ctx.tab.past_term(sa[:, None], drafted[:, None])
        own = None
        if prop.affine:
            A, C = prop.coefficients(ctx.tab, sa[:, None], pre, self.draft_state, **mem)
            if extra is not None:
                C = C + extra
            mu_p = torch.addcmul(C, A, yu[:, None])[:, 0]
        else:
            cond = ctx.target.cond_rows(d.ids[a])
            mu_p = prop.mean(ctx.tab, yu[:, None], sa[:, None], pre, cond, ctx.shape, self.draft_state, **mem)[:, 0]
            if extra is not None:
                # what this node hands on to its drafted descendants: the draft's own prediction, as the full draft
                exact = root_known(pre, d.s0[a], yu) if level == 1 else None
                own = own_hand_on(ctx, yu[:, None], sa[:, None], mu_p[:, None], d.predicted[a], exact)[:, 0]
                mu_p = mu_p + extra[:, 0]
            self.draft_calls += level_calls(prop, ctx.tab)
        ch = tt.children[u]  # (P, K)
        K = ch.shape[1]
        keys = d.keys[a[:, None], tt.kids[u]]
        zk = sibling_noise(ctx, keys, K, yu.shape[1])
        sz = ctx.tab.scale[sa][:, None, None] * zk
        if chain_draft(prop, d.tt, d.Lr):
            kids = torch.addcmul(C + sz, A, yu[:, None])
        else:
            kids = mu_p[:, None] + sz
        scale = ctx.tab64.scale[sa]
        ckeys = d.keys[a, u]
        valid = tt.valid[u]
        s_hat, delta, e, acc, idx = _problem_inputs(ctx, zk, mu_p, mu_q, scale, valid, ckeys)
        self.kids[a], self.kid_nodes[a] = kids, ch
        # the last problem of each row: where a rejected walk stopped
        met = dict(s_hat=s_hat, delta=delta, valid=valid, idx=idx, keys=ckeys, e=e, scale=scale, kids=kids)
        if self.prob is None:
            self.prob = {k: t.new_zeros((len(self.rows),) + tuple(t.shape[1:])) for k, t in met.items()}
        for k, t in met.items():
            self.prob[k][a] = t
        # advance the accepted rows to their child
        take = a[acc]
        self.par[take], self.par_y[take], self.par_v[take] = u[acc], yu[acc], vu[acc]
        if carried.history:
            moved = carried.take(acc)
            self.par_carried = self.par_carried.put(take, moved)
            self.cur_carried = self.cur_carried.put(take, moved.pushed(ctx.tab.carry(yu[acc], vu[acc], sa[acc])))
            handed = own[acc] if own is not None else hand_on(ctx, yu[acc], sa[acc], d.predicted[take])
            self.drafted = self.drafted.put(take, drafted.take(acc).pushed(handed))
        self.cur_y[take] = kids[acc, idx[acc]]
        self.cur[take] = ch[acc, idx[acc]]
        self.cur_evaluated[take] = False
        nxt = torch.zeros_like(cur)
        nxt[a] = ch.gather(1, idx[:, None])[:, 0]
        full = lambda t, fill: torch.full_like(cur, fill, dtype=t.dtype).index_put((a,), t)  # noqa: E731
        if prop.observes:
            y_full = torch.zeros_like(self.cur_y).index_put((a,), yu)
            q_full = torch.zeros_like(self.cur_y).index_put((a,), mu_q)
            return Level(
                verified=act, accepted=full(acc, False), next=nxt, delta=full(delta, 0.0), y=y_full, mu_q=q_full
            )
        return Level(verified=act, accepted=full(acc, False), next=nxt, delta=full(delta, 0.0))

    def descend(self) -> Descent:
        """The walks depth by depth, each depth drafted and evaluated as the walks reach it."""
        d, dev = self.d, self.ctx.device
        G = d.ids.numel()
        cur = torch.zeros(G, dtype=torch.long, device=dev)
        alive = torch.ones(G, dtype=torch.bool, device=dev)
        acts, accs, deltas, obs = [], [], [], []
        for level in range(1, d.Lr + 1):
            # a walk goes on while every child so far was accepted, within its lookahead, above a leaf
            lv = self.level(level, cur, alive)
            if lv is None:
                break
            alive = lv.accepted
            # a rejected walk stays at the node whose children it rejected
            cur = torch.where(alive, lv.next, cur)
            acts.append(lv.verified)
            accs.append(alive)
            deltas.append(lv.delta)
            if lv.y is not None:
                obs.append((lv.verified, lv.y, lv.mu_q, level))
        observed = None
        if obs:
            act_o = torch.cat([o[0] for o in obs])
            rows = torch.arange(G, device=dev).repeat(len(obs))[act_o]
            steps = torch.cat([d.s0 + o[3] - 1 for o in obs])[act_o]
            observed = Observed(
                y=torch.cat([o[1] for o in obs])[act_o],
                mu_q=torch.cat([o[2] for o in obs])[act_o],
                steps=steps,
                rows=rows,
            )
        return Descent(
            cur=cur, act=torch.stack(acts, 1), acc=torch.stack(accs, 1), delta=torch.stack(deltas, 1), observed=observed
        )

    def problem(self, rows: torch.Tensor, nodes: torch.Tensor) -> Problem:
        p = {k: t[rows] for k, t in self.prob.items()}
        return Problem(stream=streams.Stream(p.pop("keys"), streams.SLOT_COUPLE), **p)

    def state(self, nodes: torch.Tensor) -> torch.Tensor:
        out = torch.where((nodes == self.par)[:, None], self.par_y, self.cur_y)
        is_kid = nodes[:, None] == self.kid_nodes
        k = is_kid.to(torch.int8).argmax(1)
        kid_y = self.kids[self.rows, k]
        return torch.where((is_kid.any(1) & (nodes != self.cur))[:, None], kid_y, out)

    def velocity(self, nodes: torch.Tensor) -> torch.Tensor:
        """Velocities at ``nodes``: the path's evaluations are known; siblings and the committed leaf are evaluated now."""
        ctx, d = self.ctx, self.d
        known_par = nodes == self.par
        known_cur = (nodes == self.cur) & self.cur_evaluated
        out = torch.where(known_par[:, None], self.par_v, self.cur_v)
        need = (~known_par & ~known_cur).nonzero()[:, 0]
        if need.numel():
            y = self.state(nodes)[need]
            s = (d.s0[need] + d.tt.depth[nodes[need]]).clamp(max=ctx.T - 1)
            out[need] = ctx.tab.velocity(ctx.target, y, s, d.ids[need])
        return out

    def children_states(self, rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        return self.kids[rows]

    def carried(self, nodes: torch.Tensor) -> Carried:
        # as ``state``: the walk's parent's, else its current node's
        return self.cur_carried.where(nodes == self.par, self.par_carried)


def walk(ctx: RunContext, d: Draft, R: Realizer) -> WalkResult:
    """From each root down to the first rejection, the residual there, and the prefetch rule (phase 4)."""
    tt = d.tt
    desc = R.descend()
    cur, act_t, acc_t = desc.cur, desc.act, desc.acc
    rejected = (act_t ^ acc_t).any(1)  # (an accepted child was verified)
    ncom = act_t.sum(1)
    new_x = R.state(cur)
    r = rejected.nonzero()[:, 0]
    if r.numel():
        rej_node = cur[r]  # the parent of the rejected children
        p = R.problem(r, rej_node)
        x_rej = ctx.coupling.rejected_state(p.s_hat, p.delta, p.valid, p.idx, p.stream, p.kids, p.scale, p.e)
        new_x = new_x.index_put((r,), x_rej)

    # -- prefetch: which evaluation the next round drafts from ----------------------------------
    # the node a walk ended at if it was rejected there or it is evaluated, else its parent
    src = torch.where(rejected | tt.eval_at[d.Ls, cur], cur, tt.up[cur])
    if ctx.prefetch == "nearest" and r.numel():
        ch = tt.children[rej_node]
        ok = tt.kid_eval[d.Ls[r], rej_node]
        if ch.shape[1] == 1:
            # one child: the nearest sibling is the rejected child itself, when evaluated
            pick_node = torch.where(ok[:, 0], ch[:, 0], rej_node)
        else:
            dist = (R.children_states(r, rej_node) - x_rej[:, None]).square().sum(-1)
            dist = torch.where(ok, dist, torch.full_like(dist, float("inf")))
            pick, has = dist.argmin(1), ok.any(1)
            pick_node = torch.where(has, ch.gather(1, pick[:, None])[:, 0], rej_node)
        src = src.index_put((r,), pick_node)
    pre_y, pre_v = R.state(src), R.velocity(src)
    pre_step = d.s0 + tt.depth[src]
    carried = d.carried
    if carried.history:
        # the new state's parent: the node whose children were rejected, or the last accepted one's parent
        par = torch.where(rejected, cur, tt.up[cur])
        x0 = ctx.tab.carry(R.state(par), R.velocity(par), (d.s0 + tt.depth[par]).clamp(max=ctx.T - 1))
        carried = R.carried(par).pushed(x0)
    return WalkResult(
        x=new_x,
        committed=ncom,
        pre_y=pre_y,
        pre_v=pre_v,
        pre_step=pre_step,
        act=act_t,
        acc=acc_t,
        delta=desc.delta,
        observed=desc.observed,
        draft_calls=R.draft_calls,
        carried=carried,
    )
