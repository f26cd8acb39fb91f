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

import functools
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from . import engine, streams
from .couplings import Coupling, get_coupling
from .engine import PREFETCH_POLICIES
from .proposals import Proposal, get_proposal
from .records import RunContext
from .results import SampleResult, SampleStats, returned, stats_of
from .sde import ReverseSDE, flow_match_grid, uniform_grid
from .target import Target, outside_inference
from .trees import VERIFY_MODES, DraftTree, TreePolicy
from .validation import check_states

__all__ = [
    "PREFETCH_POLICIES",
    "RunSpec",
    "SampleResult",
    "SampleStats",
    "TunedFor",
    "check_tuned_for",
    "prepare",
    "sample",
    "standard_sample",
]

GRIDS = ("flow_match", "uniform")

VelocityFn = Callable[..., torch.Tensor]


def _as_sigmas(sigmas) -> torch.Tensor:
    """An explicit grid as a float64 tensor, or an error naming ``sigmas``."""
    try:
        s = torch.as_tensor(sigmas)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"sigmas must be a (T + 1,) tensor of noise levels, got {type(sigmas).__name__}") from err
    if s.is_complex() or s.dtype == torch.bool:
        raise TypeError(f"sigmas must be a real tensor of noise levels, got {s.dtype}")
    if s.ndim != 1 or s.numel() < 2:
        raise ValueError(f"sigmas must be a 1-D tensor of T + 1 >= 2 noise levels, got shape {tuple(s.shape)}")
    return s.to(torch.float64)


def _make_sde(steps, sigmas, grid, shift, churn) -> ReverseSDE:
    if sigmas is None:
        if steps is None:
            raise ValueError("give steps (an int >= 1) or sigmas (a (T + 1,) tensor)")
        if grid not in GRIDS:
            raise ValueError(f"grid must be one of {GRIDS}, got {grid!r}")
        if type(steps) is int and type(shift) in (int, float) and type(churn) in (int, float):
            return _grid_sde(steps, grid, shift, churn)  # (anything else: the constructors name the bad value)
        sigmas = _grid_sigmas(steps, grid, shift)
    else:
        sigmas = _as_sigmas(sigmas)
        if steps is not None and int(steps) != len(sigmas) - 1:
            raise ValueError(f"steps={steps} disagrees with len(sigmas) - 1 = {len(sigmas) - 1}")
    return ReverseSDE(sigmas.to(torch.float64), churn)


@functools.lru_cache(maxsize=32)
def _grid_sde(steps: int, grid: str, shift: float, churn: float) -> ReverseSDE:
    """The SDE of a named grid, made once per (steps, grid, shift, churn): its tables are cached on it,
    so repeated runs (one image at a time, say) do not rebuild them."""
    return ReverseSDE(_grid_sigmas(steps, grid, shift).to(torch.float64), churn)


def _grid_sigmas(steps, grid: str, shift) -> torch.Tensor:
    return flow_match_grid(steps, shift=shift) if grid == "flow_match" else uniform_grid(steps, shift=shift)


def _sample_keys(generator, seed, sample_index, B: int, device) -> torch.Tensor:
    """``(B,)`` per-sample keys from a seed, a generator or a list of generators (see :func:`sample`)."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != B or not all(isinstance(g, torch.Generator) for g in generator):
            raise ValueError(
                f"a list of generators must hold one torch.Generator per sample ({B}), got {len(generator)} items"
            )
        if seed is not None:
            raise ValueError("give seed or a list of generators, not both")
        return streams.keys_from_generators(generator, device)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, a list of them or None, got {type(generator).__name__}")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if generator is not None:
            raise ValueError("give seed or generator, not both")
    else:
        seed = streams.key_from_generator(generator)
    if sample_index is None:
        index = torch.arange(B, device=device)
    else:
        try:
            index = torch.as_tensor(sample_index, device=device)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"sample_index must be {B} integers in [0, 2**63) (one per row of x)") from err
        if index.shape != (B,) or index.is_floating_point() or index.dtype == torch.bool:
            raise ValueError(f"sample_index must be {B} integers (one per row of x), got shape {tuple(index.shape)}")
        if bool((index < 0).any()):
            raise ValueError("sample_index must be non-negative")
    return streams.sample_keys(seed, index.long())


def _check_cond(cond, B: int, model_kwargs: Optional[dict] = None) -> dict:
    """``cond`` as a dict of ``(B, ...)`` tensors keyed by str, none of them also in ``model_kwargs``."""
    if cond is None:
        return {}
    if not isinstance(cond, dict):
        raise TypeError(
            f"cond must be a dict of tensors with one row per trajectory or None, got {type(cond).__name__}"
        )
    for k, v in cond.items():
        if not isinstance(k, str):
            raise TypeError(f"cond's keys must be str (keyword arguments of the model), got {k!r}")
        if not isinstance(v, torch.Tensor) or v.ndim < 1 or v.shape[0] != B:
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"cond[{k!r}] must be a tensor with one row per trajectory ({B}, ...), got {got}")
    both = sorted(set(cond) & set(model_kwargs or {}))
    if both:
        raise ValueError(f"cond and model_kwargs both give {both}: each keyword argument of the model comes from one")
    return dict(cond)


@dataclass(frozen=True)
class TunedFor:
    """The run a tuned configuration was chosen for, as :func:`sample` checks it.

    A :class:`~specforest.latency.Tuned` passes one as ``tuned_for`` with its
    options (``sample(model, x, **tuned)``): the measured choice holds only for the
    grid, churn and batch it was measured at.

    Attributes:
        steps: grid steps ``T``.
        batch: trajectories per run (rows of ``x``; slots of :func:`specforest.generate`).
        churn: the churn, or ``None`` where it was not recorded (files written before it was).
    """

    steps: int
    batch: int
    churn: Optional[float] = None


def check_tuned_for(
    tuned_for: Optional[TunedFor],
    *,
    steps: Optional[int],
    sigmas: Optional[torch.Tensor],
    churn: Any,
    batch: Optional[int],
    batch_name: str = "rows of x",
) -> Optional[int]:
    """The steps of a run given with ``tuned_for``: its own, or the tuned run's when neither ``steps``
    nor ``sigmas`` is given.

    Args:
        tuned_for: the tuned run (``None``: nothing is checked, ``steps`` is returned).
        steps, sigmas, churn: the run's options, as given to :func:`sample`.
        batch: the run's trajectories (``None``: not checked).
        batch_name: what ``batch`` counts, for the message.

    Raises:
        TypeError: if ``tuned_for`` is not a :class:`TunedFor`.
        ValueError: listing every difference between the run and the tuned one.
    """
    if tuned_for is None:
        return steps
    if not isinstance(tuned_for, TunedFor):
        raise TypeError(
            f"tuned_for must be a specforest.sampler.TunedFor (passed by sample(model, x, **tuned)) or None, "
            f"got {type(tuned_for).__name__}"
        )
    diffs = []
    run_steps = steps if sigmas is None else len(sigmas) - 1
    if run_steps is None:
        steps = tuned_for.steps
    elif run_steps != tuned_for.steps:
        diffs.append(f"steps {run_steps} (tuned for {tuned_for.steps})")
    if (
        tuned_for.churn is not None
        and isinstance(churn, (int, float))
        and not math.isclose(float(churn), tuned_for.churn, rel_tol=1e-9, abs_tol=1e-12)
    ):
        diffs.append(f"churn {churn:g} (tuned for {tuned_for.churn:g})")
    if batch is not None and batch != tuned_for.batch:
        diffs.append(f"{batch} {batch_name} (tuned for {tuned_for.batch})")
    if diffs:
        raise ValueError(
            "the tuned configuration was chosen for another run: "
            + "; ".join(diffs)
            + ". Run it as tuned, tune again for this run, or pass tuned.options() to run the configuration unchecked"
        )
    return steps


@dataclass(frozen=True)
class RunSpec:
    """The validated options of a run, shared by :func:`sample` and :func:`specforest.generate`."""

    sde: ReverseSDE
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
    ) -> RunContext:
        """The engine's context for ``batch`` trajectories with conditioning ``cond``."""
        target = Target(
            model, shape, work, self.max_rows, cond, self.model_kwargs, device, group=group, pad_rows=self.pad_rows
        )
        return engine.make_context(
            tab=self.sde.tables(device, work),
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
        )


def prepare(
    *,
    steps: Optional[int],
    churn: float,
    sigmas: Optional[torch.Tensor],
    grid: str,
    shift: float,
    tree: "Optional[DraftTree | TreePolicy]",
    coupling: "str | Coupling",
    draft: "str | Proposal | VelocityFn",
    prefetch: str,
    verify: str,
    max_rows: Optional[int],
    model_kwargs: Optional[dict],
    lazy: bool,
    record_deltas: bool,
    pad_rows: "Optional[str | Sequence[int]]" = None,
) -> RunSpec:
    """Validate the options of :func:`sample` (all but the states and randomness) into a :class:`RunSpec`.

    Raises:
        ValueError / TypeError: naming the parameter.
    """
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)):
        raise TypeError(f"steps must be an int >= 1, got {type(steps).__name__}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if prefetch not in PREFETCH_POLICIES:
        raise ValueError(f"prefetch must be one of {PREFETCH_POLICIES}, got {prefetch!r}")
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
        raise ValueError(f"max_rows must be None or an int >= 1, got {max_rows!r}")
    policy = tree if isinstance(tree, TreePolicy) else None
    if tree is not None and not isinstance(tree, (DraftTree, TreePolicy)):
        raise TypeError(
            f"tree must be a DraftTree (see specforest.trees), a TreePolicy (planning.AdaptiveTree) or None, "
            f"got {type(tree).__name__}"
        )
    fixed = None if policy is not None else tree
    if fixed is not None and fixed.L < 1:
        raise ValueError("tree must have depth L >= 1; use tree=None for the standard sampler")
    if not isinstance(lazy, bool):
        raise TypeError(f"lazy must be a bool, got {type(lazy).__name__}")
    if not isinstance(record_deltas, bool):
        raise TypeError(f"record_deltas must be a bool, got {type(record_deltas).__name__}")
    sde = _make_sde(steps, sigmas, grid, shift, churn)
    cp = get_coupling(coupling)
    if policy is not None and cp.structured_siblings:
        raise ValueError(f"coupling {cp.name!r} draws structured siblings; an adaptive tree needs i.i.d. children")
    if fixed is not None and cp.structured_siblings:
        k = fixed.num_children[fixed.internal]
        if (k != k[0]).any():
            raise ValueError(
                f"coupling {cp.name!r} draws structured siblings: every internal node of the tree "
                "needs the same number of children (e.g. trees.uniform(4, L) for antithetic)"
            )
    if fixed is not None:
        for k in fixed.num_children[fixed.internal].unique().tolist():
            try:
                cp.check_children(int(k))
            except ValueError as err:
                raise ValueError(f"tree: {err}") from None
    proposal = get_proposal(draft)
    if model_kwargs is not None and not isinstance(model_kwargs, dict):
        raise TypeError(f"model_kwargs must be a dict or None, got {type(model_kwargs).__name__}")
    if model_kwargs and not all(isinstance(k, str) for k in model_kwargs):
        raise TypeError(f"model_kwargs' keys must be str (keyword arguments of the model), got {list(model_kwargs)!r}")

    L = fixed.L if fixed is not None else (min(policy.max_depth, sde.steps) if policy is not None else 0)
    if policy is not None:
        L = max(L, policy.initial.L)
    config = dict(
        steps=sde.steps,
        churn=sde.churn,
        grid=grid if sigmas is None else "custom",
        shift=shift,
        tree=None if tree is None else repr(tree),
        budget=0 if tree is None else tree.budget,
        coupling=cp.name,
        draft=proposal.name,
        prefetch=prefetch,
        verify=verify,
        mode="lazy" if lazy else "full",
    )
    return RunSpec(
        sde,
        cp,
        proposal,
        fixed,
        policy,
        L,
        prefetch,
        verify,
        lazy,
        record_deltas,
        max_rows,
        model_kwargs or {},
        config,
        pad_sizes(pad_rows),
    )


def pad_sizes(pad_rows: "Optional[str | Sequence[int]]") -> Optional[tuple]:
    """The ascending row counts of ``pad_rows``: ``"pow2"`` (1, 2, 4, ..., 2**16), a list of ints, or ``None``.

    Raises:
        ValueError: naming ``pad_rows`` and what it accepts.
    """
    if pad_rows is None:
        return None
    if pad_rows == "pow2":
        return tuple(2**k for k in range(17))
    if isinstance(pad_rows, str) or not isinstance(pad_rows, Sequence) or not pad_rows:
        raise ValueError(f"pad_rows must be None, 'pow2' or a non-empty list of ints >= 1, got {pad_rows!r}")
    if any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in pad_rows):
        raise ValueError(f"pad_rows must list ints >= 1, got {pad_rows!r}")
    return tuple(sorted(set(pad_rows)))


@torch.inference_mode()
def sample(
    model: VelocityFn,
    x: torch.Tensor,
    *,
    steps: Optional[int] = None,
    churn: float,
    sigmas: Optional[torch.Tensor] = None,
    grid: str = "flow_match",
    shift: float = 1.0,
    tree: "Optional[DraftTree | TreePolicy]" = None,
    coupling: "str | Coupling" = "grs",
    draft: "str | Proposal | VelocityFn" = "velocity",
    prefetch: str = "nearest",
    verify: str = "internal",
    generator: "Optional[torch.Generator | Sequence[torch.Generator]]" = None,
    seed: Optional[int] = None,
    sample_index: Optional[torch.Tensor] = None,
    callback: Optional[Callable[[dict], None]] = None,
    progress: bool = False,
    max_rows: Optional[int] = None,
    cond: Optional[dict] = None,
    model_kwargs: Optional[dict] = None,
    lazy: bool = False,
    record_deltas: bool = False,
    process_group: Any = None,
    pad_rows: "Optional[str | Sequence[int]]" = None,
    tuned_for: Optional[TunedFor] = None,
) -> SampleResult:
    """Sample the churned reverse SDE exactly, speculating on a draft tree.

    The output has the law of the standard Euler-Maruyama chain on the same
    grid (paper eq. 6) for any tree, coupling, draft and prefetch policy;
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
        x: ``(B, *shape)`` initial states at ``sigmas[0]`` (pure noise at 1;
            :func:`specforest.streams.randn` makes them per sample).
        steps: number of steps ``T >= 1`` on the chosen ``grid``.
        churn: ``eps`` in (0, 1] (ERRATA 8: 0 makes speculation vacuous).
        sigmas: an explicit ``(T + 1,)`` grid, decreasing from <= 1 to 0.
        grid: ``flow_match`` (diffusers' default grid) or ``uniform`` (the paper's text).
        shift: timestep shift ``kappa`` of eq. (38).
        tree: draft topology (a :class:`~specforest.trees.DraftTree`), a
            :class:`~specforest.trees.TreePolicy` re-planned every round
            (``planning.AdaptiveTree``), or ``None`` for the standard sampler.
        coupling: a registered name (``grs`` (D-GRS, Algorithm 3), ``rmc``
            (Algorithm 2, chains only), ``rank``, ``antithetic``, see
            :func:`~specforest.couplings.register_coupling`) or a
            :class:`~specforest.couplings.Coupling`.
        draft: a registered draft name (``velocity``, ``drift``, ``x0``, ``eps``,
            ``x0_extrap``, ``auto``), a :class:`~specforest.proposals.Proposal`,
            or a draft-model callable.
        prefetch: ``nearest`` or ``parent``, see :data:`specforest.engine.PREFETCH_POLICIES`.
        verify: ``internal`` (evaluate root and internal nodes) or ``drafted``
            (every node, leaves included).
        generator: the run's seed is one draw from it (so a given generator
            state reproduces the run); or a list of ``B`` generators, one per
            sample (diffusers' convention): sample ``i``'s streams come from
            ``generator[i]`` alone. ``None`` (and no ``seed``): fresh entropy.
        seed: the run's seed as an int (instead of ``generator``).
        sample_index: ``(B,)`` global indices of the rows of ``x`` (default
            ``0..B-1``): row ``b`` draws the streams of sample
            ``sample_index[b]``, so a share of a larger job reproduces it.
        callback: called after each round with a dict of named tensors
            (``round``, ``step``, ``x``, ``committed``).
        progress: show a progress bar of the slowest trajectory's step.
        max_rows: split each target call into sub-batches of at most this many
            states (still one call, one NFE; bounds peak memory of the model).
        cond: per-trajectory conditioning: tensors ``(B, ...)`` (class labels,
            prompt embeddings); every call gets the rows of the trajectories
            its states belong to.
        model_kwargs: extra keyword arguments passed to every call as they are.
        lazy: cost simulation: realize only the nodes the acceptance walk visits
            (same samples, NFE and acceptance as the full tree, at a fraction of
            the compute). NFE and ``rows`` are accounted as for the full tree;
            the model is called several times per round with few rows.
        record_deltas: keep every verification's ``(depth, step, delta, accepted)`` in ``stats.deltas``.
        process_group: tree-parallel verification over a ``torch.distributed``
            process group: every process runs the same call with the same
            states and seed; each round's target rows are split across the
            group's processes and the velocities gathered, so every process
            commits the same states. The states and keys are broadcast from
            the group's first process at the start. ``None``: one process.
        pad_rows: pad every network call's rows up to the next of a few sizes
            (``"pow2"`` or a list of ints; a larger call is split), for a
            ``torch.compile(mode="reduce-overhead")`` or CUDA-graph model that
            would otherwise recompile for each new row count. Padding rows repeat
            a real row; their outputs are never used, so the samples do not change.
        tuned_for: the run a tuned configuration was chosen for (:class:`TunedFor`), set by
            ``sample(model, x, **tuned)`` with a :class:`~specforest.latency.Tuned`: without
            ``steps`` and ``sigmas`` the run takes its steps; a run whose steps, churn or batch
            (rows of ``x``) differ is refused. ``tuned.options()`` passes the configuration alone.

    Returns:
        :class:`SampleResult` with ``samples`` ``(B, *shape)`` and ``stats``.

    Raises:
        ValueError / TypeError: on invalid arguments, naming the parameter; on a run that
            differs from ``tuned_for``, listing the differences.
        FloatingPointError: if the model returns NaN or inf.
    """
    t0 = time.perf_counter()
    if not callable(model):
        raise TypeError("model must be callable as model(x, sigma)")
    check_states(x)
    steps = check_tuned_for(tuned_for, steps=steps, sigmas=sigmas, churn=churn, batch=x.shape[0])
    spec = prepare(
        steps=steps,
        churn=churn,
        sigmas=sigmas,
        grid=grid,
        shift=shift,
        tree=tree,
        coupling=coupling,
        draft=draft,
        prefetch=prefetch,
        verify=verify,
        max_rows=max_rows,
        model_kwargs=model_kwargs,
        lazy=lazy,
        record_deltas=record_deltas,
        pad_rows=pad_rows,
    )
    shape = tuple(x.shape[1:])
    B, D = x.shape[0], math.prod(shape)
    dev = x.device
    work = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    keys = _sample_keys(generator, seed, sample_index, B, dev)
    cond = _check_cond(cond, B, spec.model_kwargs)
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be None or callable as callback(dict), got {type(callback).__name__}")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool, got {type(progress).__name__}")
    x0 = x.reshape(B, D).to(work, copy=True)
    if process_group is not None:
        # tree-parallel: every process starts from the first process's states and keys
        # (a process given another seed, or none, would otherwise drift apart silently)
        from .distributed import broadcast_

        broadcast_(keys, process_group)
        broadcast_(x0, process_group)
    ctx = spec.context(model, shape, work, dev, B, cond, group=process_group)
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
                        "x": state.x.reshape(B, *shape).clone(),
                        "committed": state.step - prev,
                    }
                )
    if bar is not None:
        bar.close()
    xs = state.x
    target.check_finite()
    if not torch.isfinite(xs).all():
        raise FloatingPointError("sampling produced NaN or inf; refusing to return it")
    stats = stats_of(state, T)
    if record_deltas:
        stats.deltas = torch.cat(state.records) if state.records else torch.zeros(0, 4, dtype=torch.float64)
    stats.target_seconds = target.total_seconds()
    stats.phase_seconds = state.phase_seconds
    stats.wall_seconds = time.perf_counter() - t0
    # the run's tensors are inference tensors; the caller gets normal ones
    with outside_inference():
        samples = xs.reshape(B, *shape).to(x.dtype).clone()
    return SampleResult(samples, returned(stats), dict(spec.config))


def standard_sample(model: VelocityFn, x: torch.Tensor, **kwargs: Any) -> SampleResult:
    """The standard Euler-Maruyama sampler: :func:`sample` with ``tree=None``."""
    kwargs["tree"] = None
    return sample(model, x, **kwargs)
