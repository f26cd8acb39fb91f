"""Seconds, not calls: the batch-cost curve, and latency and throughput of every sampler next to its prediction.

    .venv/bin/python benchmarks/wallclock.py [--device cuda]

For the Gaussian mixture of the paper (d = 500, T = 30, churn 0.1) and the
shipped digits model (T = 100, churn 0.3), on one pinned CPU thread (or the
given device):

1. the target's batch-cost curve ``time(b) / time(1)``, b = 1 .. 512
   (``specforest.latency.measure_cost_curve``, median of 7 calls);
2. per-image latency (one image per run) and throughput (64 images per run)
   of the standard sampler, the RMC chain of 14, D-GRS (2, 3), rank (2, 3),
   the call-optimal planned tree (``planning.plan_tree``, budget 62) and the
   latency-optimal tuned configuration (``latency.tune`` over every registered
   draft): target calls, rows
   per image, the sampler's own time per round, wall time per image (one image
   per run: the mean of ``--latency-runs`` runs, 20, with its standard error,
   since a run's time follows its random number of rounds and the prediction is
   its expectation; 64 images: the median of ``--repeats`` runs; the
   configurations interleaved, at one image each timed run right after an
   untimed run of the same configuration, Python's cyclic collector off during
   each run as in ``timeit``) and the speedup over the standard
   sampler in the same run, next to the cost model's prediction
   (``latency.Calibrator``), and the pooled factor by which a call inside a
   run costs more than on the curve. The runs come in ``--blocks`` blocks (4);
   before each, every row is timed again side by side
   (``Calibrator.time(..., fresh=True)``) and predicted, and a row's prediction
   is the mean of its blocks'. Each prediction is made before its runs, and
   seconds rather than minutes before them: on a shared machine the speed
   drifts by 15-25% within a minute, which no model of the configuration can
   know. The predicted speedup (the standard sampler's prediction over the
   row's) cancels what drift remains: the standard sampler's calls are not
   random, so its own error is the drift, and the speedup error (predicted
   over measured speedup) is each row's error with that drift taken out.

Regenerates the ``wallclock`` section of ``benchmarks/RESULTS.md``, all but its GPU rows:
those are the sub-block ``wallclock_gpu`` inside it, written by ``benchmarks/gpu.sh``
(``benchmarks/gpu.py``) and carried over unchanged here.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

TIMING_SECONDS = 3.0
"""Each row is timed (``Calibrator.time``) in turns until its runs took this long, or 5 turns."""
GPU_ROWS = "wallclock_gpu"
"""Marker name of the GPU rows' sub-block inside the ``wallclock`` section (``benchmarks/gpu.py`` writes it)."""
GPU_ROWS_HEADING = "### GPU rows"


def _setup(name: str, device: str):
    import torch

    from specforest import streams
    from specforest.models import GaussianMixture
    from specforest.models.digits import load_velocity

    idx = torch.arange(64)
    if name == "gmm":
        model = GaussianMixture.paper(dim=500, components=5, seed=0)
        return model, streams.randn(11, idx, (500,), device=device), None, dict(steps=30, churn=0.1)
    model = load_velocity(device=device)
    cond = {"class_labels": (idx % 10).to(device)}
    return model, streams.randn(11, idx, (1, 8, 8), device=device), cond, dict(steps=100, churn=0.3)


def _configs(model, x, cond, opts, pred, tuned):
    from specforest import trees
    from specforest.planning import plan_tree

    planned = plan_tree(model, x, budget=62, coupling="grs", cond=cond, seed=5, **opts)
    return [
        ("standard", dict(tree=None)),
        ("RMC chain B=14", dict(tree=trees.chain(14), coupling="rmc")),
        ("D-GRS (2,3)", dict(tree=trees.uniform(2, 3), coupling="grs")),
        ("rank (2,3)", dict(tree=trees.uniform(2, 3), coupling="rank")),
        ("call-optimal planned, B=62", dict(tree=planned, coupling="grs")),
        (f"tuned: {tuned.label}", dict(tuned)),
    ]


def run_model(
    name: str,
    device: str,
    repeats: int,
    latency_runs: int,
    blocks: int,
    *,
    batches: tuple = (1, 64),
    steps: "int | None" = None,
    timing_seconds: float = TIMING_SECONDS,
) -> dict:
    """The curve and the latency (batch 1) and throughput (batch 64) rows of one model.

    ``batches``, ``steps`` (instead of the model's own) and ``timing_seconds`` (per row and
    block) let ``benchmarks/gpu.py`` run the same protocol in its time budget, and its
    dry run in seconds on a CPU.
    """
    import torch

    import specforest
    from specforest.latency import Calibrator, tune
    from specforest.proposals import available_drafts, drafts_serving

    model, x_all, cond_all, opts = _setup(name, device)
    if steps is not None:
        opts = dict(opts, steps=steps)
    out = {"curve": None, "rows": {}}
    for batch in batches:
        x = x_all[:batch]
        cond = None if cond_all is None else {k: v[:batch] for k, v in cond_all.items()}
        t0 = time.perf_counter()
        pred = Calibrator.calibrate(
            model,
            x_all,
            cond=cond_all,
            batch=batch,
            drafts=drafts_serving(available_drafts(), tuple(x_all.shape[1:])),
            **opts,
        )
        tuned = tune(model, x_all, predictor=pred, **opts)
        tune_seconds = time.perf_counter() - t0
        if out["curve"] is None:
            out["curve"] = pred.curve
        configs = _configs(model, x, cond, opts, pred, tuned)
        keys = {}
        for label, kw in configs:
            kw = dict(kw)
            keys[label] = (kw.get("tree"), kw.get("coupling", "grs"), kw.get("verify", "internal"))
            keys[label] += (kw.get("draft", "velocity"),)
        walls: dict = {label: [] for label, _ in configs}
        runs: dict = {label: [] for label, _ in configs}
        n_runs = latency_runs if batch == 1 else repeats
        n_blocks = min(blocks, n_runs)
        edges = [round(b * n_runs / n_blocks) for b in range(n_blocks + 1)]
        predicted_in: dict = {label: [] for label, _ in configs}
        for r in range(n_runs):
            if r in edges[:-1]:
                # before each block of runs every row is timed again, side by side (one pooled
                # network factor, the same stretch of the machine for every row), and predicted
                # then: the prediction is made before its runs, seconds rather than minutes before
                pred.time(list(keys.values()), min_seconds=timing_seconds, fresh=True)
                for label, key in keys.items():
                    predicted_in[label].append(pred.predict(*key))
            for label, kw in configs:
                if batch == 1:
                    # a short run pays for the caches the previous configuration's run left (after a
                    # 476-row tree a mixture call costs ~1.7x): as for a user sampling one image after
                    # another, and as in the tuner's timing runs, a timed run follows one of its own
                    specforest.sample(model, x, cond=cond, seed=1000 + r, **opts, **kw)
                # Python's cyclic collector off during a run, as timeit and the tuner's timing runs do: a
                # full collection (tens of ms with torch loaded) landing in a 10 ms run would be taken
                # for the configuration's time
                gc.collect()
                gc.disable()
                try:
                    t0 = time.perf_counter()
                    res = specforest.sample(model, x, cond=cond, seed=100 + r, **opts, **kw)
                    if x.device.type == "cuda":
                        torch.cuda.synchronize()
                    walls[label].append(time.perf_counter() - t0)
                finally:
                    gc.enable()
                s = res.stats
                runs[label].append((s.calls, float(s.rows.double().mean()), s.sampler_seconds))
        # one image per run: a run's time follows its random number of rounds, and the prediction is
        # its expectation, so the mean over many runs; 64 images average that out within a run, and
        # the median of a few runs keeps the machine's hiccups out
        centre = statistics.fmean if batch == 1 else statistics.median
        base = centre(walls["standard"])
        rows = []
        for label, _ in configs:
            calls, rws, sampler = zip(*runs[label], strict=True)
            wall = centre(walls[label])
            n = len(walls[label])
            se = statistics.stdev(walls[label]) / n**0.5 if batch == 1 and n > 1 else None
            p_sec, p_calls = (statistics.fmean(p[i] for p in predicted_in[label]) for i in (0, 1))
            rows.append(
                dict(
                    label=label,
                    calls=statistics.fmean(calls),
                    pred_calls=p_calls,
                    rows=statistics.fmean(rws),
                    sampler_ms=1e3 * sum(sampler) / sum(calls),
                    wall_ms=1e3 * wall / batch,
                    wall_se_ms=None if se is None else 1e3 * se / batch,
                    pred_ms=1e3 * p_sec,
                    speedup=base / wall,
                )
            )
        out["rows"][batch] = dict(
            rows=rows,
            tuned=tuned,
            tune_seconds=tune_seconds,
            factor=pred.network_factor(),
            runs=len(walls["standard"]),
            blocks=n_blocks,
        )
    return out


def gpu_rows_block(path: Path) -> str:
    """The GPU rows' sub-block of the ``wallclock`` section in ``path`` as it is (markers included),
    or a placeholder when there is none yet."""
    begin, end = f"<!-- {GPU_ROWS}:begin -->", f"<!-- {GPU_ROWS}:end -->"
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if begin in text and end in text:
        return begin + text.split(begin, 1)[1].split(end, 1)[0] + end
    return (
        f"{begin}\n{GPU_ROWS_HEADING}\n\nNot measured yet: `benchmarks/gpu.sh` on a CUDA machine writes them "
        f"(the digits model, SD3-medium- and Flux-dev-sized transformers).\n{end}"
    )


def write_gpu_rows(path: Path, body: str) -> Path:
    """Replace the GPU rows of the ``wallclock`` section of ``path`` by ``body``, leaving its CPU rows as they are.

    The rows go in the sub-block :data:`GPU_ROWS` (made at the end of the section when missing; the
    section itself, with the GPU rows alone, when the file has none).
    """
    from specforest.experiments.io import atomic_write_text
    from specforest.experiments.results import replace_section

    begin, end = f"<!-- {GPU_ROWS}:begin -->", f"<!-- {GPU_ROWS}:end -->"
    block = f"{begin}\n{GPU_ROWS_HEADING}\n\n{body.rstrip()}\n{end}"
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if begin in text and end in text:
        return replace_section(path, GPU_ROWS, GPU_ROWS_HEADING, body)
    section_end = "<!-- wallclock:end -->"
    if section_end in text:
        head, tail = text.split(section_end, 1)
        paragraphs = head.rstrip().split("\n\n")
        if paragraphs[-1].startswith("GPU rows ("):
            # the one-line placeholder this script wrote before the GPU rows had a sub-block of their own
            paragraphs.pop()
        return atomic_write_text(path, "\n\n".join(paragraphs) + "\n\n" + block + "\n" + section_end + tail)
    return replace_section(
        path,
        "wallclock",
        "## Wall-clock: batch-cost curve, latency and throughput",
        "CPU rows: not measured yet (`benchmarks/wallclock.py`).\n\n" + block,
    )


def _table(name: str, res: dict) -> list:
    lines = []
    for batch, r in res["rows"].items():
        tuned = r["tuned"]
        what = (
            f"latency, one image per run, mean of {r['runs']} runs"
            if batch == 1
            else f"throughput, {batch} images per run, median of {r['runs']} runs"
        ) + f" in {r['blocks']} blocks"
        lines += [
            "",
            f"**{name}, {what}** (tuned in {r['tune_seconds']:.1f} s: {tuned.label}, predicted "
            f"{1e3 * tuned.predicted_seconds_per_image:.2f} ms per image, {tuned.predicted_speedup:.2f}x"
            + ("" if tuned.measured_speedup is None else f", {tuned.measured_speedup:.2f}x in its final race")
            + "; "
            f"a call in a run costs {r['factor']:.2f}x its time on the curve)",
            "",
            "| sampler | target calls (predicted) | rows per image | sampler time per round | wall per image "
            + ("(± s.e.) " if batch == 1 else "")
            + "| predicted | error | wall-clock speedup | predicted speedup | speedup error |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        base = next(row for row in r["rows"] if row["label"] == "standard")
        for row in r["rows"]:
            err = row["pred_ms"] / row["wall_ms"] - 1.0
            se = "" if row["wall_se_ms"] is None else f" ± {row['wall_se_ms']:.2f}"
            lines.append(
                f"| {row['label']} | {row['calls']:.1f} ({row['pred_calls']:.1f}) | {row['rows']:.0f} | "
                f"{row['sampler_ms']:.2f} ms | {row['wall_ms']:.2f}{se} ms | {row['pred_ms']:.2f} ms | "
                f"{100 * err:+.0f}% | {row['speedup']:.2f}x | {base['pred_ms'] / row['pred_ms']:.2f}x | "
                f"{100 * (base['pred_ms'] / row['pred_ms'] / row['speedup'] - 1.0):+.0f}% |"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--repeats", type=int, default=3, help="runs per configuration at 64 images (median)")
    ap.add_argument("--latency-runs", type=int, default=20, help="runs per configuration at one image per run (mean)")
    ap.add_argument("--models", default="gmm,digits", help="comma list of gmm, digits")
    ap.add_argument(
        "--blocks", type=int, default=4, help="blocks of runs, each after its own timing and prediction (default 4)"
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = ap.parse_args()
    for name in ("repeats", "latency_runs", "blocks"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    import torch

    from specforest.allocator import keep_freed_memory
    from specforest.experiments.results import machine_line, replace_section

    torch.set_num_threads(1)
    keep_freed_memory()
    results = {
        m: run_model(m, args.device, args.repeats, args.latency_runs, args.blocks) for m in args.models.split(",")
    }
    label = {"gmm": "Gaussian mixture (d = 500, T = 30, churn 0.1)", "digits": "digits U-Net (T = 100, churn 0.3)"}
    lines = [
        f"`.venv/bin/python benchmarks/wallclock.py --device {args.device}` on {machine_line()}, one CPU thread, "
        "freed memory kept by the allocator (`specforest.allocator.keep_freed_memory`, as the CLI does).",
        "",
        "Batch-cost curve of the target, time(b) / time(1) (median of 7 calls per size):",
        "",
        "| model | time(1) | " + " | ".join(f"b={b}" for b in results[next(iter(results))]["curve"].sizes[:10]) + " |",
        "| --- | --- | " + " | ".join("---" for _ in range(10)) + " |",
    ]
    for m, res in results.items():
        c = res["curve"]
        rel = c.relative()[:10]
        lines.append(f"| {label[m]} | {1e3 * c.seconds[0]:.3f} ms | " + " | ".join(f"{v:.2f}" for v in rel) + " |")
    lines += [
        "",
        "Error = predicted over measured wall time per image, minus 1. The runs come in blocks; before each "
        "block every row is timed again side by side (`Calibrator.time(..., fresh=True)`) and predicted, and a "
        "row's prediction is the mean of its blocks' (each made before its runs, seconds before them: the "
        "machine's speed drifts by 15-25% within a minute). "
        "The standard sampler's number of calls is not random, so its error is the machine's drift between "
        "timing and measuring; speedup error = predicted over measured speedup, minus 1, is a row's error with "
        "that drift taken out.",
    ]
    for m, res in results.items():
        lines += _table(label[m], res)
    text = "\n".join(lines)
    # the GPU rows are gpu.py's: carried over as they are
    text += "\n\n" + gpu_rows_block(args.out)
    print(text)
    replace_section(args.out, "wallclock", "## Wall-clock: batch-cost curve, latency and throughput", text)


if __name__ == "__main__":
    main()
