"""The ``(K, L)`` sweep of paper Figures 3 and 7: every tree method at every cell, RMC at each matched budget."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from pathlib import Path

from ..common import (
    SweepResult,
    budget_of,
    chain_record,
    check_int,
    check_sweep_methods,
    record_key,
    write_records,
)
from ..io import load_records
from .report import write_figures
from .run import run_config
from .setting import KEY_FIELDS, GMMSetting

__all__ = ["SweepResult", "load_results", "result_key", "run_sweep", "sweep_configs", "write_results"]

# Trees above this size make a full sweep slow enough to advise lazy mode.
_LAZY_ADVISED_NODES = 100_000


def result_key(record: dict) -> tuple:
    """The identity of a configuration in a results file (:data:`KEY_FIELDS`)."""
    return record_key(record, KEY_FIELDS)


def sweep_configs(
    K_values: Iterable[int], L_values: Iterable[int], steps: int, methods: Sequence[str] = ("dgrs",)
) -> list[tuple[str, int, int]]:
    """``(method, K, L)`` of the sweep, cheapest first.

    Each tree method of ``methods`` (:data:`SWEEP_METHODS`; ``antithetic`` at even
    ``K`` only) at every ``(K, L)``, and RMC at each distinct matched budget
    ``B = K + ... + K^L`` (recorded as ``(1, B)``). Cost is the number of tree
    nodes a full run realizes.
    """
    Ks = sorted({check_int("K", k, 1) for k in K_values})
    Ls = sorted({check_int("L", v, 1) for v in L_values})
    if not Ks or not Ls:
        raise ValueError("K_values and L_values must each name at least one value")
    methods = check_sweep_methods(methods)
    configs = {(m, K, L) for m in methods for K in Ks for L in Ls if not (m == "antithetic" and K % 2)}
    configs |= {("rmc", 1, budget_of("dgrs", K, L)) for K in Ks for L in Ls}

    def cost(c):
        m, K, L = c
        nodes = 1 + (min(L, steps) if m == "rmc" else budget_of(m, K, L))
        return (nodes, m, K, L)

    return sorted(configs, key=cost)


def load_results(path: str | os.PathLike[str]) -> list[dict]:
    """Records of a ``results.json`` (an empty list if it does not exist)."""
    return load_records(path)


def write_results(out_dir: str | os.PathLike[str], records: list[dict]) -> list[Path]:
    """Write ``results.json`` and ``results.csv`` atomically."""
    return write_records(out_dir, records)


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
    # (a record written before chains ran the em chain at its churn: record_key says so)
    done = {result_key(r): r for r in records if all(k in r for k in KEY_FIELDS if k != "chain")}

    def key_of(method, K, L):
        has_tree = method != "standard"
        return result_key(
            dict(
                asdict(setting),
                **chain_record(setting.run_chain),
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
    biggest = max(1 + budget_of(m, K, L) for m, K, L in configs if m != "rmc")
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
