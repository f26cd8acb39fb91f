"""Many processes, one job: share indices, gather results, with ``torch.distributed``.

Two ways to use several devices, both inside any initialized process group
(``torchrun``, or accelerate's ``PartialState``) and with no global state of
specforest's own (every function takes the group, default the world):

* **Data-parallel** (throughput): :func:`shard` gives each process its share
  of a job's indices; each process runs :func:`specforest.generate` on its
  share; :func:`gather` collects ``(index, tensor)`` results on every process,
  ordered by index. Sample ``i`` depends on ``(seed, i)`` only, so the union is
  the one-process job.
* **Tree-parallel** (latency): every process calls
  :func:`specforest.sample` (or :func:`specforest.generate`) with the same
  states, seed and ``process_group=``; each round's target rows are split
  across the processes and the velocities gathered
  (:class:`specforest.target.Target`).

A failure on one process must not leave the others waiting in a collective.
:func:`agree` (and the :func:`together` block built on it) replaces a bare
barrier at the points where the processes meet: each process brings its
outcome, and if one failed, every process raises (:class:`PeerError` where it
did not fail itself), so they all stop at the same step with the error in hand.

:func:`init_from_env` is the command line's start-up under ``torchrun``: it
initializes the default group from torchrun's environment (NCCL for CUDA,
gloo otherwise) and is a no-op in a single process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import torch

from .devices import default_device
from .validation import check_indices, is_int

__all__ = [
    "PeerError",
    "agree",
    "broadcast_",
    "gather",
    "init_from_env",
    "is_distributed",
    "rank",
    "shard",
    "together",
    "world_size",
]


class PeerError(RuntimeError):
    """Another process of the group failed, or left, at a step all of them take together (:func:`agree`)."""


def is_distributed() -> bool:
    """Whether a process group is in use (``torch.distributed`` is initialized)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def world_size(group: Any = None) -> int:
    """Processes in ``group`` (1 without an initialized group)."""
    import torch.distributed as dist

    return dist.get_world_size(group) if is_distributed() else 1


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (0 without an initialized group, -1 if not a member)."""
    import torch.distributed as dist

    return dist.get_rank(group) if is_distributed() else 0


def broadcast_(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Overwrite ``t`` in place with the group's first process's ``t`` (a no-op without a group).

    Tree-parallel runs start from the same states and keys on every process this way,
    whatever each process was given.
    """
    import torch.distributed as dist

    if is_distributed():
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast(t, src=src, group=group)
    return t


def shard(indices: "int | Sequence[int] | torch.Tensor", group: Any = None) -> torch.Tensor:
    """This process's share of a job's indices: every ``world``-th one, from its rank.

    Args:
        indices: ``count`` (for ``0..count-1``) or the job's indices.
        group: the process group (default: the world; one process without one).

    Returns:
        ``(n,)`` long indices; empty on idle ranks when there are fewer indices than processes.

    Raises:
        ValueError: if ``indices`` is a negative count, or not a 1-D sequence of non-negative integers.
    """
    if is_int(indices):
        if indices < 0:
            raise ValueError(f"indices must be a count >= 0 or a sequence of indices, got {indices}")
        idx = torch.arange(indices)
    else:
        idx = check_indices("indices", indices)
    r = rank(group)
    if r < 0:  # not a member of the group: no share
        return idx[:0]
    return idx[r :: world_size(group)]


def gather(
    index: "torch.Tensor | Sequence[torch.Tensor]", values: "torch.Tensor | Sequence[torch.Tensor]", group: Any = None
) -> "tuple[torch.Tensor, torch.Tensor]":
    """Every process's ``(index (n,), values (n, ...))``, on every process, ordered by index.

    ``index`` and ``values`` may be lists of pieces (an idle rank passes empty
    lists). Values go through the host (``all_gather_object``): use it for
    results, not per round. A mismatch raises on every process, after the
    collective, so that no process is left waiting.
    """
    import torch.distributed as dist

    def join(t) -> torch.Tensor:
        if isinstance(t, torch.Tensor):
            return t.detach().cpu()
        pieces = [p.detach().cpu() for p in t]
        return torch.cat(pieces) if pieces else torch.zeros(0)

    index, values = join(index).long(), join(values)
    ok = index.ndim == 1 and index.shape[:1] == values.shape[:1]
    parts: list = [(index, values, ok)]
    if is_distributed():
        parts = [None] * world_size(group)
        dist.all_gather_object(parts, (index, values, ok), group=group)
    if not all(p[2] for p in parts):
        raise ValueError("index must be (n,) and values (n, ...) on every process (one row per index)")
    index = torch.cat([p[0] for p in parts])
    values = torch.cat([p[1] for p in parts if p[1].numel()]) if index.numel() else values[:0]
    order = torch.argsort(index)
    return index[order], values[order]


def agree(step: str, error: Optional[BaseException] = None, value: Any = None, group: Any = None) -> list:
    """A barrier that carries each process's outcome: every process's ``value``, or an error on every process.

    Every process of ``group`` calls it at the same point of its program (it is one
    ``all_gather_object``), passing the exception it met since the last such point,
    if any. Then no process waits for one that failed: they all stop here.

    Args:
        step: what the processes were doing, for the messages (``"the merge"``).
        error: this process's failure, or None.
        value: a picklable value to share (e.g. statistics).
        group: the process group (default: the world; one process without one).

    Returns:
        Every process's ``value``, by rank (``[value]`` without a group).

    Raises:
        error: on the process that passed it, once every process has arrived.
        PeerError: on the other processes when some process passed an error, naming
            the processes and the first error; or on every process when the collective
            itself failed (a process left the job: it exited or its node is gone).
    """
    import torch.distributed as dist

    if not is_distributed():
        if error is not None:
            raise error
        return [value]
    mine = (None if error is None else f"{type(error).__name__}: {error}", value)
    parts: list = [None] * world_size(group)
    try:
        dist.all_gather_object(parts, mine, group=group)
    except RuntimeError as e:  # gloo: "Connection closed by peer"; a timeout; NCCL: DistBackendError
        if error is not None:
            raise error from e
        raise PeerError(f"{step}: another process left the job ({e})") from e
    if error is not None:
        raise error
    failed = [r for r, (msg, _) in enumerate(parts) if msg is not None]
    if failed:
        who = "process" if len(failed) == 1 else "processes"
        raise PeerError(f"{step} failed on {who} {', '.join(map(str, failed))} of {len(parts)}: {parts[failed[0]][0]}")
    return [v for _, v in parts]


@contextmanager
def together(step: str, group: Any = None) -> Iterator[None]:
    """A block every process of ``group`` runs, then leaves together: if it raised anywhere, it raises everywhere.

    ``with together("the merge"): ...`` is :func:`agree` with the block's exception.
    The block must not itself use ``group``: a process that raised before such a
    collective would meet the others inside it. An interrupt (``KeyboardInterrupt``,
    ``SystemExit``) is not held for the others: the process leaves at once, and the
    others' :func:`agree` raises :class:`PeerError` when they see it gone.

    Raises:
        The block's exception on the process where it was raised; :class:`PeerError` on the others.
    """
    try:
        yield
    except Exception as e:
        agree(step, e, group=group)
    else:
        agree(step, group=group)


def init_from_env(device: Optional[str] = None) -> bool:
    """Initialize the default process group from ``torchrun``'s environment, if there is one.

    Args:
        device: ``cuda`` uses NCCL and binds this process to ``LOCAL_RANK``'s GPU;
            anything else uses gloo. Default: CUDA when available.

    Returns:
        True when a group of more than one process is in use.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_world_size() > 1
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    cuda = (device or default_device()).startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    return True
