"""Continuous batching: many samples through a fixed number of slots, each slot refilled as it finishes.

A speculative trajectory takes a random number of rounds, so a fixed batch
drains to a few stragglers whose calls are nearly empty. :func:`generate`
keeps up to ``batch`` trajectories in flight: the round a trajectory finishes,
its slot takes the next index of the job (new state at step 0, new random
streams, new conditioning) and the next call is full again. Because every
random number is addressed by (seed, sample index, place) (:mod:`specforest.streams`),
sample ``i`` is the same whatever slot, batch size or order it runs in
(bitwise for a batch-invariant model; ``draft="auto"`` and adaptive trees
learn from the whole batch, so with them only the law is invariant).

Host-device synchronizations: those of the rounds (:mod:`specforest.engine`)
plus one read per round (the finished slots with the NaN flags; none before
round ``T`` for the standard sampler); a refill copies the new indices'
states and checks ``make_x``'s output once (its shape at once, its finiteness
at that one read, so a NaN from ``make_x`` is not blamed on the model).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from . import engine, streams
from .distributed import broadcast_
from .options import SamplerOptions, TunedFor, resolve
from .records import RunContext, RunState
from .results import SampleStats, returned, stats_of
from .sampler import RunSpec, VelocityFn, prepare
from .target import outside_inference
from .validation import check_indices, check_int, check_seed, is_int, refuse_non_finite, working_dtype

__all__ = ["MAX_COUNT", "Finished", "Generation", "GenerationStats", "generate"]

MAX_COUNT = 2**63 - 1
"""The largest ``count`` of :func:`generate`: its indices ``0..count-1`` are int64 sample indices
(made as the slots take them, so a large count holds no memory)."""


@dataclass(frozen=True)
class Finished:
    """Samples that finished in one round.

    Attributes:
        index: ``(n,)`` long global indices of the samples.
        samples: ``(n, *shape)`` final states (the dtype of ``make_x``'s states).
        stats: their :class:`~specforest.sampler.SampleStats` rows (``nfe`` ``(n,)`` and so on;
            ``calls`` is the number of rounds run so far).
    """

    index: torch.Tensor
    samples: torch.Tensor
    stats: SampleStats


@dataclass
class GenerationStats:
    """How the slots were used, updated while :class:`Generation` is iterated.

    Attributes:
        rounds: target calls made.
        slot_rounds: the sum over rounds of the slots holding an unfinished trajectory.
        slots: the number of slots ``batch``.
        finished: samples produced.
        wall_seconds: wall time of the iteration so far.
        target_seconds: time inside the target calls.
    """

    rounds: int = 0
    slot_rounds: int = 0
    slots: int = 0
    finished: int = 0
    wall_seconds: float = 0.0
    target_seconds: float = 0.0

    @property
    def occupancy(self) -> float:
        """Mean fraction of the slots busy per round (NaN before the first round)."""
        return self.slot_rounds / (self.rounds * self.slots) if self.rounds else math.nan


class Generation:
    """An iterable over :class:`Finished` batches; its :attr:`stats` fill in as it runs.

    Made by :func:`generate`; iterate it once.
    """

    def __init__(
        self,
        model: VelocityFn,
        spec: RunSpec,
        indices: "torch.Tensor | int",
        make_x: Callable[[torch.Tensor], torch.Tensor],
        make_cond: Optional[Callable[[torch.Tensor], dict]],
        batch: int,
        seed: int,
        process_group: Any,
    ) -> None:
        # a count stands for 0..count-1, made as the slots take them: a job of 10**12 samples holds no index
        self.indices = indices
        self.count = indices if isinstance(indices, int) else len(indices)
        self.model, self.spec = model, spec
        self.make_x, self.make_cond = make_x, make_cond
        self.batch, self.seed, self.group = batch, seed, process_group
        self.stats = GenerationStats(slots=min(batch, self.count))
        self._used = False

    def _take(self, start: int, stop: int) -> torch.Tensor:
        """The job's indices ``start..stop-1`` in its order, ``(stop - start,)`` long."""
        if isinstance(self.indices, int):
            return torch.arange(start, stop)
        return self.indices[start:stop]

    def _states(self, idx: torch.Tensor, first: bool) -> "tuple[torch.Tensor, dict]":
        with outside_inference():
            x = self.make_x(idx)
        if not isinstance(x, torch.Tensor) or x.ndim < 2 or x.shape[0] != len(idx):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"make_x must return a tensor (n, *shape) with one row per index ({len(idx)}), got {got}")
        if first:
            if not x.is_floating_point() or not bool(torch.isfinite(x).all()):
                raise ValueError("make_x must return finite floating-point states")
        elif (tuple(x.shape[1:]), x.dtype, x.device) != (self._shape, self._dtype, self._device):
            raise ValueError(
                f"make_x returned states {tuple(x.shape[1:])} {x.dtype} on {x.device}, but its first call "
                f"returned {self._shape} {self._dtype} on {self._device}"
            )
        with outside_inference():
            cond = {} if self.make_cond is None else self.make_cond(idx)
        if not isinstance(cond, dict) or any(
            not isinstance(k, str) or not isinstance(v, torch.Tensor) or v.shape[:1] != (len(idx),)
            for k, v in cond.items()
        ):
            raise ValueError(
                f"make_cond must return a dict of tensors with one row per index ({len(idx)}), keyed by str"
            )
        both = sorted(set(cond) & set(self.spec.model_kwargs))
        if both:
            raise ValueError(f"make_cond and model_kwargs both give {both}: each keyword of the model comes from one")
        if not first:
            # checked at the round's one read, before the model's own flag (which these states would set)
            self._bad_x = self._bad_x | ~torch.isfinite(x).all()
        return x, cond

    def _start(self, idx: torch.Tensor) -> "tuple[RunContext, RunState, torch.Tensor]":
        x, cond = self._states(idx, first=True)
        dev = x.device
        self._bad_x = torch.zeros((), dtype=torch.bool, device=dev)
        self._dtype, self._shape, self._device = x.dtype, tuple(x.shape[1:]), x.device
        self._work = working_dtype(x.dtype)
        keys = streams.sample_keys(self.seed, idx.to(dev))
        x0 = x.reshape(len(idx), -1).to(self._work, copy=True)
        if self.group is not None:
            broadcast_(keys, self.group)
            broadcast_(x0, self.group)
        ctx = self.spec.context(self.model, self._shape, self._work, dev, len(idx), cond, group=self.group)
        state = engine.init_state(ctx, x0, keys)
        return ctx, state, idx.to(dev)

    def _refill(self, ctx: RunContext, state: RunState, slot_idx: torch.Tensor, slots: torch.Tensor, new: torch.Tensor):
        """Slots ``slots`` restart at step 0 as samples ``new``: their states, keys and counters
        (:meth:`~specforest.records.RunState.restart`) and their conditioning."""
        x, cond = self._states(new, first=False)
        dev = ctx.device
        slots, new = slots.to(dev), new.to(dev)
        keys = streams.sample_keys(self.seed, new)
        x = x.reshape(len(new), -1).to(self._work, copy=True)
        if self.group is not None:
            broadcast_(keys, self.group)
            broadcast_(x, self.group)
        ctx.target.set_rows(slots, cond)
        x = engine.chain_start(ctx, x, keys)
        return state.restart(slots, x, keys), slot_idx.index_copy(0, slots, new)

    @torch.inference_mode()
    def __iter__(self) -> Iterator[Finished]:
        # the decorator re-enters per step of a generator: the caller's loop keeps its own mode; the
        # model and make_x / make_cond run in normal mode without grad, and what is yielded is normal
        if self._used:
            raise RuntimeError("a Generation is iterated once; call generate again")
        self._used = True
        n = self.count
        if n == 0:
            return
        t0 = time.perf_counter()
        T = self.spec.sde.steps
        slots = self.stats.slots
        ctx, state, slot_idx = self._start(self._take(0, slots))
        live = torch.ones(slots, dtype=torch.bool, device=ctx.device)
        n_live, nxt_i, seconds = slots, slots, 0.0
        while n_live:
            nxt = engine.run_round(ctx, state)
            if nxt is not None:
                state = nxt
                self.stats.rounds += 1
                self.stats.slot_rounds += n_live
            if ctx.lockstep and nxt is not None and state.rounds < T:
                continue  # a lockstep run's trajectories all finish at round T: nothing to read before
            done = (state.step >= ctx.T) & live
            bad_x = (done & ~torch.isfinite(state.x).all(1)).any()
            # the one read of the round: finished slots, the target's NaN flag, non-finite finished states
            n_done, bad_target, bad_state, bad_made = engine.host_read(
                torch.stack([done.sum(), ctx.target.bad.long(), bad_x.long(), self._bad_x.long()])
            )
            if bad_made:
                raise ValueError("make_x must return finite floating-point states (a refill got NaN or inf)")
            if bad_target:
                ctx.target.raise_not_finite()
            refuse_non_finite(bool(bad_state))
            if not n_done:
                continue
            rows = torch.nonzero_static(done, size=n_done)[:, 0]
            stats = stats_of(state, T, rows, self.spec.sde.standard_calls)
            self.stats.finished += n_done
            index = slot_idx[rows].cpu()
            with outside_inference():
                samples = state.x[rows].reshape(n_done, *self._shape).to(self._dtype).clone()
            yield Finished(index, samples, returned(stats))
            live = live.index_fill(0, rows, False)
            n_live -= n_done
            k = min(n_done, n - nxt_i)
            if k == 0:
                continue
            new = self._take(nxt_i, nxt_i + k)
            nxt_i += k
            if n_live == 0:
                # every slot is free (the standard sampler's trajectories always finish together):
                # a fresh run, with fewer slots at the end of the job
                seconds += ctx.target.total_seconds()
                ctx, state, slot_idx = self._start(new)
                live = torch.ones(k, dtype=torch.bool, device=ctx.device)
            else:
                state, slot_idx = self._refill(ctx, state, slot_idx, rows[:k], new)
                live = live.index_fill(0, rows[:k], True)
            n_live += k
        self.stats.target_seconds = seconds + ctx.target.total_seconds()
        self.stats.wall_seconds = time.perf_counter() - t0


def generate(
    model: VelocityFn,
    *,
    count: Optional[int] = None,
    indices: "Optional[Sequence[int] | torch.Tensor]" = None,
    make_x: Callable[[torch.Tensor], torch.Tensor],
    make_cond: Optional[Callable[[torch.Tensor], dict]] = None,
    seed: int,
    batch: Optional[int] = None,
    options: Optional[SamplerOptions] = None,
    process_group: Any = None,
    tuned_for: Optional[TunedFor] = None,
    **option_kwargs: Any,
) -> Generation:
    """Sample many indices through ``batch`` slots, refilling each slot the round it finishes.

    Sample ``i`` starts from ``make_x(i)`` and draws the streams of ``(seed, i)``,
    so it equals ``sample(model, make_x([i]), seed=seed, sample_index=[i], ...)``
    whatever the slot, the batch size or the order of work (see the module
    docstring for the exceptions). Iterate the result for :class:`Finished`
    batches in the order the samples finish.

    Args:
        model: the target velocity, as in :func:`specforest.sample`.
        count: produce indices ``0..count-1``, ``0 <= count <= 2**63 - 1`` (:data:`MAX_COUNT`; the
            indices are made as the slots take them, so any count holds the same memory); or give ``indices``.
        indices: the global indices to produce (e.g. this process's share of a job,
            :func:`specforest.distributed.shard`).
        make_x: ``make_x(idx (n,) long) -> (n, *shape)`` initial states at noise level 1
            (e.g. ``lambda i: streams.randn(seed, i, shape)``).
        make_cond: ``make_cond(idx) -> dict`` of per-trajectory conditioning, one row per index.
        seed: the job's seed (an int).
        batch: slots in flight, ``>= 1`` (default 64, or the tuned batch with ``tuned_for``).
        options: the sampler's options (:class:`~specforest.options.SamplerOptions`), or give them
            as keywords (``**option_kwargs``, as in :func:`specforest.sample`; the keywords override
            the object's fields). ``record_deltas`` is :func:`specforest.sample`'s alone. With
            ``tree=None`` (the standard sampler) the draft's options (``coupling``, ``draft``,
            ``verify``, ``prefetch``, ``lazy``) are taken and unused, as by :func:`specforest.sample`:
            a tuned configuration that chose the standard sampler carries them.
        process_group: tree-parallel verification (see :func:`specforest.sample`);
            every process of the group must make the same call.
        tuned_for: the run a tuned configuration was chosen for, as in :func:`specforest.sample`
            (``generate(model, ..., **tuned)``); the slots ``batch`` are its batch.

    Returns:
        A :class:`Generation`: iterate it; its ``stats`` (rounds, occupancy, time)
        fill in as it runs.

    Raises:
        ValueError / TypeError: naming the parameter.
        FloatingPointError: (while iterating) if the model returns NaN or inf.
    """
    if (count is None) == (indices is None):
        raise ValueError("give exactly one of count (an int >= 0) and indices")
    if not callable(model):
        raise TypeError("model must be callable as model(x, sigma, **cond)")
    if count is not None:
        if is_int(count) and count > MAX_COUNT:
            raise ValueError(f"count must be an int >= 0 and <= 2**63 - 1 (a sample index is an int64), got {count}")
        idx = check_int("count", count, 0)
    else:
        idx = check_indices("indices", indices, unique=True).cpu()
    seed = check_seed(seed)
    if batch is None:
        batch = 64 if tuned_for is None or not isinstance(tuned_for, TunedFor) else tuned_for.batch
    batch = check_int("batch", batch, 1)
    opts = resolve(options, option_kwargs, tuned_for=tuned_for, batch=batch, batch_name="slots")
    if opts.record_deltas:
        raise TypeError("generate does not take record_deltas=True: its Finished stats carry no deltas (use sample)")
    if not callable(make_x):
        raise TypeError("make_x must be callable as make_x(indices) -> (n, *shape) states")
    if make_cond is not None and not callable(make_cond):
        raise TypeError("make_cond must be None or callable as make_cond(indices) -> dict")
    return Generation(model, prepare(opts), idx, make_x, make_cond, batch, seed, process_group)
