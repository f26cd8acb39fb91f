"""Continuous batching, data-parallel and tree-parallel generation, kill-and-resume (2 gloo processes on CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import specforest
from specforest import distributed, streams, trees
from specforest.cli import main
from specforest.models import GaussianMixture

GMM = ["--dim", "8", "--components", "3", "--steps", "12", "--no-progress"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _gmm64():
    gmm = GaussianMixture.paper(dim=6, components=3, seed=0)
    return lambda x, s, **k: gmm(x.double(), s.double()).to(x.dtype)


def _collect(gen) -> "tuple[dict, dict]":
    samples, nfe = {}, {}
    for f in gen:
        for j, i in enumerate(f.index.tolist()):
            assert i not in samples, "an index finished twice"
            samples[i], nfe[i] = f.samples[j], int(f.stats.nfe[j])
    return samples, nfe


# -- the library: continuous batching -------------------------------------------------------------


@pytest.mark.parametrize("tree", [trees.uniform(2, 3), trees.chain(4), None], ids=["dgrs", "rmc", "standard"])
def test_continuous_batching_gives_each_index_its_own_sample(tree):
    model = _gmm64()

    def mk(i):
        return streams.randn(5, i, (6,), dtype=torch.float64)

    opts = dict(
        steps=12, churn=0.4, tree=tree, coupling="rmc" if tree is not None and tree.max_children == 1 else "grs"
    )
    n = 23
    ref = specforest.sample(model, mk(torch.arange(n)), seed=7, **opts)
    for batch in (1, 4, 64):
        gen = specforest.generate(model, count=n, make_x=mk, seed=7, batch=batch, **opts)
        samples, nfe = _collect(gen)
        assert sorted(samples) == list(range(n))
        got = torch.stack([samples[i] for i in range(n)])
        assert torch.equal(got, ref.samples), batch  # bitwise: float64, batch-invariant model
        assert [nfe[i] for i in range(n)] == ref.stats.nfe.tolist()
        assert 0 < gen.stats.occupancy <= 1 and gen.stats.finished == n
    # a shuffled share of the job reproduces the same samples
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    samples, _ = _collect(specforest.generate(model, indices=order[:9], make_x=mk, seed=7, batch=3, **opts))
    for i in order[:9].tolist():
        assert torch.equal(samples[i], ref.samples[i])


def test_continuous_batching_keeps_slots_fuller_than_fixed_batches():
    model = _gmm64()

    def mk(i):
        return streams.randn(1, i, (6,), dtype=torch.float64)

    opts = dict(steps=20, churn=0.3, tree=trees.uniform(2, 3))
    gen = specforest.generate(model, count=64, make_x=mk, seed=1, batch=8, **opts)
    _collect(gen)
    # fixed batches of 8: each batch runs as long as its slowest trajectory
    fixed_rounds = fixed_busy = 0
    for b in range(8):
        out = specforest.sample(
            model, mk(torch.arange(8 * b, 8 * b + 8)), seed=1, sample_index=torch.arange(8 * b, 8 * b + 8), **opts
        )
        fixed_rounds += out.stats.calls
        fixed_busy += int(out.stats.nfe.sum())
    assert gen.stats.rounds < fixed_rounds
    assert gen.stats.occupancy > fixed_busy / (8 * fixed_rounds)


def test_generate_validates_its_arguments():
    model = _gmm64()
    mk = lambda i: streams.randn(0, i, (6,), dtype=torch.float64)  # noqa: E731
    with pytest.raises(ValueError, match="exactly one of count"):
        specforest.generate(model, make_x=mk, seed=0, steps=5, churn=0.5)
    with pytest.raises(ValueError, match="count must be an int >= 0"):
        specforest.generate(model, count=-1, make_x=mk, seed=0, steps=5, churn=0.5)
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        specforest.generate(model, count=3, make_x=mk, seed=0, batch=0, steps=5, churn=0.5)
    with pytest.raises(ValueError, match="make_x must return"):
        list(specforest.generate(model, count=3, make_x=lambda i: torch.zeros(2, 6), seed=0, steps=5, churn=0.5))
    assert list(specforest.generate(model, count=0, make_x=mk, seed=0, steps=5, churn=0.5)) == []


def test_shard_and_gather_in_one_process():
    assert distributed.shard(5).tolist() == [0, 1, 2, 3, 4]
    idx, vals = distributed.gather(torch.tensor([2, 0, 1]), torch.tensor([[2.0], [0.0], [1.0]]))
    assert idx.tolist() == [0, 1, 2] and vals[:, 0].tolist() == [0.0, 1.0, 2.0]


# -- the command, on one process and on two ----------------------------------------------------------


def _torchrun(n: int, args: list) -> subprocess.CompletedProcess:
    # --standalone: a local rendezvous on a free port
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
    return subprocess.run(cmd + ["-m", "specforest", *args], capture_output=True, text=True, env=ENV, timeout=300)


def _load(path: Path) -> "tuple[dict, dict]":
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    return arrays, json.loads(path.with_suffix(".json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ref.npz"
    res = CliRunner().invoke(main, ["generate", "gmm", *GMM, "--count", "40", "--batch", "6", "--out", str(out)])
    assert res.exit_code == 0, res.output
    return _load(out)


def test_one_process_output(reference):
    arrays, meta = reference
    assert arrays["samples"].shape == (40, 8) and arrays["index"].tolist() == list(range(40))
    assert len(meta["nfe"]) == 40 and meta["options"]["count"] == 40 and meta["specforest_version"]
    assert 0 < meta["occupancy"] <= 1


def test_two_processes_data_parallel_and_tree_parallel_equal_one(reference, tmp_path):
    ref, meta = reference
    for extra in ([], ["--tree-parallel"]):
        out = tmp_path / f"two{len(extra)}.npz"
        res = _torchrun(2, ["generate", "gmm", *GMM, "--count", "40", "--batch", "6", "--out", str(out), *extra])
        assert res.returncode == 0, res.stderr[-3000:]
        arrays, m = _load(out)
        np.testing.assert_allclose(arrays["samples"], ref["samples"], atol=1e-6, rtol=0)
        assert m["nfe"] == meta["nfe"] and m["processes"] == 2
        assert not Path(str(out) + ".parts").exists()


def test_more_processes_than_samples_leaves_ranks_idle(tmp_path):
    out = tmp_path / "few.npz"
    res = _torchrun(3, ["generate", "gmm", *GMM, "--count", "2", "--out", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    arrays, _ = _load(out)
    one = tmp_path / "one.npz"
    assert CliRunner().invoke(main, ["generate", "gmm", *GMM, "--count", "2", "--out", str(one)]).exit_code == 0
    np.testing.assert_array_equal(arrays["samples"], _load(one)[0]["samples"])


def test_tree_parallel_digits_equal_one_process(tmp_path):
    args = ["generate", "pixel", "--steps", "16", "--count", "5", "--batch", "5", "--no-progress"]
    one, two = tmp_path / "one.npz", tmp_path / "two.npz"
    res = CliRunner().invoke(main, [*args, "--out", str(one)])
    assert res.exit_code == 0, res.output
    res = _torchrun(2, [*args, "--out", str(two), "--tree-parallel"])
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = _load(one), _load(two)
    assert a[0]["samples"].shape == (5, 1, 8, 8) and a[0]["labels"].tolist() == b[0]["labels"].tolist()
    np.testing.assert_allclose(b[0]["samples"], a[0]["samples"], atol=1e-5, rtol=0)
    assert a[1]["nfe"] == b[1]["nfe"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_run_resumes_to_the_uninterrupted_output(sig, tmp_path):
    args = ["generate", "gmm", "--dim", "8", "--components", "3", "--steps", "30", "--count", "600", "--batch", "4"]
    ref = tmp_path / "ref.npz"
    assert CliRunner().invoke(main, [*args, "--no-progress", "--out", str(ref)]).exit_code == 0
    out = tmp_path / "killed.npz"
    parts = Path(str(out) + ".parts")
    cmd = [sys.executable, "-m", "specforest", *args, "--no-progress", "--out", str(out)]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if parts.exists() and len(list(parts.glob("shard-*.npz"))) >= 3:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed; make it longer"
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert proc.returncode != 0 and not out.exists()
    if sig == signal.SIGTERM:
        assert not [p for p in parts.iterdir() if p.name.endswith(".tmp")]  # nothing half-written
    shards = list(parts.glob("shard-*.npz"))
    assert shards
    # without --resume the partial job is refused, and left as it is
    res = CliRunner().invoke(main, [*args, "--no-progress", "--out", str(out)])
    assert res.exit_code != 0 and "--resume" in res.output and sorted(parts.glob("shard-*.npz")) == sorted(shards)
    res = CliRunner().invoke(main, [*args, "--no-progress", "--out", str(out), "--resume"])
    assert res.exit_code == 0, res.output
    a, b = _load(out), _load(ref)
    assert a[0]["index"].tolist() == list(range(600))
    np.testing.assert_array_equal(a[0]["samples"], b[0]["samples"])
    assert a[1]["nfe"] == b[1]["nfe"] and not parts.exists()
    # resuming a complete job does nothing
    res = CliRunner().invoke(main, [*args, "--no-progress", "--out", str(out), "--resume"])
    assert res.exit_code == 0 and "complete" in res.output


def test_bad_input_is_refused_and_leaves_nothing(tmp_path):
    out = tmp_path / "x.npz"
    res = CliRunner().invoke(main, ["generate", "gmm", *GMM, "--count", "0", "--out", str(out)])
    assert res.exit_code != 0 and "--count must be >= 1" in res.output
    assert list(tmp_path.iterdir()) == []
    res = CliRunner().invoke(main, ["generate", "gmm", *GMM, "--count", "4", "--out", str(out)])
    assert res.exit_code == 0
    before = sorted(p.name for p in tmp_path.iterdir())
    res = CliRunner().invoke(main, ["generate", "gmm", *GMM, "--count", "4", "--out", str(out)])
    assert res.exit_code != 0 and "exists; pass --resume" in res.output
    res = CliRunner().invoke(main, ["generate", "gmm", *GMM, "--count", "5", "--out", str(out), "--resume"])
    assert res.exit_code != 0 and "options that differ" in res.output and "count: 4 on disk, 5 now" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_resuming_in_the_same_process_never_overwrites_a_shard(tmp_path, monkeypatch):
    """Two interrupted runs in one process (same pid), then a resume: every index once, as uninterrupted."""
    from specforest.experiments import generate as gen_exp

    spec = gen_exp.JobSpec(
        "gmm",
        30,
        2,
        dict(
            method="dgrs",
            K=2,
            L=2,
            steps=10,
            churn=0.3,
            grid="flow_match",
            prefetch="nearest",
            verify="internal",
            draft="velocity",
        ),
        dict(dim=6, components=2, mixture_seed=0),
    )
    ref = gen_exp.run_job(spec, tmp_path / "ref.npz", batch=2)
    assert ref.complete
    real = gen_exp.generate

    def interrupted(*args, **kwargs):
        for k, f in enumerate(real(*args, **kwargs)):
            if k == 4:
                raise KeyboardInterrupt
            yield f

    monkeypatch.setattr(gen_exp, "generate", interrupted)
    out = tmp_path / "job.npz"
    with pytest.raises(KeyboardInterrupt):
        gen_exp.run_job(spec, out, batch=2)
    with pytest.raises(KeyboardInterrupt):
        gen_exp.run_job(spec, out, batch=2, resume=True)
    monkeypatch.setattr(gen_exp, "generate", real)
    res = gen_exp.run_job(spec, out, batch=2, resume=True)
    assert res.complete and res.skipped > 0
    a, b = _load(out), _load(tmp_path / "ref.npz")
    np.testing.assert_array_equal(a[0]["samples"], b[0]["samples"])
    assert a[1]["nfe"] == b[1]["nfe"]


def test_a_generation_leaves_the_callers_grad_mode_alone():
    model = _gmm64()
    gen = specforest.generate(
        model,
        count=3,
        make_x=lambda i: streams.randn(0, i, (6,), dtype=torch.float64),
        seed=0,
        steps=6,
        churn=0.5,
        tree=trees.uniform(2, 2),
    )
    for _ in gen:
        assert torch.is_grad_enabled()


def test_tree_parallel_needs_no_seed_agreement(tmp_path):
    """Each process gives its own seed and states: the first process's are used everywhere."""
    script = tmp_path / "tp.py"
    script.write_text(
        "import torch, specforest, torch.distributed as dist\n"
        "from specforest import distributed, trees\n"
        "from specforest.models import GaussianMixture\n"
        "distributed.init_from_env('cpu')\n"
        "r = dist.get_rank()\n"
        "gmm = GaussianMixture.paper(dim=4, components=2, seed=0)\n"
        "x = torch.randn(5, 4, generator=torch.Generator().manual_seed(r))\n"
        "out = specforest.sample(gmm, x, steps=8, churn=0.5, seed=r, tree=trees.uniform(2, 2), "
        "process_group=dist.group.WORLD)\n"
        "parts = [None, None]\n"
        "dist.all_gather_object(parts, out.samples)\n"
        f"if r == 0: torch.save(parts, {str(tmp_path / 'parts.pt')!r})\n"
        "dist.destroy_process_group()\n"
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = torch.load(tmp_path / "parts.pt")
    assert torch.equal(a, b)
    x0 = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    gmm = GaussianMixture.paper(dim=4, components=2, seed=0)
    one = specforest.sample(gmm, x0, steps=8, churn=0.5, seed=0, tree=trees.uniform(2, 2))
    torch.testing.assert_close(a, one.samples, atol=1e-6, rtol=0)


def test_gather_and_generate_validate_their_inputs():
    with pytest.raises(ValueError, match="one row per index"):
        distributed.gather(torch.tensor([0, 1]), torch.zeros(3, 2))
    idx, vals = distributed.gather([], [])
    assert idx.numel() == 0
    model = _gmm64()
    mk = lambda i: streams.randn(0, i, (6,), dtype=torch.float64)  # noqa: E731
    assert list(specforest.generate(model, indices=[], make_x=mk, seed=0, steps=5, churn=0.5)) == []
    with pytest.raises(ValueError, match="must not repeat"):
        specforest.generate(model, indices=[1, 1], make_x=mk, seed=0, steps=5, churn=0.5)
    with pytest.raises(TypeError, match="model must be callable"):
        specforest.generate(None, count=2, make_x=mk, seed=0, steps=5, churn=0.5)
