"""Scale-out: continuous batching against fixed batches, and tree-parallel round time on 1 and 2 processes.

    .venv/bin/python benchmarks/distributed.py

1. **Continuous batching** (``specforest.generate``) against fixed batches
   (``specforest.sample`` on consecutive blocks of ``--batch`` indices), for
   M = 2000 samples with D-GRS, on the paper's Gaussian mixture (d = 500,
   T = 30, churn 0.1, tree (5, 3), 64 slots) and the shipped digits model
   (T = 100, churn 0.3, tree (2, 3), 64 slots), one process, one thread:
   rounds (target calls), occupancy (mean fraction of the slots holding an
   unfinished trajectory per round) and samples per second. Both produce
   the same samples (per-sample streams); only the scheduling differs.
2. **Tree-parallel verification** (``sample(..., process_group=...)``) with
   the digits model at budget 62 (the (2, 5) tree, ``verify="drafted"``,
   8 images, T = 100): median time per round on 1 and 2 gloo processes
   launched by ``torchrun`` (one thread each), and one process with two
   threads for comparison. Every process runs the sampler; the target's rows
   are split. NCCL rows need more than one GPU.

Regenerates the ``distributed`` section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _models(quick: bool):
    import torch

    from specforest import streams, trees
    from specforest.models import GaussianMixture
    from specforest.models.digits import NUM_CLASSES, load_velocity

    gmm = GaussianMixture.paper(dim=500, components=5, seed=0)
    digits = load_velocity()

    def labels(idx):
        return {"class_labels": (idx % NUM_CLASSES).long()}

    T_gmm, T_px = (10, 20) if quick else (30, 100)
    return [
        (
            "Gaussian mixture, D-GRS (5,3)",
            gmm,
            lambda i: streams.randn(3, i, (500,)),
            None,
            dict(steps=T_gmm, churn=0.1, tree=trees.uniform(5, 3), verify="drafted"),
        ),
        (
            "digits, D-GRS (2,3)",
            digits,
            lambda i: streams.randn(3, i, (1, 8, 8)),
            labels,
            dict(steps=T_px, churn=0.3, tree=trees.uniform(2, 3)),
        ),
    ], torch


def batching(count: int, batch: int, quick: bool) -> list:
    """Rows of part 1."""
    import specforest

    models, torch = _models(quick)
    torch.set_num_threads(1)
    rows = []
    for label, model, make_x, make_cond, opts in models:
        t0 = time.perf_counter()
        gen = specforest.generate(model, count=count, make_x=make_x, make_cond=make_cond, seed=0, batch=batch, **opts)
        n = sum(len(f.index) for f in gen)
        cont = time.perf_counter() - t0
        t0 = time.perf_counter()
        rounds = busy = 0
        for start in range(0, count, batch):
            idx = torch.arange(start, min(start + batch, count))
            cond = None if make_cond is None else make_cond(idx)
            out = specforest.sample(model, make_x(idx), seed=0, sample_index=idx, cond=cond, **opts)
            rounds += out.stats.calls
            busy += int(out.stats.nfe.sum())
        fixed = time.perf_counter() - t0
        rows.append(
            dict(
                model=label,
                count=n,
                batch=batch,
                cont_rounds=gen.stats.rounds,
                cont_occ=gen.stats.occupancy,
                cont_rate=n / cont,
                fixed_rounds=rounds,
                fixed_occ=busy / (rounds * batch),
                fixed_rate=count / fixed,
            )
        )
    return rows


def worker(images: int, steps: int, rounds_out: str) -> None:
    """One process of part 2 (under torchrun): time the rounds of a tree-parallel run."""
    import torch
    import torch.distributed as dist

    import specforest
    from specforest import distributed, streams, trees
    from specforest.models.digits import load_velocity

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    group = None
    if distributed.init_from_env("cpu"):
        group = dist.group.WORLD
    model = load_velocity()
    idx = torch.arange(images)
    x = streams.randn(0, idx, (1, 8, 8))
    cond = {"class_labels": idx % 10}
    times = []
    last = [time.perf_counter()]

    def tick(_):
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    kw = dict(steps=steps, churn=0.3, tree=trees.uniform(2, 5), verify="drafted", seed=0, cond=cond)
    specforest.sample(model, x, process_group=group, **kw)  # warm-up
    med = []
    for _ in range(3):
        times.clear()
        last[0] = time.perf_counter()
        out = specforest.sample(model, x, process_group=group, callback=tick, **kw)
        med.append(statistics.median(times))
    if distributed.rank() == 0:
        rows = int(out.stats.rows.sum()) / out.stats.calls
        Path(rounds_out).write_text(
            json.dumps(dict(round_ms=1e3 * statistics.median(med), calls=out.stats.calls, rows=rows)) + "\n"
        )
    if group is not None:
        dist.destroy_process_group()


def tree_parallel(images: int, steps: int) -> list:
    """Rows of part 2: 1 process x 1 thread, 1 process x 2 threads, 2 processes x 1 thread."""
    rows = []
    for procs, threads in ((1, 1), (1, 2), (2, 1)):
        out = ROOT / f".bench-tp-{procs}-{threads}.json"
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), BENCH_THREADS=str(threads))
        args = [__file__, "--worker", "--images", str(images), "--steps", str(steps), "--worker-out", str(out)]
        if procs == 1:
            cmd = [sys.executable, *args]
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc_per_node={procs}",
                "--master-port=29651",
                *args,
            ]
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True)
        r = json.loads(out.read_text())
        out.unlink()
        rows.append(dict(procs=procs, threads=threads, **r))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=2000, help="samples per model in part 1")
    ap.add_argument("--batch", type=int, default=64, help="slots (and fixed batch size) in part 1")
    ap.add_argument("--images", type=int, default=8, help="images of the tree-parallel run")
    ap.add_argument("--steps", type=int, default=100, help="grid steps of the tree-parallel run")
    ap.add_argument("--quick", action="store_true", help="a smoke run, not for the table")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = ap.parse_args()
    if args.worker:
        worker(args.images, args.steps, args.worker_out)
        return
    from specforest.experiments.results import machine_line, replace_section

    count = 200 if args.quick else args.count
    part1 = batching(count, args.batch, args.quick)
    part2 = tree_parallel(args.images, 20 if args.quick else args.steps)
    lines = [
        "`.venv/bin/python benchmarks/distributed.py` on " + machine_line() + ".",
        "",
        f"Continuous batching against fixed batches: {count} samples per model, {args.batch} slots, one process, "
        "one thread. Both make the same samples; occupancy is the mean fraction of slots holding an unfinished "
        "trajectory per round.",
        "",
        "| model | scheduling | target calls | occupancy | samples / s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in part1:
        lines.append(
            f"| {r['model']} | fixed batches | {r['fixed_rounds']} | {r['fixed_occ']:.3f} | {r['fixed_rate']:.1f} |"
        )
        lines.append(
            f"| {r['model']} | continuous | {r['cont_rounds']} | {r['cont_occ']:.3f} | {r['cont_rate']:.1f} "
            f"({r['cont_rate'] / r['fixed_rate']:.2f}x) |"
        )
    base = part2[0]["round_ms"]
    lines += [
        "",
        f"Tree-parallel verification: digits model, budget 62 (the (2, 5) tree, verify=drafted), {args.images} images, "
        f"T = {20 if args.quick else args.steps}; median time per round (median of 3 runs), every process runs the "
        "sampler and evaluates its share of the rows. The samples equal the one-process run's (tests/test_generate.py).",
        "",
        "| backend | processes x threads | rows per call | time per round | vs 1 x 1 |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in part2:
        backend = "none" if r["procs"] == 1 else "gloo (CPU)"
        lines.append(
            f"| {backend} | {r['procs']} x {r['threads']} | {r['rows']:.0f} | {r['round_ms']:.2f} ms | "
            f"{base / r['round_ms']:.2f}x |"
        )
    lines.append("| NCCL (GPUs) | 2 x 1 | - | not measured (no GPUs here) | - |")
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        replace_section(
            args.out, "distributed", "## Scale-out: continuous batching and tree-parallel verification", text
        )


if __name__ == "__main__":
    main()
