"""Command line: ``specforest train digits``, ``digits-draft``, ``natural32`` and ``natural64``, the
models the experiments ship with.

A thin shell over :mod:`specforest.experiments.train_digits`,
:mod:`specforest.experiments.train_digits_draft` and :mod:`specforest.experiments.train_natural`
(the natural-image models' runs are checkpointed: the same command again resumes one).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from .common import CONTEXT, check_output, library_errors, output_path, progress_option

__all__ = ["train"]


def _out_dir_option(default: str, what: str, help: str):
    """``--out`` (``out_dir``): the folder a training writes ``what`` to (checked before any work)."""
    return click.option(
        "--out",
        "out_dir",
        type=click.Path(file_okay=False),
        default=default,
        show_default=True,
        callback=output_path(what=what, folder=True),
        help=help,
    )


def _weights_dir_option(help: str):
    return click.option(
        "--weights-dir",
        type=click.Path(file_okay=False),
        default=None,
        show_default="the package's models/weights",
        callback=output_path(what="the weights and their manifest", folder=True),
        help=help,
    )


def _weights_dir(given: "str | None", default: Path) -> Path:
    """The weights folder of a training run, checked before it starts: the package's own folder (the
    default) may be read-only in an installed package, and a training run takes minutes."""
    path = Path(given) if given else default
    check_output(str(path), option="--weights-dir", folder=True)
    return path


def _max_minutes_seed_options(minutes: float, help: str):
    """``--max-minutes`` (default ``minutes``) and ``--seed``, in that order."""

    def wrap(f):
        f = click.option("--seed", type=click.IntRange(0), default=0, show_default=True, help="Training seed (>= 0).")(
            f
        )
        return click.option(
            "--max-minutes", type=click.FloatRange(0.0, min_open=True), default=minutes, show_default=True, help=help
        )(f)

    return wrap


def _threads_progress_options(f):
    """``--threads`` and ``--progress/--no-progress``, in that order."""
    f = progress_option("Progress bars on stderr.")(f)
    return click.option(
        "--threads",
        type=click.IntRange(1),
        default=1,
        show_default=True,
        help="torch CPU threads (1 is fastest on a shared 2-core machine).",
    )(f)


@click.group(context_settings=CONTEXT)
def train() -> None:
    """Train the models the experiments ship with."""


@train.command("digits", context_settings=CONTEXT)
@_out_dir_option(
    "results/train_digits", "the loss plot and the training log", "Directory of loss.png and train_log.json."
)
@_weights_dir_option("Where the safetensors files and manifest.json are written (atomically).")
@click.option("--steps", type=click.IntRange(1), default=3000, show_default=True, help="Denoiser optimizer steps.")
@_max_minutes_seed_options(18.0, "Stop the denoiser's training early after this many minutes.")
@click.option(
    "--eval-samples",
    type=click.IntRange(0),
    default=500,
    show_default=True,
    help="Standard-sampler samples drawn after training to measure the classifier's accuracy.",
)
@_threads_progress_options
def train_digits(
    out_dir: str,
    weights_dir: str | None,
    steps: int,
    max_minutes: float,
    seed: int,
    eval_samples: int,
    threads: int,
    progress: bool,
) -> None:
    """Train the digits denoiser (EDM U-Net, EMA weights) and the evaluation classifier."""
    import torch

    from ..experiments.train_digits import TrainConfig, main_train
    from ..models.digits import WEIGHTS_DIR

    weights = _weights_dir(weights_dir, WEIGHTS_DIR)
    torch.set_num_threads(threads)
    cfg = TrainConfig(steps=steps, max_minutes=max_minutes, seed=seed, eval_samples=eval_samples)
    library_errors(
        lambda: main_train(
            out_dir,
            weights_dir=weights,
            config=cfg,
            progress=progress,
            log=lambda line: click.echo(line, err=True),
        )
    )


@train.command("digits-draft", context_settings=CONTEXT)
@_weights_dir_option("Where digits_draft_unet.safetensors goes and whose manifest.json gets its entry (atomically).")
@click.option("--steps", type=click.IntRange(1), default=2500, show_default=True, help="Optimizer steps.")
@click.option("--batch", type=click.IntRange(1), default=256, show_default=True, help="States per step.")
@_max_minutes_seed_options(15.0, "Stop early after this many minutes.")
@_threads_progress_options
def train_digits_draft(
    weights_dir: str | None, steps: int, batch: int, max_minutes: float, seed: int, threads: int, progress: bool
) -> None:
    """Distill the learned draft (draft="learned") from the shipped digits target.

    The draft is the target's U-Net, narrower (models.digits.DRAFT_CONFIG), trained to minimise
    the sampler's mismatch delta (its velocity error over each verified step's noise scale) on
    the pixel experiment's grid (flow_match, T = 100, churn 0.3).
    """
    import torch

    from ..experiments.train_digits_draft import DraftTrainConfig, main_train_draft
    from ..models.digits import WEIGHTS_DIR

    weights = _weights_dir(weights_dir, WEIGHTS_DIR)
    torch.set_num_threads(threads)
    cfg = DraftTrainConfig(steps=steps, batch=batch, max_minutes=max_minutes, seed=seed)
    library_errors(
        lambda: main_train_draft(
            weights_dir=weights,
            config=cfg,
            progress=progress,
            log=lambda line: click.echo(line, err=True),
        )
    )


def _natural_command(name: str):
    """``specforest train NAME`` for one of the natural-image models (its defaults: the shipped run's)."""
    from ..models.natural import MODELS

    steps, batch = MODELS[name].steps, MODELS[name].batch

    @train.command(name, context_settings=CONTEXT)
    @_out_dir_option(
        f"results/train_{name}",
        "the checkpoint, the training log and the figures",
        "Folder of checkpoint.safetensors (a rerun resumes from it), train_log.json, loss.png, samples.png.",
    )
    @_weights_dir_option(f"Where {name}_unet.safetensors goes and whose manifest.json gets its entry (atomically).")
    @click.option("--steps", type=click.IntRange(1), default=steps, show_default=True, help="Optimizer steps.")
    @click.option("--batch", type=click.IntRange(1), default=batch, show_default=True, help="Crops per step.")
    @click.option(
        "--channels",
        type=str,
        default=None,
        show_default="the shipped architecture's",
        help="The U-Net's feature channels at its three resolutions, C0,C1,C2 (multiples of 4 up to 32, of 8 above).",
    )
    @click.option(
        "--checkpoint-every", type=click.IntRange(1), default=100, show_default=True, help="Steps between checkpoints."
    )
    @click.option(
        "--eval-crops",
        type=click.IntRange(0),
        default=256,
        show_default=True,
        help="Held-out and training crops the evaluation measures (0: no evaluation).",
    )
    @click.option(
        "--figure-samples",
        type=click.IntRange(0),
        default=16,
        show_default=True,
        help="Samples in samples.png (0: no figure).",
    )
    @_max_minutes_seed_options(
        50.0, "Stop this run's training after this many minutes (checkpointed: rerun to resume)."
    )
    @_threads_progress_options
    def command(
        out_dir: str,
        weights_dir: "str | None",
        steps: int,
        batch: int,
        channels: "str | None",
        checkpoint_every: int,
        eval_crops: int,
        figure_samples: int,
        max_minutes: float,
        seed: int,
        threads: int,
        progress: bool,
    ) -> None:
        import torch

        from ..experiments.train_natural import NaturalTrainConfig, main_train_natural
        from ..models.digits import WEIGHTS_DIR
        from ..models.natural import MODELS

        unet = MODELS[name].unet
        if channels is not None:
            try:
                chans = tuple(int(c) for c in channels.split(","))
            except ValueError:
                chans = ()
            # the blocks' GroupNorm takes min(8, C // 4) groups, which must divide C
            if len(chans) != 3 or any(c < 4 or c % 4 or (c > 32 and c % 8) for c in chans):
                raise click.BadParameter(
                    f"must be three channel counts separated by commas, each a multiple of 4 from 4 to 32 or "
                    f"of 8 above, got {channels!r}",
                    param_hint="--channels",
                )
            unet = dataclasses.replace(unet, channels=chans)
        weights = _weights_dir(weights_dir, WEIGHTS_DIR)
        torch.set_num_threads(threads)
        cfg = NaturalTrainConfig(
            steps=steps,
            batch=batch,
            seed=seed,
            max_minutes=max_minutes,
            checkpoint_every=checkpoint_every,
            eval_crops=eval_crops,
            figure_samples=figure_samples,
        )
        library_errors(
            lambda: main_train_natural(
                name,
                out_dir,
                weights_dir=weights,
                config=cfg,
                unet_config=unet,
                progress=progress,
                log=lambda line: click.echo(line, err=True),
            )
        )

    command.__doc__ = (
        f"Train the {name} denoiser (EDM U-Net on crops of scikit-image's photographs, EMA weights), "
        "resumable from its checkpoint, then evaluate it on held-out crops."
    )
    command.help = command.__doc__
    return command


train_natural32 = _natural_command("natural32")
train_natural64 = _natural_command("natural64")


def _natural_draft_command(name: str):
    """``specforest train NAME-draft`` for one of the natural-image models (its defaults: the shipped run's)."""
    from ..models.natural import MODELS

    spec = MODELS[name]

    @train.command(f"{name}-draft", context_settings=CONTEXT)
    @_out_dir_option(
        f"results/train_{name}-draft",
        "the checkpoint and the training log",
        "Folder of checkpoint.safetensors (a rerun resumes from it) and train_log.json.",
    )
    @_weights_dir_option(f"Where {spec.draft_file} goes and whose manifest.json gets its entry (atomically).")
    @click.option(
        "--steps", type=click.IntRange(1), default=spec.draft_steps, show_default=True, help="Optimizer steps."
    )
    @click.option(
        "--batch", type=click.IntRange(1), default=spec.draft_batch, show_default=True, help="Noised crops per step."
    )
    @click.option(
        "--checkpoint-every", type=click.IntRange(1), default=100, show_default=True, help="Steps between checkpoints."
    )
    @click.option(
        "--eval-crops",
        type=click.IntRange(0),
        default=64,
        show_default=True,
        help="Held-out crops noised at every verified level to measure the draft's mismatch (0: no evaluation).",
    )
    @_max_minutes_seed_options(
        15.0, "Stop this run's training after this many minutes (checkpointed: rerun to resume)."
    )
    @_threads_progress_options
    def command(
        out_dir: str,
        weights_dir: "str | None",
        steps: int,
        batch: int,
        checkpoint_every: int,
        eval_crops: int,
        max_minutes: float,
        seed: int,
        threads: int,
        progress: bool,
    ) -> None:
        import torch

        from ..experiments.train_natural_draft import NaturalDraftConfig, main_train_natural_draft
        from ..models.digits import WEIGHTS_DIR

        weights = _weights_dir(weights_dir, WEIGHTS_DIR)
        torch.set_num_threads(threads)
        cfg = NaturalDraftConfig(
            steps=steps,
            batch=batch,
            seed=seed,
            max_minutes=max_minutes,
            checkpoint_every=checkpoint_every,
            eval_crops=eval_crops,
        )
        library_errors(
            lambda: main_train_natural_draft(
                name,
                out_dir,
                weights_dir=weights,
                config=cfg,
                progress=progress,
                log=lambda line: click.echo(line, err=True),
            )
        )

    command.__doc__ = (
        f"Distill {name}'s learned draft (draft=\"learned\"): a narrower U-Net trained to minimise the sampler's "
        "mismatch delta against the shipped target on noised training crops at the verified levels of "
        "euler_ancestral's 50 Karras steps; resumable from its checkpoint."
    )
    command.help = command.__doc__
    return command


train_natural32_draft = _natural_draft_command("natural32")
train_natural64_draft = _natural_draft_command("natural64")
