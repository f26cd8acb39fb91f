"""Figures, an optional part of specforest: matplotlib comes with the ``cli`` extra.

:func:`pyplot` gives ``matplotlib.pyplot`` on the non-interactive Agg backend
(or says which extra to install); :func:`save_figure` writes a PNG atomically.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .atomic import atomic_write

__all__ = ["pyplot", "save_figure"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (figures are files, never windows).

    Raises:
        ImportError: naming the extra to install if matplotlib is missing.
    """
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("figures need matplotlib, which is not installed: pip install 'specforest[cli]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: "str | os.PathLike[str]", dpi: int = 150) -> Path:
    """Save a matplotlib figure as PNG atomically (temporary name, then rename) and close it."""
    plt = pyplot()
    path = Path(path)
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi, bbox_inches="tight"), binary=True)
    finally:
        plt.close(fig)
    return path
