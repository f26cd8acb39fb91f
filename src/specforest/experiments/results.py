"""Benchmark result files: marked sections of ``benchmarks/RESULTS.md``.

Each benchmark script owns one section, delimited by ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->``; regenerating it replaces that block only and leaves the
rest of the file as it was. Files are written atomically.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
from pathlib import Path

import torch

from .io import atomic_write_text

__all__ = ["describe_method", "machine_line", "replace_section"]

_TREE_METHODS = {"dgrs": "D-GRS", "rank": "rank coupling", "antithetic": "antithetic pairs"}


def describe_method(r: dict) -> str:
    """``"D-GRS, K=5 L=3 (B=155)"`` and the like, for a record of any method and tree mode."""
    method = r["method"]
    if method == "standard":
        return "standard sampler"
    if method == "rmc":
        return f"RMC, chain B={r['budget']}"
    if method == "tuned":
        return f"tuned: {r.get('tuned_label', '?')}"
    name = _TREE_METHODS.get(method, method)
    if r.get("tree", "uniform") == "uniform":
        return f"{name}, K={r['K']} L={r['L']} (B={r['budget']})"
    return f"{name}, {r['tree']} tree {r.get('tree_layers')} (B={r['budget']})"


def machine_line() -> str:
    """Date, machine and library versions, for the header of a results table."""
    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{_dt.date.today().isoformat()}, {platform.system()} {platform.machine()} ({cpu}), "
        f"{os.cpu_count()} CPUs, {gpu}, Python {platform.python_version()}, torch {torch.__version__}"
    )


def replace_section(path: str | os.PathLike, name: str, heading: str, body: str) -> Path:
    """Replace (or append) the section ``name`` of the markdown file ``path``.

    Args:
        path: the results file (created if missing).
        name: section key used in the begin/end markers.
        heading: markdown heading line written above the block.
        body: markdown content of the section.
    """
    path = Path(path)
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{heading}\n\n{body.rstrip()}\n{end}"
    text = path.read_text(encoding="utf-8") if path.exists() else "# specforest benchmark results\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    return atomic_write_text(path, text)
