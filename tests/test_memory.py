"""The memory limit holds: every command's measured peak against its limit and its estimate.

Each run is a fresh process (``os.wait4``'s ``ru_maxrss``: the peak resident
set, a launcher's waited workers included; on CUDA a child reports
``torch.cuda.max_memory_allocated``). It is started and waited for by a small
launcher (:func:`specforest.peak.run_measured`), not by the test process itself:
a child of a 2.5 GB test process would report at least 2.5 GB whatever it held. The limit bounds the whole process: the
interpreter, torch and the model count toward it, as the estimate's fixed bytes
(:func:`specforest.memory.resolve_limit`), so nothing is subtracted from the
measured peak. Two bounds per run:

* ``peak <= 1.25 x limit`` (the issue's bound);
* ``peak <= (1 + MARGIN) x estimate``: the estimate the run was sized with is
  not below what it reached by more than ``MARGIN``.

Two deliberately wrong memory models run the same way and break the first
bound: the estimate without the round's own arithmetic (one float32 state per
realized node, the old model) and without the network's declared per-row cost.
Limits of 0.5-2 GB and runs of a few seconds: the machine is shared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specforest import chains, memory, trees
from specforest.experiments import gmm as gmm_exp
from specforest.peak import run_measured

ROOT = Path(__file__).resolve().parent.parent
BOUND = 1.25
MARGIN = 0.10
"""How far a measured peak may exceed the estimate (at most 8% over in ``benchmarks/memory.py``'s table)."""

ENV = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))

# a command line in a fresh process, optionally with a wrong memory model patched in first
_CLI_CHILD = r"""
import json, sys
a = json.loads(sys.argv[1])
from specforest import memory
if a.get("wrong") == "no_round_arithmetic":
    # the old model: one float32 state per realized node, two per row, nothing for the round's
    # own arithmetic, its keys or the allocator
    memory._NODE_STATES, memory._INNER_STATES, memory._ROW_STATES, memory._KEY_BYTES = 1, 0, 2, 0
    memory.allocator_slack = lambda dynamic, device="cpu": 0
    memory._dynamic_room = lambda room, device: max(room, 0)
if a.get("wrong") == "no_row_bytes":
    # the network's activations ignored: every row counted as a few states
    import specforest.experiments.pixel.run as pixel_run
    memory.row_bytes_of = lambda *args, **kw: None
    pixel_run.ROW_BYTES = 3 * 64 * 4
if a.get("wrong") == "memory_draft_as_lazy":
    # a draft that remembers its chain sized as the lazy run the command asked for
    estimate = memory.estimate
    memory.estimate = lambda **kw: estimate(**{**kw, "lazy": True, "draft": None})
from specforest.cli import main
main(a["argv"], prog_name="specforest")
"""

# the resident bytes a fresh process gives back when it frees 16 blocks of 16 MiB, with glibc's
# defaults or after keep_freed_memory (the module loaded alone: no torch, a small process)
_FREE_CHILD = r"""
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("allocator", sys.argv[1])
allocator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(allocator)
kept = allocator.keep_freed_memory() if sys.argv[2] == "keep" else None

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

blocks = [bytearray(16 << 20) for _ in range(16)]  # zero-filled: resident
peak = resident()
del blocks
print(json.dumps({"kept": kept, "released": peak - resident()}))
"""

_SD3_CHILD = r"""
import json, sys, tempfile
from pathlib import Path
import torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[2])
from test_diffusers_sd3 import build_tiny_pipeline
from specforest import diffusers as sd
a = json.loads(sys.argv[1])
device = "cuda" if torch.cuda.is_available() else "cpu"
pipe = build_tiny_pipeline(Path(tempfile.mkdtemp()))
if device == "cuda":
    pipe.to(device)
    torch.cuda.reset_peak_memory_stats()
res = sd.sample(pipe, ["a photo of a cat"] * a["images"], num_inference_steps=6, K=3, L=3, height=16, width=16,
                max_sequence_length=8, output_type="latent", progress=False, verify="drafted",
                generator=torch.Generator().manual_seed(0), max_memory_gb=a["limit_gb"])
out = {"memory_estimate_gb": res.memory.total_bytes / 1e9, "max_rows": res.memory.max_rows}
if device == "cuda":
    out["device_peak"] = torch.cuda.max_memory_allocated()
print(json.dumps(out))
"""


def _measure(argv: list) -> dict:
    """Run ``argv`` in a fresh process: exit code, peak bytes, the last JSON line of stdout, stderr."""
    run = run_measured(argv, env=ENV, cwd=ROOT)
    stdout, stderr, returncode, maxrss_bytes = run.stdout, run.stderr, run.returncode, run.peak_bytes
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    rec = json.loads(lines[-1]) if lines else None
    peak = maxrss_bytes
    if rec is not None and "device_peak" in rec:
        peak = rec["device_peak"]  # on CUDA the limit bounds the device's allocated memory
    return {"rc": returncode, "peak": peak, "record": rec, "stderr": stderr}


def _cli(argv: list, wrong: "str | None" = None) -> dict:
    return _measure([sys.executable, "-c", _CLI_CHILD, json.dumps({"argv": argv, "wrong": wrong})])


def _estimate(run: dict) -> float:
    rec = run["record"]
    if rec is not None:
        return 1e9 * rec.get("memory_estimate_gb", rec.get("memory_peak_gb"))
    # generate logs the estimate it sized its slots with
    line = [s for s in run["stderr"].splitlines() if s.startswith("memory:")][-1]
    return 1e9 * float(line.split("peak ~")[1].split(" GB")[0])


def _holds(run: dict, limit_gb: float) -> None:
    assert run["rc"] == 0, run["stderr"][-3000:]
    peak, est, limit = run["peak"], _estimate(run), limit_gb * 1e9
    assert peak <= BOUND * limit, f"peak {peak / 1e9:.3f} GB > {BOUND} x limit {limit_gb} GB"
    assert peak <= (1 + MARGIN) * est, f"peak {peak / 1e9:.3f} GB above the estimate {est / 1e9:.3f} GB"
    assert est <= limit


GMM = ["gmm", "--threads", "1", "--no-progress", "--json", "--steps", "10"]
PIXEL = ["pixel", "--threads", "1", "--no-progress", "--json", "--steps", "6", "--verify", "drafted"]


@pytest.mark.slow
def test_gmm_full_chunked_run_holds_and_the_old_model_does_not():
    argv = [*GMM, "--K", "6", "--L", "4", "--trajectories", "24", "--verify", "internal", "--memory-gb", "0.6"]
    run = _cli(argv)
    _holds(run, 0.6)
    assert run["record"]["chunks"] > 1 and run["record"]["mode"] == "full"
    # the same command sized without the round's own arithmetic runs everything at once and breaks the bound
    wrong = _cli(argv, wrong="no_round_arithmetic")
    assert wrong["rc"] == 0 and wrong["record"]["chunks"] == 1
    assert wrong["peak"] > BOUND * 0.6e9


@pytest.mark.slow
def test_gmm_full_run_in_one_chunk_holds():
    run = _cli([*GMM, "--K", "4", "--L", "4", "--trajectories", "32", "--memory-gb", "1.0"])
    _holds(run, 1.0)
    assert run["record"]["chunks"] == 1


def test_gmm_lazy_run_holds():
    run = _cli([*GMM, "--K", "6", "--L", "6", "--trajectories", "30", "--lazy", "--memory-gb", "0.5"])
    _holds(run, 0.5)
    assert run["record"]["mode"] == "lazy"


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["memory", "secant", "picard", "cached", "corrected"])
def test_gmm_memory_draft_run_holds_and_the_lazy_estimate_does_not(draft):
    """``--lazy`` with a draft that remembers its chain runs full (it remembers every node of its
    chain) and keeps a state per node (``secant``: two, the state beside its prediction); so does
    one that refines its chain with Picard sweeps (two states a node, the sweep's evaluations and
    its redrafted chain): sized so, the run holds; sized as the lazy run asked for, it does not."""
    argv = [*GMM, "--method", "rmc", "--L", "10", "--draft", draft, "--lazy"]
    argv += ["--dim", "20000", "--trajectories", "96", "--memory-gb", "0.7"]
    run = _cli(argv)
    _holds(run, 0.7)
    assert run["record"]["mode"] == "full" and run["record"]["chunks"] > 1
    wrong = _cli(argv, wrong="memory_draft_as_lazy")
    assert wrong["rc"] == 0 and wrong["record"]["chunks"] == 1
    assert wrong["peak"] > BOUND * 0.7e9


@pytest.mark.slow
@pytest.mark.parametrize(
    "chain, limit_gb",
    [([], 0.5), (["--chain", "dpm_2_ancestral", "--schedule", "karras"], 0.7)],
    ids=["em", "two_calls"],
)
def test_pixel_cached_draft_run_holds(chain, limit_gb):
    """The cached self-draft on digits keeps 2048 feature numbers a row (32 times the state): every
    evaluated row's in the call and in the round, and each remembered node's (three copies at the
    round's commit); on a chain of two calls a step, one set a call. Sized with them, a chain run whose
    calls the limit splits stays under its estimate and the limit."""
    argv = [*PIXEL, *chain, "--method", "rmc", "--L", "10", "--draft", "cached", "--samples", "256"]
    argv += ["--memory-gb", str(limit_gb)]
    run = _cli(argv)
    _holds(run, limit_gb)
    assert run["record"]["max_rows"] is not None  # the limit splits the calls
    assert run["record"]["mode"] == "full"


@pytest.mark.slow
def test_pixel_run_holds_and_the_estimate_without_row_bytes_does_not():
    argv = [*PIXEL, "--K", "4", "--L", "3", "--samples", "64", "--memory-gb", "0.5"]
    run = _cli(argv)
    _holds(run, 0.5)
    assert run["record"]["max_rows"] is not None  # the limit splits the network's calls
    wrong = _cli(argv, wrong="no_row_bytes")
    assert wrong["rc"] == 0 and wrong["record"]["max_rows"] is None
    assert wrong["peak"] > BOUND * 0.5e9


@pytest.mark.slow
def test_tiny_sd3_pipeline_holds():
    run = _measure([sys.executable, "-c", _SD3_CHILD, json.dumps({"images": 8, "limit_gb": 0.8}), str(ROOT / "tests")])
    _holds(run, 0.8)


@pytest.mark.slow
def test_generate_tree_parallel_holds(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    args = ["generate", "gmm", "--K", "4", "--L", "4", "--count", "64", "--batch", "64", "--steps", "8"]
    run = _measure(
        [*torchrun, "-m", "specforest", *args, "--threads", "1", "--no-progress", "--tree-parallel"]
        + ["--memory-gb", "0.6", "--out", str(tmp_path / "tp.npz")]
    )
    _holds(run, 0.6)


@pytest.mark.slow
def test_generate_holds_with_fewer_slots(tmp_path):
    args = ["generate", "gmm", "--K", "4", "--L", "4", "--count", "96", "--batch", "96", "--steps", "8"]
    run = _measure(
        [sys.executable, "-m", "specforest", *args, "--threads", "1", "--no-progress", "--memory-gb", "0.5"]
        + ["--out", str(tmp_path / "g.npz")]
    )
    _holds(run, 0.5)
    assert "chunk(s) of <= " in run["stderr"]


@pytest.mark.slow
def test_the_issues_run_fits_its_default_limit_or_is_refused():
    # specforest gmm --method dgrs --K 6 --L 6 --trajectories 30, full mode: sized, not run (12 GB)
    setting = gmm_exp.GMMSetting(trajectories=30)
    limit, source, fixed = memory.resolve_limit(None, "cpu")
    tree = trees.uniform(6, 6)
    try:
        m = memory.estimate(
            trajectories=30,
            state_numel=500,
            tree=tree,
            verify="drafted",
            steps=30,
            history=0,
            stages=1,
            model=setting.mixture(),
            fixed_bytes=fixed,
            limit_bytes=limit,
            limit_source=source,
        )
    except MemoryError as e:
        assert "does not fit" in str(e) and source in str(e)
    else:
        assert m.total_bytes <= limit and m.chunk < 30  # chunked to fit, where it ran all 30 at once before
    # the same tree under a small limit: run for real, one trajectory per chunk
    run = _cli([*GMM, "--K", "6", "--L", "6", "--trajectories", "2", "--steps", "8", "--memory-gb", "1.6"])
    _holds(run, 1.6)
    assert run["record"]["chunk_size"] == 1
    # and under one that a trajectory cannot fit: refused before sampling, with the numbers
    refused = _cli([*GMM, "--K", "6", "--L", "6", "--trajectories", "2", "--memory-gb", "0.5"])
    assert refused["rc"] != 0 and refused["peak"] < 0.5e9
    msg = " ".join(refused["stderr"].split())
    for part in ("does not fit the memory limit of 0.5 GB (--memory-gb 0.5)", "needs about", "already holds", "--lazy"):
        assert part in msg, msg


def test_model_declarations_are_measured_figures():
    """The declared row costs against a measurement in this process (output included, input excluded)."""
    from specforest.models import GaussianMixture

    gmm = GaussianMixture.paper(dim=500, components=5)
    x = torch.zeros(1, 500)
    assert memory.row_bytes_of(gmm, x) == (2 * 500 + 7 * 5) * 4
    assert memory.row_bytes_of(gmm, x.double()) == (2 * 500 + 7 * 5) * 8
    assert memory.row_bytes_of(object(), x) is None
    with pytest.raises(TypeError, match="row_bytes must be an int"):
        memory.row_bytes_of(type("M", (), {"row_bytes": 1.5})(), x)


def test_a_peak_is_the_commands_own_not_its_parents():
    """A child started straight from a large process reports the parent's peak (vfork, and ``ru_maxrss``
    survives ``execve``); behind :func:`run_measured`'s launcher it reports its own."""
    big = bytearray(1_000_000_000)
    big[::4096] = b"\x01" * len(range(0, len(big), 4096))  # resident: 1 GB in this process
    child = [sys.executable, "-c", "x = bytearray(100_000_000); x[::4096] = b'1' * len(range(0, len(x), 4096))"]
    run = run_measured(child)
    assert run.returncode == 0 and 100e6 <= run.peak_bytes < 300e6, run.peak_bytes
    proc = subprocess.Popen(child)
    _, _, usage = os.wait4(proc.pid, 0)
    assert usage.ru_maxrss * 1024 > 1e9  # the wrong way: the parent's gigabyte
    del big
    with pytest.raises(TypeError, match="argv must be a non-empty sequence of str"):
        run_measured("python -c pass")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc thresholds")
def test_keep_freed_memory_keeps_freed_heap_blocks_resident():
    """After :func:`specforest.allocator.keep_freed_memory` a process keeps the blocks under 32 MiB it
    frees for reuse; with glibc's defaults each is mapped and unmapped, so the next round pays its page
    faults again."""

    def released(mode: str) -> dict:
        path = ROOT / "src" / "specforest" / "allocator.py"
        res = subprocess.run([sys.executable, "-c", _FREE_CHILD, str(path), mode], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)

    freed = 16 * 16 << 20
    kept = released("keep")
    if not kept["kept"]:
        pytest.skip("no glibc mallopt here: keep_freed_memory changes nothing")
    assert kept["released"] <= 0.1 * freed, kept
    default = released("default")
    assert default["released"] >= 0.9 * freed, default  # the behaviour it replaces: every block goes back


@pytest.mark.parametrize("history", [1, 2])
def test_a_multistep_chain_counts_the_predictions_it_carries(history):
    """A chain of history h (DPM++ 2M SDE: 1, 3M SDE: 2) keeps h predictions per state, and a full
    round each inner node's prediction and its h carried ones."""
    kw = dict(trajectories=4, state_numel=1000, tree=trees.uniform(2, 3), steps=20, limit_bytes=10**12, stages=1)
    plain, carried = memory.estimate(**kw, history=0), memory.estimate(**kw, history=history)
    inner = trees.uniform(2, 3).size_at_depth(2)
    assert carried.trajectory_bytes - plain.trajectory_bytes == 1000 * 4 * (history + (1 + history) * inner)
    lazy = memory.estimate(**kw, lazy=True, history=history).trajectory_bytes
    assert lazy - memory.estimate(**kw, lazy=True, history=0).trajectory_bytes == 1000 * 4 * history
    with pytest.raises(ValueError, match="history"):
        memory.estimate(**kw, history=-1)


def test_a_chain_of_two_stages_counts_what_its_later_call_holds():
    """A chain of s stages (Heun: 2) holds, per evaluated row, its earlier stages' predictions, the stage
    point, the weighted sum and the call's output while the later calls run: ``s + 2`` states a row."""
    kw = dict(trajectories=4, state_numel=1000, tree=trees.uniform(2, 3), steps=20, limit_bytes=10**12, history=0)
    plain, staged = memory.estimate(**kw, stages=1), memory.estimate(**kw, stages=2)
    rows = trees.uniform(2, 3).size_at_depth(2)  # verify="internal": the inner nodes are evaluated
    assert staged.trajectory_bytes - plain.trajectory_bytes == 1000 * 4 * 4 * rows
    with pytest.raises(ValueError, match="stages"):
        memory.estimate(**kw, stages=0)


def test_run_shape_reads_what_the_options_decide():
    """memory.run_shape(options): the tree, verification, lazy, draft, the grid's steps and the chain's
    carried prediction, as estimate's keywords; the same estimate as given by hand."""
    from specforest import SamplerOptions

    tree = trees.uniform(2, 3)
    grid = torch.linspace(0.9, 0.0, 13)  # (a VE chain needs a first level below t = 1)
    opts = SamplerOptions(sigmas=grid, chain="dpmpp_2m_sde", tree=tree, verify="drafted", lazy=True)
    shape = memory.run_shape(opts)
    assert shape == dict(tree=tree, verify="drafted", lazy=True, draft="velocity", steps=12, history=1, stages=1)
    heun = memory.run_shape(SamplerOptions(sigmas=grid, chain=chains.HeunChurn(s_churn=5.0), tree=tree))
    assert heun["stages"] == 2 and heun["history"] == 0
    em = memory.run_shape(SamplerOptions(sigmas=torch.linspace(1, 0, 6), churn=0.5))
    assert em["steps"] == 5 and em["history"] == 0 and em["tree"] is None
    kw = dict(trajectories=4, state_numel=64, limit_bytes=10**9, fixed_bytes=0)
    by_hand = memory.estimate(**kw, tree=tree, verify="drafted", lazy=True, steps=12, history=1, stages=1)
    assert memory.estimate(**kw, **shape) == by_hand
    # the carried prediction is counted: the same run of the em chain holds less
    assert memory.estimate(**kw, **{**shape, "history": 0}).total_bytes < by_hand.total_bytes


def test_the_corrected_draft_counts_its_pairs():
    """``draft="corrected"`` keeps, per remembered chain node, the cached draft's prediction and deep
    features, the node's state with the secant draft's gains (it reads the remembered states), and its
    pair's: one more state (the offset) and one more row of deep features a node."""
    from specforest.models import GaussianMixture

    gmm = GaussianMixture.paper(dim=1000, components=5, seed=0)  # 5 features a row: the responsibilities
    kw = dict(trajectories=4, state_numel=1000, tree=trees.chain(6), steps=20, limit_bytes=10**12, model=gmm)
    kw.update(history=0, stages=1)
    cached, corrected = (memory.estimate(**kw, draft=d).trajectory_bytes for d in ("cached", "corrected"))
    gains = 2 * 8 * 20  # two float64 sums a step
    assert corrected - cached == 3 * 6 * (2 * 1000 + 5) * 4 + gains  # (three copies at the round's commit)


@pytest.mark.parametrize(
    "chain, options, shape",
    [
        ("dpm_2_ancestral", {"schedule": "karras"}, dict(history=0, stages=2)),
        ("dpmpp_3m_sde", {"schedule": "karras"}, dict(history=2, stages=1)),
        ("em", {}, dict(history=0, stages=1)),
    ],
)
@pytest.mark.parametrize("command", ["pixel", "gmm"])
def test_the_experiments_size_their_runs_with_the_chains_history_and_stages(
    command, chain, options, shape, monkeypatch
):
    """``specforest pixel`` and ``specforest gmm`` size a run with its chain's declarations: a chain of two
    calls a step or two carried predictions holds more a row than the em chain (the estimate was once
    made as if every chain were em, and a two-call run reached 1.11 x its estimate)."""
    from specforest.experiments import pixel as pixel_exp

    seen = []
    estimate = memory.estimate
    monkeypatch.setattr(memory, "estimate", lambda **kw: seen.append(kw) or estimate(**kw))
    kw = dict(method="rmc", K=1, L=3, seed=0, chain=chain, churn=0.1 if chain == "em" else None, options=options)
    if command == "pixel":
        rec = pixel_exp.simulate(samples=2, steps=6, **kw).record
    else:
        setting = gmm_exp.GMMSetting(dim=4, steps=6, trajectories=2, chain=kw.pop("chain"), churn=kw.pop("churn"))
        rec = gmm_exp.run_config(setting, **kw)
    assert rec["chain"] == chain and seen
    assert all({k: s[k] for k in shape} == shape for s in seen), [{k: s[k] for k in shape} for s in seen]


STEPS = 12
"""Steps of the live-bytes runs: a chain of 10 nodes, its memory a large share of what they hold."""


def _live_peak_and_estimate(chain: str, options: dict) -> tuple:
    """A cached-draft chain run of digits with its calls split at 100 rows: the peak of its live tensor
    bytes (the profiler's allocation records: deterministic, unlike the resident set) and what its
    estimate holds for the sampler and those rows, beyond the allocator's slack."""
    import dataclasses

    from torch.profiler import ProfilerActivity, profile

    from specforest.experiments import pixel as pixel_exp

    seen = []
    estimate = memory.estimate

    def split(**kw):
        seen.append(dataclasses.replace(estimate(**kw), max_rows=100))
        return seen[-1]

    kw = dict(method="rmc", K=1, L=10, samples=128, steps=STEPS, seed=0, draft="cached", verify="drafted")
    with pytest.MonkeyPatch.context() as mp, profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        mp.setattr(memory, "estimate", split)
        pixel_exp.simulate(**kw, chain=chain, churn=0.1 if chain == "em" else None, options=options)
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    (m,) = seen
    return peak, m.sampler_bytes + 100 * m.row_bytes


@pytest.mark.parametrize(
    "chain, options",
    [("em", {}), ("dpm_2_ancestral", {"schedule": "karras"}), ("dpmpp_3m_sde", {"schedule": "karras"})],
)
def test_a_cached_draft_runs_live_tensors_stay_within_its_estimate(chain, options, monkeypatch):
    """The tensors a cached-draft run holds at once (one set of deep features a call, the draft's memory
    in three copies at the round's commit) are within its estimate before the allocator's slack; the
    estimate that keeps one copy of the memory is below what a two-call run holds."""
    peak, est = _live_peak_and_estimate(chain, options)
    assert peak <= est, (peak, est)
    if chain == "dpm_2_ancestral":
        monkeypatch.setattr(memory, "_MEMORY_COPIES", 1)
        peak_wrong, est_wrong = _live_peak_and_estimate(chain, options)
        assert peak_wrong > est_wrong, (peak_wrong, est_wrong)
