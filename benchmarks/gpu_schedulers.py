"""The GPU run's scheduler stages: an SDXL-sized UNet inside a ``StableDiffusionXLPipeline``, two stochastic schedulers.

One stage per scheduler of :data:`SCHEDULERS` (``benchmarks/gpu.py`` runs them in their time
boxes): ``sdxl-euler-ancestral-1024`` (``EulerAncestralDiscreteScheduler``, T = 30) and
``sdxl-dpmpp-2m-sde-1024`` (``DPMSolverMultistepScheduler(algorithm_type="sde-dpmsolver++")``,
T = 25), each swapped in from the pipeline's scheduler config (SDXL base's Euler config,
:data:`SDXL_SCHEDULER`) as a diffusers user swaps one, and followed by
``specforest.diffusers.sample(pipe, ..., chain="scheduler")``.

The pipeline is built in code, nothing downloaded (:func:`build_pipeline`): the UNet of
stable-diffusion-xl-base-1.0 (:data:`SDXL_BASE`, 2.57e9 parameters) with random weights
(seed 0) in bf16, built on the device itself; text encoders of the real widths (768 and
1280, pooled projection 1280, 77 tokens) but one layer each, so the UNet sees text
embeddings ``(n, 77, 2048)`` and the added embedding ``(n, 2816)`` of the real shapes; the
byte-pair CLIP tokenizer the tests build in memory (``tests/test_diffusers_sdxl.py``); and a
VAE of a few thousand parameters whose only use is its scale factor 8 (``output_type="latent"``:
nothing is decoded). 1024 x 1024 pixels: latents ``(1, 4, 128, 128)``; guidance 5 (the
pipeline's default), both branches in one UNet call of ``2 B`` rows for ``B`` states.

Each stage times, one image per run, the standard sampler (``tree=None``: the scheduler's own
``T`` calls) and the RMC chains of ``B`` in :attr:`SDXLPlan.budgets` with the ``secant`` draft
(every one has the scheduler's law), each run after its own warm-up (``warmup=True``: the UNet
called once at every row count of the run, not timed), interleaved pass by pass: wall time of
the sampling loop (``stats.wall_seconds``: text encoding, latents and warm-up apart), NFE
(sequential UNet calls), T/NFE, the wall-time speedup over the standard sampler, and the
sampler's own time per round (``stats.sampler_seconds / stats.calls``) beside the UNet call's
(``stats.target_seconds / stats.calls``). A configuration whose bound (``B`` times the
standard run, as if every round committed one step at a linear cost per row) does not fit what
is left of the box is not run, and the stage says so.

With random weights the acceptance is not a trained model's: what carries over is the UNet's
cost per call at each row count and the sampler's own time per round.
"""

from __future__ import annotations

import copy
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

ROOT = Path(__file__).resolve().parents[1]

# -- the models ----------------------------------------------------------------------------

SDXL_BASE = dict(
    sample_size=128,
    in_channels=4,
    out_channels=4,
    layers_per_block=2,
    block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(5, 10, 20),
    transformer_layers_per_block=(1, 2, 10),
    cross_attention_dim=2048,
    addition_embed_type="text_time",
    addition_embed_type_num_heads=64,
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
    use_linear_projection=True,
    norm_num_groups=32,
)
"""``unet/config.json`` of stabilityai/stable-diffusion-xl-base-1.0 (the keys that differ from
``UNet2DConditionModel``'s defaults): 2,567,463,684 parameters; cross-attention on the two text
encoders' hidden states side by side (768 + 1280), the added embedding on six time ids of 256
features and the 1280-wide pooled projection (6 x 256 + 1280 = 2816)."""

SDXL_SCHEDULER = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    num_train_timesteps=1000,
    prediction_type="epsilon",
    steps_offset=1,
    timestep_spacing="leading",
    interpolation_type="linear",
    use_karras_sigmas=False,
)
"""SDXL base's ``EulerDiscreteScheduler`` config (the one the schedulers are swapped in from)."""

SDXL_TINY = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    layers_per_block=1,
    block_out_channels=(8, 16),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(2, 4),
    cross_attention_dim=16,
    addition_embed_type="text_time",
    addition_time_embed_dim=4,
    projection_class_embeddings_input_dim=6 * 4 + 8,
    use_linear_projection=True,
    norm_num_groups=4,
)
"""The dry run's UNet: the tiny SDXL UNet of ``tests/test_diffusers_sdxl.py`` (the same code paths)."""


@dataclass(frozen=True)
class SDXLSize:
    """The pipeline's sizes: the UNet's config, the text encoders' widths, tokens and the image."""

    name: str
    unet: dict
    widths: tuple  # hidden sizes of text_encoder and text_encoder_2
    heads: tuple  # their attention heads
    projection: int  # text_encoder_2's pooled projection
    tokens: int  # the tokenizer's model_max_length
    pixels: int

    @property
    def latent(self) -> tuple:
        """One image's latents ``(C, h, w)`` (the VAE's scale factor 8)."""
        h = self.pixels // VAE_SCALE
        return (self.unet["in_channels"], h, h)

    @property
    def label(self) -> str:
        return f"{self.name}, {self.pixels}x{self.pixels}"


VAE_SCALE = 8
"""Pixels per latent pixel (SDXL's VAE; the tiny one built here has four levels for it)."""

SDXL_1024 = SDXLSize(
    "SDXL-base-sized UNet", SDXL_BASE, widths=(768, 1280), heads=(12, 20), projection=1280, tokens=77, pixels=1024
)
SDXL_DRY = SDXLSize("tiny SDXL UNet", SDXL_TINY, widths=(8, 8), heads=(2, 2), projection=8, tokens=8, pixels=64)


@dataclass(frozen=True)
class SchedulerCase:
    """One stage: a diffusers scheduler swapped in from the pipeline's config, at its usual step count."""

    key: str  # the stage's name in benchmarks/gpu.py
    label: str
    scheduler: str  # diffusers' class name
    config: dict  # from_config overrides
    steps: int


SCHEDULERS = (
    SchedulerCase("sdxl-euler-ancestral-1024", "Euler ancestral", "EulerAncestralDiscreteScheduler", {}, 30),
    SchedulerCase(
        "sdxl-dpmpp-2m-sde-1024",
        "DPM++ 2M SDE",
        "DPMSolverMultistepScheduler",
        {"algorithm_type": "sde-dpmsolver++"},
        25,
    ),
)
STAGES = tuple(c.key for c in SCHEDULERS)


@dataclass(frozen=True)
class SDXLPlan:
    """Sizes of the scheduler stages; :meth:`full` on the GPU, :meth:`dry_run` on the CPU."""

    device: str
    size: SDXLSize
    max_steps: Optional[int]  # None: each scheduler's usual T
    budgets: tuple  # B of the RMC chains tried, ascending
    draft: str
    runs: int  # timed passes (one run of every configuration each)
    guidance: float = 5.0  # SDXL's default: both branches in one call

    @classmethod
    def full(cls) -> "SDXLPlan":
        return cls(device="cuda", size=SDXL_1024, max_steps=None, budgets=(2, 4, 8), draft="secant", runs=2)

    @classmethod
    def dry_run(cls) -> "SDXLPlan":
        return cls(device="cpu", size=SDXL_DRY, max_steps=4, budgets=(2, 4), draft="secant", runs=1)

    def steps(self, case: SchedulerCase) -> int:
        return case.steps if self.max_steps is None else min(case.steps, self.max_steps)


class StageRecord(Protocol):
    """What a stage writes into (``benchmarks/gpu.py``'s ``Stage``)."""

    name: str
    status: str
    notes: list
    result: dict

    def left(self) -> float: ...


# -- the pipeline ----------------------------------------------------------------------------

_PIPELINES: dict = {}  # (size's label, device) -> (pipeline, build seconds, UNet parameters): both stages share it


def release() -> None:
    """Drop the built pipeline (its UNet leaves the GPU)."""
    _PIPELINES.clear()
    gc.collect()


def _text_encoders(size: SDXLSize, vocab: int) -> tuple:
    """``(text_encoder, text_encoder_2)``: CLIP text models of the real widths, one layer each."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    def config(i: int, **kw) -> Any:
        return CLIPTextConfig(
            vocab_size=vocab,
            hidden_size=size.widths[i],
            intermediate_size=4 * size.widths[i],
            num_attention_heads=size.heads[i],
            num_hidden_layers=1,
            max_position_embeddings=size.tokens,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
            **kw,
        )

    return CLIPTextModel(config(0)), CLIPTextModelWithProjection(config(1, projection_dim=size.projection))


def _vae() -> Any:
    """A VAE of four levels (scale factor 8) and a few thousand parameters: only its config is read."""
    import diffusers

    return diffusers.AutoencoderKL(
        block_out_channels=(8,) * 4,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        norm_num_groups=2,
        layers_per_block=1,
        scaling_factor=0.13025,
    )


def build_pipeline(size: SDXLSize, device: str) -> tuple:
    """``(pipe, build seconds, UNet parameters)``: a ``StableDiffusionXLPipeline`` of ``size`` with random
    weights (seed 0) in bf16, every model built on ``device`` itself (2.6e9 parameters initialised on the
    host would take minutes); made once, then shared (:func:`release` drops it)."""
    import torch

    key = (size.label, device)
    if key in _PIPELINES:
        return _PIPELINES[key]
    release()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    import diffusers

    unet = size.unet
    if unet["cross_attention_dim"] != sum(size.widths):
        raise ValueError(f"cross_attention_dim {unet['cross_attention_dim']} is not the text widths {size.widths}")
    if unet["projection_class_embeddings_input_dim"] != 6 * unet["addition_time_embed_dim"] + size.projection:
        raise ValueError("projection_class_embeddings_input_dim is not six time ids and the pooled projection")
    sys.path.insert(0, str(ROOT / "tests"))  # the tokenizer, built in memory as the tests build it
    from test_diffusers_sdxl import clip_tokenizer

    tokenizer, vocab = clip_tokenizer()
    tokenizer.model_max_length = size.tokens
    # (its warning that casting with to() keeps no module in float32: there is none to keep)
    diffusers.utils.logging.set_verbosity_error()
    t0 = time.perf_counter()
    devices = [torch.device(device).index or 0] if device.startswith("cuda") else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        with torch.device(device):
            models = dict(
                unet=diffusers.UNet2DConditionModel(**unet),
                vae=_vae(),
                **dict(zip(("text_encoder", "text_encoder_2"), _text_encoders(size, vocab), strict=True)),
            )
    models = {k: m.to(device=device, dtype=torch.bfloat16).eval().requires_grad_(False) for k, m in models.items()}
    pipe = diffusers.StableDiffusionXLPipeline(
        **models,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        scheduler=diffusers.EulerDiscreteScheduler(**SDXL_SCHEDULER),
        force_zeros_for_empty_prompt=True,
    )
    pipe.set_progress_bar_config(disable=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    params = sum(p.numel() for p in models["unet"].parameters())
    _PIPELINES[key] = (pipe, time.perf_counter() - t0, params)
    return _PIPELINES[key]


def swapped(pipe: Any, case: SchedulerCase) -> Any:
    """A shallow copy of ``pipe`` (the same models) with ``case``'s scheduler made from its scheduler config."""
    from specforest.diffusers.schedulers import scheduler_class

    other = copy.copy(pipe)
    object.__setattr__(
        other, "scheduler", scheduler_class(case.scheduler).from_config(pipe.scheduler.config, **case.config)
    )
    return other


# -- the stage -------------------------------------------------------------------------------


PROMPT = "a photo of a cat on the street"


def _configs(plan: SDXLPlan) -> list:
    """``[(label, B or 0)]``: the standard sampler, then the RMC chains."""
    return [("standard", 0)] + [(f"RMC chain B={b}, {plan.draft}", b) for b in plan.budgets]


def _run(pipe: Any, plan: SDXLPlan, steps: int, budget: int, seed: int) -> Any:
    """One image, after its warm-up: the result's ``stats`` (``nfe (1,)``, ``calls``, seconds)."""
    import torch

    import specforest.diffusers as px
    from specforest import trees

    spec = {} if budget == 0 else dict(tree=trees.chain(budget), coupling="rmc", draft=plan.draft)
    return px.sample(
        pipe,
        PROMPT,
        chain="scheduler",
        num_inference_steps=steps,
        guidance_scale=plan.guidance,
        height=plan.size.pixels,
        width=plan.size.pixels,
        output_type="latent",
        generator=torch.Generator().manual_seed(seed),
        progress=False,
        warmup=True,
        **spec,
    ).stats


def summarize(runs: dict, steps: int) -> tuple:
    """``(rows, best label)`` from ``runs``, ``{label: [(wall s, NFE, calls, sampler s, network s, {phase:
    s}), ...]}`` (the standard sampler's first): one row per configuration run, means over its runs (the
    round engine's phases in ms per round); the best is the exact configuration of least wall time
    (``None`` before one ran)."""
    base = statistics.fmean(r[0] for r in runs["standard"]) if runs.get("standard") else None
    rows = []
    for label, got in runs.items():
        if not got:
            continue
        wall, nfe, calls, sampler, network = (statistics.fmean(v) for v in list(zip(*got, strict=True))[:5])
        phases = {k: 1e3 * statistics.fmean(g[5].get(k, 0.0) for g in got) / calls for k in got[0][5]}
        rows.append(
            dict(
                label=label,
                runs=len(got),
                wall_s=wall,
                nfe=nfe,
                t_over_nfe=steps / nfe,
                sampler_ms=1e3 * sampler / calls,
                network_ms=1e3 * network / calls,
                phase_ms=phases,
                speedup=base / wall if base else None,
            )
        )
    exact = [r for r in rows if r["label"] != "standard"]
    best = min(exact, key=lambda r: r["wall_s"])["label"] if exact else None
    return rows, best


def stage_scheduler(plan: SDXLPlan, case: SchedulerCase, st: StageRecord) -> None:
    """``case``'s stage: the standard sampler and the RMC chains, pass by pass, inside ``st``'s box.

    ``st.result`` holds, as soon as each run ends: ``label``, ``pipeline``, ``params``,
    ``build_seconds``, ``steps``, ``rows`` (:func:`summarize`) and ``best``.
    """
    pipe, build_seconds, params = build_pipeline(plan.size, plan.device)
    pipe = swapped(pipe, case)
    steps = plan.steps(case)
    st.result.update(
        label=case.label,
        scheduler=case.scheduler,
        pipeline=plan.size.label,
        latent=plan.size.latent,
        params=params,
        build_seconds=build_seconds,
        steps=steps,
        rows=[],
        best=None,
    )
    configs = _configs(plan)
    runs: dict = {label: [] for label, _ in configs}

    def record(label: str, stats: Any) -> None:
        calls = max(int(stats.calls), 1)
        nfe = float(stats.nfe.double().mean())
        seconds = (stats.wall_seconds, nfe, calls, stats.sampler_seconds, stats.target_seconds)
        runs[label].append((*seconds, dict(stats.phase_seconds)))
        st.result["rows"], st.result["best"] = summarize(runs, steps)

    for r in range(plan.runs):
        walls = {label: statistics.fmean(w for w, *_ in got) for label, got in runs.items() if got}
        if r and 1.3 * sum(walls.values()) > st.left():
            st.notes.append(f"{r} timed runs per row, not {plan.runs} (the box)")
            break
        for label, budget in configs:
            if r and not runs[label]:
                continue  # not run in the first pass: not in the others
            if budget and not r:
                # a bound: every round commits one step, at B times the standard round (a linear cost per
                # row), and its warm-up; a run the box stops loses only itself (the others are recorded)
                bound = 1.2 * budget * walls.get("standard", 0.0)
                if bound > st.left():
                    st.notes.append(f"{label} not run (up to {bound:.0f} s, {st.left():.0f} s left)")
                    continue
            record(label, _run(pipe, plan, steps, budget, seed=r))
            walls[label] = statistics.fmean(w for w, *_ in runs[label])


# -- the report ------------------------------------------------------------------------------


def report_lines(plan: SDXLPlan, stages: list) -> list:
    """Markdown lines for the ``gpu`` section: one summary row per scheduler stage in ``stages`` (a stage
    that measured nothing says why, from its status), then every configuration's row."""
    size = plan.size
    lines = [
        "",
        f'**The pipeline\'s own scheduler** (`chain="scheduler"`; {size.label}: a StableDiffusionXLPipeline '
        f"built in code, UNet with random weights, seed 0, bf16; text encoders {size.widths[0]} and "
        f"{size.widths[1]} wide, one layer each, {size.tokens} tokens; latents {'x'.join(map(str, size.latent))}, output_type latent; guidance "
        f"{plan.guidance:g}, both branches in one call; one image per run, each after its own warm-up). The "
        f"standard sampler (`tree=None`, T calls) against the RMC chains of B = "
        f"{', '.join(map(str, plan.budgets))} with the `{plan.draft}` draft; the best is the one of least wall "
        "time (the sampling loop's, `stats.wall_seconds`). Sampler ms / round is `stats.sampler_seconds / "
        "stats.calls`, beside the UNet call's ms (2 B rows a call). With random weights the acceptance is not "
        "a trained model's.",
        "",
        "| scheduler | steps T | standard: calls, wall | best exact configuration | its NFE | T/NFE | "
        "wall speedup | sampler ms / round: standard / best | network ms / call: standard / best |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    details = []
    cases = {c.key: c for c in SCHEDULERS}
    for st in stages:
        case = cases[st.name]
        res = st.result
        rows = {r["label"]: r for r in res.get("rows", [])}
        std, best = rows.get("standard"), rows.get(res.get("best"))
        steps = res.get("steps", plan.steps(case))
        if std is None:
            lines.append(f"| {case.label} | {steps} | not run ({st.status}) | - | - | - | - | - | - |")
            continue
        if best is None:
            lines.append(
                f"| {case.label} | {steps} | {steps}, {std['wall_s']:.2f} s | none run ({st.status}) | - | - | - | "
                f"{std['sampler_ms']:.2f} / - | {std['network_ms']:.1f} / - |"
            )
        else:
            lines.append(
                f"| {case.label} | {steps} | {steps}, {std['wall_s']:.2f} s | {best['label']} | {best['nfe']:.1f} | "
                f"{best['t_over_nfe']:.2f} | {best['speedup']:.2f}x | {std['sampler_ms']:.2f} / "
                f"{best['sampler_ms']:.2f} | {std['network_ms']:.1f} / {best['network_ms']:.1f} |"
            )
        for r in rows.values():
            speed = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
            details.append(
                f"| {case.label} | {r['label']} | {r['runs']} | {r['nfe']:.1f} | {r['t_over_nfe']:.2f} | "
                f"{r['wall_s']:.2f} s | {speed} | {r['sampler_ms']:.2f} | {r['network_ms']:.1f} |"
            )
    if details:
        lines += [
            "",
            "| scheduler | configuration | runs | NFE | T/NFE | wall | wall speedup | sampler ms / round | "
            "network ms / call |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *details,
        ]
    return lines
