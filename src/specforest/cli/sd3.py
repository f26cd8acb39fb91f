"""Command line: ``specforest sd3 --model PATH --prompts FILE`` (paper Sec. 5.3, Figure 5).

A thin shell over :mod:`specforest.experiments.sd3`: options are parsed and
range-checked here, everything else happens in the library. ``sd3`` is a
:class:`click.Command`, added to the root group by :mod:`specforest.cli`.
"""

from __future__ import annotations

import click

from ..devices import default_device, default_dtype
from ..experiments import sd3 as sd3_exp
from .common import (
    CONTEXT,
    MODEL_DEFAULTS,
    apply_tuned,
    churn_option,
    draft_option,
    extra_values,
    int_list,
    lazy_option,
    library_errors,
    output_path,
    pipeline_extra_options,
    prefetch_option,
    progress_option,
    seed_option,
    set_threads,
    steps_option,
    threads_option,
    tune_option,
    verify_option,
)

__all__ = ["pipeline_options", "sd3", "tune_pipeline_options"]


def pipeline_options(f):
    """The pipeline, captions and image options of every SD3 command (``sd3`` and ``generate sd3``)."""
    for opt in reversed(_pipeline_option_list("--model", required=True, device=True)):
        f = opt(f)
    return f


def tune_pipeline_options(f):
    """The same options for ``specforest tune --model sd3``: the pipeline is ``--pipeline``, nothing required."""
    pipeline = (
        "Local diffusers pipeline directory, loaded with local_files_only=True: --model sd3 a "
        "StableDiffusion3Pipeline (e.g. a download of stabilityai/stable-diffusion-3.5-medium), --model diffusers "
        "a pipeline of any family (sd3, flux, sdxl, sd), read from its model_index.json."
    )
    for opt in reversed(_pipeline_option_list("--pipeline", required=False, device=False, path_help=pipeline)):
        f = opt(f)
    return f


def _pipeline_option_list(path_flag: str, *, required: bool, device: bool, path_help: "str | None" = None) -> list:
    opts = [
        click.option(
            path_flag,
            "pipeline_path" if path_flag != "--model" else "model",
            type=click.Path(exists=True, file_okay=False),
            required=required,
            help=path_help
            or "Local StableDiffusion3Pipeline directory (e.g. a download of "
            "stabilityai/stable-diffusion-3.5-medium); loaded with local_files_only=True.",
        ),
        click.option(
            "--prompts",
            "prompts_file",
            type=click.Path(exists=True, dir_okay=False),
            required=required,
            help="Text file of captions, one per line (empty lines skipped).",
        ),
        click.option(
            "--num-prompts",
            type=click.IntRange(1),
            default=None,
            show_default="all",
            help="Use the first N captions (>= 1).",
        ),
        click.option(
            "--guidance",
            type=click.FloatRange(0.0),
            default=7.0,
            show_default=True,
            help="Classifier-free guidance scale (>= 0; <= 1 disables guidance).",
        ),
        click.option(
            "--shift",
            type=click.FloatRange(0.0, min_open=True),
            default=3.0,
            show_default=True,
            help="Timestep shift kappa (> 0, eq. 38); overrides the scheduler's.",
        ),
        click.option(
            "--height",
            type=click.IntRange(1),
            default=512,
            show_default=True,
            help="Image height in pixels (>= 1, divisible by vae_scale_factor x patch_size, 16 for SD3).",
        ),
        click.option(
            "--width",
            type=click.IntRange(1),
            default=512,
            show_default=True,
            help="Image width in pixels (>= 1, divisible by vae_scale_factor x patch_size, 16 for SD3).",
        ),
        click.option(
            "--max-sequence-length",
            type=click.IntRange(1, 512),
            default=256,
            show_default=True,
            help="T5 prompt tokens (1..512), as in the SD3 pipeline.",
        ),
        click.option(
            "--dtype",
            type=click.Choice(tuple(sd3_exp.DTYPES)),
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
    return opts


@click.command("sd3", context_settings=CONTEXT)
@pipeline_options
@click.option(
    "--K-values",
    "K_values",
    default="2,3,4,5,6,7",
    show_default=True,
    callback=int_list("K-values", 1),
    help="Comma-separated D-GRS widths K (each >= 1); RMC runs a chain of B = K + ... + K^L for each.",
)
@click.option("--L", "L", type=click.IntRange(1), default=2, show_default=True, help="D-GRS depth L (>= 1).")
@steps_option(MODEL_DEFAULTS["sd3"]["steps"])
@churn_option(MODEL_DEFAULTS["sd3"]["churn"])
@seed_option("latents and noise")
@verify_option("drafted")
@prefetch_option()
@draft_option()
@click.option(
    "--batch-size",
    type=click.IntRange(1),
    default=None,
    show_default="all prompts at once",
    help="Images per sampler call (>= 1).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default="results/sd3",
    show_default=True,
    callback=output_path(what="the results and figures", folder=True),
    help="Directory of results.json/.csv and speedup_vs_K.png (resumed if present).",
)
@click.option(
    "--clip",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Local CLIP model directory (e.g. openai/clip-vit-large-patch14) for CLIP scores "
    "(100 x cosine, clipped at 0); none: no CLIP score, images are not decoded.",
)
@click.option(
    "--max-memory-gb",
    type=click.FloatRange(0.0, min_open=True),
    default=None,
    show_default="free CUDA memory, or 50% of RAM",
    help="Memory limit in GB (> 0); transformer calls are split to fit it, runs that cannot fit are refused.",
)
@lazy_option("Draft only the visited nodes: same law of images and NFE, far less memory and compute.")
@click.option("--save-images", is_flag=True, help="Save every image under OUT/images/<configuration>/.")
@progress_option("Progress bars on stderr.")
@threads_option()
@tune_option(
    "A JSON written by 'specforest tune --model sd3': its configuration (tree, coupling, verify, draft, "
    "prefetch) runs as one more of the study, 'tuned'; --K-values/--L/--verify/--prefetch set the others. "
    "--steps, --churn, --batch-size, --guidance, --shift, --height, --width, --device and --threads default "
    "to the file's; given, they must match it (an error lists every difference)."
)
@pipeline_extra_options
def sd3(**o) -> None:
    """Stable Diffusion 3 experiment of the paper (Section 5.3, Figure 5, Table 1).

    Runs the standard sampler, then for every K: D-GRS on the (K, L) tree and RMC on a
    chain of the matched budget B = K + ... + K^L, on the same captions and initial
    latents. Reports NFE speedup T/NFE per image (mean ± SEM) and, with --clip, the CLIP
    score. Defaults are the paper's: 512x512, T=50, guidance 7, churn 0.8, shift 3, L=2,
    K=2..7. Writes OUT/results.json, OUT/results.csv and OUT/speedup_vs_K.png.
    """
    o, tuned = apply_tuned(
        o,
        "sd3",
        run={k: k for k in ("guidance", "shift", "height", "width")} | {"batch": "batch_size"},
        sampler=False,
    )
    set_threads(o.pop("threads"))
    device = o["device"] or default_device()
    dtype = o["dtype"] or default_dtype(device)

    def log(line: str) -> None:
        click.echo(line, err=True)

    setting = library_errors(
        lambda: sd3_exp.SD3Setting(
            height=o["height"],
            width=o["width"],
            steps=o["steps"],
            guidance_scale=o["guidance"],
            churn=o["churn"],
            shift=o["shift"],
            L=o["L"],
            K_values=o["K_values"],
            verify=o["verify"],
            prefetch=o["prefetch"],
            draft=o["draft"],
            lazy=o["lazy"],
            seed=o["seed"],
            batch_size=o["batch_size"],
            max_sequence_length=o["max_sequence_length"],
            options=extra_values(o),
        )
    )
    prompts = library_errors(lambda: sd3_exp.load_prompts(o["prompts_file"], o["num_prompts"]))
    log(f"loading {o['model']} ({dtype} on {device})")
    pipe = library_errors(lambda: sd3_exp.load_pipeline(o["model"], device=device, dtype=dtype))
    res = library_errors(
        lambda: sd3_exp.run_experiment(
            pipe,
            prompts,
            setting,
            o["out_dir"],
            model=str(o["model"]),
            dtype=dtype,
            max_memory_gb=o["max_memory_gb"],
            clip=o["clip"],
            clip_device=device,
            save_images=o["save_images"],
            progress=o["progress"],
            log=log,
            tuned=tuned,
        )
    )
    click.echo(sd3_exp.format_summary(res.records))
    click.echo(f"ran {res.ran} configuration(s), skipped {res.skipped} already done")
    for p in res.files:
        click.echo(f"wrote {p}")
