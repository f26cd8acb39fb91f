"""What a run returns: :class:`SampleResult` and its :class:`SampleStats`, read from the engine's
final :class:`~specforest.records.RunState`.

``specforest.SampleResult``, ``specforest.SampleStats`` and their ``specforest.sampler`` names are these classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

import torch

from .records import RunState
from .target import outside_inference

__all__ = ["SampleResult", "SampleStats", "returned", "stats_of"]


@dataclass
class SampleStats:
    """Per-trajectory statistics of a run of ``batch`` trajectories, tree depth ``L``.

    Attributes:
        nfe: ``(batch,)`` target calls each trajectory took part in (its sequential NFE).
        rounds: ``(batch,)`` speculative rounds (rounds that drafted a tree).
        spec_steps: ``(batch,)`` steps committed by speculative rounds.
        attempts: ``(batch, L)`` verification problems met at each depth.
        accepts: ``(batch, L)`` of which a drafted child was accepted.
        delta_sum: ``(batch, L)`` float64 sum of the observed ``delta`` at each depth.
        commits: ``(batch, L + 1)`` rounds that committed ``j`` steps (column ``j``).
        rows: ``(batch,)`` states each trajectory had evaluated by the target.
        deltas: with ``record_deltas=True``, ``(n, 4)`` float64 rows
            ``(depth, step, delta, accepted)`` of every verification problem of the
            run (``step`` is the verified parent's step; for calibrating tree plans
            and for per-step diagnostics).
        calls: batched target calls of the whole run (the batch's NFE).
        draft_calls: calls of an independent draft model (0 for frozen drafts).
        steps: number of steps ``T`` of the grid.
        standard_calls: the target calls of the standard sampler's run on the grid (``T`` for a chain
            of one call a step; a chain of several stages makes more, :attr:`~specforest.sde.GaussianChain.standard_calls`).
        wall_seconds: wall-clock time of the run.
        target_seconds: time spent inside target calls (CUDA: measured with
            events, read once at the end of the run).
        phase_seconds: host time per phase of the round engine
            (:data:`specforest.engine.PHASES`; the target call excluded).
    """

    nfe: torch.Tensor
    rounds: torch.Tensor
    spec_steps: torch.Tensor
    attempts: torch.Tensor
    accepts: torch.Tensor
    delta_sum: torch.Tensor
    commits: torch.Tensor
    rows: torch.Tensor
    deltas: Optional[torch.Tensor] = None
    calls: int = 0
    draft_calls: int = 0
    steps: int = 0
    standard_calls: int = 0
    wall_seconds: float = 0.0
    target_seconds: float = 0.0
    phase_seconds: dict = field(default_factory=dict)

    @property
    def sampler_seconds(self) -> float:
        """The sampler's own time: ``wall_seconds - target_seconds``."""
        return self.wall_seconds - self.target_seconds

    @property
    def accept_rate_per_depth(self) -> torch.Tensor:
        """``(L,)`` pooled acceptance rate at each depth (NaN where never reached)."""
        a = self.attempts.sum(0).double()
        return self.accepts.sum(0).double() / a

    @property
    def delta_per_depth(self) -> torch.Tensor:
        """``(L,)`` mean observed ``delta`` at each depth (NaN where never reached)."""
        return self.delta_sum.sum(0) / self.attempts.sum(0).double()

    @property
    def speedup(self) -> torch.Tensor:
        """``(batch,)`` float64 speedup over the standard sampler: its calls (``T`` for one call a step,
        :attr:`standard_calls`) over ``nfe``."""
        return (self.standard_calls or self.steps) / self.nfe.double()

    @property
    def steps_per_round(self) -> torch.Tensor:
        """``(batch,)`` mean steps committed per speculative round."""
        return self.spec_steps.double() / self.rounds.double()


@dataclass
class SampleResult:
    """What :func:`specforest.sample` returns.

    Attributes:
        samples: ``(batch, *shape)`` final states at ``sigma = 0``.
        stats: the run's :class:`SampleStats`.
        config: the options that produced it (names as in :func:`specforest.sample`).
    """

    samples: torch.Tensor
    stats: SampleStats
    config: dict = field(default_factory=dict)


def returned(stats: SampleStats) -> SampleStats:
    """``stats`` with every tensor a normal one (a clone made outside inference mode), to hand to the caller."""
    with outside_inference():
        values = {f.name: getattr(stats, f.name) for f in fields(stats)}
        return replace(stats, **{k: v.clone() for k, v in values.items() if isinstance(v, torch.Tensor)})


def stats_of(state: RunState, T: int, rows: Any = None, standard_calls: Optional[int] = None) -> SampleStats:
    """The :class:`SampleStats` of a run's final ``state`` (rows ``rows`` of it, default all) on a grid of
    ``T`` steps whose standard run makes ``standard_calls`` target calls (default ``T``)."""
    c = state.counters.flushed()
    sel = (lambda t: t) if rows is None else (lambda t: t[rows])
    return SampleStats(
        nfe=sel(c.nfe),
        rounds=sel(c.per_traj[:, 0]),
        spec_steps=sel(c.per_traj[:, 1]),
        attempts=sel(c.per_depth[..., 0].long()),
        accepts=sel(c.per_depth[..., 1].long()),
        delta_sum=sel(c.per_depth[..., 2]),
        commits=sel(c.commits),
        rows=sel(c.per_traj[:, 2]),
        calls=state.rounds + state.sweep_calls + state.stage_calls,
        draft_calls=state.draft_calls,
        steps=T,
        standard_calls=T if standard_calls is None else standard_calls,
    )
