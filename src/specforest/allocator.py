"""Steady CPU memory allocation: keep freed memory in the process instead of returning it each round.

A speculative round on the CPU allocates its trees (``(batch, V, D)`` states, noise,
evaluations) and frees them at its end. With glibc's default ``malloc``, blocks
above a threshold (128 KiB, raised as large blocks are freed, up to 32 MiB)
are mapped fresh for each allocation and unmapped when freed, and the top of
the heap is trimmed back to the system whenever enough of it is free: every
round then pays page faults on memory it had a moment ago, and how many
depends on the process's allocation history, so that a round's time, and the
tuner's timings, depend on what the process did before (measurements in
``docs/latency.md``, "The allocator").

:func:`keep_freed_memory` sets glibc's thresholds so that freed memory stays
with the process (its resident size stays at its peak). It changes the whole
process, so the library never calls it by itself; the command-line tool and
the benchmarks do. PyTorch's own CPU tuning guides make the same point by
preloading jemalloc or tcmalloc, which this does not need.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

__all__ = ["keep_freed_memory"]

# mallopt(3) parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

TRIM_THRESHOLD = 1 << 30
"""Free memory at the top of the heap kept before trimming: 1 GiB."""
MMAP_THRESHOLD = 1 << 25
"""Blocks below this come from the heap, not fresh mappings: 32 MiB, the largest glibc accepts
everywhere (and the ceiling its dynamic threshold would reach by itself)."""
TOP_PAD = 1 << 26
"""Extra memory requested each time the heap grows: 64 MiB."""


@functools.lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse (once per process); ``False`` where there is no glibc.

    Returns:
        Whether the thresholds were set (Linux with glibc), else ``False`` and nothing changed.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = [mallopt(p, v) for p, v in ((_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_MMAP_THRESHOLD, MMAP_THRESHOLD))]
    done.append(mallopt(_M_TOP_PAD, TOP_PAD))
    return all(r == 1 for r in done)
