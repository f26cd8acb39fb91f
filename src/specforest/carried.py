"""The carried state: the past clean-image predictions a chain's mean reads.

A chain declares its history ``h`` (:attr:`specforest.chains.Chain.history`,
:attr:`specforest.sde.GaussianChain.history`): step ``n`` of a chain whose mean reads ``h``
past predictions moves a state ``y`` to

    ``y' ~ N(a[n] y + c[n] v + past[n, 0] p_0 + ... + past[n, h - 1] p_{h - 1}, scale[n]^2 I)``

with ``p_j`` what the state ``j + 1`` steps before handed on (``p_0`` from the state's parent, ``p_1``
from its grandparent): its prediction ``y - sigma v`` (DPM++ 2M SDE reads one, DPM++ 3M SDE two), or
another fixed combination of that state and its velocity the chain declares
(:meth:`specforest.sde.StepTables.carry`: DPM++ SDE's step start hands its midpoint part of the end's mean).
Given them the step is Gaussian with a covariance free of the network, so the chain on
``(y, p_0, ..., p_{h - 1})`` can be speculated exactly: the engine keeps them beside each state.

:class:`Carried` is that state, for any ``h`` (``h = 0``: a one-step sampler, which carries
nothing and costs nothing), with every operation the engine, the walk, drafting and the
lockstep round make on it. No other module knows how many predictions a chain reads, or which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["NOTHING", "Carried"]


@dataclass(frozen=True)
class Carried:
    """What the last ``h`` states before each state handed on (their clean-image predictions unless the chain
    declares otherwise): ``p (..., h, D)``, the most recent first.

    ``p`` is ``None`` for a chain of history 0: every operation is then the identity (or adds
    nothing), so a one-step chain runs the same ops as if the concept did not exist. The leading
    dimensions are the states' (``(batch,)`` for a run's rows, ``(G, V)`` for a tree's nodes).
    Predictions before the first step are 0: a chain's coefficient of a prediction it does not
    have yet is 0 (:meth:`specforest.chains.Chain.build`).
    """

    p: Optional[torch.Tensor] = None

    @classmethod
    def start(cls, history: int, x: torch.Tensor) -> "Carried":
        """The carried state of states ``x (batch, D)`` at step 0 (zeros), for a chain of ``history``."""
        if history == 0:
            return NOTHING
        return cls(x.new_zeros(x.shape[0], history, x.shape[1]))

    @property
    def history(self) -> int:
        """``h``, the predictions carried per state."""
        return 0 if self.p is None else self.p.shape[-2]

    @staticmethod
    def held_states(history: int, inner: int, lazy: bool) -> int:
        """States of ``D`` elements a trajectory holds for its carried predictions at a round's peak
        (what :func:`specforest.memory.estimate` counts): ``h`` for its rows; a full round also the
        prediction at each of its ``inner`` nodes and their ``h`` carried ones (:meth:`at_nodes`)."""
        if history == 0:
            return 0
        return history if lazy else history + (1 + history) * inner

    def __getitem__(self, idx) -> "Carried":
        """The carried state of the states ``idx`` selects (indexing the leading dimensions)."""
        return self if self.p is None else Carried(self.p[idx])

    def take(self, rows: torch.Tensor) -> "Carried":
        """Rows ``rows (n,)`` of the first dimension."""
        return self if self.p is None else Carried(self.p[rows])

    def put(self, rows: torch.Tensor, new: "Carried") -> "Carried":
        """This state with rows ``rows (n,)`` replaced by ``new`` (``(n, h, D)``)."""
        return self if self.p is None else Carried(self.p.index_put((rows,), new.p))

    def where(self, mask: torch.Tensor, new: "Carried") -> "Carried":
        """``new`` where ``mask (n,)`` is True, this state elsewhere."""
        return self if self.p is None else Carried(torch.where(mask[:, None, None], new.p, self.p))

    def restart(self, rows: torch.Tensor) -> "Carried":
        """Rows ``rows (n,)`` back at step 0 (no prediction yet)."""
        return self if self.p is None else Carried(self.p.index_fill(0, rows, 0))

    def pushed(self, x0: torch.Tensor) -> "Carried":
        """The carried state of these states' children: ``x0 (..., D)``, what these states hand on
        (:meth:`specforest.sde.StepTables.carry`), first, then the ``h - 1`` most recent of theirs."""
        if self.p is None:
            return self
        return Carried(torch.cat([x0.unsqueeze(-2), self.p[..., :-1, :]], -2))

    def at_nodes(self, x0: torch.Tensor, up: torch.Tensor) -> "Carried":
        """The carried state of every node of a tree, from its root's (this state, ``(G, h, D)``).

        Args:
            x0: ``(G, V, D)`` the prediction at each node.
            up: ``(V,)`` long, each node's parent (the root's any node: it is replaced by the root's).

        Returns:
            ``(G, V, h, D)``: node ``i``'s ``p_j`` is its ``j + 1``-th ancestor's prediction, or the
            root's carried one where that ancestor is above the root.
        """
        if self.p is None:
            return self
        G, V, D = x0.shape
        out = x0.new_empty(G, V, self.history, D)
        level = x0[:, up]  # p_0: the parent's prediction
        for j in range(self.history):
            level[:, 0] = self.p[:, j]
            out[:, :, j] = level
            level = level[:, up]  # p_{j + 1} of a node is its parent's p_j
        return Carried(out)

    def term_below(self, handed: torch.Tensor, past: torch.Tensor) -> Optional[torch.Tensor]:
        """The carried term ``sum_j past[..., j] p_j`` of the states ``0 .. n - 1`` steps below these ones on a
        path whose state ``k`` steps below hands on ``handed[:, k]``: a state's ``p_j`` is what the state
        ``j + 1`` steps above it handed on, this state's own ``p_{j - k}`` for one ``k`` steps below it with
        ``j >= k``. What a draft's mean reads below a root (:func:`specforest.drafting.carried_term`), in the
        ops of :meth:`term` on the path's states pushed one by one (:meth:`pushed`), number for number.

        Args:
            handed: ``(G, m, D)``, ``m >= n - 1``: what the path's state at each depth (0: this one) hands on.
            past: ``(G, n, h)`` the mean's coefficients at the steps of the states ``0 .. n - 1`` below.

        Returns:
            ``(G, n, D)``, or ``None`` for history 0.
        """
        if self.p is None:
            return None
        h, n = self.history, past.shape[1]
        # the path's hand-ons, oldest first: this state's p_{h-1} .. p_0, then depths 0, 1, ...; the state
        # at depth k reads p_j at position h - 1 - j + k, so each j is one slice over every depth
        ext = torch.cat([self.p.flip(1), handed[:, : max(n - 1, 0)]], 1)
        m = past[..., 0:1] * ext[:, h - 1 : h - 1 + n]
        for j in range(1, h):
            m = torch.addcmul(m, past[..., j : j + 1], ext[:, h - 1 - j : h - 1 - j + n])
        return m

    def term(self, past: torch.Tensor) -> Optional[torch.Tensor]:
        """``sum_j past[..., j] p_j``, ``(..., D)``, with coefficients ``past (..., h)`` (``None`` for history 0)."""
        if self.p is None:
            return None
        m = past[..., 0:1] * self.p[..., 0, :]
        for j in range(1, self.history):
            m = torch.addcmul(m, past[..., j : j + 1], self.p[..., j, :])
        return m

    def added_to(self, mean: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        """``mean + sum_j past[..., j] p_j``: a chain's mean with its carried term (``mean (..., D)``,
        ``past (..., h)`` the coefficients at the states' steps)."""
        for j in range(self.history):
            mean = torch.addcmul(mean, past[..., j : j + 1], self.p[..., j, :])
        return mean


NOTHING = Carried()
"""The carried state of a chain of history 0."""
