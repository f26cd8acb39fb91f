"""A ``specforest generate`` job on disk, beside its output ``PATH``: ``PATH.parts/`` holds the options
(``options.json``) and the finished samples (``shard-*.npz``) until the job is complete, and the lock
(``lock``) of the process that holds the job.

The checks that keep jobs apart (:class:`JobLock`: one process at a time; :func:`check_start`: nothing
overwritten, a resumed job's options the same), the reading of the shards (:func:`read_shard`: a damaged
one is named, with what to do) and the removal of the parts once the output is written live here; the
driver (:mod:`specforest.experiments.generate`) writes the shards and merges them.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import zipfile
import zlib
from pathlib import Path
from typing import Optional

import numpy as np

from .generate_job import JobSpec, job_model_name

__all__ = [
    "LOCK_NAME",
    "JobHeldError",
    "JobLock",
    "check_start",
    "done_indices",
    "meta_path",
    "parts_dir",
    "read_shard",
    "remove_parts",
]

LOCK_NAME = "lock"
"""The lock file in ``PATH.parts/``: locked (``flock``) by the process that holds the job, and holding
its pid, host and start time for the message of a process refused."""


def parts_dir(out: Path) -> Path:
    """Where the job's shards live until it is complete."""
    return Path(str(out) + ".parts")


def meta_path(out: Path) -> Path:
    """The JSON beside the output: its name with the suffix ``.json`` (``gmm.npz`` -> ``gmm.json``)."""
    return out.with_suffix(".json")


class IncompleteJobError(OSError):
    """The job's parts lack samples the merge needs (a shard or a PNG removed while the job ran):
    ``--resume`` samples them again."""


class JobHeldError(OSError):
    """Another process holds the job (its :class:`JobLock`): one job runs in one process, or one
    ``torchrun`` launch, at a time."""


class JobLock:
    """The job at ``out`` held by this process: an exclusive ``flock`` on ``PATH.parts/lock`` (POSIX).

    The operating system releases the lock when its process ends, however it ends (a SIGKILL too),
    so a job is never left held; the file, with the holder's pid, host and start time in it, may stay
    and is taken over by the next process. A process that finds the job held is refused at once
    (:class:`JobHeldError`), before it reads or writes anything of the job, so two processes never
    sample the same indices. A lock made where nothing of the job was (``PATH.parts`` and the folders
    above it) is removed on :meth:`release` with those folders, when nothing else was written there:
    a refused run leaves nothing.

    Args:
        out: the job's final output path.
    """

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.path = parts_dir(self.out) / LOCK_NAME
        self._fd: Optional[int] = None
        self._made: list = []  # folders this lock created, innermost first

    def acquire(self) -> None:
        """Take the job, or refuse it.

        Raises:
            JobHeldError: if another process holds the job, naming it and the lock file.
        """
        import fcntl

        parts = self.path.parent
        missing = []
        for folder in (parts, *parts.parents):
            if folder.exists():
                break
            missing.append(folder)
        self._made = missing
        # a holder that ends removes the file (:meth:`release`): a lock taken on the removed file is
        # worth nothing, so it is taken again until the file locked is the one at the path
        while True:
            parts.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            except FileNotFoundError:  # the folder was removed in between
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise JobHeldError(
                    f"{self.out} is held by {holder}: one process (or one torchrun launch) runs a job at a "
                    f"time; wait for it to end, or stop it, then rerun with --resume (the lock: {self.path})"
                ) from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode("utf-8"), 0)
        self._fd = fd

    def release(self) -> None:
        """Give the job back (a no-op unless held): the lock file is removed, then the folders the lock
        made, where they are empty."""
        if self._fd is None:
            return
        try:
            # removed while still locked, so that no other process takes this file (see acquire)
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                os.unlink(self.path)
        except FileNotFoundError:  # the parts were removed with the job complete
            pass
        os.close(self._fd)
        self._fd = None
        for folder in self._made:
            try:
                folder.rmdir()
            except FileNotFoundError:
                continue
            except OSError:  # not empty: something of the job, or of another, is there
                break


def _holder(fd: int) -> str:
    """Who holds a lock, from its file ``fd``, in words: ``pid P on HOST since T``."""
    # the holder writes its record just after it takes the lock: a process refused in between waits a little
    for _ in range(20):
        try:
            rec = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
            return f"pid {rec['pid']} on {rec['host']} since {rec['started']}"
        except (ValueError, KeyError, TypeError):
            time.sleep(0.02)
    return "another process (its pid, host and start time unreadable)"


def read_shard(path: Path, keys: "Optional[tuple]" = None) -> dict:
    """The arrays of the shard ``path`` (only ``keys``, if given), every member's checksum checked.

    Raises:
        ValueError: if the shard cannot be read (cut short, damaged, without ``keys``), naming it and
            what to do: delete it and resume, which makes its samples again.
    """
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
        if bad is not None:
            raise zipfile.BadZipFile(f"bad checksum of {bad}")
        with np.load(path) as z:
            return {k: z[k] for k in (keys or z.files)}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise ValueError(
            f"the shard {path} cannot be read ({type(e).__name__}: {e}): delete it and rerun with --resume, "
            "which makes its samples again"
        ) from e


def done_indices(out: Path) -> set:
    """Indices already in the job's shards; stale temporary files of a killed run are removed.

    Raises:
        ValueError: naming a shard that cannot be read (:func:`read_shard`).
    """
    parts = parts_dir(out)
    done: set = set()
    if not parts.exists():
        return done
    for p in sorted(parts.iterdir()):  # (in order: the first damaged shard is the one named)
        if p.name.endswith(".tmp"):
            p.unlink(missing_ok=True)
        elif p.name.startswith("shard-") and p.suffix == ".npz":
            done.update(int(i) for i in read_shard(p, ("index",))["index"])
    return done


def _started(parts: Path) -> bool:
    """Whether a job was started in ``parts``: it holds anything but a lock (its options come first)."""
    return parts.exists() and any(p.name != LOCK_NAME for p in parts.iterdir())


def _read_options(path: Path, what: str, key: Optional[str] = None) -> dict:
    """The JSON object in ``path`` (its ``key``, if given), or an error naming the file and ``what`` to do."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if key is not None and isinstance(data, dict):
            data = data.get(key)
        if not isinstance(data, dict):
            raise ValueError(f"no JSON object{f' under {key!r}' if key else ''}")
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e}): {what}") from e
    return data


def check_start(out: Path, spec: JobSpec, resume: bool) -> bool:
    """Refuse what would mix or overwrite jobs; True when the job is already complete.

    Raises:
        FileExistsError: if something of a job is at ``out`` without ``resume``, or ``out`` is not a job's.
        ValueError: if the job on disk has other options, or its options cannot be read (naming the file).
    """
    parts, meta = parts_dir(out), meta_path(out)
    opts = _as_ran(spec.options())
    now = job_model_name(opts)
    if not resume:
        for p in (out, meta):
            if p.exists():
                raise FileExistsError(f"{p} exists; pass --resume to continue that job, or choose another --out")
        if _started(parts):
            raise FileExistsError(f"{parts} exists; pass --resume to continue that job, or choose another --out")
        return False
    if out.exists() and meta.exists():
        # the output and its JSON are written last: the job is complete (a kill may have left parts behind)
        what = f"it records the options of the complete {out}; restore it, or delete {out} and {meta} to make it again"
        old = _as_ran(_read_options(meta, what, "options"))
        _refuse_other_model(old, now, out)
        if old != opts:
            raise ValueError(f"--resume with options that differ from those of {out}: {_diff(old, opts)}")
        return True
    if (parts / "options.json").exists():
        what = f"it records the options of the samples in {parts}; restore it, or delete {parts} to start the job anew"
        old = _as_ran(_read_options(parts / "options.json", what))
        _refuse_other_model(old, now, parts)
        if old != opts:
            raise ValueError(f"--resume with options that differ from those on disk in {parts}: {_diff(old, opts)}")
    elif out.exists():
        raise FileExistsError(f"{out} exists but is not a specforest generate output; choose another --out")
    return False


def _refuse_other_model(old: dict, now: str, where: Path) -> None:
    """Refuse a resume whose model is not the job's on disk, naming both (before the other options'
    differences, which follow from it).

    Raises:
        ValueError: naming both models and ``where``.
    """
    was = job_model_name(old) if isinstance(old, dict) else None
    if was is not None and was != now:
        raise ValueError(
            f"--resume of the job in {where}, which samples the {was} model, for the {now} model: a job keeps its "
            f"model; resume it with {was}, or choose another --out for {now}"
        )


def _as_ran(opts: dict) -> dict:
    """A job's options as they ran, as a resumed job compares them: a standard job's draft options are
    unused (a job written before the command line recorded them as null holds the defaults: the same job),
    and a job written before chains were recorded ran the em chain at its churn."""
    sampler = opts.get("sampler") if isinstance(opts, dict) else None
    if not isinstance(sampler, dict):
        return opts
    if "chain" not in sampler:
        sampler = {**sampler, "chain": "em", "chain_params": {"churn": sampler.get("churn")}}
    if sampler.get("method") == "standard":
        sampler = {**sampler, **dict.fromkeys(("draft", "prefetch", "verify"))}
    if opts.get("model") == "diffusers":
        # its pipeline's grid ran whatever grid said (a job written before recorded flow_match); a scheduler's
        # eta of 0 and none (a step that takes none) are one chain
        sampler = {**sampler, "grid": None}
        if sampler.get("chain") == "scheduler" and not (sampler.get("chain_params") or {}).get("eta"):
            sampler = {**sampler, "chain_params": {"eta": None}}
    return {**opts, "sampler": sampler}


def _diff(old: dict, new: dict) -> str:
    flat = lambda d, p="": {  # noqa: E731
        k2: v2
        for k, v in d.items()
        for k2, v2 in (flat(v, f"{p}{k}.").items() if isinstance(v, dict) else [(p + k, v)])
    }
    a, b = flat(old), flat(new)
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return ", ".join(f"{k}: {a.get(k)!r} on disk, {b.get(k)!r} now" for k in keys)


def remove_parts(out: Path) -> None:
    """Remove the shards of a complete job: renamed away first, so a kill never leaves half a parts folder."""
    parts = parts_dir(out)
    trash = parts.with_name(parts.name + ".trash")
    if parts.exists():
        os.replace(parts, trash)
    shutil.rmtree(trash, ignore_errors=True)
