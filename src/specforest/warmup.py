"""Warm-up: pay a fresh process's first network call at each row count before the run, not inside it.

The first call of a network at a new batch shape is slow: on a CPU the
allocator grows and oneDNN creates its primitives for that shape, on CUDA
cuDNN autotunes and a compiled model records its graph. A run calls the
network with a few row counts, each first met at some round, so a fresh
process pays these one-off costs inside the run (measurements in
``docs/latency.md``). :func:`warm_up` makes one call at each row count the run can make, before it,
and returns the seconds that took.

The row counts follow from the run's options (:func:`network_rows`):

* the standard sampler: every call holds the ``batch`` trajectories (they run
  in lockstep);
* a fixed tree: a trajectory contributes one row (a deterministic step, the
  fetch of its first root), the rows its tree evaluates at its lookahead (the
  full tree, or the tree truncated where the stochastic run ends), or nothing
  once finished; a call holds the sum over the trajectories, so the set is
  every such sum, up to ``batch`` times the tree's rows;
* the lazy cost simulation: each call holds at most one row per trajectory;
* then, as :class:`~specforest.target.Target` does, a call is split into
  ``max_rows`` chunks and each chunk padded up to the next of ``pad_rows``.

With one trajectory (latency, where a tuned tree pays) the set is small: the
digits model's RMC chain of 14 calls with 1 to 14 rows. With many trajectories
and a tree it has up to ``batch`` times as many counts, most of which a run
never meets; there :func:`pad_rows_for` gives padded sizes that bound them.

The warm-up calls the network only (a draft model, if any, is not warmed), on
copies of the run's own initial states and conditioning, under ``no_grad``; it
draws no random number, so the run's samples are bit for bit those it gives
without a warm-up.
"""

from __future__ import annotations

import functools
import math
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from .options import RUN_INPUTS, SamplerOptions
from .sampler import check_cond, prepare
from .target import Target
from .trees import TreeTables
from .validation import check_int, check_ints, check_states

__all__ = ["MAX_SHAPES", "network_rows", "pad_rows_for", "warm_up"]

MAX_SHAPES = 64
"""The most row counts :func:`warm_up` warms unless told otherwise (:func:`pad_rows_for` pads to fewer)."""


def _spec(options: dict):
    """The validated :class:`~specforest.sampler.RunSpec` of ``sample``'s shape-relevant options."""
    shaping = {k: v for k, v in options.items() if k in SamplerOptions.names()}
    return prepare(SamplerOptions.from_kwargs(**{**shaping, "model_kwargs": None, "record_deltas": False}))


_SHAPE_OPTIONS = tuple(n for n in SamplerOptions.names() if n not in ("churn", "model_kwargs", "record_deltas"))
_SHAPE_OPTIONS += ("process_group",)
# sample's options and inputs that change no call's shape: accepted so that a sample call's options pass as
# they are (``cond`` and ``model_kwargs`` are warm_up's own arguments, passed to the network as they are)
_IGNORED_OPTIONS = tuple(n for n in RUN_INPUTS if n not in ("cond", "process_group")) + (
    "record_deltas",
    "model_kwargs",
)


def _batches(batch: "int | Sequence[int]") -> tuple:
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return tuple(sorted(set(check_ints("batch", batch, 1, nonempty=True))))
    return (check_int("batch", batch, 1),)


def _check_options(options: dict) -> None:
    # (churn is required with the em chain, the default, and refused with another: SamplerOptions says so)
    unknown = sorted(set(options) - set(_SHAPE_OPTIONS) - set(_IGNORED_OPTIONS) - {"churn"})
    if unknown:
        raise TypeError(
            f"unexpected option(s) {', '.join(unknown)}; warm-up takes sample's options "
            f"churn, {', '.join(_SHAPE_OPTIONS)} (and ignores {', '.join(_IGNORED_OPTIONS)})"
        )


def _trajectory_rows(spec) -> list:
    """The rows one trajectory can add to a call of a fixed-tree run: 0 (finished), 1, and the rows its
    tree evaluates at each lookahead it can take (the lookaheads of :class:`~specforest.records.RunContext`)."""
    sde, L = spec.sde, spec.tree.L
    s = torch.arange(sde.steps)
    lookahead = torch.where(sde.stochastic, torch.clamp(sde.run_end[:-1] - s, max=L), 0)
    tt = TreeTables.of(spec.tree, spec.verify, torch.device("cpu"))
    looks = sorted(set(lookahead[lookahead > 0].tolist()))
    # the last step (into sigma 0) is deterministic: every trajectory takes one single-row call
    return sorted({0, 1} | {int(tt.rows_at[m]) for m in looks})


def _call_rows(batch: int, spec) -> list:
    """Every row count a call of a run of ``batch`` trajectories can hold, before splitting and padding."""
    if spec.tree is None:
        return [batch]  # the standard sampler: every trajectory every round
    if spec.lazy:
        # the lazy walk's calls hold the single-row trajectories, or one row per walking trajectory
        return list(range(1, batch + 1))
    per = _trajectory_rows(spec)
    reach = 1  # bit m set: the trajectories so far can add up to m rows (a bitset: fast for large batches)
    for _ in range(batch):
        reach = functools.reduce(operator.or_, (reach << r for r in per))
    return [m for m in range(1, reach.bit_length()) if reach >> m & 1]


def _split(M: int, chunk: Optional[int], pad: Optional[tuple]) -> set:
    """The network row counts of one call of ``M`` rows, as :class:`~specforest.target.Target` makes them."""
    if pad:
        chunk = min(chunk or pad[-1], pad[-1])
    chunk = chunk or M
    parts = {chunk} if M >= chunk else set()
    if M % chunk:
        parts.add(M % chunk)
    if pad:
        parts = {next(p for p in pad if p >= m) for m in parts}
    return parts


def network_rows(batch: "int | Sequence[int]", **options: Any) -> tuple:
    """The row counts a run can call the network with: ascending ints.

    Args:
        batch: trajectories of the run (``len(x)``), or several (runs of a few sizes: chunks,
            the last partial batch of :func:`specforest.generate`'s standard sampler).
        options: :func:`specforest.sample`'s options that shape the calls: ``churn`` (required with
            the em chain, the default), ``chain``, ``steps`` or ``sigmas``, ``grid``, ``shift``, ``tree`` (a fixed
            :class:`~specforest.trees.DraftTree` or ``None``), ``coupling``, ``draft``,
            ``prefetch``, ``verify``, ``max_rows``, ``lazy``, ``pad_rows``, ``process_group``
            (tree-parallel: the rows of this process's share of each call); a
            :class:`~specforest.latency.Tuned` unpacks into them (``**tuned``). ``seed``,
            ``generator``, ``sample_index``, ``callback``, ``progress`` and ``record_deltas``
            are accepted and ignored.

    Returns:
        The counts, each after ``max_rows`` splitting and ``pad_rows`` padding. Every call of the
        run has one of them; which of them a run meets depends on its random acceptances.

    Raises:
        ValueError / TypeError: naming the option (as :func:`specforest.sample` does); an
            adaptive tree (:class:`~specforest.trees.TreePolicy`) is refused, its trees being
            planned during the run.
    """
    _check_options(options)
    batches = _batches(batch)
    spec = _spec(options)
    if spec.policy is not None:
        raise ValueError("tree: an adaptive tree plans its trees during the run; warm-up needs a fixed DraftTree")
    world = 1
    if options.get("process_group") is not None:
        import torch.distributed as dist

        world = dist.get_world_size(options["process_group"])
    out: set = set()
    for b in batches:
        for M in _call_rows(b, spec):
            # tree-parallel: each process evaluates its equal share of the call (Target._split)
            out |= _split(-(-M // world), spec.max_rows, spec.pad_rows)
    return tuple(sorted(out))


def pad_rows_for(batch: "int | Sequence[int]", *, max_shapes: int = MAX_SHAPES, **options: Any) -> Optional[list]:
    """``pad_rows`` that keep a run's distinct row counts within ``max_shapes``, or ``None`` when they are.

    Where the run (``options``, as in :func:`network_rows`, with their ``pad_rows``) can
    already meet at most ``max_shapes`` row counts, padding would only add rows: ``None``.
    Otherwise (many trajectories on a tree), the sizes ``ceil(2 ** (k / 4))`` up to the
    largest call (at most ``max_rows``): a padded call holds at most 19% more rows, 9% on
    average, and a call of ``n`` rows meets one of about ``4 log2(n)`` sizes (40 at 1,000 rows).
    Padding changes no sample's law (the padding rows' outputs are dropped) and, for a model
    whose rows do not depend on their batch, no bit.

    Raises:
        ValueError / TypeError: as :func:`network_rows`, and if ``max_shapes`` is not an int >= 1.
    """
    max_shapes = check_int("max_shapes", max_shapes, 1)
    rows = network_rows(batch, **options)
    if len(rows) <= max_shapes:
        return None
    top = rows[-1]
    sizes, k = set(), 0
    while (size := math.ceil(2 ** (k / 4))) < top:
        sizes.add(size)
        k += 1
    return sorted(sizes | {top})


@torch.inference_mode()
def warm_up(
    model: Callable[..., torch.Tensor],
    x: torch.Tensor,
    *,
    cond: Optional[dict] = None,
    model_kwargs: Optional[dict] = None,
    batch: "Optional[int | Sequence[int]]" = None,
    max_shapes: int = MAX_SHAPES,
    repeats: int = 1,
    **options: Any,
) -> float:
    """Call ``model`` once at each row count a run of ``sample(model, x, **options)`` can call it with.

    ``warm_up(model, x, steps=100, churn=0.3, cond=cond, **tuned)`` before
    ``sample(model, x, steps=100, churn=0.3, cond=cond, seed=0, **tuned)`` moves the
    network's one-off costs of each new batch shape out of the run. The calls go through
    the sampler's own :class:`~specforest.target.Target` (same reshaping, conditioning rows,
    ``max_rows`` chunks and ``pad_rows`` padding), on rows of ``x`` cycled and the grid's
    middle noise level, under ``no_grad``; their outputs are dropped. No random number is
    drawn (the global generator's state is left as it was), so the run's samples are the
    same bit for bit.

    Args:
        model: the target velocity ``v(x, sigma, **cond, **model_kwargs)``, as in :func:`specforest.sample`.
        x: ``(n, *shape)`` the run's initial states (their shape, dtype and device, and rows to call with).
        cond: the run's per-trajectory conditioning, tensors ``(n, ...)``.
        model_kwargs: the run's extra keyword arguments of every call.
        batch: the trajectories per run (default ``n``), or a list of sizes for runs of several
            (see :func:`network_rows`).
        max_shapes: refuse to warm more row counts than this (pass ``pad_rows``, e.g. from
            :func:`pad_rows_for`, to the warm-up and the run).
        repeats: calls per row count (1 suffices on a CPU; a ``torch.compile(mode="reduce-overhead")``
            model records its CUDA graph on a later call than its first: 3).
        options: the run's options, as in :func:`network_rows`.

    Returns:
        The seconds spent (on CUDA, after synchronizing).

    Raises:
        ValueError / TypeError: naming the parameter: a bad ``x``, ``cond``, option,
            ``repeats`` or ``max_shapes``, or more row counts than ``max_shapes``.
    """
    t0 = time.perf_counter()
    if not callable(model):
        raise TypeError("model must be callable as model(x, sigma)")
    check_states(x)
    max_shapes = check_int("max_shapes", max_shapes, 1)
    repeats = check_int("repeats", repeats, 1)
    if model_kwargs is not None and not isinstance(model_kwargs, dict):
        raise TypeError(f"model_kwargs must be a dict or None, got {type(model_kwargs).__name__}")
    n = x.shape[0]
    cond = check_cond(cond, n)
    rows = network_rows(n if batch is None else batch, **options)
    if len(rows) > max_shapes:
        raise ValueError(
            f"the run can call the network with {len(rows)} row counts (from {rows[0]} to {rows[-1]}), more than "
            f"max_shapes={max_shapes}: pass pad_rows (specforest.warmup.pad_rows_for gives sizes) to the warm-up "
            "and the run, or raise max_shapes"
        )
    spec = _spec(options)
    shape, dev = tuple(x.shape[1:]), x.device
    work = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    target = Target(model, shape, work, spec.max_rows, cond, model_kwargs or {}, dev, pad_rows=spec.pad_rows)
    flat = x.reshape(n, -1).to(work)
    sig = spec.sde.sigmas
    level = float(sig[len(sig) // 2])
    for m in rows:
        traj = torch.arange(m, device=dev) % n
        xs, sigma = flat[traj], torch.full((m,), level, dtype=work, device=dev)
        for _ in range(repeats):
            target(xs, sigma, traj)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0
