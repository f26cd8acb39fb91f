"""Crash-safe result files: every write goes to a temporary file in the target's
directory and is moved over the target with :func:`os.replace`, so a reader (or a
resumed run) sees either the old file or the new one, never a partial one."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Union

from ..atomic import atomic_write, atomic_write_text

__all__ = ["atomic_write", "atomic_write_text", "load_records", "records_csv"]

PathLike = Union[str, "os.PathLike[str]"]


def load_records(path: PathLike) -> list[dict]:
    """The result records of a ``results.json`` (an empty list if it does not exist).

    Raises:
        ValueError: if the file is not a JSON list of objects (move it away to start afresh).
    """
    path = Path(path)
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); move it away to start afresh") from e
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{path} must hold a JSON list of result objects")
    return data


def records_csv(records: list[dict]) -> str:
    """CSV text of result records: the union of their keys, lists and dicts as JSON."""
    cols: list[str] = []
    for r in records:
        cols += [k for k in r if k not in cols]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    for r in records:
        w.writerow(
            {k: json.dumps(v) if isinstance(v, (list, dict)) else ("" if v is None else v) for k, v in r.items()}
        )
    return buf.getvalue()
