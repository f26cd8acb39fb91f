"""A full disk at a command's final write (issue 45, item 10): ``gmm``/``pixel --dump-samples`` and
``tune --out`` print their result first, then write atomically; a failed write is a one-line error
naming the flag and the path (no traceback), and leaves nothing behind, not even a temporary file."""

from __future__ import annotations

import errno
import json
import os

import pytest
from helpers import invoke

from specforest import latency
from specforest.latency import CostCurve, Tuned

QUIET = ["--no-progress", "--threads", "1"]


@pytest.fixture
def full_disk(monkeypatch):
    """Every file flushed to disk fails as on a full disk, after its bytes were handed to the file."""

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)


def _failed_write(res, flag: str, path) -> str:
    # a click error ends in SystemExit; an OSError reaching the runner is a traceback
    assert isinstance(res.exception, SystemExit) and res.exit_code == 1, (res.exception, res.output)
    err = " ".join(res.stderr.split())
    assert "Error" in err and flag in err and str(path) in err and os.strerror(errno.ENOSPC) in err, err
    assert "Traceback" not in res.output
    return err


@pytest.mark.parametrize(
    "command",
    [
        ["gmm", "--dim", "2", "--steps", "4", "--trajectories", "2"],
        ["pixel", "--samples", "1", "--steps", "3"],
    ],
)
def test_dump_samples_on_a_full_disk_prints_the_result_and_names_the_path(tmp_path, full_disk, command):
    out = tmp_path / "s.npz"
    res = invoke(*command, *QUIET, "--dump-samples", out)
    _failed_write(res, "--dump-samples", out)
    assert "NFE" in res.stdout and "samples written" not in res.stdout, res.stdout
    assert not any(tmp_path.iterdir())  # no half-written archive, no temporary file
    res = invoke(*command, *QUIET, "--json", "--dump-samples", out)
    _failed_write(res, "--dump-samples", out)
    assert json.loads(res.stdout)["steps"] in (3, 4)
    assert not any(tmp_path.iterdir())


def _tuned() -> Tuned:
    return Tuned(
        label="standard",
        tree=None,
        coupling="grs",
        verify="internal",
        draft="x0",
        batch=1,
        steps=30,
        predicted_seconds_per_image=0.5,
        predicted_speedup=1.0,
        standard_seconds_per_image=0.5,
        predicted_calls=30.0,
        curve=CostCurve((1, 4), (1.0, 2.0)),
        churn=0.1,
    )


def test_tune_on_a_full_disk_prints_its_choice_and_names_the_path(tmp_path, full_disk, monkeypatch):
    # the choice, minutes of measuring, was never printed
    monkeypatch.setattr(latency, "tune", lambda *a, **k: _tuned())
    out = tmp_path / "t.json"
    res = invoke("tune", "--model", "gmm", "--dim", 2, *QUIET, "--out", out)
    err = _failed_write(res, "--out", out)
    assert "chosen: standard" in res.stdout and "wrote" not in res.stdout, res.stdout
    assert "printed above" in err
    assert not any(tmp_path.iterdir())


def test_a_result_that_can_be_written_is_printed_then_written(tmp_path, monkeypatch):
    monkeypatch.setattr(latency, "tune", lambda *a, **k: _tuned())
    out = tmp_path / "t.json"
    res = invoke("tune", "--model", "gmm", "--dim", 2, *QUIET, "--out", out)
    assert res.exit_code == 0, res.output
    assert "chosen: standard" in res.stdout and f"wrote {out}" in res.stdout
    assert json.loads(out.read_text())["label"] == "standard"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]
