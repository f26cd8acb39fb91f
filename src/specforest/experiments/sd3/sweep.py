"""The study of Sec. 5.3, resumable: standard, then D-GRS and RMC at the matched budget for every ``K``."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ... import __version__
from ..common import SweepResult, record_key, write_records
from ..io import load_records
from ..results import describe_method
from .loading import encode_prompts
from .report import format_line, write_figure
from .run import run_config
from .setting import SD3Setting, configs, setting_id

__all__ = ["KEY_FIELDS", "run_experiment"]

KEY_FIELDS = ("method", "K", "L")
"""Fields that identify a configuration within one setting (its ``setting_id``)."""


def _images_name(method: str, K: int, L: int) -> str:
    return {"standard": "standard", "rmc": f"rmc_B{L}", "dgrs": f"dgrs_K{K}_L{L}", "tuned": "tuned"}[method]


def run_experiment(
    pipe: Any,
    prompts: Sequence[str],
    setting: SD3Setting,
    out_dir: str | os.PathLike[str],
    *,
    model: str = "",
    dtype: str = "",
    max_memory_gb: float | None = None,
    clip: str | None = None,
    clip_device: str | torch.device = "cpu",
    save_images: bool = False,
    progress: bool = False,
    log: Callable[[str], None] = lambda s: None,
    tuned: Any = None,
) -> SweepResult:
    """The study of Sec. 5.3: standard, then D-GRS and RMC for every ``K`` of the setting.

    Resumable: configurations already in ``out_dir/results.json`` for the same
    setting (``K_values`` aside), captions, model and dtype are skipped (rerun
    if CLIP scores are asked for and missing); ``results.json`` and
    ``results.csv`` are rewritten (atomically) after every configuration, then
    the figure.

    Args:
        pipe: a loaded ``StableDiffusion3Pipeline``.
        prompts: the captions.
        setting: the :class:`~.setting.SD3Setting`.
        out_dir: output directory (``results.json``, ``results.csv``,
            ``speedup_vs_K.png``, ``images/<config>/`` with ``save_images``).
        model, dtype: recorded (and part of the resume key, :func:`~.setting.setting_id`).
        max_memory_gb, clip, clip_device: as in :func:`~.run.run_config`.
        save_images: write every image as PNG.
        progress: sampler progress bars.
        log: receives one line per configuration.
        tuned: a :class:`~specforest.latency.Tuned` (from ``specforest tune``): run as one more
            configuration, method ``tuned`` (resumed only if the file's choice is the same).

    Returns:
        A :class:`~specforest.experiments.common.SweepResult` whose records are
        this study's, in run order (resumed ones included).

    Raises:
        ValueError: if ``out_dir`` holds results of another setting.
    """
    out_dir = Path(out_dir)
    sid = setting_id(setting, prompts, model, dtype)
    old = load_records(out_dir / "results.json")
    other = {r.get("setting_id") for r in old} - {sid}
    if other:
        raise ValueError(
            f"{out_dir} holds results of another setting (setting_id {min(map(str, other))}, this one {sid}); "
            "use another --out or move the old results away"
        )
    done = {record_key(r, KEY_FIELDS): r for r in old}
    store = dict(done)  # every record of out_dir, this study's replacing older ones
    embeds = None
    records, ran, skipped = [], 0, 0
    common = {
        "setting_id": sid,
        "model": model,
        "dtype": dtype,
        **{k: v for k, v in setting.as_dict().items() if k not in ("L", "K_values")},
        "L_tree": setting.L,
        "clip_model": clip,
        "specforest_version": __version__,
        "torch_version": torch.__version__,
        "platform": platform.platform(),
    }
    todo = configs(setting.K_values, setting.L) + ([("tuned", 0, 0)] if tuned is not None else [])
    for method, K, L in todo:
        key = (method, K, L)
        same = method != "tuned" or done.get(key, {}).get("tuned_label") == tuned.label
        if key in done and same and (clip is None or done[key].get("clip_mean") is not None):
            records.append(done[key])
            skipped += 1
            log(f"{describe_method(done[key])}: done before, skipped")
            continue
        if embeds is None:
            embeds = encode_prompts(pipe, prompts, setting)
        rec = run_config(
            pipe,
            prompts,
            setting,
            method,
            K,
            L,
            embeds=embeds,
            max_memory_gb=max_memory_gb,
            clip=clip,
            clip_device=clip_device,
            images_dir=out_dir / "images" / _images_name(method, K, L) if save_images else None,
            progress=progress,
            tuned=tuned if method == "tuned" else None,
        )
        rec = {**rec, **common}
        records.append(rec)
        store[key] = rec
        ran += 1
        write_records(out_dir, list(store.values()))
        log(format_line(rec))
    every = list(store.values())
    files = write_records(out_dir, every) + [write_figure(every, out_dir)]
    return SweepResult(records, ran, skipped, files)
