"""Command line: ``specforest tune --model gmm|digits|natural32|natural64|sd3|diffusers --out tuned.json``: the
fastest configuration here.

A thin shell over :func:`specforest.latency.tune`: measures the target's
batch-cost curve on the device, calibrates acceptance on a short run, times the
sampler's own work per candidate, prints the chosen configuration with its
predicted latency next to the standard sampler's, and writes it.
"""

from __future__ import annotations

import json

import click

from ..atomic import atomic_write_text
from ..devices import default_dtype
from ..experiments.common import chain_kwargs
from ..experiments.further_options import options_record
from ..experiments.pixel.models import PIXEL_MODELS, pixel_model, refuse_undeclared_learned, tune_target
from ..schedules import MAX_STEPS
from .common import (
    CHAIN_FLAGS,
    CONTEXT,
    MODEL_DEFAULTS,
    NAMED_GRID,
    NAMED_GRID_SHIFT,
    chain_options,
    chain_settings,
    check_grid,
    churn_option,
    extra_options,
    extra_values,
    grid_flags,
    is_given,
    library_errors,
    output_path,
    progress_option,
    refuse_deterministic_chain,
    run_chain,
    set_threads,
    steps_option,
    threads_option,
    write_result,
)
from .diffusers import FAMILY_FLAGS, family_given, pipeline_chain, scheduler_option, swap_scheduler
from .sd3 import tune_pipeline_options

__all__ = ["tune"]

_STEPS_SHOWN = ", ".join(f"{m} {d['steps']}" for m, d in MODEL_DEFAULTS.items()) + ", diffusers the family's"
_CHURNS_SHOWN = ", ".join(f"{m} {d['churn']:g}" for m, d in MODEL_DEFAULTS.items()) + ", diffusers the family's"


_PIPELINE_PARAMS = (
    "pipeline_path",
    "prompts_file",
    "num_prompts",
    "guidance",
    "shift",
    "height",
    "width",
    "max_sequence_length",
    "dtype",
    "max_memory_gb",
)
_PIPELINES = ("sd3", "diffusers")
_SMALL = ("gmm", *PIXEL_MODELS)
"""The models tuned on a named grid in this process: the mixture and the pixel experiment's models."""
_CHAINED = ", ".join((*_SMALL, "diffusers")[:-1]) + " or diffusers"
"""The models whose tuned run takes --chain, in a message."""

_MODELS_OF = {
    **{name: ("gmm",) for name in ("dim", "components", "mixture_seed")},
    **{name: ("sd3", "diffusers") for name in _PIPELINE_PARAMS},
    **{name: ("diffusers",) for name in ("true_cfg_scale", "negative_prompt", "scheduler_name")},
}
"""The options of some models only (the mixture's size, a pipeline's), and those models."""


def _refuse_other_models(model: str) -> None:
    """Refuse an option given for another model than ``--model``'s, which the tuner would not read.

    Raises:
        click.UsageError: naming those options and the models they apply to.
    """
    ctx = click.get_current_context()
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    unused = [(flags[n], models) for n, models in _MODELS_OF.items() if model not in models and is_given(ctx, n)]
    if unused:
        raise click.UsageError(
            "; ".join(f"{flag} applies only to --model {' or '.join(models)}" for flag, models in unused)
            + f": leave {'it' if len(unused) == 1 else 'them'} out with --model {model}"
        )


def _target(model: str, o: dict, n: int):
    """The model of ``--model`` (the mixture, or a pixel model: :func:`~specforest.experiments.pixel.models.tune_target`),
    ``n`` initial states and their conditioning."""
    if model == "gmm":
        import torch

        from .. import streams
        from ..models import GaussianMixture

        gmm = GaussianMixture.paper(dim=o["dim"], components=o["components"], seed=o["mixture_seed"])
        return gmm, streams.randn(0, torch.arange(n), (o["dim"],), device=o["device"]), None
    return tune_target(model, n, o["device"])


def parse_drafts(text: str) -> list:
    """``--drafts``: a comma list of registered draft names, or ``all`` (every registered draft)."""
    from ..proposals import available_drafts

    names = [d.strip() for d in text.split(",") if d.strip()]
    if names == ["all"]:
        return list(available_drafts())
    unknown = [d for d in names if d not in available_drafts()]
    if not names or unknown:
        raise click.BadParameter(
            f"expected a comma list of {', '.join(available_drafts())} or 'all', got {text!r}", param_hint="--drafts"
        )
    return names


def _tune_sd3(o: dict, drafts: list):
    """``specforest.diffusers.tune`` on the pipeline and captions of ``--pipeline`` and ``--prompts``."""
    from .. import diffusers as sd
    from ..experiments import sd3 as sd3_exp

    if not o["pipeline_path"] or not o["prompts_file"]:
        raise click.UsageError("--model sd3 needs --pipeline DIR and --prompts FILE")
    dtype = o["dtype"] or default_dtype(o["device"])
    prompts = library_errors(lambda: sd3_exp.load_prompts(o["prompts_file"], o["num_prompts"]))
    pipe = library_errors(lambda: sd3_exp.load_pipeline(o["pipeline_path"], device=o["device"], dtype=dtype))
    return library_errors(
        lambda: sd.tune(
            pipe,
            prompts,
            num_inference_steps=o["steps"],
            guidance_scale=o["guidance"],
            height=o["height"],
            width=o["width"],
            churn=o["churn"],
            shift=o["shift"],
            batch=o["batch"],
            budget_max=o["budget_max"],
            drafts=drafts,
            max_sequence_length=o["max_sequence_length"],
            max_memory_gb=o["max_memory_gb"],
            progress=o["progress"],
            **extra_values(o),
        )
    )


def _tune_diffusers(o: dict, drafts: list):
    """The family's tuner (``Family.tune``) on the pipeline of ``--pipeline``, its family from its
    ``model_index.json``; ``o`` gets the family and its resolved options (steps, churn, ...) for the record."""
    from ..diffusers.families import family_of_directory
    from ..experiments import sd3 as sd3_exp
    from ..experiments.pipelines import family_options, load_pipeline

    if not o["pipeline_path"] or not o["prompts_file"]:
        raise click.UsageError("--model diffusers needs --pipeline DIR and --prompts FILE")
    ctx = click.get_current_context()
    family = library_errors(lambda: family_of_directory(o["pipeline_path"]))
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    names = {lib: flags[k] for k, lib in FAMILY_FLAGS.items() if k in flags}
    # --guidance, --shift, --height, ... default to the SD3 paper's run here: not given, they are the family's
    options = library_errors(lambda: family_options(family, "tune", family_given(o, ctx), names=names))
    dtype = o["dtype"] or default_dtype(o["device"])
    prompts = library_errors(lambda: sd3_exp.load_prompts(o["prompts_file"], o["num_prompts"]))
    chain = pipeline_chain(o, ctx)
    pipe, _ = library_errors(lambda: load_pipeline(o["pipeline_path"], device=o["device"], dtype=dtype))
    swap_scheduler(pipe, o["scheduler_name"])
    res = library_errors(
        lambda: family.tune(
            pipe,
            prompts,
            batch=o["batch"],
            budget_max=o["budget_max"],
            drafts=drafts,
            max_memory_gb=o["max_memory_gb"],
            progress=o["progress"],
            **chain,
            **extra_values(o),
            **options,
        )
    )
    o["family"] = family.name
    for k, lib in FAMILY_FLAGS.items():
        o[k] = options.get(lib)
    o["churn"] = res.churn  # (None with another chain than em: the family's default churn was not run)
    keys = [k for k, lib in FAMILY_FLAGS.items() if lib in options and k not in ("steps", "churn")]
    if o["scheduler_name"] is not None:
        o["scheduler"] = o["scheduler_name"]  # (the swap, so that a run with --tune makes it too)
        keys.append("scheduler")
    return res, keys


@click.command("tune", context_settings=CONTEXT)
@click.option(
    "--model",
    type=click.Choice([*_SMALL, *_PIPELINES]),
    required=True,
    help="The target to tune for (digits, natural32, natural64: the shipped models of 'specforest pixel --model'; "
    "diffusers: a pipeline of any family, read from --pipeline).",
)
@steps_option(
    None, f"the model's command default: {_STEPS_SHOWN}", f"Grid steps T (3 to {MAX_STEPS}) of the run to tune for."
)
@churn_option(None, f"the model's command default: {_CHURNS_SHOWN}", "Churn eps in (0, 1] of the run to tune for.")
@chain_options(extra=("scheduler",))
@scheduler_option(" diffusers only.")
@click.option(
    "--batch",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Trajectories per run (>= 1): the run's --trajectories (gmm), --samples (pixel), --batch-size (sd3) "
    "or --batch (generate).",
)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--dim", type=click.IntRange(1), default=500, show_default=True, help="gmm: dimension.")
@click.option("--components", type=click.IntRange(1), default=5, show_default=True, help="gmm: components.")
@click.option("--mixture-seed", type=click.IntRange(0), default=0, show_default=True, help="gmm: mixture seed.")
@click.option(
    "--drafts",
    default="all",
    show_default=True,
    help="Comma list of registered drafts to consider, or 'all': every registered draft that serves the model "
    "(cached: a model that keeps its deep features, the mixture and the pixel models; learned: a model that "
    "declares its draft network, the digits model; a draft that remembers the last chain round, memory, secant, auto or "
    "learned, is considered on chains only; a draft network's calls are timed inside the sampler's rounds).",
)
@click.option("--budget-max", type=click.IntRange(1), default=62, show_default=True, help="Largest budget tried.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    required=True,
    callback=output_path(".json", what="a JSON file"),
    help="The JSON to write.",
)
@tune_pipeline_options
@click.option(
    "--true-cfg-scale",
    type=click.FloatRange(0.0),
    default=None,
    show_default="the family tuner's",
    help="diffusers: true classifier-free guidance (Flux; > 1 runs both branches in one call).",
)
@click.option(
    "--negative-prompt",
    default=None,
    show_default="the family tuner's",
    help="diffusers: the negative caption of every image (Flux's true CFG).",
)
@click.option(
    "--max-memory-gb",
    type=click.FloatRange(0.0, min_open=True),
    default=None,
    show_default="free CUDA memory, or 50% of RAM",
    help="sd3, diffusers: memory limit in GB (> 0); calls above it are split.",
)
@threads_option()
@progress_option()
@extra_options
def tune(**o) -> None:
    """Measure this device's batch-cost curve and the sampler's own time, and pick the fastest configuration.

    --model sd3 tunes a local StableDiffusion3Pipeline (--pipeline DIR) on the
    captions of --prompts FILE: its transformer with classifier-free guidance
    on its scheduler's grid (by default the paper's run, as 'specforest sd3').
    --model diffusers tunes a pipeline of any family (sd3, flux, sdxl, sd),
    read from DIR/model_index.json, for 'specforest diffusers' and 'generate
    diffusers': the family options not given (--steps, --churn, --guidance,
    --shift, --height, ...) are the family's own defaults, not the SD3 paper's.

    The JSON holds the configuration (tree as its parent list, coupling, verify,
    draft), predicted_seconds_per_image, predicted_speedup over the standard
    sampler, the cost curve and every candidate's prediction. The tuner measures
    with the thread count it sets (--threads).

    Without --steps and --churn it tunes at the model's own command defaults
    (digits, natural32, natural64: those of 'specforest pixel'; see --steps and
    --churn). --chain tunes the run of another sampler's chain (gmm, the pixel
    models and diffusers; the SD3 study's tuner runs the em chain); --model diffusers --chain scheduler tunes
    the pipeline's own scheduler (swapped in with --scheduler NAME, with --eta
    its step's), and the file records both. A command run with --tune FILE takes the file's
    steps, churn, chain, batch, device and threads where they are not given, and
    refuses a run that differs from them.
    """
    from ..latency import tune as tune_fn

    _refuse_other_models(o["model"])
    ctx = click.get_current_context()
    em = (o["chain"] or "em") == "em"
    if o["model"] == "sd3":
        given = [
            f for n, f in (("chain", "--chain"), *CHAIN_FLAGS.items()) if is_given(ctx, n) and not (n == "chain" and em)
        ]
        if given:
            raise click.UsageError(
                f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to --model {_CHAINED}: the SD3 "
                f"study's tuner runs the em chain (--churn); leave {'it' if len(given) == 1 else 'them'} out, or tune "
                "the pipeline with --model diffusers"
            )
    if o["model"] in _PIPELINES:
        gridded = [flag for n, flag in grid_flags().items() if is_given(ctx, n)]
        if gridded:
            raise click.UsageError(
                f"{', '.join(gridded)} {'applies' if len(gridded) == 1 else 'apply'} only to --model "
                f"{', '.join(_SMALL[:-1])} or {_SMALL[-1]}: "
                f"a pipeline's grid is its scheduler's (--steps); leave {'it' if len(gridded) == 1 else 'them'} out"
            )
    if o["chain"] == "scheduler" and o["model"] != "diffusers":
        raise click.UsageError(
            f"--chain scheduler (a pipeline's own scheduler) applies only to --model diffusers, not {o['model']}"
        )
    if o["model"] != "diffusers":
        for key in ("steps", "churn"):
            if o[key] is None and (key == "steps" or em):
                o[key] = MODEL_DEFAULTS[o["model"]][key]
    chain = None
    if o["model"] in _SMALL:
        chain = run_chain(o)
        check_grid(chain, o, grid=NAMED_GRID, where=f"the {NAMED_GRID} grid tune runs")
        refuse_deterministic_chain(
            chain, o["steps"], NAMED_GRID, where=f"the {NAMED_GRID} grid of --steps {o['steps']}", schedule=o
        )
    threads = set_threads(o["threads"])
    drafts = parse_drafts(o["drafts"])
    every = o["drafts"].strip() == "all"
    if every and o["model"] in _PIPELINES:
        from ..proposals import drafts_serving

        # a pipeline's latents are not known here: the drafts that serve any shape and any model
        # (not a draft network made for one model, nor one that reads features it does not keep)
        drafts = drafts_serving(drafts, None)
    keys = ("model", "steps", "churn", "batch", "device")
    if o["model"] == "diffusers":
        res, family_keys = _tune_diffusers(o, drafts)
        keys = ("model", "family", *keys[1:], *family_keys)
    elif o["model"] == "sd3":
        res = _tune_sd3(o, drafts)
        keys = ("model", "steps", "churn", "batch", "device", "guidance", "shift", "height", "width")
    else:
        res = _tune_small(o, drafts, tune_fn, every, chain)
        # the grid it tuned on: a run with --tune on another grid is refused
        o.update(grid=NAMED_GRID, shift=NAMED_GRID_SHIFT, **chain_settings(chain))
        keys += ("grid", "shift", "chain", "chain_params")
    if o["model"] == "gmm":
        keys += ("dim", "components")
    data = res.to_json()
    data["tuned_for"] = {k: o[k] for k in keys}
    data["tuned_for"]["threads"] = threads
    # the further options it was tuned with (not at their defaults), under their keys: a run takes them
    data["tuned_for"].update(options_record(extra_values(o)))
    # the choice first: minutes of measuring are not lost to a disk that fills at the write
    ms = 1e3
    per_s = lambda sec: 1.0 / sec if sec > 0 else float("inf")  # noqa: E731
    click.echo(
        f"chosen: {res.label}: {ms * res.predicted_seconds_per_image:.2f} ms per image predicted "
        f"({per_s(res.predicted_seconds_per_image):.1f} images/s), {res.predicted_speedup:.2f}x the standard "
        f"sampler's {ms * res.standard_seconds_per_image:.2f} ms ({per_s(res.standard_seconds_per_image):.1f} "
        f"images/s; {o['batch']} per run, {threads} thread(s))"
    )
    if res.measured_speedup is not None:
        click.echo(f"  measured {res.measured_speedup:.2f}x the standard sampler in the final race (full runs)")
    timed = [c for c in res.candidates if c["timed"]]
    for c in timed[:5]:
        click.echo(f"  {c['label']}: {ms * c['seconds_per_image']:.2f} ms per image, {c['calls']:.1f} calls")
    if len(timed) < len(res.candidates):
        click.echo(f"  ({len(res.candidates) - len(timed)} more not timed: their network calls alone are slower)")
    text = json.dumps(data, indent=1) + "\n"
    write_result(o["out"], lambda: atomic_write_text(o["out"], text), option="--out")
    click.echo(f"wrote {o['out']}")


def _tune_small(o: dict, drafts: list, tune_fn, every: bool, chain):
    """The mixture or a pixel model on ``chain``; with ``every`` (``--drafts all``), the drafts that serve it."""
    model, x, cond = library_errors(lambda: _target(o["model"], o, max(o["batch"], 16)))
    if o["model"] in PIXEL_MODELS and not every:
        library_errors(lambda: refuse_undeclared_learned(model, pixel_model(o["model"]), drafts, param="drafts"))
    if every:
        from ..proposals import drafts_serving

        # the model's own states and the model (the cached self-draft needs one that keeps its features)
        drafts = drafts_serving(drafts, tuple(x.shape[1:]), model)
    return library_errors(
        lambda: tune_fn(
            model,
            x,
            steps=o["steps"],
            **chain_kwargs(chain),
            cond=cond,
            batch=o["batch"],
            budget_max=o["budget_max"],
            drafts=drafts,
            progress=o["progress"],
            grid=NAMED_GRID,
            shift=NAMED_GRID_SHIFT,
            **extra_values(o),
        )
    )
