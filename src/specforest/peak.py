"""The peak memory of a command, measured in a fresh process.

What a memory limit promises is checked by measuring, not by estimating: run
the command as its own process and read its peak resident set. The process is
started and waited for by a small launcher, not by the caller: Python starts
children with ``vfork``, the kernel keeps ``ru_maxrss`` across ``execve``, and
so a child of a large process (a test session of several GB) would report at
least its parent's peak, whatever it held itself. The launcher is a bare
interpreter of a few MB, which bounds what its child can inherit.

Used by ``tests/test_memory.py`` and ``benchmarks/memory.py``; on CUDA the
device's peak is read by the command itself (``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

__all__ = ["Measured", "run_measured"]

# waits for the measured process, then writes its exit code and ru_maxrss (KiB) to argv[1]
_LAUNCHER = r"""
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}")
"""


@dataclass(frozen=True)
class Measured:
    """A finished command and its peak.

    Attributes:
        returncode: its exit code (negative: killed by that signal).
        peak_bytes: its peak resident set in bytes, the processes it waited for included.
        stdout, stderr: what it printed.
    """

    returncode: int
    peak_bytes: int
    stdout: str
    stderr: str


def run_measured(
    argv: Sequence[str],
    *,
    env: Optional[Mapping[str, str]] = None,
    cwd: Union[str, Path, None] = None,
) -> Measured:
    """Run ``argv`` in a fresh process (behind a small launcher) and measure its peak resident set.

    Args:
        argv: the command, e.g. ``[sys.executable, "-m", "specforest", "gmm", ...]``.
        env: its environment (default: this process's).
        cwd: its working directory.

    Returns:
        A :class:`Measured`.

    Raises:
        TypeError: if ``argv`` is not a non-empty sequence of strings.
    """
    if isinstance(argv, (str, bytes)) or not argv or not all(isinstance(a, str) for a in argv):
        raise TypeError("argv must be a non-empty sequence of str")
    with (
        tempfile.TemporaryFile("w+") as out,
        tempfile.TemporaryFile("w+") as err,
        tempfile.TemporaryDirectory() as tmp,
    ):
        report = Path(tmp) / "usage"
        launcher = [sys.executable, "-c", _LAUNCHER, str(report), *argv]
        subprocess.run(launcher, stdout=out, stderr=err, env=None if env is None else dict(env), cwd=cwd, check=True)
        returncode, maxrss = (int(v) for v in report.read_text().split())
        out.seek(0)
        err.seek(0)
        return Measured(returncode, maxrss * 1024, out.read(), err.read())
