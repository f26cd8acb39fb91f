"""Command line of the pixel-space experiment: ``specforest pixel`` (one configuration) and
``specforest pixel sweep`` (Figures 4 and 8).

A thin shell over :mod:`specforest.experiments.pixel`.
"""

from __future__ import annotations

import json

import click
import numpy as np

from ..experiments import pixel as pixel_exp
from ..experiments.io import atomic_write
from .common import (
    CONTEXT,
    MODEL_DEFAULTS,
    NAMED_GRID_SHIFT,
    apply_tuned,
    as_ran,
    chain_options,
    check_grid,
    choice_list,
    churn_option,
    compile_option,
    draft_option,
    extra_options,
    extra_values,
    float_list,
    grid_option,
    json_option,
    lazy_option,
    library_errors,
    method_option,
    output_path,
    pixel_model_option,
    prefetch_option,
    progress_option,
    refuse_deterministic_chain,
    refuse_group_options,
    refuse_unused,
    run_chain,
    seed_option,
    set_threads,
    steps_option,
    threads_option,
    tree_options,
    tree_size_options,
    tune_option,
    verify_option,
    write_result,
)

__all__ = ["pixel"]


def _pairs(value: str) -> list[tuple[int, int]]:
    try:
        pairs = []
        for item in value.split(","):
            if item.strip():
                k, l_ = item.lower().split("x")
                pairs.append((int(k), int(l_)))
    except ValueError as e:
        raise click.BadParameter(f"must look like 2x3,2x5,3x4,4x4; got {value!r}") from e
    if not pairs or min(min(p) for p in pairs) < 1:
        raise click.BadParameter(f"K and L must be >= 1, got {value!r}")
    return pairs


def _common(f):
    """Options shared by ``pixel`` and ``pixel sweep``."""
    opts = [
        steps_option(MODEL_DEFAULTS["digits"]["steps"]),
        click.option(
            "--samples",
            type=click.IntRange(1),
            default=100,
            show_default=True,
            help="Images per configuration (>= 1), labels uniform over the 10 classes.",
        ),
        seed_option("the labels, x_T and the sampling noise"),
        grid_option(),
        prefetch_option(),
        verify_option("internal"),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


@click.group(invoke_without_command=True, context_settings=CONTEXT)
@pixel_model_option()
@method_option(pixel_exp.METHODS)
@draft_option()
@tree_options
@tree_size_options(K=2, L=3)
@churn_option(MODEL_DEFAULTS["digits"]["churn"])
@chain_options
@_common
@lazy_option("Realize only the visited nodes: same law and NFE, less compute; wall-clock not comparable.")
@click.option(
    "--memory-gb",
    type=click.FloatRange(0.0, min_open=True),
    default=None,
    show_default="50% of physical memory, or 8 GB if unknown",
    help="Memory limit of the process in GB (> 0) that sets the rows per network call.",
)
@json_option()
@click.option(
    "--dump-samples",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    callback=output_path(".npz", what="an .npz archive"),
    help="Write an .npz with 'samples' (N, C, H, W) float32 in [-1, 1] ((N, 1, 8, 8) for digits) and, for "
    "digits, 'labels' (N,).",
)
@progress_option()
@threads_option()
@compile_option()
@tune_option()
@extra_options
@click.pass_context
def pixel(ctx: click.Context, **o) -> None:
    """Pixel-space experiment of the paper (Section 5.2) on a shipped model: ONE configuration.

    Defaults: class-conditional 8x8 digits, D-GRS on the (2, 3) tree (B = 14), churn 0.3,
    T = 100, 100 images. Reports the speedup T/NFE per image and, for digits, the
    classifier's accuracy against the conditioning label. The paper's EDM models on
    CIFAR-10 / FFHQ (d = 3072 / 12288) reach 2.2-2.6x / 2.0-2.2x; digits has d = 64,
    --model natural32 / natural64 (unconditional natural-image denoisers) d = 3072 /
    12288. --chain runs another sampler's chain (e.g. --chain euler_ancestral --eta
    0.7), exactly.
    """
    if ctx.invoked_subcommand is not None:
        refuse_group_options(ctx)
        return
    o, _ = apply_tuned(
        o, o["model"], run={"batch": "samples"}, fixed={"device": "cpu", "shift": NAMED_GRID_SHIFT}, model_option=True
    )
    refuse_unused(o)
    chain = run_chain(o)
    check_grid(chain, o)
    refuse_deterministic_chain(chain, o["steps"], o["grid"], speculative=o["method"] != "standard", schedule=o)
    set_threads(o["threads"])
    run = library_errors(
        lambda: pixel_exp.simulate(
            method=o["method"],
            K=o["K"],
            L=o["L"],
            chain=chain,
            samples=o["samples"],
            steps=o["steps"],
            seed=o["seed"],
            grid=o["grid"],
            prefetch=o["prefetch"],
            verify=o["verify"],
            lazy=o["lazy"],
            progress=o["progress"],
            draft=o["draft"],
            tree=o["tree_mode"],
            budget=o["budget"],
            compile=o["compile_model"],
            warmup=bool(o["tune_file"]),
            memory_gb=o["memory_gb"],
            options=extra_values(o),
            model_name=o["model"],
        )
    )
    rec = as_ran(run.record)
    # the result first: a disk that fills at the write loses the file, not what the run found
    click.echo(json.dumps(rec, allow_nan=False) if o["as_json"] else pixel_exp.format_result(rec))
    if o["dump_samples"]:
        arrays = {"samples": run.samples.clamp(-1, 1).numpy().astype(np.float32)}
        if run.labels is not None:  # (an unconditional model's samples have none)
            arrays["labels"] = run.labels.numpy().astype(np.int64)
        arrays["result"] = np.array(json.dumps(rec))
        path = o["dump_samples"]
        write_result(
            path,
            lambda: atomic_write(path, lambda f: np.savez(f, **arrays), binary=True),
            option="--dump-samples",
        )
        if not o["as_json"]:
            click.echo(f"  samples written to {path}")


@pixel.command("sweep", context_settings=CONTEXT)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default="results/pixel_sweep",
    show_default=True,
    callback=output_path(what="the results and figures", folder=True),
    help="Directory of results.json/.csv, samples/ and the figures (resumed if present).",
)
@click.option(
    "--trees",
    "pairs",
    default="2x3,2x5,3x4,4x4",
    show_default=True,
    help="Trees KxL of the tree methods; RMC runs at each matched budget K + ... + K^L.",
)
@click.option(
    "--churns",
    default="0.1,0.3,0.6",
    show_default=True,
    callback=float_list("churns", 0.0, 1.0, lo_open=True, unique=True),
    help="Comma-separated churn levels in (0, 1].",
)
@click.option(
    "--methods",
    default="dgrs",
    show_default=True,
    callback=choice_list("methods", pixel_exp.SWEEP_METHODS),
    help="Comma-separated tree methods run at each KxL: dgrs, rank, antithetic (even K only).",
)
@_common
@click.option(
    "--lazy/--full",
    default=True,
    show_default=True,
    help="Lazy runs give the same law and NFE at a fraction of the compute; --full for wall-clock.",
)
@click.option(
    "--progress/--no-progress",
    default=True,
    show_default=True,
    help="Progress bar over configurations on stderr.",
)
@threads_option()
def sweep(out_dir: str, pairs: str, churns: list[float], methods: list[str], **o) -> None:
    """Figure 4 / Figure 8: each tree method of --methods (D-GRS by default) at each
    (K, L) vs RMC at the matched budget, per churn.

    Writes OUT/results.json, results.csv, speedup_vs_budget.png (mean ± std per
    churn) and samples_grid.png (RMC vs D-GRS at the largest budget).
    """
    set_threads(o.pop("threads"))
    pair_list = _pairs(pairs)
    res = library_errors(
        lambda: pixel_exp.run_sweep(
            out_dir,
            pairs=pair_list,
            churns=churns,
            samples=o["samples"],
            steps=o["steps"],
            seed=o["seed"],
            grid=o["grid"],
            prefetch=o["prefetch"],
            verify=o["verify"],
            lazy=o["lazy"],
            progress=o["progress"],
            log=lambda line: click.echo(line, err=True),
            methods=methods,
        )
    )
    click.echo(pixel_exp.format_summary(res.records))
    click.echo(f"ran {res.ran} configuration(s), skipped {res.skipped} already done")
    for p in res.files:
        click.echo(f"wrote {p}")
