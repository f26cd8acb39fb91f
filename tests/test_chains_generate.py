"""Every registered chain through ``specforest.generate``: continuous batching equals ``sample``, and two
processes (data-parallel and tree-parallel, gloo on CPU) equal one.

The job (``chains_generate_setup``): 10 indices through 3 slots on a branching tree, each chain at its
stochastic example. One process runs it here; ``torchrun`` runs ``chains_torchrun.py`` for every chain
and both modes in one launch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from chains_generate_setup import COUNT, TIMED, TimedMixture, config, make_x, model, timed_config

from specforest import chains, generate, sample

HERE = Path(__file__).parent


def one_process(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    kw, velocity = (timed_config(), TimedMixture()) if name == TIMED else (config(name), model())
    finished = list(generate(velocity, count=COUNT, make_x=make_x, **kw))
    idx = torch.cat([f.index for f in finished])
    order = idx.argsort()
    return torch.cat([f.samples for f in finished])[order], torch.cat([f.stats.nfe for f in finished])[order].double()


def test_the_timed_job_reads_its_time_inputs():
    """The two-process job's chain with declared time inputs gives other samples than the same chain without
    them (a process that dropped or misplaced its rows' time inputs would not equal one process)."""
    x, _ = one_process(TIMED)
    plain = list(generate(TimedMixture(), count=COUNT, make_x=make_x, **config("dpm_2_ancestral")))
    assert not torch.equal(x, torch.cat([f.samples for f in plain])[torch.cat([f.index for f in plain]).argsort()])


@pytest.mark.parametrize("name", chains.available_chains())
def test_generate_equals_sample_for_every_chain(name):
    """Slots refilled as samples finish: each sample is the one ``sample`` gives its index."""
    x, nfe = one_process(name)
    kw = config(name)
    kw.pop("batch")
    idx = torch.arange(COUNT)
    ref = sample(model(), make_x(idx), sample_index=idx, **kw)
    torch.testing.assert_close(x, ref.samples, rtol=0, atol=1e-12)
    assert torch.equal(nfe, ref.stats.nfe.double())


def test_two_processes_equal_one_for_every_chain(tmp_path):
    """Every chain, and a chain whose calls carry their own time inputs (each process's share of a split
    call gets its rows' own), give on two processes what one gives."""
    out = tmp_path / "two.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    # (the package the test imports, where PYTHONPATH names it, not only an installed one)
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    res = subprocess.run(
        [*cmd, str(HERE / "chains_torchrun.py"), str(out)], capture_output=True, text=True, env=env, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    two = torch.load(out, weights_only=True)
    for name in (*chains.available_chains(), TIMED):
        x, nfe = one_process(name)
        for mode in ("data", "tree"):
            x2, nfe2 = two[f"{name}/{mode}"]
            torch.testing.assert_close(x2, x, rtol=0, atol=1e-12, msg=f"{name} {mode}")
            assert torch.equal(nfe2, nfe), (name, mode)
