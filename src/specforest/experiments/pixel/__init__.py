"""The pixel-space experiment of paper Sec. 5.2 (Figures 4 and 8), on digits (and one configuration on
the natural-image models).

The paper runs EDM's CIFAR-10 and FFHQ denoisers; this experiment runs the same
protocol on the package's small class-conditional digits model
(:mod:`specforest.models.digits`, ``1 x 8 x 8``, ``d = 64``), which trains in
minutes on a CPU. Speedups are therefore those of a different, much
lower-dimensional model: the paper reports 2.2-2.6x on CIFAR-10 and 2.0-2.2x on
FFHQ, and the mismatch between draft and target grows with ``sqrt(d)``.

Protocol (defaults): ``T = 100`` steps on diffusers' flow-matching grid
(noise levels ``linspace(1, 1e-3, T)`` then 0, ERRATA 6: the first and last
steps are deterministic Euler steps; the last stochastic level 1e-3 is the
paper's lower clip of the EDM noise level), churn ``eps``, 100 images with
labels drawn uniformly from the ten classes. Methods
(:data:`~specforest.experiments.common.METHODS`): ``standard`` (no tree,
exactly ``T`` NFE), ``rmc`` (Algorithm 2 on a chain of ``B`` drafted states;
``K, L`` recorded as ``(1, B)``), ``dgrs`` (Algorithm 3 on the uniform
``(K, L)`` tree, ``B = K + ... + K^L``, ERRATA 7), and the ``rank`` and
``antithetic`` couplings on the same trees.

Conditioning: the labels are a ``(batch,)`` tensor passed as ``cond``; the sampler
indexes per-trajectory tensors per row, so the nodes of different trajectories
share one batched call with their own labels, and one :func:`specforest.sample`
call covers every class.

Randomness: ``seed`` drives the labels and ``x_T`` (one stream) and the
sampling noise (another), so every method sees the same labels and initial
states at a seed. Speedups are ``T / NFE`` per image (every target call counts,
including both deterministic steps and the first root fetch) and, in the
paper's accounting, ``(T - 2) / (NFE - 2)``.

Each run also reports the shipped classifier's accuracy against the
conditioning label. ``lazy=True`` realizes only the visited tree nodes: the same
law of samples and NFE at a fraction of the compute, but its wall-clock is not
that of a batched run; use full mode to measure wall-clock.

One configuration (:func:`simulate`) also runs the unconditional natural-image models
(``model_name="natural32"`` or ``"natural64"``, ``3 x 32 x 32`` / ``3 x 64 x 64``): no labels, no
classifier accuracy (null in the record). :mod:`.models` declares the models (:data:`PIXEL_MODELS`),
which ``specforest pixel``, ``generate pixel`` and ``tune`` take as ``--model``.

Modules: :mod:`.models` (the models), :mod:`.setting` (the protocol's constants, initial states, the sweep's
file layout), :mod:`.run` (one configuration), :mod:`.sweep` (the resumable
sweep of Figure 4) and :mod:`.report` (figures and text).
"""

from ..common import COUPLING_OF, METHOD_LABELS, METHODS, SWEEP_METHODS, SweepResult, budget_of
from .models import PIXEL_MODELS, PixelModel, pixel_model
from .report import format_result, format_summary, image_grid, write_figures
from .run import ROW_BYTES, PixelRun, simulate
from .setting import KEY_FIELDS, PAPER_SPEEDUPS, SWEEP_CHURNS, SWEEP_TREES, initial_states, samples_path
from .sweep import run_sweep, sweep_configs

__all__ = [
    "COUPLING_OF",
    "KEY_FIELDS",
    "METHODS",
    "METHOD_LABELS",
    "PAPER_SPEEDUPS",
    "PIXEL_MODELS",
    "ROW_BYTES",
    "SWEEP_CHURNS",
    "SWEEP_METHODS",
    "SWEEP_TREES",
    "PixelModel",
    "PixelRun",
    "SweepResult",
    "budget_of",
    "format_result",
    "format_summary",
    "image_grid",
    "initial_states",
    "pixel_model",
    "run_sweep",
    "samples_path",
    "simulate",
    "sweep_configs",
    "write_figures",
]
