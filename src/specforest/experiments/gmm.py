"""The Gaussian-mixture experiment of paper Sec. 5.1 (Figures 3 and 7).

Setting (defaults of :class:`GMMSetting`): a mixture of 5 isotropic Gaussians in
``d = 500`` with means ``U([-2, 2]^d)`` and stds ``U([0.10, 0.25])`` drawn from
``mixture_seed``; the churned reverse SDE with ``T = 30`` steps, churn 0.1, on
diffusers' flow-matching grid (ERRATA 6); 100 trajectories from ``x_T ~ N(0, I)``.

Methods: ``standard`` (no tree, exactly ``T`` NFE), ``rmc`` (Algorithm 2 on a
chain of ``B`` drafted states) and ``dgrs`` (Algorithm 3 on the uniform
``(K, L)`` tree, ``B = K + ... + K^L``). Budgets count drafted states (ERRATA 7).

Speedups are reported in two accountings:

* ``speedup`` = ``T / NFE`` per trajectory (every target call counts, including
  the deterministic first and last Euler steps and the first root fetch);
* ``speedup_paper`` = ``(T - T_det) / (NFE - T_det)``, stochastic steps per
  stochastic-phase call, with ``T_det`` the deterministic steps of the grid
  (2 on both grids); this is the paper's accounting.

Randomness: ``seed`` drives ``x_T`` and the sampling noise, ``mixture_seed`` only
the mixture. ``x_T`` is drawn once for all trajectories from a stream derived from
``seed``, so every method sees the same initial states at a seed. Trajectories
are run in chunks that fit a memory limit, chunk ``i`` with its own generator
derived from ``(seed, i)``; since the engine's noise stream is shared within a
batch, samples depend on the chunking (their law does not).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from .. import __version__, sample, trees
from ..models import GaussianMixture
from ..planning import AdaptiveTree, plan_tree
from ..proposals import DRAFT_KINDS
from ..sampler import GRIDS, PREFETCH_POLICIES
from ..sde import ReverseSDE, flow_match_grid, uniform_grid
from ..trees import VERIFY_MODES, DraftTree
from .io import atomic_write, atomic_write_text, load_records, records_csv
from .results import describe_method

__all__ = [
    "COUPLING_OF",
    "KEY_FIELDS",
    "METHODS",
    "GMMRun",
    "GMMSetting",
    "SweepResult",
    "bytes_per_trajectory",
    "chunk_size",
    "default_memory_gb",
    "format_result",
    "format_summary",
    "initial_states",
    "load_results",
    "make_tree",
    "mixture_fingerprint",
    "result_key",
    "run_config",
    "run_sweep",
    "simulate",
    "sweep_configs",
    "write_figures",
    "write_results",
]

METHODS = ("standard", "rmc", "dgrs", "rank", "antithetic")

TREE_MODES = ("uniform", "optimal", "adaptive")
"""``uniform``: the (K, L) tree (a chain for rmc); ``optimal``: the tree of
:func:`specforest.trees.optimal` for ``budget``, from an acceptance model
calibrated on a separate short run (:func:`specforest.planning.plan_tree`);
``adaptive``: re-planned every round from the run's own statistics
(:class:`specforest.planning.AdaptiveTree`)."""

COUPLING_OF = {"rmc": "rmc", "dgrs": "grs", "rank": "rank", "antithetic": "antithetic"}
"""The coupling each tree method verifies with (rank and antithetic: issue #6)."""

KEY_FIELDS = (
    "method",
    "K",
    "L",
    "prefetch",
    "verify",
    "draft",
    "tree",
    "mode",
    "grid",
    "churn",
    "steps",
    "dim",
    "components",
    "trajectories",
    "seed",
    "mixture_seed",
)
"""Fields that identify a configuration in a results file (a resumed sweep skips
a configuration whose key is already present)."""

# Bytes per realized tree node and dimension of a full run: float32 states, the
# gathered rows sent to the target and the returned velocities (x 3).
_BYTES_PER_NODE_DIM = 4 * 3

# Trees above this size make a full sweep slow enough to advise lazy mode.
_LAZY_ADVISED_NODES = 100_000

# x_T and the chunks' sampling noise come from separate streams of one seed.
_STREAM_INIT, _STREAM_CHUNK = 0, 1


def _check_int(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int >= {lo}, got {type(value).__name__}")
    if value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value}")
    return int(value)


def _check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return str(value)


@dataclass(frozen=True)
class GMMSetting:
    """The experiment's fixed setting; the defaults are the paper's.

    Attributes:
        dim: dimension ``d >= 1``.
        components: number of mixture components ``>= 1``.
        steps: grid steps ``T >= 3`` (the first and last are deterministic).
        churn: ``eps`` in (0, 1].
        trajectories: number of independent trajectories ``>= 1``.
        grid: ``flow_match`` or ``uniform``.
        mixture_seed: seed of the mixture's means and stds, ``>= 0``.
    """

    dim: int = 500
    components: int = 5
    steps: int = 30
    churn: float = 0.1
    trajectories: int = 100
    grid: str = "flow_match"
    mixture_seed: int = 0

    def __post_init__(self) -> None:
        _check_int("dim", self.dim, 1)
        _check_int("components", self.components, 1)
        _check_int("steps", self.steps, 3)
        _check_int("trajectories", self.trajectories, 1)
        _check_int("mixture_seed", self.mixture_seed, 0)
        _check_choice("grid", self.grid, GRIDS)
        c = self.churn
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not (0.0 < c <= 1.0):
            raise ValueError(f"churn must be a number in (0, 1], got {c!r}")
        object.__setattr__(self, "churn", float(c))

    def mixture(self) -> GaussianMixture:
        """The mixture drawn from ``mixture_seed`` (independent of the sampling seed)."""
        return GaussianMixture.paper(dim=self.dim, components=self.components, seed=self.mixture_seed)

    def sde(self) -> ReverseSDE:
        """The discretized reverse SDE the sampler runs (same grid as :func:`specforest.sample`)."""
        sig = flow_match_grid(self.steps) if self.grid == "flow_match" else uniform_grid(self.steps)
        return ReverseSDE(sig, self.churn)

    @property
    def deterministic_steps(self) -> int:
        """Steps of the grid taken as plain Euler steps (2 on both grids)."""
        return self.steps - int(self.sde().stochastic.sum())


def mixture_fingerprint(gmm: GaussianMixture) -> str:
    """Short hash of a mixture's parameters, recorded with every result."""
    h = hashlib.sha256()
    for t in (gmm.means, gmm.stds, gmm.weights):
        h.update(t.detach().cpu().to(torch.float64).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _derive_seed(seed: int, *stream: int) -> int:
    # SeedSequence mixes (seed, stream...) into well-separated 63-bit seeds.
    return int(np.random.SeedSequence([seed, *stream]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def initial_states(trajectories: int, dim: int, seed: int) -> torch.Tensor:
    """``(trajectories, dim)`` float32 ``x_T ~ N(0, I)``, the same for every method at ``seed``."""
    g = torch.Generator().manual_seed(_derive_seed(seed, _STREAM_INIT))
    return torch.randn(trajectories, dim, generator=g, dtype=torch.float32)


def _normalize(method: str, K: int, L: int) -> tuple[int, int]:
    """The ``(K, L)`` recorded for a method: standard (0, 0); rmc (1, B); dgrs (K, L)."""
    if method == "standard":
        return 0, 0
    if method == "rmc":
        return 1, L
    return K, L


def make_tree(method: str, K: int, L: int, steps: int) -> DraftTree | None:
    """The draft tree of a method: ``None``, a chain or the uniform ``(K, L)`` tree.

    For ``rmc``, ``L`` is the chain length ``B``; the sampler truncates a round to
    the stochastic steps left, so the chain is built with ``min(B, steps)`` nodes
    (identical behaviour, far less memory).
    """
    _check_choice("method", method, METHODS)
    if method == "standard":
        return None
    if method == "rmc":
        return trees.chain(min(L, steps))
    return trees.uniform(K, L)


def _budget(method: str, K: int, L: int) -> int:
    if method == "standard":
        return 0
    if method == "rmc":
        return L
    return sum(K**level for level in range(1, L + 1))


def bytes_per_trajectory(tree: DraftTree | None, dim: int, lazy: bool = False) -> int:
    """Estimated peak bytes one trajectory needs in a run.

    A full run realizes every node of the tree: ``size * dim * 4`` bytes of
    float32 states, times about 3 for the rows gathered for the target and the
    velocities it returns. A lazy run realizes only the nodes it visits: at most
    the children of one node per depth, ``1 + K_max * L`` nodes.
    """
    if tree is None:
        nodes = 1
    elif isinstance(tree, AdaptiveTree):  # any plan has at most budget + 1 nodes
        nodes = 1 + tree.kmax * tree.max_depth if lazy else tree.budget + 1
    elif lazy:
        nodes = 1 + tree.max_children * tree.L
    else:
        nodes = tree.size_at_depth(tree.L)
    return nodes * dim * _BYTES_PER_NODE_DIM


def default_memory_gb() -> float:
    """25% of the machine's physical memory, or 4 GB where it cannot be read."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 4.0
    if total <= 0:
        return 4.0
    return 0.25 * total / 1e9


def chunk_size(per_trajectory: int, trajectories: int, memory_gb: float) -> int:
    """Largest balanced chunk of trajectories whose estimated memory fits ``memory_gb``.

    Raises:
        MemoryError: if even one trajectory does not fit.
    """
    limit = memory_gb * 1e9
    fit = int(limit // per_trajectory)
    if fit < 1:
        raise MemoryError(
            f"one trajectory needs about {per_trajectory / 1e9:.3g} GB but the memory limit is "
            f"{memory_gb:.3g} GB; run with lazy=True (--lazy), which realizes only the visited "
            "nodes, or raise memory_gb (--memory-gb)"
        )
    chunks = math.ceil(trajectories / min(fit, trajectories))
    return math.ceil(trajectories / chunks)


def _finite(x: float) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _mean_sem(x: torch.Tensor) -> tuple[float | None, float | None]:
    x = x.double()
    n = x.numel()
    mean = x.mean().item()
    sem = (x.std(unbiased=True) / math.sqrt(n)).item() if n > 1 else float("nan")
    return _finite(mean), _finite(sem)


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
) -> GMMRun:
    """Run one configuration and keep its samples; see :func:`run_config`."""
    if not isinstance(setting, GMMSetting):
        raise TypeError(f"setting must be a GMMSetting, got {type(setting).__name__}")
    _check_choice("method", method, METHODS)
    K = _check_int("K", K, 1)
    L = _check_int("L", L, 1)
    _check_choice("prefetch", prefetch, PREFETCH_POLICIES)
    _check_choice("verify", verify, VERIFY_MODES)
    _check_choice("draft", draft, DRAFT_KINDS)
    seed = _check_int("seed", seed, 0)
    if memory_gb is None:
        memory_gb = default_memory_gb()
    if isinstance(memory_gb, bool) or not isinstance(memory_gb, (int, float)) or not memory_gb > 0:
        raise ValueError(f"memory_gb must be a number > 0, got {memory_gb!r}")
    K, L = _normalize(method, K, L)
    if isinstance(tree, DraftTree):
        if method in ("standard", "rmc"):
            raise ValueError(f"a DraftTree as tree needs a tree method (dgrs, rank, antithetic), got method={method!r}")
        tree_mode = "custom"
        K, L = tree.max_children, tree.L
    else:
        _check_choice("tree", tree, TREE_MODES)
        tree_mode = tree
        if tree_mode != "uniform" and method != "standard":
            if budget is None:
                raise ValueError(f"budget (drafted states per round, >= 1) is required with tree={tree_mode!r}")
            budget = _check_int("budget", budget, 1)
        if tree_mode != "uniform" and method == "antithetic":
            raise ValueError(f"tree={tree_mode!r} plans irregular trees of i.i.d. children; use dgrs, rank or rmc")
        if tree_mode == "adaptive" and method != "standard":
            tree = AdaptiveTree(budget)
        elif tree_mode == "optimal" and method != "standard":
            tree = plan_tree(
                setting.mixture(), initial_states(16, setting.dim, _derive_seed(seed, 7)), budget=budget,
                steps=setting.steps, churn=setting.churn, coupling=COUPLING_OF[method], grid=setting.grid,
                draft=draft, prefetch=prefetch, verify=verify,
                generator=torch.Generator().manual_seed(_derive_seed(seed, 8)),
            )
        else:
            tree = make_tree(method, K, L, setting.steps)
    # a tree-less run has nothing to realize lazily
    lazy = bool(lazy) and tree is not None
    if method == "antithetic" and tree_mode != "custom" and K % 2:
        raise ValueError(f"K must be even for the antithetic method (K/2 mirrored pairs per node), got {K}")
    coupling = COUPLING_OF.get(method, "grs")

    n, T = setting.trajectories, setting.steps
    per_traj = bytes_per_trajectory(tree, setting.dim, lazy)
    size = chunk_size(per_traj, n, memory_gb)
    gmm = setting.mixture()
    x_T = initial_states(n, setting.dim, seed)

    t0 = time.perf_counter()
    parts: dict[str, list] = {
        k: [] for k in ("samples", "nfe", "attempts", "accepts", "delta_sum", "rows", "rounds", "spec_steps")
    }
    calls, target_seconds = 0, 0.0
    extra = {"lazy": True} if lazy else {}
    starts = list(range(0, n, size))
    for i, start in enumerate(starts):
        g = torch.Generator().manual_seed(_derive_seed(seed, _STREAM_CHUNK, i))
        out = sample(
            gmm,
            x_T[start : start + size],
            steps=T,
            churn=setting.churn,
            grid=setting.grid,
            tree=tree,
            coupling=coupling,
            draft=draft,
            prefetch=prefetch,
            verify=verify,
            generator=g,
            progress=progress,
            **extra,
        )
        s = out.stats
        parts["samples"].append(out.samples.to(torch.float32))
        for name in ("nfe", "attempts", "accepts", "delta_sum", "rows", "rounds", "spec_steps"):
            parts[name].append(getattr(s, name).cpu())
        calls += int(s.calls)
        target_seconds += s.target_seconds
    wall = time.perf_counter() - t0
    cat = {k: torch.cat(v) for k, v in parts.items()}

    nfe = cat["nfe"].double()
    t_det = setting.deterministic_steps
    speedup = T / nfe
    # stochastic steps per call spent on them (T >= 3 leaves at least one of each)
    speedup_paper = (T - t_det) / (nfe - t_det)
    att, acc = cat["attempts"].sum(0).double(), cat["accepts"].sum(0).double()
    per_depth = (acc / att).tolist()
    delta = (cat["delta_sum"].sum(0) / att).tolist()
    n_att = att.sum().item()
    nfe_mean, nfe_sem = _mean_sem(nfe)
    sp_mean, sp_sem = _mean_sem(speedup)
    pp_mean, pp_sem = _mean_sem(speedup_paper)
    rounds = cat["rounds"].sum().item()
    record = {
        "method": method,
        "K": K,
        "L": L,
        "budget": tree.budget if tree_mode != "uniform" and tree is not None else _budget(method, K, L),
        "tree": tree_mode,
        "tree_layers": None if tree is None else repr(tree),
        "trajectories": n,
        "nfe_mean": nfe_mean,
        "nfe_sem": nfe_sem,
        "speedup_mean": sp_mean,
        "speedup_sem": sp_sem,
        "speedup_paper_mean": pp_mean,
        "speedup_paper_sem": pp_sem,
        "accept_rate": _finite(acc.sum().item() / n_att) if n_att else None,
        "accept_rate_per_depth": [_finite(a) for a in per_depth],
        "delta_per_depth": [_finite(d) for d in delta],
        "steps_per_round": _finite(cat["spec_steps"].sum().item() / rounds) if rounds else None,
        "rows_mean": _finite(cat["rows"].double().mean().item()),
        "calls": calls,
        "wall_seconds": wall,
        "target_seconds": target_seconds,
        "grid": setting.grid,
        "churn": setting.churn,
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
        "chunk_size": size,
        "chunks": len(starts),
        "memory_gb": float(memory_gb),
        "bytes_per_trajectory": per_traj,
        "specforest_version": __version__,
        "torch_version": torch.__version__,
        "platform": platform.platform(),
    }
    return GMMRun(record, cat["samples"], tree)


def run_config(setting: GMMSetting, **options) -> dict:
    """Run one configuration of the experiment and summarize it.

    Args:
        setting: the experiment's :class:`GMMSetting`.
        method: ``standard``, ``rmc``, ``dgrs``, ``rank`` or ``antithetic`` (default ``dgrs``).
        K: tree width for the tree methods (even for ``antithetic``), ``>= 1``.
        L: tree depth for the tree methods; chain length ``B`` for ``rmc``; ``>= 1``.
        prefetch: ``nearest`` or ``parent`` (ERRATA 9).
        verify: ``internal`` or ``drafted``.
        draft: frozen prediction of the draft: ``velocity`` (default, the
            paper's protocol), ``drift``, ``x0`` or ``eps``.
        seed: seed of ``x_T`` and the sampling noise, ``>= 0``.
        lazy: realize only visited nodes (same law of samples and NFE, far less
            memory and time for big trees).
        memory_gb: memory limit that sets the chunk size (default
            :func:`default_memory_gb`).
        progress: show the sampler's progress bar (stderr).
        tree: ``uniform``, ``optimal`` or ``adaptive`` (see :data:`TREE_MODES`),
            or a :class:`~specforest.trees.DraftTree` to sample with as given
            (recorded as ``custom``, with ``K, L`` its widest node and depth).
        budget: drafted states per round for ``optimal`` and ``adaptive``.

    Returns:
        A JSON-serializable dict (NaN written as ``None``) with the options and
        ``budget``, ``nfe_mean``/``nfe_sem``, ``speedup_mean``/``speedup_sem``
        (``T / NFE``), ``speedup_paper_mean``/``speedup_paper_sem``
        (``(T - 2) / (NFE - 2)``), ``accept_rate`` (pooled per-step acceptance:
        accepts / verification problems), ``accept_rate_per_depth``,
        ``delta_per_depth``, ``wall_seconds``, ``mode``, ``chunk_size`` and more.
        ``K, L`` are recorded as ``(0, 0)`` for ``standard`` and ``(1, B)`` for ``rmc``.

    Raises:
        ValueError / TypeError: on invalid options, naming the option.
        MemoryError: if one trajectory does not fit ``memory_gb`` (use ``lazy``).
    """
    return simulate(setting, **options).record


def result_key(record: dict) -> tuple:
    """The identity of a configuration in a results file (:data:`KEY_FIELDS`)."""
    return tuple(float(record[k]) if k == "churn" else record[k] for k in KEY_FIELDS)


# -- the (K, L) sweep of Figures 3 and 7 ----------------------------------------------


SWEEP_METHODS = ("dgrs", "rank", "antithetic")
"""Tree methods a sweep can run at every ``(K, L)`` (antithetic at even ``K`` only)."""
METHOD_LABELS = {"standard": "standard", "rmc": "RMC", "dgrs": "D-GRS", "rank": "rank", "antithetic": "antithetic"}
"""Short names of the methods for tables and legends."""


def check_sweep_methods(methods: Sequence[str]) -> list[str]:
    """``methods`` without repeats, each one of :data:`SWEEP_METHODS` (``ValueError`` otherwise)."""
    methods = list(dict.fromkeys(methods))
    if not methods:
        raise ValueError(f"methods must name at least one of {SWEEP_METHODS}")
    for m in methods:
        _check_choice("methods", m, SWEEP_METHODS)
    return methods


def sweep_configs(
    K_values: Iterable[int], L_values: Iterable[int], steps: int, methods: Sequence[str] = ("dgrs",)
) -> list[tuple[str, int, int]]:
    """``(method, K, L)`` of the sweep, cheapest first.

    Each tree method of ``methods`` (:data:`SWEEP_METHODS`; ``antithetic`` at even
    ``K`` only) at every ``(K, L)``, and RMC at each distinct matched budget
    ``B = K + ... + K^L`` (recorded as ``(1, B)``). Cost is the number of tree
    nodes a full run realizes.
    """
    Ks = sorted({_check_int("K", k, 1) for k in K_values})
    Ls = sorted({_check_int("L", v, 1) for v in L_values})
    if not Ks or not Ls:
        raise ValueError("K_values and L_values must each name at least one value")
    methods = check_sweep_methods(methods)
    configs = {(m, K, L) for m in methods for K in Ks for L in Ls if not (m == "antithetic" and K % 2)}
    configs |= {("rmc", 1, _budget("dgrs", K, L)) for K in Ks for L in Ls}

    def cost(c):
        m, K, L = c
        nodes = 1 + (min(L, steps) if m == "rmc" else _budget(m, K, L))
        return (nodes, m, K, L)

    return sorted(configs, key=cost)


def load_results(path: str | os.PathLike[str]) -> list[dict]:
    """Records of a ``results.json`` (an empty list if it does not exist)."""
    return load_records(path)


def write_results(out_dir: str | os.PathLike[str], records: list[dict]) -> None:
    """Write ``results.json`` and ``results.csv`` atomically."""
    out_dir = Path(out_dir)
    atomic_write_text(out_dir / "results.json", json.dumps(records, indent=1, allow_nan=False) + "\n")
    atomic_write_text(out_dir / "results.csv", records_csv(records))


@dataclass
class SweepResult:
    """What :func:`run_sweep` returns.

    Attributes:
        records: this sweep's records, in run order (resumed ones included).
        ran: configurations run now.
        skipped: configurations found in the results file and not rerun.
        files: paths written.
    """

    records: list[dict]
    ran: int
    skipped: int
    files: list[Path] = field(default_factory=list)


def run_sweep(
    setting: GMMSetting,
    out_dir: str | os.PathLike[str],
    *,
    K_values: Sequence[int] = tuple(range(1, 8)),
    L_values: Sequence[int] = tuple(range(2, 8)),
    prefetch: str = "nearest",
    verify: str = "internal",
    seed: int = 0,
    lazy: bool = False,
    memory_gb: float | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    draft: str = "velocity",
    methods: Sequence[str] = ("dgrs",),
) -> SweepResult:
    """The ``(K, L)`` sweep: each tree method at each cell, RMC at each matched budget.

    Resumable: after each configuration ``results.json`` and ``results.csv`` in
    ``out_dir`` are rewritten atomically; configurations whose
    :func:`result_key` is already there are skipped. At the end the figures
    ``heatmap.png`` and ``speedup_vs_K.png`` are written (atomically too).

    Args:
        setting: the experiment's setting.
        out_dir: directory of the results and figures (created if missing).
        K_values, L_values: the grid (paper: K in 1..7, L in 2..7).
        methods: tree methods run at each cell (:data:`SWEEP_METHODS`; the
            paper's is ``dgrs``; ``antithetic`` only at even ``K``).
        prefetch, verify, seed, lazy, memory_gb: as in :func:`run_config`.
        progress: progress bar over configurations (stderr).
        log: receives one line per skipped or finished configuration.

    Returns:
        A :class:`SweepResult`.
    """
    out_dir = Path(out_dir)
    Ks, Ls = sorted(set(K_values)), sorted(set(L_values))
    configs = sweep_configs(Ks, Ls, setting.steps, methods)
    common = {"prefetch": prefetch, "verify": verify, "seed": seed, "draft": draft}
    json_path = out_dir / "results.json"
    records = load_results(json_path)
    done = {result_key(r): r for r in records if all(k in r for k in KEY_FIELDS)}

    def key_of(method, K, L):
        has_tree = method != "standard"
        return result_key(
            dict(
                asdict(setting),
                method=method,
                K=K,
                L=L,
                mode="lazy" if lazy and has_tree else "full",
                tree="uniform",
                **common,
            )
        )

    from tqdm.auto import tqdm

    say = log or (lambda s: None)
    biggest = max(1 + _budget(m, K, L) for m, K, L in configs if m != "rmc")
    if not lazy and biggest > _LAZY_ADVISED_NODES:
        say(
            f"warning: the largest tree has {biggest:,} nodes per trajectory; a full run realizes "
            "all of them, lazy=True (--lazy) only the visited ones"
        )
    mine, ran, skipped = [], 0, 0
    bar = tqdm(configs, desc="configurations", unit="config", disable=not progress)
    for method, K, L in bar:
        bar.set_postfix_str(f"{method} K={K} L={L}")
        key = key_of(method, K, L)
        if key in done:
            skipped += 1
            mine.append(done[key])
            say(f"skip {method} K={K} L={L}: already in {json_path}")
            continue
        rec = run_config(setting, method=method, K=K, L=L, lazy=lazy, memory_gb=memory_gb, **common)
        records.append(rec)
        done[key] = rec
        mine.append(rec)
        write_results(out_dir, records)
        ran += 1
        say(
            f"done {method} K={K} L={L} B={rec['budget']}: speedup {rec['speedup_mean']:.3f} "
            f"({rec['wall_seconds']:.1f} s)"
        )
    bar.close()
    if not json_path.exists():
        write_results(out_dir, records)
    files = [json_path, out_dir / "results.csv"]
    files += write_figures(mine, out_dir, Ks, Ls)
    return SweepResult(mine, ran, skipped, files)


def _grids(records: list[dict], Ks: Sequence[int], Ls: Sequence[int]):
    """``(len(Ls), len(Ks))`` arrays of mean and SEM speedup for RMC and each tree method."""
    tree = {(r["method"], r["K"], r["L"]): r for r in records if r["method"] in SWEEP_METHODS}
    rm = {r["L"]: r for r in records if r["method"] == "rmc"}
    shape = (len(Ls), len(Ks))
    out = {m: (np.full(shape, np.nan), np.full(shape, np.nan)) for m in ("rmc", *SWEEP_METHODS)}
    for i, L in enumerate(Ls):
        for j, K in enumerate(Ks):
            cells = [(m, tree.get((m, K, L))) for m in SWEEP_METHODS] + [("rmc", rm.get(_budget("dgrs", K, L)))]
            for m, r in cells:
                if r is not None:
                    out[m][0][i, j] = np.nan if r["speedup_mean"] is None else r["speedup_mean"]
                    out[m][1][i, j] = np.nan if r["speedup_sem"] is None else r["speedup_sem"]
    return out


def _save_figure(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=150, bbox_inches="tight"), binary=True)
    finally:
        plt.close(fig)
    return path


def _title(records: list[dict]) -> str:
    r = records[0]
    return (
        f"Gaussian mixture: d={r['dim']}, {r['components']} components, T={r['steps']}, "
        f"churn={r['churn']}, {r['grid']} grid, {r['trajectories']} trajectories, "
        f"prefetch={r['prefetch']}, verify={r['verify']}"
    )


def write_figures(
    records: list[dict], out_dir: str | os.PathLike[str], K_values: Sequence[int], L_values: Sequence[int]
) -> list[Path]:
    """Figure 3 (``heatmap.png``) and Figure 7 (``speedup_vs_K.png``) of one sweep.

    Args:
        records: the sweep's records (one setting).
        out_dir: where the PNGs go.
        K_values, L_values: the grid's axes.

    Returns:
        The two paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import cm, colors

    out_dir = Path(out_dir)
    Ks, Ls = sorted(K_values), sorted(L_values)
    g = _grids(records, Ks, Ls)
    vals = np.concatenate([g["rmc"][0].ravel(), g["dgrs"][0].ravel()])
    vals = vals[np.isfinite(vals)]
    vmin, vmax = (float(vals.min()), float(vals.max())) if vals.size else (1.0, 2.0)
    if vmax - vmin < 1e-9:
        vmin, vmax = vmin - 0.05, vmax + 0.05
    norm = colors.Normalize(vmin, vmax)
    title = _title(records) if records else "Gaussian mixture"

    fig, axes = plt.subplots(
        1, 2, figsize=(2.0 + 1.1 * len(Ks) * 2, 1.6 + 0.8 * len(Ls)), sharey=True, constrained_layout=True
    )
    for ax, m, name in zip(axes, ("rmc", "dgrs"), ("RMC (chain of matched B)", "D-GRS"), strict=True):
        z = g[m][0]
        im = ax.imshow(np.ma.masked_invalid(z), origin="lower", cmap="viridis", norm=norm, aspect="auto")
        for i in range(len(Ls)):
            for j in range(len(Ks)):
                if np.isfinite(z[i, j]):
                    light = norm(z[i, j]) > 0.6
                    ax.text(
                        j,
                        i,
                        f"{z[i, j]:.2f}\nB={_budget('dgrs', Ks[j], Ls[i])}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="black" if light else "white",
                    )
        ax.set_xticks(range(len(Ks)), [str(k) for k in Ks])
        ax.set_yticks(range(len(Ls)), [str(v) for v in Ls])
        ax.set_xlabel("K (children per node)")
        ax.set_title(name)
    axes[0].set_ylabel("L (lookahead depth)")
    fig.colorbar(im, ax=axes, label="speedup T / NFE (mean)")
    fig.suptitle(title, fontsize=8)
    heat = _save_figure(fig, out_dir / "heatmap.png")

    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    cmap = plt.get_cmap("viridis")
    lnorm = colors.Normalize(min(Ls), max(Ls) if max(Ls) > min(Ls) else min(Ls) + 1)
    x = np.array(Ks, dtype=float)
    rmc_labelled = False
    for i, L in enumerate(Ls):
        c = cmap(lnorm(L))
        mean, sem = g["dgrs"][0][i], g["dgrs"][1][i]
        ok = np.isfinite(mean)
        if ok.any():
            ax.plot(x[ok], mean[ok], "o-", color=c, ms=4, lw=1.5)
            s = np.where(np.isfinite(sem), sem, 0.0)[ok]
            ax.fill_between(x[ok], mean[ok] - s, mean[ok] + s, color=c, alpha=0.2, lw=0)
        r = g["rmc"][0][i]
        okr = np.isfinite(r)
        if okr.any():
            ax.plot(
                x[okr],
                r[okr],
                "x",
                color=c,
                ms=6,
                mew=1.5,
                ls="none",
                label=None if rmc_labelled else "RMC at matched budget B",
            )
            rmc_labelled = True
    # the other tree methods of the sweep, same colour per L, their own line style
    present = [m for m in SWEEP_METHODS[1:] if np.isfinite(g[m][0]).any()]
    for m, style in zip(present, ("^--", "v:"), strict=False):
        for i, L in enumerate(Ls):
            mean = g[m][0][i]
            ok = np.isfinite(mean)
            if ok.any():
                ax.plot(x[ok], mean[ok], style, color=cmap(lnorm(L)), ms=4, lw=1.3)
        ax.plot([], [], style, color="gray", label=METHOD_LABELS[m])
    ax.plot([], [], "o-", color="gray", label="D-GRS (mean, ±1 SEM band)")
    ax.set_xlabel("K (children per node)")
    ax.set_ylabel("speedup T / NFE")
    ax.set_xticks(Ks)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.colorbar(cm.ScalarMappable(norm=lnorm, cmap=cmap), ax=ax, label="L (lookahead depth)", ticks=Ls)
    ax.set_title(title, fontsize=7)
    line = _save_figure(fig, out_dir / "speedup_vs_K.png")
    return [heat, line]


# -- text summaries ---------------------------------------------------------------------


def _pm(mean: float | None, sem: float | None, digits: int = 3) -> str:
    if mean is None:
        return "n/a"
    return f"{mean:.{digits}f}" if sem is None else f"{mean:.{digits}f} ± {sem:.{digits}f}"


def format_result(r: dict) -> str:
    """A few human-readable lines describing one record."""
    what = describe_method(r)
    per_depth = " ".join("-" if a is None else f"{a:.2f}" for a in r["accept_rate_per_depth"][:10])
    if len(r["accept_rate_per_depth"]) > 10:
        per_depth += " ..."
    lines = [
        (
            f"{what}: {r['trajectories']} trajectories, d={r['dim']}, {r['components']} components, "
            f"T={r['steps']}, churn={r['churn']}, {r['grid']} grid, seed {r['seed']}, "
            f"mixture seed {r['mixture_seed']}"
        ),
        (
            f"  NFE {_pm(r['nfe_mean'], r['nfe_sem'], 2)}   speedup T/NFE {_pm(r['speedup_mean'], r['speedup_sem'])}"
            f"   paper accounting {_pm(r['speedup_paper_mean'], r['speedup_paper_sem'])}"
        ),
    ]
    if r["method"] != "standard":
        acc = "n/a" if r["accept_rate"] is None else f"{r['accept_rate']:.3f}"
        lines.append(f"  per-step acceptance {acc}; per depth {per_depth}")
        lines.append(f"  prefetch {r['prefetch']}, verify {r['verify']}, mode {r['mode']}")
    lines.append(
        f"  wall {r['wall_seconds']:.2f} s in {r['chunks']} chunk(s) of <= {r['chunk_size']} trajectories"
    )
    return "\n".join(lines)


def format_summary(records: list[dict]) -> str:
    """A table of a sweep: one line per ``(K, L)`` with each tree method and RMC at the same budget."""
    tree = {(r["method"], r["K"], r["L"]): r for r in records if r["method"] in SWEEP_METHODS}
    rm = {r["L"]: r for r in records if r["method"] == "rmc"}
    methods = [m for m in SWEEP_METHODS if any(k[0] == m for k in tree)]
    labels = [METHOD_LABELS[m] for m in [*methods, "rmc"]]
    head = f"{'L':>2} {'K':>2} {'B':>8}  " + "   ".join(
        f"{name + ' T/NFE':>16} {'paper acct':>10} {'acc':>5}" for name in labels
    )
    lines = [head, "-" * len(head)]

    def cells(r):
        if r is None:
            return f"{'-':>16} {'-':>10} {'-':>5}"
        acc = "-" if r["accept_rate"] is None else f"{r['accept_rate']:.2f}"
        pp = "-" if r["speedup_paper_mean"] is None else f"{r['speedup_paper_mean']:.3f}"
        return f"{_pm(r['speedup_mean'], r['speedup_sem']):>16} {pp:>10} {acc:>5}"

    for K, L in sorted({(k[1], k[2]) for k in tree}, key=lambda kl: (kl[1], kl[0])):
        B = _budget("dgrs", K, L)
        row = "   ".join(cells(tree.get((m, K, L))) for m in methods)
        lines.append(f"{L:>2} {K:>2} {B:>8}  {row}   {cells(rm.get(B))}")
    return "\n".join(lines)
