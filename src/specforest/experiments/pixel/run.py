"""One configuration of the pixel experiment: sample a shipped model (class-conditional digits by
default, or an unconditional natural-image model, :mod:`.models`), summarize.

Randomness: the labels (a conditional model's) and ``x_T`` come from one stream of ``seed``
(:func:`~.setting.initial_states`), the sampling noise from one generator seeded
from another, so every method sees the same labels and initial states at a
seed. All trajectories run in one :func:`specforest.sample` call: with one
generator a sample would change with the chunking, so the memory limit only
splits the network's calls into sub-batches (``max_rows``), never the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Optional

import torch

from ... import __version__, memory, sample
from ...chains import Chain
from ...drafting import runs_full
from ...models.digits import DigitsClassifier
from ...options import SamplerOptions, check_option, options_sde
from ...planning import plan_tree
from ...proposals import get_proposal
from ...trees import DraftTree
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
    finite,
    normalize,
    run_chain,
    summarize,
)
from ..further_options import further_options, with_options
from .models import DEFAULT_MODEL, pixel_model, refuse_undeclared_learned
from .setting import (
    STREAM_CALIBRATION_NOISE,
    STREAM_CALIBRATION_X,
    STREAM_NOISE,
    initial_states,
)

__all__ = ["ROW_BYTES", "PixelRun", "simulate"]

ROW_BYTES = 10**6
"""Peak bytes one row is assumed to add inside the call of a ``model`` that declares no
``row_bytes`` (:func:`specforest.memory.row_bytes_of`): 1 MB, a generous figure for a small
image network. The shipped digits velocity declares its measured figure
(:data:`specforest.models.digits.ROW_BYTES_FLOAT32`, 136 kB a float32 row)."""


DEFAULT_CHURN = 0.3
"""The em chain's churn of :func:`simulate` (the paper's middle level of Sec. 5.2)."""


@dataclass
class PixelRun:
    """One configuration's outcome.

    Attributes:
        record: flat JSON-serializable summary (see :func:`simulate`).
        samples: ``(n, *shape)`` float32 samples (not clipped): ``(n, 1, 8, 8)`` for digits.
        labels: ``(n,)`` long conditioning labels; ``None`` for an unconditional model.
    """

    record: dict
    samples: torch.Tensor
    labels: Optional[torch.Tensor]


def simulate(
    *,
    method: str = "dgrs",
    K: int = 2,
    L: int = 3,
    churn: Optional[float] = None,
    samples: int = 100,
    steps: int = 100,
    seed: int = 0,
    grid: str = "flow_match",
    prefetch: str = "nearest",
    verify: str = "internal",
    lazy: bool = False,
    progress: bool = False,
    draft: str = "velocity",
    tree: "str | DraftTree" = "uniform",
    budget: Optional[int] = None,
    model: Optional[Callable[..., torch.Tensor]] = None,
    classifier: Optional[DigitsClassifier] = None,
    compile: bool = False,
    warmup: bool = False,
    memory_gb: Optional[float] = None,
    chain: "str | Chain" = "em",
    options: Optional[dict] = None,
    model_name: str = DEFAULT_MODEL,
) -> PixelRun:
    """Sample ``samples`` images of a shipped model with one method and summarize.

    Args:
        method: ``standard``, ``rmc``, ``dgrs``, ``rank`` or ``antithetic`` (K even).
        K: tree width of the tree methods (ignored otherwise), ``>= 1`` (``>= 0`` for ``standard``).
        L: tree depth of the tree methods; chain length ``B`` for ``rmc``; ``>= 1`` (``>= 0`` for ``standard``).
        churn: ``eps`` in (0, 1] of the ``em`` chain (default 0.3); ``None`` with another chain.
        samples: number of images ``>= 1``.
        steps: grid steps ``T >= 3``.
        seed: seed of the labels, ``x_T`` and the sampling noise, ``>= 0``.
        grid: ``flow_match`` or ``uniform``.
        prefetch: ``nearest`` or ``parent`` (ERRATA 9).
        verify: ``internal`` or ``drafted``.
        lazy: realize only visited nodes (same law and NFE; wall-clock not comparable).
        draft: the draft (:data:`specforest.proposals.DRAFT_KINDS`): a frozen prediction
            (``velocity``, ``drift``, ``x0``, ``eps``, ``x0_extrap``), ``memory`` (the previous
            round's evaluation at each step; the run goes full) or ``auto``.
        tree: ``uniform`` (the (K, L) tree), ``optimal`` (planned for ``budget`` from
            a short calibration run) or ``adaptive`` (re-planned every round); see
            :func:`specforest.experiments.common.choose_tree`.
        budget: drafted states per round for ``optimal`` / ``adaptive``.
        progress: the sampler's progress bar on stderr.
        model: the velocity (default: the shipped network of ``model_name``).
        classifier: the evaluation classifier of a conditional model (default: the shipped digits
            classifier; an unconditional model has none).
        compile: ``torch.compile(mode="reduce-overhead")`` the model, rows padded to
            powers of two (same samples).
        warmup: call the model at every row count of the run before it
            (:func:`specforest.warmup.warm_up`; same samples), so that a fresh process does not
            pay its first calls at each shape inside ``wall_seconds``; with many images on a
            tree the calls are padded to :func:`specforest.warmup.pad_rows_for`'s sizes.
        memory_gb: memory limit of the whole process in GB (> 0; default
            :func:`specforest.memory.default_memory_limit`); it sets ``max_rows``.
        chain: the sampler's chain (:mod:`specforest.chains`): ``"em"`` (the paper's Euler-Maruyama
            step with ``churn``, the default), or another registered name or
            :class:`~specforest.chains.Chain` with its parameters (``get_chain("euler_ancestral", eta=0.7)``).
        options: further options of :func:`specforest.sample` by name, passed to every run (the
            calibration of a planned tree too) and recorded under their keys
            (:mod:`specforest.experiments.further_options`); one the run sets itself (``steps``, ``churn``,
            ``tree``, ... :data:`~specforest.experiments.further_options.SET_BY_RUNS`) is refused.
        model_name: which model (:data:`~specforest.experiments.pixel.models.PIXEL_MODELS`):
            ``digits`` (class-conditional ``1 x 8 x 8``, labels uniform over the ten classes),
            ``natural32`` or ``natural64`` (unconditional ``3 x 32 x 32`` / ``3 x 64 x 64``). With
            ``draft="learned"`` the model must declare its draft network (``learned_draft``).

    Returns:
        A :class:`PixelRun`; its record holds the options and ``budget``, the
        statistics of :func:`specforest.experiments.common.summarize`
        (``standard_calls`` ``N``, ``nfe_mean``/``nfe_sem``, ``speedup_mean``/``speedup_sem`` (``N / NFE``
        per image, ``T / NFE`` for one call a step), ``speedup_paper_mean``/``speedup_paper_sem``
        (``(N - N_det) / (NFE - N_det)``, ``(T - 2) / (NFE - 2)`` for the em chain), ``accept_rate``, ``accept_rate_per_depth``,
        ``delta_per_depth`` (``None`` where a depth was never reached), ...),
        ``speedup_std``, ``wall_seconds``, ``warmup_seconds`` (0 without ``warmup``; not in
        ``wall_seconds``), ``max_rows``, ``memory_peak_gb`` (the estimated peak of the process),
        ``memory_gb`` (the limit), ``classifier_accuracy`` (null for an unconditional model), the chain
        as ``chain`` (its name) and ``chain_params`` (``churn`` null with a chain other than em), and
        ``model``, the model's description (``"natural32 3x32x32 (EDM U-Net)"``).

    Raises:
        ValueError / TypeError: on invalid options, naming the option (``draft='learned'`` with a model
            that declares no draft network among them).
        MemoryError: if the run does not fit the memory limit
            (:func:`specforest.memory.estimate`).
    """
    check_choice("method", method, METHODS)
    pm = pixel_model(model_name)
    lo = 0 if method == "standard" else 1  # standard ignores K and L
    K, L = check_int("K", K, lo), check_int("L", L, lo)
    n, T, seed = check_int("samples", samples, 1), check_int("steps", steps, 3), check_int("seed", seed, 0)
    for name, value in (("grid", grid), ("prefetch", prefetch), ("verify", verify), ("draft", draft)):
        check_option(name, value)  # (the choices the sampler's options declare)
    if method == "antithetic" and K % 2:
        raise ValueError(f"K must be even for the antithetic method (K/2 mirrored pairs per node), got {K}")
    further = further_options(options, by="the pixel experiment's run")
    ch = run_chain(chain, churn, DEFAULT_CHURN)
    churn = chain_kwargs(ch)["churn"]
    if memory_gb is not None:
        memory_gb = check_number("memory_gb", memory_gb, 0.0, lo_open=True)
    K, L = normalize(method, K, L)
    tree_mode = tree
    model = pm.load() if model is None else model
    refuse_undeclared_learned(model, pm, draft)
    classifier = pm.classifier() if classifier is None and pm.conditional else classifier
    x_T, labels = initial_states(n, seed, pm.name)

    def plan(b: int) -> DraftTree:
        cx, cl = initial_states(16, derive_seed(seed, STREAM_CALIBRATION_X), pm.name)
        return plan_tree(
            model,
            cx,
            budget=b,
            steps=T,
            **chain_kwargs(ch),
            coupling=COUPLING_OF[method],
            grid=grid,
            draft=draft,
            prefetch=prefetch,
            verify=verify,
            cond=pm.cond(cl),
            generator=torch.Generator().manual_seed(derive_seed(seed, STREAM_CALIBRATION_NOISE)),
            **further,
        )

    # the chain's tables on the run's grid: the steps a round drafts (dpmpp_sde's 2 T - 1 half-steps, not
    # the grid's), the standard run's calls and its calls without noise
    tables = options_sde(SamplerOptions(steps=T, **chain_kwargs(ch), grid=grid, **further))
    if isinstance(tree, DraftTree):
        # a tree given as it is (e.g. a tuned one): recorded as custom, K and L its widest node and depth
        if method in ("standard", "rmc"):
            raise ValueError(f"a DraftTree as tree needs a tree method (dgrs, rank, antithetic), got method={method!r}")
        tree_mode, budget = "custom", tree.budget
        K, L = tree.max_children, tree.L
    else:
        tree, budget = choose_tree(method, K, L, tables.steps, tree_mode, budget, plan)
    # a tree-less run has nothing to realize lazily; a draft that remembers its chain runs chains full
    lazy = bool(lazy) and tree is not None and not runs_full(get_proposal(draft), tree)
    # the limit bounds the whole process: what it holds now (the networks) counts as fixed
    limit, source, fixed = memory.resolve_limit(memory_gb, x_T.device, "memory_gb")
    g = torch.Generator().manual_seed(derive_seed(seed, STREAM_NOISE))
    target, pad_rows = compiled(model, compile)
    opts = SamplerOptions(
        steps=T,
        **chain_kwargs(ch),
        grid=grid,
        tree=tree,
        coupling=COUPLING_OF.get(method, "grs"),
        draft=draft,
        prefetch=prefetch,
        verify=verify,
        lazy=lazy,
        **further,
    )
    cond_row = pm.cond(None if labels is None else labels[:1])
    declared = memory.row_bytes_of(model, x_T[:1], cond_row)
    mem = memory.estimate(
        trajectories=n,
        state_numel=math.prod(pm.shape),
        **memory.run_shape(opts),  # the tree, verification, draft and the chain's history and stages
        model=model,  # read for the deep features a cached draft keeps (its row bytes are given)
        x_row=x_T[:1],
        row_bytes=ROW_BYTES if declared is None else declared,
        fixed_bytes=fixed,
        limit_bytes=limit,
        limit_source=source,
        device=x_T.device,
        chunked=False,
    )
    opts = replace(opts, max_rows=mem.max_rows)
    cond = pm.cond(labels)
    warmup_seconds = 0.0
    if warmup:
        pad_rows = pad_rows or pad_rows_for(n, **opts.as_dict())
    opts = replace(opts, pad_rows=pad_rows)
    if warmup:
        warmup_seconds = warm_up(target, x_T, cond=cond, repeats=3 if compile else 1, **opts.as_dict())
    out = sample(target, x_T, opts, generator=g, progress=progress, cond=cond)
    s = out.stats
    counts = call_counts(tables)
    speedup = counts["standard_calls"] / s.nfe.double()
    accuracy = None
    if labels is not None and classifier is not None:
        with torch.no_grad():
            accuracy = float((classifier.predict(out.samples) == labels).float().mean())
    record = {
        "method": method,
        "K": K,
        "L": L,
        "budget": budget_of(method, K, L) if budget is None else budget,
        "tree": tree_mode,
        "samples": n,
        "churn": churn,
        **chain_record(ch),
        "steps": T,
        **summarize(
            nfe=s.nfe,
            attempts=s.attempts,
            accepts=s.accepts,
            delta_sum=s.delta_sum,
            spec_steps=s.spec_steps,
            rounds=s.rounds,
            rows=s.rows,
            **counts,
        ),
        "speedup_std": finite(speedup.std().item()) if n > 1 else None,
        "wall_seconds": float(s.wall_seconds),
        "warmup_seconds": warmup_seconds,
        "target_seconds": float(s.target_seconds),
        "classifier_accuracy": accuracy,
        "calls": int(s.calls),
        "grid": further.get("schedule") or grid,  # (a schedule makes the grid)
        "seed": seed,
        "prefetch": prefetch,
        "verify": verify,
        "mode": "lazy" if lazy else "full",
        "coupling": None if tree is None else COUPLING_OF[method],
        "draft": draft,
        "compiled": bool(compile),
        "threads": torch.get_num_threads(),
        "tree_layers": None if tree is None else repr(tree),
        "max_rows": mem.max_rows,
        "memory_peak_gb": mem.total_bytes / 1e9,
        "memory_gb": mem.limit_bytes / 1e9,
        "model": pm.description,
        "specforest_version": __version__,
        "torch_version": torch.__version__,
    }
    return PixelRun(with_options(record, further), out.samples.to(torch.float32), labels)
