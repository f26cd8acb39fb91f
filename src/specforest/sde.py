"""Gaussian chains tabulated per step: what the engine samples (:class:`GaussianChain`, with its tables
on a device, :class:`StepTables`). The paper's own chain, the discretized reverse SDE, is
:mod:`specforest.reverse_sde`'s (importable from here as before); the grids are :mod:`specforest.schedules`'.

Conventions
-----------
* The *noise level* ``t`` is the forward time of the linear path
  ``x_t = (1 - t) x_0 + t xi``: data at ``t = 0``, pure noise at ``t = 1``. A model is a velocity
  ``v(x, t) = E[xi - x_0 | x_t = x]``.
* A *time grid* is a decreasing tensor of levels ``t_0 > ... > t_T`` of shape ``(T + 1,)`` with
  ``t_0 <= 1`` and ``t_T = 0``, passed as ``sigmas`` (the name every signature gives it, as
  k-diffusion's do). Step ``n`` moves the state from ``t_n`` to ``t_{n + 1}``.
* A step's transition is Gaussian given the state and the model's velocity ``v`` at it:
  ``mean = a y + c v`` (plus the past predictions' terms of a multistep chain, its ``past`` table), standard
  deviation ``scale``. Its *reverse drift* ``b = (mean - y) / gamma_n`` with ``gamma_n = t_n - t_{n + 1}``
  is ``-f v - k y`` (:meth:`GaussianChain.drift`; the paper's eq. 35 for its own chain,
  :mod:`specforest.reverse_sde`).
* A step whose transition would carry no noise is *deterministic*: the step from ``t = 1`` (where
  ``g`` diverges and ``b`` contains ``y / 0``) and the step into ``t = 0``. It is a plain Euler step of
  the probability-flow ODE, ``y + (t_{n + 1} - t_n) v(y, t_n)``, which every sampler takes, counts as
  one target call, and never speculates on (ERRATA 6, 8).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .carried import NOTHING, Carried

# the grids lived here; they are the schedules module's now, and stay importable from here
from .schedules import MAX_STEPS, check_sigmas, flow_match_grid, shift_sigmas, uniform_grid
from .stages import Stages, evaluate

__all__ = [
    "MAX_STEPS",
    "GaussianChain",
    "StepTables",
    "flow_match_grid",
    "shift_sigmas",
    "uniform_grid",
]


def _run_ends(stochastic: torch.Tensor) -> torch.Tensor:
    """``(T + 1,)``: the first index ``>= n`` of a deterministic step (or ``T``), per ``n``."""
    # (on Python lists: a loop of tensor element writes costs ~500 dispatches a run)
    T = stochastic.numel()
    ends, flags = [T] * (T + 1), stochastic.tolist()
    for n in range(T - 1, -1, -1):
        ends[n] = ends[n + 1] if flags[n] else n
    return torch.tensor(ends, dtype=torch.long)


class GaussianChain:
    """A Gaussian Markov chain on the linear path, tabulated per step: what the engine samples.

    Step ``n`` moves a state ``y`` at level ``t_n = sigmas[n]`` to

        ``y' ~ N(a[n] y + c[n] v(y, t_n), scale[n]^2 I)``

    with ``v`` the model's velocity, so ``y - t_n v`` is its clean-image prediction. Every
    sampler :mod:`specforest.chains` registers is such a chain once written in the linear path's
    coordinates; a step with ``scale[n] = 0`` is deterministic (a point mass, never speculated).
    ``init_a``, ``init_scale``: the state the chain starts from is ``init_a x + init_scale z`` for the
    caller's ``x`` at ``sigmas[0]`` (EDM's churned Euler starts from the churned ``x-hat``).

    Attributes:
        sigmas: ``(T + 1,)`` float64 levels ``t_n`` of the states, decreasing to 0.
        name: the chain's name; ``params``: its parameters (what a run's record says).

    A multistep sampler also reads the clean-image predictions ``p_0, ..., p_{h - 1}`` the model gave
    ``1 .. h`` steps before (its :attr:`history` ``h``: 1 for DPM++ 2M SDE, 2 for DPM++ 3M SDE): its mean
    is ``a[n] y + c[n] v + sum_j past[n, j] p_j`` (``past[n, j] = 0`` where step ``n`` has no such
    prediction, ``n <= j``). What a state hands on is :attr:`carries`' fixed linear combination of it and
    its velocity: its prediction by default, the start of a DPM++ SDE step's half-steps for ``dpmpp_sde``. The covariance still depends on the schedule alone, so the chain on
    ``(y, p_0, ..., p_{h - 1})`` is Gaussian in ``y`` given the ``p``: the engine carries them beside
    each state (:class:`~specforest.carried.Carried`).

    Derived ``(T,)`` float64 tensors: ``a``, ``c``, ``scale``, ``gamma`` (``sigmas[n] - sigmas[n + 1]``),
    ``stochastic`` (``scale > 0``), ``drift_f`` and ``drift_k`` (the reverse drift
    ``b = -drift_f v - drift_k y`` with ``mean = y + gamma b``, what the ``drift`` draft freezes).
    """

    name = "custom"

    def _set_tables(
        self,
        sigmas: torch.Tensor,
        a: torch.Tensor,
        c: torch.Tensor,
        scale: torch.Tensor,
        drift_f: Optional[torch.Tensor] = None,
        drift_k: Optional[torch.Tensor] = None,
        init_a: float = 1.0,
        init_scale: float = 0.0,
        monotone: bool = True,
        past: Optional[torch.Tensor] = None,
        stages: Optional[Stages] = None,
        carry: Optional[torch.Tensor] = None,
        times: Optional[torch.Tensor] = None,
    ) -> None:
        t = check_sigmas(sigmas, monotone)
        T = t.numel() - 1
        tabs = {}
        for key, given in (("a", a), ("c", c), ("scale", scale)):
            tab = torch.as_tensor(given, dtype=torch.float64).reshape(-1)
            if tab.numel() != T or not bool(torch.isfinite(tab).all()):
                raise ValueError(f"the chain's {key} must be {T} finite numbers, one per step")
            tabs[key] = tab
        past = torch.zeros(T, 0, dtype=torch.float64) if past is None else torch.as_tensor(past, dtype=torch.float64)
        if past.dim() != 2 or past.shape[0] != T or not bool(torch.isfinite(past).all()):
            raise ValueError(f"the chain's past coefficients must be (T, history) = ({T}, h) finite numbers")
        if carry is not None:
            carry = torch.as_tensor(carry, dtype=torch.float64)
            if carry.shape != (T, 2) or not bool(torch.isfinite(carry).all()):
                raise ValueError(f"the chain's carry coefficients must be (T, 2) = ({T}, 2) finite numbers")
        if bool((tabs["scale"] < 0).any()):
            raise ValueError("the chain's scale must be >= 0 at every step")
        gamma = t[:-1] - t[1:]
        if drift_f is None:
            # mean = y + gamma b with b = -drift_f v - drift_k y (none between equal levels)
            g = torch.where(gamma == 0, torch.ones_like(gamma), gamma)
            drift_f, drift_k = -tabs["c"] / g, (1.0 - tabs["a"]) / g
        stochastic = tabs["scale"] > 0
        for key, val in (
            ("sigmas", t),
            ("_a", tabs["a"]),
            ("_c", tabs["c"]),
            ("_scale", tabs["scale"]),
            ("_past", past),
            ("_carry", carry),
            ("_stages", stages),
            ("_times", times),
            ("_gamma", gamma),
            ("_drift_f", drift_f),
            ("_drift_k", drift_k),
            ("_stochastic", stochastic),
            ("_run_end", _run_ends(stochastic)),
            ("init_a", float(init_a)),
            ("init_scale", float(init_scale)),
        ):
            object.__setattr__(self, key, val)

    @property
    def params(self) -> dict:
        """The chain's parameters, by name (recorded with a run's results)."""
        return {}

    @property
    def steps(self) -> int:
        """Number of steps ``T``."""
        return self.sigmas.numel() - 1

    @property
    def a(self) -> torch.Tensor:
        """``(T,)`` coefficient of the state in the mean."""
        return self._a

    @property
    def c(self) -> torch.Tensor:
        """``(T,)`` coefficient of the velocity in the mean."""
        return self._c

    @property
    def past(self) -> torch.Tensor:
        """``(T, h)`` coefficients of the past predictions in the mean (``h = 0``: a one-step sampler)."""
        return self._past

    @property
    def history(self) -> int:
        """``h``, the past predictions the mean reads: the engine carries them (:class:`~specforest.carried.Carried`)."""
        return self._past.shape[1]

    @property
    def carries(self) -> torch.Tensor:
        """``(T, 2)`` float64 ``(k_y, k_v)``: a state ``y`` at step ``n`` with velocity ``v`` hands its children
        ``k_y[n] y + k_v[n] v`` to carry (:meth:`StepTables.carry`). By default its prediction ``y - sigmas[n] v``
        (``(1, -sigmas[n])``); a chain that carries another quantity declares it (:meth:`specforest.chains.Chain.carries`)."""
        if self._carry is not None:
            return self._carry
        return torch.stack([torch.ones_like(self.sigmas[:-1]), -self.sigmas[:-1]], 1)

    @property
    def stages(self) -> int:
        """``s``, the model calls a step makes (:mod:`specforest.stages`; 1: one call at the state)."""
        return 1 if self._stages is None else self._stages.count

    @property
    def standard_calls(self) -> int:
        """The model calls of the standard sampler's run (``tree=None``): ``T`` for one call a step, each
        step's stages for a chain of several (Heun's ``2 T - 1``: its last step makes one)."""
        return self.steps if self._stages is None else sum(self._stages.used)

    @property
    def stage_tables(self) -> Optional[Stages]:
        """The stage tableau (float64, CPU), or ``None`` for a one-stage chain."""
        return self._stages

    @property
    def call_times(self) -> Optional[torch.Tensor]:
        """``(T, s)`` float64, the model's own time input at each step's calls where the chain declares it
        (:meth:`specforest.chains.Chain.call_times`), or ``None``: the model maps the level."""
        return self._times

    @property
    def gamma(self) -> torch.Tensor:
        """``(T,)`` reverse-time step sizes ``sigmas[n] - sigmas[n + 1]``."""
        return self._gamma

    @property
    def scale(self) -> torch.Tensor:
        """``(T,)`` transition std; 0 on deterministic steps."""
        return self._scale

    @property
    def drift_f(self) -> torch.Tensor:
        """``(T,)`` the velocity's coefficient in the reverse drift (``b = -drift_f v - drift_k y``)."""
        return self._drift_f

    @property
    def drift_k(self) -> torch.Tensor:
        """``(T,)`` the state's coefficient in the reverse drift."""
        return self._drift_k

    @property
    def stochastic(self) -> torch.Tensor:
        """``(T,)`` bool, True where the step is a Gaussian transition."""
        return self._stochastic

    @property
    def run_end(self) -> torch.Tensor:
        """``(T + 1,)`` long: the end (exclusive) of the stochastic run at ``n``."""
        return self._run_end

    def tables(self, device: "torch.device | str", dtype: torch.dtype) -> "StepTables":
        """The per-step coefficients on ``device`` in ``dtype``, made once per (device, dtype) and cached."""
        key = (str(device), dtype)
        cache = self.__dict__.setdefault("_tables", {})
        if key not in cache:
            cache[key] = StepTables.build(self, torch.device(device), dtype)
        return cache[key]

    def mean_from_velocity(self, y: torch.Tensor, v: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """Transition mean ``a[step] y + c[step] v`` (eq. 36 for the paper's chain).

        Args:
            y: ``(M, ..., D)`` flattened states at their steps.
            v: ``(M, ..., D)`` velocities ``v(y, sigmas[step])`` (broadcastable).
            step: ``(M, ...)`` long step indices in ``[0, T)``, one per state.

        Returns:
            ``(M, ..., D)`` next-state means.
        """
        return self.tables(y.device, y.dtype).mean(y, v, step)

    def mean_from_drift(self, y: torch.Tensor, drift: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """``y + gamma b`` per state, for a given reverse drift ``b`` (eq. 5); shapes as :meth:`mean_from_velocity`."""
        return y + self.tables(y.device, y.dtype).gamma[step][..., None] * drift

    def drift(self, y: torch.Tensor, v: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """Reverse drift ``b`` (``(mean - y) / gamma``); shapes as :meth:`mean_from_velocity`."""
        tab = self.tables(y.device, y.dtype)
        return -tab.drift_f[step][..., None] * v - tab.drift_k[step][..., None] * y


@dataclass(frozen=True)
class StepTables:
    """Per-step coefficients of a :class:`GaussianChain` on one device, in one dtype.

    Everything the round reads per step, indexed by step ``n`` (``(T,)``, with
    ``sig`` ``(T + 1,)``): the sampler gathers from these instead of recomputing
    or copying them. ``mean = a * y + c * v`` is eq. (36) (the Euler step on
    deterministic steps); the drift is ``b = -drift_f * v - drift_k * y``;
    ``scale_safe`` is ``scale`` with 1 on deterministic steps.
    """

    sig: torch.Tensor
    gamma: torch.Tensor
    scale: torch.Tensor
    scale_safe: torch.Tensor
    a: torch.Tensor
    c: torch.Tensor
    drift_f: torch.Tensor
    drift_k: torch.Tensor
    stochastic: torch.Tensor
    run_end: torch.Tensor
    ac: Optional[torch.Tensor] = None  # (T, 2): a and c side by side, one gather for both
    past: Optional[torch.Tensor] = None  # (T, h): the past predictions' coefficients, or None (history 0)
    init_a: float = 1.0  # the chain starts from init_a x + init_scale z (see GaussianChain)
    init_scale: float = 0.0
    tableau: Optional[Stages] = None  # the stage tableau (specforest.stages), or None (one call a step)
    keep: Optional[torch.Tensor] = None  # (T, 2): what a state hands on, k_y y + k_v v; None: its prediction
    times: Optional[torch.Tensor] = None  # (T, s) float64: each call's time input for the model, or None (its level)
    calls: Optional[torch.Tensor] = None  # (T + 1,) long: the model calls each step makes (0 at T: finished)

    def __post_init__(self) -> None:
        if self.ac is None:
            object.__setattr__(self, "ac", torch.stack([self.a, self.c], -1))
        if self.calls is None:
            T = self.sig.numel() - 1
            used = [1] * T if self.tableau is None else list(self.tableau.used)
            object.__setattr__(self, "calls", torch.tensor([*used, 0], device=self.sig.device))

    @classmethod
    def build(cls, chain: GaussianChain, device: torch.device, dtype: torch.dtype) -> "StepTables":
        to = lambda x: x.to(device, dtype)  # noqa: E731
        # the scale with 1 on deterministic steps: for problems that are never verified but must stay finite
        safe = torch.where(chain.scale > 0, chain.scale, torch.ones_like(chain.scale))
        return cls(
            to(chain.sigmas),
            to(chain.gamma),
            to(chain.scale),
            to(safe),
            to(chain.a),
            to(chain.c),
            to(chain.drift_f),
            to(chain.drift_k),
            chain.stochastic.to(device),
            chain.run_end.to(device),
            past=to(chain.past) if chain.history else None,
            tableau=None if chain.stage_tables is None else chain.stage_tables.to(device, dtype),
            init_a=chain.init_a,
            init_scale=chain.init_scale,
            keep=None if chain._carry is None else to(chain._carry),
            # (float64 whatever the run's dtype: a time input is the model's, passed as the chain declares it)
            times=None if chain.call_times is None else chain.call_times.to(device, torch.float64),
        )

    @property
    def history(self) -> int:
        """``h``, the past predictions the mean reads (:attr:`GaussianChain.history`)."""
        return 0 if self.past is None else self.past.shape[1]

    @property
    def stages(self) -> int:
        """``s``, the sequential model calls a step makes (:attr:`GaussianChain.stages`)."""
        return 1 if self.tableau is None else self.tableau.count

    def calls_at(self, step: int) -> int:
        """The model calls step ``step`` makes where every row of a call is at it (the lockstep round's)."""
        return 1 if self.tableau is None else self.tableau.used[step]

    def velocity(
        self,
        target: Any,
        y: torch.Tensor,
        step: torch.Tensor,
        traj: torch.Tensor,
        *,
        sig: Optional[torch.Tensor] = None,
        rows_key: Hashable = None,
        features: bool = False,
        upto: Optional[int] = None,
    ) -> Any:
        """The velocity the mean reads at states ``y (M, D)`` at steps ``step (M,)`` of trajectories
        ``traj (M,)``: one call of ``target`` for a one-stage chain, ``s`` sequential calls for a chain
        of ``s`` stages (:func:`specforest.stages.evaluate`), each call given its declared time input where the
        chain declares them (:attr:`times`). ``sig``: the states' levels ``(M,)`` where the caller has them
        (default ``sig[step]``); ``rows_key``, ``features``, ``upto`` as there."""
        sig = self.sig[step] if sig is None else sig
        times = None if self.times is None else self.times[step]
        return evaluate(
            self.tableau, target, y, sig, step, traj, rows_key=rows_key, features=features, upto=upto, times=times
        )

    def mean(self, y: torch.Tensor, v: torch.Tensor, step: torch.Tensor, carried: Carried = NOTHING) -> torch.Tensor:
        """``a[step] * y + c[step] * v (+ sum_j past[step, j] p_j)``: ``y, v (M, ..., D)``, ``step (M, ...)``,
        ``carried`` the states' past predictions (:class:`~specforest.carried.Carried`, ``(M, ..., h, D)``).
        Without them the term is left out: a draft's mean, to which the engine adds it
        (:func:`~specforest.drafting.carried_term`).

        Written as ``addcmul(c v, a, y)``, the same ops as an affine draft
        ``addcmul(C, A, y)`` with the velocity frozen: a draft frozen at the
        state it drafts from gives exactly the target mean (``delta = 0``).
        """
        ac = self.ac[step]  # (..., 2): slices of it are views, cheaper than a second gather
        m = torch.addcmul(ac[..., 1:] * v, ac[..., :1], y)
        return self.add_past(m, step, carried)

    def add_past(self, m: torch.Tensor, step: torch.Tensor, carried: Carried) -> torch.Tensor:
        """``m + sum_j past[step, j] p_j``: ``m (M, ..., D)`` with the carried term of states at steps
        ``step (M, ...)`` carrying ``carried`` (``(M, ..., h, D)``); ``m`` itself for history 0."""
        return m if carried.p is None else carried.added_to(m, self.past[step])

    def past_term(self, step: torch.Tensor, carried: Carried) -> Optional[torch.Tensor]:
        """``(M, ..., D)`` the mean's carried term ``sum_j past[step, j] p_j`` at steps ``step (M, ...)`` of
        states carrying ``carried`` (``(M, ..., h, D)``), or ``None`` for a chain of history 0."""
        return None if carried.p is None else carried.term(self.past[step])

    def prediction(self, y: torch.Tensor, v: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """The clean-image prediction ``y - sig[step] v`` of states ``y (M, ..., D)`` with velocities ``v`` at
        steps ``step (M, ...)`` (``0 <= step <= T``)."""
        return torch.addcmul(y, self.sig[step][..., None], v, value=-1.0)

    def hand_on(self, y: torch.Tensor, x0: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """:meth:`carry` of states ``y (M, ..., D)`` at steps ``step (M, ...)`` (``< T``) whose prediction is
        ``x0`` (``(M, ..., D)``) rather than given by a velocity: ``u y + w x0`` with the chain's declared
        ``(u, w)`` (:meth:`specforest.chains.Chain.carries`), ``x0`` itself by default. What a draft hands on
        from a state it has not evaluated, with another state's prediction (:func:`specforest.drafting.carried_term`)."""
        if self.keep is None:
            return x0
        k = self.keep[step]
        # keep = (u + w, -w sig): w = -keep_v / sig
        w = -k[..., 1:] / self.sig[step][..., None]
        return torch.addcmul(w * x0, k[..., :1] - w, y)

    @property
    def hands_on_prediction(self) -> bool:
        """Whether what a state hands on is its prediction alone (:meth:`hand_on` of any state is ``x0``),
        not a combination with the state itself (``dpmpp_sde``'s step start)."""
        return self.keep is None

    def carry(self, y: torch.Tensor, v: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """What the states' children carry (:meth:`Carried.pushed`), ``(M, ..., D)``, from states ``y (M, ..., D)``
        with velocities ``v`` at steps ``step (M, ...)``: the chain's declared ``keep[step, 0] y + keep[step, 1] v``
        (:attr:`GaussianChain.carries`), by default the clean-image prediction ``y - sig[step] v``."""
        if self.keep is None:
            return self.prediction(y, v, step)
        k = self.keep[step]
        return torch.addcmul(k[..., 1:] * v, k[..., :1], y)
