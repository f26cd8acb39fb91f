"""Memory, not time: each command's estimated peak (``specforest.memory``) against its measured peak.

    .venv/bin/python benchmarks/memory.py [--skip-rounds] [--skip-rows] [--skip-commands]

1. **What a round holds**: the live tensor bytes of a run of the Gaussian
   mixture at its peak, tracked op by op (every op's outputs held by weak
   reference to their storage, a ``TorchDispatchMode``), per trajectory and
   state, against the model's ``6 V + 5 V_i + R + 8`` states (``V`` nodes,
   ``V_i`` above the last layer, ``R`` rows; keys and scratch included).
2. **What one row costs inside a model call**, for the figures the shipped
   models declare (``row_bytes``): each model is called on ``M`` and ``2 M``
   rows in a fresh process whose allocator returns freed memory at once
   (``MALLOC_MMAP_THRESHOLD_=65536``, ``MALLOC_TRIM_THRESHOLD_=0``), and the
   growth of the peak resident set between the two, over ``M``, is the
   measured cost of a row (input excluded, output included). Next to it the
   model's declaration.
3. **Every command's peak against its limit**: each command (the Gaussian
   mixture full, chunked and lazy, the digits model, ``generate`` on one
   process and tree-parallel on two gloo processes, a tiny SD3 pipeline built
   in code) runs in a fresh process with a small ``--memory-gb`` /
   ``max_memory_gb``; its peak resident set (``os.wait4``'s ``ru_maxrss``,
   which covers a launcher's waited children) is set against the estimate it
   reports (``memory_estimate_gb``, ``memory_peak_gb`` or the ``memory:`` log
   line) and the limit. The limit bounds the whole process: the interpreter,
   torch and the model count toward it (the estimate's fixed bytes). The
   commands run with the CLI's allocator settings
   (``specforest.allocator.keep_freed_memory``).

Regenerates the ``memory`` section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from specforest.peak import run_measured

ROOT = Path(__file__).resolve().parent.parent
SPECFOREST = [sys.executable, "-m", "specforest"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "specforest"]

_ROW_PROBE = r"""
import json, resource, sys, torch
torch.set_num_threads(1)
a = json.loads(sys.argv[1])
M = a["M"]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
if a["model"] == "gmm":
    from specforest.models import GaussianMixture
    model = GaussianMixture.paper(dim=a["dim"], components=a["components"])
    x = torch.randn(M, a["dim"], dtype=getattr(torch, a["dtype"]))
    cond = {}
elif a["model"] == "digits":
    from specforest.models.digits import load_velocity
    model = load_velocity()
    x = torch.randn(M, 1, 8, 8)
    cond = {"class_labels": torch.arange(M) % 10}
else:
    from diffusers import SD3Transformer2DModel
    from specforest.diffusers import FlowMatchVelocity
    torch.manual_seed(0)
    S, hd, H, txt = a["size"], a["head_dim"], a["heads"], a["text"]
    tr = SD3Transformer2DModel(sample_size=S, patch_size=2, in_channels=4, num_layers=a["layers"],
        attention_head_dim=hd, num_attention_heads=H, joint_attention_dim=16, caption_projection_dim=hd * H,
        pooled_projection_dim=16, out_channels=4, pos_embed_max_size=S).eval()
    model = FlowMatchVelocity(tr, guidance_scale=a["guidance"])
    x = torch.randn(M, 4, S, S)
    cond = {"encoder_hidden_states": torch.randn(M, txt, 16), "pooled_projections": torch.randn(M, 16)}
    if model.branches == 2:
        cond.update(negative_encoder_hidden_states=torch.randn(M, txt, 16),
                    negative_pooled_projections=torch.randn(M, 16))
sigma = torch.rand(M) * 0.9 + 0.05
with torch.no_grad():
    model(x[:2], sigma[:2], **{k: v[:2] for k, v in cond.items()})
    base = rss()
    model(x, sigma, **cond)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
from specforest import memory
declared = memory.row_bytes_of(model, x[:1], {k: v[:1] for k, v in cond.items()})
print(json.dumps({"grown": peak - base, "declared": declared}))
"""

_ROUND_PROBE = r"""
import json, sys, torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
import specforest
from specforest import trees
from specforest.models import GaussianMixture
torch.set_num_threads(1)
a = json.loads(sys.argv[1])
gmm = GaussianMixture.paper(dim=a["dim"])
x = specforest.streams.randn(0, torch.arange(a["B"]), (a["dim"],))

class Live(TorchDispatchMode):
    # the bytes of every storage an op made that is still alive, after each op
    def __init__(self):
        super().__init__()
        self.live, self.peak = {}, 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor):
                st = o.untyped_storage()
                self.live.setdefault(st.data_ptr(), (StorageWeakRef(st), st.nbytes()))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out

tree = trees.uniform(a["K"], a["L"])
live = Live()
with live:
    specforest.sample(gmm, x, steps=a["steps"], churn=0.1, seed=0, tree=tree, verify=a["verify"])
print(json.dumps({"peak": live.peak, "V": tree.size, "Vi": tree.size_at_depth(tree.L - 1),
                  "R": tree.verification_budget(a["verify"])}))
"""

_SD3_RUN = r"""
import json, sys, tempfile
from pathlib import Path
import torch
torch.set_num_threads(1)
from specforest.allocator import keep_freed_memory
keep_freed_memory()
sys.path.insert(0, str(Path(sys.argv[2]) / "tests"))
from test_diffusers_sd3 import build_tiny_pipeline
from specforest import diffusers as sd
a = json.loads(sys.argv[1])
pipe = build_tiny_pipeline(Path(tempfile.mkdtemp()))
if a["device"] == "cuda":
    pipe.to("cuda")
    torch.cuda.reset_peak_memory_stats()
res = sd.sample(pipe, ["a photo of a cat"] * a["prompts"], num_inference_steps=a["steps"], K=a["K"], L=a["L"],
                height=a["size"], width=a["size"], max_sequence_length=8, output_type="latent", progress=False,
                generator=torch.Generator().manual_seed(0), max_memory_gb=a["limit_gb"], verify=a["verify"],
                guidance_scale=a["guidance"])
out = {"estimate": res.memory.total_bytes, "max_rows": res.memory.max_rows}
if a["device"] == "cuda":
    out["device_peak"] = torch.cuda.max_memory_allocated()
print(json.dumps(out))
"""


def measure(argv: list, env: "dict | None" = None) -> dict:
    """Run ``argv`` in a fresh process; its peak resident set (:func:`specforest.peak.run_measured`)."""
    run = run_measured(argv, env=env, cwd=ROOT)
    return {"rc": run.returncode, "peak": run.peak_bytes, "stdout": run.stdout, "stderr": run.stderr}


def _estimate_of(run: dict) -> float:
    """The estimated peak a command reports: its JSON record, or its ``memory:`` log line."""
    for line in run["stdout"].splitlines()[::-1]:
        if line.startswith("{"):
            rec = json.loads(line)
            for key in ("memory_estimate_gb", "memory_peak_gb"):
                if key in rec:
                    return float(rec[key]) * 1e9
            if "estimate" in rec:
                return float(rec["estimate"])
    found = re.findall(r"peak ~([0-9.e+-]+) GB", run["stderr"])
    if not found:
        raise RuntimeError(f"no estimate in the output of the command:\n{run['stdout']}\n{run['stderr'][-2000:]}")
    return float(found[-1]) * 1e9


def measure_rounds() -> list:
    """Live tensor bytes of a run at its peak per trajectory, in float32 states of the mixture (d = 500)."""
    rows = []
    for K, L, B, verify in (
        (2, 6, 32, "internal"),
        (3, 6, 8, "internal"),
        (6, 4, 8, "internal"),
        (6, 5, 2, "internal"),
        (6, 5, 2, "drafted"),
        (4, 4, 16, "drafted"),
    ):
        args = {"K": K, "L": L, "B": B, "verify": verify, "dim": 500, "steps": 12}
        res = measure([sys.executable, "-c", _ROUND_PROBE, json.dumps(args)])
        if res["rc"] != 0:
            raise RuntimeError(res["stderr"][-2000:])
        r = json.loads(res["stdout"].splitlines()[-1])
        measured = r["peak"] / (B * 500 * 4)
        model = 6 * r["V"] + 5 * r["Vi"] + r["R"] + 8 + 8 * r["V"] / (500 * 4)
        rows.append({"tree": f"({K}, {L})", "verify": verify, "B": B, **r, "measured": measured, "model": model})
        print(rows[-1], flush=True)
    return rows


def _gmm_case(d: int, c: int, dtype: str) -> tuple:
    return (
        "GaussianMixture",
        f"d = {d}, C = {c}, {dtype}",
        {"model": "gmm", "dim": d, "components": c, "dtype": dtype, "M": 20000},
    )


def _sd3_case(s: int, hd: int, h: int, t: int, g: float, layers: int = 1) -> tuple:
    config = f"{(s // 2) ** 2} image + {t} text tokens, hidden {hd * h} ({h} heads), {layers} layer(s), " + (
        "guidance" if g > 1 else "no guidance"
    )
    args = {"model": "sd3", "size": s, "head_dim": hd, "heads": h, "text": t, "guidance": g, "layers": layers, "M": 400}
    return "FlowMatchVelocity (SD3)", config, args


def _row_cases() -> list:
    gmm, sd3 = _gmm_case, _sd3_case
    return [
        gmm(500, 5, "float32"),
        gmm(500, 20, "float32"),
        gmm(250, 5, "float32"),
        gmm(500, 5, "float64"),
        ("digits velocity (U-Net)", "float32", {"model": "digits", "M": 2048}),
        sd3(8, 8, 2, 16, 1.0),
        sd3(8, 32, 4, 16, 1.0),
        sd3(8, 16, 16, 16, 1.0),
        sd3(16, 32, 4, 16, 1.0),
        sd3(16, 32, 4, 64, 1.0),
        sd3(8, 32, 4, 128, 1.0),
        sd3(8, 32, 4, 16, 7.0),
        sd3(8, 32, 4, 16, 1.0, layers=3),
    ]


def measure_rows() -> list:
    """Per-row cost of each shipped model, measured (slope of the peak between ``M`` and ``2 M`` rows)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    rows = []
    for model, config, args in _row_cases():
        runs = []
        for m in (args["M"], 2 * args["M"]):
            res = measure([sys.executable, "-c", _ROW_PROBE, json.dumps(dict(args, M=m))], env)
            if res["rc"] != 0:
                raise RuntimeError(res["stderr"][-2000:])
            runs.append(json.loads(res["stdout"].splitlines()[-1]))
        per_row = (runs[1]["grown"] - runs[0]["grown"]) / args["M"]
        rows.append({"model": model, "config": config, "measured": per_row, "declared": runs[0]["declared"]})
        print(rows[-1], flush=True)
    return rows


def _commands(tmp: Path) -> list:
    """``(label, limit in GB, argv)`` of every command measured."""
    gmm = ["gmm", "--threads", "1", "--no-progress", "--json"]
    pixel = ["pixel", "--threads", "1", "--no-progress", "--json"]
    out = lambda name: ["--out", str(tmp / f"{name}.npz")]  # noqa: E731
    sd3 = lambda **a: [sys.executable, "-c", _SD3_RUN, json.dumps(dict(device="cpu", **a)), str(ROOT)]  # noqa: E731
    return [
        (
            "gmm full, D-GRS (4, 4), 64 trajectories, drafted",
            1.0,
            [*SPECFOREST, *gmm, "--K", "4", "--L", "4", "--trajectories", "64", "--steps", "10", "--memory-gb", "1.0"],
        ),
        (
            "gmm full, chunked: D-GRS (6, 5), 8 trajectories, drafted",
            0.8,
            [*SPECFOREST, *gmm, "--K", "6", "--L", "5", "--trajectories", "8", "--steps", "10", "--memory-gb", "0.8"],
        ),
        (
            "gmm full, chunked: D-GRS (6, 6), 4 trajectories, drafted (issue 26's tree)",
            2.0,
            [*SPECFOREST, *gmm, "--K", "6", "--L", "6", "--trajectories", "4", "--steps", "8", "--memory-gb", "2"],
        ),
        (
            "gmm full, D-GRS (2, 6), 256 trajectories, internal",
            0.6,
            [
                *SPECFOREST,
                *gmm,
                "--K",
                "2",
                "--L",
                "6",
                "--trajectories",
                "256",
                "--steps",
                "10",
                "--verify",
                "internal",
                "--memory-gb",
                "0.6",
            ],
        ),
        (
            "gmm lazy, D-GRS (6, 6), 30 trajectories",
            0.5,
            [
                *SPECFOREST,
                *gmm,
                "--K",
                "6",
                "--L",
                "6",
                "--trajectories",
                "30",
                "--steps",
                "10",
                "--lazy",
                "--memory-gb",
                "0.5",
            ],
        ),
        (
            "pixel, D-GRS (3, 3), 64 images, drafted",
            0.6,
            [
                *SPECFOREST,
                *pixel,
                "--K",
                "3",
                "--L",
                "3",
                "--samples",
                "64",
                "--steps",
                "20",
                "--verify",
                "drafted",
                "--memory-gb",
                "0.6",
            ],
        ),
        *(
            (
                f"pixel, RMC chain 10, cached draft, 256 images, {name}",
                limit,
                [
                    *SPECFOREST,
                    *pixel,
                    *chain,
                    *("--method", "rmc", "--L", "10", "--draft", "cached", "--samples", "256", "--steps", "6"),
                    *("--verify", "drafted", "--memory-gb", str(limit)),
                ],
            )
            for name, chain, limit in (
                ("em", [], 0.5),
                ("dpm_2_ancestral (two calls a step)", ["--chain", "dpm_2_ancestral", "--schedule", "karras"], 0.7),
            )
        ),
        (
            "generate gmm, D-GRS (4, 4), 128 samples, batch 64",
            0.6,
            [
                *SPECFOREST,
                "generate",
                "gmm",
                "--K",
                "4",
                "--L",
                "4",
                "--count",
                "128",
                "--batch",
                "64",
                "--steps",
                "10",
                "--threads",
                "1",
                "--no-progress",
                "--memory-gb",
                "0.6",
                *out("gen_gmm"),
            ],
        ),
        (
            "generate pixel, D-GRS (3, 3), 64 samples",
            0.6,
            [
                *SPECFOREST,
                "generate",
                "pixel",
                "--K",
                "3",
                "--L",
                "3",
                "--count",
                "64",
                "--steps",
                "20",
                "--verify",
                "drafted",
                "--threads",
                "1",
                "--no-progress",
                "--memory-gb",
                "0.6",
                *out("gen_pixel"),
            ],
        ),
        (
            "generate gmm tree-parallel (2 gloo processes), D-GRS (4, 4), 64 samples",
            0.6,
            [
                *TORCHRUN,
                "generate",
                "gmm",
                "--K",
                "4",
                "--L",
                "4",
                "--count",
                "64",
                "--batch",
                "64",
                "--steps",
                "10",
                "--threads",
                "1",
                "--no-progress",
                "--tree-parallel",
                "--memory-gb",
                "0.6",
                *out("gen_tp"),
            ],
        ),
        (
            "tiny SD3 pipeline, D-GRS (3, 3), 8 images, guidance 7, drafted",
            0.8,
            sd3(prompts=8, steps=8, K=3, L=3, size=16, limit_gb=0.8, verify="drafted", guidance=7.0),
        ),
    ]


def measure_commands() -> list:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, limit, argv in _commands(Path(tmp)):
            res = measure(argv)
            if res["rc"] != 0:
                raise RuntimeError(f"{label} failed:\n{res['stderr'][-3000:]}")
            rows.append({"command": label, "limit": limit * 1e9, "estimate": _estimate_of(res), "peak": res["peak"]})
            print(rows[-1] | {"peak/limit": rows[-1]["peak"] / rows[-1]["limit"]}, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-rounds", action="store_true", help="do not measure a round's live bytes")
    ap.add_argument("--skip-rows", action="store_true", help="do not measure the models' per-row costs")
    ap.add_argument("--skip-commands", action="store_true", help="do not measure the commands")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = ap.parse_args()
    from specforest.experiments.results import machine_line, replace_section

    lines = [
        f"`.venv/bin/python benchmarks/memory.py` on {machine_line()}; every measurement in a fresh process, "
        "one CPU thread.",
    ]
    if not args.skip_rounds:
        rows = measure_rounds()
        lines += [
            "",
            "What a full round holds: the live tensor bytes of a Gaussian-mixture run (d = 500, T = 12) at its "
            "peak, tracked op by op, per trajectory in float32 states, against the model of "
            "`specforest.memory.estimate` (`6 V + 5 V_i + R + 8` states and 8 bytes a node of keys; the tree's "
            "tables are counted apart, per run).",
            "",
            "| tree | verify | trajectories | nodes V | above the last layer V_i | rows R | measured states | model | model / measured |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in rows:
            lines.append(
                f"| {r['tree']} | {r['verify']} | {r['B']} | {r['V']} | {r['Vi']} | {r['R']} | "
                f"{r['measured']:.0f} | {r['model']:.0f} | {r['model'] / r['measured']:.2f} |"
            )
    if not args.skip_rows:
        rows = measure_rows()
        lines += [
            "",
            "Bytes one row adds inside a model call (input excluded, output included): the growth of the peak "
            "resident set between M and 2M rows, over M, with an allocator that returns freed memory at once; "
            "next to it what the model declares (`row_bytes`, read by `specforest.memory.row_bytes_of`).",
            "",
            "| model | configuration | measured per row | declared | declared / measured |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r in rows:
            lines.append(
                f"| {r['model']} | {r['config']} | {r['measured'] / 1e3:.2f} kB | {r['declared'] / 1e3:.2f} kB | "
                f"{r['declared'] / r['measured']:.2f} |"
            )
    if not args.skip_commands:
        rows = measure_commands()
        lines += [
            "",
            "Each command's peak resident set against its limit and the estimate it was sized with "
            "(`specforest.memory.estimate`: the process's memory when the run is sized, the sampler's states at "
            "a round's peak, one sub-batch of target rows, the allocator's slack). The limit bounds the whole "
            "process; the bound the tests hold is peak <= 1.25 x limit.",
            "",
            "| command | limit | estimate | measured peak | peak / limit | peak / estimate |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for r in rows:
            lines.append(
                f"| {r['command']} | {r['limit'] / 1e9:.2f} GB | {r['estimate'] / 1e9:.3f} GB | "
                f"{r['peak'] / 1e9:.3f} GB | {r['peak'] / r['limit']:.2f} | {r['peak'] / r['estimate']:.2f} |"
            )
    text = "\n".join(lines)
    print(text)
    replace_section(args.out, "memory", "## Memory: estimated against measured peak", text)


if __name__ == "__main__":
    main()
