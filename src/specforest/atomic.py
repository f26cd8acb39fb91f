"""Atomic file writes: a result is either the old file or the whole new one, never half-written.

The file is written to a temporary name in the destination's directory,
flushed to disk, then renamed over the destination (``os.replace`` is atomic
on POSIX and Windows), so an interrupt at any point leaves nothing partial.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Union

__all__ = ["atomic_write", "atomic_write_text"]

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
