"""The samplers people run (``specforest.chains``): standard calls against the best exact configuration.

    .venv/bin/python benchmarks/chains.py [--images 32] [--trajectories 16] [--big-trajectories 4]
    .venv/bin/python benchmarks/chains.py --dry-run   # 2 trajectories, short grids; prints, writes nothing

Every registered chain but ``em`` at its usual settings: ``euler_ancestral`` at 50 Karras steps,
``euler`` (EDM's churn: ``s_churn`` 40, ``s_tmin`` 0.05, ``s_tmax`` 50, ``s_noise`` 1.003) at 50,
``dpmpp_2m_sde`` (``eta`` 1, midpoint) at 25 and 50,
``ddpm`` at DDPM's own 1000 steps (linear betas 1e-4 to 0.02, :func:`specforest.chains.ddpm_linear_grid`),
``ddim`` (``eta`` 1) at 100 of those steps, ``lcm`` at 8 Karras steps. Karras grids span
``sigma`` 0.002 to 80. Three models: the digits model, and the paper's mixture at d = 500 and at
d = 65,536.

The standard sampler takes ``T`` calls. The exact configurations tried are the RMC chains of
``B`` = 14, 62, 155 with the ``secant`` and ``cached`` drafts (prefetch nearest, verify drafted);
the table gives the best, as T/NFE (mean ± standard error over trajectories). Every configuration
has the chain's law exactly (``tests/test_kdiffusion_samplers.py``, ``tests/test_chains.py``), so
the choice among them is only about calls. Then one digits image at DDPM's 1000 steps in seconds,
warm, on one thread, for the standard sampler and a few exact configurations. Regenerates the
``chains`` section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import specforest
from specforest import chains
from specforest.experiments import gmm as gmm_exp
from specforest.experiments import pixel as pixel_exp
from specforest.experiments.results import machine_line, replace_section
from specforest.models.digits import load_velocity

BUDGETS = (14, 62, 155)
DRAFTS = ("secant", "cached")


def settings(dry: bool) -> list:
    """``(label, chain, grid)`` of every chain at its usual steps (a few steps in a dry run)."""
    k = chains.karras_linear_grid
    ddpm = chains.ddpm_linear_grid(1000 if not dry else 40)
    every = 10 if not dry else 4
    ddim_grid = torch.cat([ddpm[:-1:every], ddpm.new_zeros(1)])
    churn = chains.EulerChurn(s_churn=40.0, s_tmin=0.05, s_tmax=50.0, s_noise=1.003)
    return [
        ("euler_ancestral, 50 Karras steps", chains.EulerAncestral(), k(50 if not dry else 6)),
        ("euler (s_churn 40), 50 Karras steps", churn, k(50 if not dry else 6)),
        ("dpmpp_2m_sde, 25 Karras steps", chains.DPMPP2MSDE(), k(25 if not dry else 5)),
        ("dpmpp_2m_sde, 50 Karras steps", chains.DPMPP2MSDE(), k(50 if not dry else 6)),
        ("ddpm, 1000 steps", chains.DDPM(), ddpm),
        ("ddim eta 1, 100 steps", chains.DDIM(eta=1.0), ddim_grid),
        ("lcm, 8 Karras steps", chains.LCM(), k(8 if not dry else 4)),
    ]


def t_over_nfe(model, x, cond: dict, chain, grid, tree, coupling: str, draft, seed: int) -> tuple[float, float]:
    """``(T/NFE, its standard error)`` of one run of every trajectory of ``x``."""
    run = specforest.sample(
        model, x, sigmas=grid, chain=chain, tree=tree, coupling=coupling, draft=draft, seed=seed, cond=cond,
        verify="drafted", prefetch="nearest",
    )  # fmt: skip
    steps = grid.numel() - 1
    nfe = run.stats.nfe.double()
    mean = float(nfe.mean())
    se = float(nfe.std() / nfe.numel() ** 0.5) * steps / mean**2 if nfe.numel() > 1 else float("nan")
    return steps / mean, se


def best(model, x, cond, chain, grid, seed: int) -> tuple[str, float, float]:
    """The configuration with the most T/NFE among :data:`BUDGETS` x :data:`DRAFTS`."""
    top = ("", 0.0, 0.0)
    for B in BUDGETS:
        for draft in DRAFTS:
            r, se = t_over_nfe(model, x, cond, chain, grid, specforest.trees.chain(B), "rmc", draft, seed)
            print(f"    B = {B} {draft}: {r:.2f} ± {se:.2f}", file=sys.stderr, flush=True)
            if r > top[1]:
                top = (f"RMC chain B = {B}, {draft}", r, se)
    return top


WALL_CONFIGS = [
    ("standard", dict(tree=None)),
    ("RMC chain B = 30, secant", dict(tree=specforest.trees.chain(30), coupling="rmc", draft="secant")),
    ("RMC chain B = 45, secant", dict(tree=specforest.trees.chain(45), coupling="rmc", draft="secant")),
    ("RMC chain B = 62, secant", dict(tree=specforest.trees.chain(62), coupling="rmc", draft="secant")),
    ("RMC chain B = 100, secant", dict(tree=specforest.trees.chain(100), coupling="rmc", draft="secant")),
    ("RMC chain B = 62, cached", dict(tree=specforest.trees.chain(62), coupling="rmc", draft="cached")),
    ("RMC chain B = 155, cached", dict(tree=specforest.trees.chain(155), coupling="rmc", draft="cached")),
]


def wall_clock(seeds: int) -> list:
    """One digits image at DDPM's 1000 steps on one thread, warm: per configuration the median
    seconds over ``seeds`` seeds (an untimed run of each first; the configurations interleaved)."""
    import gc
    import statistics

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = load_velocity()
    grid = chains.ddpm_linear_grid(1000)
    times: dict = {name: [] for name, _ in WALL_CONFIGS}
    nfe: dict = {name: [] for name, _ in WALL_CONFIGS}
    for seed in range(seeds + 1):
        x, labels = pixel_exp.initial_states(1, seed)
        for name, cfg in WALL_CONFIGS:
            gc.collect()
            gc.disable()
            t0 = time.perf_counter()
            out = specforest.sample(
                model, x * float(grid[0]), sigmas=grid, chain="ddpm", seed=seed, cond={"class_labels": labels}, **cfg
            )
            dt = time.perf_counter() - t0
            gc.enable()
            if seed > 0:  # seed 0 warms every configuration up
                times[name].append(dt)
                nfe[name].append(float(out.stats.nfe[0]))
    torch.set_num_threads(threads)
    base = statistics.median(times["standard"])
    rows = []
    for name, _ in WALL_CONFIGS:
        med = statistics.median(times[name])
        rows.append(f"| {name} | {statistics.mean(nfe[name]):.1f} | {1000 * med:.0f} | {base / med:.2f}x |")
    return rows


FRESH = """
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(1)
import specforest
from specforest import chains
from specforest.experiments import pixel as pixel_exp
from specforest.latency.tuned import Tuned
from specforest.models.digits import load_velocity
tuned = Tuned.from_json(json.load(open(sys.argv[1])))
model = load_velocity()
grid = chains.ddpm_linear_grid(1000)
x, labels = pixel_exp.initial_states(1, int(sys.argv[2]))
t1 = time.perf_counter()
out = specforest.sample(model, x * float(grid[0]), sigmas=grid, seed=int(sys.argv[2]),
                        cond={"class_labels": labels}, **dict(tuned))
t2 = time.perf_counter()
print(json.dumps({"sample": t2 - t1, "process": t2 - t0, "nfe": float(out.stats.nfe[0])}))
"""


def tuned_one_image(seeds: int, dry: bool) -> list:
    """``specforest.latency.tune``'s choice for one digits image at DDPM's 1000 steps on one thread,
    timed warm (median of ``seeds``, beside the standard sampler) and in a fresh process (the
    sampling call, and the whole process from interpreter start, median of ``seeds`` processes)."""
    import json
    import statistics
    import subprocess
    import tempfile

    from specforest.latency import tune

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = load_velocity()
    steps = 40 if dry else 1000
    grid = chains.ddpm_linear_grid(steps)
    x, labels = pixel_exp.initial_states(16, 100)
    t0 = time.perf_counter()
    tuned = tune(
        model, x * float(grid[0]), steps=steps, chain="ddpm", cond={"class_labels": labels}, batch=1,
        sigmas_for=chains.ddpm_linear_grid, budget_max=155, drafts=("secant", "x0"), seed=1,
    )  # fmt: skip
    tune_s = time.perf_counter() - t0
    print(f"    tune chose {tuned.label} in {tune_s:.0f} s", file=sys.stderr, flush=True)
    warm: dict = {"standard": [], "tuned": []}
    for seed in range(seeds + 1):
        xs, lab = pixel_exp.initial_states(1, seed)
        for name, cfg in (("standard", {"chain": "ddpm"}), ("tuned", dict(tuned))):  # (a tuned ddpm carries its chain)
            t1 = time.perf_counter()
            specforest.sample(model, xs * float(grid[0]), sigmas=grid, seed=seed, cond={"class_labels": lab}, **cfg)
            if seed > 0:
                warm[name].append(time.perf_counter() - t1)
    torch.set_num_threads(threads)
    rows = []
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(tuned.to_json(), f)
    fresh = []
    if not dry:
        for seed in range(1, seeds + 1):
            res = subprocess.run(
                [sys.executable, "-c", FRESH, f.name, str(seed)], capture_output=True, text=True, check=True,
                env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
            )  # fmt: skip
            fresh.append(json.loads(res.stdout.strip().splitlines()[-1]))
    base, med = statistics.median(warm["standard"]), statistics.median(warm["tuned"])
    rows.append(f"| standard, warm | {1000 * base:.0f} | 1.00x |")
    rows.append(f"| {tuned.label} (tune's choice), warm | {1000 * med:.0f} | {base / med:.2f}x |")
    if fresh:
        s = statistics.median(r["sample"] for r in fresh)
        p = statistics.median(r["process"] for r in fresh)
        rows.append(f"| {tuned.label}, fresh process: the sampling call | {1000 * s:.0f} | {base / s:.2f}x |")
        rows.append(
            f"| {tuned.label}, fresh process: start to sample (imports, model) | {1000 * p:.0f} | {base / p:.2f}x |"
        )
    return [*rows, "", f"tune ran {tune_s:.0f} s (batch 1, drafts secant and x0, budgets up to 155)."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=32, help="digits images (>= 2)")
    ap.add_argument("--trajectories", type=int, default=16, help="mixture trajectories at d = 500 (>= 2)")
    ap.add_argument("--big-trajectories", type=int, default=4, help="mixture trajectories at d = 65,536 (>= 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initial states and the sampling noise (>= 0)")
    ap.add_argument("--only", choices=("digits", "mixture", "big"), default=None, help="one model only")
    ap.add_argument("--wall-seeds", type=int, default=5, help="timed seeds of the one-image wall clock (>= 1)")
    ap.add_argument("--dry-run", action="store_true", help="2 trajectories, short grids; print, write nothing")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = ap.parse_args()
    if min(args.images, args.trajectories, args.big_trajectories) < 2 or args.seed < 0:
        ap.error("--images, --trajectories and --big-trajectories must be >= 2, --seed >= 0")
    if args.dry_run:
        args.images = args.trajectories = args.big_trajectories = 2
    t0 = time.perf_counter()
    xd, labels = pixel_exp.initial_states(args.images, args.seed)
    models = {
        "digits": (f"digits ({args.images} images)", load_velocity(), xd, {"class_labels": labels}),
        "mixture": (
            f"mixture d = 500 ({args.trajectories})",
            gmm_exp.GMMSetting(trajectories=args.trajectories).mixture(),
            gmm_exp.initial_states(args.trajectories, 500, args.seed),
            {},
        ),
        "big": (
            f"mixture d = 65,536 ({args.big_trajectories})",
            gmm_exp.GMMSetting(dim=65_536).mixture(),
            gmm_exp.initial_states(args.big_trajectories, 65_536, args.seed),
            {},
        ),
    }
    if args.only is not None:
        models = {args.only: models[args.only]}
    lines = [
        f"Measured with `benchmarks/chains.py --images {args.images} --trajectories {args.trajectories} "
        f"--big-trajectories {args.big_trajectories}` on {machine_line()}, {torch.get_num_threads()} threads.",
        "",
        "Standard calls `T` against the best exact configuration among the RMC chains of B = "
        + ", ".join(map(str, BUDGETS))
        + " with the `secant` and `cached` drafts (prefetch nearest, verify drafted); T/NFE, mean ± standard "
        "error over trajectories. Initial states `t_0 * N(0, I)` on the linear path (the VE prior "
        "`sigma_0 N(0, I)`).",
        "",
        "| model | chain | standard calls | best exact configuration | T/NFE |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, model, x, cond in models.values():
        for name, chain, grid in settings(args.dry_run):
            print(f"{label}: {name}", file=sys.stderr, flush=True)
            x0 = x * float(grid[0])
            how, r, se = best(model, x0, cond, chain, grid, args.seed)
            lines.append(f"| {label} | {name} | {grid.numel() - 1} | {how} | {r:.2f} ± {se:.2f} |")
            print(lines[-1], file=sys.stderr, flush=True)
    if args.only in (None, "digits"):
        seeds = 1 if args.dry_run else args.wall_seeds
        lines += [
            "",
            f"One digits image at DDPM's 1000 steps, warm, one thread: median of {seeds} seeds after an untimed "
            "run of every configuration, the configurations interleaved, Python's collector off during each run.",
            "",
            "| configuration | sequential calls | ms per image | against the standard sampler |",
            "| --- | --- | --- | --- |",
            *wall_clock(seeds),
        ]
        print("\n".join(lines[-len(WALL_CONFIGS) - 2 :]), file=sys.stderr, flush=True)
        lines += [
            "",
            "The same image with `specforest.latency.tune`'s choice for it (one thread): warm, median of "
            f"{seeds} seeds beside the standard sampler; and in a fresh Python process per seed (median), the "
            "sampling call alone and from interpreter start (imports and model load included).",
            "",
            "| configuration | ms per image | against the standard sampler, warm |",
            "| --- | --- | --- |",
            *tuned_one_image(seeds, args.dry_run),
        ]
    lines += ["", f"Total wall time {(time.perf_counter() - t0) / 60:.1f} min."]
    text = "\n".join(lines)
    if not args.dry_run:
        replace_section(args.out, "chains", "## The samplers people run: calls of each chain", text)
    print(text)


if __name__ == "__main__":
    main()
