"""A pipeline's own stochastic scheduler (``chain="scheduler"``): standard calls against the best exact configuration.

    .venv/bin/python benchmarks/schedulers.py [--images 8]
    .venv/bin/python benchmarks/schedulers.py --dry-run   # 2 images, few steps; prints, writes nothing

Each scheduler ``specforest.diffusers.sample(pipe, ..., chain="scheduler")`` follows, swapped into a
tiny SD 1.5 pipeline (built in code as the tests build it) at its usual step count: DDPM 50, DDIM
(eta 1) 50, Euler ancestral 30, DPM++ 2M SDE (``sde-dpmsolver++``) 25, LCM 6, TCD (eta 0.3) 6; and
the stochastic flow-matching scheduler on a tiny SD3 pipeline at 28. Two networks: the tiny
pipeline's random UNet, and the exact noise of a Gaussian data law (``GaussianUNet``), whose
predictions move like a trained model's. The standard sampler takes ``T`` calls; the exact
configurations tried are the RMC chains of ``B`` = 4, 8, 16, 32 with the ``x0`` and ``secant``
drafts; the table gives the best as T/NFE (mean ± standard error over images), and at that
configuration the sampler's own time per round beside the network call's (one thread). Every
configuration has the scheduler's law (``tests/test_diffusers_scheduler_pipelines.py``).

Then ``tune_sdxl(pipe, ..., chain="scheduler")``'s choice for one image, for Euler ancestral and
DPM++ 2M SDE on the random UNet: the configuration, its predicted speedup, and the sampling wall time
of the standard sampler and of the choice, measured side by side (interleaved, median of the repeats,
warm, one thread). Regenerates the ``schedulers`` section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny pipelines, built as the tests build them

import diffusers  # noqa: E402

import specforest.diffusers as px  # noqa: E402
from specforest import trees  # noqa: E402
from specforest.experiments.results import machine_line, replace_section  # noqa: E402

BUDGETS = (4, 8, 16, 32)
DRAFTS = ("x0", "secant")
SCHEDULERS = [
    ("DDPM", "DDPMScheduler", {"clip_sample": False}, 0.0, 50),
    ("DDIM, eta 1", "DDIMScheduler", {"clip_sample": False}, 1.0, 50),
    ("Euler ancestral", "EulerAncestralDiscreteScheduler", {}, 0.0, 30),
    ("DPM++ 2M SDE", "DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}, 0.0, 25),
    ("LCM", "LCMScheduler", {}, 0.0, 6),
    ("TCD, eta 0.3", "TCDScheduler", {}, 0.3, 6),
    ("KDPM2 ancestral", "KDPM2AncestralDiscreteScheduler", {}, 0.0, 25),
    ("DPM++ SDE", "DPMSolverSDEScheduler", {}, 0.0, 20),
]


def _swap(pipe, name: str, cfg: dict):
    import copy

    other = copy.copy(pipe)
    object.__setattr__(other, "scheduler", getattr(diffusers, name).from_config(pipe.scheduler.config, **cfg))
    return other


def _run(pipe, prompt, steps: int, eta: float, images: int, **kw):
    extra = {"eta": eta} if eta else {}
    return px.sample(
        pipe, prompt, chain="scheduler", num_inference_steps=steps, num_images_per_prompt=images, height=8, width=8,
        output_type="latent", generator=torch.Generator().manual_seed(0), progress=False, **extra, **kw,
    )  # fmt: skip


def best(pipe, prompt, steps: int, eta: float, images: int) -> tuple:
    """``(label, T/NFE, its standard error, sampler ms a round, network ms a call, T)`` of the best configuration,
    ``T`` the standard sampler's calls (``2 steps - 1`` for a scheduler of two calls a step)."""
    top = ("", 0.0, 0.0, 0.0, 0.0, steps)
    for B in BUDGETS:
        for draft in DRAFTS:
            out = _run(pipe, prompt, steps, eta, images, tree=trees.chain(B), coupling="rmc", draft=draft)
            nfe = out.stats.nfe.double()
            T = int(out.stats.standard_calls)
            r = T / float(nfe.mean())
            se = float(nfe.std() / nfe.numel() ** 0.5) * T / float(nfe.mean()) ** 2
            calls = max(int(out.stats.calls), 1)
            own = 1000 * (out.stats.wall_seconds - out.stats.target_seconds) / calls
            net = 1000 * out.stats.target_seconds / calls
            print(f"    B = {B} {draft}: {r:.2f} ± {se:.2f}", file=sys.stderr, flush=True)
            if r > top[1]:
                top = (f"RMC chain B = {B}, {draft}", r, se, own, net, T)
    return top


TUNED = ("Euler ancestral", "DPM++ 2M SDE")
"""The schedulers whose ``tune_sdxl`` choice is measured."""


def tuned_row(pipe, prompt, label: str, steps: int, eta: float, repeats: int) -> str:
    """The table row of ``tune_sdxl(chain="scheduler")``'s choice for one image: the configuration, its
    prediction, and the median sampling wall time of the standard sampler and of the choice, run in turns."""
    from specforest.diffusers import tune_sdxl

    t0 = time.perf_counter()
    tuned = tune_sdxl(
        pipe, prompt, num_inference_steps=steps, height=8, width=8, batch=1, budget_max=32,
        drafts=DRAFTS, calibration_images=4, chain="scheduler", eta=eta,
    )  # fmt: skip
    tune_s = time.perf_counter() - t0
    walls: dict = {"standard": [], "tuned": []}
    nfe = []
    for _ in range(repeats + 1):  # (the first pass warms up, and is not kept)
        for kind in walls:
            # (the choice with its check: chain="scheduler" and eta are _run's, the same as tuned)
            kw = {k: v for k, v in tuned.items() if k not in ("chain", "eta")} if kind == "tuned" else {}
            out = _run(pipe, prompt, steps, eta, 1, **kw)
            walls[kind].append(out.stats.wall_seconds)
            if kind == "tuned":
                nfe.append(float(out.stats.nfe.double().mean()))
    med = {k: sorted(v[1:])[len(v[1:]) // 2] for k, v in walls.items()}
    return (
        f"| {label} | {steps} | {tuned.label} | {tuned.predicted_speedup:.2f}x | "
        f"{steps / (sum(nfe[1:]) / len(nfe[1:])):.2f} | {1000 * med['standard']:.0f} | {1000 * med['tuned']:.0f} | "
        f"{med['standard'] / med['tuned']:.2f}x | {tune_s:.0f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=8, help="images per setting (>= 2)")
    ap.add_argument("--dry-run", action="store_true", help="2 images, few steps; print, write nothing")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = ap.parse_args()
    if args.images < 2:
        ap.error("--images must be >= 2")
    images = 2 if args.dry_run else args.images
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    from test_diffusers_sdxl import BETAS, GaussianUNet, build_tiny_pipeline

    sd = build_tiny_pipeline("sd")
    lines = [
        f"Measured with `benchmarks/schedulers.py --images {args.images}` on {machine_line()}, 1 thread.",
        "",
        "`chain=\"scheduler\"`: the pipeline's own scheduler, swapped in from its config. Standard calls `T` "
        "against the best exact configuration among the RMC chains of B = " + ", ".join(map(str, BUDGETS)) +
        " with the `x0` and `secant` drafts; T/NFE, mean ± standard error over images; at that configuration the "
        "sampler's own time per round beside the network call (ms).",
        "",
        "| network | scheduler | standard calls | best exact configuration | T/NFE | sampler ms / round | network ms / call |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for label, name, cfg, eta, steps in SCHEDULERS:
        steps = min(steps, 6) if args.dry_run else steps
        for net in ("random UNet", "Gaussian UNet"):
            pipe = _swap(sd, name, {**BETAS, **cfg} if net == "Gaussian UNet" else cfg)
            if net == "Gaussian UNet":
                object.__setattr__(pipe, "unet", GaussianUNet(sd.unet.config, pipe.scheduler.alphas_cumprod))
            print(f"tiny SD 1.5, {net}: {label}, {steps} steps", file=sys.stderr, flush=True)
            how, r, se, own, call, T = best(pipe, "a photo of a cat", steps, eta, images)
            lines.append(
                f"| tiny SD 1.5, {net} | {label} | {T} | {how} | {r:.2f} ± {se:.2f} | {own:.2f} | {call:.2f} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    from test_diffusers_sd3 import build_tiny_pipeline as build_sd3

    with tempfile.TemporaryDirectory() as tmp:
        sd3 = build_sd3(Path(tmp))
    flow = _swap(sd3, "FlowMatchEulerDiscreteScheduler", {"stochastic_sampling": True})
    steps = 6 if args.dry_run else 28
    print(f"tiny SD3: flow matching, stochastic, {steps} steps", file=sys.stderr, flush=True)
    how, r, se, own, call, T = best(flow, "a photo of a cat", steps, 0.0, images)
    lines.append(
        f"| tiny SD3, random transformer | FlowMatchEuler, stochastic_sampling | {T} | {how} | {r:.2f} ± {se:.2f} "
        f"| {own:.2f} | {call:.2f} |"
    )
    repeats = 1 if args.dry_run else 5
    lines += [
        "",
        f'`tune_sdxl(pipe, ..., chain="scheduler")`\'s choice for one image on the random UNet (RMC chains up to '
        f"B = 32 and D-GRS trees, drafts {', '.join(DRAFTS)}), and the sampling wall time of the standard sampler and "
        f"of the choice, run in turns: median of {repeats} warm repeats each, one thread.",
        "",
        "| scheduler | standard calls | tune's choice | predicted speedup | T/NFE | standard ms | tuned ms | "
        "measured speedup | tune s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, name, cfg, eta, steps in SCHEDULERS:
        if label in TUNED:
            steps = min(steps, 6) if args.dry_run else steps
            print(f"tune_sdxl: {label}, {steps} steps", file=sys.stderr, flush=True)
            lines.append(tuned_row(_swap(sd, name, cfg), "a photo of a cat", label, steps, eta, repeats))
            print(lines[-1], file=sys.stderr, flush=True)
    lines += ["", f"Total wall time {(time.perf_counter() - t0) / 60:.1f} min."]
    text = "\n".join(lines)
    if not args.dry_run:
        replace_section(args.out, "schedulers", "## A pipeline's own scheduler: calls of each", text)
    print(text)


if __name__ == "__main__":
    main()
