"""One configuration of the Gaussian-mixture experiment: run it, summarize it.

Randomness: ``seed`` drives ``x_T`` and the sampling noise, ``mixture_seed`` only
the mixture. ``x_T`` is drawn once for all trajectories from a stream derived
from ``seed``, so every method sees the same initial states at a seed; the
sampling noise comes from the engine's per-sample streams keyed by a second
stream of ``seed`` and the trajectory's index, so a trajectory's sample does not
depend on the memory limit's chunking.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, replace

import torch

from ... import __version__, memory, sample
from ...drafting import runs_full
from ...models.gmm import MixtureSize
from ...options import SamplerOptions, check_option, options_sde
from ...planning import AdaptiveTree, plan_tree
from ...proposals import get_proposal
from ...trees import DraftTree, TreePolicy, chain
from ...warmup import pad_rows_for, warm_up
from ..common import (
    COUPLING_OF,
    METHODS,
    budget_of,
    call_counts,
    chain_kwargs,
    chain_record,
    check_choice,
    check_int,
    check_number,
    choose_tree,
    compiled,
    derive_seed,
    normalize,
    summarize,
)
from ..further_options import further_options, with_options
from .setting import (
    STREAM_CALIBRATION_NOISE,
    STREAM_CALIBRATION_X,
    GMMSetting,
    initial_states,
    mixture_fingerprint,
)

__all__ = ["GMMRun", "run_config", "simulate"]

STREAM_NOISE = 1
# trajectories of a planned tree's calibration run (plan_tree's default)
_CALIBRATION_TRAJECTORIES = 16


@dataclass
class GMMRun:
    """One configuration's outcome.

    Attributes:
        record: the flat result dict (see :func:`run_config`).
        samples: ``(trajectories, dim)`` float32 final samples.
        tree: the draft tree sampled with (``None`` for the standard sampler;
            an :class:`~specforest.planning.AdaptiveTree` for ``tree='adaptive'``).
    """

    record: dict
    samples: torch.Tensor
    tree: "DraftTree | AdaptiveTree | None" = None


def _held(
    setting: GMMSetting, tree: "DraftTree | TreePolicy | None", calibration: bool = False
) -> tuple[memory.Held, ...]:
    """What a run holds whole, whatever its chunking: the mixture's parameters, and every
    trajectory's initial state beside its sample and statistics twice (each chunk's, then their
    concatenation); with ``calibration``, those of a planned tree's calibration run."""
    d, C = setting.dim, setting.components
    n = _CALIBRATION_TRAJECTORIES if calibration else setting.trajectories
    states = n * d * 4 + 2 * memory.returned_bytes(n, d, tree, steps=setting.steps)
    return (
        memory.Held("the mixture's parameters", (("components", C), ("dim", d)), MixtureSize(d, C).parameter_bytes),
        memory.Held(f"the calibration's {n} initial states, samples and statistics", (("dim", d),), states)
        if calibration
        else memory.Held("the initial states, samples and statistics", (("trajectories", n), ("dim", d)), states),
    )


def simulate(
    setting: GMMSetting,
    *,
    method: str = "dgrs",
    K: int = 6,
    L: int = 6,
    prefetch: str = "nearest",
    verify: str = "internal",
    seed: int = 0,
    lazy: bool = False,
    memory_gb: float | None = None,
    progress: bool = False,
    draft: str = "velocity",
    tree: "str | DraftTree" = "uniform",
    budget: int | None = None,
    compile: bool = False,
    warmup: bool = False,
    options: dict | None = None,
) -> GMMRun:
    """Run one configuration and keep its samples; see :func:`run_config`."""
    if not isinstance(setting, GMMSetting):
        raise TypeError(f"setting must be a GMMSetting, got {type(setting).__name__}")
    further = further_options(options, by="the gmm experiment's run")
    check_choice("method", method, METHODS)
    K = check_int("K", K, 1)
    L = check_int("L", L, 1)
    for name, value in (("prefetch", prefetch), ("verify", verify), ("draft", draft)):
        check_option(name, value)  # (the choices the sampler's options declare)
    seed = check_int("seed", seed, 0)
    if memory_gb is not None:
        memory_gb = check_number("memory_gb", memory_gb, 0.0, lo_open=True)
    K, L = normalize(method, K, L)
    n, T = setting.trajectories, setting.steps
    # the limit bounds the whole process: what it holds now counts as fixed
    limit, source, fixed = memory.resolve_limit(memory_gb, "cpu", "memory_gb")
    # the chain's history and stages, from its tables on the run's grid
    tables = options_sde(SamplerOptions(steps=T, **chain_kwargs(setting.run_chain), grid=setting.grid, **further))
    # what a trajectory walks and a round drafts: the chain's steps (dpmpp_sde's 2 T - 1 half-steps)
    chain_T = tables.steps

    def sized(tree: "DraftTree | TreePolicy | None", lazy: bool, calibration: bool = False) -> memory.MemoryEstimate:
        # made before the mixture is drawn (its size declares what it costs, a meta row its dtype):
        # a mixture, states or tree too large for the limit is refused before anything is allocated
        return memory.estimate(
            trajectories=_CALIBRATION_TRAJECTORIES if calibration else n,
            state_numel=setting.dim,
            tree=tree,
            verify=verify,
            lazy=lazy,
            steps=chain_T,
            model=MixtureSize(setting.dim, setting.components),
            x_row=torch.empty(1, setting.dim, device="meta"),
            draft=draft,
            fixed_bytes=fixed,
            limit_bytes=limit,
            limit_source=source,
            chunked=not calibration,  # the calibration runs its trajectories at once
            held=_held(setting, tree, calibration),
            **memory.chain_shape(tables),
        )

    if isinstance(tree, DraftTree):
        if method in ("standard", "rmc"):
            raise ValueError(f"a DraftTree as tree needs a tree method (dgrs, rank, antithetic), got method={method!r}")
        tree_mode = "custom"
        K, L = tree.max_children, tree.L
    else:
        tree_mode = tree

        def plan(b: int) -> DraftTree:
            # the calibration draws the mixture too, and runs a lazy chain (plan_tree's)
            sized(chain(min(b, chain_T)), lazy=True, calibration=True)
            return plan_tree(
                setting.mixture(),
                initial_states(_CALIBRATION_TRAJECTORIES, setting.dim, derive_seed(seed, STREAM_CALIBRATION_X)),
                budget=b,
                steps=setting.steps,
                **chain_kwargs(setting.run_chain),
                coupling=COUPLING_OF[method],
                grid=setting.grid,
                draft=draft,
                prefetch=prefetch,
                verify=verify,
                seed=derive_seed(seed, STREAM_CALIBRATION_NOISE),
                **further,
            )

        tree, budget = choose_tree(method, K, L, chain_T, tree_mode, budget, plan)
    # a tree-less run has nothing to realize lazily; a draft that remembers its chain runs chains full
    lazy = bool(lazy) and tree is not None and not runs_full(get_proposal(draft), tree)
    if method == "antithetic" and tree_mode != "custom" and K % 2:
        raise ValueError(f"K must be even for the antithetic method (K/2 mirrored pairs per node), got {K}")
    coupling = COUPLING_OF.get(method, "grs")

    mem = sized(tree, lazy)
    gmm = setting.mixture()
    model, pad_rows = compiled(gmm, compile)
    x_T = initial_states(n, setting.dim, seed)
    noise_seed = derive_seed(seed, STREAM_NOISE)

    starts = list(range(0, n, mem.chunk))
    opts = SamplerOptions(
        steps=T,
        **chain_kwargs(setting.run_chain),
        grid=setting.grid,
        tree=tree,
        coupling=coupling,
        draft=draft,
        prefetch=prefetch,
        verify=verify,
        max_rows=mem.max_rows,
        lazy=lazy,
        **further,
    )
    warmup_seconds = 0.0
    if warmup:
        # the chunks' sizes: every full one and the last
        sizes = sorted({min(mem.chunk, n - start) for start in starts})
        pad_rows = pad_rows or pad_rows_for(sizes, **opts.as_dict())
    opts = replace(opts, pad_rows=pad_rows)
    if warmup:
        reps = 3 if compile else 1
        warmup_seconds = warm_up(model, x_T[: sizes[-1]], batch=sizes, repeats=reps, **opts.as_dict())
    t0 = time.perf_counter()
    names = ("nfe", "attempts", "accepts", "delta_sum", "rows", "rounds", "spec_steps")
    parts: dict[str, list] = {k: [] for k in ("samples", *names)}
    calls, target_seconds = 0, 0.0
    for start in starts:
        stop = min(start + mem.chunk, n)
        # per-sample streams: trajectory i's noise depends on (seed, i) only, not on the chunking
        out = sample(
            model, x_T[start:stop], opts, seed=noise_seed, sample_index=torch.arange(start, stop), progress=progress
        )
        s = out.stats
        parts["samples"].append(out.samples.to(torch.float32))
        for name in names:
            parts[name].append(getattr(s, name).cpu())
        calls += int(s.calls)
        target_seconds += s.target_seconds
    wall = time.perf_counter() - t0
    cat = {k: torch.cat(v) for k, v in parts.items()}

    # on the run's own grid: a schedule (a further option) starts below t = 1, where the em chain's first step is noisy
    t_det = chain_T - int(tables.stochastic.sum())  # (the chain's steps: dpmpp_sde walks 2 T - 1 half-steps)
    summary = summarize(**{k: cat[k] for k in names}, **call_counts(tables))
    record = {
        "method": method,
        "K": K,
        "L": L,
        "budget": tree.budget if tree_mode != "uniform" and tree is not None else budget_of(method, K, L),
        "tree": tree_mode,
        "tree_layers": None if tree is None else repr(tree),
        "trajectories": n,
        **summary,
        "calls": calls,
        "wall_seconds": wall,
        "warmup_seconds": warmup_seconds,
        "target_seconds": target_seconds,
        "grid": further.get("schedule") or setting.grid,  # (a schedule makes the grid)
        "churn": setting.churn,
        **chain_record(setting.run_chain),
        "steps": T,
        "deterministic_steps": t_det,
        "dim": setting.dim,
        "components": setting.components,
        "prefetch": prefetch,
        "verify": verify,
        "draft": draft,
        "seed": seed,
        "mixture_seed": setting.mixture_seed,
        "mixture_fingerprint": mixture_fingerprint(gmm),
        "mode": "lazy" if lazy else "full",
        "coupling": coupling if tree is not None else None,
        "compiled": bool(compile),
        "threads": torch.get_num_threads(),
        "chunk_size": mem.chunk,
        "chunks": len(starts),
        "max_rows": mem.max_rows,
        "memory_gb": mem.limit_bytes / 1e9,
        "memory_estimate_gb": mem.total_bytes / 1e9,
        "bytes_per_trajectory": mem.trajectory_bytes,
        "specforest_version": __version__,
        "torch_version": torch.__version__,
        "platform": platform.platform(),
    }
    return GMMRun(with_options(record, further), cat["samples"], tree)


def run_config(setting: GMMSetting, **options) -> dict:
    """Run one configuration of the experiment and summarize it.

    Args:
        setting: the experiment's :class:`GMMSetting`.
        method: ``standard``, ``rmc``, ``dgrs``, ``rank`` or ``antithetic`` (default ``dgrs``).
        K: tree width for the tree methods (even for ``antithetic``), ``>= 1``.
        L: tree depth for the tree methods; chain length ``B`` for ``rmc``; ``>= 1``.
        prefetch: ``nearest`` or ``parent`` (ERRATA 9).
        verify: ``internal`` or ``drafted``.
        draft: the draft (:data:`specforest.proposals.DRAFT_KINDS`): ``velocity`` (default,
            the paper's protocol), ``drift``, ``x0``, ``eps``, ``x0_extrap``, ``memory`` (the
            previous round's evaluation at each step; the run goes full) or ``auto``.
        seed: seed of ``x_T`` and the sampling noise, ``>= 0``.
        lazy: realize only visited nodes (same law of samples and NFE, far less
            memory and time for big trees).
        memory_gb: memory limit of the whole process (its resident set) that sets
            the chunk size and ``max_rows`` (default
            :func:`specforest.memory.default_memory_limit`: 50% of RAM).
        progress: show the sampler's progress bar (stderr).
        tree: ``uniform``, ``optimal`` or ``adaptive`` (see :data:`specforest.planning.TREE_MODES`),
            or a :class:`~specforest.trees.DraftTree` to sample with as given
            (recorded as ``custom``, with ``K, L`` its widest node and depth).
        budget: drafted states per round for ``optimal`` and ``adaptive``.
        compile: ``torch.compile(mode="reduce-overhead")`` the target, rows padded
            to powers of two (same samples).
        warmup: call the target at every row count of the run's chunks before them
            (:func:`specforest.warmup.warm_up`; same samples); with many trajectories on a tree
            the calls are padded to :func:`specforest.warmup.pad_rows_for`'s sizes.
        options: further options of :func:`specforest.sample` by name, passed to every run (the
            calibration of a planned tree too) and recorded under their keys
            (:mod:`specforest.experiments.further_options`); one the run sets itself (``steps``, ``churn``,
            ``tree``, ... :data:`~specforest.experiments.further_options.SET_BY_RUNS`) is refused.

    Returns:
        A JSON-serializable dict (NaN written as ``None``) with the options (the setting's chain as
        ``chain``, its name, and ``chain_params``, its parameters; ``churn`` null with a chain other than em) and
        ``budget``, ``standard_calls`` (``N``: the chain's standard run's model calls, ``T`` for one call a step),
        ``nfe_mean``/``nfe_sem``, ``speedup_mean``/``speedup_sem`` (``N / NFE``),
        ``speedup_paper_mean``/``speedup_paper_sem`` (``(N - N_det) / (NFE - N_det)``, ``(T - 2) / (NFE - 2)``
        for the em chain), ``accept_rate`` (pooled per-step acceptance:
        accepts / verification problems), ``accept_rate_per_depth``,
        ``delta_per_depth``, ``wall_seconds``, ``warmup_seconds`` (0 without ``warmup``; not in
        ``wall_seconds``), ``mode``, ``chunk_size``, ``memory_estimate_gb`` (the estimated peak
        of the process) and more.
        ``K, L`` are recorded as ``(0, 0)`` for ``standard`` and ``(1, B)`` for ``rmc``.

    Raises:
        ValueError / TypeError: on invalid options, naming the option.
        MemoryError: if what the run holds whole (the mixture's parameters, every trajectory's
            initial state, sample and statistics) does not fit ``memory_gb``, naming ``dim``,
            ``components`` or ``trajectories``, or one trajectory's round does not (use ``lazy``);
            before the mixture is drawn and anything is sampled; the message gives the numbers.
    """
    return simulate(setting, **options).record
