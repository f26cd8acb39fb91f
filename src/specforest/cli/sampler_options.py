"""The sampler's options on the command line, derived from their declaration.

Each field of :class:`~specforest.options.SamplerOptions` declares its flag, help, choices and whether the
command line exposes it (:class:`~specforest.options.Option`); :func:`sampler_option` makes the click option
of one from that, with the command's own default (``--verify drafted`` in ``gmm``, ``internal`` in ``pixel``).
The choices of a registry-backed option (``--draft``, ``--chain``) are the registry's when the command runs
(:class:`RegistryChoice`), so a registered plug-in is offered. :func:`extra_options` adds every exposed
option that no command places itself (:data:`PLACED`): a new field with ``cli=True`` reaches every command
that runs the sampler without another edit, and :func:`extra_values` hands its value on to the run
(:mod:`specforest.experiments.further_options`: each experiment passes it to every run it makes and records it).
The chains' own options (``--eta``, ``--s-noise``, ...: parameters of a chain, not fields) and the
chain of a command's options (:func:`run_chain`) are here too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import click
import torch

from ..chains import EM, PARAMETERS, Chain, available_chains, get_chain
from ..options import Option, declared_options, option_default
from ..schedules import SCHEDULE_SIGMA_RANGE, SCHEDULES, named_grid, schedule_grid

__all__ = [
    "CHAIN_FLAGS",
    "NAMED_GRID",
    "NAMED_GRID_SHIFT",
    "PLACED",
    "RegistryChoice",
    "chain_options",
    "chains_taking",
    "chain_settings",
    "check_grid",
    "check_named_grid",
    "churn_option",
    "draft_option",
    "extra_options",
    "grid_flags",
    "pipeline_extra_options",
    "extra_values",
    "grid_option",
    "is_given",
    "lazy_option",
    "prefetch_option",
    "run_chain",
    "sampler_option",
    "steps_option",
    "verify_option",
]

NAMED_GRID = option_default("grid")
"""The default of ``--grid``, which ``specforest tune`` tunes the mixture and the digits model on."""

NAMED_GRID_SHIFT = option_default("shift")
"""The timestep shift of the named grids (``--grid``) that the gmm and pixel commands run: the sampler's
default, which they have no option to change (``specforest tune`` records it; a ``--tune`` file must match)."""

PLACED = ("steps", "churn", "chain", "grid", "draft", "prefetch", "verify", "lazy")
"""The exposed options each command places itself (its own default, place in ``--help`` and use);
:func:`extra_options` adds the rest."""

_GIVEN = (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)

_UNSET: Any = object()


def is_given(ctx: click.Context, name: str) -> bool:
    """Whether the parameter ``name`` was given, on the command line or in the environment, whatever its value."""
    return ctx.get_parameter_source(name) in _GIVEN


class RegistryChoice(click.Choice):
    """A :class:`click.Choice` whose choices are a registry's when asked (``available_drafts()``), not when made."""

    def __init__(self, lister: Callable[[], Any]) -> None:
        self._lister = lister
        super().__init__(())

    @property
    def choices(self) -> tuple:  # type: ignore[override]
        return tuple(self._lister())

    @choices.setter
    def choices(self, value: Any) -> None:  # (click's __init__ sets them; the registry's are read instead)
        pass


def _decl(name: str) -> Option:
    return declared_options()[name]


def _type(decl: Option) -> Any:
    """The click type of a declared option (``None`` for an on flag)."""
    if decl.choices is not None:
        return RegistryChoice(decl.choices) if callable(decl.choices) else click.Choice(tuple(decl.choices))
    if decl.kind is int:
        return click.IntRange(decl.low, decl.high, min_open=decl.low_open)
    if decl.kind is float:
        return click.FloatRange(decl.low, decl.high, min_open=decl.low_open)
    return decl.kind or str


def sampler_option(name: str, *, default: Any = _UNSET, show_default: Any = True, help: "str | None" = None):
    """The click option of the sampler's option ``name`` as its field declares it: its flag, type (choices,
    range), help and default, each but the flag overridable by a command (its own default, a help
    worded for it)."""
    decl = _decl(name)
    default = option_default(name) if default is _UNSET else default
    if decl.kind is bool:
        return click.option(decl.flag, name, is_flag=True, default=default, help=help or decl.help)
    return click.option(
        decl.flag, name, type=_type(decl), default=default, show_default=show_default, help=help or decl.help
    )


def extra_options(f):
    """The options the command line exposes (``cli=True``) that no command places itself (:data:`PLACED`),
    each as :func:`sampler_option` makes it: a new field declared for the command line appears here, on
    every command that runs the sampler."""
    for name in reversed(extra_names()):
        f = sampler_option(name)(f)
    return f


def pipeline_extra_options(f):
    """:func:`extra_options` less those that make the grid (``Option.grid``: ``--schedule`` and its range),
    for the pipelines' commands, whose grid is their scheduler's."""
    for name in reversed(extra_names(pipeline=True)):
        f = sampler_option(name)(f)
    return f


def extra_names(pipeline: bool = False) -> "tuple[str, ...]":
    """The names :func:`extra_options` adds (``pipeline``: :func:`pipeline_extra_options`)."""
    return tuple(n for n, d in declared_options().items() if d.cli and n not in PLACED and not (pipeline and d.grid))


def grid_flags() -> "dict[str, str]":
    """The flags of the options that make the grid (``Option.grid``), by option name."""
    return {n: d.flag for n, d in declared_options().items() if d.cli and d.grid}


def extra_values(o: dict) -> dict:
    """The values of a command's :func:`extra_options` that differ from the option's default, by option name:
    the further options a command passes to its run (:mod:`specforest.experiments.further_options`).

    An option at its default is left to the sampler, which has the same default: a run's record, a
    ``generate`` job or an SD3 study made before the option existed is the same run, and resumes as it was."""
    return {n: o[n] for n in extra_names() if n in o and o[n] != option_default(n)}


def prefetch_option():
    """``--prefetch``: which evaluated node the next round drafts from after a rejection."""
    return sampler_option("prefetch")


def verify_option(default: str):
    """``--verify drafted|internal`` (``default``: the command's protocol)."""
    return sampler_option("verify", default=default)


def draft_option():
    """``--draft``: what the draft reads from the evaluations made before the round (the registered drafts,
    :func:`specforest.drafts.available_drafts`, as registered when the command runs)."""
    return sampler_option("draft")


def lazy_option(help: "str | None" = None):
    """``--lazy``: realize only the visited nodes (``help``: the command's wording)."""
    return sampler_option("lazy", help=help)


def steps_option(default: "int | None", shown: "str | None" = None, help: "str | None" = None):
    """``--steps``: grid steps ``T >= 3`` (``default=None`` with ``shown``: a default chosen later, so described)."""
    return sampler_option("steps", default=default, show_default=shown or True, help=help)


def churn_option(default: "float | None", shown: "str | None" = None, help: "str | None" = None):
    """``--churn``: the churn ``eps`` in (0, 1] (``default=None`` with ``shown``: chosen later, so described)."""
    return sampler_option("churn", default=default, show_default=shown or True, help=help)


def grid_option():
    """``--grid flow_match|uniform``: the time grid."""
    return sampler_option("grid")


def _chain_parameters() -> dict:
    """``{parameter: (its type, the chains that take it)}`` of the registered chains' declared parameters
    (their dataclass fields, :data:`specforest.chains.PARAMETERS`), in the order the chains list them."""
    out: dict = {}
    for name in available_chains():
        try:
            chain = get_chain(name)
        except (TypeError, ValueError):
            continue
        for field in dataclasses.fields(chain):
            out.setdefault(field.name, (type(getattr(chain, field.name)), []))[1].append(name)
    return out


CHAIN_FLAGS = {p: "--" + p.replace("_", "-") for p in _chain_parameters() if p != "churn"}
"""The chains' parameters the command line sets, by their flags: every parameter a registered chain declares
(its name with dashes; each chain takes some of them; ``--churn``, each command's own, is the ``em`` chain's)."""


def chains_taking(param: str) -> list:
    """The registered chains that declare the parameter ``param`` (e.g. ``"eta"``), in registration order."""
    return list(_chain_parameters().get(param, (None, []))[1])


def _chain_flags(name: str) -> list:
    """The flags of the command line that set the parameters of the registered chain ``name``."""
    try:
        params = get_chain(name).params
    except (TypeError, ValueError):
        return []
    return [("--churn" if p == "churn" else CHAIN_FLAGS[p]) for p in params if p == "churn" or p in CHAIN_FLAGS]


def chain_options(f=None, *, extra: tuple = ()):
    """``--chain`` (the registered chains, :func:`specforest.chains.available_chains`, offered as registered when
    the command runs) and the chains' own
    options, one for each parameter a registered chain declares (:data:`CHAIN_FLAGS`: ``--eta``,
    ``--s-noise``, ``--s-tmin``, ``--path``, ...), all unset by default: :func:`run_chain` makes the chain of a command's options. ``chain_options(extra=(...))``
    offers more ``--chain`` values (``scheduler`` on a pipeline command: its own scheduler's chain)."""
    if f is None:
        return lambda g: chain_options(g, extra=extra)
    chains = available_chains()
    listed = "; ".join(f"{n}: {', '.join(fl)}" if (fl := _chain_flags(n)) else n for n in chains)
    help_ = _decl("chain").help.replace("{chains}", listed)
    if extra:
        chain_opt = click.option(
            _decl("chain").flag,
            "chain",
            type=RegistryChoice(lambda: (*available_chains(), *extra)),
            default=None,
            show_default="em",
            help=help_
            + " scheduler: the pipeline's own stochastic scheduler, as its step computes it (with --eta its step's eta).",
        )
    else:
        chain_opt = sampler_option("chain", default=None, show_default="em", help=help_)
    opts = [chain_opt]
    declared = _chain_parameters()
    for param, flag in CHAIN_FLAGS.items():
        kind, takers = declared[param]
        described = PARAMETERS.get(param, f"The chain's {param}.")
        opts.append(
            click.option(
                flag,
                param,
                type=kind,
                default=None,
                show_default="the chain's",
                help=f"{described} Chains: {', '.join(takers)}.",
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
        click.UsageError: naming ``--chain`` and the grid, and ``--schedule``, which gives such a chain a grid.
    """
    try:
        sigmas = named_grid(grid, steps, shift=NAMED_GRID_SHIFT).to(torch.float64)
    except ValueError as e:
        raise click.UsageError(
            f"--chain {chain.name} does not run on {where or f'--grid {grid}'}, which starts at t = 1 "
            f"(sigma = inf): {e}"
        ) from None
    try:
        chain.build(sigmas)
    except ValueError as e:
        # a linear-path chain refuses t = 1 for its own reason (dpmpp_sde's half-log-SNR there), which it names
        why = (
            f"({e})"
            if getattr(chain, "path", "ve") == "linear"
            else "where a sampler on VE noise levels is not defined"
        )
        raise click.UsageError(
            f"--chain {chain.name} does not run on {where or f'--grid {grid}'}, which starts at t = 1 "
            f"(sigma = inf), {why}: give a noise schedule, "
            f"--schedule {'|'.join(SCHEDULES)} (with --sigma-min/--sigma-max for karras and exponential)"
        ) from None


def _set(flags: list) -> str:
    return "sets" if len(flags) == 1 else "set"


def _range_flags(o: dict) -> list:
    return [
        flag for name, flag in (("sigma_min", "--sigma-min"), ("sigma_max", "--sigma-max")) if o.get(name) is not None
    ]


def check_grid(chain: Chain, o: dict, grid: "str | None" = None, where: "str | None" = None) -> None:
    """Refuse the grid of a command's options ``o`` where its run could not have it, in flags: ``--schedule``
    beside ``--grid``, ``--sigma-min``/``--sigma-max`` without a schedule that takes them or out of order,
    a chain that is not defined on the named grid (:func:`check_named_grid`). ``grid``: the named grid the
    command runs when it has no ``--grid`` (``specforest tune``), named by ``where``.

    Raises:
        click.UsageError / click.BadParameter: naming the flags, before anything is loaded or written.
    """
    schedule = o.get("schedule")
    ranged = _range_flags(o)
    if schedule is None:
        if ranged:
            raise click.UsageError(
                f"{' and '.join(ranged)} {_set(ranged)} the range of --schedule {' or '.join(SCHEDULE_SIGMA_RANGE)}; "
                "give --schedule, or leave them out"
            )
        check_named_grid(chain, o["steps"], o["grid"] if grid is None else grid, where)
        return
    if grid is None and is_given(click.get_current_context(), "grid"):
        raise click.UsageError(f"--grid {o['grid']} and --schedule {schedule} both choose the grid: give one of them")
    if schedule not in SCHEDULE_SIGMA_RANGE:
        if ranged:
            raise click.UsageError(
                f"{' and '.join(ranged)} {_set(ranged)} the range of --schedule {' or '.join(SCHEDULE_SIGMA_RANGE)}; "
                f"--schedule {schedule} has its own levels: leave {'them' if len(ranged) > 1 else 'it'} out"
            )
    else:
        lo_default, hi_default = SCHEDULE_SIGMA_RANGE[schedule]
        lo = lo_default if o.get("sigma_min") is None else o["sigma_min"]
        hi = hi_default if o.get("sigma_max") is None else o["sigma_max"]
        if not hi > lo:
            lo_said = f"{lo:g}" if o.get("sigma_min") is not None else f"{lo:g}, its default"
            raise click.BadParameter(f"must be > --sigma-min ({lo_said}), got {hi:g}", param_hint="--sigma-max")
    try:
        chain.build(schedule_grid(schedule, o["steps"], o.get("sigma_min"), o.get("sigma_max")))
    except ValueError as e:
        raise click.UsageError(f"--chain {chain.name} does not run on --schedule {schedule}: {e}") from None


def chain_settings(chain: Chain) -> dict:
    """What a run's record and a tuned file hold of its chain: ``churn`` (``None`` with another chain than
    em), ``chain`` (its name) and ``chain_params`` (its parameters, a non-finite one as ``null``)."""
    from ..experiments.common import json_params

    return {
        "churn": chain.churn if isinstance(chain, EM) else None,
        "chain": chain.name,
        "chain_params": json_params(chain.params),
    }
