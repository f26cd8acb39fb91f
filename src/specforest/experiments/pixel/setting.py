"""The pixel experiment's protocol: the paper's trees and churns, initial states, the sweep's files."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..common import derive_seed
from .models import DEFAULT_MODEL, pixel_model

__all__ = [
    "DETERMINISTIC_STEPS",
    "KEY_FIELDS",
    "MODEL_NAME",
    "PAPER_SPEEDUPS",
    "SWEEP_CHURNS",
    "SWEEP_TREES",
    "initial_states",
    "samples_path",
]

SWEEP_TREES = ((2, 3), (2, 5), (3, 4), (4, 4))
"""The paper's ``(K, L)`` pairs of Sec. 5.2, budgets 14, 62, 120, 340."""

SWEEP_CHURNS = (0.1, 0.3, 0.6)
"""The paper's churn levels of Sec. 5.2."""

PAPER_SPEEDUPS = {"CIFAR-10 (32x32x3, EDM)": (2.2, 2.6), "FFHQ (64x64x3, EDM)": (2.0, 2.2)}
"""Speedup ranges the paper reports in Sec. 5.2 (a different model and dimension)."""

KEY_FIELDS = ("method", "K", "L", "churn", "samples", "steps", "grid", "seed", "prefetch", "verify", "mode")
"""Fields that identify a configuration in a results file (a resumed sweep skips
a configuration whose key is already present)."""

DETERMINISTIC_STEPS = 2
"""Deterministic Euler steps of both grids: the step from 1 and the step into 0."""

MODEL_NAME = pixel_model(DEFAULT_MODEL).description
"""The record's ``model`` of a digits run (:data:`~.models.PIXEL_MODELS` declares every model's)."""

# labels and x_T, the sampling noise, and the calibration run of tree="optimal"
# come from separate streams of one seed
STREAM_INIT, STREAM_NOISE, STREAM_CALIBRATION_X, STREAM_CALIBRATION_NOISE = 0, 1, 7, 8


def initial_states(n: int, seed: int, model: str = DEFAULT_MODEL) -> "tuple[torch.Tensor, torch.Tensor | None]":
    """Labels ``(n,)`` uniform over the model's classes and ``x_T (n, *shape) ~ N(0, I)``, from ``seed``.

    Args:
        n: states.
        seed: the run's seed.
        model: a name of :data:`~.models.PIXEL_MODELS` (``digits``: ``shape = (1, 8, 8)``, ten classes;
            ``natural32`` / ``natural64``: ``(3, 32, 32)`` / ``(3, 64, 64)``, unconditional).

    Returns:
        ``(x_T, labels)``: float32 ``(n, *shape)`` and long ``(n,)``, ``None`` for an unconditional model
        (whose ``x_T`` is the first draw of the same stream).
    """
    m = pixel_model(model)
    g = torch.Generator().manual_seed(derive_seed(seed, STREAM_INIT))
    labels = torch.randint(0, m.num_classes, (n,), generator=g) if m.conditional else None
    return torch.randn((n, *m.shape), generator=g), labels


def samples_path(out_dir: str | os.PathLike[str], record: dict) -> Path:
    """Where a sweep keeps the samples of a record: ``out_dir/samples/<method>_K<K>_L<L>_churn<churn>.npz``."""
    r = record
    return Path(out_dir) / "samples" / f"{r['method']}_K{r['K']}_L{r['L']}_churn{r['churn']:g}.npz"
