"""What speculation gives at real dimensions: trained networks against the closed-form mixture.

    .venv/bin/python benchmarks/real_dims.py [--quick] [--samples 4] [--budget-minutes 25]

For digits (d = 64), ``natural32`` (d = 3,072), ``natural64`` (d = 12,288) and the paper's Gaussian
mixture at the same three dimensions, and for the samplers people run (``euler_ancestral`` 30 and 50
Karras steps, ``ddpm`` 1000, ``dpmpp_2m_sde`` 25 and 50, ``ddim`` eta 1 at 100, ``euler`` with churn,
``lcm`` 8), through :func:`specforest.kdiffusion.sample` (the drop-ins' chains) or, for the mixture,
:func:`specforest.sample` on the same linear-path grid:

* the standard sampler's calls (``T``);
* the best exact configuration's T/NFE over a small search (RMC chains of depth 4 and 8; the frozen
  ``velocity`` and ``x0`` drafts and, for the networks, ``cached`` and ``corrected``);
* the **oracle** at that tree: the target itself as the draft (a callable draft that calls the
  target, so every drafted step has the target's law: acceptance 1, the ceiling of that tree);
* acceptance per depth, and the per-dimension error of the draft's mean against the step's noise
  scale, ``delta / sqrt(d)`` with ``delta = |mu_draft - mu_target| / s`` (the coupling's own
  statistic, :class:`specforest.results.SampleStats`'s ``delta_sum``);
* one image's wall time, ``natural32`` ``euler_ancestral`` 50, the best configuration against the
  standard sampler (warm, one thread, in turns, median).

Then deeper chains for the goals' samplers (the ``real_dims_deep`` section; ``--deep-only``), and
:func:`specforest.latency.tune`'s choice for that image, timed the same way (the
``real_dims_tune`` section; ``--tune-only`` regenerates that alone; ``--main-only`` the main grid alone).

Regenerates the ``real_dims`` section of ``benchmarks/RESULTS.md``. Cells are measured cheapest
first; a cell that would start after ``--budget-minutes`` is listed as not measured. One thread.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from specforest import sample as lib_sample
from specforest import trees
from specforest.chains import DDIM, DDPM, DPMPP2MSDE, LCM, EulerAncestral, EulerChurn
from specforest.drafts import drafts_serving
from specforest.experiments.results import machine_line, replace_section
from specforest.kdiffusion import get_sigmas_karras, has_features, linear_grid
from specforest.kdiffusion import sample as kd_sample
from specforest.schedules import ddpm_discrete_sigmas

SAMPLERS: dict[str, tuple[Callable[[], Any], Callable[[], torch.Tensor]]] = {
    "euler_ancestral 30": (lambda: EulerAncestral(eta=1.0), lambda: get_sigmas_karras(30, 0.002, 80.0)),
    "euler_ancestral 50": (lambda: EulerAncestral(eta=1.0), lambda: get_sigmas_karras(50, 0.002, 80.0)),
    "dpmpp_2m_sde 25": (lambda: DPMPP2MSDE(), lambda: get_sigmas_karras(25, 0.002, 80.0)),
    "dpmpp_2m_sde 50": (lambda: DPMPP2MSDE(), lambda: get_sigmas_karras(50, 0.002, 80.0)),
    "euler churn 50": (lambda: EulerChurn(s_churn=20.0), lambda: get_sigmas_karras(50, 0.002, 80.0)),
    "lcm 8": (lambda: LCM(), lambda: get_sigmas_karras(8, 0.002, 80.0)),
    "ddim eta=1 100": (lambda: DDIM(eta=1.0), lambda: ddpm_discrete_sigmas(100)),
    "ddpm 1000": (lambda: DDPM(), lambda: ddpm_discrete_sigmas(1000)),
}
"""name -> (chain factory, VE sigmas factory ending in 0)."""
DEPTHS = (4, 8)
DEEP = {"euler_ancestral 50": (16,), "ddpm 1000": (16, 32, 64, 128)}
"""The deep section's chains: depth 8 caps T/NFE near T / ceil(T / 8) (the oracle's 7.9 at T = 1000)."""
ORACLE = "oracle"


@dataclass
class Target:
    """A model under test: a k-diffusion denoiser (``kind="denoiser"``) or a linear-path velocity."""

    name: str
    d: int
    shape: tuple
    kind: str
    fn: Any
    extra_args: Optional[dict] = None
    row_args: tuple = ()


def targets(quick: bool) -> list[Target]:
    """Digits, the mixtures at the same dimensions, natural32, natural64 (cheapest first)."""
    from specforest.models import GaussianMixture
    from specforest.models.digits import load_denoiser as digits_denoiser
    from specforest.models.natural import load_denoiser

    out = [Target("digits", 64, (1, 8, 8), "denoiser", digits_denoiser(), {"class_labels": None}, ("class_labels",))]
    for d in (64, 3072, 12288):
        out.append(Target(f"mixture d={d}", d, (d,), "velocity", GaussianMixture.paper(dim=d, components=5)))
    for name, r in (("natural32", 32), ("natural64", 64)):
        out.append(Target(name, 3 * r * r, (3, r, r), "denoiser", load_denoiser(name)))
    return out


def run(target: Target, sampler: str, n: int, *, tree=None, draft: Any = "velocity", seed: int = 0):
    """One run of ``n`` trajectories; the :class:`~specforest.results.SampleResult`."""
    chain_f, sig_f = SAMPLERS[sampler]
    sigmas = sig_f()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, *target.shape, generator=g) * float(sigmas[0])
    opts: dict = dict(chain=chain_f(), seed=seed)
    if tree is not None:
        opts.update(tree=tree, coupling="rmc", draft=target.fn if draft == ORACLE else draft)
    if target.kind == "velocity":
        t = linear_grid(sigmas)
        return lib_sample(target.fn, x / (1.0 + float(sigmas[0])), sigmas=t, **opts)
    extra = None
    if target.extra_args is not None:
        extra = {"class_labels": torch.arange(n) % 10}
    return kd_sample(target.fn, x, sigmas, extra, row_args=target.row_args, disable=True, **opts)


FEATURE_DRAFTS = ["cached", "corrected"]
"""The drafts that reuse a network's deep features: searched for the networks that keep them."""


def network_drafts(target: Target) -> list[str]:
    """The drafts a network serves beyond the frozen ones: its feature drafts (:data:`FEATURE_DRAFTS`) where
    it keeps its deep features, ``learned`` where it declares a distilled draft network (``learned_draft``)."""
    if target.kind != "denoiser":
        return []
    out = list(FEATURE_DRAFTS) if has_features(target.fn) else []
    return out + (["learned"] if getattr(target.fn, "learned_draft", None) is not None else [])


def drafts_for(target: Target) -> list[str]:
    return ["velocity", "x0", *network_drafts(target)]


def summarize(res, d: int) -> dict:
    st = res.stats
    acc = [float(a) for a in st.accept_rate_per_depth]
    dl = [float(v) for v in st.delta_per_depth]
    return {
        "speedup": float(st.speedup.mean()),
        "acc": acc,
        "per_dim": [v / math.sqrt(d) for v in dl],
        "delta": dl,
        "draft_calls": int(st.draft_calls),
    }


def measure_cell(target: Target, sampler: str, n: int, depths: tuple = DEPTHS, drafts: Optional[list] = None) -> dict:
    """The search over (depth, draft), then the oracle at the best tree."""
    best = None
    tried = []
    for L in depths:
        for draft in drafts or drafts_for(target):
            s = summarize(run(target, sampler, n, tree=trees.chain(L), draft=draft), target.d)
            s.update(L=L, draft=draft)
            tried.append(s)
            if best is None or s["speedup"] > best["speedup"]:
                best = s
    oracle = summarize(run(target, sampler, n, tree=trees.chain(best["L"]), draft=ORACLE), target.d)
    return {"best": best, "oracle": oracle, "tried": tried}


def time_one_image(target: Target, sampler: str, L: int, draft: str, repeats: int) -> tuple[float, float]:
    """Median seconds of one image, standard and speculative, run in turns after a warm-up of each."""
    std, spec = [], []
    for i in range(repeats + 1):
        for tree, acc in ((None, std), (trees.chain(L), spec)):
            t0 = time.perf_counter()
            run(target, sampler, 1, tree=tree, draft=draft, seed=100 + i)
            if i > 0:  # the first turn warms both up
                acc.append(time.perf_counter() - t0)
    return statistics.median(std), statistics.median(spec)


def deep_section(tgts: list, n: int) -> list[str]:
    """The ``real_dims_deep`` section: deeper RMC chains for the goals' samplers (:data:`DEEP`), the
    networks' feature drafts (:data:`FEATURE_DRAFTS`, the best shown) and the mixture's x0, natural64 at
    one trajectory, and the oracle at the best depth."""
    t0 = time.perf_counter()
    lines = [
        f"Measured with `benchmarks/real_dims.py --deep-only --samples {n}` (also run by the full command) on "
        f"{machine_line()}, one thread.",
        "",
        "Depth 8 caps T/NFE near T / ceil(T / 8): the goals' long grids need deeper chains. RMC chains of the "
        f"depths shown; drafts: {', '.join(FEATURE_DRAFTS)} and learned (where the model declares its distilled "
        f"draft) for the networks (the best shown, the others' T/NFE beside it), x0 for the mixture; {n} trajectories per run (natural64: 1); the oracle at the best "
        "depth.",
        "",
        "| model | d | sampler | best T/NFE (depth, draft) | T/NFE per depth and draft tried | oracle T/NFE | "
        "best / oracle | acceptance at depth 1 / 2 / 4 / 8 / 16 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for sampler, depths in DEEP.items():
        for tgt in tgts:
            drafts = ["x0"] if tgt.kind == "velocity" else (network_drafts(tgt) or ["velocity"])
            cell = measure_cell(tgt, sampler, 1 if tgt.name == "natural64" else n, depths, drafts)
            b, o = cell["best"], cell["oracle"]
            tried = ", ".join(f"{s['L']} {s['draft']}: {s['speedup']:.2f}" for s in cell["tried"])
            acc = [b["acc"][i] for i in (0, 1, 3, 7, 15) if i < len(b["acc"])]
            lines.append(
                f"| {tgt.name} | {tgt.d} | {sampler} | {b['speedup']:.2f} ({b['L']}, {b['draft']}) | {tried} | "
                f"{o['speedup']:.2f} | {b['speedup'] / o['speedup']:.0%} | {fmt_list(acc, '.2f')} |"
            )
            print(f"[real_dims] deep {lines[-1]} ({(time.perf_counter() - t0) / 60:.1f} min)", flush=True)
    lines += ["", f"Total wall time {(time.perf_counter() - t0) / 60:.1f} min."]
    return lines


def tune_timing(repeats: int) -> list[str]:
    """The ``real_dims_tune`` section: :func:`specforest.latency.tune`'s choice for one image of
    ``natural32``, ``euler_ancestral`` 50 Karras steps (every draft it serves: velocity, x0, cached, corrected, learned; budgets up to 16),
    timed against the standard sampler (warm, one thread, in turns, median of ``repeats``)."""
    from specforest.latency import tune
    from specforest.models.natural import load_velocity

    model = load_velocity("natural32")
    sigmas = get_sigmas_karras(50, 0.002, 80.0)

    def sigmas_for(steps: int) -> torch.Tensor:
        return linear_grid(get_sigmas_karras(steps, 0.002, 80.0))

    def x_at(n: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, 3, 32, 32, generator=g) * float(sigmas[0]) / (1.0 + float(sigmas[0]))

    # every draft natural32 serves (tune --drafts all's search there)
    drafts = tuple(drafts_serving(["velocity", "x0", "cached", "corrected", "learned"], (3, 32, 32), model))
    t0 = time.perf_counter()
    tuned = tune(
        model,
        x_at(2, 7),
        steps=50,
        chain=EulerAncestral(eta=1.0),
        sigmas_for=sigmas_for,
        batch=1,
        budget_max=16,
        drafts=drafts,
        calibration_trajectories=2,
        race=2,
        race_repeats=2,
    )
    tune_s = time.perf_counter() - t0
    grid = sigmas_for(50)
    std, spec = [], []
    for i in range(repeats + 1):
        for opts, acc in (({}, std), (tuned.options(), spec)):
            t1 = time.perf_counter()
            out = lib_sample(model, x_at(1, 100 + i), sigmas=grid, chain=EulerAncestral(eta=1.0), seed=i, **opts)
            if i > 0:  # the first turn warms both up
                acc.append((time.perf_counter() - t1, float(out.stats.speedup.mean())))
    t_std = statistics.median(t for t, _ in std)
    t_spec = statistics.median(t for t, _ in spec)
    nfe = statistics.mean(v for _, v in spec)
    return [
        f"Measured with `benchmarks/real_dims.py --tune-only --repeats {repeats}` (also run by the full "
        f"command) on {machine_line()}, one thread.",
        "",
        "One image of natural32, euler_ancestral 50 Karras steps: `specforest.latency.tune` (drafts "
        f"{', '.join(drafts)}, budgets up to 16, 2 calibration trajectories, a race of 2) chose **{tuned.label}** "
        f"(draft {tuned.draft}; predicted {tuned.predicted_speedup:.2f}x; tuning took {tune_s:.0f} s). Warm, "
        f"one thread, run in turns with the standard sampler, median of {repeats}: standard {t_std:.2f} s, "
        f"tune's choice {t_spec:.2f} s (T/NFE {nfe:.2f}): **{t_std / t_spec:.2f}x**.",
    ]


def fmt_list(values: list, spec: str) -> str:
    return " / ".join("-" if math.isnan(v) else format(v, spec) for v in values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=None, help="trajectories per run (>= 1; default 4, --quick 2)")
    ap.add_argument("--quick", action="store_true", help="2 trajectories, natural64 ddpm 1000 left out")
    ap.add_argument("--budget-minutes", type=float, default=25.0, help="no cell starts after this (> 0)")
    ap.add_argument("--repeats", type=int, default=3, help="timed turns of the one-image wall time (>= 1)")
    ap.add_argument("--samplers", default=",".join(SAMPLERS), help="comma list among: " + ", ".join(SAMPLERS))
    ap.add_argument("--deep-only", action="store_true", help="only the deep-chains section")
    ap.add_argument("--tune-only", action="store_true", help="only the tune section (natural32, one image)")
    ap.add_argument("--main-only", action="store_true", help="only the main grid's section (real_dims)")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = ap.parse_args()
    n = args.samples if args.samples is not None else (2 if args.quick else 4)
    if n < 1:
        ap.error("--samples must be >= 1")
    if not args.budget_minutes > 0:
        ap.error("--budget-minutes must be > 0")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    samplers = [s.strip() for s in args.samplers.split(",") if s.strip()]
    bad = [s for s in samplers if s not in SAMPLERS]
    if bad or not samplers:
        ap.error(f"--samplers must name samplers among {', '.join(SAMPLERS)}, got {args.samplers!r}")
    torch.set_num_threads(1)
    tune_heading = "### Real dimensions: `tune`'s choice for one natural32 image"
    if args.tune_only:
        lines = tune_timing(args.repeats)
        replace_section(args.out, "real_dims_tune", tune_heading, "\n".join(lines))
        print("\n".join(lines))
        return
    deep_heading = "### Real dimensions: deeper chains for the goals' samplers"
    if args.deep_only:
        lines = deep_section(targets(args.quick), n)
        replace_section(args.out, "real_dims_deep", deep_heading, "\n".join(lines))
        print("\n".join(lines))
        return
    t_start = time.perf_counter()
    deadline = t_start + 60.0 * args.budget_minutes
    tgts = targets(args.quick)

    # the wall time first: the one-image goal's cell, whatever the budget leaves for the grid
    nat32 = next(t for t in tgts if t.name == "natural32")
    timing_cell = measure_cell(nat32, "euler_ancestral 50", n) if "euler_ancestral 50" in samplers else None
    timing = None
    if timing_cell is not None:
        b = timing_cell["best"]
        timing = (b["L"], b["draft"], *time_one_image(nat32, "euler_ancestral 50", b["L"], b["draft"], args.repeats))
        print(f"[real_dims] timing {timing}", flush=True)

    rows, skipped = [], []
    for sampler in samplers:  # every model's cheap samplers before any model's 1000 steps
        for tgt in tgts:
            if tgt.name == "natural32" and sampler == "euler_ancestral 50" and timing_cell is not None:
                cell = timing_cell
            elif args.quick and tgt.name == "natural64" and sampler == "ddpm 1000":
                skipped.append(f"{tgt.name} {sampler} (--quick)")
                continue
            elif time.perf_counter() > deadline:
                skipped.append(f"{tgt.name} {sampler} (budget)")
                continue
            else:
                cell = measure_cell(tgt, sampler, n)
            steps = len(SAMPLERS[sampler][1]()) - 1
            rows.append((tgt, sampler, steps, cell))
            b, o = cell["best"], cell["oracle"]
            print(
                f"[real_dims] {tgt.name} {sampler}: best {b['speedup']:.2f} (L={b['L']}, {b['draft']}), "
                f"oracle {o['speedup']:.2f}, acc {fmt_list(b['acc'], '.2f')}, "
                f"err/dim {fmt_list(b['per_dim'], '.3g')} ({(time.perf_counter() - t_start) / 60:.1f} min)",
                flush=True,
            )

    lines = [
        f"Measured with `benchmarks/real_dims.py{' --quick' if args.quick else ''}{' --main-only' if args.main_only else ''} --samples {n}` on "
        f"{machine_line()}, one thread.",
        "",
        "Trajectories per run: "
        f"{n}. Trees: RMC chains of depth {' and '.join(map(str, DEPTHS))}; drafts: velocity, x0 and (networks "
        f"with deep features) {' and '.join(FEATURE_DRAFTS)}, and learned where the model declares its distilled draft; the best by T/NFE is shown. Oracle: the target itself as the draft at the "
        "best tree's depth (a callable draft that calls the target; its own calls, not counted in NFE, are "
        "the price of a perfect draft): the ceiling of that tree. Acceptance and the per-dimension mean error "
        "`delta / sqrt(d)` (delta = |mu_draft - mu_target| / noise scale of the step) per depth 1 / 2 / 3 "
        "/ ..., of the best configuration. The standard sampler takes T calls (T/NFE = 1).",
        "",
        "| model | d | sampler | T | best T/NFE (depth, draft) | oracle T/NFE | best / oracle | "
        "acceptance per depth | error per dim per depth | delta per depth |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for tgt, sampler, steps, cell in rows:
        b, o = cell["best"], cell["oracle"]
        lines.append(
            f"| {tgt.name} | {tgt.d} | {sampler} | {steps} | {b['speedup']:.2f} ({b['L']}, {b['draft']}) | "
            f"{o['speedup']:.2f} | {b['speedup'] / o['speedup']:.0%} | {fmt_list(b['acc'][:4], '.2f')} | "
            f"{fmt_list(b['per_dim'][:4], '.3g')} | {fmt_list(b['delta'][:4], '.3g')} |"
        )
    if timing is not None:
        L, draft, t_std, t_spec = timing
        lines += [
            "",
            f"One image, natural32, euler_ancestral 50 Karras steps, warm, one thread, in turns, median of "
            f"{args.repeats}: standard {t_std:.2f} s, best configuration (RMC chain {L}, {draft}) {t_spec:.2f} s: "
            f"{t_std / t_spec:.2f}x.",
        ]
    if skipped:
        lines += ["", "Not measured: " + "; ".join(skipped) + "."]
    lines += ["", f"Total wall time {(time.perf_counter() - t_start) / 60:.1f} min."]
    replace_section(args.out, "real_dims", "## Real dimensions: trained networks against the mixture", "\n".join(lines))
    print("\n".join(lines))
    if args.main_only:
        return
    deep = deep_section(tgts, n)
    replace_section(args.out, "real_dims_deep", deep_heading, "\n".join(deep))
    print("\n".join(deep))
    tuned = tune_timing(args.repeats)
    replace_section(args.out, "real_dims_tune", tune_heading, "\n".join(tuned))
    print("\n".join(tuned))


if __name__ == "__main__":
    main()
