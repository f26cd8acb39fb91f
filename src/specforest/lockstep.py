"""The standard sampler's round: every trajectory takes its exact Euler-Maruyama transition, in lockstep.

A run without a tree (``tree=None``) is the standard sampler, and its round is
:func:`lockstep_round`, chosen once when the context is made
(:func:`specforest.engine.make_context`). Its rule: **every trajectory is at
step** ``state.rounds``. They all start at step 0 (:func:`~specforest.engine.init_state`)
and each round moves every one of them one step, deterministic steps included,
so the run ends after exactly ``T`` rounds; a lockstep run is never restarted
row by row (:func:`specforest.generate` starts a new run when its trajectories
all finish together). What follows from the rule:

* a round reads nothing back from the device (no host-device synchronization):
  its sizes are known;
* a step's noise levels and coefficients are the same for every trajectory:
  0-d views and a ``(batch,)`` row made once per run (:func:`lockstep_steps`);
* the counters count a Python int (:meth:`~specforest.records.Counters.with_lockstep_round`):
  every trajectory evaluated one row;
* the noise of several steps is drawn in one pass (:func:`_exact_noise`).
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from . import streams
from .records import LockstepStep, NoiseBlock, RunContext, RunState
from .sde import StepTables
from .target import ALL_ROWS

__all__ = ["NOISE_BLOCK_ELEMENTS", "lockstep_round", "lockstep_steps"]

NOISE_BLOCK_ELEMENTS = 1 << 20
"""The lockstep round draws its noise for up to 16 steps at once, up to this many numbers."""


def lockstep_steps(tab: StepTables, batch: int) -> tuple:
    """Per step, what a lockstep round of ``batch`` trajectories reads (:class:`~specforest.records.LockstepStep`):
    views made in a few ops per run (the noise levels of every step, ``(T + 1, batch)``, made once),
    so a step gathers nothing."""
    sig = tab.sig[:, None].expand(-1, batch).contiguous().unbind(0)
    c, a, scale = tab.c.unbind(0), tab.a.unbind(0), tab.scale.unbind(0)
    past = tab.past.unbind(0) if tab.history else (None,) * len(c)
    return tuple(LockstepStep(sig=sig[s], c=c[s], a=a[s], scale=scale[s], past=past[s]) for s in range(len(c)))


def _exact_noise(ctx: RunContext, state: RunState) -> tuple[torch.Tensor, NoiseBlock]:
    """The ``(batch, D)`` noise of this round's step, and the block it was read from.

    Every trajectory is at step ``state.rounds``. The numbers are those of one
    draw per step (each is a function of its key, :mod:`~specforest.streams`),
    drawn for several steps in one pass of the mixer: a draw costs about 20
    tensor ops whatever its size, half of the lockstep round's ops.
    """
    s, block = state.rounds, state.noise
    if ctx.noise is not None:
        return ctx.noise(s).reshape(state.x.shape).to(ctx.work), block
    if block is None or not block.first <= s < block.first + block.noise.shape[0]:
        batch, D = state.x.shape
        n = max(1, min(16, NOISE_BLOCK_ELEMENTS // (batch * D)))
        block = NoiseBlock(first=s, noise=streams.normal(state.keys[:, s : s + n].T, D, ctx.work, streams.TAG_EXACT))
    return block.noise[s - block.first], block


def lockstep_round(ctx: RunContext, state: RunState) -> Optional[RunState]:
    """One round of the standard sampler: every trajectory, at step ``state.rounds``, takes its
    exact transition (scale 0 on deterministic steps); ``None`` after ``T`` rounds.

    The mean is ``tab.mean``'s ``addcmul(c v, a, y)`` with the step's 0-d coefficients (the same numbers).
    """
    s = state.rounds
    if s >= ctx.T:
        return None
    clock = time.perf_counter
    t0 = clock()
    at = ctx.lockstep_steps[s]
    inside = ctx.target.seconds
    # every trajectory is at step s: a chain of several stages makes the calls this step uses
    calls = ctx.tab.calls_at(s)
    v = ctx.tab.velocity(ctx.target, state.x, state.step, ctx.rows_all, sig=at.sig, rows_key=ALL_ROWS, upto=calls)
    t1 = clock()
    inside = ctx.target.seconds - inside
    noise, block = _exact_noise(ctx, state)
    mean = torch.addcmul(at.c * v, at.a, state.x)
    carried = state.carried
    if at.past is not None:
        # a multistep chain: the mean reads the carried predictions, and this step's is carried on
        mean = carried.added_to(mean, at.past)
        carried = carried.pushed(ctx.tab.carry(state.x, v, state.step))
    x = torch.addcmul(mean, at.scale, noise)
    step = state.step + 1
    counters = state.counters.with_lockstep_round(calls)
    t2 = clock()
    sched, drafted, evaluated, walked, committed = state.seconds
    return RunState(
        x=x,
        step=step,
        keys=state.keys,
        pre=state.pre,
        counters=counters,
        draft_state=state.draft_state,
        records=state.records,
        rounds=s + 1,
        draft_calls=state.draft_calls,
        sweep_calls=state.sweep_calls,
        stage_calls=state.stage_calls + calls - 1,
        noise=block,
        draft_bad=state.draft_bad,
        carried=carried,
        memory=state.memory,
        seconds=(sched, drafted, evaluated + (t1 - t0 - inside), walked, committed + (t2 - t1)),
    )
