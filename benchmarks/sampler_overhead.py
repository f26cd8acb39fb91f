"""The sampler's own time per round next to the network call it makes, phase by phase.

    .venv/bin/python benchmarks/sampler_overhead.py --before fce9583

Target: the shipped digits U-Net (1 x 8 x 8, class-conditional), T = 100,
churn 0.3, one CPU thread (pinned: on a shared machine the default thread
count makes timings swing by 10x). For every coupling, one image at a time
and 64 images at once: wall time, time inside the network, and the sampler's
own time per round (wall minus network, divided by the rounds), median of 3
runs in each of 2 passes, with the split over the round engine's phases
(``SampleStats.phase_seconds``), and for one image the same rounds replayed
with the network replaced by a lookup (the sampler's work alone). ``--before REF`` measures the same runs on
an older commit (checked out in a temporary git worktree) for a before/after
table, alternating with this tree pass by pass, each in a fresh process, so
that both see the same stretches of the machine; it has no phase split. The GRS residual sampler's cost per call is
measured in both. Regenerates the ``overhead`` section of
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = [
    # (label, images, tree spec, coupling, draft)
    ("standard", 1, None, "grs", "velocity"),
    ("RMC chain B=14", 1, ("chain", 14), "rmc", "velocity"),
    ("D-GRS (2,3)", 1, ("uniform", 2, 3), "grs", "velocity"),
    ("rank (2,3), draft auto", 1, ("uniform", 2, 3), "rank", "auto"),
    ("antithetic (2,3)", 1, ("uniform", 2, 3), "antithetic", "velocity"),
    ("standard", 64, None, "grs", "velocity"),
    ("RMC chain B=14", 64, ("chain", 14), "rmc", "velocity"),
    ("D-GRS (2,3)", 64, ("uniform", 2, 3), "grs", "velocity"),
    ("rank (2,3), draft auto", 64, ("uniform", 2, 3), "rank", "auto"),
    ("antithetic (2,3)", 64, ("uniform", 2, 3), "antithetic", "velocity"),
    ("D-GRS (2,5)", 64, ("uniform", 2, 5), "grs", "velocity"),
]


def _runs(n: int, spec, repeats: int) -> int:
    """Timed runs per pass: a 64-image tree's run takes 10-30 s here, so at most 3 (1 for (2,5))."""
    if n == 1 or spec is None:
        return repeats
    return 1 if spec[-1] == 5 else min(repeats, 3)


def _tree(spec):
    from specforest import trees

    if spec is None:
        return None
    return trees.chain(spec[1]) if spec[0] == "chain" else trees.uniform(spec[1], spec[2])


def _alone(run, repeats: int) -> "float | None":
    """The sampler's own time per round with the network out of the way, or None on an older engine.

    One run is recorded round by round (its state before each round and the network's
    outputs); the rounds are then replayed under inference mode with the network
    replaced by a lookup of those outputs, and the replay timed (median of
    ``repeats``). Against the sampler time of a real run, this separates the
    sampler's own work from what the network's calls in between cost it (cold
    caches).
    """
    import statistics

    import torch

    try:
        from specforest import engine
        from specforest import sampler as sampler_module
    except ImportError:
        return None
    if not hasattr(engine, "run_round"):
        return None
    real_round, rounds = engine.run_round, []

    def recording(ctx, state):
        outs, fn = [], ctx.target.fn
        ctx.target.fn = lambda x, s, **kw: outs.append(fn(x, s, **kw)) or outs[-1]
        try:
            return real_round(ctx, state)
        finally:
            ctx.target.fn = fn
            rounds.append((ctx, state, outs))

    sampler_module.engine.run_round = recording
    try:
        run()
    finally:
        sampler_module.engine.run_round = real_round
    rounds = [r for r in rounds if r[2]]
    times = []
    with torch.inference_mode():
        for rep in range(repeats + 1):
            t0 = time.perf_counter()
            for ctx, state, outs in rounds:
                it = iter(outs)
                ctx.target.fn = lambda x, s, it=it, **kw: next(it)
                real_round(ctx, state)
            if rep:  # the first replay warms up
                times.append((time.perf_counter() - t0) / len(rounds))
    return statistics.median(times)


def measure(repeats: int, quick: bool) -> dict:
    """Time every configuration with the ``specforest`` importable here; returns a JSON-able dict."""
    import torch

    import specforest
    from specforest.couplings import grs_levels, sample_grs_residual
    from specforest.models.digits import load_velocity

    torch.set_num_threads(1)
    vel = load_velocity()
    inside = [0.0]

    def model(x, sigma, **kw):
        t = time.perf_counter()
        out = vel(x, sigma, **kw)
        inside[0] += time.perf_counter() - t
        return out

    has_cond = "cond" in inspect.signature(specforest.sample).parameters
    rows = []
    for label, n, spec, coupling, draft in CONFIGS:
        runs = []
        # one untimed run first: first calls build caches (tables, quadrature nodes, kernels)
        for rep in [-1] + list(range(_runs(n, spec, repeats))):
            g = torch.Generator().manual_seed(max(rep, 0))
            x = torch.randn(n, 1, 8, 8, generator=g)
            labels = torch.randint(0, 10, (n,), generator=g)
            kw = {"cond": {"class_labels": labels}} if has_cond else {"model_kwargs": {"class_labels": labels}}
            inside[0] = 0.0
            t0 = time.perf_counter()
            with torch.no_grad():
                out = specforest.sample(
                    model,
                    x,
                    steps=10 if rep < 0 else (20 if quick else 100),
                    churn=0.3,
                    tree=_tree(spec),
                    coupling=coupling,
                    draft=draft,
                    generator=torch.Generator().manual_seed(100 + max(rep, 0)),
                    **kw,
                )
            wall = time.perf_counter() - t0
            if rep < 0:
                continue
            runs.append(
                dict(
                    wall=wall,
                    inside=inside[0],
                    calls=out.stats.calls,
                    nfe=float(out.stats.nfe.double().mean()),
                    phases=getattr(out.stats, "phase_seconds", None) or {},
                )
            )
        runs.sort(key=lambda r: r["wall"] - r["inside"])
        alone = None
        if n == 1:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(n, 1, 8, 8, generator=g)
            labels = torch.randint(0, 10, (n,), generator=g)
            kw = {"cond": {"class_labels": labels}} if has_cond else {"model_kwargs": {"class_labels": labels}}
            one_run = functools.partial(
                specforest.sample,
                model,
                x,
                steps=20 if quick else 100,
                churn=0.3,
                tree=_tree(spec),
                coupling=coupling,
                draft=draft,
                generator=torch.Generator().manual_seed(100),
                **kw,
            )
            alone = _alone(one_run, repeats)
        rows.append(dict(label=label, images=n, alone=alone, runs=runs, **runs[len(runs) // 2]))
    try:  # the draw the sampler makes: trials, then the inversion (an older engine: the inversion)
        from specforest.residuals import TRIALS, draw_grs_residual
    except ImportError:
        TRIALS, draw_grs_residual = 0, None
    residual = {}
    for P in (1, 64):
        d = torch.full((P,), 0.7, dtype=torch.float64)
        lam, G = grs_levels(d, 3)
        g = torch.Generator().manual_seed(0)
        u = torch.rand(P, 1 + 2 * TRIALS, dtype=torch.float64, generator=g).clamp_min(1e-12)
        args = (d, lam[:, 3], G[:, 3], u)
        for name, draw in (("inversion", sample_grs_residual), ("draw", draw_grs_residual)):
            if draw is None:
                continue
            a = args if draw is draw_grs_residual else args[:3] + (u[:, 0],)
            draw(*a)
            times = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(50):
                    draw(*a)
                times.append((time.perf_counter() - t) / 50)
            residual[f"{name} {P}"] = statistics.median(times)
        residual.setdefault(f"draw {P}", residual[f"inversion {P}"])
    return dict(rows=rows, residual=residual)


def _measure_in(src: Path, repeats: int, quick: bool, cwd: str) -> dict:
    """:func:`measure` in a fresh process importing ``specforest`` from ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure-only", "--repeats", str(repeats)]
    out = subprocess.run(
        cmd + (["--quick"] if quick else []), check=True, capture_output=True, text=True, env=env, cwd=cwd
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _pooled(passes: list) -> dict:
    """One result from several passes of :func:`measure`: per configuration the median run of all
    passes' runs (by sampler time per round) and the median replay; the median residual times."""
    rows = []
    for i, first in enumerate(passes[0]["rows"]):
        runs = sorted(
            (run for p in passes for run in p["rows"][i]["runs"]), key=lambda r: (r["wall"] - r["inside"]) / r["calls"]
        )
        alone = [p["rows"][i]["alone"] for p in passes if p["rows"][i]["alone"] is not None]
        rows.append(
            dict(
                label=first["label"],
                images=first["images"],
                alone=statistics.median(alone) if alone else None,
                **runs[len(runs) // 2],
            )
        )
    residual = {P: statistics.median(p["residual"][P] for p in passes) for P in passes[0]["residual"]}
    return dict(rows=rows, residual=residual)


def _measure_both(ref: "str | None", repeats: int, quick: bool, passes: int) -> tuple:
    """``(before, after)``: each pass measures the older commit ``ref`` (in a temporary git worktree)
    and then this tree, each in a fresh process, so both see the same stretches of a shared machine."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        wt = Path(tmp) / "before"
        if ref:
            subprocess.run(
                ["git", "-C", str(root), "worktree", "add", "--detach", str(wt), ref], check=True, capture_output=True
            )
        try:
            before, after = [], []
            for _ in range(passes):
                if ref:
                    before.append(_measure_in(wt / "src", repeats, quick, tmp))
                after.append(_measure_in(root / "src", repeats, quick, tmp))
            return (_pooled(before) if ref else None), _pooled(after)
        finally:
            if ref:
                subprocess.run(
                    ["git", "-C", str(root), "worktree", "remove", "--force", str(wt)], check=False, capture_output=True
                )


def _residual(result: dict, name: str, P: str) -> float:
    """A residual timing of :func:`measure`'s result: ``name`` is ``draw`` or ``inversion``."""
    return result["residual"][f"{name} {P}"]


def _ms(x: float) -> str:
    return f"{1e3 * x:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--before", default=None, help="git ref to measure as 'before' (e.g. the commit before the round engine)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="runs per configuration and pass (the median is reported)")
    ap.add_argument(
        "--passes", type=int, default=2, help="passes over before and now, alternated (their runs are pooled)"
    )
    ap.add_argument("--quick", action="store_true", help="T = 20 instead of 100 (a smoke run, not for the table)")
    ap.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = ap.parse_args()
    if args.measure_only:
        print(json.dumps(measure(args.repeats, args.quick)))
        return
    before, after = _measure_both(args.before, args.repeats, args.quick, args.passes)

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from specforest.experiments.results import machine_line, replace_section

    steps = 20 if args.quick else 100
    lines = [
        f"Measured with `benchmarks/sampler_overhead.py{' --before ' + args.before if args.before else ''}` "
        f"on {machine_line()}, one CPU thread.",
        "",
        f"Target: the shipped digits U-Net (1 x 8 x 8), T = {steps}, churn 0.3; median of {args.repeats} runs "
        f"in each of {args.passes} passes, each pass measuring "
        + ("before, then now, each in a fresh process" if before else "in a fresh process")
        + " (at 64 images, at most 3 runs per pass for a tree and one for D-GRS (2,5)). Sampler time = wall time "
        "outside the network, per round; "
        "wall-clock speedup = the standard sampler's wall time over the configuration's, same number of images. "
        "Alone = the same rounds replayed with the network replaced by a lookup of its outputs (one image): "
        "the sampler's own work without the network's calls in between, which leave its caches cold.",
        "",
        "| configuration | images | rounds | NFE | network per call (ms) | sampler per round (ms) | "
        + ("before (ms) | now / before | " if before else "")
        + "alone (ms) | "
        + "draft / evaluate / walk / commit (ms per round) | sampler share of wall | wall (ms) | "
        "wall-clock speedup |",
        "| --- | --- | --- | --- | --- | --- | " + ("--- | --- | " if before else "") + "--- | --- | --- | --- | --- |",
    ]
    standard_wall = {r["images"]: r["wall"] for r in after["rows"] if r["label"] == "standard"}
    for i, r in enumerate(after["rows"]):
        c = r["calls"]
        ph = r["phases"]
        split = " / ".join(_ms(ph.get(k, 0.0) / c) for k in ("draft", "evaluate", "walk", "commit"))
        b = ""
        if before:
            br = before["rows"][i]
            now_s, before_s = (r["wall"] - r["inside"]) / c, (br["wall"] - br["inside"]) / br["calls"]
            b = f"{_ms(before_s)} | {now_s / before_s:.2f} | "
        b += "- | " if r.get("alone") is None else f"{_ms(r['alone'])} | "
        lines.append(
            f"| {r['label']} | {r['images']} | {c} | {r['nfe']:.1f} | {_ms(r['inside'] / c)} | "
            f"{_ms((r['wall'] - r['inside']) / c)} | {b}{split} | {(r['wall'] - r['inside']) / r['wall']:.0%} | "
            f"{1e3 * r['wall']:.0f} | {standard_wall[r['images']] / r['wall']:.2f}x |"
        )
        print(lines[-1], flush=True)
    lines += [
        "",
        "GRS residual, time per call (K = 3, delta = 0.7, where the envelope's mass over the residual's "
        "is M = 2.8): the draw the sampler makes (trials, then the inversion where none is kept; before "
        "it, the inversion alone), and the inversion:",
        "",
        "| problems | " + ("draw before (ms) | " if before else "") + "draw now (ms) | inversion now (ms) |",
        "| --- | " + ("--- | " if before else "") + "--- | --- |",
    ]
    for P in ("1", "64"):
        b = f"{_ms(_residual(before, 'draw', P))} | " if before else ""
        lines.append(f"| {P} | {b}{_ms(_residual(after, 'draw', P))} | {_ms(_residual(after, 'inversion', P))} |")
    print("\n".join(lines[-4:]))
    if not args.quick:
        replace_section(args.out, "overhead", "## Sampler overhead per round", "\n".join(lines))


if __name__ == "__main__":
    main()
