"""What the paper's experiments share: methods, trees, seeds, summaries and result files.

Every experiment (:mod:`~specforest.experiments.gmm`,
:mod:`~specforest.experiments.pixel`, :mod:`~specforest.experiments.sd3`) names
its samplers by *method* (``standard``, ``rmc``, ``dgrs``, ``rank``,
``antithetic``), turns a method and ``(K, L)`` into a tree with
:func:`method_tree` (``tree="optimal"``/``"adaptive"`` with :func:`choose_tree`),
derives its random streams with :func:`derive_seed`, summarizes a run's
statistics with :func:`summarize` and writes resumable result files with
:func:`write_records`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..chains import EM, Chain, get_chain
from ..planning import TREE_MODES, AdaptiveTree, make_tree
from ..plots import pyplot, save_figure
from ..sde import GaussianChain
from ..trees import DraftTree
from ..validation import check_choice, check_churn, check_int, check_number
from .io import atomic_write_text, records_csv

__all__ = [
    "COUPLING_OF",
    "METHODS",
    "METHOD_LABELS",
    "SWEEP_METHODS",
    "SweepResult",
    "budget_of",
    "call_counts",
    "chain_steps",
    "chain_kwargs",
    "chain_of_record",
    "chain_record",
    "check_choice",
    "check_churn",
    "check_int",
    "check_number",
    "check_sweep_methods",
    "choose_tree",
    "compiled",
    "derive_seed",
    "describe_chain",
    "finite",
    "mean_sem",
    "method_tree",
    "normalize",
    "pm",
    "pyplot",
    "json_params",
    "record_key",
    "run_chain",
    "save_figure",
    "summarize",
    "write_records",
]

METHODS = ("standard", "rmc", "dgrs", "rank", "antithetic")
"""``standard``: no tree (``T`` NFE); ``rmc``: Algorithm 2 on a chain of ``B``
drafted states; ``dgrs``: Algorithm 3 on a ``(K, L)`` tree; ``rank`` and
``antithetic``: the rank coupling and antithetic pairs on the same trees."""

COUPLING_OF = {"rmc": "rmc", "dgrs": "grs", "rank": "rank", "antithetic": "antithetic"}
"""The coupling each tree method verifies with."""

SWEEP_METHODS = ("dgrs", "rank", "antithetic")
"""Tree methods a sweep can run at every ``(K, L)`` (antithetic at even ``K`` only)."""

METHOD_LABELS = {"standard": "standard", "rmc": "RMC", "dgrs": "D-GRS", "rank": "rank", "antithetic": "antithetic"}
"""Short names of the methods for tables and legends."""


def check_sweep_methods(methods: Sequence[str]) -> list[str]:
    """``methods`` without repeats, each one of :data:`SWEEP_METHODS` (``ValueError`` otherwise)."""
    methods = list(dict.fromkeys(methods))
    if not methods:
        raise ValueError(f"methods must name at least one of {SWEEP_METHODS}")
    for m in methods:
        check_choice("methods", m, SWEEP_METHODS)
    return methods


def run_chain(chain: "str | Chain", churn: Optional[float], default_churn: float) -> Chain:
    """The chain an experiment's run samples: ``chain`` (a registered name or a
    :class:`~specforest.chains.Chain`) with ``churn``, the ``em`` chain's parameter.

    With the ``em`` chain (the paper's, the default) ``churn`` is its churn (``None``: an
    :class:`~specforest.chains.EM`'s own, or ``default_churn``, the experiment's); another chain
    carries its own parameters and takes no ``churn``.

    Raises:
        ValueError / TypeError: an unknown chain (listing the registered ones), a churn out of
            ``(0, 1]``, or a churn given with another chain (naming the chain and its parameters).
    """
    if isinstance(chain, EM) or (isinstance(chain, str) and chain.lower() == "em"):
        if churn is None:
            return chain if isinstance(chain, EM) else EM(churn=default_churn)
        churn = check_churn(churn)
        if isinstance(chain, EM) and churn != chain.churn:
            raise ValueError(f"churn={churn:g} disagrees with the chain's churn {chain.churn:g}; give one of them")
        return EM(churn=churn)
    made = get_chain(chain)
    if churn is not None:
        raise ValueError(
            f"churn is the em chain's parameter; chain {made.name!r} takes {', '.join(made.params)} "
            f"(set them on the chain: specforest.chains.get_chain({made.name!r}, ...)); leave churn unset"
        )
    return made


def chain_kwargs(chain: Chain) -> dict:
    """:func:`specforest.sample`'s options ``churn`` and ``chain`` of a run's chain: the ``em`` chain as
    its churn (the options every run had before chains), another chain as itself."""
    if isinstance(chain, EM):
        return {"churn": chain.churn, "chain": "em"}
    return {"churn": None, "chain": chain}


def json_params(params: dict) -> dict:
    """A chain's parameters as JSON holds them: a non-finite number (EDM's ``s_tmax = inf``, no bound)
    as ``null``, which :func:`chain_of_record` reads back as the parameter's default."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in params.items()}


def chain_of_record(name: str, params: "dict | None") -> Chain:
    """The chain a record names: ``get_chain(name, **params)``, a ``null`` parameter its default (:func:`json_params`).

    Raises:
        ValueError / TypeError: an unknown chain, or a parameter it lacks or refuses, naming it.
    """
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise TypeError(f"chain_params must be an object of the chain's parameters, got {type(params).__name__}")
    return get_chain(name, **{k: v for k, v in params.items() if v is not None})


def chain_record(chain: Chain) -> dict:
    """What a run's record holds of its chain: ``chain`` (its name) and ``chain_params`` (:func:`json_params`)."""
    return {"chain": chain.name, "chain_params": json_params(chain.params)}


def describe_chain(record: dict, sep: str = "=") -> str:
    """A record's chain in a summary line: ``churn=0.1`` for the em chain (a record without a chain
    ran it), ``chain euler_ancestral (eta=0.7, s_noise=1, path=ve)`` for another."""
    name = record.get("chain", "em")
    if name == "em":
        return f"churn{sep}{record.get('churn')}"
    params = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in record["chain_params"].items())
    return f"chain {name} ({params})"


def derive_seed(seed: int, *stream: int) -> int:
    """A 63-bit seed for the stream ``(seed, *stream)``: numpy's SeedSequence keeps streams well apart."""
    return int(np.random.SeedSequence([seed, *stream]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def normalize(method: str, K: int, L: int) -> tuple[int, int]:
    """The ``(K, L)`` recorded for a method: standard ``(0, 0)``; rmc ``(1, B)``; tree methods ``(K, L)``."""
    if method == "standard":
        return 0, 0
    if method == "rmc":
        return 1, L
    return K, L


def budget_of(method: str, K: int, L: int) -> int:
    """Drafted states per round: 0, ``B = L`` for ``rmc``, ``K + ... + K^L`` for the tree methods."""
    if method == "standard":
        return 0
    if method == "rmc":
        return L
    return sum(K**level for level in range(1, L + 1))


def chain_steps(chain: "str | Chain | None", steps: int) -> int:
    """The steps a run of ``chain`` walks on a grid of ``steps`` steps (:meth:`~specforest.chains.Chain.grid_step`):
    ``steps``, or ``dpmpp_sde``'s ``2 steps - 1`` half-steps; ``steps`` for a chain named by a string
    (``"em"``, a pipeline's ``"scheduler"``)."""
    return steps if not isinstance(chain, Chain) else int(chain.grid_step(steps).numel())


def method_tree(method: str, K: int, L: int, steps: int) -> Optional[DraftTree]:
    """The tree of a method: ``None``, the chain of ``L`` (``rmc``) or the uniform ``(K, L)`` tree, no deeper
    than ``steps``: the run's chain's steps on its grid (``T``, or ``dpmpp_sde``'s ``2 T - 1`` half-steps).

    One call of :func:`specforest.planning.make_tree`, the tree of every command.
    """
    check_choice("method", method, METHODS)
    if method == "standard":
        return None
    return make_tree(None if method == "rmc" else K, L, coupling=COUPLING_OF[method], steps=steps)


def choose_tree(
    method: str,
    K: int,
    L: int,
    steps: int,
    tree: str,
    budget: Optional[int],
    plan: Callable[[int], DraftTree],
) -> "tuple[DraftTree | AdaptiveTree | None, Optional[int]]":
    """The tree of a ``tree=uniform|optimal|adaptive`` option (:data:`~specforest.planning.TREE_MODES`).

    Args:
        method, K, L, steps: as in :func:`method_tree` (``uniform``).
        tree: the mode.
        budget: drafted states per round, required by ``optimal`` and ``adaptive``.
        plan: ``plan(budget)`` runs the experiment's calibration and returns the
            planned tree (:func:`specforest.planning.plan_tree`), for ``optimal``.

    Returns:
        ``(tree, budget)``, the budget checked (``None`` for ``uniform``).
    """
    check_choice("tree", tree, TREE_MODES)
    if tree == "uniform" or method == "standard":
        return method_tree(method, K, L, steps), None
    if budget is None:
        raise ValueError(f"budget (drafted states per round, >= 1) is required with tree={tree!r}")
    budget = check_int("budget", budget, 1)
    if method == "antithetic":
        raise ValueError(f"tree={tree!r} plans irregular trees of i.i.d. children; use dgrs, rank or rmc")
    return (AdaptiveTree(budget) if tree == "adaptive" else plan(budget)), budget


def compiled(model: Callable, compile: bool) -> "tuple[Callable, Optional[str]]":
    """``(model, pad_rows)`` of a run: with ``compile``, ``torch.compile(model, mode="reduce-overhead")``
    with every call's rows padded to a power of two (a few shapes to compile, not one per round)."""
    if not compile:
        return model, None
    return torch.compile(model, mode="reduce-overhead"), "pow2"


def finite(x: float) -> Optional[float]:
    """``x`` as a float, ``None`` where it is NaN or infinite (JSON has no NaN)."""
    x = float(x)
    return x if math.isfinite(x) else None


def mean_sem(x: torch.Tensor) -> tuple[Optional[float], Optional[float]]:
    """Mean and standard error of the mean of ``x`` (``None`` where undefined)."""
    x = x.double()
    n = x.numel()
    mean = x.mean().item()
    sem = (x.std(unbiased=True) / math.sqrt(n)).item() if n > 1 else float("nan")
    return finite(mean), finite(sem)


def pm(mean: Optional[float], sem: Optional[float], digits: int = 3) -> str:
    """``"1.234 ± 0.005"``; ``-`` where the mean is unknown."""
    if mean is None:
        return "-"
    return f"{mean:.{digits}f}" + ("" if sem is None else f" ± {sem:.{digits}f}")


def call_counts(sde: GaussianChain) -> dict:
    """``standard_calls`` and ``deterministic_calls`` of :func:`summarize` for a run of the chain's tables
    ``sde``: the standard run's model calls (:attr:`~specforest.sde.GaussianChain.standard_calls`, ``T`` for
    one call a step, Heun's ``2 T - 1``) and those it makes on the steps without noise."""
    used = torch.ones(sde.steps, dtype=torch.long)
    if sde.stage_tables is not None:
        used = torch.tensor(sde.stage_tables.used, dtype=torch.long)
    return {"standard_calls": sde.standard_calls, "deterministic_calls": int(used[~sde.stochastic.cpu()].sum())}


def summarize(
    *,
    nfe: torch.Tensor,
    attempts: torch.Tensor,
    accepts: torch.Tensor,
    delta_sum: torch.Tensor,
    spec_steps: torch.Tensor,
    rounds: torch.Tensor,
    rows: torch.Tensor,
    standard_calls: int,
    deterministic_calls: int,
) -> dict:
    """The statistics every experiment records, from per-trajectory counters.

    Args:
        nfe, spec_steps, rounds, rows: ``(n,)`` per trajectory (see :class:`specforest.SampleStats`).
        attempts, accepts, delta_sum: ``(n, L)`` per trajectory and depth.
        standard_calls: the standard run's model calls ``N`` on the run's grid (``T`` for a chain of one
            call a step; a chain of several stages makes more, :func:`call_counts`).
        deterministic_calls: those it makes on the steps without noise ``N_det`` (``T_det`` for one call
            a step).

    Returns:
        ``standard_calls``, ``nfe_mean``/``nfe_sem``, ``speedup_mean``/``speedup_sem`` (``N / NFE``,
        ``T / NFE`` for one call a step), ``speedup_paper_mean``/``speedup_paper_sem``
        (``(N - N_det) / (NFE - N_det)``, the paper's accounting ``(T - T_det) / (NFE - T_det)``),
        ``accept_rate`` (accepts / verification problems),
        ``accept_rate_per_depth``, ``delta_per_depth``, ``steps_per_round``, ``rows_mean``.
    """
    nfe = nfe.double()
    att, acc = attempts.sum(0).double(), accepts.sum(0).double()
    n_att = att.sum().item()
    n_rounds = rounds.sum().item()
    out: dict = {"standard_calls": int(standard_calls)}
    out["nfe_mean"], out["nfe_sem"] = mean_sem(nfe)
    out["speedup_mean"], out["speedup_sem"] = mean_sem(standard_calls / nfe)
    out["speedup_paper_mean"], out["speedup_paper_sem"] = mean_sem(
        (standard_calls - deterministic_calls) / (nfe - deterministic_calls)
    )
    out["accept_rate"] = finite(acc.sum().item() / n_att) if n_att else None
    out["accept_rate_per_depth"] = [finite(a) for a in (acc / att).tolist()]
    out["delta_per_depth"] = [finite(d) for d in (delta_sum.sum(0).double() / att).tolist()]
    out["steps_per_round"] = finite(spec_steps.sum().item() / n_rounds) if n_rounds else None
    out["rows_mean"] = finite(rows.double().mean().item())
    return out


def record_key(record: dict, fields: Sequence[str]) -> tuple:
    """The identity of a configuration in a results file: its ``fields`` (``churn`` as a float; ``chain``
    as its name and parameters, the ``em`` chain at the record's churn in a record written before chains)."""

    def value(k: str):
        if k == "churn":
            return None if record.get("churn") is None else float(record["churn"])
        if k == "chain":
            name = record.get("chain", "em")
            params = record.get("chain_params")
            if params is None:
                params = {"churn": float(record["churn"])} if name == "em" and record.get("churn") is not None else {}
            return name, tuple(sorted(params.items()))
        return record[k]

    return tuple(value(k) for k in fields)


@dataclass
class SweepResult:
    """What a sweep returns.

    Attributes:
        records: the sweep's records, in run order (resumed ones included).
        ran: configurations run now.
        skipped: configurations found in the results file and not rerun.
        files: paths written.
    """

    records: list[dict]
    ran: int = 0
    skipped: int = 0
    files: list[Path] = field(default_factory=list)


def write_records(out_dir: "str | os.PathLike[str]", records: list[dict]) -> list[Path]:
    """Write ``results.json`` and ``results.csv`` in ``out_dir`` atomically; return their paths."""
    out_dir = Path(out_dir)
    return [
        atomic_write_text(out_dir / "results.json", json.dumps(records, indent=1, allow_nan=False) + "\n"),
        atomic_write_text(out_dir / "results.csv", records_csv(records)),
    ]
