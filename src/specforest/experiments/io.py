"""Crash-safe result files: every write goes to a temporary file in the target's
directory and is moved over the target with :func:`os.replace`, so a reader (or a
resumed run) sees either the old file or the new one, never a partial one."""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Union

__all__ = ["atomic_write", "atomic_write_text", "load_records", "records_csv"]

PathLike = Union[str, "os.PathLike[str]"]


def atomic_write(path: PathLike, write: Callable[[IO], None], *, binary: bool = False) -> Path:
    """Write ``path`` atomically.

    Args:
        path: destination file; its directory is created if missing.
        write: called with an open file object (text or binary) to fill.
        binary: open the temporary file in binary mode.

    Returns:
        The destination path.

    Raises:
        Whatever ``write`` raises; the destination is then left untouched and
        the temporary file is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600; give the file the mode a plain open() would
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def atomic_write_text(path: PathLike, text: str) -> Path:
    """Write the string ``text`` to ``path`` atomically (UTF-8)."""
    return atomic_write(path, lambda f: f.write(text))


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
        w.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else ("" if v is None else v) for k, v in r.items()})
    return buf.getvalue()
