"""The Gaussian-mixture experiment of paper Sec. 5.1 (Figures 3 and 7).

Setting (defaults of :class:`GMMSetting`): a mixture of 5 isotropic Gaussians in
``d = 500`` with means ``U([-2, 2]^d)`` and stds ``U([0.10, 0.25])`` drawn from
``mixture_seed``; the churned reverse SDE with ``T = 30`` steps, churn 0.1, on
diffusers' flow-matching grid (ERRATA 6); 100 trajectories from ``x_T ~ N(0, I)``.

Methods: ``standard`` (no tree, exactly ``T`` NFE), ``rmc`` (Algorithm 2 on a
chain of ``B`` drafted states) and ``dgrs`` (Algorithm 3 on the uniform
``(K, L)`` tree, ``B = K + ... + K^L``). Budgets count drafted states (ERRATA 7).

Speedups are reported in two accountings:

* ``speedup`` = ``T / NFE`` per trajectory (every target call counts, including
  the deterministic first and last Euler steps and the first root fetch);
* ``speedup_paper`` = ``(T - T_det) / (NFE - T_det)``, stochastic steps per
  stochastic-phase call, with ``T_det`` the deterministic steps of the grid
  (2 on both grids); this is the paper's accounting.

For a chain of several calls a step, ``T`` and ``T_det`` are the standard run's calls
(``standard_calls``, Heun's ``2 T - 1``) and those of its steps without noise.

Modules: :mod:`.setting` (the fixed setting and initial states), :mod:`.run`
(one configuration), :mod:`.sweep` (the resumable ``(K, L)`` sweep) and
:mod:`.report` (figures and text).
"""

from ..common import COUPLING_OF, METHOD_LABELS, METHODS, SWEEP_METHODS, method_tree
from .report import format_result, format_summary, write_figures
from .run import GMMRun, run_config, simulate
from .setting import KEY_FIELDS, GMMSetting, initial_states, mixture_fingerprint
from .sweep import SweepResult, load_results, result_key, run_sweep, sweep_configs, write_results

__all__ = [
    "COUPLING_OF",
    "KEY_FIELDS",
    "METHODS",
    "METHOD_LABELS",
    "SWEEP_METHODS",
    "GMMRun",
    "GMMSetting",
    "SweepResult",
    "format_result",
    "format_summary",
    "initial_states",
    "load_results",
    "method_tree",
    "mixture_fingerprint",
    "result_key",
    "run_config",
    "run_sweep",
    "simulate",
    "sweep_configs",
    "write_figures",
    "write_results",
]
