"""``benchmarks/gpu.sh`` (``benchmarks/gpu.py``) without a GPU: its pieces, and its dry run on the CPU.

The GPU run itself needs a CUDA machine; what can be checked here is that its
dry run (the same stages at tiny sizes) runs end to end and writes only its own
blocks of a results file, that its time boxes stop a stage, that its law smoke
test tells a shifted sample from an equal one, that the GPU rows of the
``wallclock`` section survive ``benchmarks/wallclock.py`` rewriting its CPU rows,
and that the scheduler stages (``benchmarks/gpu_schedulers.py``: an SDXL-sized
UNet with Euler ancestral and DPM++ 2M SDE) run at the dry run's sizes and report
their rows, or say why they did not run.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu():
    return _load("gpu")


@pytest.fixture(scope="module")
def wallclock():
    return _load("wallclock")


SECTION = """# results

<!-- other:begin -->
## Other

untouched
<!-- other:end -->

<!-- wallclock:begin -->
## Wall-clock: batch-cost curve, latency and throughput

CPU rows here.

| a | b |
| --- | --- |
| 1 | 2 |

GPU rows (the digits model ...): not measured (no GPU lent to this project's sessions yet).
<!-- wallclock:end -->
"""


def test_gpu_rows_go_inside_the_wallclock_section_and_leave_its_cpu_rows(tmp_path, wallclock):
    path = tmp_path / "RESULTS.md"
    path.write_text(SECTION)
    wallclock.write_gpu_rows(path, "first GPU table")
    text = path.read_text()
    head, block = text.split("<!-- wallclock_gpu:begin -->")
    assert head == SECTION.split("GPU rows (")[0]  # CPU rows as they were; the old placeholder line gone
    assert block.startswith("\n### GPU rows\n\nfirst GPU table\n<!-- wallclock_gpu:end -->\n<!-- wallclock:end -->")
    wallclock.write_gpu_rows(path, "second GPU table")
    text = path.read_text()
    assert text.count("wallclock_gpu:begin") == 1 and "second GPU table" in text and "first" not in text
    assert text.startswith(head)


def test_wallclock_rewriting_its_cpu_rows_carries_the_gpu_rows_over(tmp_path, wallclock):
    from specforest.experiments.results import replace_section

    path = tmp_path / "RESULTS.md"
    path.write_text(SECTION)
    assert "Not measured yet" in wallclock.gpu_rows_block(path)  # no GPU rows yet: the placeholder
    wallclock.write_gpu_rows(path, "the GPU table")
    # what wallclock.py's main does with its new CPU rows
    replace_section(path, "wallclock", "## Wall-clock", "new CPU rows\n\n" + wallclock.gpu_rows_block(path))
    text = path.read_text()
    assert "new CPU rows" in text and "CPU rows here" not in text
    assert text.count("the GPU table") == 1 and "untouched" in text


def test_a_time_box_stops_a_stage_and_is_not_an_ordinary_exception(gpu):
    t0 = time.monotonic()
    with pytest.raises(gpu.TimeBoxExpired):
        try:
            with gpu.time_box(0.2):
                while True:
                    pass
        except Exception:  # what library code on the way may catch: not the box
            pytest.fail("an except Exception caught the time box")
    assert time.monotonic() - t0 < 5.0


def test_run_stages_records_a_stopped_a_failed_and_a_done_stage(gpu):
    def slow(st):
        st.result["partial"] = 1
        while True:
            pass

    def broken(st):
        raise ValueError("bad input")

    def fine(st):
        st.result["value"] = 2

    stages = [gpu.Stage("slow", box=1.0), gpu.Stage("broken", box=1.0), gpu.Stage("fine", box=1.0)]
    gpu.run_stages(stages, {"slow": slow, "broken": broken, "fine": fine}, time.monotonic() + gpu.REPORT_SECONDS + 6)
    assert stages[0].status.startswith("stopped at its time box") and stages[0].result == {"partial": 1}
    assert stages[1].status == "failed: ValueError: bad input"
    assert stages[2].status == "done" and stages[2].result == {"value": 2}


def test_the_law_test_rejects_a_shift_it_is_sized_for_and_accepts_equal_laws(gpu):
    g = torch.Generator().manual_seed(0)
    n = 4000
    a = torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64)
    b = torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64)
    z_crit = float(torch.special.ndtri(torch.tensor(1 - gpu.LAW_ALPHA / 12, dtype=torch.float64)))
    sa, sb = gpu.law_statistics(a), gpu.law_statistics(b)
    assert sa.shape == (n, len(gpu.LAW_STATISTICS))
    assert gpu.two_sample_z(sa, sb).abs().max() < z_crit
    # twice the shift detected half the time, along the lowest cosine mode: the mean brightness
    shift = 2 * z_crit * (2.0 / n) ** 0.5
    shifted = gpu.law_statistics(b + shift / 8.0)  # (0,0) mode: the sum over 64 pixels / 8
    assert gpu.two_sample_z(sa, shifted).abs().max() > z_crit


def test_the_configurations_are_the_released_models(gpu):
    sd3, flux = gpu.SD3_MEDIUM, gpu.FLUX_DEV
    assert sd3["num_layers"] == 24 and sd3["num_attention_heads"] * sd3["attention_head_dim"] == 1536
    assert flux["num_layers"] == 19 and flux["num_single_layers"] == 38
    assert flux["num_attention_heads"] * flux["attention_head_dim"] == 3072
    assert sum(flux["axes_dims_rope"]) == flux["attention_head_dim"]
    specs = {s.key: s for s in gpu.transformer_specs(dry=False)}
    assert specs["sd3-1024"].latent == (16, 128, 128) and specs["sd3-1024"].image_tokens == 4096
    assert specs["flux-512"].latent == (16, 64, 64) and specs["flux-512"].image_tokens == 1024


def test_the_sdxl_unet_is_the_released_one_and_the_shares_fit_the_budget(gpu):
    import diffusers

    sch = gpu.gpu_schedulers
    size = gpu.Plan.full().sdxl.size
    with torch.device("meta"):  # shapes only: no memory, no time
        unet = diffusers.UNet2DConditionModel(**size.unet)
    assert sum(p.numel() for p in unet.parameters()) == 2_567_463_684  # stable-diffusion-xl-base-1.0's UNet
    assert size.unet["cross_attention_dim"] == sum(size.widths) == 768 + 1280 and size.tokens == 77
    assert size.unet["projection_class_embeddings_input_dim"] == 6 * 256 + size.projection
    assert size.latent == (4, 128, 128) and gpu.Plan.dry_run().sdxl.size.latent == (4, 8, 8)
    assert [gpu.Plan.full().sdxl.steps(c) for c in sch.SCHEDULERS] == [30, 25]
    assert all(key in gpu.SHARES for key in sch.STAGES)
    assert sum(gpu.SHARES.values()) + gpu.REPORT_SECONDS <= 450  # the default budget


def test_the_scheduler_stages_run_at_dry_sizes_and_report_their_rows(gpu):
    """Both scheduler stages in their boxes at the dry run's sizes (a few seconds), and the report's rows."""
    sch = gpu.gpu_schedulers
    plan = gpu.Plan.dry_run()
    stages = {name: gpu.Stage(name, box=float(share)) for name, share in plan.shares.items()}
    todo = [stages[key] for key in sch.STAGES]
    fns = {c.key: lambda st, c=c: gpu.stage_scheduler(plan, c, st) for c in sch.SCHEDULERS}
    try:
        gpu.run_stages(todo, fns, time.monotonic() + gpu.REPORT_SECONDS + 120)
    finally:
        sch.release()
    for st in todo:
        assert st.status == "done", st.status  # a failure in the stage is recorded as "failed: ..."
        rows = st.result["rows"]
        assert [r["label"] for r in rows] == ["standard", "RMC chain B=2, secant", "RMC chain B=4, secant"]
        for r in rows:
            assert 1 <= r["nfe"] <= st.result["steps"] == 4 and r["t_over_nfe"] == pytest.approx(4 / r["nfe"])
            assert r["wall_s"] > 0 and r["sampler_ms"] > 0 and r["network_ms"] > 0 and r["speedup"] > 0
        assert st.result["best"] == min(rows[1:], key=lambda r: r["wall_s"])["label"]
    body, _ = gpu.report(plan, stages, 450.0, 1.0, "benchmarks/gpu.sh --dry-run")
    for label in ("Euler ancestral", "DPM++ 2M SDE"):
        (row,) = [line for line in body.splitlines() if line.startswith(f"| {label} | 4 | 4, ")]
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3].startswith("RMC chain B=") and float(cells[5]) > 0 and cells[6].endswith("x")
        assert len([line for line in body.splitlines() if line.startswith(f"| {label} | RMC chain B=")]) == 2


def test_a_scheduler_stage_that_did_not_run_says_why_in_its_row(gpu):
    sch = gpu.gpu_schedulers
    skipped = gpu.Stage(sch.STAGES[0], status="not asked for (--only)")
    failed = gpu.Stage(sch.STAGES[1], status="failed: RuntimeError: CUDA out of memory")
    lines = sch.report_lines(gpu.Plan.full().sdxl, [skipped, failed])
    assert "| Euler ancestral | 30 | not run (not asked for (--only)) | - |" in "\n".join(lines)
    assert "| DPM++ 2M SDE | 25 | not run (failed: RuntimeError: CUDA out of memory) | - |" in "\n".join(lines)
    # the best exact configuration is the one of least wall time, and only an exact one
    runs = {
        "standard": [(2.0, 30, 30, 0.1, 1.9, {})],
        "A": [(3.0, 10, 10, 0.1, 2.9, {})],
        "B": [(1.5, 15, 15, 0, 1, {})],
    }
    rows, best = sch.summarize(runs, 30)
    assert best == "B" and [r["speedup"] for r in rows] == [1.0, 2.0 / 3.0, 2.0 / 1.5]
    assert sch.summarize({"standard": runs["standard"], "A": []}, 30)[1] is None


def test_dry_run_refuses_to_write_the_committed_results(gpu):
    with pytest.raises(SystemExit) as err:
        gpu.main(["--dry-run", "--out", str(BENCH / "RESULTS.md")])
    assert err.value.code == 2


@pytest.mark.slow
def test_the_dry_run_runs_every_stage_and_writes_only_its_blocks(tmp_path, gpu):
    """The whole script, as ``benchmarks/gpu.sh --dry-run`` runs it (about 40 s here)."""
    committed = BENCH / "RESULTS.md"
    before = hashlib.sha256(committed.read_bytes()).hexdigest()
    out, raw = tmp_path / "RESULTS.md", tmp_path / "raw.json"
    original = committed.read_text()
    out.write_text(original)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run(
        [sys.executable, str(BENCH / "gpu.py"), "--dry-run", "--out", str(out), "--json", str(raw)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert hashlib.sha256(committed.read_bytes()).hexdigest() == before
    stages = json.loads(raw.read_text())
    assert {k: v["status"].split(" (")[0] for k, v in stages.items()} == dict.fromkeys(stages, "done")
    law = {r["label"]: r for r in stages["digits-law"]["rows"]}
    assert law["WRONG: chain B=14 accepting every draft"]["rejected"]
    assert not law["D-GRS (2,3)"]["rejected"] and not law["RMC chain B=14"]["rejected"]
    assert [r["label"] for r in stages["digits-syncs"]["rows"]][0] == "standard"
    assert stages["digits-syncs"]["rows"][0]["counted"] == 0  # the standard sampler reads nothing in a round
    nat = stages["natural64"]["rows"]
    assert [r["draft"] for r in nat] == ["standard", "velocity", "cached", "oracle"] * 2
    assert "| natural64 (trained" in run.stdout  # the trained network's rows in the printed section
    for key in ("sd3-512", "sd3-1024", "flux-512", "flux-1024"):
        assert [r["label"].split(",")[0] for r in stages[key]["latency"]["rows"]][:2] == ["standard", "RMC chain B=4"]
    for key, label in (("sdxl-euler-ancestral-1024", "Euler ancestral"), ("sdxl-dpmpp-2m-sde-1024", "DPM++ 2M SDE")):
        rows = stages[key]["rows"]
        assert [r["label"] for r in rows] == ["standard", "RMC chain B=2, secant", "RMC chain B=4, secant"]
        assert all(r["nfe"] >= 1 and r["wall_s"] > 0 and r["sampler_ms"] > 0 for r in rows)
        assert stages[key]["best"] in {r["label"] for r in rows[1:]}
        assert f"| {label} | 4 | 4, " in run.stdout  # its summary row, with numbers, in the printed table
    text = out.read_text()
    # the file outside the two blocks is the committed one: CPU rows untouched
    begin, end = "<!-- wallclock_gpu:begin -->", "<!-- wallclock_gpu:end -->"
    outside = text.split(begin)[0] + text.split(end)[1]
    outside = outside.split("<!-- gpu:begin -->")[0].rstrip()
    kept = original.split("\nGPU rows (")[0] if "\nGPU rows (" in original else original.split(begin)[0]
    assert outside.startswith(kept.rstrip())
    assert gpu.GPU_HEADING in text and "DRY RUN" in text


def test_the_natural_stage_measures_the_trained_network_and_a_wider_one_at_dry_sizes(gpu):
    plan = gpu.Plan.dry_run()
    st = gpu.Stage("natural64")
    gpu.stage_natural(plan, st)
    rows = st.result["rows"]
    nets = sorted({r["network"] for r in rows})
    assert len(nets) == 2 and any("trained" in n for n in nets) and any("RANDOM" in n for n in nets)
    for net in nets:
        mine = [r for r in rows if r["network"] == net]
        assert [r["draft"] for r in mine] == ["standard", "velocity", "cached", "oracle"]
        assert mine[0]["t_per_nfe"] == 1.0 and mine[0]["acceptance"] == []
        assert all(a == 1.0 for a in mine[-1]["acceptance"])  # the target as its own draft
        assert mine[-1]["t_per_nfe"] > 1.0
    assert "natural64" in gpu.SHARES and sum(gpu.SHARES.values()) + gpu.REPORT_SECONDS <= 450
