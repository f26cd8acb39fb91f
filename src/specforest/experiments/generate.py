"""``specforest generate``: a data set of samples, on one process or many, resumable, nothing lost or twice.

The job ``(model, sampler options, count M, seed S)`` produces samples
``0..M-1``; sample ``i`` is a function of ``(S, i)`` only (its initial state,
its label and every random number of its chain), so the result does not
depend on the number of processes, ``--batch`` or the order of work.

On disk, next to the final output ``PATH``:

* ``PATH.parts/lock``: locked by the process that holds the job (:class:`JobLock`;
  rank 0 of a ``torchrun`` launch, for all of them): another process is refused at
  once, naming it; the lock goes with its process, however it ends;
* ``PATH.parts/options.json``: the job's options, written first; ``--resume``
  refuses options that differ;
* ``PATH.parts/shard-*.npz``: finished samples (``index``, ``samples``,
  ``nfe``, and ``labels`` for pixel), each written atomically (temporary name,
  then rename) as the samples finish; a resumed job skips the indices found there;
* at the end, ``PATH`` (``samples``, ``index`` ``0..M-1``, ``labels``) and
  ``PATH.json`` (options, version, per-sample NFE, occupancy), both atomic;
  then the parts are removed.

Processes: with ``torchrun``, each process takes every ``world``-th missing
index (:func:`specforest.distributed.shard`) and runs them with continuous
batching (:func:`specforest.generate`); rank 0 merges. With
``tree_parallel=True`` every process runs the same indices and each round's
rows are split across them (:func:`specforest.sample`'s ``process_group``);
rank 0 writes. The processes meet through
:func:`specforest.distributed.together`, so a failure at a meeting (the
output check, the model's loading, the merge) raises on every process; a
failure while sampling ends its process, and the others stop as soon as they
see it gone (torchrun's SIGTERM, or the next meeting).

This module is the driver (:func:`run_job`, ending in :func:`merge`); the job itself and the
options it records are in :mod:`.generate_job`, what it samples on a process and how many slots
fit in :mod:`.generate_model`, and its files on disk in :mod:`.generate_shards`. Their public
names are importable from here too.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from .. import __version__, distributed, generate, streams
from ..atomic import atomic_write, atomic_write_text
from ..warmup import pad_rows_for, warm_up
from .common import check_int, compiled
from .generate_job import IMAGE_MODELS, MODELS, JobSpec, count_limit, diffusers_options, pixel_options, sd3_options
from .generate_model import JobModel, gmm_model, image_model, pixel_model, size_slots
from .generate_shards import (
    IncompleteJobError,
    JobHeldError,
    JobLock,
    check_start,
    done_indices,
    meta_path,
    parts_dir,
    read_shard,
    remove_parts,
)

__all__ = [
    "IMAGE_MODELS",
    "MODELS",
    "GenerateResult",
    "IncompleteJobError",
    "JobHeldError",
    "JobLock",
    "JobSpec",
    "count_limit",
    "diffusers_options",
    "done_indices",
    "merge",
    "meta_path",
    "parts_dir",
    "pixel_options",
    "run_job",
    "sd3_options",
    "size_slots",
]


@dataclass
class GenerateResult:
    """What :func:`run_job` did on this process.

    Attributes:
        out: the final output path.
        produced: samples this process made now.
        skipped: samples found on disk (resumed).
        occupancy: mean fraction of slots busy per round on this process (NaN if none ran).
        rounds: target calls on this process.
        seconds: wall time of the sampling on this process.
        complete: whether the final output was written.
        warmup_seconds: time of the warm-up before the sampling (``warmup``; not in ``seconds``).
    """

    out: Path
    produced: int
    skipped: int
    occupancy: float
    rounds: int
    seconds: float
    complete: bool
    warmup_seconds: float = 0.0


def _model(spec: JobSpec, out: Path, device: str) -> JobModel:
    """The job's model on this process (every process loads it, at the meeting "loading the model")."""
    if spec.model == "gmm":
        return gmm_model(spec)
    if spec.model == "pixel":
        return pixel_model(spec, device)
    return image_model(spec, out, device)


def _control_group() -> Any:
    """A gloo group over the job's processes for the steps they take together (None in one process).

    Under NCCL a process waiting in a collective would block inside a device
    synchronisation, where a peer that exited goes unnoticed until NCCL's own timeout
    (and a Python SIGTERM handler, such as the command's, cannot run inside a
    collective). Over gloo the wait is on a socket, which fails at once when the peer
    exits ("Connection closed by peer").
    """
    if not distributed.is_distributed():
        return None
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def run_job(
    spec: JobSpec,
    out: "str | os.PathLike[str]",
    *,
    batch: int = 64,
    resume: bool = False,
    tree_parallel: bool = False,
    device: str = "cpu",
    progress: bool = False,
    log: Callable[[str], None] = lambda s: None,
    compile: bool = False,
    warmup: bool = False,
    memory_gb: Optional[float] = None,
) -> GenerateResult:
    """Run (or resume) a generation job on this process, as one of the group's processes if any.

    Args:
        spec: the job.
        out: the final ``.npz``.
        batch: slots in flight per process (``>= 1``).
        resume: continue a job found at ``out``; without it, anything at ``out`` is an error.
        tree_parallel: every process runs the same samples, splitting each round's rows.
        device: where the model and states live (``cpu`` or ``cuda``).
        progress: a progress bar of finished samples (rank 0).
        log: receives progress lines (rank 0).
        compile: ``torch.compile(mode="reduce-overhead")`` the target, rows padded to powers of two.
        warmup: call the target at every row count of this process's runs before sampling
            (:func:`specforest.warmup.warm_up`; same samples); with many slots on a tree the calls
            are padded to :func:`specforest.warmup.pad_rows_for`'s sizes. Its time is
            ``warmup_seconds`` in the result and in ``PATH.json``.
        memory_gb: memory limit of each process in GB (default
            :func:`specforest.memory.default_memory_limit`): fewer slots than ``batch``
            run where they do not fit (:func:`size_slots`; the samples are the same).

    Returns:
        A :class:`GenerateResult`.

    Nothing is written until every check has passed (the count, the output, the model, the slots
    that fit the memory limit, the sampler's options): a refused job leaves no ``PATH.parts``.

    Raises:
        JobHeldError: if another process holds the job (:class:`JobLock`), at once, naming it.
        FileExistsError: if ``out`` (or its parts) exists without ``resume``.
        ValueError: if ``resume`` finds a job with other options, on bad options, on a count
            the merge could not hold (:func:`count_limit`), or on a file of the job that cannot be
            read (naming it and what to do).
        OSError: if a shard or the output cannot be written (a full disk), naming it and saying
            that ``--resume`` finishes the job.
        MemoryError: if one slot does not fit the memory limit (:func:`size_slots`).
        specforest.distributed.PeerError: on the other processes, when one failed at a step
            they take together (checking the output, loading the model, the merge) or left the job.
    """
    out = Path(out)
    batch = check_int("batch", batch, 1)
    control = _control_group()
    lock = JobLock(out)
    try:
        return _run_job(
            spec,
            out,
            control,
            lock,
            batch=batch,
            resume=resume,
            tree_parallel=tree_parallel,
            device=device,
            progress=progress,
            log=log,
            compile=compile,
            warmup=warmup,
            memory_gb=memory_gb,
        )
    finally:
        lock.release()
        if control is not None:
            import torch.distributed as dist

            dist.destroy_process_group(control)


def _run_job(
    spec: JobSpec,
    out: Path,
    control: Any,
    lock: JobLock,
    *,
    batch: int,
    resume: bool,
    tree_parallel: bool,
    device: str,
    progress: bool,
    log: Callable[[str], None],
    compile: bool,
    warmup: bool,
    memory_gb: Optional[float],
) -> GenerateResult:
    """:func:`run_job` once the processes' control group exists.

    The processes meet at the steps in ``together`` blocks (every process runs each of
    them, in this order) and at the end of sampling: a failure there raises on every
    process. A failure while sampling is not held for the others (they may be hours
    from the next meeting): it ends this process, torchrun then stops the others with a
    SIGTERM, and without torchrun they raise at the end of sampling, on finding it gone.
    """
    rank = distributed.rank()
    # every rank checks, so that every rank raises the same error
    with distributed.together("checking the output", control):
        limit, why = count_limit(spec.model, spec.model_options, memory_gb=memory_gb, device=device)
        if limit < 1:
            raise ValueError(f"memory_gb={memory_gb:g} cannot hold one sample: {why}")
        if spec.count > limit:
            raise ValueError(
                f"count must be an int in [1, {limit}] here, got {spec.count}: {why}; give a larger "
                "memory_gb or split the job into several outputs"
            )
        if rank == 0:
            # before anything of the job is read: the job as a whole is held by rank 0's process
            lock.acquire()
        complete = check_start(out, spec, resume)
    if complete:
        with distributed.together("removing the parts", control):
            if rank == 0:
                remove_parts(out)
        log(f"{out} is complete; nothing to do")
        return GenerateResult(out, 0, spec.count, float("nan"), 0, 0.0, True)
    with distributed.together("loading the model", control):
        model = _model(spec, out, device)
    # every rank has read the shards before any writes more (none were written yet by a new job)
    with distributed.together("reading the shards", control):
        done = done_indices(out)
    # the indices not on disk, in order (a mask, not a Python list of every index)
    left = torch.ones(spec.count, dtype=torch.bool)
    left[torch.tensor(sorted(done), dtype=torch.long)] = False
    todo = torch.nonzero(left)[:, 0]
    mine = todo if tree_parallel else distributed.shard(todo)
    writer = rank == 0 or not tree_parallel
    seed = spec.seed

    dev = getattr(model.velocity, "device", None) or device

    def make_x(idx: torch.Tensor) -> torch.Tensor:
        x = streams.randn(seed, idx, model.shape, device=dev)
        return x if model.noise_scale == 1.0 else model.noise_scale * x

    group = None
    if tree_parallel and distributed.is_distributed():
        import torch.distributed as dist

        group = dist.group.WORLD
    world = distributed.world_size() if tree_parallel else 1
    # the last checks, before anything is written: the slots that fit, the options of every call
    with distributed.together("sizing the slots", control):
        mem = size_slots(model, batch, memory_gb, world=world, device=dev)
        velocity, pad_rows = compiled(model.velocity, compile)
        if warmup and len(mine):
            # the slots that fit, and the last run of the standard sampler, whose slots all finish together
            slots = mem.chunk
            sizes = sorted({min(slots, len(mine)), len(mine) % slots or slots})
            first = mine[: sizes[-1]]
            pad_rows = pad_rows or pad_rows_for(sizes, **model.sampler.as_dict())
        # the job's options with the rows per call that fit and the padding of a compiled model
        options = replace(model.sampler, max_rows=mem.max_rows, pad_rows=pad_rows)
        gen = generate(
            velocity,
            indices=mine,
            make_x=make_x,
            make_cond=model.make_cond,
            seed=seed,
            batch=mem.chunk,
            process_group=group,
            options=options,
        )
    log(mem.describe())
    with distributed.together("writing the options", control):
        if rank == 0:
            parts_dir(out).mkdir(parents=True, exist_ok=True)
            if spec.model in IMAGE_MODELS:
                out.mkdir(parents=True, exist_ok=True)
            if not (parts_dir(out) / "options.json").exists():
                atomic_write_text(parts_dir(out) / "options.json", json.dumps(spec.options(), indent=1) + "\n")
    warmup_seconds = 0.0
    if warmup and len(mine):
        cond = None if model.make_cond is None else model.make_cond(first)
        warmup_seconds = warm_up(
            velocity,
            make_x(first),
            cond=cond,
            batch=sizes,
            process_group=group,
            repeats=3 if compile else 1,
            **options.as_dict(),
        )
    bar = None
    if progress and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), initial=0, unit="sample", desc="generate")
    seq, produced, t0 = 0, 0, time.perf_counter()
    token = secrets.token_hex(6)
    pending: list = []
    flush_at = max(batch, 1)

    def flush() -> None:
        nonlocal seq, pending
        if not pending or not writer:
            pending = []
            return
        index = torch.cat([f.index for f in pending])
        samples = torch.cat([f.samples for f in pending])
        arrays = {"index": index.numpy(), "nfe": torch.cat([f.stats.nfe for f in pending]).cpu().numpy()}
        if model.save_images is not None:
            # images first, then the shard that records them: a kill in between redoes them
            with _writing(out, out):
                model.save_images(index, samples)
        else:
            arrays["samples"] = samples.cpu().to(torch.float32).numpy()
        if model.labels_of is not None:
            arrays["labels"] = model.labels_of(index).numpy()
        # a fresh token per run: a resumed run (even with the same pid, as after a restart) never
        # overwrites a shard of an earlier one
        name = f"shard-r{rank:04d}-{token}-{seq:06d}.npz"
        with _writing(parts_dir(out) / name, out):
            atomic_write(parts_dir(out) / name, lambda f: np.savez(f, **arrays), binary=True)
        seq += 1
        pending = []

    for f in gen:
        pending.append(f)
        produced += len(f.index)
        if sum(len(p.index) for p in pending) >= flush_at:
            flush()
        if bar is not None:
            bar.update(len(f.index) * (distributed.world_size() if not tree_parallel else 1))
    flush()
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t0
    occ = gen.stats.occupancy
    # the shards are all written once every process is here
    stats = distributed.agree(
        "sampling",
        value=(produced, gen.stats.rounds, gen.stats.slot_rounds, seconds, gen.stats.slots, warmup_seconds),
        group=control,
    )
    with distributed.together("the merge", control):
        if rank == 0:
            run = {"device": device, "compiled": bool(compile), "threads": torch.get_num_threads()}
            run["warmup_seconds"] = max(s[5] for s in stats)
            world = distributed.world_size()
            merge(out, spec, batch=batch, world=world, tree_parallel=tree_parallel, stats=stats, run=run)
    if rank == 0:
        log(f"wrote {out} and {meta_path(out)}")
    return GenerateResult(out, produced, len(done), occ, gen.stats.rounds, seconds, True, warmup_seconds)


def merge(
    out: Path, spec: JobSpec, *, batch: int, world: int, tree_parallel: bool, stats: list, run: Optional[dict] = None
) -> None:
    """Write the final ``out`` and ``out.json`` from the shards, check every index is there once, remove the parts.

    An error leaves the shards in place and no output (``--resume`` merges again).

    Raises:
        IncompleteJobError: if an index (or an image) is missing, naming the folder (an ``OSError``: the
            command line says it without a traceback).
        ValueError: if a shard cannot be read, naming it (:func:`read_shard`).
        OSError: if the output or its JSON cannot be written, naming it and saying that ``--resume``
            finishes the job.
    """
    parts = parts_dir(out)
    chunks: dict = {}
    for p in sorted(parts.glob("shard-*.npz")):
        data = read_shard(p)
        for j, i in enumerate(data["index"].tolist()):
            chunks.setdefault(i, {k: v[j] for k, v in data.items()})
    missing = [i for i in range(spec.count) if i not in chunks]
    if missing:
        raise IncompleteJobError(
            f"{len(missing)} indices missing from {parts} (first: {missing[:5]}): rerun with --resume, which samples "
            "them again"
        )
    rows = [chunks[i] for i in range(spec.count)]
    nfe = [int(r["nfe"]) for r in rows]
    if spec.model in IMAGE_MODELS:
        absent = [i for i in range(spec.count) if not (out / f"{i:06d}.png").exists()]
        if absent:
            raise IncompleteJobError(
                f"{len(absent)} images missing from {out} (first: {absent[:5]}): rerun with --resume, which makes "
                "them again"
            )
    else:
        arrays = {"samples": np.stack([r["samples"] for r in rows]), "index": np.arange(spec.count, dtype=np.int64)}
        if "labels" in rows[0]:
            arrays["labels"] = np.array([int(r["labels"]) for r in rows], dtype=np.int64)
        with _writing(out, out):
            atomic_write(out, lambda f: np.savez(f, **arrays), binary=True)
    busy = sum(s[2] for s in stats)
    capacity = sum(s[1] * s[4] for s in stats)
    meta = {
        "options": spec.options(),
        "specforest_version": __version__,
        "torch_version": torch.__version__,
        "platform": platform.platform(),
        "processes": world,
        "tree_parallel": tree_parallel,
        "batch": batch,
        # of the last run; a job resumed on another device or with --compile may mix float roundings
        **(run or {}),
        "nfe": nfe,
        "nfe_mean": float(np.mean(nfe)),
        # of this (last) run: mean fraction of the slots busy per round, over all processes
        "occupancy": busy / capacity if capacity else None,
        "per_process": [
            {"samples": s[0], "rounds": s[1], "seconds": round(s[3], 3), "warmup_seconds": round(s[5], 3)}
            for s in stats
        ],
    }
    try:
        with _writing(meta_path(out), out):
            atomic_write_text(meta_path(out), json.dumps(meta, indent=1) + "\n")
    except BaseException:
        # the JSON is what marks the output complete: without it, no output either (the shards stay)
        if spec.model not in IMAGE_MODELS:
            out.unlink(missing_ok=True)
        raise
    remove_parts(out)


@contextmanager
def _writing(path: Path, out: Path) -> Iterator[None]:
    """Writing ``path`` of the job at ``out``: an OSError (a full disk, say) names the path and says that the
    finished samples are kept and ``--resume`` finishes the job (with the same ``errno``)."""
    try:
        yield
    except OSError as e:
        err = OSError(
            f"could not write {path}: {e.strerror or e}; the samples are kept in {parts_dir(out)}: free some space "
            "(or fix the cause) and rerun with --resume to finish the job"
        )
        err.errno = e.errno
        raise err from e
