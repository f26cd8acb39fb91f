"""Verification rules: exact couplings of drafted children with the target, and their registry.

Every rule works on the rank-1 reduction of paper Sec. 3.1: proposal
``P = N(mu_p, s^2 I)`` and target ``Q = N(mu_q, s^2 I)`` differ only along
``e = (mu_q - mu_p) / |mu_q - mu_p|``. With ``delta = |mu_q - mu_p| / s`` and the
projection ``S = e.(Y - mu_p) / s`` (ERRATA 2), ``S ~ N(0, 1)`` under P and
``N(delta, 1)`` under Q, and ``rho(S) = dQ/dP = exp(delta S - delta^2 / 2)``. A
rule only replaces the projection of a child; the orthogonal part is kept.

A rule is called on a batch of ``P`` independent verification problems at once
(one per trajectory whose round reached that depth), each with up to ``K``
children. The scalar work is done in float64 whatever the states' dtype.

Modules: :mod:`.base` (the :class:`Coupling` contract and the projection),
:mod:`.maximal` (RMC and GRS, the paper's rules), :mod:`.lists` (rank and
antithetic). A new rule is a subclass of :class:`Coupling` made available by
name with :func:`register_coupling`.
"""

from __future__ import annotations

from typing import Callable

from ..registry import Registry
from ..residuals import log_sf, sample_grs_residual
from .base import Coupling, CouplingResult, project
from .lists import AntitheticCoupling, RankCoupling
from .maximal import GRS, RMC, grs_acceptance, grs_levels, rmc_acceptance

__all__ = [
    "Coupling",
    "CouplingResult",
    "AntitheticCoupling",
    "GRS",
    "RMC",
    "RankCoupling",
    "available_couplings",
    "get_coupling",
    "project",
    "register_coupling",
    "unregister_coupling",
    "grs_acceptance",
    "grs_levels",
    "log_sf",
    "rmc_acceptance",
    "sample_grs_residual",
]


_COUPLINGS: Registry[Coupling] = Registry(
    "coupling",
    {
        "rmc": RMC,
        "grs": GRS,
        "dgrs": GRS,
        "rank": RankCoupling,
        "antithetic": AntitheticCoupling,
    },
    case_insensitive=True,
)


def register_coupling(name: str, factory: Callable[[], Coupling], *, replace: bool = False) -> None:
    """Make ``coupling=name`` resolve to ``factory()`` everywhere (sampler, CLI, planners).

    Args:
        name: the registry name (case-insensitive).
        factory: a zero-argument callable returning a fresh :class:`Coupling` (a subclass works).
        replace: allow overriding an existing name.

    Raises:
        ValueError: if ``name`` is taken and ``replace`` is False.
        TypeError: if ``factory`` is not callable.
    """
    _COUPLINGS.register(name, factory, replace=replace)


def unregister_coupling(name: str) -> None:
    """Remove ``name`` from the coupling registry (undoes :func:`register_coupling`).

    Raises:
        ValueError: if ``name`` is not registered.
    """
    _COUPLINGS.unregister(name)


def available_couplings() -> list[str]:
    """The registered coupling names."""
    return sorted(_COUPLINGS.names())


def get_coupling(coupling: "str | Coupling") -> Coupling:
    """Resolve a registered coupling name (``rmc``, ``grs``/``dgrs``, ``rank``, ``antithetic``, or one
    added by :func:`register_coupling`) or pass an instance through."""
    if isinstance(coupling, Coupling):
        return coupling
    if coupling in _COUPLINGS:
        cp = _COUPLINGS.make(coupling)
        if not isinstance(cp, Coupling):
            raise TypeError(f"the factory registered for {coupling!r} returned {type(cp).__name__}, not a Coupling")
        return cp
    raise ValueError(f"coupling must be one of {available_couplings()} or a Coupling instance, got {coupling!r}")
