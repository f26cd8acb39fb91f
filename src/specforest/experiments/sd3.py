"""Stable Diffusion 3 text-to-image study of the paper (Sec. 5.3, Figure 5, Table 1).

The paper's setting: 512 x 512 images, ``T = 50`` steps, guidance 7, churn 0.8,
timestep shift 3 (eq. 38), lookahead ``L = 2`` and ``K = 2..7`` (budgets
``B = K + K^2 = 6..56``), D-GRS on the ``(K, 2)`` tree against RMC on a chain of
the matched budget ``B`` and the standard sampler (``T`` NFE per image), 100 COCO
captions, CLIP score with ``openai/clip-vit-large-patch14``.

Every configuration starts from the same initial latents (the generator of batch
``i`` is seeded from ``(seed, i)`` and draws the latents first), so the methods
differ only in how they sample the chain. Per image, the speedup is ``T / NFE``
(and ``(T - 2) / (NFE - 2)``, the stochastic steps per call spent on them, since
the first and last steps are deterministic Euler steps every sampler takes).
Results are written atomically after every configuration and a rerun with the
same setting skips what is done.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import __version__
from .. import diffusers as sd
from ..sampler import PREFETCH_POLICIES
from ..trees import VERIFY_MODES
from .io import atomic_write, atomic_write_text, load_records, records_csv

__all__ = [
    "DTYPES",
    "METHODS",
    "SD3Experiment",
    "SD3Setting",
    "budget",
    "clip_scores",
    "configs",
    "format_summary",
    "load_pipeline",
    "load_prompts",
    "run_config",
    "run_experiment",
    "write_figure",
]

METHODS = ("standard", "rmc", "dgrs")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _derive_seed(seed: int, *stream: int) -> int:
    return int(np.random.SeedSequence([seed, *stream]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def budget(K: int, L: int) -> int:
    """Drafted states of a uniform ``(K, L)`` tree, ``K + K^2 + ... + K^L`` (ERRATA 7)."""
    return sum(K**level for level in range(1, L + 1))


@dataclass(frozen=True)
class SD3Setting:
    """Everything that defines one study (the paper's Sec. 5.3 by default).

    Attributes:
        height, width: image size in pixels.
        steps: grid steps ``T`` (>= 3: the first and last are deterministic).
        guidance_scale: classifier-free guidance (<= 1: none).
        churn: ``eps`` in (0, 1].
        shift: static timestep shift ``kappa`` (eq. 38), overriding the scheduler's.
        L: tree depth of D-GRS.
        K_values: tree widths of D-GRS; RMC runs a chain of ``budget(K, L)`` for each.
        verify: ``drafted`` (every drafted state evaluated, the paper's protocol) or ``internal``.
        prefetch: ``nearest`` or ``parent`` (ERRATA 9).
        lazy: the sampler's cost simulation (same law and NFE, less memory).
        seed: seed of the initial latents and of the sampling noise.
        batch_size: images per sampler call (``None``: all at once).
        max_sequence_length: T5 tokens.
    """

    height: int = 512
    width: int = 512
    steps: int = 50
    guidance_scale: float = 7.0
    churn: float = 0.8
    shift: float = 3.0
    L: int = 2
    K_values: tuple[int, ...] = (2, 3, 4, 5, 6, 7)
    verify: str = "drafted"
    prefetch: str = "nearest"
    lazy: bool = False
    seed: int = 0
    batch_size: int | None = None
    max_sequence_length: int = 256

    def __post_init__(self) -> None:
        for name, lo in (
            ("height", 1),
            ("width", 1),
            ("steps", 3),
            ("L", 1),
            ("seed", 0),
            ("max_sequence_length", 1),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if self.batch_size is not None and (not isinstance(self.batch_size, int) or self.batch_size < 1):
            raise ValueError(f"batch_size must be None or an int >= 1, got {self.batch_size!r}")
        ks = tuple(self.K_values)
        if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
            raise ValueError(f"K_values must be a non-empty list of ints >= 1, got {self.K_values!r}")
        object.__setattr__(self, "K_values", tuple(sorted(set(ks))))
        if not (isinstance(self.churn, (int, float)) and 0 < self.churn <= 1):
            raise ValueError(f"churn must be in (0, 1], got {self.churn!r}")
        if not (
            isinstance(self.guidance_scale, (int, float))
            and math.isfinite(self.guidance_scale)
            and self.guidance_scale >= 0
        ):
            raise ValueError(f"guidance_scale must be a finite number >= 0, got {self.guidance_scale!r}")
        if not (isinstance(self.shift, (int, float)) and math.isfinite(self.shift) and self.shift > 0):
            raise ValueError(f"shift must be a finite number > 0, got {self.shift!r}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {self.verify!r}")
        if self.prefetch not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch must be one of {PREFETCH_POLICIES}, got {self.prefetch!r}")

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["K_values"] = list(self.K_values)
        return d


def configs(K_values: Sequence[int], L: int) -> list[tuple[str, int, int]]:
    """``(method, K, L)`` of a study: the standard sampler, then D-GRS ``(K, L)``
    and RMC on a chain of ``budget(K, L)`` (recorded as ``(1, B)``) for each ``K``."""
    out = [("standard", 0, 0)]
    for K in sorted(set(K_values)):
        out += [("dgrs", K, L), ("rmc", 1, budget(K, L))]
    return out


def load_prompts(path: str | os.PathLike[str], num_prompts: int | None = None) -> list[str]:
    """Captions of a text file, one per non-empty line (surrounding spaces stripped).

    Args:
        path: the file (UTF-8).
        num_prompts: keep the first ``N >= 1`` (``None``: all).

    Raises:
        ValueError: if the file holds no caption or fewer than ``num_prompts``.
    """
    lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines()]
    prompts = [ln for ln in lines if ln]
    if not prompts:
        raise ValueError(f"{path} holds no caption (one per line expected)")
    if num_prompts is not None:
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        if num_prompts > len(prompts):
            raise ValueError(f"num_prompts={num_prompts} but {path} holds only {len(prompts)} captions")
        prompts = prompts[:num_prompts]
    return prompts


def load_pipeline(path: str | os.PathLike[str], *, device: str = "cuda", dtype: str = "float16") -> Any:
    """``StableDiffusion3Pipeline.from_pretrained(path, torch_dtype=..., local_files_only=True)`` on ``device``.

    Raises:
        ImportError: without diffusers (``pip install 'specforest[diffusers]'``).
        ValueError: on an unknown dtype.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    try:
        from diffusers import StableDiffusion3Pipeline
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the sd3 experiment needs diffusers: pip install 'specforest[diffusers]'") from e
    from diffusers.pipelines import pipeline_utils

    # newer diffusers renamed torch_dtype to dtype (the old name warns)
    key = "dtype" if hasattr(pipeline_utils, "_resolve_dtype") else "torch_dtype"
    pipe = StableDiffusion3Pipeline.from_pretrained(str(path), local_files_only=True, **{key: DTYPES[dtype]})
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def clip_scores(
    model_dir: str | os.PathLike[str],
    images: Sequence[Any],
    prompts: Sequence[str],
    *,
    device: str | torch.device = "cpu",
    batch_size: int = 16,
) -> torch.Tensor:
    """CLIP score of each image with its caption: ``100 max(cos(image, text), 0)``.

    Args:
        model_dir: a local CLIP model directory (model and processor), e.g. a
            download of ``openai/clip-vit-large-patch14``.
        images: PIL images.
        prompts: one caption per image.
        device: where CLIP runs.
        batch_size: images per forward pass.

    Returns:
        ``(n,)`` float64 scores.
    """
    from transformers import CLIPModel, CLIPProcessor

    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images but {len(prompts)} captions")
    model = CLIPModel.from_pretrained(str(model_dir), local_files_only=True).to(device).eval()
    proc = CLIPProcessor.from_pretrained(str(model_dir), local_files_only=True)
    max_len = getattr(model.config.text_config, "max_position_embeddings", 77)
    out = []
    with torch.no_grad():
        for i in range(0, len(images), batch_size):
            inputs = proc(
                text=list(prompts[i : i + batch_size]),
                images=list(images[i : i + batch_size]),
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=max_len,
            ).to(device)
            res = model(**inputs)
            img = torch.nn.functional.normalize(res.image_embeds.double(), dim=-1)
            txt = torch.nn.functional.normalize(res.text_embeds.double(), dim=-1)
            out.append(100.0 * (img * txt).sum(-1).clamp_min(0.0))
    return torch.cat(out).cpu()


def _finite(x: float) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _mean_sem(x: torch.Tensor) -> tuple[float | None, float | None]:
    x = x.double()
    n = x.numel()
    mean = x.mean().item() if n else float("nan")
    sem = (x.std(unbiased=True) / math.sqrt(n)).item() if n > 1 else float("nan")
    return _finite(mean), _finite(sem)


def _setting_id(setting: SD3Setting, prompts: Sequence[str], model: str, dtype: str) -> str:
    # K_values is left out: a sweep can be extended to more K in the same directory
    st = {k: v for k, v in setting.as_dict().items() if k != "K_values"}
    blob = json.dumps(
        {"setting": st, "prompts": list(prompts), "model": model, "dtype": dtype}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _encode(pipe: Any, prompts: Sequence[str], setting: SD3Setting) -> dict:
    """Text embeddings of the captions, computed once for every configuration."""
    cfg = setting.guidance_scale > 1
    with torch.no_grad():
        pe, npe, ppe, nppe = pipe.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            prompt_3=None,
            do_classifier_free_guidance=cfg,
            max_sequence_length=setting.max_sequence_length,
        )
    out = {"prompt_embeds": pe, "pooled_prompt_embeds": ppe}
    if cfg:
        out.update(negative_prompt_embeds=npe, negative_pooled_prompt_embeds=nppe)
    return out


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
) -> dict:
    """Run one configuration on every caption and summarise it.

    Args:
        pipe: a loaded ``StableDiffusion3Pipeline``.
        prompts: the captions (one image each).
        setting: the study's :class:`SD3Setting`.
        method: ``standard``, ``rmc`` (chain of ``L`` drafted states) or ``dgrs`` (``(K, L)`` tree).
        K, L: as recorded by :func:`configs`.
        embeds: precomputed text embeddings (default: encoded here).
        max_memory_gb: memory limit (default: :func:`specforest.diffusers.default_memory_limit`).
        clip: a local CLIP directory; adds ``clip_mean`` / ``clip_sem``.
        clip_device: where CLIP runs.
        images_dir: if given, the images are saved there as ``NNNN.png``.
        progress: the sampler's progress bar.

    Returns:
        A flat record (JSON-serialisable).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if embeds is None:
        embeds = _encode(pipe, prompts, setting)
    n = len(prompts)
    size = setting.batch_size or n
    tree_kw: dict = {}
    if method == "dgrs":
        tree_kw = dict(K=K, L=L, coupling="grs")
    elif method == "rmc":
        tree_kw = dict(L=L, coupling="rmc")
    want_images = clip is not None or images_dir is not None
    parts: dict[str, list] = {
        k: [] for k in ("nfe", "attempts", "accepts", "delta_sum", "rounds", "spec_steps", "rows")
    }
    images: list = []
    calls, max_rows, memory, target_seconds = 0, [], None, 0.0
    t0 = time.perf_counter()
    for i, start in enumerate(range(0, n, size)):
        sl = slice(start, start + size)
        g = torch.Generator(device="cpu").manual_seed(_derive_seed(setting.seed, i))
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
            prefetch=setting.prefetch,
            verify=setting.verify,
            progress=progress,
            max_memory_gb=max_memory_gb,
            lazy=setting.lazy,
            shift=setting.shift,
            max_sequence_length=setting.max_sequence_length,
            **tree_kw,
        )
        s = res.stats
        for name, part in parts.items():
            part.append(getattr(s, name).cpu())
        calls += int(s.calls)
        target_seconds += s.target_seconds
        max_rows.append(res.memory.max_rows)
        memory = res.memory
        if want_images:
            images += list(res.images)
    wall = time.perf_counter() - t0
    cat = {k: torch.cat(v) for k, v in parts.items()}
    T = setting.steps
    nfe = cat["nfe"].double()
    att, acc = cat["attempts"].sum(0).double(), cat["accepts"].sum(0).double()
    n_att = att.sum().item()
    rounds = cat["rounds"].sum().item()
    nfe_mean, nfe_sem = _mean_sem(nfe)
    sp_mean, sp_sem = _mean_sem(T / nfe)
    pp_mean, pp_sem = _mean_sem((T - 2) / (nfe - 2))
    record = {
        "method": method,
        "K": K,
        "L": L,
        "budget": {"standard": 0, "rmc": L, "dgrs": budget(K, L)}[method],
        "images": n,
        "nfe_mean": nfe_mean,
        "nfe_sem": nfe_sem,
        "speedup_mean": sp_mean,
        "speedup_sem": sp_sem,
        "speedup_paper_mean": pp_mean,
        "speedup_paper_sem": pp_sem,
        "accept_rate": _finite(acc.sum().item() / n_att) if n_att else None,
        "accept_rate_per_depth": [_finite(a) for a in (acc / att).tolist()],
        "delta_per_depth": [_finite(d) for d in (cat["delta_sum"].sum(0) / att).tolist()],
        "steps_per_round": _finite(cat["spec_steps"].sum().item() / rounds) if rounds else None,
        "rows_mean": _finite(cat["rows"].double().mean().item()),
        "nfe_per_image": [int(v) for v in cat["nfe"].tolist()],
        "calls": calls,
        "max_rows": max_rows,
        "memory_per_round_gb": memory.round_bytes / 1e9,
        "memory_peak_gb": memory.total_bytes / 1e9,
        "wall_seconds": wall,
        "target_seconds": target_seconds,
        "clip_mean": None,
        "clip_sem": None,
    }
    if clip is not None:
        scores = clip_scores(clip, images, list(prompts), device=clip_device)
        record["clip_mean"], record["clip_sem"] = _mean_sem(scores)
    if images_dir is not None:
        d = Path(images_dir)
        for j, im in enumerate(images):
            atomic_write(d / f"{j:04d}.png", lambda f, im=im: im.save(f, format="PNG"), binary=True)
    return record


def write_results(out_dir: str | os.PathLike[str], records: list[dict]) -> list[Path]:
    """``results.json`` and ``results.csv``, written atomically."""
    out_dir = Path(out_dir)
    return [
        atomic_write_text(out_dir / "results.json", json.dumps(records, indent=1, allow_nan=False) + "\n"),
        atomic_write_text(out_dir / "results.csv", records_csv(records)),
    ]


def write_figure(records: list[dict], out_dir: str | os.PathLike[str]) -> Path:
    """Figure 5: speedup ``T / NFE`` against ``K`` for D-GRS and RMC at the matched budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(out_dir) / "speedup_vs_K.png"
    fig, ax = plt.subplots(figsize=(6.5, 4.2), constrained_layout=True)
    dg = sorted((r for r in records if r["method"] == "dgrs"), key=lambda r: r["K"])
    rm = {r["budget"]: r for r in records if r["method"] == "rmc"}

    def arr(rs, key):
        return np.array([np.nan if r[key] is None else r[key] for r in rs], dtype=float)

    if dg:
        Ks = np.array([r["K"] for r in dg], dtype=float)
        m, s = arr(dg, "speedup_mean"), np.nan_to_num(arr(dg, "speedup_sem"))
        ax.plot(Ks, m, "o-", color="C0", label="D-GRS, (K, L) tree")
        ax.fill_between(Ks, m - s, m + s, color="C0", alpha=0.2, lw=0)
        pairs = [(r["K"], rm[r["budget"]]) for r in dg if r["budget"] in rm]
        if pairs:
            kr = np.array([k for k, _ in pairs], dtype=float)
            mr = arr([r for _, r in pairs], "speedup_mean")
            sr = np.nan_to_num(arr([r for _, r in pairs], "speedup_sem"))
            ax.errorbar(kr, mr, yerr=sr, fmt="s--", color="C3", capsize=3, label="RMC, chain of matched B")
        ax.set_xticks(Ks, [f"{int(k)}\nB={r['budget']}" for k, r in zip(Ks, dg, strict=True)])
    ax.axhline(1.0, color="gray", ls=":", label="standard sampler")
    ax.set_xlabel("K (children per node)")
    ax.set_ylabel("speedup T / NFE (mean ± SEM)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if records:
        r = records[0]
        ax.set_title(
            f"SD3 {r['height']}x{r['width']}, T={r['steps']}, guidance {r['guidance_scale']}, churn {r['churn']}, "
            f"shift {r['shift']}, L={r['L_tree']}, {r['images']} images, verify={r['verify']}",
            fontsize=7,
        )
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=150, bbox_inches="tight"), binary=True)
    finally:
        plt.close(fig)
    return path


@dataclass
class SD3Experiment:
    """What :func:`run_experiment` returns.

    Attributes:
        records: one per configuration, in run order (resumed ones included).
        ran: configurations run now.
        skipped: configurations found in ``results.json`` and not rerun.
        files: paths written.
    """

    records: list[dict]
    ran: int
    skipped: int
    files: list[Path] = field(default_factory=list)


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
) -> SD3Experiment:
    """The study of Sec. 5.3: standard, then D-GRS and RMC for every ``K`` of the setting.

    Resumable: configurations already in ``out_dir/results.json`` for the same
    setting (``K_values`` aside), captions, model and dtype are skipped; results are rewritten
    (atomically) after every configuration, then the figure.

    Args:
        pipe: a loaded ``StableDiffusion3Pipeline``.
        prompts: the captions.
        setting: the :class:`SD3Setting`.
        out_dir: output directory (``results.json``, ``results.csv``,
            ``speedup_vs_K.png``, ``images/<config>/`` with ``save_images``).
        model, dtype: recorded (and part of the resume key).
        max_memory_gb, clip, clip_device: as in :func:`run_config`.
        save_images: write every image as PNG.
        progress: sampler progress bars.
        log: receives one line per configuration.

    Raises:
        ValueError: if ``out_dir`` holds results of another setting.
    """
    out_dir = Path(out_dir)
    sid = _setting_id(setting, prompts, model, dtype)
    old = load_records(out_dir / "results.json")
    other = {r.get("setting_id") for r in old} - {sid}
    if other:
        raise ValueError(
            f"{out_dir} holds results of another setting (setting_id {min(map(str, other))}, this one {sid}); "
            "use another --out or move the old results away"
        )
    done = {(r["method"], r["K"], r["L"]): r for r in old}
    store = dict(done)  # every record of out_dir, this sweep's replacing older ones
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
    for method, K, L in configs(setting.K_values, setting.L):
        key = (method, K, L)
        if key in done and (clip is None or done[key].get("clip_mean") is not None):
            records.append(done[key])
            skipped += 1
            log(f"{_label(done[key])}: done before, skipped")
            continue
        if embeds is None:
            embeds = _encode(pipe, prompts, setting)
        name = {"standard": "standard", "rmc": f"rmc_B{L}", "dgrs": f"dgrs_K{K}_L{L}"}[method]
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
            images_dir=out_dir / "images" / name if save_images else None,
            progress=progress,
        )
        rec = {**rec, **common}
        records.append(rec)
        store[key] = rec
        ran += 1
        write_results(out_dir, list(store.values()))
        log(_line(rec))
    every = list(store.values())
    files = write_results(out_dir, every) + [write_figure(every, out_dir)]
    return SD3Experiment(records, ran, skipped, files)


def _label(r: dict) -> str:
    return {
        "standard": "standard sampler",
        "rmc": f"RMC chain B={r['budget']}",
        "dgrs": f"D-GRS K={r['K']} L={r['L']} (B={r['budget']})",
    }[r["method"]]


def _pm(mean: float | None, sem: float | None, digits: int = 3) -> str:
    if mean is None:
        return "n/a"
    return f"{mean:.{digits}f}" if sem is None else f"{mean:.{digits}f} ± {sem:.{digits}f}"


def _line(r: dict) -> str:
    acc = "-" if r["accept_rate"] is None else f"{r['accept_rate']:.3f}"
    clip = "" if r.get("clip_mean") is None else f"  CLIP {_pm(r['clip_mean'], r['clip_sem'], 2)}"
    return (
        f"{_label(r)}: NFE {_pm(r['nfe_mean'], r['nfe_sem'], 2)}  speedup {_pm(r['speedup_mean'], r['speedup_sem'])}"
        f"  acceptance {acc}{clip}  ({r['wall_seconds']:.1f} s)"
    )


def format_summary(records: list[dict]) -> str:
    """A table: one line per ``K`` with D-GRS and RMC at the matched budget, and the standard sampler."""
    dg = {r["K"]: r for r in records if r["method"] == "dgrs"}
    rm = {r["budget"]: r for r in records if r["method"] == "rmc"}
    st = next((r for r in records if r["method"] == "standard"), None)

    def cells(r):
        if r is None:
            return f"{'-':>16} {'-':>6} {'-':>13}"
        acc = "-" if r["accept_rate"] is None else f"{r['accept_rate']:.3f}"
        return f"{_pm(r['speedup_mean'], r['speedup_sem']):>16} {acc:>6} {_pm(r['clip_mean'], r['clip_sem'], 2):>13}"

    head = f"{'K':>2} {'B':>4}  {'D-GRS T/NFE':>16} {'acc':>6} {'CLIP':>13}   {'RMC T/NFE':>16} {'acc':>6} {'CLIP':>13}"
    lines = [head, "-" * len(head)]
    for K in sorted(dg):
        lines.append(f"{K:>2} {dg[K]['budget']:>4}  {cells(dg[K])}   {cells(rm.get(dg[K]['budget']))}")
    if st is not None:
        lines.append(
            f"standard sampler: NFE {_pm(st['nfe_mean'], st['nfe_sem'], 2)}, CLIP {_pm(st['clip_mean'], st['clip_sem'], 2)}"
        )
    return "\n".join(lines)
