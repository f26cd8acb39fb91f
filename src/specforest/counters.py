"""Per-trajectory counters of a run (:class:`Counters`) and what a speculative round adds to them
(:class:`RoundEntry`, one :class:`Outcome` per speculating group), accumulated in batches of
rounds so that a round adds no tensor op. :mod:`specforest.records` re-exports them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["FLUSH_ROUNDS", "Counters", "Outcome", "RoundEntry"]

FLUSH_ROUNDS = 16
"""Rounds whose counters are added together (:meth:`Counters.with_round`): memory for ``16 (batch, L)`` outcomes."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """One speculating group's outcome in a round, as :class:`Counters` add it.

    Attributes:
        ids: ``(G,)`` its trajectories.
        committed: ``(G,)`` steps each committed.
        rows: ``(G,)`` rows each had evaluated.
        act: ``(G, Lw)`` bool, a verification problem met at each depth walked.
        acc: ``(G, Lw)`` bool, ... and a child accepted.
        delta: ``(G, Lw)`` float64 mismatch of the problem met (junk where not ``act``).
        sweeps: target calls each trajectory took part in before the round's verification call
            (Picard sweeps; 0 for a free draft).
    """

    ids: torch.Tensor
    committed: torch.Tensor
    rows: torch.Tensor
    act: torch.Tensor
    acc: torch.Tensor
    delta: torch.Tensor
    sweeps: int = 0


@dataclass(frozen=True, slots=True)
class RoundEntry:
    """A speculative round's outcome, pending in :class:`Counters`.

    Attributes:
        needs: ``(batch,)`` long, the calls each trajectory's rows needed (0 for one that took no part):
            the chain's stages where it speculated, its step's where it took a single row (Heun's last
            step, into 0, needs one, whatever else the batch did). Its NFE counts these.
        single: ``(n1,)`` trajectories that took a single row (one evaluated row each, not a
            speculative round), or ``None``.
        outcomes: the speculating groups'.
        calls: sequential target calls the round (and each of its Picard sweeps) made: the chain's
            stages (:mod:`specforest.stages`), fewer where every row was a single row at a step of fewer.
    """

    needs: torch.Tensor
    single: Optional[torch.Tensor]
    outcomes: tuple
    calls: int = 1


@dataclass(frozen=True)
class Counters:
    """Per-trajectory counters, accumulated in batches of rounds so that a round adds no ops.

    A round appends its outcome to ``pending`` (a Python tuple: no tensor op);
    every :data:`FLUSH_ROUNDS` rounds, and whenever they are read
    (:meth:`flushed`), the pending rounds are added in a few ops for all of
    them together.

    Attributes:
        nfe: ``(batch,)`` target calls each trajectory took part in.
        per_traj: ``(batch, 3)`` long: speculative rounds, steps they committed, evaluated rows.
        per_depth: ``(batch, L, 3)`` float64: verifications met, accepted, summed ``delta`` at each depth.
        commits: ``(batch, L + 1)`` long: rounds that committed ``j`` steps.
        pending: :class:`RoundEntry` of the rounds not yet added.
        lockstep: lockstep rounds not yet added (every trajectory evaluated one row): a Python
            int, so that such a round adds no tensor op.
        lockstep_calls: their target calls (more than ``lockstep`` for a chain of several stages).

    See :class:`specforest.sampler.SampleStats` for their meaning.
    """

    nfe: torch.Tensor
    per_traj: torch.Tensor
    per_depth: torch.Tensor
    commits: torch.Tensor
    pending: tuple = ()
    lockstep: int = 0
    lockstep_calls: int = 0

    @classmethod
    def zeros(cls, batch: int, L: int, device: torch.device) -> Counters:
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=device)  # noqa: E731
        return cls(
            nfe=z(batch),
            per_traj=z(batch, 3),
            per_depth=torch.zeros(batch, L, 3, dtype=torch.float64, device=device),
            commits=z(batch, L + 1),
        )

    def with_round(self, entry: RoundEntry) -> Counters:
        """These counters with one more speculative round."""
        out = Counters(
            nfe=self.nfe,
            per_traj=self.per_traj,
            per_depth=self.per_depth,
            commits=self.commits,
            pending=self.pending + (entry,),
            lockstep=self.lockstep,
            lockstep_calls=self.lockstep_calls,
        )
        return out.flushed() if len(out.pending) >= FLUSH_ROUNDS else out

    def with_lockstep_round(self, calls: int = 1) -> Counters:
        """These counters with one more lockstep round (every trajectory, one row) of ``calls`` target calls."""
        return Counters(
            nfe=self.nfe,
            per_traj=self.per_traj,
            per_depth=self.per_depth,
            commits=self.commits,
            pending=self.pending,
            lockstep=self.lockstep + 1,
            lockstep_calls=self.lockstep_calls + calls,
        )

    @staticmethod
    def _one_row(ids: torch.Tensor) -> torch.Tensor:
        return torch.tensor([[0, 0, 1]], dtype=torch.long, device=ids.device)

    def flushed(self) -> Counters:
        """The counters with every pending round added."""
        if self.lockstep:
            n = self.lockstep
            one_row = self._one_row(self.nfe)
            out = Counters(
                nfe=self.nfe + self.lockstep_calls,
                per_traj=self.per_traj + n * one_row,
                per_depth=self.per_depth,
                commits=self.commits,
                pending=self.pending,
            )
            return out.flushed()
        if not self.pending:
            return self
        needs = [e.needs for e in self.pending]
        nfe = self.nfe + (torch.stack(needs).sum(0) if len(needs) > 1 else needs[0])
        per_traj, per_depth, commits = self.per_traj, self.per_depth, self.commits
        single = [e.single for e in self.pending if e.single is not None]
        if single:
            # a single row is not a speculative round: it counts one evaluated row only
            ids = torch.cat(single) if len(single) > 1 else single[0]
            per_traj = per_traj.index_add(0, ids, self._one_row(ids).expand(ids.numel(), 3))
        spec = [o for e in self.pending for o in e.outcomes]
        swept = [(o, e.calls) for e in self.pending for o in e.outcomes if o.sweeps]
        if swept:
            # a Picard sweep is one more sequential target call (one per stage) of each of the group's trajectories
            ids = torch.cat([o.ids for o, _ in swept])
            nfe = nfe.index_add(0, ids, torch.cat([torch.full_like(o.ids, o.sweeps * k) for o, k in swept]))
        if spec:
            ids = torch.cat([o.ids for o in spec])
            committed = torch.cat([o.committed for o in spec])
            rows = torch.cat([o.rows for o in spec])
            per_traj = per_traj.index_add(0, ids, torch.stack([torch.ones_like(ids), committed, rows], 1))
            commits = commits.index_put((ids, committed), torch.ones_like(ids), accumulate=True)
            by_depth: dict = {}
            for o in spec:
                by_depth.setdefault(o.act.shape[1], []).append(o)
            for Lw, group in by_depth.items():
                act = torch.cat([o.act for o in group])
                acc = torch.cat([o.acc for o in group])
                delta = torch.cat([o.delta for o in group])
                gid = torch.cat([o.ids for o in group])
                cols = torch.arange(Lw, device=gid.device)
                per_depth = per_depth.index_put(
                    (gid[:, None], cols[None]),
                    torch.stack([act.double(), acc.double(), torch.where(act, delta, 0.0)], -1),
                    accumulate=True,
                )
        return Counters(nfe=nfe, per_traj=per_traj, per_depth=per_depth, commits=commits)

    def restart(self, rows: torch.Tensor) -> Counters:
        """The counters (pending rounds added) with trajectories ``rows`` back at zero."""
        c = self.flushed()
        return Counters(
            nfe=c.nfe.index_fill(0, rows, 0),
            per_traj=c.per_traj.index_fill(0, rows, 0),
            per_depth=c.per_depth.index_fill(0, rows, 0),
            commits=c.commits.index_fill(0, rows, 0),
        )
