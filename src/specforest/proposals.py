"""Proposals: how drafted states are drawn (paper eq. 7, Appendix C.1).

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
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Optional

import torch

from .registry import Registry
from .sde import StepTables
from .target import outside_inference
from .validation import check_int

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


@dataclass(frozen=True)
class Prefetch:
    """Per-trajectory target evaluation reused by the next round's draft.

    Attributes:
        y: ``(batch, D)`` state at which the target was evaluated.
        v: ``(batch, D)`` the target velocity there.
        step: ``(batch,)`` long step index of that evaluation.
        prev_y, prev_v, prev_step: the evaluation prefetched before it, for
            drafts that extrapolate in time.
        has_prev: ``(batch,)`` bool, True where ``prev_*`` hold a real evaluation.
        valid: ``(batch,)`` bool, True where ``y, v, step`` hold an evaluation.
        mem_x0: ``(batch, W, D)`` the clean-data predictions ``y - sigma v`` of the last
            speculative round's evaluated chain nodes, node ``j`` at step ``mem_s0 + j``, for
            drafts that read the previous round at the same step (:class:`MemoryDraft`);
            ``W = 0`` when the proposal keeps no memory.
        mem_s0: ``(batch,)`` long step of ``mem_x0``'s first node.
        mem_n: ``(batch,)`` long number of valid nodes in ``mem_x0`` (0: no memory).
        mem_y: ``(batch, W, D)`` the states of those nodes, for drafts that also correct for how
            far the drafted state is from the remembered one (:class:`SecantDraft`); ``W = 0``
            unless the proposal :attr:`~Proposal.uses_states`.
        gain_num, gain_den: ``(batch, S)`` per trajectory and step, the running sums
            ``sum <x0' - x0, y' - y>`` and ``sum |y' - y|^2`` over pairs of evaluations that two
            successive rounds made at the same step (``S = 0`` unless the proposal
            :attr:`~Proposal.uses_states`); their ratio is :class:`SecantDraft`'s gain.
        mem_f: ``(batch, W, F)`` the target's deep features at those nodes, kept by the round's
            verification call (``W = F = 0`` unless the proposal :attr:`~Proposal.uses_features`;
            :class:`CachedDraft`).
    """

    y: torch.Tensor
    v: torch.Tensor
    step: torch.Tensor
    prev_y: torch.Tensor
    prev_v: torch.Tensor
    prev_step: torch.Tensor
    has_prev: torch.Tensor
    valid: torch.Tensor
    mem_x0: Optional[torch.Tensor] = None
    mem_s0: Optional[torch.Tensor] = None
    mem_n: Optional[torch.Tensor] = None
    mem_y: Optional[torch.Tensor] = None
    gain_num: Optional[torch.Tensor] = None
    gain_den: Optional[torch.Tensor] = None
    mem_f: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        # no memory given: none kept (W = 0, S = 0)
        batch, D = self.y.shape
        for name in ("mem_x0", "mem_y"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.y.new_zeros(batch, 0, D))
        for name in ("mem_s0", "mem_n"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, torch.zeros_like(self.step))
        for name in ("gain_num", "gain_den"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.y.new_zeros(batch, 0, dtype=torch.float64))
        if self.mem_f is None:
            object.__setattr__(self, "mem_f", self.y.new_zeros(batch, 0, 0))

    @classmethod
    def empty(
        cls,
        batch: int,
        D: int,
        dtype: torch.dtype,
        device: torch.device,
        memory: int = 0,
        states: bool = False,
        steps: int = 0,
        features: int = 0,
    ) -> "Prefetch":
        """No evaluation yet for any of ``batch`` trajectories (room for ``memory`` nodes of memory,
        with ``states`` for their states and the gains of a grid of ``steps`` steps, and for
        ``features`` numbers of deep features a node)."""
        z = torch.zeros(batch, D, dtype=dtype, device=device)
        zi = torch.zeros(batch, dtype=torch.long, device=device)
        zb = torch.zeros(batch, dtype=torch.bool, device=device)
        zm = torch.zeros(batch, memory, D, dtype=dtype, device=device)
        zy = torch.zeros(batch, memory if states else 0, D, dtype=dtype, device=device)
        zg = torch.zeros(batch, steps if states else 0, dtype=torch.float64, device=device)
        zf = torch.zeros(batch, memory if features else 0, features, dtype=dtype, device=device)
        return cls(
            **dict(y=z, v=z, step=zi, prev_y=z, prev_v=z, prev_step=zi, has_prev=zb, valid=zb),
            **dict(mem_x0=zm, mem_s0=zi, mem_n=zi, mem_y=zy, gain_num=zg, gain_den=zg, mem_f=zf),
        )

    def restart(self, rows: torch.Tensor) -> "Prefetch":
        """Rows ``rows`` as :meth:`empty` makes them (no evaluation), the others unchanged."""
        return Prefetch(**{f.name: getattr(self, f.name).index_fill(0, rows, 0) for f in fields(self)})

    def take(self, idx: torch.Tensor, history: bool = True) -> "Prefetch":
        """The rows ``idx`` of every field (of ``y, v, step, valid`` only unless ``history``)."""
        if history:
            return Prefetch(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})
        return replace(
            self,
            y=self.y[idx],
            v=self.v[idx],
            step=self.step[idx],
            valid=self.valid[idx],
            mem_x0=self.mem_x0[idx],
            mem_s0=self.mem_s0[idx],
            mem_n=self.mem_n[idx],
            mem_y=self.mem_y[idx],
            gain_num=self.gain_num[idx],
            gain_den=self.gain_den[idx],
            mem_f=self.mem_f[idx],
        )

    def replaced(self, y: torch.Tensor, v: torch.Tensor, step: torch.Tensor, history: bool = True) -> "Prefetch":
        """Every row replaced by a new evaluation, the old one kept as ``prev`` (``with_rows`` of all rows)."""
        valid = torch.ones_like(self.valid)
        if not history:
            return replace(self, y=y, v=v, step=step, valid=valid)
        return replace(
            self,
            y=y,
            v=v,
            step=step,
            prev_y=self.y,
            prev_v=self.v,
            prev_step=self.step,
            has_prev=self.valid,
            valid=valid,
        )

    def with_rows(
        self,
        idx: torch.Tensor,
        y: torch.Tensor,
        v: torch.Tensor,
        step: torch.Tensor,
        keep_prev: bool,
        history: bool = True,
    ) -> "Prefetch":
        """A new prefetch with rows ``idx`` replaced by an evaluation; the old one becomes ``prev`` if
        ``keep_prev`` (``prev`` is only tracked with ``history``)."""
        put = lambda t, val: t.index_put((idx,), val)  # noqa: E731
        valid = self.valid.index_fill(0, idx, True)
        if not history:
            return replace(self, y=put(self.y, y), v=put(self.v, v), step=put(self.step, step), valid=valid)
        keep = torch.full_like(idx, keep_prev, dtype=torch.bool) & self.valid[idx]
        return replace(
            self,
            y=put(self.y, y),
            v=put(self.v, v),
            step=put(self.step, step),
            prev_y=put(self.prev_y, self.y[idx]),
            prev_v=put(self.prev_v, self.v[idx]),
            prev_step=put(self.prev_step, self.step[idx]),
            has_prev=put(self.has_prev, keep),
            valid=valid,
        )

    def with_memory(
        self,
        idx: Optional[torch.Tensor],
        x0: torch.Tensor,
        s0: torch.Tensor,
        n: torch.Tensor,
        y: Optional[torch.Tensor] = None,
        f: Optional[torch.Tensor] = None,
    ) -> "Prefetch":
        """Rows ``idx`` (every row if ``None``) remember a round's chain: ``x0 (G, W', D)`` clean-data
        predictions of its nodes from step ``s0 (G,)`` on, the first ``n (G,)`` of them valid.

        Where the prefetch keeps states (``mem_y`` not empty), ``y (G, W', D)`` are the nodes'
        states: they are kept too, and every node at a step the remembered chain also evaluated
        adds its pair to the gain sums (``gain_num``, ``gain_den``) before the memory is replaced.
        Where it keeps deep features (``mem_f`` not empty), ``f (G, W', F)`` are the nodes'.
        """
        W = self.mem_x0.shape[1]
        x0 = _fit_width(x0, W)
        n = n.clamp(max=W)
        rows = slice(None) if idx is None else idx
        new = dict(mem_x0=x0, mem_s0=s0, mem_n=n)
        if self.mem_y.shape[1]:
            if y is None:
                raise ValueError("this prefetch keeps the remembered states: with_memory needs y")
            y = _fit_width(y, W)
            old = (self.mem_x0[rows], self.mem_y[rows], self.mem_s0[rows], self.mem_n[rows])
            at, num, den = _secant_pairs(x0, y, s0, n, *old, self.gain_num.shape[1])
            new.update(
                mem_y=y,
                gain_num=self.gain_num[rows].scatter_add(1, at, num),
                gain_den=self.gain_den[rows].scatter_add(1, at, den),
            )
        if self.mem_f.shape[1]:
            if f is None:
                raise ValueError("this prefetch keeps the nodes' deep features: with_memory needs f")
            new.update(mem_f=_fit_width(f.to(self.mem_f.dtype), W))
        if idx is None:
            return replace(self, **new)
        return replace(self, **{k: getattr(self, k).index_put((idx,), v) for k, v in new.items()})


def _fit_width(t: torch.Tensor, W: int) -> torch.Tensor:
    """``t (G, W', D)`` cut or zero-padded to ``(G, W, D)``."""
    if t.shape[1] < W:
        t = torch.cat([t, t.new_zeros(t.shape[0], W - t.shape[1], t.shape[2])], 1)
    return t[:, :W]


def _secant_pairs(
    x0: torch.Tensor,
    y: torch.Tensor,
    s0: torch.Tensor,
    n: torch.Tensor,
    old_x0: torch.Tensor,
    old_y: torch.Tensor,
    old_s0: torch.Tensor,
    old_n: torch.Tensor,
    S: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gain-sum increments of a new chain memory ``x0, y (G, W, D)`` (from step ``s0``, ``n``
    valid) against the one it replaces (``old_*``), on a grid of ``S`` steps.

    New node ``j < n`` (step ``s0 + j``) pairs with old node ``t = s0 + j - old_s0`` when
    ``0 <= t < old_n``: the two rounds' evaluations at one step. Returns ``(at, num, den)``, each
    ``(G, W)``: the long step of each node (clamped into the grid) and the float64 increments
    ``<dx0, dy>`` and ``|dy|^2`` (zero where a node has no pair), ready for ``scatter_add``.
    """
    W = x0.shape[1]
    j = torch.arange(W, device=x0.device)
    step = s0[:, None] + j  # (G, W)
    t = step - old_s0[:, None]
    ok = (j < n[:, None]) & (t >= 0) & (t < old_n[:, None])
    at = t.clamp(0, max(old_x0.shape[1] - 1, 0))[..., None].expand_as(x0)
    dx = (x0 - old_x0.gather(1, at)).double()
    dy = (y - old_y.gather(1, at)).double()
    zero = torch.zeros((), dtype=torch.float64, device=x0.device)
    num = torch.where(ok, (dx * dy).sum(-1), zero)
    den = torch.where(ok, (dy * dy).sum(-1), zero)
    return step.clamp(max=S - 1), num, den


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


def _frozen_coefficients(kind: str, tab: StepTables, steps: torch.Tensor, pre: Prefetch):
    """``(A (G, n, 1), C (G, n, D))`` of one frozen parameterization (see :class:`FrozenPrediction`)."""
    ac = tab.ac[steps]  # (G, n, 2)
    a, c = ac[..., :1], ac[..., 1:]
    ys, vs = pre.y[:, None], pre.v[:, None]
    if kind == "velocity":
        return a, c * vs
    if kind == "drift":
        ps = pre.step[:, None]
        b = -tab.drift_f[ps][..., None] * vs - tab.drift_k[ps][..., None] * ys
        return torch.ones_like(a), tab.gamma[steps][..., None] * b
    sig = tab.sig[steps][..., None]
    sig_src = tab.sig[pre.step][:, None, None]
    if kind in ("x0", "x0_extrap"):
        x0 = ys - sig_src * vs
        if kind == "x0_extrap":
            sig_prev = tab.sig[pre.prev_step][:, None, None]
            x0_prev = pre.prev_y[:, None] - sig_prev * pre.prev_v[:, None]
            gap = sig_src - sig_prev
            ok = pre.has_prev[:, None, None] & (gap.abs() > 1e-12)
            slope = torch.where(ok, (x0 - x0_prev) / torch.where(ok, gap, torch.ones_like(gap)), torch.zeros_like(x0))
            x0 = x0 + (sig - sig_src) * slope
        # v = (y - x0) / sig
        k = c / sig
        return a + k, -k * x0
    # eps: v = (xi - y) / (1 - sig), xi = y* + (1 - sig*) v*
    xi = ys + (1.0 - sig_src) * vs
    k = c / (1.0 - sig)
    return a - k, k * xi


class FrozenPrediction(Proposal):
    """Delayed drift: freeze one target prediction and recompute the rest.

    With ``(y*, sigma*, v*)`` the prefetched evaluation and ``(y, sigma)`` the
    drafted parent, the draft velocity is, per ``kind``:

    * ``velocity``: ``v*`` (the paper's protocol, Sec. 5 and the authors' code);
    * ``drift``: the whole reverse drift ``b(y*)`` of eq. (35) (Appendix C.1),
      so ``m^p(y) = y + gamma b(y*)``;
    * ``x0``: the clean-data prediction ``x0* = y* - sigma* v*``, so
      ``v = (y - x0*) / sigma``;
    * ``eps``: the noise prediction ``xi* = y* + (1 - sigma*) v*``, so
      ``v = (xi* - y) / (1 - sigma)``;
    * ``x0_extrap``: the clean-data prediction extrapolated linearly in the noise
      level from the last two prefetched evaluations,
      ``x0(sigma) = x0* + (sigma - sigma*) (x0* - x0_prev) / (sigma* - sigma_prev)``
      (plain ``x0`` where there is no earlier evaluation).

    Each is affine in the parent ``y`` (:meth:`coefficients`).

    Args:
        kind: one of :data:`FROZEN_KINDS`.
    """

    affine = True

    def __init__(self, kind: str = "velocity") -> None:
        if kind not in FROZEN_KINDS:
            raise ValueError(f"draft must be one of {available_drafts()} or a callable, got {kind!r}")
        self.kind = kind
        self.name = kind
        self.uses_history = kind == "x0_extrap"

    def coefficients(self, tab, steps, pre, state, terms=None):
        if pre is None:
            raise ValueError("a frozen-prediction draft needs a prefetched evaluation")
        return _frozen_coefficients(self.kind, tab, steps, pre)

    def __repr__(self) -> str:
        return f"FrozenPrediction(kind={self.kind!r})"


class PicardDraft(FrozenPrediction):
    """Picard-refined chains (``draft="picard"``, ``J = 1``; ``"picard2"``, ``J = 2``): the ``x0``
    kind's chain refined by ``J`` sweeps, each one batched target call at the chain's parents.

    What it reads: the prefetched evaluation (the ``x0`` kind's, for the chain before any sweep),
    then, sweep by sweep, the target's evaluations at the parents of the chain the last sweep
    drafted, all before the round's verification call. Sweep ``j`` redrafts the chain from its
    root with the same noise, node ``l + 1`` from node ``l`` of sweep ``j`` with the target's
    clean-data prediction at node ``l`` of sweep ``j - 1`` (``specforest.drafting._picard``). So
    the first node's draft is the target's own transition after one sweep, the first two after
    two, and so on: the fixed-point iteration of ParaDiGMS over one round's chain, the refinement
    in the authors' public code. A node's draft never reads its own draw, so the sampler stays
    exact.

    Every sweep is a sequential target call of ``Lr`` rows a trajectory, counted in the NFE
    (``J = 0`` is the ``x0`` kind: its baseline). On a tree whose first level branches it
    drafts as the ``x0`` kind (no sweep). A run with sweeps evaluates every parent of its
    chains, so it goes full even when ``lazy`` is asked.

    Args:
        sweeps: ``J >= 0``.

    Raises:
        ValueError: if ``sweeps`` is not an int ``>= 0``, naming the draft.
    """

    def __init__(self, sweeps: int = 1) -> None:
        super().__init__("x0")
        if isinstance(sweeps, bool) or not isinstance(sweeps, int) or sweeps < 0:
            raise ValueError(f"draft='picard': the sweeps J must be an int >= 0, got {sweeps!r}")
        self.picard_sweeps = sweeps
        self.name = "picard" if sweeps == 1 else f"picard{sweeps}"

    def __repr__(self) -> str:
        return f"PicardDraft(sweeps={self.picard_sweeps})"


class MemoryDraft(Proposal):
    """Time-aligned memory (``draft="memory"``): a parent at step ``s`` is drafted from the target's
    clean-data prediction at step ``s`` made by the previous round's verification call.

    What it reads, all made before the round's verification call:

    * ``Prefetch.mem_x0``: ``x0_j = y_j - sigma_j v_j`` at the previous speculative round's
      evaluated chain nodes ``j`` (steps ``mem_s0 + j``, ``j < mem_n``);
    * the prefetched evaluation ``(y*, v*, step*)``, as the ``x0`` kind does.

    Rule: at a parent of step ``s``, with ``j = min(s - mem_s0, mem_n - 1)``, the draft velocity is
    ``v = (y - x0_j) / sigma_s`` when ``s >= mem_s0`` and node ``j`` is not older than the
    prefetch (``mem_s0 + j >= step*``), else the ``x0`` kind's ``(y - x0*) / sigma_s``. Past the
    previous round's chain it freezes its last node's prediction, the latest the run has.

    With :attr:`aligned_noise`, a chain redrafts the steps the previous round evaluated but did
    not accept with the noise they had then (those draws made no decision: the walk stopped
    before them), so the redrafted nodes lie near the evaluated ones and the memory's error is
    the prediction's change over that small distance, not over a whole step's noise. The draft
    is exact for any memory: it only moves the acceptance. Memory is kept for chain trees (one
    node a depth); on a wider tree the rule falls back to the ``x0`` kind.
    """

    affine = True
    uses_memory = True
    aligned_noise = True
    name = "memory"

    def coefficients(self, tab, steps, pre, state, terms=None):
        if pre is None:
            raise ValueError("the memory draft needs a prefetched evaluation")
        ac = tab.ac[steps]  # (G, n, 2)
        a, c = ac[..., :1], ac[..., 1:]
        k = c / tab.sig[steps][..., None]
        x0 = (pre.y - tab.sig[pre.step][:, None] * pre.v)[:, None]  # (G, 1, D)
        mem, use = _memory_at(steps, pre)
        if mem is not None:
            x0 = torch.where(use[..., None], mem, x0)
        return a + k, -k * x0

    def __repr__(self) -> str:
        return "MemoryDraft()"


class SecantDraft(MemoryDraft):
    """Local linear memory (``draft="secant"``): :class:`MemoryDraft`'s remembered prediction
    moved to the drafted state by a secant (Broyden-style) gain fitted from the run's own pairs.

    What it reads, all made before the round's verification call:

    * what :class:`MemoryDraft` reads, and the remembered nodes' states ``Prefetch.mem_y``;
    * the trajectory's gain sums ``Prefetch.gain_num``, ``Prefetch.gain_den`` at each step: each
      time a chain round evaluates a step the previous round evaluated too, the two evaluations
      ``(y, x0)`` and ``(y', x0')`` add ``<x0' - x0, y' - y>`` and ``|y' - y|^2`` (the engine does
      it when it stores the new memory, :meth:`Prefetch.with_memory`).

    Rule: at a parent ``y`` of step ``s`` that reads memory node ``j`` at the same step (``s =
    mem_s0 + j``, ``j < mem_n``), the clean-data prediction is ``x0_j + g_s (y - y_j)`` with the
    least-squares scalar gain ``g_s = gain_num / gain_den`` of the trajectory's own pairs at
    ``s``, or at the nearest earlier step that has pairs (``g = 0``, which is :class:`MemoryDraft`,
    before any). Everywhere else it is :class:`MemoryDraft`. ``g_s`` estimates how the target's
    prediction moves with the state near the trajectory (a scalar multiple of the identity for
    the Jacobian ``d x0 / d y``); the mean stays affine in ``y``: ``A = a + (c / sigma)(1 - g)``,
    ``C = -(c / sigma)(x0_j - g y_j)``.

    Each trajectory fits its own gain from its own evaluations, so a sample does not depend on
    its batch companions. The draft is exact for any gain: it only moves the acceptance. It
    keeps twice :class:`MemoryDraft`'s remembered states (the nodes' states as well) and two
    numbers per trajectory and step.
    """

    uses_states = True
    name = "secant"

    def coefficients(self, tab, steps, pre, state, terms=None):
        if pre is None:
            raise ValueError("the secant draft needs a prefetched evaluation")
        A, C = super().coefficients(tab, steps, pre, state)
        if not pre.mem_y.shape[1]:
            return A, C
        # the memory draft's mean plus (c / sigma) g (y_j - y)
        g, ym = _secant_at(steps, pre)
        kg = tab.ac[steps][..., 1:] / tab.sig[steps][..., None] * g.to(C.dtype)[..., None]
        return A - kg, torch.addcmul(C, kg, ym)

    def __repr__(self) -> str:
        return "SecantDraft()"


class DraftModel(Proposal):
    """An independent draft model ``v_draft(x, sigma, **cond)`` with the target's signature.

    It is evaluated once per drafted parent (its calls are counted apart from
    the target's NFE) and receives the same per-trajectory conditioning as the
    target, indexed per row; no prefetching is needed.

    Args:
        fn: callable ``(x: (M, *shape), sigma: (M,), **cond) -> (M, *shape)`` velocity.
    """

    needs_prefetch = False
    name = "model"

    def __init__(self, fn: VelocityFn) -> None:
        if not callable(fn):
            raise TypeError("draft model must be callable as fn(x, sigma)")
        self.fn = fn

    def mean(self, tab, y, steps, pre, cond, shape, state):
        G, n, D = y.shape
        sig = tab.sig[steps].reshape(-1)
        # trajectory-major rows: row b * n + i belongs to trajectory b
        kw = {k: v.repeat_interleave(n, dim=0) for k, v in cond.items()}
        with outside_inference():
            v = self.fn(y.reshape(G * n, *shape), sig, **kw)
        if not isinstance(v, torch.Tensor) or v.numel() != y.numel():
            raise ValueError(f"the draft model must return a tensor of shape {(G * n, *shape)}")
        v = v.reshape(G, n, D).to(y.dtype)
        bad = ~torch.isfinite(v).all(-1)
        if bad.any():
            at = sorted(set(steps[bad].tolist()))
            raise FloatingPointError(
                f"the draft model returned NaN or inf at step {at[0]} (steps {at}); refusing to continue"
            )
        return tab.mean(y, v, steps)

    def __repr__(self) -> str:
        return f"DraftModel({self.fn!r})"


class LearnedDraft(DraftModel):
    """A draft network anchored at the run's own evaluations (``draft="learned"`` with the digits
    model's distilled U-Net, :func:`specforest.models.digits.load_draft_velocity`).

    What it reads, all made before the round's verification call:

    * the draft network ``f`` (a velocity with the target's signature), called at the drafted
      parents and at their anchors: one batched call per drafted level (counted in
      ``draft_calls``, never in the target's NFE);
    * the anchor of each parent: the remembered chain node at the parent's own step
      (``Prefetch.mem_y``, ``Prefetch.mem_x0``: the previous round's evaluation there, as
      :class:`SecantDraft` reads it), else the prefetched evaluation ``(y*, v*, step*)``.

    Rule: with the anchor's state ``y_a`` at noise level ``sigma_a`` and the target's clean-data
    prediction there ``x0_a``, the draft's prediction at a parent ``y`` of level ``sigma`` is
    ``x0_a + f_x0(y, sigma) - f_x0(y_a, sigma_a)`` (``f_x0 = y - sigma f``): the network supplies
    how the prediction moves from the anchor, the target the level. So the draft is the
    ``x0`` kind anchored at the prefetch when ``f``'s own clean-data prediction ``f_x0`` is
    constant (``f = y / sigma``, say), and the target itself when ``f`` is; at a same-step
    memory anchor its error is ``(J - J_f)(y - y_a)`` to first order (the Jacobians of the
    target's and the network's predictions), which :class:`SecantDraft` approximates with a
    scalar gain. Chains draw their noise by step (:attr:`aligned_noise`), so ``y - y_a`` is small.

    The draft is exact for any network: it only moves the acceptance. A network whose output
    is NaN or inf makes a non-finite mismatch, which stops the run with the step and the draft
    named (the sampler's check, no extra synchronization).

    Args:
        fn: the draft velocity ``(x: (M, *shape), sigma: (M,), **cond) -> (M, *shape)``, or a
            callable of no arguments returning it (loaded at the first call).
        shape: the per-sample state shape the network serves (``None``: any); a run of another
            shape is refused before sampling (:meth:`check`).
        label: how errors name the network.
    """

    needs_prefetch = True
    uses_memory = True
    uses_states = True
    aligned_noise = True
    name = "learned"

    def __init__(
        self,
        fn: "VelocityFn | Callable[[], VelocityFn]",
        *,
        shape: Optional[tuple[int, ...]] = None,
        label: str = "the draft network",
        lazy_load: bool = False,
    ) -> None:
        super().__init__(fn)
        self._load = fn if lazy_load else None
        self.serves = None if shape is None else tuple(int(n) for n in shape)
        self.label = label

    @classmethod
    def digits(cls) -> "LearnedDraft":
        """The digits model's learned draft (the shipped weights, loaded at the first call)."""

        def load() -> VelocityFn:
            from .models.digits import load_draft_velocity

            return load_draft_velocity()

        from .models.digits import IMAGE_SHAPE

        return cls(load, shape=IMAGE_SHAPE, label="the digits model's distilled U-Net", lazy_load=True)

    def check(self, shape: tuple[int, ...], dtype: torch.dtype, model: Any = None) -> None:
        if self.serves is not None and tuple(shape) != self.serves:
            raise ValueError(
                f"draft={self.name!r} is {self.label}: it serves states of shape {self.serves}, got {tuple(shape)}"
            )

    def mean(self, tab, y, steps, pre, cond, shape, state):
        if pre is None:
            raise ValueError(f"draft={self.name!r} needs a prefetched evaluation")
        if self._load is not None:
            self.fn, self._load = self._load(), None
        G, n, D = y.shape
        sig = tab.sig[steps]  # (G, n)
        sig_p = tab.sig[pre.step]  # (G,)
        ya = pre.y[:, None].expand(G, n, D)
        xa = (pre.y - sig_p[:, None] * pre.v)[:, None].expand(G, n, D)
        sa = sig_p[:, None].expand(G, n)
        if pre.mem_y.shape[1]:
            same, j = _same_step(steps, pre)
            ya = torch.where(same[..., None], pre.mem_y.gather(1, j), ya)
            xa = torch.where(same[..., None], pre.mem_x0.gather(1, j), xa)
            sa = torch.where(same, sig, sa)
        # one call: the parents' rows, then their anchors' (trajectory-major within each half)
        kw = {k: v.repeat_interleave(n, dim=0).repeat(2, *(1,) * (v.ndim - 1)) for k, v in cond.items()}
        X = torch.cat([y.reshape(G * n, D), ya.reshape(G * n, D)])
        S = torch.cat([sig.reshape(-1), sa.reshape(-1)])
        with outside_inference():
            f = self.fn(X.reshape(2 * G * n, *shape), S, **kw)
        if not isinstance(f, torch.Tensor) or f.numel() != X.numel():
            raise ValueError(f"draft={self.name!r}: {self.label} must return a tensor of shape {(2 * G * n, *shape)}")
        f = f.reshape(2, G, n, D).to(y.dtype)
        # v = (y - x0_a - f_x0(y) + f_x0(y_a)) / sigma = f(y) + (f_x0(y_a) - x0_a) / sigma
        v = f[0] + (ya - sa[..., None] * f[1] - xa) / sig[..., None]
        return tab.mean(y, v, steps)

    def __repr__(self) -> str:
        return f"LearnedDraft({self.label})"


class CachedDraft(Proposal):
    """The cached self-draft (``draft="cached"``, DeepCache-style): the target network itself with
    its deep features reused from an evaluation of the previous round, only its outer blocks
    recomputed at the drafted state and level.

    What it reads, all made before the round's verification call:

    * ``Prefetch.mem_f``: the target's deep features at the previous speculative round's evaluated
      chain nodes, kept by that round's verification call (the model's ``with_features``; the
      engine asks for them only for this draft), and those nodes' steps (``mem_s0``, ``mem_n``);
    * the prefetched evaluation ``(y*, v*, step*)``, as the ``x0`` kind does, where no node is
      remembered.

    Rule: a parent at step ``s`` reads node ``j`` as :class:`MemoryDraft` does (the remembered node
    at its own step, else the chain's last one past it, never one older than the prefetch), and
    its draft velocity is the model's cheap evaluation ``from_features(y, sigma_s, f_j)``: the
    embedding, the outer encoder and decoder blocks at the parent, the deeper blocks node ``j``'s.
    At node ``j``'s own state and level that is the target's velocity exactly; where no node is
    remembered (the first round after a fetch, a tree whose first level branches) it is the
    ``x0`` kind. Chains draw their noise by step (:attr:`aligned_noise`), so a redrafted parent
    lies near the node whose features it reuses.

    One batched call of the outer blocks a drafted level (``G n`` rows, counted in
    ``draft_calls``, its time the draft phase's), never the target's NFE. The draft is exact for
    any features: it only moves the acceptance. A model without the protocol
    (``feature_numel``, ``with_features``, ``from_features``:
    :class:`~specforest.models.edm.EDMDenoiserVelocity` around a denoiser with ``deep`` and
    ``shallow``, as the digits model's) is refused before sampling (:meth:`check`).
    """

    uses_memory = True
    aligned_noise = True
    uses_features = True
    name = "cached"

    def __init__(self) -> None:
        self.model: Any = None
        self.model_kwargs: dict = {}
        self._counted: tuple = ()  # (model, shape, feature numbers) of the last count

    def _features_of(self, model: Any, shape: tuple[int, ...]) -> int:
        """The model's feature numbers a row (0 without the protocol), counted once per model and
        shape: ``feature_numel`` may run the network (``check`` and ``bind`` both ask)."""
        shape = tuple(shape)
        if self._counted and self._counted[0] is model and self._counted[1] == shape:
            return self._counted[2]
        have = all(callable(getattr(model, k, None)) for k in ("feature_numel", "with_features", "from_features"))
        F = int(model.feature_numel(shape)) if have else 0
        self._counted = (model, shape, F)
        return F

    def check(self, shape, dtype, model=None):
        if model is not None and self._features_of(model, shape) <= 0:
            raise ValueError(
                f"draft={self.name!r} reuses the target's deep features: the model must keep them "
                f"(feature_numel > 0, with_features, from_features; the digits model does), "
                f"{type(model).__name__} does not"
            )

    def bind(self, model, shape, model_kwargs=None):
        self.model, self.model_kwargs = model, dict(model_kwargs or {})
        return self._features_of(model, shape)

    def mean(self, tab, y, steps, pre, cond, shape, state):
        if pre is None:
            raise ValueError(f"draft={self.name!r} needs a prefetched evaluation")
        G, n, D = y.shape
        sig = tab.sig[steps]  # (G, n)
        x0 = (pre.y - tab.sig[pre.step][:, None] * pre.v)[:, None]  # (G, 1, D)
        v = (y - x0) / sig[..., None]
        F = pre.mem_f.shape[2] if pre.mem_f.shape[1] else 0
        if F:
            if self.model is None:
                raise ValueError(f"draft={self.name!r} was not bound to the run's model")
            j, use = _memory_node(steps, pre)
            feat = pre.mem_f.gather(1, j[..., None].expand(-1, -1, F))
            kw = {k: t.repeat_interleave(n, dim=0) for k, t in cond.items()}
            with outside_inference():
                vc = self.model.from_features(
                    y.reshape(G * n, *shape), sig.reshape(-1), feat.reshape(G * n, F), **self.model_kwargs, **kw
                )
            if not isinstance(vc, torch.Tensor) or vc.numel() != y.numel():
                raise ValueError(f"draft={self.name!r}: from_features must return a tensor of shape {(G * n, *shape)}")
            v = torch.where(use[..., None], vc.reshape(G, n, D).to(y.dtype), v)
        return tab.mean(y, v, steps)

    def __repr__(self) -> str:
        return "CachedDraft()"


class AutoDraft(Proposal):
    """The draft chosen online among :data:`AUTO_KINDS` (``draft="auto"``).

    After every verification the sampler reports the exact target mean; for each
    kind in :data:`AUTO_KINDS` (the frozen kinds, ``memory`` and ``secant``) the draft mean that
    kind *would* have used is a deterministic function of the same parent, prefetch
    and memory, so the mismatch ``delta_kind = |m_q - m_p^kind| / sigma`` of every
    kind is observed at once. Rule: for a parent ``k`` steps after its prefetched
    evaluation (the draft offset) in stretch ``j`` of the grid (step ``s`` of ``T`` is in
    stretch ``floor(s stretches / T)``), use the kind with the smallest running mean of
    ``delta`` at that offset in that stretch over the rounds so far, once the pair has
    ``min_count`` observations; before that, the kind of smallest mean at that offset over
    the whole grid (an unseen offset takes the choice of the nearest smaller seen one;
    ``velocity`` before anything is seen). The state is the running sums ``(stretches,
    offsets, kinds)`` and counts; a round drafts with the state it started with, so the sampler
    stays exact. It keeps the memory of :class:`SecantDraft` (the remembered predictions, their
    states and the gain sums) and its step-aligned chain noise, so a chain run evaluates every
    node (``lazy`` runs as full).

    The drafts that cost compute (``learned``, ``cached``, the Picard chains) are not among the
    kinds: their mean at a verified parent is not known without calls of their own. Which of
    them pays, against ``auto`` and the rest, in seconds, is what ``specforest tune`` measures.

    Args:
        max_offset: the largest draft offset told apart (larger ones share its statistics).
        stretches: equal parts of the grid told apart (``1``: the draft offset only). With the
            default, 2, the mixture's RMC chain of B = 14 makes 8% more T/NFE than with 1 and its
            rank (5, 3) tree 1%, digits the same within a standard error; 4 and 8 are no better
            (section ``auto_stretches`` of ``benchmarks/RESULTS.md``).
        min_count: observations a (stretch, offset) pair needs before its own statistics decide.
    """

    affine = True
    observes = True
    uses_history = True
    uses_memory = True
    uses_states = True
    aligned_noise = True
    name = "auto"

    def __init__(self, max_offset: int = 64, stretches: int = 2, min_count: int = 16) -> None:
        self.max_offset = check_int("max_offset", max_offset, 0)
        self.stretches = check_int("stretches", stretches, 1)
        self.min_count = check_int("min_count", min_count, 1)

    def init_state(self, device):
        n = self.max_offset + 1
        return (
            torch.zeros(self.stretches, n, len(AUTO_KINDS), dtype=torch.float64, device=device),
            torch.zeros(self.stretches, n, dtype=torch.float64, device=device),
        )

    @staticmethod
    def choice(state, min_count: int = 16) -> torch.Tensor:
        """``(stretches, max_offset + 1)`` index into :data:`AUTO_KINDS` used at each stretch and
        offset, from a state ``(total (stretches, offsets, kinds), count (stretches, offsets))``.

        A pair with fewer than ``min_count`` observations takes the choice at its offset over
        every stretch; an offset never observed takes the choice of the nearest smaller observed
        offset (``velocity`` when there is none).
        """
        total, count = state
        all_total, all_count = total.sum(0), count.sum(0)
        pick = (all_total / all_count.clamp_min(1.0)[:, None]).argmin(1)
        ar = torch.arange(all_count.numel(), device=count.device)
        last_seen = torch.cummax(torch.where(all_count > 0, ar, -1), 0).values
        pooled = torch.where(last_seen >= 0, pick[last_seen.clamp(min=0)], 0)
        own = (total / count.clamp_min(1.0)[..., None]).argmin(-1)
        return torch.where(count >= min_count, own, pooled[None])

    def _cell(self, tab, steps: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """The flat (stretch, offset) index of parents at ``steps`` with draft ``offset``."""
        S = self.stretches
        if S == 1:
            return offset
        stretch = (steps * S).div(tab.a.numel(), rounding_mode="floor").clamp(0, S - 1)
        return stretch * (self.max_offset + 1) + offset

    @staticmethod
    def _all_kinds(tab, steps, pre):
        """Every kind's mean as ``A y + alpha y* + beta v* + eps x0_prev + mu x0_mem + nu y_mem``.

        Returns ``coef (6, 7, G, n)``: ``A, alpha, beta, eps, mu, nu`` of the seven kinds (in
        :data:`AUTO_KINDS` order) at each parent, and the vectors ``y* (G, D)``, ``v* (G, D)``,
        ``x0_prev (G, D)``, ``x0_mem (G, n, D)`` (the memory node each parent would read) and
        ``y_mem (G, n, D)`` (its state), the last two ``None`` when the run keeps no memory. The
        same affine maps as :class:`FrozenPrediction`'s, :class:`MemoryDraft`'s and
        :class:`SecantDraft`'s, written so that the kinds cost a few scalar ops and five vector
        ones, not seven vector computations (``velocity`` is bit-identical to its own; the
        others agree to rounding). What depends on one step only is tabulated once per run
        (:func:`_kind_tables`).
        """
        by_step, by_src = _kind_tables(tab)
        at = by_step[steps].unbind(-1)
        c, sig, neg_g, k0, ke, neg_k0 = at[5:]
        sig_src, f, k, one_minus_src = by_src[pre.step][:, None].unbind(-1)
        sig_prev = tab.sig[pre.prev_step][:, None]
        gap = sig_src - sig_prev
        ok = pre.has_prev[:, None] & (gap.abs() > 1e-12)
        r = torch.where(ok, (sig - sig_src) / torch.where(ok, gap, torch.ones_like(gap)), torch.zeros_like(gap))
        k0r = k0 * (1.0 + r)
        zero = torch.zeros_like(c)
        x0_mem, use = _memory_at(steps, pre)
        # the memory kind: mu x0_mem where it reads a node, the x0 kind (times keep = 1) where not
        reads = zero if use is None else use.to(c.dtype)
        keep = 1.0 - reads
        x0_beta = k0 * sig_src
        # the secant kind: the memory kind plus k0 g (y_mem - y), g = 0 where it reads no node
        # at the parent's own step
        y_mem, kg = None, zero
        if x0_mem is not None and pre.mem_y.shape[1]:
            g, y_mem = _secant_at(steps, pre)
            kg = k0 * g.to(c.dtype)
        # A, alpha, beta, eps, mu, nu of velocity, drift, x0, eps, x0_extrap, memory, secant
        coef = torch.stack(
            [
                *at[:5],
                *(at[2], at[2] - kg),
                *(zero, neg_g * k, neg_k0, ke, -k0r, neg_k0 * keep, neg_k0 * keep),
                *(c, neg_g * f, x0_beta, ke * one_minus_src, k0r * sig_src, x0_beta * keep, x0_beta * keep),
                *(zero, zero, zero, zero, k0 * r, zero, zero),
                *(zero, zero, zero, zero, zero, neg_k0 * reads, neg_k0 * reads),
                *(zero, zero, zero, zero, zero, zero, kg),
            ]
        ).view(6, 7, *c.shape)
        x0_prev = pre.prev_y - sig_prev * pre.prev_v
        return coef, (pre.y, pre.v, x0_prev, x0_mem, y_mem)

    def round_terms(self, tab, steps, pre):
        return self._all_kinds(tab, steps, pre)

    def take_terms(self, terms, rows, cols):
        coef, (ys, vs, x0p, x0m, ym) = terms
        at = lambda t: None if t is None else t[rows, cols]  # noqa: E731
        return coef[:, :, rows, cols], (ys[rows], vs[rows], x0p[rows], at(x0m), at(ym))

    def coefficients(self, tab, steps, pre, state, terms=None):
        coef, (ys, vs, x0p, x0m, ym) = self._all_kinds(tab, steps, pre) if terms is None else terms
        offset = (steps - pre.step[:, None]).clamp(0, self.max_offset)
        pick = self.choice(state, self.min_count).reshape(-1)[self._cell(tab, steps, offset)]  # (G, n)
        A, alpha, beta, eps, mu, nu = coef.gather(1, pick.expand(6, 1, *pick.shape))[:, 0, ..., None].unbind(0)
        C = torch.addcmul(torch.addcmul(alpha * ys[:, None], beta, vs[:, None]), eps, x0p[:, None])
        if x0m is not None:
            C = torch.addcmul(C, mu, x0m)
        if ym is not None:
            C = torch.addcmul(C, nu, ym)
        return A, C

    def observe(self, state, tab, y, mu_q, steps, pre, scale, terms=None):
        total, count = state
        if terms is None:
            coef, (ys, vs, x0p, x0m, ym) = self._all_kinds(tab, steps[:, None], pre)  # (6, 7, P, 1)
            x0m = None if x0m is None else x0m[:, 0]
            ym = None if ym is None else ym[:, 0]
        else:
            coef, (ys, vs, x0p, x0m, ym) = terms
            coef = coef[..., None]
        A, alpha, beta, eps, mu, nu = coef.unbind(0)  # (7, P, 1) each
        m = torch.addcmul(torch.addcmul(torch.addcmul(alpha * ys, beta, vs), eps, x0p), A, y)  # (7, P, D)
        if x0m is not None:
            m = torch.addcmul(m, mu, x0m)
        if ym is not None:
            m = torch.addcmul(m, nu, ym)
        d = torch.linalg.vector_norm((mu_q[None] - m).double(), dim=-1) / scale.double()  # (7, P)
        offset = (steps - pre.step).clamp(0, self.max_offset)
        cell = self._cell(tab, steps, offset)
        k = total.shape[-1]
        flat_total = total.reshape(-1, k).index_add(0, cell, d.T)
        flat_count = count.reshape(-1).index_add(0, cell, torch.ones_like(d[0]))
        return (flat_total.view(total.shape), flat_count.view(count.shape))

    def __repr__(self) -> str:
        return f"AutoDraft(stretches={self.stretches})"


def _memory_at(steps: torch.Tensor, pre: Prefetch) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The memory node a parent at ``steps (G, n)`` reads (:class:`MemoryDraft`'s rule):
    ``x0_mem (G, n, D)`` and ``use (G, n)`` bool (False: fall back to the prefetch's ``x0``);
    ``(None, None)`` when the run keeps no memory."""
    if not pre.mem_x0.shape[1]:
        return None, None
    j, use = _memory_node(steps, pre)
    return pre.mem_x0.gather(1, j[..., None].expand(-1, -1, pre.mem_x0.shape[2])), use


def _memory_node(steps: torch.Tensor, pre: Prefetch) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`MemoryDraft`'s node index ``j (G, n)`` long for parents of ``steps (G, n)``: the
    remembered node at the parent's step, or the last one past the remembered chain; and ``use
    (G, n)`` bool, False where there is none not older than the prefetch."""
    n, s0 = pre.mem_n[:, None], pre.mem_s0[:, None]
    t = steps - s0
    j = torch.minimum(t, n - 1).clamp(min=0)
    return j, (n > 0) & (t >= 0) & (s0 + j >= pre.step[:, None])


def _same_step(steps: torch.Tensor, pre: Prefetch) -> tuple[torch.Tensor, torch.Tensor]:
    """Where parents of ``steps (G, n)`` have a remembered node at their own step (not older than
    the prefetch), for the drafts that read the remembered states (:attr:`Proposal.uses_states`):
    ``same (G, n)`` bool and the node's index ``(G, n, D)`` into ``Prefetch.mem_y`` / ``mem_x0``
    for ``gather`` along dim 1 (meaningless where ``same`` is False)."""
    n, s0 = pre.mem_n[:, None], pre.mem_s0[:, None]
    t = steps - s0
    same = (n > 0) & (t >= 0) & (t < n) & (steps >= pre.step[:, None])
    return same, t.clamp(0, pre.mem_y.shape[1] - 1)[..., None].expand(-1, -1, pre.mem_y.shape[2])


def _secant_at(steps: torch.Tensor, pre: Prefetch) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`SecantDraft`'s gain ``g (G, n)`` float64 and remembered state ``y_j (G, n, D)`` at
    parents of ``steps (G, n)``: ``g`` is 0 where the parent does not read a memory node at its
    own step or the trajectory has no pair at or before it."""
    same, j = _same_step(steps, pre)
    ym = pre.mem_y.gather(1, j)
    num, den = pre.gain_num, pre.gain_den  # (G, S)
    S = num.shape[1]
    has = den > 0
    ratio = torch.where(has, num / torch.where(has, den, torch.ones_like(den)), torch.zeros_like(den))
    # the nearest step at or before each one that has pairs (-1: none)
    ar = torch.arange(S, device=num.device)
    last = torch.cummax(torch.where(has, ar, -1), 1).values
    filled = torch.where(last >= 0, ratio.gather(1, last.clamp(min=0)), torch.zeros_like(ratio))
    g = filled.gather(1, steps.clamp(0, S - 1))
    return torch.where(same, g, torch.zeros_like(g)), ym


def _kind_tables(tab: StepTables) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`AutoDraft._all_kinds`' per-step scalars, made once per table set (kept on it).

    Returns ``by_step (T, 11)``: the five kinds' ``A`` then ``c, sig, -gamma, c / sig,
    c / (1 - sig), -c / sig`` at each parent step; ``by_src (T, 4)``: ``sig, drift_f,
    drift_k, 1 - sig`` at each prefetch step. The same elementwise ops as computing them per
    round, so the same numbers.
    """
    hit = tab.__dict__.get("_auto_kinds")
    if hit is None:
        a, c, g = tab.a, tab.c, tab.gamma
        sig = tab.sig[: a.numel()]
        k0, ke = c / sig, c / (1.0 - sig)
        A = [a, torch.ones_like(a), a + k0, a - ke, a + k0]
        by_step = torch.stack([*A, c, sig, -g, k0, ke, -k0], -1)
        by_src = torch.stack([sig, tab.drift_f, tab.drift_k, 1.0 - sig], -1)
        hit = tab.__dict__["_auto_kinds"] = (by_step, by_src)
    return hit


_DRAFTS: Registry[Proposal] = Registry(
    "draft",
    {
        **{k: (lambda k=k: FrozenPrediction(k)) for k in FROZEN_KINDS},
        "auto": AutoDraft,
        "memory": MemoryDraft,
        "secant": SecantDraft,
        "learned": LearnedDraft.digits,
        "cached": CachedDraft,
        "picard": lambda: PicardDraft(1),
        "picard2": lambda: PicardDraft(2),
    },
)


def register_draft(name: str, factory: Callable[[], Proposal], *, replace: bool = False) -> None:
    """Make ``draft=name`` resolve to ``factory()`` everywhere.

    Raises:
        ValueError: if ``name`` is taken and ``replace`` is False.
        TypeError: if ``factory`` is not callable.
    """
    _DRAFTS.register(name, factory, replace=replace)


def unregister_draft(name: str) -> None:
    """Remove ``name`` from the draft registry (undoes :func:`register_draft`).

    Raises:
        ValueError: if ``name`` is not registered.
    """
    _DRAFTS.unregister(name)


def available_drafts() -> tuple[str, ...]:
    """The registered draft names."""
    return tuple(_DRAFTS.names())


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
        if draft not in _DRAFTS:
            raise ValueError(f"draft must be one of {available_drafts()}, a Proposal or a callable, got {draft!r}")
        return _DRAFTS.make(draft)
    if callable(draft):
        return DraftModel(draft)
    raise TypeError(f"draft must be one of {available_drafts()}, a Proposal or a callable, got {draft!r}")
