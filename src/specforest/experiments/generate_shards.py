"""A ``specforest generate`` job on disk, beside its output ``PATH``: ``PATH.parts/`` holds the options
(``options.json``) and the finished samples (``shard-*.npz``) until the job is complete.

The checks that keep jobs apart (:func:`check_start`: nothing overwritten, a resumed job's options the
same) and the removal of the parts once the output is written live here; the driver
(:mod:`specforest.experiments.generate`) writes the shards and merges them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from .generate_job import JobSpec

__all__ = ["check_start", "done_indices", "meta_path", "parts_dir", "remove_parts"]


def parts_dir(out: Path) -> Path:
    """Where the job's shards live until it is complete."""
    return Path(str(out) + ".parts")


def meta_path(out: Path) -> Path:
    """The JSON beside the output: its name with the suffix ``.json`` (``gmm.npz`` -> ``gmm.json``)."""
    return out.with_suffix(".json")


def done_indices(out: Path) -> set:
    """Indices already in the job's shards; stale temporary files of a killed run are removed."""
    parts = parts_dir(out)
    done: set = set()
    if not parts.exists():
        return done
    for p in parts.iterdir():
        if p.name.endswith(".tmp"):
            p.unlink(missing_ok=True)
        elif p.name.startswith("shard-") and p.suffix == ".npz":
            with np.load(p) as z:
                done.update(int(i) for i in z["index"])
    return done


def check_start(out: Path, spec: JobSpec, resume: bool) -> bool:
    """Refuse what would mix or overwrite jobs; True when the job is already complete."""
    parts, meta = parts_dir(out), meta_path(out)
    opts = _as_ran(spec.options())
    if not resume:
        for p in (out, parts, meta):
            if p.exists():
                raise FileExistsError(f"{p} exists; pass --resume to continue that job, or choose another --out")
        return False
    if out.exists() and meta.exists():
        # the output and its JSON are written last: the job is complete (a kill may have left parts behind)
        old = _as_ran(json.loads(meta.read_text())["options"])
        if old != opts:
            raise ValueError(f"--resume with options that differ from those of {out}: {_diff(old, opts)}")
        return True
    if (parts / "options.json").exists():
        old = _as_ran(json.loads((parts / "options.json").read_text()))
        if old != opts:
            raise ValueError(f"--resume with options that differ from those on disk in {parts}: {_diff(old, opts)}")
    elif out.exists():
        raise FileExistsError(f"{out} exists but is not a specforest generate output; choose another --out")
    return False


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
