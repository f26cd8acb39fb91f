"""Picard-refined chains: the ``x0`` kind's chain refined by sweeps of the target (``picard``,
``picard2``)."""

from __future__ import annotations

from .frozen import FrozenPrediction

__all__ = ["PicardDraft"]


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
