"""The draft chosen online among the frozen kinds, ``memory`` and ``secant`` (``auto``)."""

from __future__ import annotations

import torch

from ..sde import StepTables
from ..validation import check_int
from .base import AUTO_KINDS
from .chain_memory import RemembersChain
from .memory import memory_at, secant_at

__all__ = ["AutoDraft"]


class AutoDraft(RemembersChain):
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
    uses_states = True
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
    def _all_kinds(tab, steps, pre, memory=None):
        """Every kind's mean as ``A y + alpha y* + beta v* + eps x0_prev + mu x0_mem + nu y_mem``.

        Returns ``coef (6, 7, G, n)``: ``A, alpha, beta, eps, mu, nu`` of the seven kinds (in
        :data:`AUTO_KINDS` order) at each parent, and the vectors ``y* (G, D)``, ``v* (G, D)``,
        ``x0_prev (G, D)``, ``x0_mem (G, n, D)`` (the memory node each parent would read) and
        ``y_mem (G, n, D)`` (its state), the last two ``None`` when the run keeps no memory
        (``memory``, the trajectories' :class:`~specforest.drafts.chain_memory.ChainMemory`). The
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
        x0_mem, use = memory_at(steps, pre, memory)
        # the memory kind: mu x0_mem where it reads a node, the x0 kind (times keep = 1) where not
        reads = zero if use is None else use.to(c.dtype)
        keep = 1.0 - reads
        x0_beta = k0 * sig_src
        # the secant kind: the memory kind plus k0 g (y_mem - y), g = 0 where it reads no node
        # at the parent's own step
        y_mem, kg = None, zero
        if x0_mem is not None and memory.y is not None:
            g, y_mem = secant_at(steps, pre, memory)
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

    def round_terms(self, tab, steps, pre, memory=None):
        return self._all_kinds(tab, steps, pre, memory)

    def take_terms(self, terms, rows, cols):
        coef, (ys, vs, x0p, x0m, ym) = terms
        at = lambda t: None if t is None else t[rows, cols]  # noqa: E731
        return coef[:, :, rows, cols], (ys[rows], vs[rows], x0p[rows], at(x0m), at(ym))

    def coefficients(self, tab, steps, pre, state, terms=None, memory=None):
        coef, (ys, vs, x0p, x0m, ym) = self._all_kinds(tab, steps, pre, memory) if terms is None else terms
        offset = (steps - pre.step[:, None]).clamp(0, self.max_offset)
        pick = self.choice(state, self.min_count).reshape(-1)[self._cell(tab, steps, offset)]  # (G, n)
        A, alpha, beta, eps, mu, nu = coef.gather(1, pick.expand(6, 1, *pick.shape))[:, 0, ..., None].unbind(0)
        C = torch.addcmul(torch.addcmul(alpha * ys[:, None], beta, vs[:, None]), eps, x0p[:, None])
        if x0m is not None:
            C = torch.addcmul(C, mu, x0m)
        if ym is not None:
            C = torch.addcmul(C, nu, ym)
        return A, C

    def observe(self, state, tab, y, mu_q, steps, pre, scale, terms=None, memory=None):
        total, count = state
        if terms is None:
            coef, (ys, vs, x0p, x0m, ym) = self._all_kinds(tab, steps[:, None], pre, memory)  # (6, 7, P, 1)
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
