"""SamplerOptions is the one list of the sampler's options: checked when made, taken by sample and generate
as an object or as keywords (the same run either way), and the list every other table is keyed by."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import specforest
from specforest import kdiffusion, latency, planning, streams, trees, validation
from specforest.models import GaussianMixture
from specforest.options import RUN_INPUTS, SamplerOptions, TunedFor


@pytest.fixture(scope="module")
def gmm():
    return GaussianMixture.paper(dim=4, components=2, seed=0)


X = streams.randn(0, torch.arange(3), (4,))


def test_an_object_and_keywords_give_the_same_samples(gmm):
    kw = dict(steps=8, churn=0.4, tree=trees.uniform(2, 2), draft="x0", prefetch="parent")
    by_kw = specforest.sample(gmm, X, seed=3, **kw)
    by_obj = specforest.sample(gmm, X, SamplerOptions(**kw), seed=3)
    assert torch.equal(by_kw.samples, by_obj.samples) and by_kw.config == by_obj.config
    assert torch.equal(by_kw.stats.nfe, by_obj.stats.nfe)


def test_keywords_override_the_object(gmm):
    opts = SamplerOptions(steps=8, churn=0.4, tree=trees.uniform(2, 2))
    merged = specforest.sample(gmm, X, opts, seed=1, tree=None)
    standard = specforest.sample(gmm, X, steps=8, churn=0.4, seed=1)
    assert torch.equal(merged.samples, standard.samples) and merged.config["tree"] is None
    assert opts.tree is not None  # the object itself is not changed


def test_a_stateful_draft_is_fresh_in_every_run(gmm):
    opts = SamplerOptions(steps=8, churn=0.4, tree=trees.uniform(2, 2), draft="auto")
    first = specforest.sample(gmm, X, opts, seed=2)
    again = specforest.sample(gmm, X, opts, seed=2)
    assert torch.equal(first.samples, again.samples)


def test_an_adaptive_tree_is_taken_as_given(gmm):
    policy = planning.AdaptiveTree(budget=6, max_depth=3)
    out = specforest.sample(gmm, X, SamplerOptions(steps=8, churn=0.4, tree=policy), seed=0)
    assert out.samples.shape == X.shape


def test_generate_takes_the_object(gmm):
    make_x = lambda i: streams.randn(0, i, (4,))  # noqa: E731
    opts = SamplerOptions(steps=6, churn=0.3, tree=trees.chain(2), coupling="rmc")

    def produced(**kw):
        gen = specforest.generate(gmm, count=4, make_x=make_x, seed=0, **kw)
        return {int(i): s for f in gen for i, s in zip(f.index, f.samples, strict=True)}

    a, b = produced(options=opts), produced(**opts.as_dict())
    assert a.keys() == b.keys() and all(torch.equal(a[i], b[i]) for i in a)
    with pytest.raises(TypeError, match="record_deltas"):
        specforest.generate(gmm, count=1, make_x=make_x, seed=0, options=dataclasses.replace(opts, record_deltas=True))


def test_tuned_for_fills_the_steps_of_keywords_and_checks_an_object(gmm):
    tuned_for = TunedFor(steps=7, batch=3, churn=0.4)
    out = specforest.sample(gmm, X, churn=0.4, seed=0, tuned_for=tuned_for)
    assert out.config["steps"] == 7
    with pytest.raises(ValueError, match=r"steps 8 \(tuned for 7\)"):
        specforest.sample(gmm, X, SamplerOptions(steps=8, churn=0.4), seed=0, tuned_for=tuned_for)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(churn=0.0), ValueError, r"churn must be in \(0, 1\]"),
        (dict(churn=0.5, steps=0), ValueError, "steps must be >= 1"),
        (dict(churn=0.5, steps=True), TypeError, "steps must be an int"),
        (dict(churn=0.5, prefetch="first"), ValueError, "prefetch must be one of"),
        (dict(churn=0.5, verify="all"), ValueError, "verify must be one of"),
        (dict(churn=0.5, grid="cosine"), ValueError, "grid must be one of"),
        (dict(churn=0.5, max_rows=0), ValueError, "max_rows"),
        (dict(churn=0.5, lazy=1), TypeError, "lazy must be a bool"),
        (dict(churn=0.5, record_deltas="no"), TypeError, "record_deltas must be a bool"),
        (dict(churn=0.5, tree="uniform"), TypeError, "tree must be a DraftTree"),
        (dict(churn=0.5, tree=trees.uniform(2, 2), coupling="rmc"), ValueError, "tree: coupling"),
        (dict(churn=0.5, coupling="xyz"), ValueError, "coupling must be one of"),
        (dict(churn=0.5, draft="mu"), ValueError, "draft must be one of"),
        (dict(churn=0.5, model_kwargs=[1]), TypeError, "model_kwargs must be a dict"),
        (dict(churn=0.5, pad_rows=[0]), ValueError, "pad_rows must list ints"),
        (dict(churn=0.5, steps=None), ValueError, "give steps"),
        (dict(churn=0.5, sigmas=torch.linspace(1, 0, 5), steps=3), ValueError, "disagrees"),
    ],
)
def test_bad_options_are_refused_when_made(kwargs, exc, match):
    kwargs = {"steps": 5, **kwargs}
    with pytest.raises(exc, match=match):
        SamplerOptions(**kwargs)


def test_unknown_or_missing_options_are_named():
    with pytest.raises(TypeError, match=r"stepz.*the sampler's options are steps, churn"):
        SamplerOptions.from_kwargs(stepz=5, churn=0.5)
    with pytest.raises(TypeError, match="churn is required"):
        SamplerOptions.from_kwargs(steps=5)
    with pytest.raises(TypeError, match="stepz"):
        specforest.sample(lambda x, s: x, X, stepz=5, churn=0.5)
    with pytest.raises(TypeError, match="options must be a specforest.SamplerOptions"):
        specforest.sample(lambda x, s: x, X, {"steps": 5, "churn": 0.5})


def test_options_are_frozen_and_keep_their_values():
    tree = trees.uniform(2, 2)
    opts = SamplerOptions(steps=5, churn=0.5, tree=tree, draft="auto")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.steps = 6  # type: ignore[misc]
    assert opts.tree is tree and opts.draft == "auto"
    assert opts.as_dict()["tree"] is tree and set(opts.as_dict()) == set(SamplerOptions.names())


def test_every_table_of_options_is_keyed_by_the_fields():
    names = SamplerOptions.names()
    keywords = [p.name for p in inspect.signature(specforest.sample).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert keywords == list(RUN_INPUTS)
    assert list(latency.SAMPLE_OPTIONS) == [*names, *RUN_INPUTS]
    assert set(kdiffusion.speculative._PASSED) | set(kdiffusion.speculative._GIVEN_OTHERWISE) | {
        "callback",
        "tuned_for",
    } == {
        *names,
        *RUN_INPUTS,
    }
    assert specforest.SamplerOptions is SamplerOptions and "engine" not in specforest.__all__


def test_the_shared_checks():
    assert validation.working_dtype(torch.float16) == torch.float32
    assert validation.working_dtype(torch.float64) == torch.float64
    assert validation.check_seed(3) == 3
    with pytest.raises(TypeError, match="seed must be an int"):
        validation.check_seed(True)
    with pytest.raises(FloatingPointError, match="refusing to return it"):
        validation.refuse_non_finite(True)
    assert validation.check_indices("indices", []).tolist() == []
    assert validation.check_indices("indices", [2, 0]).dtype == torch.long
    for bad, match in (([-1], "non-negative"), ([[1]], "1-D sequence"), ([1.5], "integers"), ("ab", "integers")):
        with pytest.raises(ValueError, match=f"indices must .*{match}"):
            validation.check_indices("indices", bad)
    with pytest.raises(ValueError, match="must not repeat"):
        validation.check_indices("indices", [1, 1], unique=True)
    with pytest.raises(ValueError, match="sample_index must be 2 integers"):
        validation.check_indices("sample_index", [0, 1, 2], length=2)
