"""The per-trajectory target evaluations a draft reads (:class:`Prefetch`), which the engine keeps;
a draft's own memory of earlier rounds is not here (:class:`~specforest.drafts.base.DraftMemory`)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

__all__ = ["Prefetch"]


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
    """

    y: torch.Tensor
    v: torch.Tensor
    step: torch.Tensor
    prev_y: torch.Tensor
    prev_v: torch.Tensor
    prev_step: torch.Tensor
    has_prev: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def empty(cls, batch: int, D: int, dtype: torch.dtype, device: torch.device) -> "Prefetch":
        """No evaluation yet for any of ``batch`` trajectories."""
        z = torch.zeros(batch, D, dtype=dtype, device=device)
        zi = torch.zeros(batch, dtype=torch.long, device=device)
        zb = torch.zeros(batch, dtype=torch.bool, device=device)
        return cls(y=z, v=z, step=zi, prev_y=z, prev_v=z, prev_step=zi, has_prev=zb, valid=zb)

    def restart(self, rows: torch.Tensor) -> "Prefetch":
        """Rows ``rows`` as :meth:`empty` makes them (no evaluation), the others unchanged."""
        return Prefetch(**{f.name: getattr(self, f.name).index_fill(0, rows, 0) for f in fields(self)})

    def take(self, idx: torch.Tensor, history: bool = True) -> "Prefetch":
        """The rows ``idx`` of every field (of ``y, v, step, valid`` only unless ``history``)."""
        if history:
            return Prefetch(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})
        return replace(self, y=self.y[idx], v=self.v[idx], step=self.step[idx], valid=self.valid[idx])

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
