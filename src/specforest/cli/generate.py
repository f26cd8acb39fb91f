"""Command line: ``specforest generate gmm|pixel|sd3|diffusers``: a data set of samples, resumable, on one process or many.

A thin shell over :func:`specforest.experiments.generate.run_job`. Run it as
is, or with ``torchrun --nproc_per_node=N -m specforest generate ...`` (and
torchrun's usual ``--nnodes``/``--rdzv-endpoint`` across nodes): each process
samples every N-th index with continuous batching, or, with
``--tree-parallel``, all processes share each round's rows.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import click

from .. import distributed
from ..devices import default_device, default_dtype
from ..experiments import generate as gen_exp
from ..experiments.common import METHODS
from ..experiments.further_options import options_record
from ..trees import DraftTree
from .common import (
    CONTEXT,
    MODEL_DEFAULTS,
    NAMED_GRID_SHIFT,
    apply_tuned,
    as_ran,
    chain_options,
    chain_settings,
    check_grid,
    churn_option,
    compile_option,
    draft_option,
    extra_options,
    extra_values,
    grid_option,
    is_given,
    library_errors,
    method_option,
    output_path,
    pipeline_extra_options,
    pixel_model_option,
    prefetch_option,
    progress_option,
    refuse_unused,
    run_chain,
    set_threads,
    steps_option,
    threads_option,
    tree_size_options,
    tune_option,
    verify_option,
)
from .diffusers import (
    FAMILY_FLAGS,
    checked_chain,
    family_given,
    family_pipeline_options,
    family_shown,
    pipeline_chain,
    scheduler_option,
    tuned_run_keys,
)
from .sd3 import pipeline_options

__all__ = ["generate"]


def _scheduler_settings(o: dict) -> dict:
    """What a job records of ``--chain scheduler``: its step's ``eta`` (``o["eta"]``, as
    :func:`~specforest.cli.diffusers.checked_chain` gives it: null with a scheduler whose step takes none);
    the other chain options and ``--churn`` are refused (:func:`~specforest.cli.diffusers.pipeline_chain`)."""
    pipeline_chain(o)
    return {"churn": None, "chain": "scheduler", "chain_params": {"eta": o["eta"]}}


def _job_options(model: str, K: int, L: int, device: bool = True):
    """The options every ``generate`` model takes: the sampler's and the job's (``model``: as ``specforest tune``
    names it, whose command defaults the grid takes; ``diffusers``: the pipeline family's)."""
    if model == "diffusers":
        steps_opt = steps_option(None, family_shown("num_inference_steps"))
        churn_opt = churn_option(None, family_shown("churn"))
    else:
        steps_opt = steps_option(MODEL_DEFAULTS[model]["steps"])
        churn_opt = churn_option(MODEL_DEFAULTS[model]["churn"])

    def wrap(f):
        opts = [
            method_option(METHODS),
            tree_size_options(K=K, L=L),
            steps_opt,
            churn_opt,
            chain_options(extra=("scheduler",)) if model == "diffusers" else chain_options,
            grid_option(),
            prefetch_option(),
            verify_option("internal"),
            draft_option(),
            click.option(
                "--count",
                type=int,
                required=True,
                help="Samples M (>= 1): indices 0..M-1; at most what the merge at the end can hold in memory.",
            ),
            click.option(
                "--seed",
                type=int,
                default=0,
                show_default=True,
                help="Seed S (>= 0): sample i is a function of (S, i).",
            ),
            click.option(
                "--out",
                type=click.Path(),
                required=True,
                callback=output_path(what="the PNGs", folder=True)
                if model in ("sd3", "diffusers")
                else output_path(".npz", what="an .npz archive"),
                help="The output: an .npz (gmm, pixel) or a folder of PNGs (sd3, diffusers); PATH.json is written "
                "beside it "
                "and PATH.parts/ holds the shards until the end.",
            ),
            click.option(
                "--batch",
                type=click.IntRange(1),
                default=64,
                show_default=True,
                help="Trajectories in flight per process (>= 1); a finished one's slot takes the next index.",
            ),
            click.option(
                "--memory-gb",
                type=click.FloatRange(0.0, min_open=True),
                default=None,
                show_default="50% of physical memory (free memory on CUDA)",
                help="Memory limit of each process in GB (> 0): sets the slots in flight and the rows per call.",
            ),
            click.option(
                "--resume", is_flag=True, help="Continue the job at --out (same options), skipping finished indices."
            ),
            click.option(
                "--tree-parallel",
                is_flag=True,
                help="Under torchrun: every process runs the same samples and each round's rows are split across them.",
            ),
            progress_option(),
            threads_option(),
            compile_option(),
            tune_option(),
            pipeline_extra_options if model in ("sd3", "diffusers") else extra_options,
        ]
        if device:
            opts.append(
                click.option(
                    "--device",
                    type=click.Choice(["cpu", "cuda"]),
                    default="cpu",
                    show_default=True,
                    help="Where the model and the states live (under torchrun, each process takes its LOCAL_RANK's GPU).",
                )
            )
        for opt in reversed(opts):
            f = opt(f)
        return f

    return wrap


def _run(model: str, o: dict, model_options: "dict | Callable[[], dict]") -> None:
    """Check the job's options, every one before anything is loaded or written, then run it."""
    if o["count"] < 1:
        raise click.BadParameter(f"--count must be >= 1, got {o['count']}", param_hint="--count")
    if o["seed"] < 0:
        raise click.BadParameter(f"--seed must be >= 0, got {o['seed']}", param_hint="--seed")
    known = model_options if isinstance(model_options, dict) else {}
    limit, why = library_errors(lambda: gen_exp.count_limit(model, known, memory_gb=o["memory_gb"], device=o["device"]))
    if limit < 1:
        raise click.BadParameter(f"{o['memory_gb']:g} GB cannot hold one sample: {why}", param_hint="--memory-gb")
    if o["count"] > limit:
        raise click.BadParameter(
            f"must be in [1, {limit}] here, got {o['count']}: {why}; give a larger --memory-gb or split the job "
            "into several --out",
            param_hint="--count",
        )
    refuse_unused(o)
    scheduled = o.get("chain") == "scheduler"  # (generate diffusers: the pipeline's own scheduler)
    chain = None if scheduled else run_chain(o)
    if model not in gen_exp.IMAGE_MODELS:  # (an image job runs its pipeline's grid)
        check_grid(chain, o)
    set_threads(o["threads"])
    sampler = {k: o[k] for k in ("method", "K", "L", "steps", "grid", "prefetch", "verify", "draft")}
    # the chain as the job records it: churn (null with another chain than em), chain, chain_params
    sampler.update(_scheduler_settings(o) if scheduled else chain_settings(chain))
    # what runs: the standard sampler takes the draft's options and does not use them
    sampler = as_ran(sampler)
    tree = o.get("tree_mode")
    if isinstance(tree, DraftTree):
        # a tuned tree, kept as its parent list (K and L: its widest node and its depth)
        sampler.update(tree=tree.parent.tolist(), K=tree.max_children, L=tree.L)
    # the further options under their keys, those at their default left out (extra_values): a job started
    # before an option existed resumes as it was
    sampler.update(options_record(extra_values(o)))
    if callable(model_options):
        model_options = library_errors(model_options)
    spec = library_errors(lambda: gen_exp.JobSpec(model, o["count"], o["seed"], sampler, model_options))
    library_errors(lambda: distributed.init_from_env(o["device"]))
    rank = distributed.rank()
    stopped_by = [signal.SIGINT]

    def terminated(*_) -> None:
        stopped_by[0] = signal.SIGTERM
        raise KeyboardInterrupt

    # a SIGTERM unwinds like an interrupt: temporary files are removed, written shards stay
    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        res = library_errors(
            lambda: gen_exp.run_job(
                spec,
                o["out"],
                batch=o["batch"],
                resume=o["resume"],
                tree_parallel=o["tree_parallel"],
                device=o["device"],
                progress=o["progress"],
                compile=o["compile_model"],
                warmup=bool(o.get("tune_file")),
                memory_gb=o["memory_gb"],
                log=lambda s: click.echo(s, err=True) if rank == 0 else None,
            )
        )
    except distributed.PeerError as e:
        # another process failed: its own error is on its stderr; this one says which and exits non-zero too
        raise click.ClickException(f"process {rank}: {e}") from e
    except KeyboardInterrupt:
        _interrupted(o["out"], rank, stopped_by[0])
    finally:
        signal.signal(signal.SIGTERM, previous)
        if distributed.is_distributed():
            import torch.distributed as dist

            dist.destroy_process_group()
    if rank == 0 and res.produced:
        click.echo(
            f"{res.produced} samples made here ({res.skipped} on disk before) in {res.seconds:.1f} s, "
            f"{res.rounds} rounds, occupancy {res.occupancy:.3f}",
            err=True,
        )


def _interrupted(out: str, rank: int, signum: int) -> None:
    """Stop the command after a SIGINT or SIGTERM, saying where the finished samples are and that ``--resume``
    finishes the job, with exit status ``128 + signum`` (the shell's for a signal)."""
    parts = gen_exp.parts_dir(Path(out))
    who = f"process {rank}: " if distributed.is_distributed() else ""
    if parts.exists():
        msg = f"interrupted: the finished samples are kept in {parts}; rerun with --resume to finish the job"
    else:
        msg = f"interrupted before any sample was written to {parts}; rerun to start the job"
    err = click.ClickException(who + msg)
    err.exit_code = 128 + signum
    raise err


@click.group(context_settings=CONTEXT)
def generate() -> None:
    """A data set of samples: sample i is a function of (--seed, i) only, on any number of processes.

    Launch with torchrun for several processes:
    torchrun --nproc_per_node=N -m specforest generate gmm --count M --out samples.npz
    """


@generate.command("gmm", context_settings=CONTEXT)
@_job_options("gmm", K=2, L=3)
@click.option("--dim", type=click.IntRange(1), default=500, show_default=True, help="Dimension d (>= 1).")
@click.option("--components", type=click.IntRange(1), default=5, show_default=True, help="Mixture components (>= 1).")
@click.option("--mixture-seed", type=click.IntRange(0), default=0, show_default=True, help="Seed of the mixture.")
def generate_gmm(**o) -> None:
    """Samples of the paper's Gaussian mixture (Sec. 5.1): an .npz with samples (M, dim) and index."""
    o, _ = apply_tuned(o, "gmm", run={"dim": "dim", "components": "components"}, fixed={"shift": NAMED_GRID_SHIFT})
    _run("gmm", o, {k: o.pop(k) for k in ("dim", "components", "mixture_seed")})


@generate.command("pixel", context_settings=CONTEXT)
@_job_options("digits", K=2, L=3)
@pixel_model_option()
def generate_pixel(**o) -> None:
    """Images of a shipped model: an .npz with samples (M, C, H, W) and index; class-conditional 8x8 digits
    by default, with their labels; --model natural32 / natural64: unconditional 3x32x32 / 3x64x64."""
    o, _ = apply_tuned(o, o["model"], fixed={"shift": NAMED_GRID_SHIFT}, model_option=True)
    _run("pixel", o, library_errors(lambda: gen_exp.pixel_options(o.pop("model"))))


@generate.command("sd3", context_settings=CONTEXT)
@_job_options("sd3", K=2, L=2, device=False)
@pipeline_options
def generate_sd3(**o):
    """Images from a local StableDiffusion3Pipeline: image i has caption i mod n; OUT is a folder of PNGs by index.

    The latents and all the sampling noise of image i come from (--seed, i); OUT.json holds the options and
    the per-image NFE.
    """

    o, _ = apply_tuned(o, "sd3", run={k: k for k in ("guidance", "shift", "height", "width")})
    model, prompts_file, num_prompts = o.pop("model"), o.pop("prompts_file"), o.pop("num_prompts")
    guidance, shift, height, width = (o.pop(k) for k in ("guidance", "shift", "height", "width"))
    max_sequence_length = o.pop("max_sequence_length")
    device = o["device"] or default_device()
    o["device"] = device
    dtype = o.pop("dtype") or default_dtype(device)
    _run(
        "sd3",
        o,
        lambda: gen_exp.sd3_options(
            model,
            prompts_file,
            num_prompts=num_prompts,
            dtype=dtype,
            guidance=guidance,
            height=height,
            width=width,
            shift=shift,
            max_sequence_length=max_sequence_length,
        ),
    )


@generate.command("diffusers", context_settings=CONTEXT)
@_job_options("diffusers", K=2, L=2, device=False)
@family_pipeline_options()
@scheduler_option(" Recorded with the job.")
def generate_diffusers(**o):
    """Images from a local diffusers pipeline of any supported family (read from DIR/model_index.json):
    image i has caption i mod n; OUT is a folder of PNGs by index.

    The family's options default to its own sampler's. The latents and all the sampling noise of image i
    come from (--seed, i); OUT.json holds the options (the family among them) and the per-image NFE.
    """

    from ..diffusers.families import family_of_directory
    from ..experiments.pipelines import family_options

    family = library_errors(lambda: family_of_directory(o["pipeline_path"]))
    o, _ = apply_tuned(
        o, "diffusers", run={**tuned_run_keys(), "scheduler": "scheduler_name"}, fixed={"family": family.name}
    )
    ctx = click.get_current_context()
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    names = {lib: flags[k] for k, lib in FAMILY_FLAGS.items()}
    given = family_given(o)
    # the steps are the sampler's (its grid), the churn the em chain's: both defaults are the family's sample's
    churn = given.pop("churn")
    if (o["chain"] or "em") == "em":
        o["churn"] = library_errors(lambda: family_options(family, "sample", {"churn": churn}))["churn"]
    options = library_errors(lambda: family_options(family, "prepare", given, names=names))
    o["steps"] = options.pop("num_inference_steps")
    # the chain, --scheduler and --eta checked against the scheduler that will run, before anything is loaded
    _, eta = checked_chain(o, o["steps"], ctx)
    if o["chain"] == "scheduler":
        o["eta"] = eta
    if is_given(ctx, "grid"):
        raise click.UsageError("--grid: a diffusers job runs its pipeline's scheduler grid; leave it out")
    o["grid"] = None  # (recorded null: the scheduler's grid ran)
    for k in FAMILY_FLAGS:
        if k not in ("steps", "churn"):
            o.pop(k)
    pipeline, prompts_file, num_prompts = o.pop("pipeline_path"), o.pop("prompts_file"), o.pop("num_prompts")
    scheduler = o.pop("scheduler_name")
    device = o["device"] or default_device()
    o["device"] = device
    dtype = o.pop("dtype") or default_dtype(device)
    _run(
        "diffusers",
        o,
        lambda: gen_exp.diffusers_options(
            pipeline, prompts_file, num_prompts=num_prompts, dtype=dtype, options=options, scheduler=scheduler
        ),
    )
