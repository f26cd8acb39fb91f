"""What every command shares: one error policy, one definition of each shared option.

:func:`library_errors` is the CLI's only error policy: the library's errors on
bad input, memory, missing files or optional packages and non-finite network
outputs become a one-line ``Error: ...`` and exit status 1, never a traceback.
Options that several commands take (``--tree``/``--budget``, ``--method``, ``--K``/``--L``, ``--seed``, ...)
and the comma-list parsers are defined here once; the sampler's own options (``--steps``, ``--churn``,
``--prefetch``, ``--verify``, ``--draft``, ``--grid``, ``--lazy``, ``--chain`` with the chains' options) are
derived from their declaration on :class:`~specforest.SamplerOptions` in :mod:`.sampler_options`, and the
``--tune`` file is read in :mod:`.tune_file` (both re-exported here), as are the
checks every command makes before its work: each output path can be written
(:func:`output_path`), a tree option given that the run would not use is refused
(:func:`refuse_unused`; the draft's options of a standard run are recorded as not applied,
:func:`as_ran`), the chain's options are those of the chain chosen (:func:`run_chain`), and a
``--tune`` file is read whole and checked field by field (:func:`read_tuned`, :func:`apply_tuned`).
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

import click

from ..chains import Chain, available_chains
from ..devices import set_threads
from ..experiments.pixel.models import DEFAULT_MODEL, PIXEL_MODELS
from ..options import NoStochasticStep, check_stochastic, make_sde
from ..planning import TREE_MODES
from .sampler_options import (
    CHAIN_FLAGS,
    NAMED_GRID,
    NAMED_GRID_SHIFT,
    chain_options,
    chain_settings,
    chains_taking,
    check_grid,
    check_named_grid,
    churn_option,
    draft_option,
    extra_options,
    extra_values,
    grid_flags,
    grid_option,
    is_given,
    lazy_option,
    pipeline_extra_options,
    prefetch_option,
    run_chain,
    steps_option,
    verify_option,
)
from .tune_file import MAX_THREADS, SAMPLER_PARAMS, apply_tuned, read_tuned, tune_option

__all__ = [
    "CHAIN_FLAGS",
    "CHURN",
    "CONTEXT",
    "LIBRARY_ERRORS",
    "MAX_THREADS",
    "MODEL_DEFAULTS",
    "NAMED_GRID",
    "NAMED_GRID_SHIFT",
    "POSITIVE",
    "SAMPLER_PARAMS",
    "UNUSED_BY_STANDARD",
    "apply_tuned",
    "as_ran",
    "chain_given",
    "chain_options",
    "chain_settings",
    "check_grid",
    "check_named_grid",
    "check_output",
    "choice_list",
    "churn_option",
    "compile_option",
    "draft_option",
    "extra_options",
    "grid_flags",
    "pipeline_extra_options",
    "extra_values",
    "float_list",
    "grid_option",
    "in_flags",
    "int_list",
    "is_given",
    "json_option",
    "lazy_option",
    "library_errors",
    "method_option",
    "no_stochastic_step",
    "output_path",
    "pixel_model_option",
    "prefetch_option",
    "progress_option",
    "read_tuned",
    "refuse_deterministic_chain",
    "refuse_group_options",
    "refuse_unused",
    "run_chain",
    "seed_option",
    "set_threads",
    "steps_option",
    "threads_option",
    "tree_options",
    "tree_size_options",
    "tune_option",
    "verify_option",
    "write_result",
]

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
"""Click context settings of every command."""

CHURN = click.FloatRange(0.0, 1.0, min_open=True)
"""The churn ``eps`` in (0, 1]."""

POSITIVE = click.FloatRange(0.0, min_open=True)
"""A number > 0."""

LIBRARY_ERRORS = (ValueError, TypeError, MemoryError, NotImplementedError, OSError, ImportError, FloatingPointError)
"""What the library raises on bad input or an unusable environment (``OSError``
covers missing files); anything else is a bug and keeps its traceback."""

T = TypeVar("T")

_PYTHON_SPELLINGS = (
    (re.compile(r"\blazy=True \(--lazy\)|\blazy=True\b"), "--lazy"),
    (re.compile(r"\btree=None\b"), "--method standard"),
    (re.compile(r"\btree='(\w+)'"), r"--tree \1"),
)
"""The library's advice in Python keywords whose flag has another name (``tree=None`` is the standard
sampler, ``--method standard``), for :func:`in_flags`."""


def in_flags(message: str) -> str:
    """A library error's ``message`` in the current command's flags: the keywords of
    :data:`_PYTHON_SPELLINGS`, and ``name=value`` of each option of the command (``draft='learned'``,
    ``memory_gb=1e-06``) as its flag and value (``--draft learned``, ``--memory-gb 1e-06``). A user of a
    command cannot type the library's keywords; the command's options are named as they are (``--steps``
    is ``steps``), so only the spelling changes."""
    for pattern, flags in _PYTHON_SPELLINGS:
        message = pattern.sub(flags, message)
    ctx = click.get_current_context(silent=True)
    for param in ctx.command.params if ctx is not None else ():
        if isinstance(param, click.Option) and param.name and param.opts[0].startswith("--"):
            flag = param.opts[0]
            message = re.sub(rf"\b{re.escape(param.name)}='([\w.-]*)'", rf"{flag} \1", message)
            message = re.sub(rf"\b{re.escape(param.name)}=", f"{flag} ", message)
    return message


def library_errors(fn: Callable[[], T]) -> T:
    """Run ``fn()`` and turn the library's errors (:data:`LIBRARY_ERRORS`) into clean CLI errors, in flags
    (:func:`in_flags`; a chain with no stochastic step: :func:`no_stochastic_step`)."""
    try:
        return fn()
    except NoStochasticStep as e:
        raise click.ClickException(no_stochastic_step(e)) from e
    except LIBRARY_ERRORS as e:
        raise click.ClickException(in_flags(str(e))) from e


def write_result(path: str, write: Callable[[], object], *, option: str) -> None:
    """Write a command's result file at its end, after the result was printed: ``write()`` writes ``path``
    atomically (:mod:`specforest.atomic`), so a failure leaves no half-written file there.

    The path was checked before the work (:func:`output_path`), but a disk can fill while the run works.

    Args:
        path: the file, as the user gave it.
        write: writes it (raises :class:`OSError` when it cannot).
        option: the flag that named it.

    Raises:
        click.ClickException: naming ``option``, ``path`` and why, never a traceback after the work.
    """
    try:
        write()
    except OSError as e:
        raise click.ClickException(
            f"{option} {path}: cannot write it ({e.strerror or e}); nothing was written there. The result is "
            "printed above: free some space or give another path, and run again"
        ) from e


def refuse_group_options(ctx: click.Context) -> None:
    """Refuse, in a group that is also a command (``gmm``, ``pixel``), the group's own options given on
    the command line before one of its subcommands (``specforest gmm --dim 8 sweep``), which would
    silently not apply to it.

    Raises:
        click.UsageError: naming those options and where they belong.
    """
    given = [
        p.opts[0]
        for p in ctx.command.params
        if ctx.get_parameter_source(p.name) == click.core.ParameterSource.COMMANDLINE
    ]
    if given:
        raise click.UsageError(
            f"options {', '.join(given)} belong to '{ctx.info_name}' itself; put them after '{ctx.invoked_subcommand}'"
        )


def float_list(
    name: str, lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False, unique: bool = False
) -> Callable[[click.Context, click.Parameter, str], list[float]]:
    """A click callback parsing a comma list of numbers in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``).

    ``unique`` sorts the values and drops repeats; otherwise they keep their order.
    """

    def parse(ctx, param, value: str) -> list[float]:
        try:
            vals = [float(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise click.BadParameter(f"{name} must be a comma-separated list of numbers, got {value!r}") from None
        inside = all((v > lo if lo_open else v >= lo) and v <= hi for v in vals)
        if not vals or not inside:
            rng = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
            raise click.BadParameter(f"{name} must list numbers in {rng}, got {value!r}")
        return sorted(set(vals)) if unique else vals

    return parse


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


def method_option(methods: "tuple[str, ...]"):
    """``--method``: the sampler of a run (``dgrs`` by default)."""
    return click.option(
        "--method",
        type=click.Choice(methods),
        default="dgrs",
        show_default=True,
        help="standard (no tree, T NFE), rmc (chain, Algorithm 2), dgrs (uniform tree, Algorithm 3), "
        "rank (uniform tree, rank-aware list coupling conditioned on the maximum) or antithetic "
        "(uniform tree of K/2 mirrored pairs per node, K even).",
    )


def tree_size_options(K: int, L: int):
    """``--K`` and ``--L`` of the uniform ``(K, L)`` tree (``--L`` is the chain length for rmc)."""

    def wrap(f):
        f = click.option(
            "--L",
            "L",
            type=click.IntRange(1),
            default=L,
            show_default=True,
            help="Tree depth (>= 1); for rmc the chain length B (e.g. --method rmc --L 14).",
        )(f)
        return click.option(
            "--K",
            "K",
            type=click.IntRange(1),
            default=K,
            show_default=True,
            help="Children per node of the uniform tree (>= 1; even for antithetic); ignored by rmc and standard.",
        )(f)

    return wrap


def seed_option(what: str):
    """``--seed >= 0``; ``what`` says what it seeds."""
    return click.option("--seed", type=click.IntRange(0), default=0, show_default=True, help=f"Seed (>= 0) of {what}.")


def json_option():
    """``--json``: one JSON object on stdout and nothing else."""
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout and nothing else.")


def progress_option(what: str = "Progress bar on stderr."):
    """``--progress/--no-progress`` (on by default)."""
    return click.option("--progress/--no-progress", default=True, show_default=True, help=what)


def threads_option():
    """``--threads``: torch's CPU threads for this process, chosen deliberately (see :func:`set_threads`)."""
    return click.option(
        "--threads",
        # an absurd count aborts the process inside OpenMP (10**9 threads: 216 GB of thread state)
        type=click.IntRange(1, MAX_THREADS),
        default=None,
        show_default="$OMP_NUM_THREADS if set, else the CPUs divided among torchrun's local processes",
        help=f"Torch CPU threads of this process (1 to {MAX_THREADS}). On a shared machine an oversubscribed default makes "
        "timings swing by 10x; one thread per process is the stable choice.",
    )


def compile_option():
    """``--compile``: ``torch.compile(mode="reduce-overhead")`` the target, its rows padded to powers of two."""
    return click.option(
        "--compile",
        "compile_model",
        is_flag=True,
        help="torch.compile(mode='reduce-overhead') the target; every call's rows are padded to a power of "
        "two, so it compiles a few shapes instead of one per round (the samples do not change).",
    )


_PIXEL_DEFAULTS = {"steps": 100, "churn": 0.3}

MODEL_DEFAULTS = {
    "gmm": {"steps": 30, "churn": 0.1},
    **{name: dict(_PIXEL_DEFAULTS) for name in PIXEL_MODELS},
    "sd3": {"steps": 50, "churn": 0.8},
}
"""Grid steps and churn of each model's commands (``gmm``; ``pixel`` for ``digits``, ``natural32`` and
``natural64``, :data:`~specforest.experiments.pixel.models.PIXEL_MODELS`; ``sd3``; their ``generate``
forms), which ``specforest tune --model M`` tunes at by default."""


def pixel_model_option():
    """``--model``: which shipped model ``pixel`` and ``generate pixel`` sample
    (:data:`~specforest.experiments.pixel.models.PIXEL_MODELS`, the digits model by default)."""
    return click.option(
        "--model",
        "model",
        type=click.Choice(list(PIXEL_MODELS)),
        default=DEFAULT_MODEL,
        show_default=True,
        help="The shipped model: digits (class-conditional 1x8x8, scored by its classifier), natural32 or "
        "natural64 (unconditional 3x32x32 / 3x64x64 natural-image denoisers, docs/natural.md).",
    )


def check_output(value: str, *, option: str, folder: bool = False, fresh: bool = False) -> None:
    """Refuse, before any work, an output path the run could not write at its end.

    The path must not be a folder where a file is written (or a file where a folder is), and
    the nearest folder on its way that exists (the run creates the rest) must take a new file:
    a probe file is created there and removed at once. Permission bits cannot tell: root
    passes them, while ``/proc`` or a read-only mount refuse whatever they say.

    Args:
        value: the path as given.
        option: the option's flag, named in the error.
        folder: the run writes a folder there (else a file).
        fresh: the folder must not exist yet (a run that never writes into an old one).

    Raises:
        click.BadParameter: naming ``option`` and what is wrong.
    """
    path = Path(value).absolute()
    if path.exists():
        if fresh:
            raise click.BadParameter(
                f"{value} exists; choose another (a run never writes into an old one)", param_hint=option
            )
        if folder and not path.is_dir():
            raise click.BadParameter(f"{value} is a file; give a folder (new or existing)", param_hint=option)
        if not folder and path.is_dir():
            raise click.BadParameter(f"{value} is a folder; give a file name", param_hint=option)
    home = path if path.is_dir() else next(p for p in path.parents if p.exists())
    if not home.is_dir():
        raise click.BadParameter(f"cannot write {value}: {home} is a file, not a folder", param_hint=option)
    try:
        fd, probe = tempfile.mkstemp(dir=home, prefix=".specforest-probe-")
    except OSError as e:
        raise click.BadParameter(
            f"cannot write {value}: {home} does not take new files ({e.strerror or e})", param_hint=option
        ) from None
    os.close(fd)
    os.unlink(probe)


def output_path(
    *suffixes: str, what: str, folder: bool = False, fresh: bool = False
) -> Callable[[click.Context, click.Parameter, "str | None"], "str | None"]:
    """A click callback checking an output option before any work: the name (a file's suffix, one of
    ``suffixes``; a folder's not ``.npz`` or ``.json``, the files a job writes beside its folder) and
    that the run can write it (:func:`check_output`). ``what`` says what is written there."""

    def check(ctx, param, value: "str | None") -> "str | None":
        if value is None:
            return value
        suffix = Path(value).suffix.lower()
        if suffixes and suffix not in suffixes:
            raise click.BadParameter(f"must end in {' or '.join(suffixes)} ({what}), got {value!r}")
        if folder and suffix in (".npz", ".json"):
            raise click.BadParameter(f"must be a folder ({what}), not an {suffix} file, got {value!r}")
        check_output(value, option=param.opts[0], folder=folder, fresh=fresh)
        return value

    return check


UNUSED_BY_STANDARD = ("draft", "prefetch", "verify", "lazy")
"""The options a standard run takes and does not use (its record holds them as null, as its coupling)."""


def as_ran(record: dict) -> dict:
    """A run's record as it ran: the standard sampler drafts nothing, so the draft's options it holds
    (:data:`UNUSED_BY_STANDARD`) are null, whatever the options said (a record's ``mode`` is ``full``
    and its ``coupling`` null already)."""
    if record.get("method") != "standard":
        return record
    return {k: None if k in UNUSED_BY_STANDARD else v for k, v in record.items()}


def refuse_unused(o: dict) -> None:
    """Refuse a tree option given on the command line that the run would not use: ``--tree`` or
    ``--budget`` with the standard sampler (``--method standard``, or a ``--tune`` file that chose it),
    and ``--budget`` with a tree other than ``--tree optimal`` or ``adaptive``.

    (The draft's options, ``--draft``, ``--prefetch``, ``--verify`` and ``--lazy``, are taken by the
    standard sampler as :func:`specforest.sample` takes them, and unused: :func:`as_ran` records them
    as not applied.) Call it with the options as the run will use them (after :func:`apply_tuned`).
    "Given" is click's parameter source, the command line or the environment, whatever the value.

    Raises:
        click.UsageError: naming those options and why they would not apply.
    """
    ctx = click.get_current_context()
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    given = [n for n in flags if is_given(ctx, n)]
    if o.get("method") == "standard":
        unused = [flags[n] for n in ("tree_mode", "budget") if n in given]
        if unused:
            raise click.UsageError(
                f"{'/'.join(unused)} apply only to speculative methods (rmc, dgrs, rank, antithetic): the "
                "standard sampler drafts no tree; leave them out"
            )
    if "budget" in given and o.get("tree_mode") not in ("optimal", "adaptive"):
        raise click.UsageError(
            "--budget applies only to --tree optimal or adaptive (the uniform tree's budget is set by --K and --L)"
        )
    # the library's own refusals of these name its keywords (tree='optimal'); a user gave flags
    mode, method = o.get("tree_mode"), o.get("method")
    if method == "standard":
        return
    if mode in ("optimal", "adaptive") and method == "antithetic":
        raise click.UsageError(
            f"--tree {mode} plans irregular trees of i.i.d. children; --method antithetic drafts K/2 mirrored pairs "
            "per node of a uniform tree: use --method dgrs, rank or rmc with it, or --tree uniform"
        )
    if mode in ("optimal", "adaptive") and o.get("budget") is None:
        raise click.UsageError(f"--tree {mode} needs --budget (drafted states per round, >= 1)")
    if mode == "uniform" and method == "antithetic" and o.get("K") is not None and o["K"] % 2:
        raise click.UsageError(f"--K must be even with --method antithetic (K/2 mirrored pairs per node), got {o['K']}")


def chain_given(name: str, params: dict) -> str:
    """A chain as the command line gives it: ``--chain ddim --eta 0.0``, with its parameters no flag sets
    in parentheses (``(s_tmin 0.0, s_tmax None)``)."""
    flags = [f"--chain {name}"]
    flags += [f"{CHAIN_FLAGS[p]} {v}" for p, v in params.items() if p in CHAIN_FLAGS and v is not None]
    other = [f"{p} {v}" for p, v in params.items() if p not in CHAIN_FLAGS and p != "churn"]
    return " ".join(flags) + (f" ({', '.join(other)})" if other else "")


def _listed(names: list) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def stochastic_settings() -> str:
    """The settings that give a chain noise, from the registered chains' declarations: ``--eta > 0`` with a
    chain that takes ``eta``, ``--s-churn > 0`` with one that takes ``s_churn``, and the chains that take
    neither (noisy at their defaults)."""
    eta, churn = chains_taking("eta"), chains_taking("s_churn")
    rest = [n for n in available_chains() if n not in eta and n not in churn]
    parts = [
        f"{flag} > 0 with --chain {_listed(names)}" for flag, names in (("--eta", eta), ("--s-churn", churn)) if names
    ]
    if rest:
        parts.append(f"--chain {_listed(rest)}")
    return f"({'; '.join(parts)})"


def no_stochastic_step(err: NoStochasticStep, where: str = "this grid", *, tune: "bool | None" = None) -> str:
    """The command line's words for the library's :class:`~specforest.options.NoStochasticStep` (whose own
    advice is Python's ``tree=None``), on ``where``; ``tune``: worded for ``specforest tune`` (``None``: when
    the current command is ``tune``)."""
    if tune is None:
        ctx = click.get_current_context(silent=True)
        tune = ctx is not None and ctx.command.name == "tune"
    head = (
        f"{chain_given(err.chain, err.params)} has no stochastic step on {where}: every transition is a point "
        "mass, so no draft can be accepted and a tree only costs calls"
    )
    settings = stochastic_settings()
    if tune:
        return (
            f"{head}; there is nothing to tune: run it with --method standard (no --tune file), or tune a "
            f"stochastic setting {settings}"
        )
    return f"{head}. Run it with --method standard, or give a stochastic setting {settings}"


def refuse_deterministic_chain(
    chain: Chain,
    steps: int,
    grid: str,
    *,
    speculative: bool = True,
    where: "str | None" = None,
    schedule: "dict | None" = None,
) -> None:
    """Refuse, before any work, a tree on a chain with no stochastic step on the run's grid: the named grid
    ``--grid`` of ``steps`` steps, or the ``--schedule`` (with ``--sigma-min``/``--sigma-max``) that the
    command's options ``schedule`` give (``speculative=False``: the standard sampler, which runs any
    chain). ``where`` names the grid in the message (default ``--grid GRID of --steps N``, or
    ``--schedule NAME of --steps N``).

    Raises:
        click.UsageError: naming ``--chain`` with its options, the grid and ``--method standard``.
    """
    if not speculative:
        return
    ranged = {k: (schedule or {}).get(k) for k in ("schedule", "sigma_min", "sigma_max")}
    if ranged["schedule"] is not None:
        grid_words = f"--schedule {ranged['schedule']} of --steps {steps}"
        sde = make_sde(steps, None, "flow_match", 1.0, None, chain, **ranged)
    else:
        grid_words = f"--grid {grid} of --steps {steps}"
        sde = make_sde(steps, None, grid, NAMED_GRID_SHIFT, None, chain)
    try:
        check_stochastic(sde, "")
    except NoStochasticStep as e:
        raise click.UsageError(no_stochastic_step(e, where or grid_words)) from None
