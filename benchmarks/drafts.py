"""Every registered draft at the settings of the draft issue, beside a perfect draft's bound.

    .venv/bin/python benchmarks/drafts.py [--trajectories 200] [--big-trajectories 16] [--images 100] [--wall-seeds 10]
    .venv/bin/python benchmarks/drafts.py --dry-run   # a few trajectories, prints, writes nothing

Three settings, each with every draft of :data:`specforest.proposals.DRAFT_KINDS`:

* the paper's mixture (d = 500, T = 30, churn 0.1, flow_match grid): RMC chains of B = 14 and
  62, rank on planned trees of B = 62 and 155 (``tree="optimal"``) and on the uniform (5, 3) tree;
* the mixture at d = 65,536 (the size of a 512x512 SD3 latent): the RMC chain and rank (5, 3) at B = 155;
* the digits model (T = 100, churn 0.3): the RMC chain of B = 14, with the ``learned`` draft too
  (the distilled draft network, :data:`specforest.proposals.MODEL_DRAFTS`; its calls are counted
  apart from the target's).

On the RMC chains also the Picard-refined chains ``picard`` and ``picard2`` (:data:`specforest.proposals.PICARD_DRAFTS`:
``J = 1, 2`` sweeps, each one more target call a round, counted in the NFE; the ``x0`` row is
their ``J = 0``), and the cached self-draft ``cached`` (:class:`specforest.proposals.CachedDraft`:
the target's deep features of the last round's nodes, its outer part recomputed; on the mixture
the features are the responsibilities, whose cached evaluation costs about a target call, on
digits the U-Net's last decoder input, a third of one; its calls are counted apart too).

Prefetch nearest, verify drafted, lazy mode where the draft allows it (``memory``, ``secant``,
``auto``, ``learned``, ``cached`` and the Picard chains run full; same law of samples and NFE either way). The "oracle" row
drafts with the target itself (a draft model whose mean is the target's, so every node is
accepted): the fewest calls a chain of that depth can make, the bound any free draft stays under.
The per-depth table shows the acceptance and the mean mismatch ``delta`` of the RMC chain's
verifications at depths 1 to 8. On digits two "ceiling" rows bound what a draft built on the
remembered chain can do (:class:`TargetAtMemory`, which calls the target, so they are diagnostics,
not drafts): the target's own prediction wherever the parent has a remembered node at its step,
and the exact first-order correction there (what ``secant`` estimates with a scalar gain).

Then one digits image in seconds, on one CPU thread, for the standard sampler and every draft
on the same RMC chain (B = 14), full mode: warm (this long-lived process; per seed an untimed run of each
configuration, then a timed one, the configurations interleaved, Python's cyclic collector off
during each run) with the draft's own time per round (the ``draft`` phase of
``SampleStats.phase_seconds``) and the whole sampler's; and fresh (a new ``specforest pixel
--samples 1`` process per seed: its ``wall_seconds``, and the process's whole time from the
command line). Regenerates the ``drafts`` section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import specforest
from specforest.experiments import gmm as gmm_exp
from specforest.experiments import pixel as pixel_exp
from specforest.experiments.results import machine_line, replace_section
from specforest.models.digits import load_classifier, load_velocity
from specforest.proposals import DRAFT_KINDS, MODEL_DRAFTS, PICARD_DRAFTS, SecantDraft

MIXTURE_ROWS = [  # (B, method, K, L, tree)
    (14, "rmc", 1, 14, "uniform"),
    (62, "rmc", 1, 62, "uniform"),
    (62, "rank", 2, 5, "optimal"),
    (155, "rank", 5, 3, "optimal"),
    (155, "rank", 5, 3, "uniform"),
]
BIG_ROWS = [(155, "rmc", 1, 155, "uniform"), (155, "rank", 5, 3, "uniform")]
DIGITS_ROWS = [(14, "rmc", 1, 14, "uniform")]
CHAIN_DRAFTS = (*DRAFT_KINDS, *PICARD_DRAFTS, "cached")
"""On RMC chains also the Picard-refined chains (``J = 1, 2``; the ``x0`` row is their ``J = 0``)
and the cached self-draft (the mixture serves its protocol too)."""
DIGITS_DRAFTS = (*DRAFT_KINDS, *PICARD_DRAFTS, *MODEL_DRAFTS)
"""On digits also the distilled draft network (``learned``)."""
DEPTHS = 8
LABEL = {"rmc": "RMC chain", "rank": "rank"}
HEAD = "| B | method | tree | draft | NFE | T/NFE | (T-2)/(NFE-2) | per-step acceptance |"
SEP = "| --- | --- | --- | --- | --- | --- | --- | --- |"


def fmt(r: dict) -> str:
    acc = "" if r.get("accept_rate") is None else f"{r['accept_rate']:.3f}"
    return (
        f"{r['nfe_mean']:.2f} ± {r['nfe_sem']:.2f} | {r['speedup_mean']:.3f} ± {r['speedup_sem']:.3f} | "
        f"{r['speedup_paper_mean']:.3f} ± {r['speedup_paper_sem']:.3f} | {acc}"
    )


def summary(nfe: torch.Tensor, steps: int) -> dict:
    """Mean ± standard error of NFE and both speedup accountings, per trajectory."""
    n = nfe.double()
    sq = math.sqrt(n.numel())
    out = {}
    for key, v in (("nfe", n), ("speedup", steps / n), ("speedup_paper", (steps - 2) / (n - 2))):
        out[f"{key}_mean"], out[f"{key}_sem"] = float(v.mean()), float(v.std() / sq)
    return out


def tree_label(tree: str, K: int, L: int, r: dict) -> str:
    if tree == "optimal":
        return f"planned, B = {r['budget']}"
    return f"chain L = {L}" if K == 1 else f"({K}, {L})"


def chain_run(model, x: torch.Tensor, draft, *, L: int, steps: int, churn: float, cond: dict, seed: int) -> dict:
    """The RMC chain of depth ``L`` drafting with ``draft``: NFE, speedups and acceptance. With the
    target itself as ``draft`` it is the oracle row (every node accepted)."""
    out = specforest.sample(
        model,
        x,
        steps=steps,
        churn=churn,
        tree=specforest.trees.chain(L),
        coupling="rmc",
        draft=draft,
        cond=cond,
        prefetch="nearest",
        verify="drafted",
        seed=seed,
    )
    att, acc = out.stats.attempts.sum(), out.stats.accepts.sum()
    return {**summary(out.stats.nfe, steps), "accept_rate": float(acc / att)}


class TargetAtMemory(SecantDraft):
    """Ceiling diagnostic of the memory drafts, not a free draft (it calls the target): at a parent
    ``y`` that reads a remembered node ``(y_m, x0_m)`` at its own step, the clean-data prediction
    ``x0_m + (x0(y_m + h (y - y_m)) - x0_m) / h`` with the target's ``x0``; ``h = 1`` is the
    target's own prediction at ``y``, a small ``h`` the exact first-order (Jacobian) correction
    that ``secant`` estimates with a scalar gain. Elsewhere the ``secant`` draft (its gain is 0
    there: ``memory``). Same remembered chains and step-keyed noise, so exact like them."""

    affine = False

    def __init__(self, model, h: float) -> None:
        self.model, self.h = model, h
        self.name = f"target at memory, h = {h:g}"

    def mean(self, tab, y, steps, pre, cond, shape, state, memory=None):
        G, n, D = y.shape
        A, C = SecantDraft.coefficients(self, tab, steps, pre, state, memory=memory)
        if memory is None or memory.y is None:
            return torch.addcmul(C, A, y)
        t = steps - memory.s0[:, None]
        same = (t >= 0) & (t < memory.n[:, None]) & (steps >= pre.step[:, None])
        j = t.clamp(0, memory.y.shape[1] - 1)[..., None].expand(-1, -1, D)
        ym, xm = memory.y.gather(1, j), memory.x0.gather(1, j)
        sig = tab.sig[steps][..., None]
        z = ym + self.h * (y - ym)
        rows = {k: v.repeat_interleave(n, dim=0) for k, v in cond.items()}
        with torch.no_grad():
            v = self.model(z.reshape(G * n, *shape), sig.reshape(-1).to(z.dtype), **rows).reshape(G, n, D)
        x0 = xm + ((z - sig * v.to(y.dtype)) - xm) / self.h
        ac = tab.ac[steps]
        a, k = ac[..., :1], ac[..., 1:] / sig
        return torch.where(same[..., None], a * y + k * (y - x0), torch.addcmul(C, A, y))


def per_depth_table(rows: list) -> list:
    head = "| setting | draft | " + " | ".join(f"depth {d}" for d in range(1, DEPTHS + 1)) + " |"
    lines = [head, "| --- | --- | " + " | ".join("---" for _ in range(DEPTHS)) + " |"]
    for setting, draft, r in rows:
        cells = []
        for a, d in list(zip(r["accept_rate_per_depth"], r["delta_per_depth"], strict=True))[:DEPTHS]:
            cells.append("" if a is None else f"{a:.2f} (δ {d:.2f})")
        cells += [""] * (DEPTHS - len(cells))
        lines.append(f"| {setting} | {draft} | " + " | ".join(cells) + " |")
    return lines


def one_image_seconds(model, seeds: list, fresh_seeds: list) -> list:
    """The one-image wall-clock table (see the module docstring), on one CPU thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    configs = [("standard", dict(tree=None))] + [
        (d, dict(tree=specforest.trees.chain(14), coupling="rmc", draft=d)) for d in DIGITS_DRAFTS
    ]
    # full mode: lazy mode gives the same calls and law but realizes the visited nodes one
    # by one, a simulation of the calls rather than a way to spend fewer seconds
    opts = dict(steps=100, churn=0.3, prefetch="nearest", verify="drafted")
    warm: dict = {name: [] for name, _ in configs}
    try:
        for seed in tqdm(seeds, desc="one image, warm"):
            x, labels = pixel_exp.initial_states(1, seed)
            cond = {"class_labels": labels}
            for name, kw in configs:
                specforest.sample(model, x, cond=cond, seed=10_000 + seed, **opts, **kw)
                gc.collect()
                gc.disable()
                try:
                    t0 = time.perf_counter()
                    res = specforest.sample(model, x, cond=cond, seed=seed, **opts, **kw)
                    wall = time.perf_counter() - t0
                finally:
                    gc.enable()
                st = res.stats
                warm[name].append(
                    (
                        wall,
                        st.calls,
                        st.draft_calls,
                        st.phase_seconds["draft"] / st.calls,
                        st.sampler_seconds / st.calls,
                    )
                )
    finally:
        torch.set_num_threads(threads)
    fresh: dict = {name: [] for name, _ in configs}
    for seed in tqdm(fresh_seeds, desc="one image, fresh"):
        for name, _ in configs:
            args = ["--method", "standard"] if name == "standard" else ["--method", "rmc", "--K", "1", "--L", "14"]
            args += [] if name == "standard" else ["--draft", name]
            cmd = [sys.executable, "-m", "specforest", "pixel", "--samples", "1", "--steps", "100", "--churn", "0.3"]
            cmd += [*args, "--seed", str(seed), "--json", "--no-progress", "--threads", "1"]
            cmd += ["--verify", "drafted", "--prefetch", "nearest"]
            t0 = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True)
            whole = time.perf_counter() - t0
            if out.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr}")
            fresh[name].append((json.loads(out.stdout.splitlines()[-1])["wall_seconds"], whole))
    base_warm = statistics.fmean(r[0] for r in warm["standard"])
    base_fresh = statistics.median(r[0] for r in fresh["standard"])
    lines = [
        "",
        f"### One digits image in seconds (RMC chain B = 14; {len(seeds)} seeds warm, {len(fresh_seeds)} fresh; "
        "one CPU thread)",
        "",
        "| draft | calls | draft-network calls | wall, warm (± s.e.) | draft time per round | sampler time per round "
        "| speedup, warm | wall_seconds, fresh | process, fresh | speedup, fresh |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, _ in configs:
        walls, calls, dcalls, per_draft, per_sampler = zip(*warm[name], strict=True)
        w = statistics.fmean(walls)
        se = statistics.stdev(walls) / math.sqrt(len(walls))
        fw = statistics.median(r[0] for r in fresh[name])
        fp = statistics.median(r[1] for r in fresh[name])
        lines.append(
            f"| {name} | {statistics.fmean(calls):.1f} | {statistics.fmean(dcalls):.1f} | "
            f"{1e3 * w:.0f} ± {1e3 * se:.0f} ms | "
            f"{1e3 * statistics.fmean(per_draft):.2f} ms | {1e3 * statistics.fmean(per_sampler):.2f} ms | "
            f"{base_warm / w:.2f}x | {1e3 * fw:.0f} ms | {fp:.2f} s | {base_fresh / fw:.2f}x |"
        )
    lines += [
        "",
        "Warm: mean over seeds (a run's time follows its random number of rounds). Fresh: median over "
        "seeds; `wall_seconds` is the run inside the process, `process` the whole command (Python, "
        "torch and the model loaded). Speedups are the standard sampler's time over the row's, in the "
        "same pass.",
    ]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trajectories", type=int, default=200, help="mixture trajectories at d = 500 (>= 2)")
    ap.add_argument("--big-trajectories", type=int, default=16, help="mixture trajectories at d = 65,536 (>= 2)")
    ap.add_argument("--images", type=int, default=100, help="digits images (>= 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of x_T and the sampling noise (>= 0)")
    ap.add_argument("--wall-seeds", type=int, default=10, help="seeds of the one-image warm timing (>= 2)")
    ap.add_argument("--fresh-seeds", type=int, default=3, help="seeds of the one-image fresh processes (>= 1)")
    ap.add_argument("--dry-run", action="store_true", help="3 trajectories per setting; print, write nothing")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = ap.parse_args()
    if min(args.trajectories, args.big_trajectories, args.images) < 2:
        ap.error("--trajectories, --big-trajectories and --images must be >= 2")
    if args.seed < 0:
        ap.error("--seed must be >= 0")
    if args.wall_seeds < 2 or args.fresh_seeds < 1:
        ap.error("--wall-seeds must be >= 2 and --fresh-seeds >= 1")
    if args.dry_run:
        args.trajectories = args.big_trajectories = args.images = 3
        args.wall_seeds, args.fresh_seeds = 2, 1
    t0 = time.perf_counter()
    common = dict(prefetch="nearest", verify="drafted", seed=args.seed, lazy=True)
    depth_rows: list = []

    def mixture(setting, rows, title) -> list:
        lines = ["", f"### {title}", "", HEAD, SEP]
        gmm = setting.mixture()
        x = gmm_exp.initial_states(setting.trajectories, setting.dim, args.seed)
        for B, method, K, L, tree in tqdm(rows, desc=title[:30]):
            for draft in CHAIN_DRAFTS if method == "rmc" else DRAFT_KINDS:
                kw = dict(budget=B) if tree == "optimal" else {}
                r = gmm_exp.run_config(setting, method=method, K=K, L=L, draft=draft, tree=tree, **kw, **common)
                t = tree_label(tree, K, L, r)
                lines.append(f"| {r['budget']} | {LABEL[method]} | {t} | {draft} | {fmt(r)} |")
                tqdm.write(lines[-1], file=sys.stderr)
                if method == "rmc" and L == rows[0][3]:
                    depth_rows.append((f"d = {setting.dim}, {t}", draft, r))
            if method == "rmc":
                r = chain_run(gmm, x, gmm, L=L, steps=setting.steps, churn=setting.churn, cond={}, seed=args.seed)
                lines.append(f"| {B} | {LABEL[method]} | chain L = {L} | oracle (the target) | {fmt(r)} |")
        return lines

    small = gmm_exp.GMMSetting(trajectories=args.trajectories)
    big = gmm_exp.GMMSetting(dim=65536, trajectories=args.big_trajectories)
    lines = [
        f"Measured with `benchmarks/drafts.py --trajectories {args.trajectories} --big-trajectories "
        f"{args.big_trajectories} --images {args.images} --wall-seeds {args.wall_seeds} --fresh-seeds "
        f"{args.fresh_seeds}` on {machine_line()}, {torch.get_num_threads()} threads (the one-image timing: one).",
        "",
        "Every registered draft; prefetch nearest, verify drafted, lazy mode where the draft allows it "
        "(`memory`, `secant`, `auto`, `learned` and `cached` remember each chain round and run full, as the "
        "Picard chains do). Mean ± standard error over trajectories; the paper's accounting (T-2)/(NFE-2) beside "
        "T/NFE. `picard` and `picard2` refine the `x0` chain (their J = 0) with 1 and 2 Picard sweeps, each "
        "one more target call a round, counted in the NFE. `learned`'s draft-network calls and `cached`'s "
        "outer-block calls are not target calls (see the one-image table; on the mixture a cached "
        "evaluation, the velocity with the responsibilities of a remembered node, costs about a target call). The oracle row drafts with the target itself: every node "
        "accepted, the fewest calls a chain of that depth makes.",
    ]
    lines += mixture(small, MIXTURE_ROWS, "Mixture, paper setting (d = 500, T = 30, churn 0.1)")
    lines += mixture(big, BIG_ROWS, f"Mixture at d = 65,536 ({args.big_trajectories} trajectories)")

    model, clf = load_velocity(), load_classifier()
    lines += ["", f"### Digits (T = 100, churn 0.3, {args.images} images)", "", HEAD, SEP]
    for B, method, K, L, _ in DIGITS_ROWS:
        for draft in DIGITS_DRAFTS:
            r = pixel_exp.simulate(
                method=method,
                K=K,
                L=L,
                churn=0.3,
                samples=args.images,
                steps=100,
                draft=draft,
                model=model,
                classifier=clf,
                **common,
            ).record
            lines.append(f"| {B} | {LABEL[method]} | chain L = {L} | {draft} | {fmt(r)} |")
            tqdm.write(lines[-1], file=sys.stderr)
            depth_rows.append((f"digits, chain L = {L}", draft, r))
        x, labels = pixel_exp.initial_states(args.images, args.seed)
        run = dict(L=L, steps=100, churn=0.3, cond={"class_labels": labels}, seed=args.seed)
        r = chain_run(model, x, model, **run)
        lines.append(f"| {B} | {LABEL[method]} | chain L = {L} | oracle (the target) | {fmt(r)} |")
        for h, what in ((1.0, "the target's prediction"), (1e-3, "the exact first-order correction")):
            r = chain_run(model, x, TargetAtMemory(model, h), **run)
            label = f"ceiling: {what} at same-step memory nodes (calls the target)"
            lines.append(f"| {B} | {LABEL[method]} | chain L = {L} | {label} | {fmt(r)} |")
    lines += ["", "### Acceptance (and mean mismatch δ) per depth, RMC chain", ""]
    lines += per_depth_table(depth_rows)
    lines += one_image_seconds(model, list(range(args.wall_seeds)), list(range(args.fresh_seeds)))
    lines += ["", f"Total wall time {(time.perf_counter() - t0) / 60:.1f} min."]
    text = "\n".join(lines)
    if not args.dry_run:
        replace_section(args.out, "drafts", "## Drafts: every registered draft against a perfect one", text)
    print(text)


if __name__ == "__main__":
    main()
