"""Click options shared by the ``gmm``, ``pixel`` and ``sd3`` commands (one definition each)."""

from __future__ import annotations

from typing import Callable

import click

from .experiments.gmm import TREE_MODES
from .proposals import DRAFT_KINDS
from .sampler import PREFETCH_POLICIES
from .trees import VERIFY_MODES

__all__ = ["choice_list", "draft_option", "int_list", "prefetch_option", "tree_options", "verify_option"]


def int_list(name: str, lo: int) -> Callable[[click.Context, click.Parameter, str], list[int]]:
    """A click callback parsing a comma list of integers ``>= lo`` (sorted, without repeats)."""

    def parse(ctx, param, value: str) -> list[int]:
        try:
            vals = [int(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise click.BadParameter(f"{name} must be a comma-separated list of integers, got {value!r}") from None
        if not vals or min(vals) < lo:
            raise click.BadParameter(f"{name} must list integers >= {lo}, got {value!r}")
        return sorted(set(vals))

    return parse


def choice_list(name: str, choices: "tuple[str, ...]") -> Callable[[click.Context, click.Parameter, str], list[str]]:
    """A click callback parsing a comma list of names from ``choices`` (in order, without repeats)."""

    def parse(ctx, param, value: str) -> list[str]:
        vals = list(dict.fromkeys(v.strip().lower() for v in value.split(",") if v.strip()))
        bad = [v for v in vals if v not in choices]
        if not vals or bad:
            raise click.BadParameter(f"{name} must be a comma-separated list of {', '.join(choices)}; got {value!r}")
        return vals

    return parse


def prefetch_option():
    return click.option(
        "--prefetch",
        type=click.Choice(PREFETCH_POLICIES),
        default="nearest",
        show_default=True,
        help="Which evaluated node the next round drafts from after a rejection (ERRATA 9).",
    )


def verify_option(default: str):
    return click.option(
        "--verify",
        type=click.Choice(VERIFY_MODES),
        default=default,
        show_default=True,
        help="Evaluate every drafted node (drafted: the paper's protocol, B = |V|) or only "
        "the root and internal nodes (internal: fewer states per call, same NFE or more).",
    )


def draft_option():
    return click.option(
        "--draft",
        type=click.Choice(DRAFT_KINDS),
        default="velocity",
        show_default=True,
        help="What the draft freezes from the prefetched evaluation: the velocity (the paper's protocol), "
        "the whole drift (App. C.1), the clean-data prediction x0, the noise prediction eps, x0 "
        "extrapolated in time (x0_extrap), or auto (chosen online per draft offset); the exactly "
        "known rest is recomputed at each drafted state.",
    )


def tree_options(f):
    """``--tree uniform|optimal|adaptive`` (stored as ``tree_mode``) and ``--budget``."""
    f = click.option(
        "--budget",
        type=click.IntRange(1),
        default=None,
        help="Drafted states per round (>= 1) for --tree optimal or adaptive.",
    )(f)
    return click.option(
        "--tree",
        "tree_mode",
        type=click.Choice(TREE_MODES),
        default="uniform",
        show_default=True,
        help="uniform: the (K, L) tree; optimal: the tree that maximizes expected steps per target call "
        "for --budget, planned from a short calibration run; adaptive: re-planned every round from "
        "the run's own statistics (K and L are ignored by both).",
    )(f)
