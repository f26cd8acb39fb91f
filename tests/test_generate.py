"""Continuous batching, data-parallel and tree-parallel generation, kill-and-resume (2 gloo processes on CPU)."""

from __future__ import annotations

import errno
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import specforest
from specforest import distributed, streams, trees
from specforest.cli import main
from specforest.experiments import generate as gen_exp
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


def _shifted_gmm64():
    """A conditional model: the mixture's data moved by a per-sample ``offset (M, 6)``, whose exact
    velocity at ``x`` is the mixture's at ``x - (1 - sigma) offset``, minus ``offset``."""
    gmm = GaussianMixture.paper(dim=6, components=3, seed=0)

    def velocity(x, s, offset):
        x, s = x.double(), s.double()
        return (gmm(x - (1 - s)[:, None] * offset, s) - offset).to(x.dtype)

    return velocity


@pytest.mark.parametrize(
    "tree, draft", [(trees.uniform(2, 3), "velocity"), (trees.chain(4), "memory")], ids=["dgrs", "rmc-memory"]
)
def test_per_sample_conditioning_follows_each_index_through_refills(tree, draft, monkeypatch):
    """generate's refills give a slot the new sample's conditioning: every sample equals
    ``sample(..., cond=...)``'s bitwise, with trees that take each trajectory a different number of
    rounds, so that slots are refilled (several at once) while the others run on."""
    model = _shifted_gmm64()

    def mk(i):
        return streams.randn(5, i, (6,), dtype=torch.float64)

    def offsets(i):
        # far apart, one per index: a sample run with another index's offset lands elsewhere
        return {"offset": 3.0 * streams.randn(11, i, (6,), dtype=torch.float64)}

    refills: list = []
    set_rows = specforest.target.Target.set_rows
    monkeypatch.setattr(
        specforest.target.Target, "set_rows", lambda t, traj, cond: refills.append(len(traj)) or set_rows(t, traj, cond)
    )
    coupling = "rmc" if tree.max_children == 1 else "grs"
    opts = dict(steps=12, churn=0.4, tree=tree, coupling=coupling, draft=draft)
    n = 23
    ref = specforest.sample(model, mk(torch.arange(n)), seed=7, cond=offsets(torch.arange(n)), **opts)
    assert len(set(ref.stats.nfe.tolist())) > 1  # the trajectories take different numbers of rounds
    gen = specforest.generate(model, count=n, make_x=mk, make_cond=offsets, seed=7, batch=4, **opts)
    samples, nfe = _collect(gen)
    # slots were refilled while others ran, several of them at once at least once
    assert sum(refills) == n - 4 and max(refills) >= 2, refills
    got = torch.stack([samples[i] for i in range(n)])
    assert torch.equal(got, ref.samples)
    assert [nfe[i] for i in range(n)] == ref.stats.nfe.tolist()


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
    # the steps processes take together: in one process, the block's own value or error
    assert distributed.agree("a step", value={"n": 3}) == [{"n": 3}]
    with pytest.raises(OSError, match="full"), distributed.together("a step"):
        raise OSError("disk full")


# -- the command, on one process and on two ----------------------------------------------------------


def _torchrun(n: int, args: list, script: "Path | None" = None, env: "dict | None" = None, timeout: float = 300):
    """``torchrun`` over ``python -m specforest ARGS`` (or ``python SCRIPT ARGS``)."""
    # --standalone: a local rendezvous on a free port
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
    cmd += [str(script)] if script is not None else ["-m", "specforest"]
    # a session of its own, so that a job past its timeout is killed with all its workers
    proc = subprocess.Popen(
        cmd + args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**ENV, **(env or {})},
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


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


@pytest.mark.slow
def test_two_processes_tree_parallel_equal_one(reference, tmp_path):
    # (two data-parallel processes: test_a_merge_failure_on_rank_0_stops_every_rank_and_resumes, whose
    # resume merges the shards they wrote, compares them with the same reference)
    ref, meta = reference
    out = tmp_path / "two.npz"
    res = _torchrun(2, ["generate", "gmm", *GMM, "--count", "40", "--batch", "6", "--out", str(out), "--tree-parallel"])
    assert res.returncode == 0, res.stderr[-3000:]
    arrays, m = _load(out)
    np.testing.assert_allclose(arrays["samples"], ref["samples"], atol=1e-6, rtol=0)
    assert m["nfe"] == meta["nfe"] and m["processes"] == 2
    assert not Path(str(out) + ".parts").exists()


@pytest.mark.slow
def test_more_processes_than_samples_leaves_ranks_idle(tmp_path):
    out = tmp_path / "few.npz"
    res = _torchrun(3, ["generate", "gmm", *GMM, "--count", "2", "--out", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    arrays, meta = _load(out)
    # a data-parallel job that merges: rank 0 writes the output and its JSON, and removes the shards
    assert meta["processes"] == 3 and not Path(str(out) + ".parts").exists()
    one = tmp_path / "one.npz"
    assert CliRunner().invoke(main, ["generate", "gmm", *GMM, "--count", "2", "--out", str(one)]).exit_code == 0
    np.testing.assert_array_equal(arrays["samples"], _load(one)[0]["samples"])


@pytest.mark.slow
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


KILLED = ["generate", "gmm", "--dim", "8", "--components", "3", "--steps", "30", "--count", "600", "--batch", "4"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The uninterrupted output of the job the kill tests interrupt (one run for both signals)."""
    ref = tmp_path_factory.mktemp("uninterrupted") / "ref.npz"
    res = CliRunner().invoke(main, [*KILLED, "--no-progress", "--out", str(ref)])
    assert res.exit_code == 0, res.output
    return ref


@pytest.mark.parametrize(
    "sig", [pytest.param(signal.SIGTERM, marks=pytest.mark.slow), signal.SIGKILL], ids=["SIGTERM", "SIGKILL"]
)
def test_a_killed_run_resumes_to_the_uninterrupted_output(sig, uninterrupted, tmp_path):
    args, ref = KILLED, uninterrupted
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
    # stopped, the holder keeps the job while the others try it (and cannot finish it meanwhile)
    proc.send_signal(signal.SIGSTOP)
    try:
        _a_held_job_is_refused(cmd, proc.pid, parts)
    finally:
        proc.send_signal(sig)
        proc.send_signal(signal.SIGCONT)
    proc.wait(timeout=60)
    assert proc.returncode != 0 and not out.exists()
    if sig == signal.SIGTERM:
        assert not [p for p in parts.iterdir() if p.name.endswith(".tmp")]  # nothing half-written
        assert "--resume" in proc.stderr.read().decode()
    else:
        assert (parts / "lock").exists()  # the holder's record stays behind, its lock went with it
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


def _a_held_job_is_refused(cmd: list, holder: int, parts: Path) -> None:
    """Another process on the job ``cmd`` runs, held by the process ``holder``, is refused at once
    (before it loads the model), naming the holder, and leaves the job's files as they are."""
    before = sorted(p.name for p in parts.iterdir())
    t0 = time.perf_counter()
    res = subprocess.run([*cmd, "--resume"], env=ENV, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - t0
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"held by pid {holder} on " in res.stderr and "--resume" in res.stderr, res.stderr
    # (most of it starts Python and torch; the refusal itself comes before the model is loaded)
    assert seconds < 60, seconds
    # in this process (no start-up): the same refusal, with --resume or without
    for extra in (["--resume"], []):
        t0 = time.perf_counter()
        res = CliRunner().invoke(main, [*cmd[3:], *extra])
        seconds = time.perf_counter() - t0
        assert res.exit_code == 1 and f"held by pid {holder} on " in res.output, res.output
        assert seconds < 10, seconds
    assert sorted(p.name for p in parts.iterdir()) == before


def test_a_job_lock_is_held_once_and_leaves_nothing_where_nothing_was(tmp_path):
    out = tmp_path / "new" / "job.npz"
    first, second = gen_exp.JobLock(out), gen_exp.JobLock(out)
    first.acquire()
    # a lock is its open file's: a second one is refused even in the same process
    with pytest.raises(gen_exp.JobHeldError, match=rf"job.npz is held by pid {os.getpid()} on .* since .*--resume"):
        second.acquire()
    first.release()
    assert not any(tmp_path.iterdir())  # the folders it made, empty, went with it
    second.acquire()
    (second.path.parent / "options.json").write_text("{}")
    second.release()
    second.release()  # (a no-op)
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["job.npz.parts"]
    assert [p.name for p in second.path.parent.iterdir()] == ["options.json"]


@pytest.mark.slow
def test_a_torchrun_launch_on_a_held_job_is_refused_on_every_rank(tmp_path):
    out = tmp_path / "job.npz"
    lock = gen_exp.JobLock(out)
    lock.acquire()
    try:
        res = _torchrun(2, ["generate", "gmm", *GMM, "--count", "4", "--out", str(out)])
    finally:
        lock.release()
    # (torchrun's own report of the failed launch follows the workers' one-line errors)
    assert res.returncode != 0 and f"Error: {out} is held by pid {os.getpid()} on " in res.stderr, res.stderr[-3000:]
    assert "process 1: checking the output failed on process 0 of 2: JobHeldError" in res.stderr
    assert not any(tmp_path.iterdir())


def _interrupt_after(monkeypatch, batches: int) -> None:
    """``run_job``'s generation stops with a KeyboardInterrupt (a Ctrl-C) after ``batches`` finished batches."""
    real = gen_exp.generate

    def interrupted(*args, **kwargs):
        for k, f in enumerate(real(*args, **kwargs)):
            if k == batches:
                raise KeyboardInterrupt
            yield f

    monkeypatch.setattr(gen_exp, "generate", interrupted)


def test_an_interrupt_or_a_full_disk_at_the_merge_names_the_path_and_resume(reference, tmp_path, monkeypatch):
    out = tmp_path / "job.npz"
    parts, meta = Path(str(out) + ".parts"), out.with_suffix(".json")
    job = ["generate", "gmm", *GMM, "--count", "40", "--batch", "6", "--out", str(out)]
    with monkeypatch.context() as m:
        _interrupt_after(m, 3)
        res = CliRunner().invoke(main, job)
    assert res.exit_code == 130 and isinstance(res.exception, SystemExit), res.output
    assert f"interrupted: the finished samples are kept in {parts}" in res.output and "--resume" in res.output
    # the disk fills at the final writes: the output, then its JSON
    for failing, write in ((out, "atomic_write"), (meta, "atomic_write_text")):
        real = getattr(gen_exp, write)

        def full(path, *args, real=real, failing=failing, **kwargs):
            if Path(path) == failing:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(path, *args, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(gen_exp, write, full)
            res = CliRunner().invoke(main, [*job, "--resume"])
        assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
        assert f"could not write {failing}: No space left on device" in res.output, res.output
        assert f"the samples are kept in {parts}" in res.output and "rerun with --resume" in res.output
        assert not out.exists() and not meta.exists() and len(gen_exp.done_indices(out)) == 40
    res = CliRunner().invoke(main, [*job, "--resume"])
    assert res.exit_code == 0, res.output
    np.testing.assert_array_equal(_load(out)[0]["samples"], reference[0]["samples"])


def _flip_last_byte(npz: Path, member: str) -> None:
    """Damage ``member`` of the archive ``npz`` inside (its size and the archive's layout unchanged)."""
    with zipfile.ZipFile(npz) as z:
        info = z.getinfo(member)
    raw = bytearray(npz.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
    raw[info.header_offset + 30 + name_len + extra_len + info.compress_size - 1] ^= 0xFF
    npz.write_bytes(bytes(raw))


def test_a_damaged_shard_or_options_file_is_named_with_what_to_do(reference, tmp_path, monkeypatch):
    out = tmp_path / "job.npz"
    parts = Path(str(out) + ".parts")
    job = ["generate", "gmm", *GMM, "--count", "40", "--batch", "6", "--out", str(out)]
    with monkeypatch.context() as m:
        _interrupt_after(m, 15)
        CliRunner().invoke(main, job)
    first, second = sorted(parts.glob("shard-*.npz"))[:2]  # (of the 40 samples, some 20 finished)
    # cut short (what a full disk or a copy gone wrong leaves), and one byte of the samples flipped
    first.write_bytes(first.read_bytes()[:100])
    _flip_last_byte(second, "samples.npy")
    for shard in (first, second):
        res = CliRunner().invoke(main, [*job, "--resume"])
        assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
        assert f"the shard {shard} cannot be read" in res.output, res.output
        assert "delete it and rerun with --resume" in res.output
        shard.unlink()  # as told
    options = parts / "options.json"
    saved = options.read_text()
    for broken in (saved[: len(saved) // 2], "[]"):
        options.write_text(broken)
        res = CliRunner().invoke(main, [*job, "--resume"])
        assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
        assert f"{options} cannot be read" in res.output and f"delete {parts}" in res.output, res.output
    options.write_text(saved)
    res = CliRunner().invoke(main, [*job, "--resume"])
    assert res.exit_code == 0, res.output
    np.testing.assert_array_equal(_load(out)[0]["samples"], reference[0]["samples"])
    # the JSON that marks the output complete
    meta = out.with_suffix(".json")
    meta.write_text(meta.read_text()[:50])
    res = CliRunner().invoke(main, [*job, "--resume"])
    assert res.exit_code == 1 and f"{meta} cannot be read" in res.output, res.output


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


@pytest.mark.slow
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


# -- a failing job stops everywhere ------------------------------------------------------------------

# the command under a test's hands: a fault chosen by SPECFOREST_FAULT is injected through the model
# callable or the JSON write, and each process records how it ended (an exit code, or its exception)
FAULTY_CLI = """
import os, sys, time
import specforest.models
from specforest.experiments import generate as gen_exp
from specforest.cli import main

fault, rank = os.environ["SPECFOREST_FAULT"], int(os.environ["RANK"])


class Faulty(specforest.models.GaussianMixture):
    calls = 0

    def __call__(self, x, sigma, **kw):
        Faulty.calls += 1
        if fault == "sample" and rank == 1 and Faulty.calls > 12:
            raise RuntimeError("injected model error on rank 1")
        if fault == "sample" and rank == 0 and "--tree-parallel" not in sys.argv:
            # rank 0's share would take minutes: only a stop from outside ends it soon (tree-parallel:
            # it waits for rank 1 inside each round's collective)
            time.sleep(1.0)
        return super().__call__(x, sigma, **kw)

    @classmethod
    def paper(cls, *args, **kwargs):
        if fault == "load" and rank == 1:
            raise OSError("injected: rank 1 cannot load the model")
        return super().paper(*args, **kwargs)


specforest.models.GaussianMixture = Faulty
real_write = gen_exp.atomic_write_text


def write(path, text):
    if fault == "merge" and rank == 0 and path == gen_exp.meta_path(gen_exp.Path(sys.argv[-1])):
        raise OSError("injected: no space left on device while writing the JSON")
    return real_write(path, text)


gen_exp.atomic_write_text = write
end = os.path.join(os.environ["SPECFOREST_ENDS"], f"rank{rank}")
try:
    main(sys.argv[1:], prog_name="specforest")
except SystemExit as e:
    open(end, "w").write(str(e.code))
    raise
except BaseException as e:
    open(end, "w").write(type(e).__name__)
    raise
"""


@pytest.fixture(scope="module")
def faulty_cli(tmp_path_factory) -> Path:
    script = tmp_path_factory.mktemp("faulty") / "faulty_cli.py"
    script.write_text(FAULTY_CLI)
    return script


def _run_faulty(script: Path, fault: str, tmp_path: Path, args: list) -> "tuple[subprocess.CompletedProcess, dict]":
    """Two processes with ``fault``: the result and each process's end.

    A process left waiting for a peer that failed never ends: ``_torchrun``'s timeout fails the test then.
    """
    ends = Path(tempfile.mkdtemp(prefix=f"ends-{fault}-", dir=tmp_path))
    res = _torchrun(2, args, script=script, env={"SPECFOREST_FAULT": fault, "SPECFOREST_ENDS": str(ends)})
    return res, {p.name: p.read_text() for p in ends.iterdir()}


def _no_temporary_files(root: Path) -> bool:
    return not [p for p in root.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    "extra", [[], pytest.param(["--tree-parallel"], marks=pytest.mark.slow)], ids=["data-parallel", "tree-parallel"]
)
def test_a_merge_failure_on_rank_0_stops_every_rank_and_resumes(extra, faulty_cli, reference, tmp_path):
    out = tmp_path / "job.npz"
    args = ["generate", "gmm", *GMM, "--count", "40", "--batch", "6", *extra, "--out", str(out)]
    res, ends = _run_faulty(faulty_cli, "merge", tmp_path, args)
    assert res.returncode != 0 and ends == {"rank0": "1", "rank1": "1"}, (ends, res.stderr[-3000:])
    assert "injected: no space left on device" in res.stderr
    # rank 1 reports the failure of rank 0, not a broken connection
    written = out.with_suffix(".json")
    assert f"process 1: the merge failed on process 0 of 2: OSError: could not write {written}: injected" in res.stderr
    # no output without its JSON, nothing half-written; the shards are all there
    parts = Path(str(out) + ".parts")
    assert not out.exists() and not out.with_suffix(".json").exists() and _no_temporary_files(tmp_path)
    assert len(gen_exp.done_indices(out)) == 40
    # the resume only merges the shards the two processes wrote: they must equal one process's samples
    res = CliRunner().invoke(main, ["generate", "gmm", *GMM, "--count", "40", "--out", str(out), "--resume"])
    assert res.exit_code == 0, res.output
    arrays, meta = _load(out)
    np.testing.assert_allclose(arrays["samples"], reference[0]["samples"], atol=1e-6, rtol=0)
    assert meta["nfe"] == reference[1]["nfe"] and not parts.exists()


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--tree-parallel"]], ids=["data-parallel", "tree-parallel"])
def test_a_model_error_on_rank_1_stops_every_rank_and_resumes(extra, faulty_cli, reference, tmp_path):
    out = tmp_path / "job.npz"
    args = ["generate", "gmm", *GMM, "--count", "40", "--batch", "2", *extra, "--out", str(out)]
    res, ends = _run_faulty(faulty_cli, "sample", tmp_path, args)
    assert res.returncode != 0 and ends.get("rank1") == "RuntimeError", (ends, res.stderr[-3000:])
    assert ends.get("rank0") not in (None, "0"), (ends, res.stderr[-3000:])
    assert "injected model error on rank 1" in res.stderr
    assert not out.exists() and _no_temporary_files(tmp_path)
    done = gen_exp.done_indices(out)
    assert 0 < len(done) < 40  # rank 1 wrote shards before it failed, and the job is not complete
    if not extra:
        # data-parallel, rank 0 sleeps 1 s a call: it was stopped long before it finished its share
        # (every other index, from 0); unstopped, it would have finished it and failed at the merge
        assert len({i for i in done if i % 2 == 0}) < 20, sorted(done)
    res = CliRunner().invoke(main, ["generate", "gmm", *GMM, "--count", "40", "--out", str(out), "--resume"])
    assert res.exit_code == 0, res.output
    arrays, meta = _load(out)
    np.testing.assert_allclose(arrays["samples"], reference[0]["samples"], atol=1e-6, rtol=0)
    assert meta["nfe"] == reference[1]["nfe"]


@pytest.mark.slow
def test_a_complete_job_has_nothing_to_do_and_loads_no_model(faulty_cli, tmp_path, monkeypatch):
    out = tmp_path / "job.npz"
    args = ["generate", "gmm", *GMM, "--count", "3", "--out", str(out)]
    loads = []
    real = gen_exp._model
    monkeypatch.setattr(gen_exp, "_model", lambda *a, **k: loads.append(1) or real(*a, **k))
    assert CliRunner().invoke(main, args).exit_code == 0 and loads == [1]
    res = CliRunner().invoke(main, [*args, "--resume"])
    assert res.exit_code == 0 and "nothing to do" in res.output and loads == [1]
    # two processes, one of which cannot load the model: a complete job never tries
    res, ends = _run_faulty(faulty_cli, "load", tmp_path, [*args, "--resume"])
    assert res.returncode == 0 and ends == {"rank0": "0", "rank1": "0"}, res.stderr[-3000:]
    assert "nothing to do" in res.stderr
    # the same processes on a job still to do: rank 1 fails to load it, and rank 0 stops with it
    fresh = [*args[:-1], str(tmp_path / "fresh.npz")]
    res, ends = _run_faulty(faulty_cli, "load", tmp_path, fresh)
    assert ends == {"rank0": "1", "rank1": "1"}, (ends, res.stderr[-3000:])
    assert "injected: rank 1 cannot load the model" in res.stderr
    assert "process 0: loading the model failed on process 1 of 2: OSError: injected" in res.stderr


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["memory", "secant", "cached"])
@pytest.mark.parametrize("parallel", ["data", "tree"])
def test_the_memory_draft_gives_the_same_samples_on_two_processes(tmp_path, parallel, draft):
    """The memory, secant and cached drafts keep each trajectory's last chain (secant its gains,
    cached the target's features of its nodes, gathered with the velocities) in its own memory
    row: refilled slots, shards (data-parallel) and shared calls (tree-parallel) give every sample
    as one process does."""
    args = ["generate", "gmm", *GMM, "--method", "rmc", "--L", "5", "--draft", draft, "--count", "9", "--batch", "4"]
    one, two = tmp_path / "one.npz", tmp_path / "two.npz"
    res = CliRunner().invoke(main, [*args, "--out", str(one)])
    assert res.exit_code == 0, res.output
    res = _torchrun(2, [*args, "--out", str(two), *(["--tree-parallel"] if parallel == "tree" else [])])
    assert res.returncode == 0, res.stderr[-3000:]
    (a, ma), (b, mb) = _load(one), _load(two)
    np.testing.assert_allclose(b["samples"], a["samples"], atol=1e-6, rtol=0)
    assert mb["nfe"] == ma["nfe"] and mb["processes"] == 2


def test_a_merge_that_finds_samples_missing_names_the_folder_and_resume(tmp_path, monkeypatch):
    """Samples gone from the parts by the merge (a shard removed while the job ran) are named with what to do,
    as a command-line error, not a traceback; ``--resume`` then samples them again."""
    out = tmp_path / "job.npz"
    job = ["generate", "gmm", *GMM, "--count", "8", "--batch", "4", "--out", str(out)]
    real = gen_exp.generate

    class Lost:
        """A run whose finished samples never reach the parts (as if their shards were removed)."""

        def __init__(self, *args, **kwargs) -> None:
            self.run = real(*args, **kwargs)

        def __iter__(self):
            for _ in self.run:
                pass
            return iter(())

        def __getattr__(self, name):
            return getattr(self.run, name)

    with monkeypatch.context() as m:
        m.setattr(gen_exp, "generate", Lost)
        res = CliRunner().invoke(main, job)
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    parts = Path(str(out) + ".parts")
    assert f"8 indices missing from {parts}" in res.output and "rerun with --resume" in res.output, res.output
    assert not out.exists()
    res = CliRunner().invoke(main, [*job, "--resume"])
    assert res.exit_code == 0, res.output
    assert out.exists() and not parts.exists()


def test_a_jobs_chain_of_half_steps_keeps_the_length_asked_for(tmp_path):
    """dpmpp_sde at T = 6 walks 11 half-steps: a job's --method rmc --L 10 drafts a chain of 10, not one cut
    to the grid's 6 steps (the job records L = 10)."""
    from specforest.experiments.generate_model import _tree_kwargs

    sampler = {"method": "rmc", "K": 1, "L": 10, "steps": 6, "chain": "dpmpp_sde", "chain_params": {}}
    assert _tree_kwargs(sampler)["tree"].L == 10
    assert _tree_kwargs({**sampler, "chain": "em", "churn": 0.1, "chain_params": None})["tree"].L == 6
