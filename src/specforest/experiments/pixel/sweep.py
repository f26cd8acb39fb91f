"""The sweep of paper Figures 4 and 8: each tree method at each ``(K, L)`` against RMC at the matched budget."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from ...models.digits import load_classifier, load_velocity
from ..common import SweepResult, budget_of, check_sweep_methods, record_key, write_records
from ..io import atomic_write, load_records
from .report import write_figures
from .run import simulate
from .setting import KEY_FIELDS, SWEEP_CHURNS, SWEEP_TREES, samples_path

__all__ = ["run_sweep", "sweep_configs"]


def sweep_configs(
    pairs: Iterable[tuple[int, int]], churns: Iterable[float], methods: Sequence[str] = ("dgrs",)
) -> list[tuple[str, int, int, float]]:
    """``(method, K, L, churn)`` of the sweep, churn by churn.

    At each churn: the standard sampler, then each tree method of ``methods``
    (:data:`~specforest.experiments.common.SWEEP_METHODS`; ``antithetic`` at even
    ``K`` only) at each ``(K, L)`` and RMC at the matched budget
    ``B = K + ... + K^L`` (recorded as ``(1, B)``).
    """
    methods = check_sweep_methods(methods)
    out = []
    for churn in churns:
        out.append(("standard", 0, 0, float(churn)))
        for K, L in pairs:
            out += [(m, K, L, float(churn)) for m in methods if not (m == "antithetic" and K % 2)]
            out.append(("rmc", 1, budget_of("dgrs", K, L), float(churn)))
    return out


def run_sweep(
    out_dir: str | os.PathLike[str],
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

    Resumable: configurations already in ``OUT/results.json`` (same
    :data:`~.setting.KEY_FIELDS`) are skipped; after each configuration
    ``results.json`` and ``results.csv`` are rewritten atomically. Each run's
    samples go to ``OUT/samples/*.npz`` (:func:`~.setting.samples_path`). At the
    end the figures ``speedup_vs_budget.png`` and ``samples_grid.png`` are
    written, atomically too.

    Args:
        out_dir: output directory.
        pairs: ``(K, L)`` of the trees (the paper's by default).
        churns: churn levels.
        samples, steps, seed, grid, prefetch, verify, lazy: as in :func:`~.run.simulate`
            (lazy by default: identical law and NFE, much faster on a CPU).
        progress: a progress bar over configurations on stderr.
        log: receives one line per configuration run.
        methods: tree methods run at each ``(K, L)`` (:data:`~specforest.experiments.common.SWEEP_METHODS`).

    Returns:
        A :class:`~specforest.experiments.common.SweepResult` whose records are
        every record of ``results.json``.
    """
    from tqdm.auto import tqdm

    records = load_records(os.path.join(out_dir, "results.json"))
    done = {record_key(r, KEY_FIELDS) for r in records if all(k in r for k in KEY_FIELDS)}
    model, clf = load_velocity(), load_classifier()
    configs = sweep_configs(pairs, churns, methods)
    options = {"samples": samples, "steps": steps, "seed": seed, "grid": grid, "prefetch": prefetch, "verify": verify}
    ran = skipped = 0
    for method, K, L, churn in tqdm(configs, desc="pixel sweep", unit="config", disable=not progress):
        mode = "lazy" if lazy and method != "standard" else "full"
        if record_key(dict(options, method=method, K=K, L=L, churn=churn, mode=mode), KEY_FIELDS) in done:
            skipped += 1
            continue
        run = simulate(method=method, K=K, L=L, churn=churn, lazy=lazy, model=model, classifier=clf, **options)
        r = run.record
        sm, lb = run.samples.clamp(-1, 1).numpy(), run.labels.numpy()
        atomic_write(samples_path(out_dir, r), lambda f, s=sm, y=lb: np.savez(f, samples=s, labels=y), binary=True)
        records.append(r)
        done.add(record_key(r, KEY_FIELDS))
        write_records(out_dir, records)
        ran += 1
        log(
            f"{method:>8} K={K} L={L:>3} B={r['budget']:>3} churn={churn}: "
            f"speedup {r['speedup_mean']:.3f} ± {r['speedup_std'] or 0:.3f}, "
            f"accuracy {r['classifier_accuracy']:.3f}"
        )
    files = write_records(out_dir, records) + write_figures(records, out_dir)
    return SweepResult(records, ran, skipped, files)
