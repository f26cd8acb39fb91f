"""Row padding for compiled targets: few shapes reach the model, and the samples do not change."""

from __future__ import annotations

import pytest
import torch

import specforest
from specforest import streams, trees
from specforest.models import GaussianMixture


class ShapeRecorder:
    """The mixture's velocity, remembering every batch size it was called with."""

    def __init__(self) -> None:
        self.gmm = GaussianMixture.paper(dim=6, components=3, seed=0)
        self.sizes: set = set()

    def __call__(self, x, sigma, **kw):
        self.sizes.add(x.shape[0])
        return self.gmm(x.double(), sigma.double()).to(x.dtype)


@pytest.mark.parametrize(
    "kw",
    [
        dict(tree=trees.uniform(2, 3)),
        dict(tree=trees.uniform(2, 3), lazy=True),
        dict(tree=trees.chain(5), coupling="rmc", max_rows=5),
        dict(tree=None),
    ],
    ids=["full", "lazy", "chunked-chain", "standard"],
)
@pytest.mark.parametrize("pad", ["pow2", [8, 64]])
def test_padded_calls_see_few_shapes_and_change_no_sample(kw, pad):
    x = streams.randn(3, torch.arange(13), (6,), dtype=torch.float64)
    plain, padded = ShapeRecorder(), ShapeRecorder()
    a = specforest.sample(plain, x, steps=10, churn=0.4, seed=1, **kw)
    b = specforest.sample(padded, x, steps=10, churn=0.4, seed=1, pad_rows=pad, **kw)
    assert torch.equal(a.samples, b.samples) and torch.equal(a.stats.nfe, b.stats.nfe)
    allowed = {2**k for k in range(17)} if pad == "pow2" else set(pad)
    assert padded.sizes <= allowed, padded.sizes
    if kw.get("tree") is not None and not kw.get("lazy"):
        assert not plain.sizes <= allowed  # without padding the model does see other sizes


def test_a_call_larger_than_the_largest_size_is_split():
    rec = ShapeRecorder()
    x = streams.randn(0, torch.arange(20), (6,), dtype=torch.float64)
    specforest.sample(rec, x, steps=6, churn=0.4, seed=0, tree=trees.uniform(2, 2), pad_rows=[16])
    assert rec.sizes == {16}


@pytest.mark.parametrize("bad", ["pow3", [], [0, 4], [2.5], 8])
def test_bad_padding_is_refused_with_the_parameter_named(bad):
    x = torch.zeros(2, 6)
    with pytest.raises(ValueError, match="pad_rows"):
        specforest.sample(ShapeRecorder(), x, steps=4, churn=0.5, seed=0, pad_rows=bad)


def test_the_compile_flag_compiles_the_target_and_pads_its_rows(monkeypatch):
    import json

    from click.testing import CliRunner

    from specforest.cli import main

    calls = []

    def fake_compile(fn, mode=None, **kw):
        # records the mode and the row counts the "compiled" target sees
        sizes: set = set()

        def wrapped(x, sigma, **k):
            sizes.add(x.shape[0])
            return fn(x, sigma, **k)

        wrapped.sizes = sizes
        calls.extend([mode, wrapped])
        return wrapped

    monkeypatch.setattr(torch, "compile", fake_compile)
    args = ["gmm", "--dim", "8", "--steps", "10", "--trajectories", "5", "--K", "2", "--L", "2", "--json"]
    threads = torch.get_num_threads()
    try:
        res = CliRunner().invoke(main, [*args, "--compile", "--threads", "1", "--no-progress"])
        assert res.exit_code == 0, res.output
        rec = json.loads(res.stdout)
        assert rec["compiled"] is True and rec["threads"] == 1 and calls[0] == "reduce-overhead"
        assert calls[1].sizes <= {2**k for k in range(17)}
        plain = json.loads(CliRunner().invoke(main, [*args, "--threads", "1", "--no-progress"]).stdout)
        assert plain["compiled"] is False and plain["nfe_mean"] == rec["nfe_mean"]
    finally:
        torch.set_num_threads(threads)


def test_thread_count_is_chosen_deliberately(monkeypatch):
    from specforest.cli.common import set_threads

    threads = torch.get_num_threads()
    try:
        assert set_threads(1) == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert set_threads(None) == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
        assert set_threads(None) == 1  # the CPUs shared among torchrun's local processes
    finally:
        torch.set_num_threads(threads)
