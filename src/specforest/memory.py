"""One memory model for every command: what a run holds, and how to split it to fit.

A speculative run holds, per trajectory, the float32 states of the realized
tree, the rows gathered for the target and the velocities it returns, the
prefetched evaluation and a little scratch; a full round realizes the whole
tree, a lazy round (the cost simulation) only the children of one node per
depth. Inside one target call every row adds the network's activations, a
model-specific figure (``row_bytes``) that the caller supplies: the SD3
pipeline estimates a transformer's, the small models use the default.

:func:`estimate` turns that into the two knobs the sampler has: how many
trajectories run together (``chunk``; chunks run one after another) and how
many rows one network call may hold (``max_rows``; the sub-batches of one call
still count as one NFE). With per-sample random streams neither knob changes a
sample. :func:`default_memory_limit` is the limit every command assumes when
the user gives none.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .trees import DraftTree, TreePolicy

__all__ = ["MemoryEstimate", "default_memory_limit", "estimate", "tree_footprint"]

_F32 = 4
# per trajectory, beyond the realized nodes and the rows: x, the prefetched
# (state, velocity) pair and scratch of the coupling arithmetic
_SCRATCH_STATES = 5
# fraction of physical RAM assumed free on devices whose free memory is not known
_RAM_FRACTION = 0.5
_RAM_UNKNOWN_BYTES = 8 * 10**9


def default_memory_limit(device: Union[str, torch.device] = "cpu") -> tuple[int, str]:
    """Bytes available for sampling on ``device`` and where the figure comes from.

    CUDA: the device's free memory now (after the model was loaded). Other
    devices: 50% of physical RAM (8 GB where it cannot be read).

    Returns:
        ``(limit_bytes, source)``, ``source`` a phrase for messages.
    """
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device}"
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        total = 0
    if total <= 0:
        return _RAM_UNKNOWN_BYTES, "default of 8 GB (physical memory unknown)"
    return int(_RAM_FRACTION * total), "50% of physical RAM"


def tree_footprint(
    tree: "DraftTree | TreePolicy | None", *, verify: str = "internal", lazy: bool = False, steps: Optional[int] = None
) -> tuple[int, int]:
    """``(nodes, rows)`` one trajectory holds in a round: realized states and target rows per call.

    Args:
        tree: a :class:`~specforest.trees.DraftTree`, a tree policy with a
            ``budget`` (e.g. :class:`~specforest.planning.AdaptiveTree`: any plan
            has at most ``budget + 1`` nodes) or ``None`` (the standard sampler).
        verify: ``internal`` or ``drafted`` (which nodes a full round evaluates).
        lazy: the cost simulation (one row per call, the children of one node per depth).
        steps: grid steps ``T``; a round is at most ``T`` deep.
    """
    if tree is None:
        return 1, 1
    if not isinstance(tree, DraftTree):
        budget = int(tree.budget)
        kmax = int(getattr(tree, "kmax", budget))
        depth = int(getattr(tree, "max_depth", budget))
        depth = depth if steps is None else min(depth, max(steps, 1))
        return (1 + kmax * depth, 1) if lazy else (budget + 1, budget + 1)
    depth = tree.L if steps is None else min(tree.L, max(steps, 1))
    t = tree.truncate(depth)
    if lazy:
        return 1 + t.max_children * depth, 1
    return t.size, t.verification_budget(verify)


@dataclass(frozen=True)
class MemoryEstimate:
    """What a run holds in memory, estimated before it starts. Sizes in bytes.

    Attributes:
        trajectories: trajectories of the run ``B``.
        state_numel: elements of one state ``D``.
        nodes: realized states per trajectory in a round.
        rows: target rows per trajectory and call (before guidance branches).
        trajectory_bytes: what one trajectory holds between calls: float32
            ``D x (nodes + 2 rows + 5)`` (tree, gathered rows and velocities,
            ``x``, prefetch and scratch) plus its own conditioning.
        row_bytes: peak bytes one row adds inside a target call.
        fixed_bytes: bytes held whatever the batch (the caller's).
        chunk: trajectories run together (``B``: one chunk).
        max_rows: rows per target sub-batch (``None``: a whole call at once).
        limit_bytes: the memory limit.
        limit_source: where the limit comes from.
    """

    trajectories: int
    state_numel: int
    nodes: int
    rows: int
    trajectory_bytes: int
    row_bytes: int
    fixed_bytes: int
    chunk: int
    max_rows: Optional[int]
    limit_bytes: int
    limit_source: str

    @property
    def chunks(self) -> int:
        """Chunks of trajectories run one after another."""
        return math.ceil(self.trajectories / self.chunk)

    @property
    def rows_per_call(self) -> int:
        """Target rows of a full call of one chunk."""
        return self.chunk * self.rows

    @property
    def sampler_bytes(self) -> int:
        """What the sampler holds for one chunk between calls."""
        return self.chunk * self.trajectory_bytes

    @property
    def total_bytes(self) -> int:
        """Estimated peak: fixed bytes, the chunk's sampler states and one sub-batch of rows."""
        rows = self.rows_per_call if self.max_rows is None else min(self.max_rows, self.rows_per_call)
        return self.fixed_bytes + self.sampler_bytes + rows * self.row_bytes

    def describe(self) -> str:
        """One line for logs."""
        gb = 1e9
        calls = "whole calls" if self.max_rows is None else f"sub-batches of {self.max_rows} rows"
        return (
            f"memory: {self.chunks} chunk(s) of <= {self.chunk} trajectories x {self.nodes} states x "
            f"{self.state_numel} elements; sampler {self.sampler_bytes / gb:.3g} GB, "
            f"{self.row_bytes / 1e6:.3g} MB per target row in {calls}; peak ~{self.total_bytes / gb:.3g} GB "
            f"of {self.limit_bytes / gb:.3g} GB ({self.limit_source})"
        )


def estimate(
    *,
    trajectories: int,
    state_numel: int,
    tree: "DraftTree | TreePolicy | None",
    verify: str = "internal",
    lazy: bool = False,
    steps: Optional[int] = None,
    row_bytes: Optional[int] = None,
    cond_bytes: int = 0,
    fixed_bytes: int = 0,
    limit_bytes: Optional[int] = None,
    limit_source: str = "given limit",
    device: Union[str, torch.device] = "cpu",
    chunked: bool = True,
) -> MemoryEstimate:
    """Estimate a run's memory and choose ``chunk`` and ``max_rows`` so it fits.

    All trajectories run together whenever their states and one target row fit;
    the rows of a call are then split into sub-batches as needed. Otherwise (with
    ``chunked``) the trajectories run in balanced chunks, each as large as fits
    with one row beside it.

    Args:
        trajectories: trajectories ``B >= 1``.
        state_numel: elements ``D`` of one state.
        tree: the run's tree (see :func:`tree_footprint`).
        verify, lazy, steps: as in :func:`specforest.sample`.
        row_bytes: peak bytes one row adds inside a target call (default
            ``3 D`` float32: the cast input, the output and one copy).
        cond_bytes: bytes of one trajectory's conditioning.
        fixed_bytes: bytes held whatever the batch (the caller's).
        limit_bytes: the limit (default: :func:`default_memory_limit` of ``device``).
        limit_source: where ``limit_bytes`` comes from (for messages).
        device: where the run happens (for the default limit).
        chunked: allow running trajectories in chunks; if ``False`` all must fit at once.

    Returns:
        A :class:`MemoryEstimate`.

    Raises:
        MemoryError: if one trajectory and one row do not fit (or, with
            ``chunked=False``, all trajectories and one row); the message gives
            the numbers and what to change.
    """
    if limit_bytes is None:
        limit_bytes, limit_source = default_memory_limit(device)
    nodes, rows = tree_footprint(tree, verify=verify, lazy=lazy, steps=steps)
    D = int(state_numel)
    row = int(3 * D * _F32 if row_bytes is None else row_bytes)
    per = D * _F32 * (nodes + 2 * rows + _SCRATCH_STATES) + int(cond_bytes)
    room = int(limit_bytes) - int(fixed_bytes) - row
    need = trajectories if not chunked else 1
    if room < need * per:
        gb = 1e9
        raise MemoryError(
            f"this run does not fit the memory limit of {limit_bytes / gb:.3g} GB ({limit_source}): "
            f"{need} trajectory(ies) x {nodes} states x {D} elements hold {need * per / gb:.3g} GB, one target "
            f"row needs about {row / gb:.3g} GB and {fixed_bytes / gb:.3g} GB are fixed. Use a smaller tree "
            "(K, L or budget), fewer trajectories, verify='internal', lazy=True (--lazy), or raise the memory limit"
        )
    fit = room // per
    chunk = trajectories
    if fit < trajectories:
        parts = math.ceil(trajectories / fit)
        chunk = math.ceil(trajectories / parts)
    rows_fit = (int(limit_bytes) - int(fixed_bytes) - chunk * per) // row
    max_rows = None if rows_fit >= chunk * rows else int(rows_fit)
    return MemoryEstimate(
        trajectories=int(trajectories),
        state_numel=D,
        nodes=nodes,
        rows=rows,
        trajectory_bytes=per,
        row_bytes=row,
        fixed_bytes=int(fixed_bytes),
        chunk=chunk,
        max_rows=max_rows,
        limit_bytes=int(limit_bytes),
        limit_source=limit_source,
    )
