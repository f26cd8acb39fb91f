"""The sampler's options: one frozen, validated record, :class:`SamplerOptions`, taken by every entry point.

:func:`specforest.sample`, :func:`specforest.generate`, :func:`specforest.latency.tune`,
the diffusers pipelines and the CLI all take the same options; this module is their
one list (a new option is a new field here) and the one place they are checked.
Each field declares, once, what the other places need of it (:class:`Option`, made by :func:`option`):
its command-line flag, help, choices (a registry's ``available_*`` for the registry-backed ones, read when
asked), the key of run records and tuned files, whether the command line exposes it, and how
:func:`specforest.latency.tune` treats it; :func:`declared_options` reads them back.
The inputs of a single run (``generator``, ``seed``, ``sample_index``, ``callback``,
``progress``, ``cond``, ``process_group``, ``tuned_for``: :data:`RUN_INPUTS`) are not
options: they are the arguments of the call that runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .chains import EM, Chain, available_chains, get_chain
from .couplings import Coupling, available_couplings, get_coupling
from .drafts import Proposal, available_drafts, get_proposal
from .engine import PREFETCH_POLICIES
from .schedules import GRIDS, MAX_STEPS, SCHEDULE_SIGMA_RANGE, SCHEDULES, named_grid, schedule_grid
from .sde import GaussianChain
from .trees import VERIFY_MODES, DraftTree, TreePolicy
from .validation import check_choice, check_int

__all__ = [
    "GRIDS",
    "RUN_INPUTS",
    "NoStochasticStep",
    "Option",
    "SamplerOptions",
    "TunedFor",
    "check_option",
    "check_stochastic",
    "check_tuned_for",
    "declared_options",
    "make_sde",
    "option",
    "options_sde",
    "pad_sizes",
    "resolve",
]


RUN_INPUTS = (
    "generator",
    "seed",
    "sample_index",
    "callback",
    "progress",
    "cond",
    "process_group",
    "tuned_for",
    "noise",
)
"""The keyword arguments of :func:`specforest.sample` that are a run's inputs, not options."""


TUNE_ROLES = ("tuner", "constraint", "passed", "refused")
"""How :func:`specforest.latency.tune` treats an option: its own parameter, a constraint on the search,
passed to every run it makes, or refused (with :attr:`Option.refused` saying why)."""


@dataclass(frozen=True)
class Option:
    """What every place beside the sampler needs of one option, declared once on its field (:func:`option`).

    Attributes:
        help: the command line's help of its flag.
        flag: the flag (default ``--`` and the name, ``_`` as ``-``).
        choices: the names it takes: a tuple, or a registry's lister (``available_drafts``), called each
            time the choices are asked for (:meth:`allowed`), so a registered plug-in is offered.
        key: its key in run records and tuned files (default: the name).
        cli: whether the command line exposes it as its flag (``False``: a command sets it otherwise,
            or not at all).
        kind: the flag's value type: ``int``, ``float``, ``str`` or ``bool`` (an on flag); with
            ``choices``, a name.
        low, high, low_open: the flag's range (``low_open``: ``low`` excluded).
        tune: how :func:`specforest.latency.tune` treats it (:data:`TUNE_ROLES`).
        refused: why ``tune`` refuses it (``tune="refused"``).
        grid: whether it makes the run's grid (``--schedule`` and its range): a pipeline's run, whose grid
            is its scheduler's, sets it itself, so the pipelines' commands do not offer it.
        name: the field's name (filled in by :func:`declared_options`).
    """

    help: str = ""
    flag: Optional[str] = None
    choices: "Sequence[str] | Callable[[], Sequence[str]] | None" = None
    key: Optional[str] = None
    cli: bool = True
    kind: Optional[type] = None
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    tune: str = "passed"
    refused: str = ""
    grid: bool = False
    name: str = ""

    def allowed(self) -> "Optional[tuple[str, ...]]":
        """The choices now (a registry's as registered now), or ``None`` for an option without them."""
        if self.choices is None:
            return None
        return tuple(self.choices() if callable(self.choices) else self.choices)


class NoStochasticStep(ValueError):
    """A tree asked of a chain whose every step on the run's grid is a point mass: no draft can be accepted.

    Attributes:
        chain: the chain's name.
        params: its parameters (``{"eta": 0.0}``), for a caller that words the refusal in its own terms
            (the command line names its flags).
    """

    def __init__(self, message: str, chain: str, params: dict) -> None:
        super().__init__(message)
        self.chain, self.params = chain, dict(params)


def check_stochastic(sde: GaussianChain, remedy: str) -> None:
    """Refuse speculation on a chain with no stochastic step on its grid (the em chain's first and last
    steps are deterministic by construction: a grid of one or two steps has none, and has always run as
    the standard sampler whatever the tree).

    Args:
        sde: the chain's tables on the run's grid.
        remedy: what to do instead, in the caller's words.

    Raises:
        NoStochasticStep: naming the chain, its parameters and the stochastic settings.
    """
    if sde.name != "em" and not bool(sde.stochastic.any()):
        raise NoStochasticStep(
            f"chain {sde.name!r} with {sde.params} has no stochastic step on this grid: every transition is a "
            f"point mass, so no draft can be accepted and a tree only costs calls. {remedy}, or pick a stochastic "
            "setting (euler_ancestral, dpmpp_2m_sde, dpmpp_3m_sde or ddim with eta > 0, euler or heun with s_churn > 0, em, ddpm, lcm)",
            sde.name,
            sde.params,
        )


def option(default: Any, **declared: Any) -> Any:
    """A field of :class:`SamplerOptions` with its default and its :class:`Option` declaration."""
    return dataclasses.field(default=default, metadata={"option": Option(**declared)})


def declared_options(cls: "type | None" = None) -> "dict[str, Option]":
    """Each option's declaration by name, in the order of the fields, name, flag and key filled in.

    ``cls``: a subclass of :class:`SamplerOptions` (default: this module's ``SamplerOptions``, read when called).
    """
    cls = cls or SamplerOptions
    out = {}
    for f in dataclasses.fields(cls):
        made = f.metadata.get("option") or Option(cli=False)
        out[f.name] = dataclasses.replace(
            made, name=f.name, flag=made.flag or "--" + f.name.replace("_", "-"), key=made.key or f.name
        )
    return out


def option_default(name: str) -> Any:
    """The default of the option ``name``."""
    return next(f.default for f in dataclasses.fields(SamplerOptions) if f.name == name)


def check_option(name: str, value: Any) -> Any:
    """``value`` if it is one of the option ``name``'s choices now (:meth:`Option.allowed`).

    Raises:
        ValueError: naming the option and its choices.
    """
    return check_choice(name, value, declared_options()[name].allowed())


@dataclass(frozen=True, kw_only=True)
class SamplerOptions:
    """The options of the exact speculative sampler, validated when made.

    ``sample(model, x, SamplerOptions(...), seed=0)`` and ``sample(model, x, steps=..., churn=..., seed=0)``
    are the same run. The values are kept as given (names, objects): a stateful draft (``"auto"``)
    or tree policy (``planning.AdaptiveTree``) is resolved by each run, as it would be from keywords.
    :meth:`from_kwargs` makes one from keywords and names any that is not an option;
    ``dataclasses.replace(options, ...)`` changes some (and checks again).

    Attributes:
        steps: number of steps ``T >= 1`` on the chosen ``grid`` (or give ``sigmas``).
        churn: ``eps`` in (0, 1] (ERRATA 8: 0 makes speculation vacuous): the ``em`` chain's
            parameter, required with it; another chain takes none.
        chain: the sampler whose law the run has: a registered name (``em`` (the paper's
            Euler-Maruyama step with ``churn``), ``euler_ancestral``, ``euler``, ``dpmpp_2m_sde``, ``dpmpp_3m_sde``, ``ddpm``,
            ``ddim``, ``lcm``; :func:`~specforest.chains.available_chains`) with its default parameters, or a
            :class:`~specforest.chains.Chain` (``chains.get_chain("euler_ancestral", eta=0.5)``).
        sigmas: an explicit ``(T + 1,)`` grid, decreasing from <= 1 to 0.
        grid: ``flow_match`` (diffusers' default grid) or ``uniform`` (the paper's text). Both start at
            ``t = 1`` (``sigma = inf``), where a sampler on VE levels is not defined: give ``schedule``.
        shift: timestep shift ``kappa`` of eq. (38).
        schedule: ``None`` (the grid is ``grid``'s) or a named noise schedule whose ``steps`` VE levels,
            then 0, make the grid (:func:`specforest.schedules.schedule_grid`): ``karras`` (``rho = 7``) or
            ``exponential`` between ``sigma_min`` and ``sigma_max``, ``ddpm`` (DDPM's 1000-step training
            schedule) or ``vp`` (k-diffusion's ``get_sigmas_vp``). It starts below ``t = 1``, so every
            chain runs on it; ``grid`` (other than its default), ``shift`` (other than 1) and ``sigmas``
            are refused beside it.
        sigma_min, sigma_max: the VE range of the ``karras`` and ``exponential`` schedules (``None``:
            0.002 and 80); refused with another schedule or none.
        tree: draft topology (a :class:`~specforest.trees.DraftTree`), a
            :class:`~specforest.trees.TreePolicy` re-planned every round
            (``planning.AdaptiveTree``), or ``None`` for the standard sampler.
        coupling: a registered name (``grs`` (D-GRS, Algorithm 3), ``rmc``
            (Algorithm 2, chains only), ``rank``, ``antithetic``, see
            :func:`~specforest.couplings.register_coupling`) or a
            :class:`~specforest.couplings.Coupling`.
        draft: a registered draft name (``velocity``, ``drift``, ``x0``, ``eps``,
            ``x0_extrap``, ``auto``), a :class:`~specforest.drafts.Proposal`,
            or a draft-model callable.
        prefetch: ``nearest`` or ``parent``, see :data:`specforest.engine.PREFETCH_POLICIES`.
        verify: ``internal`` (evaluate root and internal nodes) or ``drafted``
            (every node, leaves included).
        max_rows: split each target call into sub-batches of at most this many
            states (still one call, one NFE; bounds peak memory of the model).
        model_kwargs: extra keyword arguments passed to every call as they are.
        lazy: cost simulation: realize only the nodes the acceptance walk visits
            (same samples, NFE and acceptance as the full tree, at a fraction of
            the compute). NFE and ``rows`` are accounted as for the full tree;
            the model is called several times per round with few rows.
        record_deltas: keep every verification's ``(depth, step, delta, accepted)`` in ``stats.deltas``
            (:func:`specforest.sample` only).
        pad_rows: pad every network call's rows up to the next of a few sizes
            (``"pow2"`` or a list of ints; a larger call is split), for a
            ``torch.compile(mode="reduce-overhead")`` or CUDA-graph model that
            would otherwise recompile for each new row count. Padding rows repeat
            a real row; their outputs are never used, so the samples do not change.

    Raises:
        ValueError / TypeError: naming the option and what it accepts.
    """

    steps: Optional[int] = option(
        None,
        help=f"Grid steps T (3 to {MAX_STEPS}; on the em chain the first and last are deterministic Euler steps).",
        kind=int,
        low=3,
        high=MAX_STEPS,
        tune="tuner",
    )
    churn: Optional[float] = option(
        None,
        help="Churn eps in (0, 1] of the em chain, the default --chain (0 would make speculation accept nothing).",
        kind=float,
        low=0.0,
        high=1.0,
        low_open=True,
        tune="tuner",
    )
    chain: "str | Chain" = option(
        "em",
        help="The stochastic sampler whose chain the run speculates exactly (docs/chains.md): em is the paper's "
        "Euler-Maruyama step with --churn. Each chain takes its own options, its defaults where not given: "
        "{chains}. An option the chain does not take is an error.",
        choices=available_chains,
        tune="tuner",
    )
    sigmas: Optional[torch.Tensor] = option(
        None,
        cli=False,
        tune="refused",
        refused="give sigmas_for, the grid as a function of its steps: the timing runs are shorter than the run",
    )
    grid: str = option(
        "flow_match",
        help="Time grid: flow_match (diffusers' FlowMatchEulerDiscreteScheduler grid, the authors' code) or uniform.",
        choices=GRIDS,
    )
    shift: float = option(1.0, cli=False, kind=float, low=0.0, low_open=True)
    schedule: Optional[str] = option(
        None,
        grid=True,
        help="Noise schedule whose --steps VE levels, then 0, make the grid instead of --grid's: karras "
        "(Karras et al., rho 7) or exponential between --sigma-min and --sigma-max, ddpm (DDPM's 1000-step "
        "training schedule, linear betas) or vp (k-diffusion's get_sigmas_vp). It starts below t = 1, so "
        "every --chain runs on it (the named grids start at t = 1, where the VE samplers are not defined).",
        choices=SCHEDULES,
    )
    sigma_min: Optional[float] = option(
        None,
        grid=True,
        help=f"Smallest VE noise level of --schedule karras or exponential, > 0 "
        f"(default {SCHEDULE_SIGMA_RANGE['karras'][0]}).",
        kind=float,
        low=0.0,
        low_open=True,
    )
    sigma_max: Optional[float] = option(
        None,
        grid=True,
        help=f"Largest VE noise level of --schedule karras or exponential, > --sigma-min "
        f"(default {SCHEDULE_SIGMA_RANGE['karras'][1]}).",
        kind=float,
        low=0.0,
        low_open=True,
    )
    tree: "Optional[DraftTree | TreePolicy]" = option(
        None,
        cli=False,
        tune="refused",
        refused="the tree is what tune chooses (Predictor.predict prices one given tree)",
    )
    coupling: "str | Coupling" = option("grs", cli=False, choices=available_couplings, tune="constraint")
    draft: "str | Proposal | Callable" = option(
        "velocity",
        help="What the draft reads from the evaluations made before the round: the prefetched "
        "velocity (the paper's protocol), the whole drift (App. C.1), the clean-data prediction x0, "
        "the noise prediction eps, x0 extrapolated in time (x0_extrap), the previous round's x0 at "
        "each drafted step (memory; the run goes full), that one moved to the drafted state by a fitted "
        "gain (secant), auto (chosen online among those per draft offset and half of the grid), picard / "
        "picard2 (the x0 chain refined by 1 / 2 Picard sweeps, each one more target call a round), learned "
        "(the draft network the model declares, the digits model's distilled U-Net, anchored at those "
        "evaluations), cached "
        "(the target's own outer blocks with its deep features from the previous round's node at that step, "
        "DeepCache-style; a model that keeps them: digits, the natural models, the mixture), or corrected "
        "(cached plus a rank-one secant of its own error, measured at that node with the features of the "
        "node the round before evaluated at the same step); the exactly known rest is "
        "recomputed at each drafted state.",
        choices=available_drafts,
        tune="constraint",
    )
    prefetch: str = option(
        "nearest",
        help="Which evaluated node the next round drafts from after a rejection (ERRATA 9).",
        choices=PREFETCH_POLICIES,
    )
    verify: str = option(
        "internal",
        help="Evaluate every drafted node (drafted: the paper's protocol, B = |V|) or only "
        "the root and internal nodes (internal: fewer states per call, same NFE or more).",
        choices=VERIFY_MODES,
        tune="constraint",
    )
    max_rows: Optional[int] = option(None, cli=False, kind=int, low=1)
    model_kwargs: Optional[dict] = option(None, cli=False)
    lazy: bool = option(
        False,
        help="Realize only the visited nodes: same law of samples and NFE, far less memory.",
        kind=bool,
        tune="refused",
        refused="lazy=True is a cost simulation whose wall time is not a run's (the calibration chains are lazy "
        "already)",
    )
    record_deltas: bool = option(
        False,
        cli=False,
        kind=bool,
        tune="refused",
        refused="the calibration chains record their deltas already; a timed run would pay for it",
    )
    pad_rows: "Optional[str | Sequence[int]]" = option(None, cli=False)

    def __post_init__(self) -> None:
        if self.steps is not None:
            if isinstance(self.steps, bool) or not isinstance(self.steps, int):
                raise TypeError(f"steps must be an int >= 1, got {type(self.steps).__name__}")
            if self.steps < 1:
                raise ValueError(f"steps must be >= 1, got {self.steps}")
        for name in ("prefetch", "verify"):
            check_option(name, getattr(self, name))
        if self.max_rows is not None:
            check_int("max_rows", self.max_rows, 1)
        tree = self.tree
        if tree is not None and not isinstance(tree, (DraftTree, TreePolicy)):
            raise TypeError(
                f"tree must be a DraftTree (see specforest.trees), a TreePolicy (planning.AdaptiveTree) or None, "
                f"got {type(tree).__name__}"
            )
        fixed = tree if isinstance(tree, DraftTree) else None
        if fixed is not None and fixed.L < 1:
            raise ValueError("tree must have depth L >= 1; use tree=None for the standard sampler")
        for name in ("lazy", "record_deltas"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.schedule is not None:
            check_option("schedule", self.schedule)
        sde = options_sde(self)
        if tree is not None:
            check_stochastic(sde, "Run it with tree=None")
        cp = get_coupling(self.coupling)
        if isinstance(tree, TreePolicy) and cp.structured_siblings:
            raise ValueError(f"coupling {cp.name!r} draws structured siblings; an adaptive tree needs i.i.d. children")
        if fixed is not None:
            k = fixed.num_children[fixed.internal]
            if cp.structured_siblings and (k != k[0]).any():
                raise ValueError(
                    f"coupling {cp.name!r} draws structured siblings: every internal node of the tree "
                    "needs the same number of children (e.g. trees.uniform(4, L) for antithetic)"
                )
            for children in k.unique().tolist():
                try:
                    cp.check_children(int(children))
                except ValueError as err:
                    raise ValueError(f"tree: {err}") from None
        get_proposal(self.draft)  # a name is checked here; each run makes its own instance
        mk = self.model_kwargs
        if mk is not None and not isinstance(mk, dict):
            raise TypeError(f"model_kwargs must be a dict or None, got {type(mk).__name__}")
        if mk and not all(isinstance(k, str) for k in mk):
            raise TypeError(f"model_kwargs' keys must be str (keyword arguments of the model), got {list(mk)!r}")
        pad_sizes(self.pad_rows)

    @classmethod
    def names(cls) -> "tuple[str, ...]":
        """The options' names, in the order of the fields."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "SamplerOptions":
        """The options given as keywords (``churn`` required with the ``em`` chain, the default).

        Raises:
            TypeError: naming a keyword that is not an option (and listing the options), or a missing ``churn``.
        """
        check_names(kwargs)
        return cls(**kwargs)

    def as_dict(self) -> dict:
        """The options as keywords (``sample(model, x, **options.as_dict())``); values as given, not copied."""
        return {name: getattr(self, name) for name in self.names()}


def check_names(kwargs: dict) -> None:
    """Refuse a keyword that is not a field of :class:`SamplerOptions`, listing the options.

    Raises:
        TypeError: naming the unknown keywords.
    """
    unknown = sorted(k for k in kwargs if k not in SamplerOptions.names())
    if unknown:
        raise TypeError(
            f"unexpected option(s) {', '.join(unknown)}; the sampler's options are "
            f"{', '.join(SamplerOptions.names())} (see specforest.SamplerOptions)"
        )


def _as_sigmas(sigmas) -> torch.Tensor:
    """An explicit grid as a float64 tensor, or an error naming ``sigmas``."""
    try:
        s = torch.as_tensor(sigmas)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"sigmas must be a (T + 1,) tensor of noise levels, got {type(sigmas).__name__}") from err
    if s.is_complex() or s.dtype == torch.bool:
        raise TypeError(f"sigmas must be a real tensor of noise levels, got {s.dtype}")
    if s.ndim != 1 or s.numel() < 2:
        raise ValueError(f"sigmas must be a 1-D tensor of T + 1 >= 2 noise levels, got shape {tuple(s.shape)}")
    return s.to(torch.float64)


def _chain_of(churn: Any, chain: Any) -> Chain:
    """The :class:`~specforest.chains.Chain` of the options ``chain`` and ``churn`` (the ``em`` chain's parameter)."""
    if isinstance(chain, str) and chain.lower() == "em":
        if churn is None:
            raise TypeError("churn is required with the em chain (the default): a float in (0, 1] (see SamplerOptions)")
        return EM(churn=churn)
    if not isinstance(chain, (str, Chain)):
        raise TypeError(
            f"chain must be a registered name ({', '.join(available_chains())}) or a specforest.chains.Chain, "
            f"got {type(chain).__name__}"
        )
    made = get_chain(chain)
    if churn is not None and not (isinstance(made, EM) and churn == made.churn):
        raise ValueError(
            f"churn={churn!r} is the em chain's parameter; chain {made.name!r} takes {made.params} "
            f"(set them on the chain: specforest.chains.get_chain({made.name!r}, ...)); leave churn unset"
        )
    return made


def _chain_diffs(tuned_for: TunedFor, chain: "str | Chain", churn: Any) -> list:
    """How the run's chain differs from the tuned one's (empty if it does not, or cannot be made)."""
    is_em = (isinstance(chain, str) and chain.lower() == "em") or isinstance(chain, EM)
    if churn is None and is_em:
        churn = dict(tuned_for.chain_params).get("churn", tuned_for.churn)
    try:
        made = _chain_of(churn, chain)
    except (TypeError, ValueError):
        return []  # (the options' own check names it)
    if made.name != tuned_for.chain:
        return [f"chain {made.name} (tuned for {tuned_for.chain})"]
    out = []
    for name, tuned in tuned_for.chain_params:
        value = made.params.get(name)
        same = value == tuned or (
            isinstance(value, (int, float)) and isinstance(tuned, (int, float))
            and math.isclose(float(value), float(tuned), rel_tol=1e-9, abs_tol=1e-12)
        )  # fmt: skip
        if not same and name != "churn":
            out.append(f"chain {made.name}'s {name} {value!r} (tuned for {tuned!r})")
    return out


def options_sde(o: "SamplerOptions") -> GaussianChain:
    """The chain's tables of the options ``o`` (:func:`make_sde` of its grid and chain options)."""
    grid = dict(schedule=o.schedule, sigma_min=o.sigma_min, sigma_max=o.sigma_max)
    return make_sde(o.steps, o.sigmas, o.grid, o.shift, o.churn, o.chain, **grid)


def _check_schedule(schedule, sigma_min, sigma_max, sigmas, grid, shift) -> None:
    """Refuse what a schedule leaves no room for (another grid given beside it), and a range without one."""
    if schedule is None:
        given = [n for n, v in (("sigma_min", sigma_min), ("sigma_max", sigma_max)) if v is not None]
        if given:
            verb = "sets" if len(given) == 1 else "set"
            takers = " or ".join(map(repr, SCHEDULE_SIGMA_RANGE))
            raise ValueError(
                f"{' and '.join(given)} {verb} the range of a schedule (schedule={takers}); give one, or leave "
                f"{'it' if len(given) == 1 else 'them'} unset"
            )
        return
    if sigmas is not None:
        raise ValueError(f"schedule={schedule!r} makes the grid from steps, and sigmas is a grid: give one of them")
    if grid != option_default("grid"):
        raise ValueError(f"schedule={schedule!r} and grid={grid!r} both choose the grid: give one of them")
    if shift != option_default("shift"):
        raise ValueError(f"shift={shift!r} shifts a named grid (grid=...); schedule={schedule!r} takes none")


def make_sde(
    steps,
    sigmas,
    grid,
    shift,
    churn,
    chain: "str | Chain" = "em",
    *,
    schedule: Optional[str] = None,
    sigma_min: Optional[float] = None,
    sigma_max: Optional[float] = None,
) -> GaussianChain:
    """The chain's tables for the options ``steps`` (on ``grid`` with ``shift``, or on ``schedule`` with its
    ``sigma_min`` and ``sigma_max``) or ``sigmas``.

    Raises:
        ValueError / TypeError: naming the option (the chain checks the grid and its parameters).
    """
    ch = _chain_of(churn, chain)
    _check_schedule(schedule, sigma_min, sigma_max, sigmas, grid, shift)
    if schedule is not None:
        if steps is None:
            raise ValueError(f"schedule={schedule!r} needs steps (an int >= 1)")
        if type(steps) is int and all(v is None or type(v) in (int, float) for v in (sigma_min, sigma_max)):
            return _schedule_sde(steps, schedule, sigma_min, sigma_max, ch)
        return ch.build(schedule_grid(schedule, steps, sigma_min, sigma_max))  # (it names the bad value)
    if sigmas is None:
        if steps is None:
            raise ValueError("give steps (an int >= 1) or sigmas (a (T + 1,) tensor)")
        check_choice("grid", grid, GRIDS)
        if type(steps) is int and type(shift) in (int, float):
            return _grid_sde(steps, grid, shift, ch)  # (anything else: the constructors name the bad value)
        sigmas = named_grid(grid, steps, shift=shift)
    else:
        sigmas = _as_sigmas(sigmas)
        if steps is not None and int(steps) != len(sigmas) - 1:
            raise ValueError(f"steps={steps} disagrees with len(sigmas) - 1 = {len(sigmas) - 1}")
    return ch.build(sigmas.to(torch.float64))


@functools.lru_cache(maxsize=32)
def _grid_sde(steps: int, grid: str, shift: float, chain: Chain) -> GaussianChain:
    """The tables of a named grid, made once per (steps, grid, shift, chain): they are cached on it,
    so repeated runs (one image at a time, say) do not rebuild them."""
    return chain.build(named_grid(grid, steps, shift=shift).to(torch.float64))


@functools.lru_cache(maxsize=32)
def _schedule_sde(steps: int, schedule: str, sigma_min, sigma_max, chain: Chain) -> GaussianChain:
    """The tables of a named schedule, made once per (steps, schedule, range, chain), as :func:`_grid_sde`'s."""
    return chain.build(schedule_grid(schedule, steps, sigma_min, sigma_max))


def pad_sizes(pad_rows: "Optional[str | Sequence[int]]") -> Optional[tuple]:
    """The ascending row counts of ``pad_rows``: ``"pow2"`` (1, 2, 4, ..., 2**16), a list of ints, or ``None``.

    Raises:
        ValueError: naming ``pad_rows`` and what it accepts.
    """
    if pad_rows is None:
        return None
    if pad_rows == "pow2":
        return tuple(2**k for k in range(17))
    if isinstance(pad_rows, str) or not isinstance(pad_rows, Sequence) or not pad_rows:
        raise ValueError(f"pad_rows must be None, 'pow2' or a non-empty list of ints >= 1, got {pad_rows!r}")
    if any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in pad_rows):
        raise ValueError(f"pad_rows must list ints >= 1, got {pad_rows!r}")
    return tuple(sorted(set(pad_rows)))


@dataclass(frozen=True)
class TunedFor:
    """The run a tuned configuration was chosen for, as :func:`specforest.sample` checks it.

    A :class:`~specforest.latency.Tuned` passes one as ``tuned_for`` with its
    options (``sample(model, x, **tuned)``): the measured choice holds only for the
    grid, churn and batch it was measured at.

    Attributes:
        steps: grid steps ``T``.
        batch: trajectories per run (rows of ``x``; slots of :func:`specforest.generate`).
        churn: the churn, or ``None`` where it was not recorded (files written before it was).
        chain: the chain's name, or ``None`` where it was not recorded (then it is not checked).
        chain_params: ``(name, value)`` pairs of the chain's parameters (``em``: its churn).
    """

    steps: int
    batch: int
    churn: Optional[float] = None
    chain: Optional[str] = None
    chain_params: tuple = ()


def check_tuned_for(
    tuned_for: Optional[TunedFor],
    *,
    steps: Optional[int],
    sigmas: Optional[torch.Tensor],
    churn: Any,
    batch: Optional[int],
    batch_name: str = "rows of x",
    chain: Any = "em",
) -> Optional[int]:
    """The steps of a run given with ``tuned_for``: its own, or the tuned run's when neither ``steps``
    nor ``sigmas`` is given.

    Args:
        tuned_for: the tuned run (``None``: nothing is checked, ``steps`` is returned).
        steps, sigmas, churn, chain: the run's options, as given to :func:`specforest.sample`.
        batch: the run's trajectories (``None``: not checked).
        batch_name: what ``batch`` counts, for the message.

    Raises:
        TypeError: if ``tuned_for`` is not a :class:`TunedFor`.
        ValueError: listing every difference between the run and the tuned one.
    """
    if tuned_for is None:
        return steps
    if not isinstance(tuned_for, TunedFor):
        raise TypeError(
            f"tuned_for must be a specforest.sampler.TunedFor (passed by sample(model, x, **tuned)) or None, "
            f"got {type(tuned_for).__name__}"
        )
    diffs = []
    run_steps = steps if sigmas is None else len(sigmas) - 1
    if run_steps is None:
        steps = tuned_for.steps
    elif run_steps != tuned_for.steps:
        diffs.append(f"steps {run_steps} (tuned for {tuned_for.steps})")
    if (
        tuned_for.churn is not None
        and isinstance(churn, (int, float))
        and not math.isclose(float(churn), tuned_for.churn, rel_tol=1e-9, abs_tol=1e-12)
    ):
        diffs.append(f"churn {churn:g} (tuned for {tuned_for.churn:g})")
    if batch is not None and batch != tuned_for.batch:
        diffs.append(f"{batch} {batch_name} (tuned for {tuned_for.batch})")
    if tuned_for.chain is not None and isinstance(chain, (str, Chain)):
        diffs += _chain_diffs(tuned_for, chain, churn)
    if diffs:
        raise ValueError(
            "the tuned configuration was chosen for another run: "
            + "; ".join(diffs)
            + ". Run it as tuned, tune again for this run, or pass tuned.options() to run the configuration unchecked"
        )
    return steps


def resolve(
    options: Optional[SamplerOptions],
    option_kwargs: dict,
    *,
    tuned_for: Optional[TunedFor] = None,
    batch: Optional[int] = None,
    batch_name: str = "rows of x",
) -> SamplerOptions:
    """The options of one call: ``options`` with ``option_kwargs`` over it (the keywords win), checked
    against ``tuned_for`` (whose steps it takes when neither ``steps`` nor ``sigmas`` is given).

    Args:
        options: the options object, or ``None`` (then the keywords are all: ``churn`` among them).
        option_kwargs: options given as keywords.
        tuned_for, batch, batch_name: as in :func:`check_tuned_for`.

    Raises:
        TypeError: if ``options`` is not a :class:`SamplerOptions`, a keyword is not an option, or
            ``churn`` is missing.
        ValueError: as :func:`check_tuned_for` and :class:`SamplerOptions`.
    """
    if options is not None and not isinstance(options, SamplerOptions):
        raise TypeError(f"options must be a specforest.SamplerOptions or None, got {type(options).__name__}")
    check_names(option_kwargs)
    given = {**({} if options is None else options.as_dict()), **option_kwargs}
    steps = check_tuned_for(
        tuned_for,
        steps=given.get("steps"),
        sigmas=given.get("sigmas"),
        churn=given.get("churn"),
        batch=batch,
        batch_name=batch_name,
        chain=given.get("chain", "em"),
    )
    if steps is not given.get("steps"):
        option_kwargs = {**option_kwargs, "steps": steps}
    if options is None:
        return SamplerOptions.from_kwargs(**option_kwargs)
    return dataclasses.replace(options, **option_kwargs) if option_kwargs else options
