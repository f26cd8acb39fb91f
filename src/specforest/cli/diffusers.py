"""Command line: ``specforest diffusers --pipeline DIR --prompts FILE``: images from a pipeline of any family.

A thin shell over :func:`specforest.diffusers.sample`. The family (SD3, Flux,
and every other entry of :data:`specforest.diffusers.FAMILIES`) is read from
the directory's ``model_index.json`` before anything is loaded; the family's
options (``--guidance``, ``--true-cfg-scale``, ``--shift``, ...) default to
its ``sample``'s own defaults, and one the family does not take is refused
naming the family. Nothing here is specific to a family: a new entry of
``FAMILIES`` works here at once. ``specforest generate diffusers`` and
``specforest tune --model diffusers`` share these options
(:func:`family_pipeline_options`, :func:`family_given`).
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import click

from ..devices import default_device, default_dtype
from ..experiments.common import METHODS, json_params
from ..experiments.further_options import options_record
from .common import (
    CONTEXT,
    apply_tuned,
    as_ran,
    chain_options,
    churn_option,
    draft_option,
    extra_values,
    json_option,
    lazy_option,
    library_errors,
    method_option,
    output_path,
    pipeline_extra_options,
    prefetch_option,
    progress_option,
    refuse_unused,
    seed_option,
    set_threads,
    steps_option,
    threads_option,
    tree_size_options,
    tune_option,
    verify_option,
)

__all__ = [
    "FAMILY_FLAGS",
    "checked_chain",
    "diffusers_command",
    "family_given",
    "family_pipeline_options",
    "family_shown",
    "pipeline_chain",
    "scheduler_option",
    "swap_scheduler",
    "tuned_run_keys",
]

FAMILY_FLAGS = {
    "steps": "num_inference_steps",
    "churn": "churn",
    "guidance": "guidance_scale",
    "true_cfg_scale": "true_cfg_scale",
    "negative_prompt": "negative_prompt",
    "shift": "shift",
    "height": "height",
    "width": "width",
    "max_sequence_length": "max_sequence_length",
}
"""Each family option: its click parameter name -> the family functions' parameter name. A
family takes those of its ``sample``/``prepare``/``tune`` signatures; their defaults are its own."""


def family_shown(library_name: str, none: str = "its own") -> str:
    """``the family's: sd3 7.0, flux 3.5``: each family's ``sample`` default of a parameter, for ``--help``
    (``-`` where a family does not take it, ``none`` where its default is ``None``)."""
    import inspect

    from ..diffusers.families import FAMILIES

    parts = []
    for f in FAMILIES:
        p = inspect.signature(f.sample).parameters.get(library_name)
        shown = "-" if p is None else (none if p.default is None else f"{p.default!r}".strip("'"))
        parts.append(f"{f.name} {shown}")
    return "the family's: " + ", ".join(parts)


def family_given(o: dict, ctx: "click.Context | None" = None) -> dict:
    """The family options of a command's parameters ``o``, by their library names (``None``: not given).

    With ``ctx``, an option whose value is click's default counts as not given (``specforest tune``'s
    options default to the SD3 paper's run, which is not another family's).
    """
    given = {}
    for name, lib in FAMILY_FLAGS.items():
        if name not in o:
            continue
        default = ctx is not None and ctx.get_parameter_source(name) == click.core.ParameterSource.DEFAULT
        given[lib] = None if default else o[name]
    return given


def tuned_run_keys() -> dict:
    """``run`` of :func:`~specforest.cli.common.apply_tuned` for a diffusers run: the family options a
    ``tune --model diffusers`` file records (``steps`` and ``churn`` map to themselves already)."""
    return {k: k for k in FAMILY_FLAGS if k not in ("steps", "churn")}


def family_pipeline_options(*, device: bool = True):
    """The pipeline, captions and family options of ``specforest diffusers`` and ``generate diffusers``."""
    from ..experiments.pipelines import DTYPES

    opts = [
        click.option(
            "--pipeline",
            "pipeline_path",
            type=click.Path(exists=True, file_okay=False),
            required=True,
            help="Local diffusers pipeline directory (save_pretrained, or a downloaded repository), "
            "loaded offline as the class its model_index.json names; the family follows from it.",
        ),
        click.option(
            "--prompts",
            "prompts_file",
            type=click.Path(exists=True, dir_okay=False),
            required=True,
            help="Text file of captions, one per line (empty lines skipped).",
        ),
        click.option(
            "--num-prompts", type=click.IntRange(1), default=None, show_default="all", help="Use the first N captions."
        ),
        click.option(
            "--negative-prompt",
            default=None,
            show_default=family_shown("negative_prompt", "none"),
            help="Caption of the negative (unconditional) branch of every image; with Flux, true CFG needs one "
            "(an empty string is one).",
        ),
        click.option(
            "--guidance",
            type=click.FloatRange(0.0),
            default=None,
            show_default=family_shown("guidance_scale"),
            help="The family's guidance_scale (>= 0): classifier-free guidance (sd3; <= 1: none) or the "
            "guidance embedded in the network (flux dev).",
        ),
        click.option(
            "--true-cfg-scale",
            type=click.FloatRange(0.0),
            default=None,
            show_default=family_shown("true_cfg_scale"),
            help="True classifier-free guidance (>= 0; > 1 needs --negative-prompt), both branches in one call.",
        ),
        click.option(
            "--shift",
            type=click.FloatRange(0.0, min_open=True),
            default=None,
            show_default=family_shown("shift", "the scheduler's"),
            help="Static timestep shift (> 0) overriding the scheduler's (Flux's dynamic shift included).",
        ),
        click.option(
            "--height",
            type=click.IntRange(1),
            default=None,
            show_default="the pipeline's native size",
            help="Image height in pixels (>= 1; divisible as the family requires: 16 for SD3 and Flux, 8 for SDXL and SD).",
        ),
        click.option(
            "--width",
            type=click.IntRange(1),
            default=None,
            show_default="the pipeline's native size",
            help="Image width in pixels (>= 1; divisible as the family requires).",
        ),
        click.option(
            "--max-sequence-length",
            type=click.IntRange(1, 512),
            default=None,
            show_default=family_shown("max_sequence_length"),
            help="T5 prompt tokens (1..512).",
        ),
        click.option(
            "--dtype",
            type=click.Choice(tuple(DTYPES)),
            default=None,
            show_default="float16 on CUDA, float32 otherwise",
            help="Dtype of the pipeline's models (the sampler itself runs in float32).",
        ),
    ]
    if device:
        opts.append(
            click.option(
                "--device",
                default=None,
                show_default="cuda if available, else cpu",
                help="Torch device of the pipeline (cuda, cuda:1, cpu, ...).",
            )
        )

    def wrap(f):
        for opt in reversed(opts):
            f = opt(f)
        return f

    return wrap


def scheduler_option(help: str = ""):
    """``--scheduler NAME``: swap the pipeline's scheduler for diffusers' class ``NAME``, from its config
    (:func:`swap_scheduler`); ``help``: what the command adds."""
    return click.option(
        "--scheduler",
        "scheduler_name",
        default=None,
        metavar="NAME",
        help="Swap the pipeline's scheduler for diffusers' class NAME, made from the pipeline's scheduler config "
        "(e.g. EulerAncestralDiscreteScheduler); with --chain scheduler its chain is followed." + help,
    )


def swap_scheduler(pipe: Any, name: "str | None") -> Any:
    """``pipe`` with ``--scheduler NAME`` swapped in (nothing when ``name`` is ``None``).

    Raises:
        click.BadParameter: naming ``--scheduler`` and the reason (no such scheduler class, ...).
    """
    if name is None:
        return pipe
    from ..diffusers.schedulers import swapped_scheduler

    try:
        pipe.scheduler = swapped_scheduler(pipe, name)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--scheduler") from None
    return pipe


def pipeline_chain(o: dict, ctx: "click.Context | None" = None) -> dict:
    """The family ``sample``'s or tuner's ``chain`` (and ``eta``) of ``--chain`` and its options: nothing for
    the em chain (``--churn`` is a family option), ``chain="scheduler"`` with ``eta`` (its step's; the
    other chain options and ``--churn`` refused), or the registered chain with its options set.

    Raises:
        click.UsageError / click.BadParameter: naming the option and the chain.
    """
    from .sampler_options import CHAIN_FLAGS, is_given, run_chain

    ctx = ctx or click.get_current_context()
    name = o.get("chain") or "em"
    if name == "scheduler":
        given = [
            f for p, f in {"churn": "--churn", **CHAIN_FLAGS}.items() if p != "eta" and p in o and is_given(ctx, p)
        ]
        if given:
            raise click.UsageError(
                f"{', '.join(given)}: --chain scheduler takes the scheduler's own settings (and --eta, its step's)"
            )
        return {"chain": "scheduler", "eta": o.get("eta") or 0.0}
    if name == "em":
        wrong = [f for p, f in CHAIN_FLAGS.items() if p in o and is_given(ctx, p)]
        if wrong:
            verb = "is not a parameter" if len(wrong) == 1 else "are not parameters"
            raise click.UsageError(f"{', '.join(wrong)} {verb} of chain 'em'; its parameters: churn")
        return {}
    return {"chain": run_chain({k: v for k, v in o.items() if k != "churn" or is_given(ctx, k)}, ctx)}


def checked_chain(o: dict, steps: int, ctx: "click.Context | None" = None) -> "tuple[dict, float | None]":
    """:func:`pipeline_chain` of the options ``o``, with everything about the chain checked before the
    pipeline is loaded: the chain's options, ``--scheduler``'s name, and with ``--chain scheduler`` the
    scheduler the run will step with (the pipeline's own or ``--scheduler``'s, made from the directory's
    scheduler config alone) and ``--eta`` against its step at ``steps`` steps.

    Returns:
        ``(chain, eta)``: the family ``sample``'s ``chain`` (and ``eta``), and the ``eta`` the run's record
        holds: the scheduler's step's with ``--chain scheduler`` (``None`` where its step takes none), a
        registered chain's own, ``None`` with the em chain.

    Raises:
        click.UsageError / click.BadParameter: naming the flag (``--chain``, ``--scheduler``, ``--eta``, ...).
    """
    from ..diffusers.schedulers import check_scheduler, directory_scheduler, scheduler_eta

    chain = pipeline_chain(o, ctx)
    try:
        sch = directory_scheduler(o["pipeline_path"], o.get("scheduler_name"))
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--scheduler") from None
    if chain.get("chain") != "scheduler":
        return chain, (chain["chain"].params.get("eta") if chain else None)
    if sch is None:  # (no scheduler config saved: the loaded pipeline's scheduler is checked by the library)
        return chain, chain["eta"]
    try:
        check_scheduler(sch)
    except ValueError as err:
        raise click.UsageError(f"--chain scheduler: {err}") from None
    try:
        check_scheduler(sch, chain["eta"], steps)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--eta") from None
    return chain, scheduler_eta(type(sch).__name__, chain["eta"])


def _tree_and_coupling(o: dict, steps: int, chain: Any = None) -> "tuple[Any, str]":
    """The draft tree and coupling of the command's method, or of its ``--tune`` file; ``chain``: the run's
    (a tree no deeper than its steps, dpmpp_sde's ``2 T - 1`` half-steps)."""
    from ..experiments.common import COUPLING_OF, chain_steps, method_tree
    from ..trees import DraftTree

    coupling = COUPLING_OF.get(o["method"], "grs")
    if isinstance(o.get("tree_mode"), DraftTree):
        return o["tree_mode"], coupling
    return method_tree(o["method"], o["K"], o["L"], chain_steps(chain, steps)), coupling


@click.command("diffusers", context_settings=CONTEXT)
@family_pipeline_options()
@click.option(
    "--num-images-per-prompt", type=click.IntRange(1), default=1, show_default=True, help="Images per caption (>= 1)."
)
@method_option(METHODS)
@tree_size_options(K=2, L=2)
@steps_option(None, family_shown("num_inference_steps"))
@churn_option(None, family_shown("churn"))
@chain_options(extra=("scheduler",))
@scheduler_option()
@draft_option()
@verify_option("internal")
@prefetch_option()
@lazy_option("Draft only the visited nodes: same law of images and NFE, far less memory.")
@seed_option("the images: image i's latents and noise come from (--seed, i) alone")
@click.option(
    "--batch-size",
    type=click.IntRange(1),
    default=None,
    show_default="all images at once",
    help="Images per sampler call (>= 1); the images do not depend on it.",
)
@click.option(
    "--max-memory-gb",
    type=click.FloatRange(0.0, min_open=True),
    default=None,
    show_default="free CUDA memory, or 50% of RAM",
    help="Memory limit in GB (> 0); transformer calls are split to fit it, runs that cannot fit are refused.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default="results/diffusers",
    show_default=True,
    callback=output_path(what="the images and run.json", folder=True, fresh=True),
    help="New folder of the images (000000.png, ...) and run.json; refused if it exists. It appears "
    "complete or not at all.",
)
@json_option()
@progress_option("Progress bar of the sampler on stderr.")
@threads_option()
@pipeline_extra_options
@tune_option(
    "A JSON written by 'specforest tune --model diffusers' for a pipeline of the same family: its tree, "
    "coupling, verify, draft and prefetch replace --method/--K/--L/--draft/--verify/--prefetch (giving any "
    "is an error); --steps, --churn, --batch-size, the family options (--guidance, --shift, --height, ...), "
    "--device and --threads default to the file's; given, they must match it."
)
def diffusers_command(**o) -> None:
    """Images from a local diffusers pipeline of any supported family, sampled exactly on a draft tree.

    The family (sd3: StableDiffusion3Pipeline, flux: FluxPipeline, ...) comes from DIR/model_index.json;
    its options default to its own sampler's. Image i has caption i // --num-images-per-prompt and is a
    function of (--seed, i) alone. Writes OUT/000000.png, ... and OUT/run.json: the family, the options,
    each image's caption and NFE (sequential transformer calls), and the wall time.
    """
    import torch

    from .. import __version__
    from ..diffusers.families import family_of_directory, pipeline_class_name
    from ..experiments.pipelines import family_options, load_pipeline, sample_images
    from ..experiments.sd3.loading import load_prompts

    family = library_errors(lambda: family_of_directory(o["pipeline_path"]))
    o, tuned = apply_tuned(
        o,
        "diffusers",
        run={**tuned_run_keys(), "batch": "batch_size", "scheduler": "scheduler_name"},
        fixed={"family": family.name},
    )
    refuse_unused(o)
    threads = set_threads(o.pop("threads"))
    ctx = click.get_current_context()
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    names = {FAMILY_FLAGS[k]: flags[k] for k in FAMILY_FLAGS}
    options = library_errors(lambda: family_options(family, "sample", family_given(o), names=names))
    device = o["device"] or default_device()
    dtype = o["dtype"] or default_dtype(device)
    captions = library_errors(lambda: load_prompts(o["prompts_file"], o["num_prompts"]))
    # every option is checked before the pipeline is loaded
    chain, eta = checked_chain(o, options["num_inference_steps"], ctx)
    tree, coupling = library_errors(
        lambda: _tree_and_coupling(o, options["num_inference_steps"], chain.get("chain") if chain else None)
    )
    if chain:
        options["churn"] = None  # (the em chain's; the run's record says it did not apply)
    click.echo(f"loading {o['pipeline_path']} ({family.name}, {dtype} on {device})", err=True)
    pipe, _ = library_errors(lambda: load_pipeline(o["pipeline_path"], device=device, dtype=dtype))
    swap_scheduler(pipe, o["scheduler_name"])
    keys = ("method", "K", "L", "draft", "verify", "prefetch", "lazy", "seed", "batch_size")
    sampler = as_ran({**{k: o[k] for k in keys}, "eta": eta})
    sampler.update(options_record(extra_values(o)))
    if tuned is not None:
        sampler.update(tuned=tuned.label, tune_file=str(Path(o["tune_file"]).resolve()), coupling=tuned.coupling)
    if not chain:
        chain_record = {}  # (the em chain: its churn is the record's)
    elif isinstance(chain["chain"], str):
        chain_record = {"chain_params": {"scheduler": type(pipe.scheduler).__name__, "eta": eta}}
    else:
        chain_record = {"chain_params": json_params(chain["chain"].params)}
    record = {
        "family": family.name,
        "pipeline_class": pipeline_class_name(o["pipeline_path"]),
        "pipeline": str(Path(o["pipeline_path"]).resolve()),
        "prompts_file": str(Path(o["prompts_file"]).resolve()),
        "captions": captions,
        "options": {
            **options,
            **sampler,
            "chain": o["chain"] or "em",
            **chain_record,
            "scheduler": type(pipe.scheduler).__name__,
            "num_images_per_prompt": o["num_images_per_prompt"],
            "max_memory_gb": o["max_memory_gb"],
            "dtype": dtype,
            "device": device,
            "threads": threads,
        },
        "specforest_version": __version__,
        "torch_version": torch.__version__,
        "diffusers_version": _diffusers_version(),
        "platform": platform.platform(),
    }
    rec = library_errors(
        lambda: sample_images(
            pipe,
            family,
            [c for c in captions for _ in range(o["num_images_per_prompt"])],
            o["out"],
            seed=o["seed"],
            batch_size=o["batch_size"],
            record=record,
            tree=tree,
            coupling=coupling,
            draft=o["draft"],
            prefetch=o["prefetch"],
            verify=o["verify"],
            lazy=o["lazy"],
            max_memory_gb=o["max_memory_gb"],
            progress=o["progress"],
            **chain,
            **extra_values(o),
            **options,
        )
    )
    if o["as_json"]:
        click.echo(json.dumps(rec, allow_nan=False))
        return
    click.echo(
        f"{family.name} ({rec['pipeline_class']}): {len(rec['nfe'])} images, NFE {rec['nfe_mean']:.2f} per image "
        f"for {rec['steps']} steps ({rec['speedup']:.2f}x fewer calls), {rec['wall_seconds']:.1f} s; "
        f"wrote {o['out']}/ ({len(rec['nfe'])} PNGs and run.json)"
    )


def _diffusers_version() -> "str | None":
    try:
        import diffusers
    except ImportError:  # pragma: no cover - the pipeline was loaded with it
        return None
    return diffusers.__version__
