"""The samplers people run (``specforest.chains``): standard calls against the best exact configuration.

    .venv/bin/python benchmarks/chains.py [--images 32] [--trajectories 16] [--big-trajectories 4]
    .venv/bin/python benchmarks/chains.py --dry-run   # 2 trajectories, short grids; prints, writes nothing
    .venv/bin/python benchmarks/chains.py --samplers heun,dpm_2,dpm_2_ancestral,dpmpp_2s_ancestral,dpmpp_3m_sde,dpmpp_sde

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

The samplers of two calls a step or two past predictions, with the goals of issue 47 on digits
(:data:`GOALS`: ``heun`` with ``s_churn`` 40 at 40 Karras steps, with EDM's own window ``S_min`` 0.05,
``S_max`` 50, ``S_noise`` 1.003 and with k-diffusion's defaults; ``dpm_2`` with EDM's churn at 25;
``dpm_2_ancestral`` and ``dpmpp_2s_ancestral`` at 25; ``dpmpp_3m_sde`` at 50; ``dpmpp_sde`` at 20 where
this build registers it), on digits and the mixture at d = 500: calls counted at the model
(:class:`Counted`, checked against the runs' statistics), the best of RMC chains of depth 8 to 64 with
the ``secant``, ``cached``, ``corrected``, ``x0`` and ``velocity`` drafts, the oracle at that depth (the target itself as a
callable draft, which runs through every stage of a step and hands on its own predictions),
and one digits image in seconds with :func:`specforest.latency.tune`'s choice for ``dpmpp_3m_sde`` and
``dpmpp_sde``. Regenerates the ``chains_goals`` section, after ``chains``.

``--samplers`` measures the chains of the registry names given; a section is written only when every
one of its samplers is measured, so ``--samplers`` with the names above rewrites ``chains_goals`` alone
and the older rows stay.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

import specforest
from specforest import chains
from specforest.drafts import drafts_serving
from specforest.experiments import gmm as gmm_exp
from specforest.experiments import pixel as pixel_exp
from specforest.experiments.io import atomic_write_text
from specforest.experiments.results import machine_line, replace_section
from specforest.models.digits import load_velocity

BUDGETS = (14, 62, 155)
DRAFTS = ("secant", "cached")


def settings(dry: bool) -> list:
    """``(key, label, chain, grid)`` of every older chain at its usual steps (a few steps in a dry run);
    ``key`` is the chain's registry name, what ``--samplers`` selects."""
    k = chains.karras_linear_grid
    ddpm = chains.ddpm_linear_grid(1000 if not dry else 40)
    every = 10 if not dry else 4
    ddim_grid = torch.cat([ddpm[:-1:every], ddpm.new_zeros(1)])
    churn = chains.EulerChurn(s_churn=40.0, s_tmin=0.05, s_tmax=50.0, s_noise=1.003)
    return [
        ("euler_ancestral", "euler_ancestral, 50 Karras steps", chains.EulerAncestral(), k(50 if not dry else 6)),
        ("euler", "euler (s_churn 40), 50 Karras steps", churn, k(50 if not dry else 6)),
        ("dpmpp_2m_sde", "dpmpp_2m_sde, 25 Karras steps", chains.DPMPP2MSDE(), k(25 if not dry else 5)),
        ("dpmpp_2m_sde", "dpmpp_2m_sde, 50 Karras steps", chains.DPMPP2MSDE(), k(50 if not dry else 6)),
        ("ddpm", "ddpm, 1000 steps", chains.DDPM(), ddpm),
        ("ddim", "ddim eta 1, 100 steps", chains.DDIM(eta=1.0), ddim_grid),
        ("lcm", "lcm, 8 Karras steps", chains.LCM(), k(8 if not dry else 4)),
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


# ---------------------------------------------------------------------------------------------
# The samplers of two calls a step and of two past predictions (issue 47's goals): section chains_goals

GOAL_SECTION = "chains_goals"
GOAL_HEADING = "### Two calls a step, two past predictions: against the oracle and the goals"
GOAL_DEPTHS = (8, 16, 32, 64)
GOAL_DRAFTS = ("secant", "cached", "corrected", "x0", "velocity")
EDM_CHURN = dict(s_churn=40.0, s_tmin=0.05, s_tmax=50.0, s_noise=1.003)
"""EDM's own stochastic setting with ``S_churn`` 40 (its README's ImageNet-64 command: ``--S_churn=40
--S_min=0.05 --S_max=50 --S_noise=1.003``); its ``generate.py`` defaults are ``S_min`` 0, ``S_max`` inf,
``S_noise`` 1, as k-diffusion's ``sample_heun``."""


@dataclass(frozen=True)
class Goal:
    """A sampler of the goals' table: the registry name ``key`` (what ``--samplers`` selects), a label,
    the chain's parameters, its Karras steps (and a dry run's), and the issue's T/NFE goal on digits."""

    key: str
    label: str
    params: dict
    steps: int
    dry_steps: int
    goal: Optional[float]


GOALS = (
    Goal("heun", "heun (s_churn 40; EDM's S_min 0.05, S_max 50, S_noise 1.003), 40 Karras steps", EDM_CHURN, 40, 6, 5.0),
    Goal("heun", "heun (s_churn 40; k-diffusion's s_tmin 0, s_tmax inf, s_noise 1), 40 Karras steps", dict(s_churn=40.0), 40, 6, 5.0),
    Goal("dpm_2", "dpm_2 (s_churn 40; EDM's S_min 0.05, S_max 50, S_noise 1.003), 25 Karras steps", EDM_CHURN, 25, 5, None),
    Goal("dpm_2_ancestral", "dpm_2_ancestral (eta 1), 25 Karras steps", {}, 25, 5, 4.0),
    Goal("dpmpp_2s_ancestral", "dpmpp_2s_ancestral (eta 1), 25 Karras steps", {}, 25, 5, 4.0),
    Goal("dpmpp_3m_sde", "dpmpp_3m_sde (eta 1), 50 Karras steps", {}, 50, 6, 4.0),
    Goal("dpmpp_sde", "dpmpp_sde (eta 1, r 1/2), 20 Karras steps", {}, 20, 5, 5.0),
)  # fmt: skip
WALL_GOALS = ("dpmpp_3m_sde", "dpmpp_sde")
"""The goals' samplers timed for one digits image with ``tune``'s choice."""


def registered(key: str) -> bool:
    """Whether this build has the chain ``key`` (``dpmpp_sde`` arrives in a later change)."""
    return key in chains.available_chains()


class Counted:
    """The model with its target calls counted: ``__call__`` and ``with_features`` (the calls that
    evaluate the network at a state; the digits velocity makes one denoiser call in each), not the
    ``cached`` draft's cheap ``from_features`` or the ``feature_numel`` probe. Everything else is the model's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name != "with_features":
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return attr(*args, **kwargs)

        return counted


def goal_run(model, x, cond, chain, grid, seed: int, tree=None, draft: Any = None) -> dict:
    """One run of every trajectory of ``x`` with the target's calls counted (:class:`Counted`): T/NFE
    with its standard error, the counted and reported calls, acceptance per depth."""
    counted = Counted(model)
    opts: dict = (
        {} if tree is None else dict(tree=tree, coupling="rmc", draft=draft, verify="drafted", prefetch="nearest")
    )
    run = specforest.sample(counted, x, sigmas=grid, chain=chain, seed=seed, cond=cond, **opts)
    st = run.stats
    nfe = st.nfe.double()
    return {
        "counted": counted.calls,
        "calls": st.calls,
        "standard": st.standard_calls,
        "nfe": nfe,
        "acc": [float(a) for a in st.accept_rate_per_depth],
    }


def speedup(standard: int, nfe: torch.Tensor) -> tuple[float, float]:
    """``(T/NFE, its standard error)``: the counted standard calls over the trajectories' mean NFE."""
    mean = float(nfe.mean())
    se = float(nfe.std() / nfe.numel() ** 0.5) * standard / mean**2 if nfe.numel() > 1 else float("nan")
    return standard / mean, se


def goal_cell(model, x, cond, chain, grid, seed: int, drafts: tuple, problems: list, where: str) -> dict:
    """The search (:data:`GOAL_DEPTHS` x ``drafts``), the oracle at the best depth, and the call checks:
    every run's counted calls against ``stats.calls``, the standard run's against ``stats.standard_calls``,
    and one trajectory alone at the best configuration against its ``stats.nfe`` (disagreements go to
    ``problems``)."""
    std = goal_run(model, x, cond, chain, grid, seed)
    T = std["counted"]
    if not (T == std["calls"] == std["standard"] and bool((std["nfe"] == T).all())):
        problems.append(
            f"{where}: standard run counted {T}, stats.calls {std['calls']}, standard_calls {std['standard']}"
        )
    best = None
    for L in GOAL_DEPTHS:
        for draft in drafts:
            r = goal_run(model, x, cond, chain, grid, seed, specforest.trees.chain(L), draft)
            if r["counted"] != r["calls"]:
                problems.append(f"{where}, depth {L}, {draft}: counted {r['counted']}, stats.calls {r['calls']}")
            r.update(L=L, draft=draft, speed=speedup(T, r["nfe"]))
            print(f"    depth {L} {draft}: {r['speed'][0]:.2f} ± {r['speed'][1]:.2f}", file=sys.stderr, flush=True)
            if best is None or r["speed"][0] > best["speed"][0]:
                best = r
    tree = specforest.trees.chain(best["L"])
    one = goal_run(model, x[:1], {k: v[:1] for k, v in cond.items()}, chain, grid, seed, tree, best["draft"])
    if not (one["counted"] == one["calls"] == int(one["nfe"][0])):
        problems.append(f"{where}, one trajectory: counted {one['counted']}, stats.nfe {int(one['nfe'][0])}")
    # the target as a plain callable draft: every stage of a step drafted, its own predictions handed on
    oracle = goal_run(model, x, cond, chain, grid, seed, tree, model)
    oracle["speed"] = speedup(T, oracle["nfe"])
    return {"T": T, "best": best, "oracle": oracle}


def per_depth(acc: list, depths=(1, 2, 4, 8, 16)) -> str:
    """Acceptance at the given depths, ``-`` where never reached."""
    out = []
    for d in depths:
        a = acc[d - 1] if d <= len(acc) else float("nan")
        out.append("-" if math.isnan(a) else f"{a:.2f}")
    return " / ".join(out)


def goal_rows(models: dict, goals: tuple, dry: bool, seed: int, problems: list, notes: list) -> tuple[list, dict]:
    """The goals' table rows for ``models`` (digits and the mixture), and the digits cells by key; the
    settings with deterministic steps before the last go to ``notes``."""
    rows, digits = [], {}
    for mkey, (label, model, x, cond) in models.items():
        drafts = tuple(drafts_serving(list(GOAL_DRAFTS), tuple(x.shape[1:]), model))
        for g in goals:
            steps = g.dry_steps if dry else g.steps
            head = f"| {label} | {g.label} |"
            if not registered(g.key):
                rows.append(f"{head} not available in this build | | | | | | |")
                continue
            print(f"{label}: {g.label}", file=sys.stderr, flush=True)
            chain = chains.get_chain(g.key, **g.params)
            grid = chains.karras_linear_grid(steps)
            cell = goal_cell(model, x * float(grid[0]), cond, chain, grid, seed, drafts, problems, f"{label} {g.label}")
            b, o = cell["best"], cell["oracle"]
            ceil_ = o["speed"][0]
            orc = f"{ceil_:.2f}" + ("" if all(math.isnan(a) or a == 1.0 for a in o["acc"]) else " (acceptance < 1!)")
            met = ""
            if g.goal is not None and mkey == "digits":
                met = f">= {g.goal:g}: " + (
                    "met" if b["speed"][0] >= g.goal else f"missed ({100 * b['speed'][0] / g.goal:.0f}%)"
                )
                met += "" if ceil_ >= g.goal else "; unreachable: the oracle is below it"
            rows.append(
                f"{head} {cell['T']} | RMC chain depth {b['L']}, {b['draft']} | {b['speed'][0]:.2f} ± {b['speed'][1]:.2f} "
                f"| {per_depth(b['acc'])} | {orc} | {100 * b['speed'][0] / ceil_:.0f}% | {met} |"
            )
            print(rows[-1], file=sys.stderr, flush=True)
            if mkey == "digits":
                digits[g.key] = (g, chain, steps, b)
            still = int((~chain.build(grid).stochastic[:-1]).sum())
            note = f"{g.label}: {still} of its {steps - 1} steps before the last add no noise"
            if still and note not in notes:
                notes.append(note)
    return rows, digits


def goals_wall_clock(digits: dict, seeds: int, dry: bool) -> list:
    """One digits image for :data:`WALL_GOALS`: ``tune``'s choice (and the table's best configuration)
    against the standard sampler, warm, one thread, run in turns, median of ``seeds`` repeats."""
    import statistics

    from specforest.latency import tune

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = load_velocity()
    rows = []
    for key in WALL_GOALS:
        if key not in digits:
            rows.append(f"| {key} | not available in this build | | | | | |")
            continue
        g, chain, steps, b = digits[key]
        grid = chains.karras_linear_grid(steps)
        x, labels = pixel_exp.initial_states(16, 100)
        t0 = time.perf_counter()
        tuned = tune(
            model, x * float(grid[0]), steps=steps, chain=chain, cond={"class_labels": labels}, batch=1,
            sigmas_for=chains.karras_linear_grid, budget_max=64, drafts=("secant", "x0"), seed=1,
        )  # fmt: skip
        tune_s = time.perf_counter() - t0
        print(f"    {key}: tune chose {tuned.label} in {tune_s:.0f} s", file=sys.stderr, flush=True)
        best_cfg = dict(
            chain=chain, tree=specforest.trees.chain(b["L"]), coupling="rmc", draft=b["draft"], verify="drafted",
            prefetch="nearest",
        )  # fmt: skip
        configs = {"standard": dict(chain=chain), "tuned": dict(tuned), "best": best_cfg}
        times: dict = {k: [] for k in configs}
        nfe: dict = {k: [] for k in configs}
        for seed in range(seeds + 1):
            xs, lab = pixel_exp.initial_states(1, seed)
            for name, cfg in configs.items():  # in turns
                t1 = time.perf_counter()
                out = specforest.sample(
                    model, xs * float(grid[0]), sigmas=grid, seed=seed, cond={"class_labels": lab}, **cfg
                )
                if seed > 0:  # seed 0 warms each up
                    times[name].append(time.perf_counter() - t1)
                    nfe[name].append(float(out.stats.nfe[0]))
        base = statistics.median(times["standard"])
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append(
            f"| {g.label} | {statistics.mean(nfe['standard']):.0f} | {base:.3f} | {tuned.label} "
            f"({statistics.mean(nfe['tuned']):.1f} calls) | {med['tuned']:.3f} ({base / med['tuned']:.2f}x) "
            f"| depth {b['L']}, {b['draft']} ({statistics.mean(nfe['best']):.1f} calls): {med['best']:.3f} "
            f"({base / med['best']:.2f}x) | {tune_s:.0f} |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    torch.set_num_threads(threads)
    return rows


def goals_section(args, models: dict, goals: tuple, command: str) -> str:
    """The ``chains_goals`` section's body."""
    t0 = time.perf_counter()
    problems: list = []
    missing = [g.key for g in goals if not registered(g.key)]
    notes: list = []
    rows, digits = goal_rows(models, goals, args.dry_run, args.seed, problems, notes)
    threads = torch.get_num_threads()
    seeds = 1 if args.dry_run else args.wall_seeds
    lines = [
        f"Measured with `{command}` on {machine_line()}, " + ("one thread." if threads == 1 else f"{threads} threads."),
        "",
        "The samplers of two model calls a step (`stages = 2`) and of two past predictions (`history = 2`), "
        "with the issue's goals on digits. Calls are counted at the model: a counting wrapper around the "
        "target (one digits denoiser call per velocity call) counts every run's calls; the standard run's "
        "count is the standard calls (2N - 1 for N steps of a two-call sampler whose last step into 0 makes "
        "one call), T/NFE is that count over the trajectories' mean NFE (mean ± standard error). "
        "Search: RMC chains of depth "
        + ", ".join(map(str, GOAL_DEPTHS))
        + " with the drafts "
        + ", ".join(f"`{d}`" for d in GOAL_DRAFTS)
        + " (those the model serves; prefetch nearest, verify "
        "drafted); the best is shown with its acceptance per depth. Oracle: the target itself as the draft "
        "at the best depth, each stage of a step included (its calls not counted), so every drafted step is "
        "accepted: the ceiling of that tree. Initial states `t_0 * N(0, I)` on the linear path.",
        "",
        "| model | sampler | standard calls | best exact configuration | T/NFE | acceptance at depth 1 / 2 / 4 / 8 "
        "/ 16 | oracle T/NFE | best / oracle | goal (digits) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ]
    if notes:
        lines += [
            "",
            "Deterministic steps: a step that adds no noise cannot be drafted exactly, so it ends a round and "
            "lowers the oracle's ceiling (EDM's churn adds noise only at levels in [S_min, S_max]): "
            + "; ".join(notes)
            + ".",
        ]
    if missing:
        lines += ["", "Not available in this build: " + ", ".join(f"`{k}`" for k in missing) + "."]
    lines += [
        "",
        "Counted calls against the run's own statistics (every run's `stats.calls`, the standard run's "
        "`stats.standard_calls` and NFE, one trajectory alone at the best configuration against its "
        "`stats.nfe`): " + ("all agree." if not problems else "DISAGREE: " + "; ".join(problems)),
    ]
    if "digits" in models and any(k in {g.key for g in goals} for k in WALL_GOALS):
        lines += [
            "",
            f"One digits image in seconds, warm, one thread: `specforest.latency.tune`'s choice (batch 1, "
            f"drafts secant and x0, budgets up to 64) and the table's best configuration against the standard "
            f"sampler, the three run in turns, median of {seeds} repeats after an untimed one.",
            "",
            "| sampler | standard calls | standard s | tune's choice | its s | best T/NFE configuration: s | tune s |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *goals_wall_clock(digits, seeds, args.dry_run),
            "",
            "Where tune chooses the standard sampler, its column times the same configuration as the standard "
            "one: their ratio is this machine's timing noise.",
        ]
    lines += ["", f"Total wall time {(time.perf_counter() - t0) / 60:.1f} min."]
    return "\n".join(lines)


def ensure_after(path: Path, name: str, after: str) -> None:
    """Place an empty section ``name`` right after section ``after`` when the file has neither its
    markers (:func:`replace_section` would append it at the end)."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    end = f"<!-- {after}:end -->"
    if f"<!-- {name}:begin -->" in text or end not in text:
        return
    head, tail = text.split(end, 1)
    atomic_write_text(path, f"{head}{end}\n\n<!-- {name}:begin -->\n<!-- {name}:end -->{tail}")


OLD_KEYS = ("euler_ancestral", "euler", "dpmpp_2m_sde", "ddpm", "ddim", "lcm")
"""The older chains (the ``chains`` section), by the registry names ``--samplers`` takes."""


def selection(text: Optional[str]) -> "set[str] | str":
    """The registry names ``--samplers`` selects (every one by default), or the message refusing it."""
    known = OLD_KEYS + tuple(dict.fromkeys(g.key for g in GOALS))
    if text is None:
        return set(known)
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if not names or bad:
        return f"--samplers must be a comma-separated list of {', '.join(known)}; got {text!r}"
    return set(names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=32, help="digits images (>= 2)")
    ap.add_argument("--trajectories", type=int, default=16, help="mixture trajectories at d = 500 (>= 2)")
    ap.add_argument("--big-trajectories", type=int, default=4, help="mixture trajectories at d = 65,536 (>= 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initial states and the sampling noise (>= 0)")
    ap.add_argument("--only", choices=("digits", "mixture", "big"), default=None, help="one model only")
    ap.add_argument(
        "--samplers", default=None,
        help="comma-separated registry names to measure (default all); a section is written only when all of "
        "its samplers are measured",
    )  # fmt: skip
    ap.add_argument("--wall-seeds", type=int, default=5, help="timed seeds of the one-image wall clock (>= 1)")
    ap.add_argument("--dry-run", action="store_true", help="2 trajectories, short grids; print, write nothing")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = ap.parse_args()
    if min(args.images, args.trajectories, args.big_trajectories) < 2 or args.seed < 0:
        ap.error("--images, --trajectories and --big-trajectories must be >= 2, --seed >= 0")
    if args.wall_seeds < 1:
        ap.error(f"--wall-seeds must be >= 1, got {args.wall_seeds}")
    chosen = selection(args.samplers)
    if isinstance(chosen, str):
        ap.error(chosen)
    command = "benchmarks/chains.py" + "".join(
        f" {flag} {value}"
        for flag, value in (
            ("--images", args.images), ("--trajectories", args.trajectories),
            ("--big-trajectories", args.big_trajectories), ("--only", args.only), ("--samplers", args.samplers),
        )
        if value is not None
    )  # fmt: skip
    if args.dry_run:
        args.images = args.trajectories = args.big_trajectories = 2
    t0 = time.perf_counter()
    old = [st for st in settings(args.dry_run) if st[0] in chosen]
    goals = tuple(g for g in GOALS if g.key in chosen)
    wanted = {args.only} if args.only else {"digits", "mixture", "big"}
    if not old:
        wanted -= {"big"}  # the goals' table: digits and the mixture at d = 500
    xd, labels = pixel_exp.initial_states(args.images, args.seed)
    models = {}
    if "digits" in wanted:
        models["digits"] = (f"digits ({args.images} images)", load_velocity(), xd, {"class_labels": labels})
    if "mixture" in wanted:
        models["mixture"] = (
            f"mixture d = 500 ({args.trajectories})",
            gmm_exp.GMMSetting(trajectories=args.trajectories).mixture(),
            gmm_exp.initial_states(args.trajectories, 500, args.seed),
            {},
        )
    if "big" in wanted:
        models["big"] = (
            f"mixture d = 65,536 ({args.big_trajectories})",
            gmm_exp.GMMSetting(dim=65_536).mixture(),
            gmm_exp.initial_states(args.big_trajectories, 65_536, args.seed),
            {},
        )
    if old:
        text = older_section(args, models, old, command, t0)
        if args.dry_run:
            print(text)
        elif set(OLD_KEYS) <= chosen:
            replace_section(args.out, "chains", "## The samplers people run: calls of each chain", text)
            print(text)
        else:
            print(text)
            print(
                "(the chains section is written only when all its samplers are measured: not written)", file=sys.stderr
            )
    goal_models = {k: v for k, v in models.items() if k in ("digits", "mixture")}
    if goals and goal_models:
        text = goals_section(args, goal_models, goals, command)
        print(text)
        if args.dry_run:
            return
        if {g.key for g in GOALS} <= chosen:
            ensure_after(args.out, GOAL_SECTION, "chains")
            replace_section(args.out, GOAL_SECTION, GOAL_HEADING, text)
        else:
            print(
                f"(the {GOAL_SECTION} section is written only when all its samplers are measured: not written)",
                file=sys.stderr,
            )


def older_section(args, models: dict, old: list, command: str, t0: float) -> str:
    """The ``chains`` section's body: the older chains of ``old`` on ``models``, and the DDPM wall clock."""
    lines = [
        f"Measured with `{command}` on {machine_line()}, {torch.get_num_threads()} threads.",
        "",
        "Standard calls `T` against the best exact configuration among the RMC chains of B = "
        + ", ".join(map(str, BUDGETS))
        + " with the `secant` and `cached` drafts (prefetch nearest, verify drafted); T/NFE, mean ± standard "
        "error over trajectories. Initial states `t_0 * N(0, I)` on the linear path (the VE prior "
        "`sigma_0 N(0, I)`). The samplers of two calls a step or two past predictions: the next section.",
        "",
        "| model | chain | standard calls | best exact configuration | T/NFE |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, model, x, cond in models.values():
        for _, name, chain, grid in old:
            print(f"{label}: {name}", file=sys.stderr, flush=True)
            x0 = x * float(grid[0])
            how, r, se = best(model, x0, cond, chain, grid, args.seed)
            lines.append(f"| {label} | {name} | {grid.numel() - 1} | {how} | {r:.2f} ± {se:.2f} |")
            print(lines[-1], file=sys.stderr, flush=True)
    if "digits" in models and any(key == "ddpm" for key, *_ in old):
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
    return "\n".join(lines)


if __name__ == "__main__":
    main()
