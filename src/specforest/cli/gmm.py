"""Command line: ``specforest gmm`` (one configuration), ``specforest gmm sweep`` and ``specforest gmm drafts``.

A thin shell over :mod:`specforest.experiments.gmm` (and
:mod:`specforest.experiments.drafts`): options are parsed and range-checked
here, everything else happens in the library.
"""

from __future__ import annotations

import json

import click
import numpy as np

from ..experiments import gmm as gmm_exp
from ..experiments.io import atomic_write
from .common import (
    MODEL_DEFAULTS,
    NAMED_GRID_SHIFT,
    POSITIVE,
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
    grid_option,
    int_list,
    json_option,
    lazy_option,
    library_errors,
    method_option,
    output_path,
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

__all__ = ["gmm"]


def _setting_options(f):
    """Options of the experiment's setting, shared by ``gmm`` and ``gmm sweep``."""
    opts = [
        click.option(
            "--components",
            type=click.IntRange(1),
            default=5,
            show_default=True,
            help="Mixture components (>= 1).",
        ),
        click.option("--dim", type=click.IntRange(1), default=500, show_default=True, help="Dimension d (>= 1)."),
        steps_option(MODEL_DEFAULTS["gmm"]["steps"]),
        churn_option(MODEL_DEFAULTS["gmm"]["churn"]),
        click.option(
            "--trajectories",
            type=click.IntRange(1),
            default=100,
            show_default=True,
            help="Independent trajectories (>= 1).",
        ),
        seed_option("x_T and the sampling noise; the mixture has its own seed"),
        click.option(
            "--mixture-seed",
            type=click.IntRange(0, 2**64 - 1),
            default=0,
            show_default=True,
            help="Seed (in [0, 2**64)) of the mixture's means U([-2,2]^d) and stds U([0.10,0.25]).",
        ),
        grid_option(),
        prefetch_option(),
        verify_option("drafted"),
        tree_options,
        draft_option(),
        click.option(
            "--memory-gb",
            type=POSITIVE,
            default=None,
            show_default="50% of physical memory, or 8 GB if unknown",
            help="Memory limit in GB (> 0) that sets how many trajectories run at once and the rows per call.",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _setting(o: dict, chain=None) -> gmm_exp.GMMSetting:
    """The experiment's setting of the options ``o``, on ``chain`` (``None``: the em chain at ``--churn``)."""
    return gmm_exp.GMMSetting(
        dim=o["dim"],
        components=o["components"],
        steps=o["steps"],
        churn=o["churn"] if chain is None else None,
        trajectories=o["trajectories"],
        grid=o["grid"],
        mixture_seed=o["mixture_seed"],
        chain="em" if chain is None else chain,
    )


@click.group(invoke_without_command=True)
@method_option(gmm_exp.METHODS)
@tree_size_options(K=6, L=6)
@_setting_options
@chain_options
@lazy_option()
@json_option()
@click.option(
    "--dump-samples",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    callback=output_path(".npz", what="an .npz archive"),
    help="Write the samples to this .npz (array 'samples', (trajectories, dim) float32).",
)
@progress_option()
@threads_option()
@compile_option()
@tune_option()
@extra_options
@click.pass_context
def gmm(ctx: click.Context, **o) -> None:
    """Gaussian-mixture experiment of the paper (Section 5.1): one configuration.

    Defaults are the paper's setting: 5 components in d=500, T=30, churn 0.1,
    100 trajectories, flow_match grid, D-GRS on the (6, 6) tree. The speedup is
    reported as T/NFE and in the paper's accounting (T-2)/(NFE-2). --chain runs
    another sampler's chain (e.g. --chain euler_ancestral --eta 0.7), exactly.
    """
    if ctx.invoked_subcommand is not None:
        refuse_group_options(ctx)
        return
    o, _ = apply_tuned(
        o,
        "gmm",
        run={"batch": "trajectories", "dim": "dim", "components": "components"},
        fixed={"device": "cpu", "shift": NAMED_GRID_SHIFT},
    )
    refuse_unused(o)
    chain = run_chain(o)
    check_grid(chain, o)
    refuse_deterministic_chain(chain, o["steps"], o["grid"], speculative=o["method"] != "standard", schedule=o)
    set_threads(o["threads"])
    setting = library_errors(lambda: _setting(o, chain))
    run = library_errors(
        lambda: gmm_exp.simulate(
            setting,
            method=o["method"],
            K=o["K"],
            L=o["L"],
            prefetch=o["prefetch"],
            verify=o["verify"],
            draft=o["draft"],
            seed=o["seed"],
            lazy=o["lazy"],
            memory_gb=o["memory_gb"],
            progress=o["progress"],
            tree=o["tree_mode"],
            budget=o["budget"],
            compile=o["compile_model"],
            warmup=bool(o["tune_file"]),
            options=extra_values(o),
        )
    )
    rec = as_ran(run.record)
    # the result first: a disk that fills at the write loses the file, not what the run found
    click.echo(json.dumps(rec, allow_nan=False) if o["as_json"] else gmm_exp.format_result(rec))
    if o["dump_samples"]:
        meta = json.dumps(rec)
        samples = run.samples.numpy().astype(np.float32)
        path = o["dump_samples"]
        write_result(
            path,
            lambda: atomic_write(path, lambda f: np.savez(f, samples=samples, result=np.array(meta)), binary=True),
            option="--dump-samples",
        )
        if not o["as_json"]:
            click.echo(f"  samples written to {path}")


@gmm.command()
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default="results/gmm_sweep",
    show_default=True,
    callback=output_path(what="the results and figures", folder=True),
    help="Directory of results.csv/.json and the figures (resumed if present).",
)
@click.option(
    "--K-values",
    "K_values",
    default="1,2,3,4,5,6,7",
    show_default=True,
    callback=int_list("K", 1),
    help="Comma-separated tree widths K (each >= 1).",
)
@click.option(
    "--L-values",
    "L_values",
    default="2,3,4,5,6,7",
    show_default=True,
    callback=int_list("L", 1),
    help="Comma-separated tree depths L (each >= 1).",
)
@click.option(
    "--methods",
    default="dgrs",
    show_default=True,
    callback=choice_list("methods", gmm_exp.SWEEP_METHODS),
    help="Comma-separated tree methods run at every (K, L): dgrs, rank, antithetic (even K only).",
)
@_setting_options
@click.option(
    "--lazy",
    is_flag=True,
    help="Realize only the visited nodes. Strongly recommended for the full grid: "
    "a full (7, 7) tree has 960,800 nodes per trajectory.",
)
@click.option(
    "--progress/--no-progress",
    default=True,
    show_default=True,
    help="Progress bar over configurations on stderr.",
)
@threads_option()
def sweep(out_dir: str, K_values: list[int], L_values: list[int], methods: list[str], **o) -> None:
    """The (K, L) sweep of Figures 3 and 7: each tree method of --methods (D-GRS by
    default) at every (K, L), RMC at each matched budget B = K + ... + K^L. Resumable:
    configurations already in OUT/results.json are skipped. Writes results.csv,
    results.json, heatmap.png (RMC vs D-GRS) and speedup_vs_K.png (every method).
    """
    set_threads(o.pop("threads"))
    if o["tree_mode"] != "uniform" or o["budget"] is not None:
        raise click.UsageError("the sweep runs the uniform (K, L) grid; --tree and --budget apply to single runs")
    setting = library_errors(lambda: _setting(o))

    def log(line: str) -> None:
        click.echo(line, err=True)

    res = library_errors(
        lambda: gmm_exp.run_sweep(
            setting,
            out_dir,
            K_values=K_values,
            L_values=L_values,
            prefetch=o["prefetch"],
            verify=o["verify"],
            draft=o["draft"],
            seed=o["seed"],
            lazy=o["lazy"],
            memory_gb=o["memory_gb"],
            progress=o["progress"],
            log=log,
            methods=methods,
        )
    )
    click.echo(gmm_exp.format_summary(res.records))
    click.echo(f"ran {res.ran} configuration(s), skipped {res.skipped} already done")
    for p in res.files:
        click.echo(f"wrote {p}")


@gmm.command("drafts")
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default="drafts.png",
    show_default=True,
    callback=output_path(".png", what="a PNG image"),
    help="PNG file to write.",
)
@click.option(
    "--model",
    type=click.Choice(["gmm", "digits"]),
    default="gmm",
    show_default=True,
    help="The paper's Gaussian mixture (d=500, T=30, churn 0.1) or the shipped digits model (T=100, churn 0.3).",
)
@click.option(
    "--trajectories", type=click.IntRange(1), default=50, show_default=True, help="Trajectories per draft kind (>= 1)."
)
@click.option(
    "--depth", type=click.IntRange(1), default=10, show_default=True, help="Chain length of the lazy runs (>= 1)."
)
@seed_option("the trajectories")
def gmm_drafts(out: str, model: str, trajectories: int, depth: int, seed: int) -> None:
    """Plot delta and acceptance per step and per depth for each draft kind (velocity, drift, x0, eps, auto)."""
    from ..experiments.drafts import draft_diagnostics, plot_draft_diagnostics

    res = library_errors(lambda: draft_diagnostics(model, trajectories=trajectories, depth=depth, seed=seed))
    plot_draft_diagnostics(res, out, title=f"{model}: chain of {depth}, {trajectories} trajectories, lazy")
    for kind, r in res.items():
        click.echo(
            f"{kind:9s} T/NFE {r['speedup']:.3f}   mean delta per depth "
            + " ".join(f"{v:.2f}" for v in r["delta_depth"][1:])
        )
    click.echo(f"wrote {out}")
