"""The pixel-space experiment of paper Sec. 5.2 (Figures 4 and 8), on digits.

The paper runs EDM's CIFAR-10 and FFHQ denoisers; this experiment runs the same
protocol on the package's small class-conditional digits model
(:mod:`specforest.models.digits`, ``1 x 8 x 8``, ``d = 64``), which trains in
minutes on a CPU. Speedups are therefore those of a different, much
lower-dimensional model: the paper reports 2.2-2.6x on CIFAR-10 and 2.0-2.2x on
FFHQ, and the mismatch between draft and target grows with ``sqrt(d)``.

Protocol (defaults): ``T = 100`` steps on diffusers' flow-matching grid
(noise levels ``linspace(1, 1e-3, T)`` then 0, ERRATA 6: the first and last
steps are deterministic Euler steps; the last stochastic level 1e-3 is the
paper's lower clip of the EDM noise level), churn ``eps``, 100 images with
labels drawn uniformly from the ten classes. Methods: ``standard`` (no tree,
exactly ``T`` NFE), ``rmc`` (Algorithm 2 on a chain of ``B`` drafted states;
``K, L`` recorded as ``(1, B)``) and ``dgrs`` (Algorithm 3 on the uniform
``(K, L)`` tree, ``B = K + ... + K^L``, ERRATA 7).

Conditioning: the labels are a ``(B,)`` tensor passed as ``cond``; the sampler
indexes per-trajectory tensors per row, so the nodes of different trajectories
share one batched call with their own labels, and one :func:`specforest.sample`
call covers every class.

Randomness: ``seed`` drives the labels and ``x_T`` (one stream) and the
sampling noise (another), so every method sees the same labels and initial
states at a seed. Speedups are ``T / NFE`` per image (every target call counts,
including both deterministic steps and the first root fetch) and, in the
paper's accounting, ``(T - 2) / (NFE - 2)``.

Each run also reports the shipped classifier's accuracy against the
conditioning label. ``lazy=True`` realizes only the visited tree nodes: the same
law of samples and NFE at a fraction of the compute, but its wall-clock is not
that of a batched run; use full mode to measure wall-clock.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .. import __version__, sample
from ..models.digits import IMAGE_SHAPE, NUM_CLASSES, DigitsClassifier, load_classifier, load_velocity
from ..planning import AdaptiveTree, plan_tree
from ..proposals import DRAFT_KINDS
from ..sampler import GRIDS, PREFETCH_POLICIES
from ..trees import VERIFY_MODES
from .gmm import (
    COUPLING_OF,
    METHOD_LABELS,
    SWEEP_METHODS,
    TREE_MODES,
    _check_choice,
    _check_int,
    _derive_seed,
    check_sweep_methods,
    make_tree,
)
from .io import atomic_write, atomic_write_text
from .results import describe_method

__all__ = [
    "METHODS",
    "PAPER_SPEEDUPS",
    "SWEEP_CHURNS",
    "SWEEP_TREES",
    "PixelRun",
    "SweepResult",
    "budget_of",
    "format_result",
    "format_summary",
    "initial_states",
    "run_sweep",
    "simulate",
    "write_figures",
]

METHODS = ("standard", "rmc", "dgrs", "rank", "antithetic")
SWEEP_TREES = ((2, 3), (2, 5), (3, 4), (4, 4))
"""The paper's ``(K, L)`` pairs of Sec. 5.2, budgets 14, 62, 120, 340."""
SWEEP_CHURNS = (0.1, 0.3, 0.6)
PAPER_SPEEDUPS = {"CIFAR-10 (32x32x3, EDM)": (2.2, 2.6), "FFHQ (64x64x3, EDM)": (2.0, 2.2)}
"""Speedup ranges the paper reports in Sec. 5.2 (a different model and dimension)."""

KEY_FIELDS = ("method", "K", "L", "churn", "samples", "steps", "grid", "seed", "prefetch", "verify", "mode")

# deterministic Euler steps of both grids: the step from 1 and the step into 0
_T_DET = 2
_STREAM_INIT, _STREAM_NOISE = 0, 1
# bounds the rows of one network call (a full (4, 4) round has 85 rows per image)
_MAX_ROWS = 4096


def budget_of(method: str, K: int, L: int) -> int:
    """Drafted states per round: 0, ``B = L`` for ``rmc``, ``K + ... + K^L`` for ``dgrs``."""
    if method == "standard":
        return 0
    if method == "rmc":
        return L
    return sum(K**level for level in range(1, L + 1))


def initial_states(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels ``(n,)`` uniform over the ten classes and ``x_T (n, 1, 8, 8) ~ N(0, I)``, from ``seed``."""
    g = torch.Generator().manual_seed(_derive_seed(seed, _STREAM_INIT))
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    return torch.randn((n,) + IMAGE_SHAPE, generator=g), labels


@dataclass
class PixelRun:
    """One configuration's outcome.

    Attributes:
        record: flat JSON-serializable summary (see :func:`simulate`).
        samples: ``(n, 1, 8, 8)`` float32 samples (not clipped).
        labels: ``(n,)`` long conditioning labels.
    """

    record: dict
    samples: torch.Tensor
    labels: torch.Tensor


def _finite(v: float) -> Optional[float]:
    return float(v) if math.isfinite(v) else None


def _sem(a: torch.Tensor) -> Optional[float]:
    return float(a.std() / math.sqrt(a.numel())) if a.numel() > 1 else None


def _normalize(method: str, K: int, L: int) -> tuple[int, int]:
    if method == "standard":
        return 0, 0
    if method == "rmc":
        return 1, L
    return K, L


def simulate(
    *,
    method: str = "dgrs",
    K: int = 2,
    L: int = 3,
    churn: float = 0.3,
    samples: int = 100,
    steps: int = 100,
    seed: int = 0,
    grid: str = "flow_match",
    prefetch: str = "nearest",
    verify: str = "internal",
    lazy: bool = False,
    progress: bool = False,
    draft: str = "velocity",
    tree: str = "uniform",
    budget: Optional[int] = None,
    model: Optional[Callable[..., torch.Tensor]] = None,
    classifier: Optional[DigitsClassifier] = None,
) -> PixelRun:
    """Sample ``samples`` class-conditional digits with one method and summarize.

    Args:
        method: ``standard``, ``rmc``, ``dgrs``, ``rank`` or ``antithetic`` (K even).
        K: tree width for ``dgrs`` (ignored otherwise), ``>= 1`` (``>= 0`` for ``standard``).
        L: tree depth for ``dgrs``; chain length ``B`` for ``rmc``; ``>= 1`` (``>= 0`` for ``standard``).
        churn: ``eps`` in (0, 1].
        samples: number of images ``>= 1``.
        steps: grid steps ``T >= 3``.
        seed: seed of the labels, ``x_T`` and the sampling noise, ``>= 0``.
        grid: ``flow_match`` or ``uniform``.
        prefetch: ``nearest`` or ``parent`` (ERRATA 9).
        verify: ``internal`` or ``drafted``.
        lazy: realize only visited nodes (same law and NFE; wall-clock not comparable).
        draft: frozen-prediction kind of the draft (``velocity``, ``drift``, ``x0``,
            ``eps``, ``x0_extrap`` or ``auto``).
        tree: ``uniform`` (the (K, L) tree), ``optimal`` (planned for ``budget`` from
            a short calibration run) or ``adaptive`` (re-planned every round).
        budget: drafted states per round for ``optimal`` / ``adaptive``.
        progress: the sampler's progress bar on stderr.
        model: the velocity (default: the shipped digits model).
        classifier: the evaluation classifier (default: the shipped one).

    Returns:
        A :class:`PixelRun`; its record holds the options and ``budget``,
        ``nfe_mean``/``nfe_sem``, ``speedup_mean``/``speedup_std``/``speedup_sem``
        (``T / NFE`` per image), ``speedup_paper_mean`` (``(T - 2) / (NFE - 2)``),
        ``accept_rate``, ``accept_rate_per_depth``, ``delta_per_depth`` (``None``
        where a depth was never reached), ``wall_seconds``, ``classifier_accuracy``.

    Raises:
        ValueError / TypeError: on invalid options, naming the option.
    """
    _check_choice("method", method, METHODS)
    lo = 0 if method == "standard" else 1  # standard ignores K and L
    K, L = _check_int("K", K, lo), _check_int("L", L, lo)
    n, T, seed = _check_int("samples", samples, 1), _check_int("steps", steps, 3), _check_int("seed", seed, 0)
    _check_choice("grid", grid, GRIDS)
    _check_choice("prefetch", prefetch, PREFETCH_POLICIES)
    _check_choice("verify", verify, VERIFY_MODES)
    _check_choice("draft", draft, DRAFT_KINDS)
    if method == "antithetic" and K % 2:
        raise ValueError(f"K must be even for the antithetic method (K/2 mirrored pairs per node), got {K}")
    if isinstance(churn, bool) or not isinstance(churn, (int, float)) or not 0.0 < churn <= 1.0:
        raise ValueError(f"churn must be a number in (0, 1], got {churn!r}")
    K, L = _normalize(method, K, L)
    _check_choice("tree", tree, TREE_MODES)
    tree_mode = tree
    model = load_velocity() if model is None else model
    classifier = load_classifier() if classifier is None else classifier
    x_T, labels = initial_states(n, seed)
    if tree_mode != "uniform" and method != "standard":
        if budget is None:
            raise ValueError(f"budget (drafted states per round, >= 1) is required with tree={tree_mode!r}")
        budget = _check_int("budget", budget, 1)
        if method == "antithetic":
            raise ValueError(f"tree={tree_mode!r} plans irregular trees of i.i.d. children; use dgrs, rank or rmc")
        if tree_mode == "adaptive":
            tree = AdaptiveTree(budget)
        else:
            cx, cl = initial_states(16, _derive_seed(seed, 7))
            tree = plan_tree(model, cx, budget=budget, steps=T, churn=float(churn), coupling=COUPLING_OF[method],
                             grid=grid, draft=draft, prefetch=prefetch, verify=verify,
                             cond={"class_labels": cl},
                             generator=torch.Generator().manual_seed(_derive_seed(seed, 8)))
    else:
        tree = make_tree(method, K, L, T)
    lazy = bool(lazy) and tree is not None

    g = torch.Generator().manual_seed(_derive_seed(seed, _STREAM_NOISE))
    out = sample(
        model,
        x_T,
        steps=T,
        churn=float(churn),
        grid=grid,
        tree=tree,
        coupling=COUPLING_OF.get(method, "grs"),
        draft=draft,
        prefetch=prefetch,
        verify=verify,
        generator=g,
        progress=progress,
        cond={"class_labels": labels},
        lazy=lazy,
        max_rows=_MAX_ROWS,
    )
    s = out.stats
    nfe = s.nfe.double()
    speedup = T / nfe
    att, acc = s.attempts.sum(0).double(), s.accepts.sum(0).double()
    n_att = att.sum().item()
    with torch.no_grad():
        accuracy = float((classifier.predict(out.samples) == labels).float().mean())
    record = {
        "method": method,
        "K": K,
        "L": L,
        "budget": budget if tree_mode != "uniform" and method != "standard" else budget_of(method, K, L),
        "tree": tree_mode,
        "samples": n,
        "churn": float(churn),
        "steps": T,
        "nfe_mean": float(nfe.mean()),
        "nfe_sem": _sem(nfe),
        "speedup_mean": float(speedup.mean()),
        "speedup_std": float(speedup.std()) if n > 1 else None,
        "speedup_sem": _sem(speedup),
        "speedup_paper_mean": float(((T - _T_DET) / (nfe - _T_DET)).mean()),
        "accept_rate": _finite(acc.sum().item() / n_att) if n_att else None,
        "accept_rate_per_depth": [_finite(a) for a in (acc / att).tolist()],
        "delta_per_depth": [_finite(d) for d in (s.delta_sum.sum(0) / att).tolist()],
        "wall_seconds": float(s.wall_seconds),
        "target_seconds": float(s.target_seconds),
        "classifier_accuracy": accuracy,
        "calls": int(s.calls),
        "rows_mean": float(s.rows.double().mean()),
        "grid": grid,
        "seed": seed,
        "prefetch": prefetch,
        "verify": verify,
        "mode": "lazy" if lazy else "full",
        "coupling": None if tree is None else COUPLING_OF[method],
        "draft": draft,
        "tree_layers": None if tree is None else repr(tree),
        "model": "digits 1x8x8 (EDM U-Net)",
        "specforest_version": __version__,
        "torch_version": torch.__version__,
    }
    return PixelRun(record, out.samples.to(torch.float32), labels)


def format_result(r: dict) -> str:
    """A few human-readable lines describing one record."""
    what = describe_method(r)
    sd = "" if r["speedup_std"] is None else f" (std {r['speedup_std']:.3f})"
    lines = [
        f"{what}: {r['samples']} digits, T={r['steps']} ({r['grid']}), churn {r['churn']}, {r['mode']} mode",
        f"  NFE {r['nfe_mean']:.2f}   speedup T/NFE {r['speedup_mean']:.3f}{sd}"
        f"   paper accounting {r['speedup_paper_mean']:.3f}",
    ]
    if r["method"] != "standard":
        per = ", ".join("-" if a is None else f"{a:.2f}" for a in r["accept_rate_per_depth"])
        lines.append(f"  acceptance per depth [{per}]")
    lines.append(f"  classifier accuracy vs label {r['classifier_accuracy']:.3f}   wall {r['wall_seconds']:.1f} s")
    return "\n".join(lines)


# -- the sweep of Figures 4 and 8 ---------------------------------------------------------


@dataclass
class SweepResult:
    """What :func:`run_sweep` did: all records, how many ran or were skipped, the files."""

    records: list[dict]
    ran: int = 0
    skipped: int = 0
    files: list[Path] = field(default_factory=list)


def _key(r: dict) -> tuple:
    return tuple(float(r[k]) if k == "churn" else r[k] for k in KEY_FIELDS)


def _samples_name(r: dict) -> str:
    return f"{r['method']}_K{r['K']}_L{r['L']}_churn{r['churn']:g}.npz"


def sweep_configs(
    pairs: Iterable[tuple[int, int]], churns: Iterable[float], methods: Sequence[str] = ("dgrs",)
) -> list[tuple[str, int, int, float]]:
    """``(method, K, L, churn)``: standard, then each tree method of ``methods`` at each
    ``(K, L)`` (antithetic at even ``K`` only) and RMC at each matched budget."""
    methods = check_sweep_methods(methods)
    out = []
    for churn in churns:
        out.append(("standard", 0, 0, float(churn)))
        for K, L in pairs:
            out += [(m, K, L, float(churn)) for m in methods if not (m == "antithetic" and K % 2)]
            out.append(("rmc", 1, budget_of("dgrs", K, L), float(churn)))
    return out


def run_sweep(
    out_dir: str | Path,
    *,
    pairs: Sequence[tuple[int, int]] = SWEEP_TREES,
    churns: Sequence[float] = SWEEP_CHURNS,
    samples: int = 100,
    steps: int = 100,
    seed: int = 0,
    grid: str = "flow_match",
    prefetch: str = "nearest",
    verify: str = "internal",
    lazy: bool = True,
    progress: bool = True,
    log: Callable[[str], None] = lambda s: None,
    methods: Sequence[str] = ("dgrs",),
) -> SweepResult:
    """Each tree method (D-GRS by default) at each ``(K, L)`` vs RMC at the matched
    budget, at each churn (Figure 4).

    Resumable: configurations already in ``OUT/results.json`` are skipped. Each
    run's samples go to ``OUT/samples/*.npz``. Writes ``results.json``,
    ``results.csv``, ``speedup_vs_budget.png`` and ``samples_grid.png``, all atomically.

    Args:
        out_dir: output directory.
        pairs: ``(K, L)`` of the trees (the paper's by default).
        methods: tree methods run at each ``(K, L)`` (:data:`SWEEP_METHODS`).
        churns: churn levels.
        samples, steps, seed, grid, prefetch, verify, lazy: as in :func:`simulate`
            (lazy by default: identical law and NFE, much faster on a CPU).
        progress: a progress bar over configurations on stderr.
        log: receives one line per configuration.
    """
    out_dir = Path(out_dir)
    res_path = out_dir / "results.json"
    records: list[dict] = json.loads(res_path.read_text()) if res_path.exists() else []
    done = {_key(r) for r in records}
    model, clf = load_velocity(), load_classifier()
    configs = sweep_configs(pairs, churns, methods)
    result = SweepResult(records)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(configs), desc="pixel sweep", unit="config")
    for method, K, L, churn in configs:
        key_rec = dict(
            method=method,
            K=K,
            L=L,
            churn=churn,
            samples=samples,
            steps=steps,
            grid=grid,
            seed=seed,
            prefetch=prefetch,
            verify=verify,
            mode="lazy" if lazy and method != "standard" else "full",
        )
        if _key(key_rec) in done:
            result.skipped += 1
        else:
            run = simulate(
                method=method,
                K=K,
                L=L,
                churn=churn,
                samples=samples,
                steps=steps,
                seed=seed,
                grid=grid,
                prefetch=prefetch,
                verify=verify,
                lazy=lazy,
                model=model,
                classifier=clf,
            )
            r = run.record
            sm = run.samples.clamp(-1, 1).numpy()
            lb = run.labels.numpy()
            atomic_write(
                out_dir / "samples" / _samples_name(r),
                lambda f, s=sm, y=lb: np.savez(f, samples=s, labels=y),
                binary=True,
            )
            records.append(r)
            done.add(_key(r))
            atomic_write_text(res_path, json.dumps(records, indent=1, allow_nan=False) + "\n")
            result.ran += 1
            log(
                f"{method:>8} K={K} L={L:>3} B={r['budget']:>3} churn={churn}: "
                f"speedup {r['speedup_mean']:.3f} ± {r['speedup_std'] or 0:.3f}, "
                f"accuracy {r['classifier_accuracy']:.3f}"
            )
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    result.files = [res_path, _write_csv(records, out_dir / "results.csv"), *write_figures(records, out_dir)]
    return result


def _write_csv(records: list[dict], path: Path) -> Path:
    cols = [
        "method",
        "K",
        "L",
        "budget",
        "churn",
        "samples",
        "steps",
        "grid",
        "seed",
        "mode",
        "nfe_mean",
        "speedup_mean",
        "speedup_std",
        "speedup_sem",
        "speedup_paper_mean",
        "accept_rate",
        "accept_rate_per_depth",
        "delta_per_depth",
        "classifier_accuracy",
        "wall_seconds",
    ]
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(cols)
    for r in records:
        w.writerow([json.dumps(r[c]) if isinstance(r[c], list) else r[c] for c in cols])
    return atomic_write_text(path, buf.getvalue())


def _png(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=130), binary=True)
    plt.close(fig)
    return path


def image_grid(images: np.ndarray, cols: int = 8, pad: int = 1) -> np.ndarray:
    """Tile ``(n, 1, h, w)`` images in ``[-1, 1]`` into one 2-D array in ``[0, 1]`` (padding at 1)."""
    n, _, h, w = images.shape
    rows = math.ceil(n / cols)
    out = np.ones((rows * (h + pad) + pad, cols * (w + pad) + pad), dtype=np.float32)
    for i in range(n):
        r, c = divmod(i, cols)
        out[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + c * (w + pad) : pad + c * (w + pad) + w] = (
            np.clip(images[i, 0], -1, 1) + 1
        ) / 2
    return out


def write_figures(records: list[dict], out_dir: str | Path) -> list[Path]:
    """``speedup_vs_budget.png`` (Figure 4-like) and ``samples_grid.png`` (Figure 8-like).

    The speedup figure has one panel per churn: mean ± std of ``T / NFE`` per
    image against the budget, RMC vs D-GRS. The grid shows the first 64 samples
    of RMC (top) and D-GRS (bottom) at the largest budget of each churn, read
    from ``out_dir/samples``; it is skipped when those files are missing.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    files: list[Path] = []
    churns = sorted({r["churn"] for r in records if r["method"] != "standard"})
    if not churns:
        return files
    fig, axes = plt.subplots(1, len(churns), figsize=(4.2 * len(churns), 3.6), squeeze=False, sharey=True)
    for ax, churn in zip(axes[0], churns, strict=True):
        for method, label, marker in (("rmc", "RMC", "s"), ("dgrs", "D-GRS", "o"), ("rank", "rank", "^"),
                                      ("antithetic", "antithetic", "v")):
            rs = sorted(
                (r for r in records if r["method"] == method and r["churn"] == churn),
                key=lambda r: r["budget"],
            )
            if rs:
                ax.errorbar(
                    [r["budget"] for r in rs],
                    [r["speedup_mean"] for r in rs],
                    yerr=[r["speedup_std"] or 0.0 for r in rs],
                    marker=marker,
                    capsize=3,
                    label=label,
                )
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        budgets = sorted({r["budget"] for r in records if r["method"] != "standard" and r["churn"] == churn})
        ax.set_xscale("log")
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.set_xlabel("budget B (drafted states)")
        ax.set_title(f"churn {churn:g}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("speedup T / NFE (mean ± std)")
    axes[0][0].legend()
    fig.suptitle("digits 1x8x8, T=100: speedup vs budget")
    fig.tight_layout()
    files.append(_png(fig, out_dir / "speedup_vs_budget.png"))

    panels = []
    for churn in churns:
        row = []
        for method in ("rmc", "dgrs"):
            rs = [r for r in records if r["method"] == method and r["churn"] == churn]
            if not rs:
                break
            r = max(rs, key=lambda r: r["budget"])
            p = out_dir / "samples" / _samples_name(r)
            if not p.exists():
                break
            with np.load(p) as z:
                row.append((r, z["samples"][:64]))
        if len(row) == 2:
            panels.append((churn, row))
    if panels:
        fig, axes = plt.subplots(2, len(panels), figsize=(3.2 * len(panels), 6.6), squeeze=False)
        for j, (churn, row) in enumerate(panels):
            for i, (r, imgs) in enumerate(row):
                ax = axes[i][j]
                ax.imshow(image_grid(imgs), cmap="gray_r", vmin=0, vmax=1, interpolation="nearest")
                name = "RMC" if r["method"] == "rmc" else f"D-GRS ({r['K']},{r['L']})"
                ax.set_title(f"{name}, B={r['budget']}, churn {churn:g}", fontsize=9)
                ax.axis("off")
        fig.tight_layout()
        files.append(_png(fig, out_dir / "samples_grid.png"))
    return files


def format_summary(records: list[dict]) -> str:
    """A table: speedup mean ± std of each method at each churn and budget, and classifier accuracy."""

    def cell(r: Optional[dict]) -> str:
        return "-" if r is None else f"{r['speedup_mean']:.2f} ± {r['speedup_std'] or 0:.2f}"

    def acc(r: Optional[dict]) -> str:
        return "-" if r is None else f"{r['classifier_accuracy']:.3f}"

    methods = [m for m in (*SWEEP_METHODS, "rmc") if any(r["method"] == m for r in records)]
    head = f"{'churn':>5} {'B':>4} {'(K,L)':>6}  " + " ".join(f"{METHOD_LABELS[m]:>15}" for m in methods)
    lines = [head + "  " + " ".join(f"{'acc ' + METHOD_LABELS[m]:>14}" for m in methods)]
    for churn in sorted({r["churn"] for r in records}):
        by = {m: {r["budget"]: r for r in records if r["method"] == m and r["churn"] == churn} for m in methods}
        for B in sorted(set().union(*by.values())):
            rows = [by[m].get(B) for m in methods]
            tree = next((r for r in rows if r is not None and r["method"] != "rmc"), None)
            kl = f"({tree['K']},{tree['L']})" if tree else ""
            lines.append(f"{churn:>5g} {B:>4} {kl:>6}  " + " ".join(f"{cell(r):>15}" for r in rows)
                         + "  " + " ".join(f"{acc(r):>14}" for r in rows))
    return "\n".join(lines)
