"""One prepared GPU run: the digits model, SD3-medium- and Flux-dev-sized transformers, an SDXL-sized UNet, on CUDA.

    benchmarks/gpu.sh             # on one large CUDA GPU: at most 8 minutes, no downloads
    benchmarks/gpu.sh --dry-run   # the same code paths at tiny sizes on the CPU

Stages, in order of priority, each in its own time box (its share of ``--budget``
seconds, with what the stages before it left over); a stage that runs out of time
stops where it is, keeps what it measured and says what it did not reach:

1. ``digits-law``: a law smoke test on the shipped digits model
   (:mod:`specforest.models.digits`, T = 100, churn 0.3): D-GRS (2,3) and the RMC
   chain of 14 against the standard sampler, and a deliberately wrong chain
   (every draft accepted unverified) that the same test must reject. Six statistics
   per image (projections on the four lowest 2-D cosine modes, the mean square and
   the total variation), each a two-sample z-score from the two runs' standard
   errors, against a Bonferroni threshold at level 1e-3; independent initial
   states and noise per run.
2. ``digits-syncs``: host-device synchronizations per round (full mode, 64 images):
   ``torch.cuda.set_sync_debug_mode("warn")`` warnings, and host reads counted as
   ``tests/test_syncs.py`` counts them on the CPU (a dispatch counter and the
   engine's planned ``host_read``).
3. ``digits-latency``: ``benchmarks/wallclock.py``'s protocol for the digits model
   (cost curve, tuned configuration, latency rows with predictions) at one image per
   run, in fewer runs and blocks.
4. ``sd3-512``, ``sd3-1024``, ``flux-512``, ``flux-1024``: diffusers'
   ``SD3Transformer2DModel`` and ``FluxTransformer2DModel`` built from the
   configurations of stable-diffusion-3-medium and FLUX.1-dev (:data:`SD3_MEDIUM`,
   :data:`FLUX_DEV`) with random weights in bf16, random text embeddings of the
   real shapes, guidance on (SD3: classifier-free, scale 7, both branches in one
   call; Flux: embedded guidance 3.5), T = 28 steps, churn 0.8, one image per run:
   the cost curve (sizes chosen from one timed call to fit the box), the tuner's
   choice (:func:`specforest.latency.tune` on that curve, draft ``x0``, budgets up
   to 8, one calibration image), and timed runs of the standard sampler, an RMC
   chain of 4 and the tuned configuration (sampler time per round, wall per image,
   predicted, speedup).
5. ``sdxl-euler-ancestral-1024``, ``sdxl-dpmpp-2m-sde-1024``: the pipeline's own scheduler
   (``chain="scheduler"``) in a ``StableDiffusionXLPipeline`` built in code around
   stable-diffusion-xl-base-1.0's UNet with random weights in bf16, 1024 x 1024, Euler ancestral
   (T = 30) and DPM++ 2M SDE (T = 25): the standard sampler against RMC chains, one image per
   run (NFE, T/NFE, wall speedup, sampler time per round beside the UNet call);
   :mod:`gpu_schedulers`.
6. ``natural64`` (run after ``digits-latency``, before the transformers): the shipped trained natural-image network (d = 12,288) and one of its architecture
   at ``Plan.natural_width`` times its channels with RANDOM weights (no wider trained network ships:
   its cost per call is real, its acceptance is not a trained network's): euler_ancestral 50 Karras
   steps, the standard sampler against an RMC chain of 8 with the velocity and cached drafts and the
   oracle (the target as its own draft), acceptance and delta per depth, T/NFE, seconds, time per call.
7. ``digits-throughput``: the digits protocol at 64 images per run, with the time left.

Each stage's transformer model is built once per family (both sizes share it) and freed
before the next family's; the SDXL pipeline once for both schedulers, after the transformers.

Writes the ``gpu`` section of ``benchmarks/RESULTS.md`` and the GPU rows of its
``wallclock`` section (the sub-block ``wallclock_gpu``; the CPU rows stay as they
are), and prints both. ``--dry-run`` runs on the CPU with tiny transformers, few
steps and images, writes into a copy of the results file in a temporary directory
(never into ``benchmarks/RESULTS.md``) and prints it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import math
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # wallclock.py and gpu_schedulers.py, beside this file

import gpu_schedulers  # noqa: E402
import wallclock  # noqa: E402

RESULTS = HERE / "RESULTS.md"

# -- the models ----------------------------------------------------------------------------

SD3_MEDIUM = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=192,
)
"""``transformer/config.json`` of stabilityai/stable-diffusion-3-medium-diffusers: 24 joint
blocks, 24 heads of 64 (hidden 1536), about 2.0e9 parameters."""
SD3_TEXT_TOKENS = 77 + 256
"""CLIP (77) and T5 (``max_sequence_length`` 256, the pipeline's default) tokens, concatenated."""
SD3_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}
"""The medium release's ``FlowMatchEulerDiscreteScheduler`` config (static shift 3)."""

FLUX_DEV = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
"""``transformer/config.json`` of black-forest-labs/FLUX.1-dev: 19 double-stream and 38
single-stream blocks, 24 heads of 128 (hidden 3072), embedded guidance, about 1.2e10 parameters."""
FLUX_TEXT_TOKENS = 512
"""T5 tokens (``max_sequence_length`` 512, FluxPipeline's default)."""
FLUX_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}
"""FLUX.1-dev's scheduler config (dynamic shift from the packed sequence length)."""

VAE_SCALE = 8
"""Pixels per latent pixel of both VAEs."""

# the dry run's transformers: the same classes and code paths, a few thousand parameters
SD3_TINY = dict(SD3_MEDIUM, num_layers=1, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16)
SD3_TINY.update(caption_projection_dim=16, pooled_projection_dim=16, pos_embed_max_size=16, sample_size=8)
FLUX_TINY = dict(FLUX_DEV, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2)
FLUX_TINY.update(joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))


@dataclass(frozen=True)
class TransformerSpec:
    """One transformer target: a family's configuration at one image size."""

    key: str
    family: str  # "sd3" or "flux"
    config: dict
    pixels: int
    text_tokens: int
    guidance: float

    @property
    def latent(self) -> tuple:
        """The sampler's state ``(C, h, w)`` (Flux: unpacked, packed inside its adapter)."""
        h = self.pixels // VAE_SCALE
        channels = self.config["in_channels"] // (4 if self.family == "flux" else 1)
        return (channels, h, h)

    @property
    def image_tokens(self) -> int:
        h = self.pixels // VAE_SCALE
        return (h // 2) ** 2  # SD3 patches of 2, Flux packs 2 x 2

    @property
    def label(self) -> str:
        name = "SD3-medium-sized" if self.family == "sd3" else "Flux-dev-sized"
        return f"{name} transformer, {self.pixels}x{self.pixels}"


def transformer_specs(dry: bool) -> list:
    """The four targets (the dry run's at 64 and 128 pixels, tiny configurations)."""
    sizes = (64, 128) if dry else (512, 1024)
    sd3, flux = (SD3_TINY, FLUX_TINY) if dry else (SD3_MEDIUM, FLUX_DEV)
    text = (6, 6) if dry else (SD3_TEXT_TOKENS, FLUX_TEXT_TOKENS)
    out = []
    for fam, cfg, tokens, g in (("sd3", sd3, text[0], 7.0), ("flux", flux, text[1], 3.5)):
        for px, name in zip(sizes, ("512", "1024"), strict=True):
            out.append(TransformerSpec(f"{fam}-{name}", fam, cfg, px, tokens, g))
    return out


# -- the plan: sizes of everything, full or dry ----------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Sizes of every stage; :meth:`full` on the GPU, :meth:`dry_run` on the CPU."""

    dry: bool
    device: str
    law_images: int
    law_steps: int
    law_churn: float
    sync_images: int
    sync_steps: int
    digits_steps: Optional[int]  # None: wallclock.py's T = 100
    digits_latency_runs: int
    digits_repeats: int
    digits_blocks: int
    digits_timing_seconds: float
    steps: int  # the transformers'
    churn: float
    curve_sizes: tuple  # candidates; those that fit the curve's share of the box are measured
    curve_share: float
    calibration_images: int
    budget_max: int
    race: int
    runs: int  # timed runs per transformer row
    throughput_batch: int
    natural_images: int  # the natural64 stage's trajectories per run
    natural_steps: int  # its euler_ancestral Karras steps
    natural_depth: int  # its RMC chain's depth
    natural_width: int  # the scaled network's channels, a multiple of the shipped ones
    sdxl: gpu_schedulers.SDXLPlan  # the scheduler stages'
    shares: dict = field(default_factory=dict)

    @classmethod
    def full(cls) -> "Plan":
        return cls(
            dry=False,
            device="cuda",
            law_images=8192,
            law_steps=100,
            law_churn=0.3,
            sync_images=64,
            sync_steps=100,
            digits_steps=None,
            digits_latency_runs=10,
            digits_repeats=3,
            digits_blocks=2,
            digits_timing_seconds=1.0,
            steps=28,
            churn=0.8,
            curve_sizes=(1, 2, 4, 8, 16, 32),
            curve_share=0.2,
            calibration_images=1,
            budget_max=8,
            race=1,
            runs=2,
            throughput_batch=64,
            natural_images=8,
            natural_steps=50,
            natural_depth=8,
            natural_width=4,
            sdxl=gpu_schedulers.SDXLPlan.full(),
            shares=SHARES,
        )

    @classmethod
    def dry_run(cls) -> "Plan":
        return cls(
            dry=True,
            device="cpu",
            law_images=128,
            law_steps=12,
            law_churn=0.6,
            sync_images=4,
            sync_steps=12,
            digits_steps=8,
            digits_latency_runs=2,
            digits_repeats=1,
            digits_blocks=1,
            digits_timing_seconds=0.0,
            steps=4,
            churn=0.8,
            curve_sizes=(1, 2, 4),
            curve_share=0.5,
            calibration_images=2,
            budget_max=4,
            race=1,
            runs=1,
            throughput_batch=4,
            natural_images=1,
            natural_steps=4,
            natural_depth=2,
            natural_width=2,
            sdxl=gpu_schedulers.SDXLPlan.dry_run(),
            shares=SHARES,
        )


SHARES = {
    "digits-law": 20,
    "digits-syncs": 15,
    "digits-latency": 70,
    "natural64": 60,
    "sd3-512": 30,
    "sd3-1024": 40,
    "flux-512": 45,
    "flux-1024": 60,
    "sdxl-euler-ancestral-1024": 40,
    "sdxl-dpmpp-2m-sde-1024": 40,
    "digits-throughput": 20,
}
"""Each stage's share of the budget (seconds of a 450-second run; what a stage leaves passes on to
the stages after it in proportion to their shares, so the last, throughput, gets what is left)."""
GPU_HEADING = "## GPU: digits, diffusers-sized transformers and an SDXL-sized UNet on CUDA"
REPORT_SECONDS = 10.0
"""Kept back from the stages for writing the report."""


# -- time boxes --------------------------------------------------------------------------------


class TimeBoxExpired(BaseException):
    """A stage's time box ran out (raised by the interval timer between Python bytecodes).

    A ``BaseException``, as ``KeyboardInterrupt`` is: an ``except Exception`` on the way does not
    swallow it."""


@dataclass
class Stage:
    """One stage's record: its box (its share until :func:`run_stages` sets the box in seconds),
    time used, status and what it measured."""

    name: str
    box: float = 0.0
    used: float = 0.0
    status: str = "not reached"
    notes: list = field(default_factory=list)
    result: dict = field(default_factory=dict)
    _deadline: float = 0.0

    def left(self) -> float:
        """Seconds left in the box."""
        return self._deadline - time.monotonic()


def _expired(signum, frame):
    raise TimeBoxExpired()


@contextlib.contextmanager
def time_box(seconds: float):
    """Raise :class:`TimeBoxExpired` in the main thread after ``seconds`` (a CUDA call in progress
    finishes first: the interval timer's handler runs when control returns to Python)."""
    if seconds <= 0:
        raise TimeBoxExpired()
    old = signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, old)


def run_stages(stages: list, fns: dict, deadline: float) -> None:
    """Run each stage in its box: its share of the time left (less :data:`REPORT_SECONDS`), in
    proportion to the shares of the stages still to run."""
    for i, st in enumerate(stages):
        left = deadline - REPORT_SECONDS - time.monotonic()
        rest = sum(s.box for s in stages[i:])  # the shares, set by main
        st.box = max(0.0, left * st.box / rest) if rest > 0 else 0.0
        t0 = time.monotonic()
        st._deadline = t0 + st.box
        if st.box < 1.0:
            st.status = f"skipped: its share of the {max(left, 0.0):.0f} s left was under a second"
            continue
        print(f"[gpu] {st.name}: box {st.box:.0f} s", flush=True)
        try:
            with time_box(st.box):
                fns[st.name](st)
            st.status = "done" if not st.notes else "done (" + "; ".join(st.notes) + ")"
        except TimeBoxExpired:
            st.status = "stopped at its time box" + (" (" + "; ".join(st.notes) + ")" if st.notes else "")
        except Exception as err:  # a stage's failure is recorded; the others still run
            traceback.print_exc()
            st.status = f"failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        st.used = time.monotonic() - t0
        print(f"[gpu] {st.name}: {st.status} in {st.used:.1f} s", flush=True)


# -- digits: law smoke test --------------------------------------------------------------------


def _accept_every_draft():
    """A WRONG coupling: accepts the first child always (the draft chain, uncorrected)."""
    import torch

    from specforest.couplings import Coupling

    class AcceptEveryDraft(Coupling):
        name = "accept-all"

        def select(self, s_hat, delta, valid, rng):
            P = s_hat.shape[0]
            return (
                torch.ones(P, dtype=torch.bool, device=s_hat.device),
                torch.zeros(P, dtype=torch.long, device=s_hat.device),
            )

    return AcceptEveryDraft()


LAW_STATISTICS = ("cos(0,0)", "cos(0,1)", "cos(1,0)", "cos(1,1)", "mean square", "total variation")
LAW_ALPHA = 1e-3


def law_statistics(samples):
    """``(n, 6)`` float64 per-image statistics of ``(n, 1, 8, 8)`` samples: projections on the four
    lowest 2-D cosine modes (fixed directions, not fitted to any sample), the mean square and the
    total variation (roughness: sensitive to a wrong noise level)."""
    import torch

    s = samples.double()[:, 0]
    n = s.shape[-1]
    i = torch.arange(n, dtype=torch.float64, device=s.device)
    c = [torch.cos(math.pi * (i + 0.5) * k / n) for k in (0, 1)]
    c = [v / torch.linalg.vector_norm(v) for v in c]
    proj = [(s * torch.outer(c[a], c[b])).sum((1, 2)) for a, b in ((0, 0), (0, 1), (1, 0), (1, 1))]
    sq = s.square().mean((1, 2))
    tv = (s[:, 1:] - s[:, :-1]).abs().mean((1, 2)) + (s[:, :, 1:] - s[:, :, :-1]).abs().mean((1, 2))
    return torch.stack(proj + [sq, tv], 1).cpu()


def two_sample_z(a, b):
    """``(k,)`` z-scores of the difference of means of each column of ``a`` and ``b`` (their standard errors)."""
    se = (a.var(0) / len(a) + b.var(0) / len(b)).sqrt()
    return (a.mean(0) - b.mean(0)) / se


def stage_law(plan: Plan, st: Stage) -> None:
    import torch

    import specforest
    from specforest import streams, trees
    from specforest.models.digits import load_velocity

    model = load_velocity(device=plan.device)
    n = plan.law_images
    idx = torch.arange(n)
    labels = (idx % 10).to(plan.device)  # the same classes in every run
    k = len(LAW_STATISTICS)
    z_crit = float(torch.special.ndtri(torch.tensor(1.0 - LAW_ALPHA / (2 * k), dtype=torch.float64)))
    st.result.update(images=n, steps=plan.law_steps, churn=plan.law_churn, z_crit=z_crit, rows=[])
    cases = [
        ("standard (reference)", None, "grs", False),
        ("D-GRS (2,3)", trees.uniform(2, 3), "grs", False),
        ("RMC chain B=14", trees.chain(14), "rmc", False),
        ("WRONG: chain B=14 accepting every draft", trees.chain(14), _accept_every_draft(), True),
    ]
    reference = None
    for i, (label, tree, coupling, wrong) in enumerate(cases):
        # each run its own initial states and noise: the samples of two runs are independent
        x = streams.randn(20 + i, idx, (1, 8, 8), device=plan.device)
        t0 = time.perf_counter()
        res = specforest.sample(
            model,
            x,
            steps=plan.law_steps,
            churn=plan.law_churn,
            tree=tree,
            coupling=coupling,
            cond={"class_labels": labels},
            seed=100 + i,
        )
        seconds = time.perf_counter() - t0
        stats = law_statistics(res.samples)
        row = dict(label=label, nfe=float(res.stats.nfe.double().mean()), seconds=seconds, wrong=wrong)
        if reference is None:
            reference = stats
        else:
            z = two_sample_z(stats, reference).abs()
            j = int(z.argmax())
            rejected = bool(z[j] > z_crit)
            row.update(max_z=float(z[j]), statistic=LAW_STATISTICS[j], rejected=rejected)
            row["result"] = (
                ("rejected, as it must be" if rejected else "NOT rejected: the test lacks power")
                if wrong
                else ("pass" if not rejected else "FAIL")
            )
        st.result["rows"].append(row)
    rows = [r for r in st.result["rows"] if "rejected" in r]
    st.result["passed"] = all(r["rejected"] == r["wrong"] for r in rows)
    st.notes.append("law smoke test " + ("passed" if st.result["passed"] else "FAILED"))


# -- digits: synchronizations per round ----------------------------------------------------------


def stage_syncs(plan: Plan, st: Stage) -> None:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import specforest
    from specforest import engine, streams, trees
    from specforest.models.digits import load_velocity

    class HostReads(TorchDispatchMode):
        """Host reads of tensor values, as tests/test_syncs.py counts them."""

        def __init__(self):
            super().__init__()
            self.count = Counter()
            self.into = "engine"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("_local_scalar_dense", "item", "is_nonzero", "nonzero"):
                self.count[self.into] += 1
            return func(*args, **(kwargs or {}))

    cuda = plan.device.startswith("cuda")
    model = load_velocity(device=plan.device)
    n = plan.sync_images
    idx = torch.arange(n)
    x = streams.randn(11, idx, (1, 8, 8), device=plan.device)
    cond = {"class_labels": (idx % 10).to(plan.device)}
    cases = [
        ("standard", None, "grs", 0),
        ("D-GRS (2,3)", trees.uniform(2, 3), "grs", 2),
        ("RMC chain B=14", trees.chain(14), "rmc", 2),
        ("rank (2,3)", trees.uniform(2, 3), "rank", 3 + 2),
        ("antithetic (2,3)", trees.uniform(2, 3), "antithetic", 3 + 2),
    ]
    st.result.update(images=n, steps=plan.sync_steps, cuda=cuda, rows=[])
    if cuda:
        # the count must be able to see a synchronization: one planted read
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                torch.ones(1, device=plan.device).item()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        if not any("synchroniz" in str(w.message) for w in caught):
            raise RuntimeError("set_sync_debug_mode('warn') raised no Python warning for a planted .item()")
    real_round, real_read = engine.run_round, engine.host_read
    for label, tree, coupling, budget in cases:
        # one untimed run first: first calls build tables (rule tables, quadrature nodes) once
        specforest.sample(model, x, steps=6, churn=0.3, tree=tree, coupling=coupling, cond=cond, seed=1)
        counts = Counter()
        spy = HostReads()

        def counted_model(x, sigma, counts=counts, spy=spy, **kw):
            # the model's own reads (the digits adapter checks its noise levels) are counted apart
            counts["calls"] += 1
            spy.into = "model"
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    return model(x, sigma, **kw)
                finally:
                    spy.into = "engine"
                    counts["model warned"] += sum("synchroniz" in str(w.message) for w in caught)

        def counted_round(ctx, state, counts=counts, spy=spy):
            counts["rounds"] += 1
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    with spy:
                        return real_round(ctx, state)
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode(0)
                    counts["warned"] += sum("synchroniz" in str(w.message) for w in caught)

        def counted_read(t, counts=counts):
            counts["reads"] += 1
            return real_read(t)

        engine.run_round, engine.host_read = counted_round, counted_read
        try:
            specforest.sample(
                counted_model, x, steps=plan.sync_steps, churn=0.3, tree=tree, coupling=coupling, cond=cond, seed=2
            )
        finally:
            engine.run_round, engine.host_read = real_round, real_read
        r, c = max(counts["rounds"], 1), max(counts["calls"], 1)
        st.result["rows"].append(
            dict(
                label=label,
                rounds=counts["rounds"],
                warned=counts["warned"] / r if cuda else None,
                counted=(spy.count["engine"] + counts["reads"]) / r,
                model_warned=counts["model warned"] / c if cuda else None,
                model_counted=spy.count["model"] / c,
                budget=budget,
            )
        )


# -- digits: wallclock.py's protocol ---------------------------------------------------------------


def stage_digits(plan: Plan, st: Stage, batch: int) -> None:
    res = wallclock.run_model(
        "digits",
        plan.device,
        plan.digits_repeats,
        plan.digits_latency_runs,
        plan.digits_blocks,
        batches=(batch,),
        steps=plan.digits_steps,
        timing_seconds=plan.digits_timing_seconds,
    )
    st.result.update(curve=res["curve"], rows=res["rows"], steps=plan.digits_steps or 100)


# -- natural64: a trained network at d = 12,288 ---------------------------------------------------


def natural_networks(plan: Plan) -> list:
    """``[(label, denoiser)]``: the shipped natural64 network, and one of ``plan.natural_width`` times its
    channels with random weights (seed 0): no trained network of that width ships, so its acceptance is
    a random network's; its cost per call is the wider network's."""
    import dataclasses

    import torch

    from specforest.models.natural import load_denoiser
    from specforest.models.unet import EDMPrecond, UNet

    den = load_denoiser("natural64", device=plan.device)
    cfg = den.net.config
    wide = dataclasses.replace(cfg, channels=tuple(plan.natural_width * c for c in cfg.channels))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = UNet(wide)
    scaled = EDMPrecond(net, sigma_data=cfg.sigma_data).to(plan.device).eval().requires_grad_(False)
    return [
        (f"natural64 (trained, channels {cfg.channels})", den),
        (f"natural64 width x{plan.natural_width} (RANDOM weights, channels {wide.channels})", scaled),
    ]


def stage_natural(plan: Plan, st: Stage) -> None:
    """Acceptance and T/NFE of a trained network at d = 12,288 (``natural64``) and of a wider one:
    ``euler_ancestral`` on Karras steps, the standard sampler against an RMC chain with the frozen
    ``velocity`` draft, the ``cached`` draft (the target's outer blocks on its deep features) and the
    oracle (the target itself as the draft: acceptance 1, the chain's ceiling), and the network's
    time per call at 1 and 16 rows."""
    import torch

    from specforest import trees
    from specforest.chains import EulerAncestral
    from specforest.kdiffusion import get_sigmas_karras
    from specforest.kdiffusion import sample as kd_sample

    n, L = plan.natural_images, plan.natural_depth
    sigmas = get_sigmas_karras(plan.natural_steps, 0.002, 80.0)
    st.result.update(images=n, steps=plan.natural_steps, depth=L, rows=[])
    for label, den in natural_networks(plan):
        per_call = {}
        for rows in (1, 16):
            x = torch.randn(rows, 3, 64, 64, device=plan.device)
            s = torch.ones(rows, device=plan.device)
            den(x, s)  # warm
            _sync(plan.device)
            t0 = time.perf_counter()
            for _ in range(3):
                den(x, s)
            _sync(plan.device)
            per_call[rows] = (time.perf_counter() - t0) / 3
        g = torch.Generator().manual_seed(1)
        x = (torch.randn(n, 3, 64, 64, generator=g) * float(sigmas[0])).to(plan.device)
        for draft in (None, "velocity", "cached", "oracle"):
            opts: dict = dict(chain=EulerAncestral(eta=1.0), seed=0)
            if draft is not None:
                opts.update(tree=trees.chain(L), coupling="rmc", draft=den if draft == "oracle" else draft)
            _sync(plan.device)
            t0 = time.perf_counter()
            res = kd_sample(den, x, sigmas, disable=True, **opts)
            _sync(plan.device)
            seconds = time.perf_counter() - t0
            acc = [float(a) for a in res.stats.accept_rate_per_depth] if draft is not None else []
            st.result["rows"].append(
                dict(
                    network=label,
                    draft=draft or "standard",
                    t_per_nfe=float(res.stats.speedup.mean()),
                    acceptance=acc,
                    delta=[float(v) for v in res.stats.delta_per_depth] if draft is not None else [],
                    seconds=seconds,
                    call_1_ms=1e3 * per_call[1],
                    call_16_ms=1e3 * per_call[16],
                )
            )
        del den
        gc.collect()


# -- transformers ----------------------------------------------------------------------------------


_MODELS: dict = {}  # family -> (model, build seconds): one random transformer serves both sizes


def build_transformer(spec: TransformerSpec, device: str):
    """The family's transformer with random weights (seed 0) in bf16 on ``device``, built there."""
    import torch

    if spec.family in _MODELS:
        return _MODELS[spec.family]
    _MODELS.clear()  # the other family's model leaves the GPU first
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    import diffusers

    # (its warning that casting with to() keeps no module in float32: there is none to keep)
    diffusers.utils.logging.set_verbosity_error()
    cls = diffusers.SD3Transformer2DModel if spec.family == "sd3" else diffusers.FluxTransformer2DModel
    t0 = time.perf_counter()
    devices = [torch.device(device).index or 0] if device.startswith("cuda") else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        # initialised on the device itself: 1.2e10 parameters initialised on the host would take minutes
        with torch.device(device):
            model = cls(**spec.config)
    model = model.to(device=device, dtype=torch.bfloat16).eval().requires_grad_(False)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    _MODELS[spec.family] = (model, time.perf_counter() - t0)
    return _MODELS[spec.family]


def _target(spec: TransformerSpec, model, device: str, n: int) -> tuple:
    """``(velocity, x (n, C, h, w), cond, sigmas_for)``: the adapter, initial noise, random text
    embeddings of the real shapes (both CFG branches for SD3) and the pipeline's grid."""
    import torch

    from specforest import streams
    from specforest.diffusers import FlowMatchVelocity, FluxVelocity, scheduler_sigmas
    from specforest.diffusers.pipeline_flux import flux_sigmas

    cfg = spec.config
    g = torch.Generator().manual_seed(1)

    def emb(*shape):
        return torch.randn(*shape, generator=g).to(device, torch.bfloat16)

    cond = {
        "encoder_hidden_states": emb(n, spec.text_tokens, cfg["joint_attention_dim"]),
        "pooled_projections": emb(n, cfg["pooled_projection_dim"]),
    }
    if spec.family == "sd3":
        velocity = FlowMatchVelocity(model, guidance_scale=spec.guidance)
        cond["negative_encoder_hidden_states"] = emb(n, spec.text_tokens, cfg["joint_attention_dim"])
        cond["negative_pooled_projections"] = emb(n, cfg["pooled_projection_dim"])

        def sigmas_for(steps: int):
            return scheduler_sigmas(SD3_SCHEDULER, steps)
    else:
        velocity = FluxVelocity(model, guidance_scale=spec.guidance)
        tokens = spec.image_tokens

        def sigmas_for(steps: int):
            return flux_sigmas(FLUX_SCHEDULER, steps, tokens)

    x = streams.randn(0, torch.arange(n), spec.latent, device=device)
    return velocity, x, cond, sigmas_for


def _rows(cond: dict, n: int) -> dict:
    return {k: v[:n] for k, v in cond.items()}


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def stage_transformer(plan: Plan, spec: TransformerSpec, st: Stage) -> None:
    import torch

    import specforest
    from specforest import trees
    from specforest.latency import CURVE_PASSES, Calibrator, measure_cost_curve, tune

    dev = plan.device
    model, build_seconds = build_transformer(spec, dev)
    n = max(1, plan.calibration_images)
    velocity, x, cond, sigmas_for = _target(spec, model, dev, n)
    params = sum(p.numel() for p in model.parameters())
    st.result.update(
        label=spec.label,
        params=params,
        image_tokens=spec.image_tokens,
        text_tokens=spec.text_tokens,
        branches=velocity.branches,
        build_seconds=build_seconds,
        steps=plan.steps,
        churn=plan.churn,
    )
    # one call to warm up, one timed: the curve's sizes are chosen from it to fit the box
    with torch.no_grad():
        s = torch.full((1,), 0.5, device=dev)
        velocity(x[:1], s, **_rows(cond, 1))
        _sync(dev)
        t0 = time.perf_counter()
        velocity(x[:1], s, **_rows(cond, 1))
        _sync(dev)
        t1 = time.perf_counter() - t0
    st.result["probe_seconds"] = t1
    calls_per_size = 2 * CURVE_PASSES  # measure_cost_curve with repeats=CURVE_PASSES: one untimed, one timed a pass
    sizes, spent = [], 0.0
    for b in plan.curve_sizes:
        cost = calls_per_size * b * t1  # linear in the rows: an upper bound on a GPU
        if sizes and spent + cost > plan.curve_share * st.left():
            st.notes.append(f"curve measured up to {sizes[-1]} rows (the next size would not fit the box)")
            break
        sizes.append(b)
        spent += cost
    curve = measure_cost_curve(velocity, x[:1], cond=_rows(cond, 1), sizes=sizes, repeats=CURVE_PASSES)
    st.result["curve"] = curve
    t0 = time.perf_counter()
    opts = dict(steps=plan.steps, churn=plan.churn)
    pred = Calibrator.calibrate(
        velocity,
        x,
        cond=cond,
        batch=1,
        drafts=("x0",),
        budget_max=plan.budget_max,
        curve=curve,
        calibration_trajectories=n,
        seed=0,
        sigmas_for=sigmas_for,
        **opts,
    )
    # the curve was measured just now on this very model, as calibrate would have measured it (with
    # fewer calls): the network factor and the tuner's race apply
    pred.measured_curve = True
    tuned = tune(velocity, x, predictor=pred, budget_max=plan.budget_max, race=plan.race, race_repeats=1, **opts)
    st.result.update(tuned=tuned, tune_seconds=time.perf_counter() - t0)
    configs = [
        ("standard", (None, "grs", "internal", "x0")),
        ("RMC chain B=4, draft x0", (trees.chain(4), "rmc", "internal", "x0")),
        (f"tuned: {tuned.label}", (tuned.tree, tuned.coupling, tuned.verify, tuned.draft)),
    ]
    # a prediction costs a timing run where the tuner pruned the configuration (the reference chain,
    # say): made only where it fits the box, at about a 22-step run (the warm-up, and a 16-step run)
    timing_steps = 6 + min(plan.steps, 16)
    timed = {c["label"] for c in tuned.candidates if c["timed"]}  # the reference's label is the tuner's
    for label, c in list(configs):
        if label != "standard" and not label.startswith("tuned") and label not in timed:
            cost = pred.network_seconds(*c) * (timing_steps / plan.steps + plan.runs)
            if cost > 0.6 * st.left():
                configs.remove((label, c))
                st.notes.append(f"{label} not run (about {cost:.0f} s, {st.left():.0f} s left)")
    keyed = {label: (None if c[0] is None else tuple(c[0].parent.tolist()), *c[1:]) for label, c in configs}
    first = {}  # one timed configuration per key: the tuned row reuses the runs of its twin
    for label, key in keyed.items():
        first.setdefault(key, label)
    predicted = {label: pred.predict(*c) for label, c in configs if first[keyed[label]] == label}
    runs: dict = {label: [] for label in predicted}
    sigmas = sigmas_for(plan.steps)
    one_of_each = sum(p[0] for p in predicted.values())
    for r in range(plan.runs):
        if r and 1.3 * one_of_each > st.left():
            st.notes.append(f"{r} timed runs per row, not {plan.runs} (the box)")
            break
        for label, (tree, coupling, verify, draft) in configs:
            if label not in runs:
                continue
            t0 = time.perf_counter()
            res = specforest.sample(
                velocity,
                x[:1],
                sigmas=sigmas,
                churn=plan.churn,
                tree=tree,
                coupling=coupling,
                verify=verify,
                draft=draft,
                cond=_rows(cond, 1),
                seed=200 + r,
            )
            _sync(dev)
            s_ = res.stats
            runs[label].append((time.perf_counter() - t0, s_.calls, float(s_.rows.double().mean()), s_.sampler_seconds))
    base = statistics.fmean(w for w, *_ in runs["standard"])
    rows = []
    for label, _ in configs:
        twin = first[keyed[label]]
        walls, calls, rws, sampler = zip(*runs[twin], strict=True)
        wall = statistics.fmean(walls)
        p_sec, p_calls, _ = predicted[twin]
        rows.append(
            dict(
                label=label if twin == label else f"{label} (the runs of {twin})",
                calls=statistics.fmean(calls),
                pred_calls=p_calls,
                rows=statistics.fmean(rws),
                sampler_ms=1e3 * sum(sampler) / sum(calls),
                wall_ms=1e3 * wall,
                wall_se_ms=1e3 * statistics.stdev(walls) / len(walls) ** 0.5 if len(walls) > 1 else None,
                pred_ms=1e3 * p_sec,
                speedup=base / wall,
            )
        )
    st.result["latency"] = dict(
        rows=rows,
        tuned=tuned,
        tune_seconds=st.result["tune_seconds"],
        factor=pred.network_factor(),
        runs=len(runs["standard"]),
        blocks=1,
    )


def stage_scheduler(plan: Plan, case: gpu_schedulers.SchedulerCase, st: Stage) -> None:
    """A scheduler stage (:func:`gpu_schedulers.stage_scheduler`), the transformers freed first."""
    _MODELS.clear()  # the transformer leaves the GPU before the SDXL UNet is built beside it
    gpu_schedulers.stage_scheduler(plan.sdxl, case, st)


# -- the report ------------------------------------------------------------------------------------


def _machine() -> str:
    import torch

    from specforest.experiments.results import machine_line

    line = machine_line()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        line += f", CUDA {torch.version.cuda}, {props.total_memory / 2**30:.0f} GiB on the GPU"
    try:
        import diffusers

        line += f", diffusers {diffusers.__version__}"
    except ImportError:
        line += ", no diffusers"
    return line


def _curve_rows(curves: list) -> list:
    """A table of ``(name, CostCurve)``: time(1) and time(b) / time(1) at the sizes any of them measured."""
    sizes = sorted({b for _, c in curves for b in c.sizes})[:10]
    lines = [
        "| target | time(1) | " + " | ".join(f"b={b}" for b in sizes) + " |",
        "| --- | --- | " + " | ".join("---" for _ in sizes) + " |",
    ]
    for name, c in curves:
        rel = dict(zip(c.sizes, c.relative(), strict=True))
        cells = " | ".join(f"{rel[b]:.2f}" if b in rel else "-" for b in sizes)
        lines.append(f"| {name} | {1e3 * c.seconds[0]:.3f} ms | {cells} |")
    return lines


def report(plan: Plan, stages: dict, budget: float, total: float, command: str) -> tuple:
    """``(gpu section body, wallclock GPU rows body)`` from the stages' records."""
    machine = _machine()
    dry = " (DRY RUN on the CPU: tiny sizes, the numbers mean nothing)" if plan.dry else ""
    gpu = [
        f"`{command}` on {machine}{dry}; budget {budget:.0f} s, whole run {total:.0f} s.",
        "",
        "| stage | time box | used | status |",
        "| --- | --- | --- | --- |",
    ]
    for st in stages.values():
        gpu.append(f"| {st.name} | {st.box:.0f} s | {st.used:.1f} s | {st.status} |")

    law = stages["digits-law"].result
    if law.get("rows"):
        n = law["images"]
        gpu += [
            "",
            f"**Digits law smoke test** (shipped digits model, {n} images per sampler, T = {law['steps']}, "
            f"churn {law['churn']}, full mode; each run its own initial states and noise). Six statistics per "
            "image (projections on the four lowest 2-D cosine modes, mean square, total variation); z = difference "
            "of the means over the standard error of that difference, against the standard sampler's run; "
            f"threshold |z| > {law['z_crit']:.2f} (two-sided, level {LAW_ALPHA:g} with a Bonferroni correction "
            f"over the six), so a shift of {law['z_crit'] * math.sqrt(2.0 / n):.3f} standard deviations of a "
            f"statistic is detected half the time. Result: **{'pass' if law.get('passed') else 'FAIL'}**"
            + ("" if "passed" in law else " (not finished)")
            + ".",
            "",
            "| sampler | NFE per image | seconds | max abs z (statistic) | result |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r in law["rows"]:
            z = f"{r['max_z']:.2f} ({r['statistic']})" if "max_z" in r else "-"
            gpu.append(f"| {r['label']} | {r['nfe']:.1f} | {r['seconds']:.2f} | {z} | {r.get('result', 'reference')} |")

    syncs = stages["digits-syncs"].result
    if syncs.get("rows"):
        gpu += [
            "",
            f"**Host-device synchronizations per round** (digits, {syncs['images']} images, T = {syncs['steps']}, "
            'full mode): warnings of `torch.cuda.set_sync_debug_mode("warn")` inside rounds, and host reads '
            "counted as `tests/test_syncs.py` counts them (a dispatch counter and the engine's `host_read`); "
            "the model's own (the digits adapter checks that its noise levels lie in [0, 1]) apart, per call. "
            "The engine's budget: none for the standard sampler, 2 for D-GRS and RMC, L + 2 for the list couplings."
            + ("" if syncs["cuda"] else " On the CPU the GRS residual also reads which branches it needs."),
            "",
            "| sampler | rounds | engine: syncs per round (set_sync_debug_mode) | engine: host reads per round "
            "(counted) | budget | model: syncs per call (set_sync_debug_mode) | model: host reads per call (counted) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in syncs["rows"]:
            na = "n/a (CPU)"
            warned = na if r["warned"] is None else f"{r['warned']:.2f}"
            model_warned = na if r["model_warned"] is None else f"{r['model_warned']:.2f}"
            gpu.append(
                f"| {r['label']} | {r['rounds']} | {warned} | {r['counted']:.2f} | {r['budget']} | {model_warned} | "
                f"{r['model_counted']:.2f} |"
            )

    nat = stages["natural64"].result
    if nat.get("rows"):
        gpu += [
            "",
            f"**A trained network at d = 12,288** (`natural64`, and a network of its architecture at a "
            f"larger width with RANDOM weights: its cost per call is real, its acceptance is not a trained "
            f"network's): euler_ancestral, {nat['steps']} Karras steps, {nat['images']} images per run, RMC chain "
            f"of depth {nat['depth']}; the oracle is the target itself as the draft (the chain's ceiling).",
            "",
            "| network | draft | T/NFE | acceptance per depth 1 / 2 / 3 | delta per depth 1 / 2 / 3 | seconds | "
            "call of 1 row | call of 16 rows |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in nat["rows"]:
            acc = " / ".join(f"{a:.2f}" for a in r["acceptance"][:3]) or "-"
            dl = " / ".join(f"{v:.3g}" for v in r["delta"][:3]) or "-"
            gpu.append(
                f"| {r['network']} | {r['draft']} | {r['t_per_nfe']:.2f} | {acc} | {dl} | {r['seconds']:.2f} | "
                f"{r['call_1_ms']:.1f} ms | {r['call_16_ms']:.1f} ms |"
            )

    tf = [s.result for k, s in stages.items() if k.startswith(("sd3", "flux")) and s.result.get("label")]
    if tf:
        gpu += [
            "",
            f"**Transformers** (random weights, seed 0, bf16; random text embeddings of the real shapes; "
            f"T = {plan.steps}, churn {plan.churn}, one image per run, draft x0 for every tree, the tuner's "
            f"candidates up to budget {plan.budget_max}). With random "
            "weights the acceptance is not a trained model's: what carries over is the cost curve and the "
            "sampler's own time per round; the tuned choice shows what the tuner does with them.",
            "",
            "| target | parameters | tokens per branch (image + text) | transformer rows per state | built in | "
            "time(1) | largest size: time(b) / time(1) | sampler per round: standard / RMC chain B=4 / tuned | "
            "tuned | predicted speedup | measured speedup |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in tf:
            c = r.get("curve")
            lat = r.get("latency")
            tuned = r.get("tuned")
            big = f"b={c.sizes[-1]}: {c.relative()[-1]:.2f}" if c else "-"
            t1 = f"{1e3 * c.seconds[0]:.1f} ms" if c else f"{1e3 * r.get('probe_seconds', float('nan')):.1f} ms"
            per_round = "-"
            if lat:
                by = {row["label"].split(",")[0].split(":")[0]: row["sampler_ms"] for row in lat["rows"]}
                per_round = " / ".join(
                    f"{by[k]:.2f}" if k in by else "-" for k in ("standard", "RMC chain B=4", "tuned")
                )
                per_round += " ms"
            label = tuned.label if tuned else "-"
            pred_s = f"{tuned.predicted_speedup:.2f}x" if tuned else "-"
            meas = f"{lat['rows'][-1]['speedup']:.2f}x" if lat else "-"
            gpu.append(
                f"| {r['label']} | {r['params']:.3g} | {r['image_tokens']} + {r['text_tokens']} | "
                f"{r['branches']} | {r['build_seconds']:.1f} s | {t1} | {big} | {per_round} | {label} | {pred_s} | "
                f"{meas} |"
            )

    gpu += gpu_schedulers.report_lines(plan.sdxl, [stages[key] for key in gpu_schedulers.STAGES])

    # the wallclock section's GPU rows: curves, then wallclock.py's latency tables
    rows = [
        f"`{command}` on {machine}{dry}. The digits model through `benchmarks/wallclock.py`'s protocol "
        f"(`run_model`: {plan.digits_latency_runs} runs per row in {plan.digits_blocks} blocks, each row timed "
        f"{plan.digits_timing_seconds:g} s before each block); the transformers with random weights in bf16 "
        f"(SD3: classifier-free guidance 7, both branches in one call; Flux: embedded guidance 3.5), "
        f"T = {plan.steps}, churn {plan.churn}, one image per run, {plan.runs} timed runs per row after the "
        "tuner's timing runs. Sizes count states; an SD3 state is two transformer rows.",
    ]
    curves = []
    digits = stages["digits-latency"].result
    if digits.get("curve"):
        curves.append((f"digits U-Net, {plan.device}", digits["curve"]))
    for r in tf:
        if r.get("curve"):
            curves.append((r["label"], r["curve"]))
    if curves:
        rows += [
            "",
            f"Batch-cost curve of the target on {plan.device}, time(b) / time(1) (median of its calls per size):",
            "",
        ]
        rows += _curve_rows(curves)
    for key in ("digits-latency", "digits-throughput"):
        res = stages[key].result
        if res.get("rows"):
            steps = res["steps"]
            rows += wallclock._table(f"digits U-Net (T = {steps}, churn 0.3), {plan.device}", {"rows": res["rows"]})
    for r in tf:
        if r.get("latency"):
            name = f"{r['label']} (T = {plan.steps}, churn {plan.churn})"
            rows += wallclock._table(name, {"rows": {1: r["latency"]}})
    skipped = [f"{s.name} ({s.status})" for s in stages.values() if not s.status.startswith("done")]
    if skipped:
        rows += ["", "Not measured in this run: " + "; ".join(skipped) + "."]
    return "\n".join(gpu), "\n".join(rows)


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "to_json"):
        return obj.to_json()
    if hasattr(obj, "__dataclass_fields__"):
        return {k: _jsonable(v) for k, v in asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return repr(obj)


def _import_error(name: str) -> Optional[str]:
    """Why ``import name`` fails, or ``None`` where it does not."""
    try:
        importlib.import_module(name)
    except ImportError as err:
        return str(err)
    return None


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU; writes a temporary copy")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for all stages and the report (450)")
    ap.add_argument("--out", type=Path, default=None, help="results file to update (default benchmarks/RESULTS.md)")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw measurements here")
    ap.add_argument("--only", default=None, help="comma list of stages to run (default all): " + ",".join(SHARES))
    args = ap.parse_args(argv)
    if not (math.isfinite(args.budget) and args.budget > REPORT_SECONDS):
        ap.error(f"--budget must be more than {REPORT_SECONDS:g} seconds, got {args.budget}")
    only = None if args.only is None else [s.strip() for s in args.only.split(",") if s.strip()]
    if only is not None and (not only or any(s not in SHARES for s in only)):
        ap.error(f"--only must list stages of {', '.join(SHARES)}, got {args.only!r}")
    out = args.out
    if args.dry_run:
        if out is not None and out.resolve() == RESULTS.resolve():
            ap.error("--dry-run never writes benchmarks/RESULTS.md: give another --out, or none (a temporary copy)")
        if out is None:
            out = Path(tempfile.mkdtemp(prefix="specforest-gpu-dry-")) / "RESULTS.md"
            shutil.copy(RESULTS, out)
    elif out is None:
        out = RESULTS

    deadline = time.monotonic() + args.budget
    t_start = time.monotonic()
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device here: run it on a GPU machine, or check it with --dry-run on the CPU")
    from specforest.allocator import keep_freed_memory

    keep_freed_memory()
    plan = Plan.dry_run() if args.dry_run else Plan.full()
    if args.dry_run:
        torch.set_num_threads(1)  # a shared machine: one thread, as the CPU benchmarks do

    specs = {s.key: s for s in transformer_specs(args.dry_run)}
    # (transformers: the SDXL pipeline's text encoders and tokenizer)
    no_diffusers, no_transformers = _import_error("diffusers"), _import_error("transformers")
    fns: dict[str, Callable] = {
        "digits-law": lambda st: stage_law(plan, st),
        "digits-syncs": lambda st: stage_syncs(plan, st),
        "digits-latency": lambda st: stage_digits(plan, st, 1),
        "digits-throughput": lambda st: stage_digits(plan, st, plan.throughput_batch),
        "natural64": lambda st: stage_natural(plan, st),
    }
    for key, spec in specs.items():
        fns[key] = lambda st, spec=spec: stage_transformer(plan, spec, st)
    for case in gpu_schedulers.SCHEDULERS:
        fns[case.key] = lambda st, case=case: stage_scheduler(plan, case, st)
    stages = {name: Stage(name, box=float(share)) for name, share in plan.shares.items()}
    todo = []
    for name, st in stages.items():
        if only is not None and name not in only:
            st.status, st.box = "not asked for (--only)", 0.0
        elif (name in specs or name in gpu_schedulers.STAGES) and no_diffusers:
            st.status, st.box = f"skipped: diffusers not importable ({no_diffusers})", 0.0
        elif name in gpu_schedulers.STAGES and no_transformers:
            st.status, st.box = f"skipped: transformers not importable ({no_transformers})", 0.0
        else:
            todo.append(st)
    run_stages(todo, fns, deadline)
    _MODELS.clear()
    gpu_schedulers.release()

    command = "benchmarks/gpu.sh" + (" --dry-run" if args.dry_run else "")
    gpu_body, rows_body = report(plan, stages, args.budget, time.monotonic() - t_start, command)
    from specforest.experiments.results import replace_section

    replace_section(out, "gpu", GPU_HEADING, gpu_body)
    wallclock.write_gpu_rows(out, rows_body)
    if args.json is not None:
        from specforest.experiments.io import atomic_write_text

        raw = {name: {"status": s.status, "box": s.box, "used": s.used, **s.result} for name, s in stages.items()}
        atomic_write_text(args.json, json.dumps(_jsonable(raw), indent=1))
    print(gpu_body)
    print()
    print(rows_body)
    print(f"\n[gpu] wrote the gpu section and the wallclock GPU rows of {out}", flush=True)
    failed = [s.name for s in stages.values() if s.status.startswith("failed")]
    law = stages["digits-law"].result
    return 1 if failed or law.get("passed") is False else 0


if __name__ == "__main__":
    sys.exit(main())
