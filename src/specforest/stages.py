"""The stages of a step: the model calls a chain's mean reads, as a Runge-Kutta tableau.

A chain declares ``stages`` ``s`` (:attr:`specforest.chains.Chain.stages`): step ``n`` of a chain of
``s`` stages evaluates the model at the state ``y_0 = y`` (level ``t = sigmas[n]``) and at ``s - 1``
further points, each linear in the state and the earlier stages' clean-image predictions::

    y_k = alpha[n, k] y + sum_{i < k} beta[n, k, i] D_i      at level  level[n, k]
    D_k = y_k - level[n, k] v(y_k, level[n, k])

and its mean is ``a[n] y + c[n] v_eff`` with the effective velocity ``v_eff = (y - D_eff) / t`` of the
prediction ``D_eff = sum_k weight[n, k] D_k`` (weights summing to 1): EDM's Heun step, DPM-Solver-2,
DPM++ 2S. Given the state the step is still Gaussian with a covariance free of the network, so the
chain is speculated exactly: a verified node's mean comes from its ``s`` stage calls; a frozen draft
predicts ``v_eff`` as it predicts a one-stage chain's velocity (the ``x0`` draft freezes ``D_eff``,
the prediction it reuses for every stage), and a draft with a network of its own runs that network
through this tableau (:meth:`specforest.drafts.Proposal.stage_velocity` calls :meth:`Stages.velocity`
with the network as the target).

:class:`Stages` is that tableau on one device, with :meth:`Stages.velocity`, the one place the
engine, the walk, drafting, the lockstep round and the network drafts run a step's stages: a round's
one batched call becomes ``s`` sequential batched calls over the same rows. A one-stage chain has no
:class:`Stages` (``None``) and calls the model once, as if the concept did not exist.

A call's level is all the model reads of its time, unless the chain declares each call's own time input
(:meth:`specforest.chains.Chain.call_times`, a ``(T, s)`` table): then :func:`evaluate` hands stage ``k`` of
step ``n`` its entry ``[n, k]`` with the call, whatever the chain is.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

__all__ = ["Stages", "evaluate"]


@dataclass(frozen=True)
class Stages:
    """A chain's stage tableau on one device, in one dtype (``T`` steps, ``s >= 2`` stages).

    Attributes:
        level: ``(T, s)`` the noise level of each stage's call (linear path; ``level[:, 0]`` the state's).
        alpha: ``(T, s)`` the state's coefficient in each stage's point (``alpha[:, 0] = 1``).
        beta: ``(T, s, s)`` the earlier predictions' coefficients (``beta[n, k, i] = 0`` for ``i >= k``).
        weight: ``(T, s)`` each prediction's weight in ``D_eff`` (rows sum to 1).
        used: per step, the stages it evaluates (host ints): a step whose later stages have weight 0
            and are read by no stage it uses (Heun's last step, into 0) skips their calls where
            every row of a call is at that step (the lockstep round).
    """

    level: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    weight: torch.Tensor
    used: tuple

    @property
    def count(self) -> int:
        """``s``, the calls a step makes (at most)."""
        return self.level.shape[1]

    @staticmethod
    def held_states(stages: int, rows: int) -> int:
        """States of ``D`` elements a trajectory's ``rows`` evaluated rows hold beside their velocity while a
        chain of ``stages`` makes its later calls (:meth:`velocity`: each stage's prediction, the point, the
        weighted sum and the call's output; what :func:`specforest.memory.estimate` counts), 0 for one stage."""
        return 0 if stages == 1 else (stages + 2) * rows

    @classmethod
    def build(
        cls, level: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor, name: str
    ) -> "Stages":
        """The tableau from float64 CPU tables (shapes as the attributes), checked.

        Raises:
            ValueError: naming the chain ``name``, if a table has the wrong shape, is not finite, a
                stage reads a later one, the weights do not sum to 1, or a used stage's level is
                outside ``(0, 1)``.
        """
        T, s = level.shape
        if s < 2 or alpha.shape != (T, s) or beta.shape != (T, s, s) or weight.shape != (T, s):
            raise ValueError(
                f"chain {name!r}: stage tables must be level, alpha, weight (T, s), beta (T, s, s), s >= 2"
            )
        if not all(bool(torch.isfinite(x).all()) for x in (level, alpha, beta, weight)):
            raise ValueError(f"chain {name!r}: its stage tables are not finite on this grid")
        if bool(beta.triu().abs().gt(0).any()):
            raise ValueError(f"chain {name!r}: a stage's point may read only the earlier stages' predictions")
        if bool(((weight.sum(1) - 1.0).abs() > 1e-9).any()):
            raise ValueError(f"chain {name!r}: the stage weights of a step must sum to 1")
        # the stages a step evaluates: up to the last one with a weight, or read by one that is
        need = weight != 0
        for k in range(s - 1, 0, -1):
            need[:, :k] |= need[:, k : k + 1] & (beta[:, k, :k] != 0)
        need[:, 0] = True
        used = [int(k) + 1 for k in (need * torch.arange(s)).amax(1).tolist()]
        lv = level[need]
        if bool(((lv <= 0) | (lv > 1)).any()):
            raise ValueError(f"chain {name!r}: a stage's level must lie in (0, 1]")
        return cls(level, alpha, beta, weight, tuple(used))

    def to(self, device: torch.device, dtype: torch.dtype) -> "Stages":
        """These tables on ``device`` in ``dtype``."""
        to = lambda x: x.to(device, dtype)  # noqa: E731
        return Stages(to(self.level), to(self.alpha), to(self.beta), to(self.weight), self.used)

    def velocity(
        self,
        target: Callable,
        y: torch.Tensor,
        step: torch.Tensor,
        traj: torch.Tensor,
        v0: torch.Tensor,
        sig: torch.Tensor,
        upto: Optional[int] = None,
        rows_key: Hashable = None,
        features: bool = False,
        times: Optional[torch.Tensor] = None,
    ) -> Any:
        """``v_eff (M, D)`` at states ``y (M, D)`` at steps ``step (M,)`` of trajectories ``traj (M,)``,
        given the first stage's velocity ``v0`` at ``y`` and the states' levels ``sig (M,)``: the
        calls of stages ``1 .. upto - 1`` (default all), each one batched call of the ``M`` rows, in that
        order (a network draft's stage callable may count its calls to know the stage).
        ``times``: ``(M, s)`` each row's time input at each stage where the chain declares them
        (:meth:`specforest.chains.Chain.call_times`), given to the target with stage ``k``'s call as ``timestep``.

        A row whose step does not use a stage evaluates it at its own state (``alpha = 1``, ``beta = 0``
        there, a finite call) with weight 0. With ``features`` (a ``target`` returning ``(v, features)``
        then), ``(v_eff, [features (M, F)])``: the deep features of each later stage's call, zeros for a
        stage ``upto`` skips."""
        s = self.count if upto is None else upto
        feats: list = []
        lv, al, be, w = self.level[step], self.alpha[step], self.beta[step], self.weight[step]
        preds = [torch.addcmul(y, sig[:, None], v0, value=-1.0)]
        # D_eff - D_0 = sum_{k >= 1} w_k (D_k - D_0): exact where the stages agree
        shift = torch.zeros_like(y)
        for k in range(1, s):
            point = al[:, k : k + 1] * y
            for i in range(k):
                point = torch.addcmul(point, be[:, k, i : i + 1], preds[i])
            timed = {} if times is None else {"timestep": times[:, k]}
            if features:
                vk, fk = target(point, lv[:, k], traj, rows_key=rows_key, features=True, **timed)
                feats.append(fk)
                vk = vk.to(y.dtype)
            else:
                vk = target(point, lv[:, k], traj, rows_key=rows_key, **timed).to(y.dtype)
            preds.append(torch.addcmul(point, lv[:, k : k + 1], vk, value=-1.0))
            shift = torch.addcmul(shift, w[:, k : k + 1], preds[k] - preds[0])
        v = torch.addcdiv(v0, shift, sig[:, None], value=-1.0)
        if not features:
            return v
        return v, feats


def _pad_stages(feats: list, first: torch.Tensor, count: int) -> torch.Tensor:
    """``(M, count F)``: the first stage's features ``first (M, F)`` then the later stages' ``feats``,
    zeros for the stages not evaluated."""
    missing = count - 1 - len(feats)
    return torch.cat([first, *feats, *([torch.zeros_like(first)] * missing)], 1)


def evaluate(
    stages: Optional[Stages],
    target: Callable,
    y: torch.Tensor,
    sig: torch.Tensor,
    step: torch.Tensor,
    traj: torch.Tensor,
    *,
    rows_key: Hashable = None,
    features: bool = False,
    upto: Optional[int] = None,
    times: Optional[torch.Tensor] = None,
) -> Any:
    """The velocity a chain's mean reads at states ``y (M, D)`` at levels ``sig (M,)`` and steps
    ``step (M,)`` of trajectories ``traj (M,)``: the model's (one call) for a one-stage chain
    (``stages`` ``None``), else ``v_eff`` from ``s`` sequential calls (:meth:`Stages.velocity`; ``upto``
    stages only, where the caller knows every row's step skips the rest). With ``features``,
    ``(v, features (M, s F))``: the deep features of each stage's call, the first stage's (the state's
    own) first, zeros for a stage ``upto`` skips; a network draft reads a remembered node's stage ``k``
    with stage ``k``'s (:class:`~specforest.drafts.model.CachedDraft`). ``times``: ``(M, s)`` the rows' time
    input at each call where the chain declares them, each call given its column as ``timestep``."""
    timed = {} if times is None else {"timestep": times[:, 0]}
    out = target(y, sig, traj, rows_key=rows_key, features=features, **timed) if features else None
    v0 = out[0] if features else target(y, sig, traj, rows_key=rows_key, **timed)
    if stages is None:
        return out if features else v0
    if upto is not None and upto <= 1:
        return (v0, _pad_stages([], out[1], stages.count)) if features else v0
    v = stages.velocity(target, y, step, traj, v0.to(y.dtype), sig.to(y.dtype), upto, rows_key, features, times)
    if not features:
        return v
    return v[0], _pad_stages(v[1], out[1], stages.count)
