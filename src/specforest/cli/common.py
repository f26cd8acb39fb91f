"""What every command shares: one error policy, one definition of each shared option.

:func:`library_errors` is the CLI's only error policy: the library's errors on
bad input, memory, missing files or optional packages and non-finite network
outputs become a one-line ``Error: ...`` and exit status 1, never a traceback.
Options that several commands take (``--prefetch``, ``--verify``, ``--draft``,
``--tree``/``--budget``, ``--chain`` with the chains' own options) and the comma-list parsers are
defined here once, as are the
checks every command makes before its work: each output path can be written
(:func:`output_path`), a tree option given that the run would not use is refused
(:func:`refuse_unused`; the draft's options of a standard run are recorded as not applied,
:func:`as_ran`), the chain's options are those of the chain chosen (:func:`run_chain`), and a
``--tune`` file is read whole and checked field by field (:func:`read_tuned`, :func:`apply_tuned`).
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, TypeVar

import click
import torch

from ..chains import EM, Chain, available_chains, get_chain
from ..devices import set_threads
from ..planning import TREE_MODES
from ..proposals import DRAFT_KINDS, MODEL_DRAFTS, PICARD_DRAFTS
from ..sampler import GRIDS, PREFETCH_POLICIES
from ..trees import VERIFY_MODES
from ..validation import check_choice, check_int, check_number, is_int

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
    "chain_options",
    "chain_settings",
    "check_named_grid",
    "check_output",
    "choice_list",
    "churn_option",
    "compile_option",
    "draft_option",
    "float_list",
    "grid_option",
    "int_list",
    "is_given",
    "json_option",
    "library_errors",
    "method_option",
    "output_path",
    "prefetch_option",
    "progress_option",
    "read_tuned",
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
]

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
"""Click context settings of every command."""

CHURN = click.FloatRange(0.0, 1.0, min_open=True)
"""The churn ``eps`` in (0, 1]."""

POSITIVE = click.FloatRange(0.0, min_open=True)
"""A number > 0."""

MAX_THREADS = 1024
"""Most CPU threads ``--threads`` takes."""

LIBRARY_ERRORS = (ValueError, TypeError, MemoryError, NotImplementedError, OSError, ImportError, FloatingPointError)
"""What the library raises on bad input or an unusable environment (``OSError``
covers missing files); anything else is a bug and keeps its traceback."""

T = TypeVar("T")


def library_errors(fn: Callable[[], T]) -> T:
    """Run ``fn()`` and turn the library's errors (:data:`LIBRARY_ERRORS`) into clean CLI errors."""
    try:
        return fn()
    except LIBRARY_ERRORS as e:
        raise click.ClickException(str(e)) from e


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


def prefetch_option():
    """``--prefetch``: which evaluated node the next round drafts from after a rejection."""
    return click.option(
        "--prefetch",
        type=click.Choice(PREFETCH_POLICIES),
        default="nearest",
        show_default=True,
        help="Which evaluated node the next round drafts from after a rejection (ERRATA 9).",
    )


def verify_option(default: str):
    """``--verify drafted|internal`` (``default``: the command's protocol)."""
    return click.option(
        "--verify",
        type=click.Choice(VERIFY_MODES),
        default=default,
        show_default=True,
        help="Evaluate every drafted node (drafted: the paper's protocol, B = |V|) or only "
        "the root and internal nodes (internal: fewer states per call, same NFE or more).",
    )


def draft_option():
    """``--draft``: what the draft reads from the evaluations made before the round."""
    return click.option(
        "--draft",
        type=click.Choice((*DRAFT_KINDS, *PICARD_DRAFTS, *MODEL_DRAFTS)),
        default="velocity",
        show_default=True,
        help="What the draft reads from the evaluations made before the round: the prefetched "
        "velocity (the paper's protocol), the whole drift (App. C.1), the clean-data prediction x0, "
        "the noise prediction eps, x0 extrapolated in time (x0_extrap), the previous round's x0 at "
        "each drafted step (memory; the run goes full), that one moved to the drafted state by a fitted "
        "gain (secant), auto (chosen online among those per draft offset and half of the grid), picard / "
        "picard2 (the x0 chain refined by 1 / 2 Picard sweeps, each one more target call a round), learned "
        "(the digits model's distilled draft network anchored at those evaluations; digits only), or cached "
        "(the target's own outer blocks with its deep features from the previous round's node at that step, "
        "DeepCache-style; a model that keeps them: digits, the mixture); the exactly known rest is "
        "recomputed at each drafted state.",
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


def steps_option(default: "int | None", shown: "str | None" = None):
    """``--steps``: grid steps ``T >= 3`` (``default=None`` with ``shown``: a default chosen later, so described)."""
    return click.option(
        "--steps",
        type=click.IntRange(3),
        default=default,
        show_default=shown or True,
        help="Grid steps T (>= 3; the first and last are deterministic Euler steps).",
    )


def churn_option(default: "float | None", shown: "str | None" = None):
    """``--churn``: the churn ``eps`` in (0, 1] (``default=None`` with ``shown``: chosen later, so described)."""
    return click.option(
        "--churn",
        type=CHURN,
        default=default,
        show_default=shown or True,
        help="Churn eps in (0, 1] of the em chain, the default --chain (0 would make speculation accept nothing).",
    )


CHAIN_FLAGS = {"eta": "--eta", "s_noise": "--s-noise", "s_churn": "--s-churn", "solver_type": "--solver-type"}
"""The chains' parameters the command line sets, by their flags (each chain takes some of them; ``--churn``
is the ``em`` chain's)."""

_CHAIN_HELP = {
    "eta": "The chain's eta: the share of the ancestral noise, >= 0 (0: no noise, no speculation).",
    "s_noise": "The chain's s_noise: the scale of the noise it adds, > 0.",
    "s_churn": "The chain's s_churn: EDM's churn, >= 0 (0: no noise, no speculation).",
    "solver_type": "The chain's solver_type (DPM++ 2M SDE's second-order step: midpoint or heun).",
}


def _chain_flags(name: str) -> list:
    """The flags of the command line that set the parameters of the registered chain ``name``."""
    try:
        params = get_chain(name).params
    except (TypeError, ValueError):
        return []
    return [("--churn" if p == "churn" else CHAIN_FLAGS[p]) for p in params if p == "churn" or p in CHAIN_FLAGS]


def _takers(param: str) -> str:
    """The registered chains that take ``param``, for its flag's help."""
    return ", ".join(n for n in available_chains() if CHAIN_FLAGS[param] in _chain_flags(n))


def chain_options(f):
    """``--chain`` (the registered chains, :func:`specforest.chains.available_chains`) and the chains' own
    options ``--eta``, ``--s-noise``, ``--s-churn``, ``--solver-type`` (:data:`CHAIN_FLAGS`), all unset by
    default: :func:`run_chain` makes the chain of a command's options."""
    chains = available_chains()
    listed = "; ".join(f"{n}: {', '.join(fl)}" if (fl := _chain_flags(n)) else n for n in chains)
    opts = [
        click.option(
            "--chain",
            type=click.Choice(chains),
            default=None,
            show_default="em",
            help="The stochastic sampler whose chain the run speculates exactly (docs/chains.md): em is the paper's "
            "Euler-Maruyama step with --churn. Each chain takes its own options, its defaults where not given: "
            f"{listed}. An option the chain does not take is an error.",
        ),
    ]
    for param, flag in CHAIN_FLAGS.items():
        opts.append(
            click.option(
                flag,
                param,
                type=str if param == "solver_type" else float,
                default=None,
                show_default="the chain's",
                help=f"{_CHAIN_HELP[param]} Chains: {_takers(param)}.",
            )
        )
    for opt in reversed(opts):
        f = opt(f)
    return f


def run_chain(o: dict, ctx: "click.Context | None" = None) -> Chain:
    """The chain of a command's options ``o``: ``--chain`` (``em`` when not given) with the chain options
    set (``--churn`` for the em chain, whose churn ``o["churn"]`` must be known by then).

    Raises:
        click.UsageError: naming each chain option given (or ``--churn`` with another chain than em) that the
            chain does not take, the chain, and its parameters.
        click.BadParameter: a value the chain refuses, with the library's message, naming the flag.
    """
    ctx = ctx or click.get_current_context()
    name = o.get("chain") or "em"
    chain = get_chain(name)
    params = list(chain.params)
    settable = {**({"churn": "--churn"} if "churn" in o else {}), **{p: f for p, f in CHAIN_FLAGS.items() if p in o}}
    wrong = [flag for p, flag in settable.items() if p not in params and is_given(ctx, p)]
    if wrong:
        verb = "is not a parameter" if len(wrong) == 1 else "are not parameters"
        raise click.UsageError(
            f"{', '.join(wrong)} {verb} of chain {chain.name!r}; its parameters: {', '.join(params)}"
        )
    for p in params:
        value = o.get(p) if p in settable else None
        if value is None:
            if isinstance(chain, EM):
                raise click.UsageError("the em chain needs --churn")  # (every command sets its default first)
            continue
        try:
            chain = chain.replace(**{p: value})
        except (TypeError, ValueError) as e:
            raise click.BadParameter(str(e), param_hint=settable[p]) from None
    return chain


def check_named_grid(chain: Chain, steps: int, grid: str, where: "str | None" = None) -> None:
    """Refuse a chain that is not defined on the named grid ``--grid`` of ``steps`` steps (the samplers
    on VE noise levels whose first step needs a finite level: the named grids start at t = 1).
    ``where`` names the grid in the message (default ``--grid GRID``).

    Raises:
        click.UsageError: naming ``--chain`` and the grid, with the library's reason.
    """
    from ..sde import flow_match_grid, uniform_grid

    make = flow_match_grid if grid == "flow_match" else uniform_grid
    try:
        chain.build(make(steps, shift=NAMED_GRID_SHIFT).to(torch.float64))
    except ValueError as e:
        raise click.UsageError(
            f"--chain {chain.name} does not run on {where or f'--grid {grid}'}, which starts at t = 1 "
            f"(sigma = inf): {e}"
        ) from None


def chain_settings(chain: Chain) -> dict:
    """What a run's record and a tuned file hold of its chain: ``churn`` (``None`` with another chain than
    em), ``chain`` (its name) and ``chain_params`` (its parameters, a non-finite one as ``null``)."""
    from ..experiments.common import json_params

    return {
        "churn": chain.churn if isinstance(chain, EM) else None,
        "chain": chain.name,
        "chain_params": json_params(chain.params),
    }


def seed_option(what: str):
    """``--seed >= 0``; ``what`` says what it seeds."""
    return click.option("--seed", type=click.IntRange(0), default=0, show_default=True, help=f"Seed (>= 0) of {what}.")


def json_option():
    """``--json``: one JSON object on stdout and nothing else."""
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout and nothing else.")


def progress_option(what: str = "Progress bar on stderr."):
    """``--progress/--no-progress`` (on by default)."""
    return click.option("--progress/--no-progress", default=True, show_default=True, help=what)


NAMED_GRID = "flow_match"
"""The default of ``--grid``, which ``specforest tune`` tunes the mixture and the digits model on."""


def grid_option():
    """``--grid flow_match|uniform``: the time grid."""
    return click.option(
        "--grid",
        type=click.Choice(GRIDS),
        default=NAMED_GRID,
        show_default=True,
        help="Time grid: flow_match (diffusers' FlowMatchEulerDiscreteScheduler grid, the authors' code) or uniform.",
    )


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


MODEL_DEFAULTS = {
    "gmm": {"steps": 30, "churn": 0.1},
    "digits": {"steps": 100, "churn": 0.3},
    "sd3": {"steps": 50, "churn": 0.8},
}
"""Grid steps and churn of each model's commands (``gmm``; ``pixel`` for ``digits``; ``sd3``; their
``generate`` forms), which ``specforest tune --model M`` tunes at by default."""


NAMED_GRID_SHIFT = 1.0
"""The timestep shift of the named grids (``--grid``) that the gmm and pixel commands run: the sampler's
default, which they have no option to change (``specforest tune`` records it; a ``--tune`` file must match)."""


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


def is_given(ctx: click.Context, name: str) -> bool:
    """Whether the parameter ``name`` was given, on the command line or in the environment, whatever its value."""
    return ctx.get_parameter_source(name) in _GIVEN


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


def tune_option(
    help: str = "A JSON written by 'specforest tune': its tree, coupling, verification mode, draft and prefetch "
    "replace --method/--K/--L/--tree/--budget/--draft/--verify/--prefetch (giving any of them is an error). "
    "--steps, --churn, --chain with its options and the batch default to the file's; given, they must match it, "
    "as must the model, the device and --threads (an error lists every difference).",
):
    """``--tune tuned.json``: run the configuration ``specforest tune`` chose."""
    return click.option("--tune", "tune_file", type=click.Path(exists=True, dir_okay=False), default=None, help=help)


_METHOD_OF = {"grs": "dgrs", "rank": "rank", "antithetic": "antithetic"}

SAMPLER_PARAMS = ("method", "K", "L", "tree_mode", "budget", "draft", "verify", "prefetch")
"""The parameters of the sampler options a ``--tune`` file replaces."""

_GIVEN = (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)

_RUN_KEYS = ("steps", "churn", "batch", "device", "threads", "grid", "shift", "sigmas")
"""What a tuned run records of itself, in the order its differences are listed (the model comes first)."""


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


def _sigmas(name: str, value: Any) -> list:
    if not isinstance(value, list):
        raise TypeError(f"{name} must be a list of T + 1 >= 2 noise levels, got {type(value).__name__}")
    if len(value) < 2:
        raise ValueError(f"{name} must be a list of T + 1 >= 2 noise levels, got {value!r}")
    return [check_number(f"{name}[{i}]", v, 0.0, 1.0) for i, v in enumerate(value)]


def _params(name: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be an object of the chain's parameters, got {type(value).__name__}")
    return value


_TUNED_FOR: "dict[str, Callable[[str, Any], Any]]" = {
    "model": lambda k, v: check_choice(k, v, ("gmm", "digits", "sd3", "diffusers")),
    "family": _text,
    "steps": lambda k, v: check_int(k, v, 1),
    "churn": lambda k, v: check_number(k, v, 0.0, 1.0, lo_open=True),
    "batch": lambda k, v: check_int(k, v, 1),
    "device": _text,
    "threads": lambda k, v: check_int(k, v, 1, MAX_THREADS),
    "grid": lambda k, v: check_choice(k, v, GRIDS),
    "shift": lambda k, v: check_number(k, v, 0.0, lo_open=True),
    "sigmas": _sigmas,
    "dim": lambda k, v: check_int(k, v, 1),
    "components": lambda k, v: check_int(k, v, 1),
    "guidance": lambda k, v: check_number(k, v, 0.0),
    "true_cfg_scale": lambda k, v: check_number(k, v, 0.0),
    "negative_prompt": _text,
    "height": lambda k, v: check_int(k, v, 1),
    "width": lambda k, v: check_int(k, v, 1),
    "max_sequence_length": lambda k, v: check_int(k, v, 1, 512),
    "chain": lambda k, v: check_choice(k, v, tuple(available_chains())),
    "chain_params": lambda k, v: _params(k, v),
}
"""Each key a ``tuned_for`` may record (``null``: not recorded) and its check, named by the key."""


def read_tuned(path: str) -> "tuple[Any, dict]":
    """The :class:`~specforest.latency.Tuned` of a file ``specforest tune`` wrote, and the run it was tuned
    for: the file's ``tuned_for`` with its steps, batch, churn (``None`` where not recorded), chain and
    chain_params (the em chain in a file written before chains were kept).

    Every field is checked before anything runs: the configuration's by
    :meth:`~specforest.latency.Tuned.from_json`, each key of ``tuned_for`` by :data:`_TUNED_FOR`.

    Raises:
        click.ClickException: if the file cannot be read, or a field is missing, unknown or out of
            range (naming the field and what it accepts).
    """
    import json

    from ..latency import Tuned

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise click.ClickException(f"--tune {path}: cannot read it ({e})") from e
    try:
        data = json.loads(text)
    except ValueError as e:
        raise click.ClickException(f"--tune {path}: not a JSON file written by 'specforest tune' ({e})") from e
    try:
        tuned = Tuned.from_json(data)
        made_for = data.get("tuned_for")
        if made_for is None:
            made_for = {}
        if not isinstance(made_for, dict):
            raise TypeError(f"tuned_for must be an object (the run it was tuned for), got {type(made_for).__name__}")
        unknown = sorted(str(k) for k in made_for if k not in _TUNED_FOR)
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(unknown)} in tuned_for; it records {', '.join(_TUNED_FOR)}")
        for key, value in made_for.items():
            if value is not None:
                _TUNED_FOR[key](f"tuned_for.{key}", value)
    except (ValueError, TypeError) as e:
        raise click.ClickException(f"--tune {path}: {e}") from e
    made_for = dict(made_for)
    made_for.update(steps=tuned.steps, batch=tuned.batch, chain=tuned.chain, chain_params=tuned.chain_params)
    if tuned.churn is not None or tuned.chain != "em":
        made_for["churn"] = tuned.churn  # (None with another chain than em: it has no churn)
    return tuned, made_for


def _shown(value: Any) -> str:
    """A file's value in a message, a long one (a grid's sigmas) cut short."""
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _adopt(ctx: click.Context, param: click.Parameter, key: str, value: Any, path: str) -> Any:
    """A ``tuned_for`` value taken for a parameter the command line did not give, checked as if given:
    its type exactly (no float taken for an int) and the option's range.

    Raises:
        click.UsageError: naming the key and the option.
    """
    kind = param.type
    wrong = (
        (isinstance(kind, click.types.IntParamType) and not is_int(value))
        or (
            isinstance(kind, click.types.FloatParamType)
            and (isinstance(value, bool) or not isinstance(value, (int, float)))
        )
        or (isinstance(kind, click.Choice) and not isinstance(value, str))
    )
    try:
        if wrong:
            raise click.BadParameter(f"{value!r} is not a {kind.name}")
        return param.type_cast_value(ctx, value)
    except click.BadParameter as e:
        raise click.UsageError(
            f"--tune {path}: the file's {key} is not a value of {param.opts[0]}: {e.format_message()}"
        ) from None


def _differs(key: str, here: Any, there: Any) -> bool:
    if key == "device":
        # cuda:1 runs on the kind of device tuned for; the file records cpu or cuda
        return str(here).split(":")[0] != str(there).split(":")[0]
    if isinstance(here, (int, float)) and isinstance(there, (int, float)):
        return not math.isclose(float(here), float(there), rel_tol=1e-9, abs_tol=1e-12)
    return here != there


def _chain_differs(ctx: click.Context, o: dict, made_for: dict, params: dict, path: str) -> list:
    """The chain of a ``--tune`` file against the command's: ``--chain`` and each chain option not given take
    the file's (checked as the option checks it); given, they must match it. A command without ``--chain``
    runs the em chain only. Returns the differences, each naming the chain."""
    name = made_for.get("chain") or "em"
    there = made_for.get("chain_params") or {}
    if "chain" not in params:
        return [] if name == "em" else [f"chain em here (this command's only one), {name} in the file"]
    if not is_given(ctx, "chain"):
        o["chain"] = name
    elif o["chain"] != name:
        return [f"--chain {o['chain']} here, {name} in the file"]
    defaults = get_chain(name).params
    diffs = []
    for p, value in there.items():
        if p == "churn" or value is None:
            continue  # the em chain's churn is a key of its own; null: the parameter's default (not finite)
        if p in CHAIN_FLAGS and p in params:
            if not is_given(ctx, p):
                o[p] = _adopt(ctx, params[p], f"chain_params.{p}", value, path)
            elif _differs(p, o[p], value):
                diffs.append(f"{CHAIN_FLAGS[p]} {o[p]} here, {value} in the file (chain {name})")
        elif p in defaults and _differs(p, defaults[p], value):
            diffs.append(f"chain {name}'s {p} {defaults[p]} here (no option sets it), {value} in the file")
    return diffs


def apply_tuned(
    o: dict,
    model: str,
    *,
    run: "dict[str, str] | None" = None,
    fixed: "dict[str, Any] | None" = None,
    sampler: bool = True,
) -> "tuple[dict, Any]":
    """Reconcile a command's options ``o`` with its ``--tune`` file (``o["tune_file"]``), tuned for ``model``.

    The one place every command with ``--tune`` goes through. The file's sampler options
    (tree, coupling, verify, draft, prefetch) replace the command's (:data:`SAMPLER_PARAMS`),
    which must not be given on the command line. Each key of the tuned run (``steps``, ``churn``, ``batch``,
    ``device``, ``threads``, ``grid``, ``shift``, ``sigmas``, ... as the file records them) that ``run``
    maps to a parameter of the command takes the file's value where that parameter was not given
    (checked as the option checks it), and must match it where it was, as do ``--chain`` and each chain
    option (a command without ``--chain`` runs only the em chain); ``fixed`` holds the
    command's values of keys it has no option for (``device="cpu"``, ``shift=1.0``; ``sigmas``:
    none, as no command runs an explicit grid). "Given" is click's parameter source: the
    command line or the environment, whatever the value.

    Args:
        o: the command's parameters (click's names).
        model: what ``specforest tune --model`` calls the command's model.
        run: file key -> parameter name, beyond those of :data:`_RUN_KEYS` (which map to themselves
            when the command has them), e.g. ``{"batch": "samples"}``.
        fixed: file key -> this command's value, for keys without an option.
        sampler: replace the command's sampler options (``False``: the command runs the file's
            configuration beside its own, as ``specforest sd3`` does, and keeps its options).

    Returns:
        ``(o, tuned)``: the options with the file's in place and the
        :class:`~specforest.latency.Tuned`; ``(o, None)`` without ``--tune``.

    Raises:
        click.UsageError: naming every sampler option given beside ``--tune`` and every
            difference between this run and the file's (model, steps, churn, batch, device,
            threads, grid, shift, chain and its parameters, ...), a file's value that its option would refuse, or a
            coupling no ``--method`` runs.
        click.ClickException: if the file cannot be read, or a field of it is wrong (:func:`read_tuned`).
    """
    path = o.get("tune_file")
    if not path:
        return o, None
    ctx = click.get_current_context()
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    given = lambda name: is_given(ctx, name)  # noqa: E731
    refused = [flags[n] for n in SAMPLER_PARAMS if sampler and n in flags and given(n)]
    tuned, made_for = read_tuned(path)
    o = dict(o)
    diffs = []
    if made_for.get("model") not in (None, model):
        diffs.append(f"--model {model} here, {made_for['model']} in the file")
    params = {p.name: p for p in ctx.command.params}
    names = {k: k for k in _RUN_KEYS if k in flags}
    names.update(run or {})
    fixed = {"sigmas": None, **(fixed or {})}
    rank = lambda k: _RUN_KEYS.index(k) if k in _RUN_KEYS else len(_RUN_KEYS)  # noqa: E731
    for key in sorted({*names, *fixed}, key=lambda k: (rank(k), k)):
        there = made_for.get(key)
        if there is None:
            continue
        if key in fixed:
            if _differs(key, fixed[key], there):
                diffs.append(f"{key} {fixed[key]} here (this command's only one), {_shown(there)} in the file")
            continue
        name = names[key]
        if not given(name):
            o[name] = _adopt(ctx, params[name], key, there, path)
        elif _differs(key, o[name], there):
            diffs.append(f"{flags[name]} {o[name]} here, {there} in the file")
    diffs += _chain_differs(ctx, o, made_for, params, path)
    problems = []
    if refused:
        problems.append(
            f"{', '.join(refused)} cannot be given with --tune: the file sets the sampler "
            f"({tuned.label}); leave {'it' if len(refused) == 1 else 'them'} out, or run without --tune"
        )
    if diffs:
        problems.append(
            f"--tune {path} was tuned for another run: {'; '.join(diffs)}. Leave those options out to take "
            "the file's values, or tune again for this run"
        )
    if problems:
        raise click.UsageError(". ".join(problems))
    if not sampler:
        return o, tuned
    o.update(verify=tuned.verify, draft=tuned.draft, prefetch=tuned.prefetch, tree_mode="uniform", budget=None)
    if tuned.tree is None:
        o.update(method="standard")
    elif tuned.coupling == "rmc":
        # (a chain: Tuned.from_json refuses an rmc tree with a node of two children)
        o.update(method="rmc", K=1, L=tuned.tree.budget)
    elif tuned.coupling in _METHOD_OF:
        o.update(method=_METHOD_OF[tuned.coupling], tree_mode=tuned.tree)
    else:
        raise click.UsageError(
            f"--tune {path}: coupling {tuned.coupling!r} is registered here but no --method runs it "
            f"(the command line runs rmc, {', '.join(_METHOD_OF)}); run it with specforest.sample(model, x, **tuned)"
        )
    return o, tuned
