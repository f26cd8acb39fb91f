"""Where a run happens, in what precision, and on how many CPU threads, when the user does not say.

The command-line tool, the benchmarks and :func:`specforest.distributed.init_from_env` read their
defaults here, so that every entry point makes the same choice.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from .allocator import keep_freed_memory

__all__ = ["default_device", "default_dtype", "set_threads"]


def default_device() -> str:
    """``"cuda"`` when a CUDA device is available, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: Union[str, torch.device]) -> str:
    """The network's dtype name on ``device``: ``"float16"`` on CUDA (``cuda``, ``cuda:1``, ...),
    ``"float32"`` elsewhere (half precision on a CPU is slow and, for some kernels, missing)."""
    return "float16" if str(device).startswith("cuda") else "float32"


def set_threads(threads: Optional[int]) -> int:
    """Set up this process's CPU work: torch's intra-op threads and an allocator that keeps freed memory.

    It changes the whole process (:func:`specforest.allocator.keep_freed_memory`), so the library
    never calls it by itself; the command-line tool and the benchmarks do.

    Args:
        threads: torch's intra-op threads; ``None`` for ``$OMP_NUM_THREADS`` when it is set to a
            count >= 1, else the CPUs of this process divided among ``$LOCAL_WORLD_SIZE`` processes
            (torchrun's processes on this machine), at least 1.

    Returns:
        The thread count set.
    """
    keep_freed_memory()
    if threads is None:
        env = os.environ.get("OMP_NUM_THREADS", "")
        if env.isdigit() and int(env) >= 1:
            threads = int(env)
        else:
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            threads = max(1, cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    torch.set_num_threads(int(threads))
    return int(threads)
