"""Warm-up: the tuned digits configuration's speedup in a fresh process, with and without warm-up, against a warm one.

    .venv/bin/python benchmarks/warmup.py [--tuned tuned.json] [--repeats 5] [--threads 1]

One digits image (T = 100, churn 0.3 unless told otherwise) with the tuned
configuration of ``specforest tune --model digits --steps 100 --churn 0.3
--batch 1`` (made here first, with ``--threads``, unless ``--tuned`` gives a
file), against the standard sampler, three ways:

1. **warm**: in this long-lived process, after an untimed run of each, runs of the
   standard sampler and of the tuned configuration interleaved (``--warm-runs``
   per seed);
2. **fresh, no warm-up**: every run in a new Python process that does what
   ``specforest pixel --samples 1 --tune FILE`` did before warm-up existed (the same
   start-up: threads set, freed memory kept; then
   ``specforest.experiments.pixel.simulate`` with ``warmup=False``);
3. **fresh, warm-up**: every run a new ``specforest pixel --samples 1 --tune FILE
   --json`` process, which warms the tuned configuration's row counts before sampling.

The standard sampler runs fresh as ``specforest pixel --samples 1 --method standard``
(one row count, met on its first call). Each time is the run's ``wall_seconds``
(the warm-up is ``warmup_seconds``, reported beside it, not in it); a row is the
median over ``--repeats`` seeds (0, 1, ...; the same seeds for every row, since a
tuned run's time follows its random number of rounds), the speedup the standard
sampler's median over the row's. The goal: the fresh run with warm-up within
10% of the warm speedup.

Regenerates the ``warmup`` section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_FRESH_NO_WARMUP = """
import json
from specforest.devices import set_threads
from specforest.experiments import pixel
from specforest.trees import from_parents
set_threads({threads})
opts = json.loads({options!r})
if "tree" in opts:
    opts["tree"] = from_parents(opts["tree"])
rec = pixel.simulate(samples=1, steps={steps}, churn={churn}, seed={seed}, **opts)
print(json.dumps(rec.record))
"""


def tuned_options(tuned) -> dict:
    """``pixel.simulate``'s options for a :class:`~specforest.latency.Tuned`, as ``--tune`` sets them."""
    opts = dict(verify=tuned.verify, draft=tuned.draft)
    if tuned.tree is None:
        return dict(opts, method="standard")
    if tuned.coupling == "rmc":
        return dict(opts, method="rmc", K=1, L=tuned.tree.budget)
    method = {"grs": "dgrs", "rank": "rank", "antithetic": "antithetic"}[tuned.coupling]
    return dict(opts, method=method, tree=tuned.tree)


def _cli(args: list, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "specforest", *args], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"specforest {' '.join(args)} failed:\n{out.stderr}")
    return json.loads(out.stdout)


def _fresh_no_warmup(opts: dict, steps: int, churn: float, seed: int, threads: int, env: dict) -> dict:
    """What ``specforest pixel --samples 1 --tune FILE`` ran before warm-up, in a new process."""
    opts = dict(opts, **({"tree": opts["tree"].parent.tolist()} if "tree" in opts else {}))
    code = _FRESH_NO_WARMUP.format(options=json.dumps(opts), steps=steps, churn=churn, seed=seed, threads=threads)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the fresh run without warm-up failed:\n{out.stderr}")
    return json.loads(out.stdout)


def _make_tuned(path: Path, steps: int, churn: float, threads: int, env: dict) -> None:
    args = ["tune", "--model", "digits", "--steps", str(steps), "--churn", str(churn), "--batch", "1"]
    args += ["--threads", str(threads), "--no-progress", "--out", str(path)]
    out = subprocess.run([sys.executable, "-m", "specforest", *args], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"specforest tune failed:\n{out.stderr}")
    print(out.stdout.strip(), file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tuned", type=Path, default=None, help="a file of specforest tune (default: tuned here first)")
    ap.add_argument("--steps", type=int, default=100, help="grid steps T (the tuned file's)")
    ap.add_argument("--churn", type=float, default=0.3, help="churn (the tuned file's)")
    ap.add_argument("--repeats", type=int, default=5, help="seeds, one run each per row (median)")
    ap.add_argument("--warm-runs", type=int, default=3, help="runs per seed and configuration in the warm process")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads of every run")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = ap.parse_args()
    for name in ("steps", "repeats", "warm_runs", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 < args.churn <= 1.0:
        ap.error(f"--churn must be in (0, 1], got {args.churn}")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))

    from specforest.devices import set_threads
    from specforest.experiments import pixel
    from specforest.experiments.results import machine_line, replace_section
    from specforest.latency import Tuned

    with tempfile.TemporaryDirectory() as tmp:
        tuned_file = args.tuned
        if tuned_file is None:
            tuned_file = Path(tmp) / "tuned.json"
            _make_tuned(tuned_file, args.steps, args.churn, args.threads, env)
        tuned = Tuned.from_json(json.loads(tuned_file.read_text()))
        seeds = range(args.repeats)
        common = ["pixel", "--samples", "1", "--steps", str(args.steps), "--churn", str(args.churn)]
        common += ["--threads", str(args.threads), "--json", "--no-progress"]

        # fresh processes first, while this one has loaded nothing that could share their caches
        rows: dict = {k: [] for k in ("standard fresh", "tuned fresh", "tuned fresh, warm-up")}
        warmups = []
        for seed in seeds:
            s = ["--seed", str(seed)]
            rows["standard fresh"].append(_cli([*common, *s, "--method", "standard"], env)["wall_seconds"])
            rec = _fresh_no_warmup(tuned_options(tuned), args.steps, args.churn, seed, args.threads, env)
            rows["tuned fresh"].append(rec["wall_seconds"])
            rec = _cli([*common, *s, "--tune", str(tuned_file)], env)
            rows["tuned fresh, warm-up"].append(rec["wall_seconds"])
            warmups.append(rec["warmup_seconds"])

        set_threads(args.threads)
        run = dict(samples=1, steps=args.steps, churn=args.churn)
        configs = {"standard warm": dict(method="standard"), "tuned warm": tuned_options(tuned)}
        for opts in configs.values():
            pixel.simulate(seed=10**6, **run, **opts)  # untimed: the process's first runs
        warm: dict = {k: [] for k in configs}
        for seed in seeds:
            for _ in range(args.warm_runs):
                for name, opts in configs.items():
                    warm[name].append(pixel.simulate(seed=seed, **run, **opts).record["wall_seconds"])
        rows.update(warm)

    med = {k: statistics.median(v) for k, v in rows.items()}
    speedup = {
        "warm process": med["standard warm"] / med["tuned warm"],
        "fresh process, no warm-up": med["standard fresh"] / med["tuned fresh"],
        "fresh `specforest pixel --tune`, warm-up": med["standard fresh"] / med["tuned fresh, warm-up"],
    }
    tuned_s = {
        "warm process": med["tuned warm"],
        "fresh process, no warm-up": med["tuned fresh"],
        "fresh `specforest pixel --tune`, warm-up": med["tuned fresh, warm-up"],
    }
    std_s = {"warm process": med["standard warm"]}
    ref = speedup["warm process"]
    lines = [
        f"`.venv/bin/python benchmarks/warmup.py --repeats {args.repeats} --threads {args.threads}` on "
        f"{machine_line()}, {args.threads} CPU thread(s).",
        "",
        f"One digits image, T = {args.steps}, churn {args.churn}; tuned configuration: {tuned.label} "
        f"(`specforest tune --model digits --steps {args.steps} --churn {args.churn} --batch 1 "
        f"--threads {args.threads}`). Wall seconds of the run (`wall_seconds`; the warm-up is reported "
        f"beside it as `warmup_seconds`, not in it), median over {args.repeats} seeds (warm: "
        f"{args.warm_runs} runs per seed, interleaved, after an untimed run of each). The standard sampler "
        "runs fresh as `specforest pixel --samples 1 --method standard`.",
        "",
        "| run | standard (s) | tuned (s) | speedup | against the warm speedup | warm-up (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, sp in speedup.items():
        std = std_s.get(name, med["standard fresh"])
        warm_up = f"{statistics.median(warmups):.3f}" if name.endswith(", warm-up") else "-"
        lines.append(f"| {name} | {std:.3f} | {tuned_s[name]:.3f} | {sp:.2f}x | {sp / ref:.2f} | {warm_up} |")
    goal = speedup["fresh `specforest pixel --tune`, warm-up"] / ref
    lines += [
        "",
        f"Goal (a fresh `specforest pixel --samples 1 --tune FILE` within 10% of the warm speedup): "
        f"{'met' if goal >= 0.9 else 'not met'} ({goal:.2f} of it).",
    ]
    text = "\n".join(lines)
    print(text)
    replace_section(args.out, "warmup", "## Warm-up: a fresh process against a warm one", text)


if __name__ == "__main__":
    main()
