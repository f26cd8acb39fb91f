"""One configuration of the SD3 study: every caption sampled with one method, summarized.

Randomness: the captions run in batches of ``setting.batch_size``; batch ``i``
gets a generator seeded from ``(setting.seed, i)`` that draws its initial
latents first and then seeds the sampler, so every method sees the same latents.
Within a batch all images sample together: the memory limit splits the
transformer's calls (``max_rows``), never the batch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ... import diffusers as sd
from ..common import COUPLING_OF, budget_of, check_choice, derive_seed, mean_sem, method_tree, summarize
from ..io import atomic_write
from .clip import clip_scores
from .loading import encode_prompts
from .setting import DETERMINISTIC_STEPS, METHODS, SD3Setting

__all__ = ["run_config"]

_COUNTERS = ("nfe", "attempts", "accepts", "delta_sum", "rounds", "spec_steps", "rows")


def run_config(
    pipe: Any,
    prompts: Sequence[str],
    setting: SD3Setting,
    method: str,
    K: int,
    L: int,
    *,
    embeds: dict | None = None,
    max_memory_gb: float | None = None,
    clip: str | None = None,
    clip_device: str | torch.device = "cpu",
    images_dir: str | os.PathLike[str] | None = None,
    progress: bool = False,
    tuned: Any = None,
) -> dict:
    """Run one configuration on every caption and summarise it.

    Args:
        pipe: a loaded ``StableDiffusion3Pipeline``.
        prompts: the captions (one image each).
        setting: the study's :class:`~.setting.SD3Setting` (its further ``options`` go to every sampler call).
        method: ``standard``, ``rmc`` (chain of ``L`` drafted states), ``dgrs`` (``(K, L)`` tree)
            or ``tuned`` (``tuned``'s configuration).
        K, L: as recorded by :func:`~.setting.configs`.
        embeds: precomputed text embeddings (default: encoded here, :func:`~.loading.encode_prompts`).
        max_memory_gb: memory limit (default: :func:`specforest.memory.default_memory_limit`).
        clip: a local CLIP directory; adds ``clip_mean`` / ``clip_sem``.
        clip_device: where CLIP runs.
        images_dir: if given, the images are saved there as ``NNNN.png``.
        progress: the sampler's progress bar.
        tuned: a :class:`~specforest.latency.Tuned` (``method="tuned"`` only): its tree,
            coupling, verification mode, draft and prefetch replace the setting's.

    Returns:
        A flat JSON-serialisable record: ``method``, ``K``, ``L``, ``budget``,
        ``images``, the statistics of :func:`specforest.experiments.common.summarize`,
        ``nfe_per_image``, ``calls``, ``max_rows`` (per batch), ``rows_per_call``
        and ``memory_peak_gb`` (the largest batch's
        :class:`~specforest.memory.MemoryEstimate`), ``wall_seconds``, ``warmup_seconds``
        (``tuned`` only: its row counts are warmed before the first batch of each size; not in
        ``wall_seconds``), ``target_seconds``, ``clip_mean``/``clip_sem``.

    Raises:
        ValueError / TypeError: on invalid options, naming the option.
        MemoryError: if a batch does not fit the memory limit.
    """
    check_choice("method", method, METHODS)
    if embeds is None:
        embeds = encode_prompts(pipe, prompts, setting)
    n = len(prompts)
    size = setting.batch_size or n
    if (method == "tuned") != (tuned is not None):
        raise ValueError("tuned must be given with method='tuned' and only then")
    if tuned is None:
        tree, coupling = method_tree(method, K, L, setting.steps), COUPLING_OF.get(method, "grs")
        verify, draft, prefetch = setting.verify, setting.draft, setting.prefetch
    else:
        tree, coupling, verify, draft, prefetch = (
            tuned[k] for k in ("tree", "coupling", "verify", "draft", "prefetch")
        )
    want_images = clip is not None or images_dir is not None
    parts: dict[str, list] = {k: [] for k in _COUNTERS}
    images: list = []
    calls, target_seconds, estimates = 0, 0.0, []
    warmup_seconds, pads = 0.0, {}
    t0 = time.perf_counter()
    for i, start in enumerate(range(0, n, size)):
        sl = slice(start, start + size)
        # a tuned configuration warms its row counts once per batch size (the last batch may be
        # smaller), and the later batches of that size pad as the first did
        b = min(size, n - start)
        g = torch.Generator(device="cpu").manual_seed(derive_seed(setting.seed, i))
        res = sd.sample(
            pipe,
            **{k: v[sl] for k, v in embeds.items()},
            num_inference_steps=setting.steps,
            guidance_scale=setting.guidance_scale,
            height=setting.height,
            width=setting.width,
            generator=g,
            output_type="pil" if want_images else "latent",
            churn=setting.churn,
            tree=tree,
            coupling=coupling,
            draft=draft,
            prefetch=prefetch,
            verify=verify,
            progress=progress,
            max_memory_gb=max_memory_gb,
            lazy=setting.lazy,
            shift=setting.shift,
            max_sequence_length=setting.max_sequence_length,
            pad_rows=pads.get(b),
            warmup=tuned is not None and b not in pads,
            **setting.options,
        )
        pads.setdefault(b, res.config["pad_rows"])
        warmup_seconds += res.warmup_seconds
        s = res.stats
        for name, part in parts.items():
            part.append(getattr(s, name).cpu())
        calls += int(s.calls)
        target_seconds += s.target_seconds
        estimates.append(res.memory)
        if want_images:
            images += list(res.images)
    wall = time.perf_counter() - t0 - warmup_seconds
    cat = {k: torch.cat(v) for k, v in parts.items()}
    record = {
        "method": method,
        "K": K,
        "L": L,
        "budget": budget_of(method, K, L) if tuned is None else (0 if tree is None else tree.budget),
        "images": n,
        **summarize(**cat, standard_calls=setting.steps, deterministic_calls=DETERMINISTIC_STEPS),  # em: a call a step
        "nfe_per_image": [int(v) for v in cat["nfe"].tolist()],
        "calls": calls,
        "max_rows": [m.max_rows for m in estimates],
        "rows_per_call": max(m.rows_per_call for m in estimates),
        "memory_peak_gb": max(m.total_bytes for m in estimates) / 1e9,
        "wall_seconds": wall,
        "warmup_seconds": warmup_seconds,
        "target_seconds": target_seconds,
        "clip_mean": None,
        "clip_sem": None,
    }
    if tuned is not None:
        record.update(
            tuned_label=tuned.label,
            coupling=coupling,
            verify=verify,
            draft=draft,
            tree_parents=None if tree is None else tree.parent.tolist(),
            predicted_seconds_per_image=tuned.predicted_seconds_per_image,
        )
    if clip is not None:
        scores = clip_scores(clip, images, list(prompts), device=clip_device)
        record["clip_mean"], record["clip_sem"] = mean_sem(scores)
    if images_dir is not None:
        d = Path(images_dir)
        for j, im in enumerate(images):
            atomic_write(d / f"{j:04d}.png", lambda f, im=im: im.save(f, format="PNG"), binary=True)
    return record
