"""The ``--tune`` file of a command: read whole, checked field by field, reconciled with the command's options.

:func:`tune_option` is the option; :func:`read_tuned` reads a file ``specforest tune`` wrote and checks each
field (the sampler's options against their declared choices); :func:`apply_tuned` puts its configuration in
place of the command's sampler options and its run's settings where the command line gave none.
(Re-exported by :mod:`specforest.cli.common`.)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import click

from ..chains import get_chain
from ..experiments.pixel.models import PIXEL_MODELS
from ..latency.tuned import SCHEDULER
from ..options import declared_options
from ..validation import check_choice, check_int, check_number, is_int
from .sampler_options import CHAIN_FLAGS, extra_names, is_given

__all__ = ["MAX_THREADS", "SAMPLER_PARAMS", "apply_tuned", "read_tuned", "tune_option"]

MAX_THREADS = 1024
"""Most CPU threads ``--threads`` takes (and a tuned file's ``threads``)."""


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
    "model": lambda k, v: check_choice(k, v, ("gmm", *PIXEL_MODELS, "sd3", "diffusers")),
    "family": _text,
    "steps": lambda k, v: check_int(k, v, 1),
    "churn": lambda k, v: check_number(k, v, 0.0, 1.0, lo_open=True),
    "batch": lambda k, v: check_int(k, v, 1),
    "device": _text,
    "threads": lambda k, v: check_int(k, v, 1, MAX_THREADS),
    "grid": lambda k, v: check_choice(k, v, declared_options()["grid"].allowed()),
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
    "scheduler": _text,
    "chain": lambda k, v: check_choice(k, v, (*declared_options()["chain"].allowed(), SCHEDULER)),
    "chain_params": lambda k, v: _params(k, v),
}
"""Each key a ``tuned_for`` may record (``null``: not recorded) and its check, named by the key."""


def _further_keys() -> "dict[str, str]":
    """The record key of each further option the command line declares (:func:`extra_names`) -> its name:
    what ``specforest tune`` records of those it was given, beside :data:`_TUNED_FOR`."""
    declared = declared_options()
    return {declared[n].key: n for n in extra_names()}


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
        further = _further_keys()
        unknown = sorted(str(k) for k in made_for if k not in _TUNED_FOR and k not in further)
        if unknown:
            raise ValueError(
                f"unknown key(s) {', '.join(unknown)} in tuned_for; it records {', '.join(_TUNED_FOR)} and the "
                "keys of the further options the command line declares"
            )
        for key, value in made_for.items():
            if value is not None and key in _TUNED_FOR:
                _TUNED_FOR[key](f"tuned_for.{key}", value)  # (a further option's: checked as its option when taken)
    except (ValueError, TypeError) as e:
        raise click.ClickException(f"--tune {path}: {e}") from e
    # a hand edit of one copy of a field (tuned_for's chain, say) ran the other's silently
    disagree = _contradictions(tuned, made_for)
    if disagree:
        raise click.ClickException(
            f"--tune {path}: the configuration and its tuned_for disagree: {'; '.join(disagree)}. A file "
            "'specforest tune' writes holds one value in both: edit both alike, or tune again"
        )
    made_for = dict(made_for)
    made_for.update(steps=tuned.steps, batch=tuned.batch, chain=tuned.chain, chain_params=tuned.chain_params)
    if tuned.churn is not None or tuned.chain != "em":
        made_for["churn"] = tuned.churn  # (None with another chain than em: it has no churn)
    return tuned, made_for


def _contradictions(tuned: Any, made_for: dict) -> "list[str]":
    """Where a tuned file's ``tuned_for`` contradicts the configuration beside it: the fields it holds twice
    (``steps``, ``batch``, ``churn``, ``chain``, each of ``chain_params``, a pipeline scheduler's class),
    each where both copies are recorded (a ``null``, or a key a file written before it was kept lacks, is
    not a value; a ``null`` chain parameter is the chain's default)."""
    out = []
    for key in ("steps", "batch", "churn"):
        here, there = getattr(tuned, key), made_for.get(key)
        if here is not None and there is not None and _differs(key, here, there):
            out.append(f"{key} {here}, tuned_for.{key} {there}")
    chain = made_for.get("chain")
    if chain is not None and chain != tuned.chain:
        return [*out, f"chain {tuned.chain!r}, tuned_for.chain {chain!r}"]
    params = made_for.get("chain_params") or {}
    if tuned.chain == SCHEDULER:
        swapped = made_for.get("scheduler")  # (--scheduler NAME, the class whose chain was tuned)
        if swapped is not None and swapped != tuned.chain_params["scheduler"]:
            out.append(f"chain_params.scheduler {tuned.chain_params['scheduler']}, tuned_for.scheduler {swapped}")
        defaults = {}
    else:
        from ..experiments.common import json_params

        defaults = json_params(get_chain(tuned.chain).params)
    for p, there in params.items():
        if p not in tuned.chain_params:
            if not (p == "churn" and tuned.chain == "em"):  # (the em chain's churn, unknown to an old file's top level)
                out.append(f"chain {tuned.chain!r}, which has no parameter {p}, tuned_for.chain_params.{p} {there}")
            continue
        here = tuned.chain_params[p]
        there = defaults.get(p) if there is None else there
        if (here is None) != (there is None) or (here is not None and _differs(p, here, there)):
            out.append(f"chain_params.{p} {here}, tuned_for.chain_params.{p} {there}")
    return out


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
    if name == SCHEDULER:
        # a pipeline's own scheduler: its class is the pipeline's (or tuned_for's --scheduler), its eta --eta's
        return _scheduler_differs(ctx, o, there.get("eta"), params, path)
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


def _scheduler_differs(ctx: click.Context, o: dict, eta: Any, params: dict, path: str) -> list:
    """``--eta`` against the ``eta`` of a file tuned for a pipeline's own scheduler (``chain="scheduler"``):
    taken where not given, else it must match."""
    if eta is None or "eta" not in params:
        return []
    if not is_given(ctx, "eta"):
        o["eta"] = _adopt(ctx, params["eta"], "chain_params.eta", eta, path)
        return []
    here = o["eta"] or 0.0
    return [f"--eta {here} here, {eta} in the file (chain scheduler)"] if _differs("eta", here, eta) else []


def apply_tuned(
    o: dict,
    model: str,
    *,
    run: "dict[str, str] | None" = None,
    fixed: "dict[str, Any] | None" = None,
    sampler: bool = True,
    model_option: bool = False,
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
    none, as no command runs an explicit grid). The further options the file was tuned with (those the
    command line declares, under their record keys) are taken and checked the same way. "Given" is click's parameter source: the
    command line or the environment, whatever the value.

    Args:
        o: the command's parameters (click's names).
        model: what ``specforest tune --model`` calls the command's model.
        run: file key -> parameter name, beyond those of :data:`_RUN_KEYS` (which map to themselves
            when the command has them), e.g. ``{"batch": "samples"}``.
        fixed: file key -> this command's value, for keys without an option.
        sampler: replace the command's sampler options (``False``: the command runs the file's
            configuration beside its own, as ``specforest sd3`` does, and keeps its options).
        model_option: the command chooses ``model`` with its ``--model`` (``o["model"]``, as ``pixel``
            does): not given, it takes the file's model where that is one of its choices; given, it
            must match it.

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
    params = {p.name: p for p in ctx.command.params}
    there = made_for.get("model")
    if model_option and not given("model") and there in getattr(params["model"].type, "choices", ()):
        o["model"] = model = there
    if there not in (None, model):
        diffs.append(f"--model {model} here, {there} in the file")
    names = {k: k for k in _RUN_KEYS if k in flags}
    names.update({key: n for key, n in _further_keys().items() if n in flags})
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
