"""The public sampler: :func:`sample` validates, sets up a run and drives :mod:`specforest.engine`.

Each round, every unfinished trajectory contributes rows to **one** batched
target call and advances by what that call buys it: a deterministic step, the
fetch of its first root evaluation, or a speculative round on its draft tree
(draft, evaluate, walk with the coupling until the first rejection, commit).
The standard Euler-Maruyama sampler (no tree) runs the same loop over its own
round (:mod:`specforest.lockstep`). Trajectories run at their own steps; a
trajectory that has finished takes no rows. The loop knows neither the
coupling's nor the proposal's internals. The phases of a round and the
host-device synchronizations they need are in :mod:`specforest.engine`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from . import engine, streams
from .couplings import Coupling, get_coupling
from .drafts import Proposal, get_proposal
from .engine import PREFETCH_POLICIES
from .options import GRIDS, SamplerOptions, TunedFor, check_tuned_for, declared_options, options_sde, pad_sizes, resolve
from .records import RunContext
from .results import SampleResult, SampleStats, returned, stats_of
from .sde import GaussianChain
from .target import Target, outside_inference
from .trees import DraftTree, TreePolicy
from .validation import check_indices, check_seed, check_states, refuse_non_finite, working_dtype

__all__ = [
    "GRIDS",
    "PREFETCH_POLICIES",
    "RunSpec",
    "SampleResult",
    "SampleStats",
    "SamplerOptions",
    "TunedFor",
    "check_tuned_for",
    "pad_sizes",
    "prepare",
    "sample",
    "standard_sample",
]

VelocityFn = Callable[..., torch.Tensor]


def _sample_keys(generator, seed, sample_index, batch: int, device) -> torch.Tensor:
    """``(batch,)`` per-sample keys from a seed, a generator or a list of generators (see :func:`sample`)."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != batch or not all(isinstance(g, torch.Generator) for g in generator):
            raise ValueError(
                f"a list of generators must hold one torch.Generator per sample ({batch}), got {len(generator)} items"
            )
        if seed is not None:
            raise ValueError("give seed or a list of generators, not both")
        return streams.keys_from_generators(generator, device)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, a list of them or None, got {type(generator).__name__}")
    if seed is not None:
        seed = check_seed(seed)
        if generator is not None:
            raise ValueError("give seed or generator, not both")
    else:
        seed = streams.key_from_generator(generator)
    if sample_index is None:
        index = torch.arange(batch, device=device)
    else:
        index = check_indices(
            "sample_index", sample_index, length=batch, unique=True, device=device, per=" (one per row of x)"
        )
    return streams.sample_keys(seed, index)


def check_cond(cond, batch: int, model_kwargs: Optional[dict] = None) -> dict:
    """``cond`` as a dict of ``(batch, ...)`` tensors keyed by str, none of them also in ``model_kwargs``."""
    if cond is None:
        return {}
    if not isinstance(cond, dict):
        raise TypeError(
            f"cond must be a dict of tensors with one row per trajectory or None, got {type(cond).__name__}"
        )
    for k, v in cond.items():
        if not isinstance(k, str):
            raise TypeError(f"cond's keys must be str (keyword arguments of the model), got {k!r}")
        if not isinstance(v, torch.Tensor) or v.ndim < 1 or v.shape[0] != batch:
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"cond[{k!r}] must be a tensor with one row per trajectory ({batch}, ...), got {got}")
    both = sorted(set(cond) & set(model_kwargs or {}))
    if both:
        raise ValueError(f"cond and model_kwargs both give {both}: each keyword argument of the model comes from one")
    return dict(cond)


@dataclass(frozen=True)
class RunSpec:
    """What a run needs of its validated options (made by :func:`prepare` alone): the SDE, the coupling,
    a fresh draft, the tree or policy, and the record ``config`` of the result."""

    sde: GaussianChain
    coupling: Coupling
    proposal: Proposal
    tree: Optional[DraftTree]  # a fixed tree (None: standard sampler or a policy)
    policy: Optional[TreePolicy]
    L: int  # the deepest round
    prefetch: str
    verify: str
    lazy: bool
    record: bool
    max_rows: Optional[int]
    model_kwargs: dict
    config: dict
    pad_rows: Optional[tuple] = None

    def context(
        self,
        model: VelocityFn,
        shape: tuple,
        work: torch.dtype,
        device: torch.device,
        batch: int,
        cond: dict,
        group: Any = None,
        noise: Optional[Callable[[int], torch.Tensor]] = None,
    ) -> RunContext:
        """The engine's context for ``batch`` trajectories with conditioning ``cond``.

        Raises:
            ValueError: if the draft cannot serve states of ``shape`` or the model
                (:meth:`Proposal.check`).
        """
        self.proposal.check(tuple(shape), work, model)
        tab = self.sde.tables(device, work)
        # a row's evaluation keeps the deep features of each of its stages' calls (stages.evaluate)
        features = self.proposal.bind(model, tuple(shape), self.model_kwargs) * tab.stages
        target = Target(
            model,
            shape,
            work,
            self.max_rows,
            cond,
            self.model_kwargs,
            device,
            group=group,
            pad_rows=self.pad_rows,
            batch=batch,
            grid=tab.sig,
        )
        return engine.make_context(
            tab=tab,
            tab64=self.sde.tables(device, torch.float64),
            T=self.sde.steps,
            coupling=self.coupling,
            proposal=self.proposal,
            target=target,
            verify=self.verify,
            prefetch=self.prefetch,
            lazy=self.lazy,
            record=self.record,
            tree=self.tree,
            policy=self.policy,
            depth=self.L,
            shape=shape,
            work=work,
            device=device,
            batch=batch,
            features=features,
            noise=noise,
        )


_NAMED_IN_RECORD = (
    *("steps", "churn", "chain", "sigmas", "grid", "shift", "tree", "coupling", "draft", "prefetch", "verify"),
    *("lazy", "max_rows", "model_kwargs", "record_deltas", "pad_rows"),
)
"""The options :func:`prepare`'s record names itself (as the chain's parameters, the tree's repr, the mode, ...)
or leaves out (a run's call sizes, the model's keywords, what it keeps); each other option is recorded by
its declared key."""


def prepare(options: SamplerOptions) -> RunSpec:
    """The :class:`RunSpec` of validated options: the SDE, the coupling and a fresh draft of one run.

    The one builder of a :class:`RunSpec` (:func:`sample`, :func:`specforest.generate`, the warm-up).
    """
    o = options
    sde = options_sde(o)
    cp = get_coupling(o.coupling)
    proposal = get_proposal(o.draft)
    policy = o.tree if isinstance(o.tree, TreePolicy) else None
    fixed = o.tree if isinstance(o.tree, DraftTree) else None
    L = fixed.L if fixed is not None else (min(policy.max_depth, sde.steps) if policy is not None else 0)
    if policy is not None:
        L = max(L, policy.initial.L)
    config = dict(
        steps=sde.steps,
        chain=sde.name,
        **sde.params,
        grid="custom" if o.sigmas is not None else (o.schedule or o.grid),  # (a schedule makes the grid)
        shift=o.shift,
        tree=None if o.tree is None else repr(o.tree),
        budget=0 if o.tree is None else o.tree.budget,
        coupling=cp.name,
        draft=proposal.name,
        prefetch=o.prefetch,
        verify=o.verify,
        mode="lazy" if o.lazy else "full",
    )
    # every other declared option under its record key: a new field is in every run's record as it is
    config.update({d.key: getattr(o, n) for n, d in declared_options(type(o)).items() if n not in _NAMED_IN_RECORD})
    return RunSpec(
        sde=sde,
        coupling=cp,
        proposal=proposal,
        tree=fixed,
        policy=policy,
        L=L,
        prefetch=o.prefetch,
        verify=o.verify,
        lazy=o.lazy,
        record=o.record_deltas,
        max_rows=o.max_rows,
        model_kwargs=o.model_kwargs or {},
        config=config,
        pad_rows=pad_sizes(o.pad_rows),
    )


@torch.inference_mode()
def sample(
    model: VelocityFn,
    x: torch.Tensor,
    options: Optional[SamplerOptions] = None,
    *,
    generator: "Optional[torch.Generator | Sequence[torch.Generator]]" = None,
    seed: Optional[int] = None,
    sample_index: Optional[torch.Tensor] = None,
    callback: Optional[Callable[[dict], None]] = None,
    progress: bool = False,
    cond: Optional[dict] = None,
    process_group: Any = None,
    tuned_for: Optional[TunedFor] = None,
    noise: Optional[Callable[[int], torch.Tensor]] = None,
    **option_kwargs: Any,
) -> SampleResult:
    """Sample a stochastic sampler's chain exactly, speculating on a draft tree.

    The output has the law of the standard sampler of the run's ``chain`` on the
    same grid (the paper's Euler-Maruyama chain by default, eq. 6; Euler
    ancestral, EDM's churned Euler, DDPM, DDIM or LCM with ``chain=``,
    ``docs/chains.md``) for any tree, coupling, draft and prefetch policy;
    those only change how many sequential target calls (NFE) it takes. Runs
    without autograd: the sampler's own arithmetic under
    ``torch.inference_mode`` (its small ops dispatch faster there), the model,
    a draft model and ``callback`` under ``torch.no_grad`` in normal mode
    (:func:`~specforest.target.outside_inference`); the samples and statistics
    returned are normal tensors that never carry a graph.

    Randomness: every draw is addressed by (seed, sample index, where in the
    run), see :mod:`specforest.streams`. Sample ``i`` is therefore the same
    whatever the batch it runs in, the order of the samples, ``max_rows`` and
    ``lazy`` (bitwise when the model's own results do not depend on its batch).
    ``draft="auto"`` and adaptive trees learn from the whole batch, so with
    them a sample depends on its batch companions (its law does not).

    Host-device synchronizations: at most two per full-mode round (one read of
    the round's sizes, one for the rejected walks), none in the standard
    sampler; the list, and the options that add some, is in
    :mod:`specforest.engine`.

    Args:
        model: the target velocity ``v(x, sigma, **cond, **model_kwargs)`` on the
            linear path, ``x: (M, *shape)``, ``sigma: (M,)`` -> ``(M, *shape)``.
        x: ``(batch, *shape)`` initial states at ``sigmas[0]`` (pure noise at 1;
            :func:`specforest.streams.randn` makes them per sample).
        options: the sampler's options, a :class:`~specforest.options.SamplerOptions`
            (which documents each); or give them as keywords (``**option_kwargs``:
            ``steps``, ``churn`` (required with the default ``em`` chain), ``chain``, ``sigmas``,
            ``grid``, ``shift``, ``tree``,
            ``coupling``, ``draft``, ``prefetch``, ``verify``, ``max_rows``,
            ``model_kwargs``, ``lazy``, ``record_deltas``, ``pad_rows``). Given both,
            the keywords override the object's fields (``dataclasses.replace``).
        generator: the run's seed is one draw from it (so a given generator
            state reproduces the run); or a list of ``batch`` generators, one per
            sample (diffusers' convention): sample ``i``'s streams come from
            ``generator[i]`` alone. ``None`` (and no ``seed``): fresh entropy.
        seed: the run's seed, an int in ``[0, 2**64)`` (instead of ``generator``).
        sample_index: ``(batch,)`` global indices of the rows of ``x`` (default
            ``0..batch-1``): row ``b`` draws the streams of sample
            ``sample_index[b]``, so a share of a larger job reproduces it. Distinct
            integers in ``[0, 2**63)``: two rows of one index would be one sample twice.
        callback: called after each round with a dict of named tensors
            (``round``, ``step``, ``x``, ``committed``).
        progress: show a progress bar of the slowest trajectory's step.
        cond: per-trajectory conditioning: tensors ``(batch, ...)`` (class labels,
            prompt embeddings); every call gets the rows of the trajectories
            its states belong to.
        process_group: tree-parallel verification over a ``torch.distributed``
            process group: every process runs the same call with the same
            states and seed; each round's target rows are split across the
            group's processes and the velocities gathered, so every process
            commits the same states. The states and keys are broadcast from
            the group's first process at the start. ``None``: one process.
        tuned_for: the run a tuned configuration was chosen for (:class:`TunedFor`), set by
            ``sample(model, x, **tuned)`` with a :class:`~specforest.latency.Tuned`: without
            ``steps`` and ``sigmas`` the run takes its steps; a run whose steps, churn or batch
            (rows of ``x``) differ is refused. ``tuned.options()`` passes the configuration alone.
        noise: the standard sampler's noise from the caller (``tree=None`` only): ``noise(n)``
            returns step ``n``'s standard normal draws ``(batch, *shape)``, called once per step in
            order, and ``noise(-1)`` the start's for a chain that has one (``euler``). For parity with
            another implementation fed the same draws (the k-diffusion drop-ins' ``noise_sampler``).

    Returns:
        :class:`SampleResult` with ``samples`` ``(batch, *shape)`` and ``stats``.

    Raises:
        ValueError / TypeError: on invalid arguments, naming the parameter (a keyword that is
            not an option: a ``TypeError`` listing the options); on a run that differs from
            ``tuned_for``, listing the differences.
        TypeError: if the model returns a tensor that is not floating-point (naming the model and the dtype).
        FloatingPointError: if the model returns NaN or inf (naming the model, the step and the rows).
    """
    t0 = time.perf_counter()
    if not callable(model):
        raise TypeError("model must be callable as model(x, sigma)")
    check_states(x)
    spec = prepare(resolve(options, option_kwargs, tuned_for=tuned_for, batch=x.shape[0]))
    shape = tuple(x.shape[1:])
    batch, D = x.shape[0], math.prod(shape)
    dev = x.device
    work = working_dtype(x.dtype)
    keys = _sample_keys(generator, seed, sample_index, batch, dev)
    cond = check_cond(cond, batch, spec.model_kwargs)
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be None or callable as callback(dict), got {type(callback).__name__}")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool, got {type(progress).__name__}")
    x0 = x.reshape(batch, D).to(work, copy=True)
    if process_group is not None:
        # tree-parallel: every process starts from the first process's states and keys
        # (a process given another seed, or none, would otherwise drift apart silently)
        from .distributed import broadcast_

        broadcast_(keys, process_group)
        broadcast_(x0, process_group)
    if noise is not None:
        if spec.tree is not None or spec.policy is not None:
            raise ValueError(
                "noise (a noise sampler) was given with a tree: a speculative run draws each node's noise from "
                "seed, keyed by sample and node, so that drafts and the exact chain share it; it cannot replay a "
                "caller's sequence. Pass seed or generator, or tree=None"
            )
        if not callable(noise):
            raise TypeError(f"noise must be callable as noise(step) -> (batch, *shape) tensor, got {type(noise)}")
    ctx = spec.context(model, shape, work, dev, batch, cond, group=process_group, noise=noise)
    target, T = ctx.target, spec.sde.steps
    state = engine.init_state(ctx, x0, keys)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=T, unit="step", desc="sampling")
    while True:
        prev = state.step
        nxt = engine.run_round(ctx, state)
        if nxt is None:
            break
        state = nxt
        if bar is not None:
            bar.n = int(state.step.min())
            bar.refresh()
        if callback is not None:
            with outside_inference():
                callback(
                    {
                        "round": state.rounds,
                        "step": state.step.clone(),
                        "x": state.x.reshape(batch, *shape).clone(),
                        "committed": state.step - prev,
                    }
                )
    if bar is not None:
        bar.close()
    xs = state.x
    target.check_finite()
    refuse_non_finite(not bool(torch.isfinite(xs).all()))
    stats = stats_of(state, T, standard_calls=spec.sde.standard_calls)
    if spec.record:
        stats.deltas = torch.cat(state.records) if state.records else torch.zeros(0, 4, dtype=torch.float64)
    stats.target_seconds = target.total_seconds()
    stats.phase_seconds = state.phase_seconds
    stats.wall_seconds = time.perf_counter() - t0
    # the run's tensors are inference tensors; the caller gets normal ones
    with outside_inference():
        samples = xs.reshape(batch, *shape).to(x.dtype).clone()
    return SampleResult(samples, returned(stats), dict(spec.config))


def standard_sample(
    model: VelocityFn, x: torch.Tensor, options: Optional[SamplerOptions] = None, **kwargs: Any
) -> SampleResult:
    """The standard Euler-Maruyama sampler: :func:`sample` with ``tree=None`` (over ``options``' tree)."""
    kwargs["tree"] = None
    return sample(model, x, options, **kwargs)
