"""The drafts that run a network of their own, ``cached`` and ``learned``, through the k-diffusion
drop-ins: a denoiser with ``deep`` and ``shallow`` methods (the digits model's) serves the cached
self-draft there, a draft network is a denoiser called with the model's ``extra_args``, and a run
is bitwise the library's own with the same seed. The law: the chain's closed form on a Gaussian
data law through both drop-ins (the cached draft reading one step too far fails the same check),
and the digits network against the standard drop-in's samples."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats as sps

import specforest
from specforest import chains, kdiffusion, testing, trees
from specforest.couplings import Coupling
from specforest.drafts import CachedDraft, LearnedDraft
from specforest.kdiffusion import linear_grid
from specforest.models import digits
from specforest.models.edm import EDMDenoiserVelocity

DROP_INS = [
    (kdiffusion.sample_euler_ancestral, chains.EulerAncestral()),
    (kdiffusion.sample_dpmpp_2m_sde, chains.DPMPP2MSDE()),
]
DROP_IN_IDS = ["euler_ancestral", "dpmpp_2m_sde"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def den():
    return digits.load_denoiser()


def _karras(n: int) -> torch.Tensor:
    # inside the digits adapter's clipping range [1e-3, 80]: the drop-in's adapter and the library's agree
    return kdiffusion.get_sigmas_karras(n, 0.02, 40.0).double()


def _digits_start(n: int, sig: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    return torch.randn(n, 1, 8, 8, generator=g) * float(sig[0]), labels


# -- the cached self-draft with the digits denoiser ------------------------------------------------


@pytest.mark.parametrize("fn, chain", DROP_INS, ids=DROP_IN_IDS)
def test_the_cached_draft_runs_through_the_drop_ins_cuts_calls_and_is_the_library_run(den, fn, chain):
    """The digits denoiser keeps its deep features through the drop-in: the cached draft's outer-block
    calls replace target calls (fewer than the standard sampler's and the x0 kind's), and the
    samples are, bitwise, ``kdiffusion.sample``'s with the drop-in's chain and
    ``specforest.sample``'s with the same adapter, grid, conditioning and seed (``docs/kdiffusion.md``)."""
    sig = _karras(30)
    x, labels = _digits_start(8, sig)
    extra = dict(extra_args={"class_labels": labels}, row_args=("class_labels",))
    run = dict(tree=trees.chain(8), coupling="rmc", seed=3, disable=True)
    got = fn(den, x, sig, **extra, draft="cached", **run)
    out = kdiffusion.sample(den, x, sig, **extra, chain=chain, draft="cached", **run)
    assert torch.equal(got, out.samples)
    assert out.config["draft"] == "cached" and out.stats.draft_calls > 0
    x0 = kdiffusion.sample(den, x, sig, **extra, chain=chain, draft="x0", **run)
    assert out.stats.calls < x0.stats.calls < 30
    lib = specforest.sample(
        EDMDenoiserVelocity(den, sigma_min=0.5 * float(sig[-2]), sigma_max=2.0 * float(sig[0])),
        x / (1.0 + float(sig[0])),
        sigmas=linear_grid(sig),
        cond={"class_labels": labels},
        chain=chain,
        draft="cached",
        tree=trees.chain(8),
        coupling="rmc",
        seed=3,
    )
    assert torch.equal(lib.samples, out.samples) and torch.equal(lib.stats.nfe, out.stats.nfe)


def test_the_corrected_draft_runs_through_a_drop_in_and_is_the_library_run(den):
    """The corrected draft (cached plus the secant correction, its residual rows in the same calls,
    each trajectory's class label given to both its rows) through ``sample_euler_ancestral``: fewer
    calls than the standard sampler, and bitwise ``specforest.sample``'s run with the same adapter."""
    sig = _karras(30)
    x, labels = _digits_start(8, sig)
    run = dict(tree=trees.chain(8), coupling="rmc", seed=3)
    out = kdiffusion.sample(
        den,
        x,
        sig,
        {"class_labels": labels},
        row_args=("class_labels",),
        chain=chains.EulerAncestral(),
        draft="corrected",
        disable=True,
        **run,
    )
    assert out.config["draft"] == "corrected" and out.stats.draft_calls > 0 and out.stats.calls < 30
    lib = specforest.sample(
        EDMDenoiserVelocity(den, sigma_min=0.5 * float(sig[-2]), sigma_max=2.0 * float(sig[0])),
        x / (1.0 + float(sig[0])),
        sigmas=linear_grid(sig),
        cond={"class_labels": labels},
        chain=chains.EulerAncestral(),
        draft="corrected",
        **run,
    )
    assert torch.equal(lib.samples, out.samples) and torch.equal(lib.stats.nfe, out.stats.nfe)
    # not the cached run: the correction moved the draft's means
    cached = specforest.sample(
        EDMDenoiserVelocity(den, sigma_min=0.5 * float(sig[-2]), sigma_max=2.0 * float(sig[0])),
        x / (1.0 + float(sig[0])),
        sigmas=linear_grid(sig),
        cond={"class_labels": labels},
        chain=chains.EulerAncestral(),
        draft="cached",
        **run,
    )
    assert not torch.equal(cached.samples, lib.samples)


def test_the_cached_draft_through_a_drop_in_reports_its_roots_to_the_callback(den):
    """A callback's ``denoised`` is the model at the reported ``x`` and ``row_sigma``: the target's calls
    that keep features are recorded as the plain ones are, the outer blocks' calls are not."""
    sig = _karras(12)
    x, labels = _digits_start(3, sig)
    seen: list = []
    kdiffusion.sample_euler_ancestral(
        den, x, sig, {"class_labels": labels}, seen.append, True,
        row_args=("class_labels",), tree=trees.chain(4), coupling="rmc", draft="cached", seed=0,
    )  # fmt: skip
    assert seen
    for info in seen:
        live = info["row_sigma"] > 0
        ref = den(info["x"][live], info["row_sigma"][live], class_labels=labels[live])
        torch.testing.assert_close(info["denoised"][live], ref, rtol=1e-5, atol=1e-5)


def _statistics(samples: torch.Tensor) -> np.ndarray:
    s = samples.double()[:, 0]
    tv = (s[:, 1:] - s[:, :-1]).abs().mean((1, 2)) + (s[:, :, 1:] - s[:, :, :-1]).abs().mean((1, 2))
    return torch.stack([s.mean((1, 2)), s.square().mean((1, 2)), tv, s[:, 3:5, 3:5].mean((1, 2))], 1).numpy()


class AcceptEveryDraft(Coupling):
    """A WRONG rule: accepts the first child always (the cached draft's chain, uncorrected)."""

    name = "accept-all"

    def select(self, s_hat, delta, valid, rng):
        P = s_hat.shape[0]
        return torch.ones(P, dtype=torch.bool), torch.zeros(P, dtype=torch.long)


def test_the_cached_draft_keeps_the_digits_law_through_euler_ancestral_and_the_same_check_sees_a_wrong_one(den):
    """Two-sample KS on four statistics of 300 digits (10 Karras steps): the cached RMC chain
    against the standard drop-in passes (smallest p 0.03 against the level 2.5e-4); the same chain
    accepting every cached draft uncorrected fails the same check (p 3e-8)."""
    sig = _karras(10)
    x, labels = _digits_start(300, sig, seed=1)
    extra = dict(extra_args={"class_labels": labels}, row_args=("class_labels",), disable=True)
    ref = _statistics(kdiffusion.sample_euler_ancestral(den, x, sig, **extra, seed=1))
    alpha = 1e-3 / ref.shape[1]

    def min_p(samples: torch.Tensor) -> float:
        return min(sps.ks_2samp(_statistics(samples)[:, j], ref[:, j]).pvalue for j in range(ref.shape[1]))

    spec = dict(tree=trees.chain(6), draft="cached", seed=2)
    assert min_p(kdiffusion.sample_euler_ancestral(den, x, sig, **extra, coupling="rmc", **spec)) > alpha
    assert min_p(kdiffusion.sample_euler_ancestral(den, x, sig, **extra, coupling=AcceptEveryDraft(), **spec)) < alpha


# -- the law in closed form: a Gaussian denoiser with the deep/shallow protocol ---------------------

D = 16
MU = torch.linspace(-2.0, 2.0, D, dtype=torch.float64)
S0 = 1.0
N_LAW = 4000


class GaussianDenoiser:
    """``E[x_0 | x = x_0 + sigma xi]`` for data ``N(MU, S0^2 I)``, with the documented protocol of
    ``draft="cached"`` in the drop-ins: ``deep`` returns the output and its "deep features", here the
    denoised estimate itself, and ``shallow`` returns those features (the prediction frozen at the
    node the features came from). The cached draft then drafts as ``draft="memory"``: a closed form
    for the features' path through the drop-in."""

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        s = sigma.reshape(-1, *[1] * (x.ndim - 1)).to(torch.float64)
        return (MU + S0**2 / (S0**2 + s**2) * (x.to(torch.float64) - MU)).to(x.dtype)

    def deep(self, x: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self(x, sigma)
        return d, d.clone()

    def shallow(self, x: torch.Tensor, sigma: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        return feat.reshape(x.shape).to(x.dtype)


class PeekCached(CachedDraft):
    """The cached draft off by one (as ``tests/test_drafts.py``'s): it reads the features of the
    remembered node one step ahead of the parent, whose state carries the noise the drafted child reuses."""

    name = "peek_cached"

    def mean(self, tab, y, steps, pre, cond, shape, state, memory=None):
        early = None if memory is None else replace(memory, s0=memory.s0 - 1)
        return super().mean(tab, y, steps, pre, cond, shape, state, memory=early)


@pytest.mark.parametrize("fn, chain", DROP_INS, ids=DROP_IN_IDS)
def test_the_cached_draft_through_the_drop_ins_keeps_the_chains_law_and_a_peek_does_not(fn, chain):
    sig = kdiffusion.get_sigmas_karras(20, 0.03, 80.0).double()
    x = torch.randn(N_LAW, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * (1 + sig[0])
    run = dict(tree=trees.chain(6), coupling="rmc", seed=4, disable=True)
    out = kdiffusion.sample(GaussianDenoiser(), x, sig, chain=chain, draft="cached", **run)
    testing.check_law(out.samples, linear_grid(sig), None, MU, S0, chain=chain).assert_exact()
    assert out.stats.draft_calls > 0 and out.stats.calls < 20
    peek = fn(GaussianDenoiser(), x, sig, draft=PeekCached(), **run)
    assert not testing.check_law(peek, linear_grid(sig), None, MU, S0, chain=chain).passed


def test_the_cached_draft_is_refused_for_a_denoiser_with_deep_but_no_shallow_naming_both():
    class HalfProtocol(GaussianDenoiser):
        shallow = None

    sig = _karras(8)
    with pytest.raises(ValueError, match=r"draft='cached'.*deep and shallow.*the model given here, HalfProtocol"):
        kdiffusion.sample_euler_ancestral(
            HalfProtocol(), torch.zeros(2, D), sig, tree=trees.chain(2), draft="cached", seed=0, disable=True
        )


# -- the learned draft: a draft network in k-diffusion's convention --------------------------------


@pytest.mark.parametrize("fn, chain", DROP_INS, ids=DROP_IN_IDS)
def test_the_digits_learned_draft_runs_through_the_drop_ins_with_a_callback_and_is_the_library_run(den, fn, chain):
    """``draft="learned"`` is the digits model's distilled U-Net in the drop-ins too, with a callback
    (whose bookkeeping never reaches the draft network), and the same run as the library's."""
    sig = _karras(30)
    x, labels = _digits_start(6, sig)
    extra = dict(extra_args={"class_labels": labels}, row_args=("class_labels",))
    run = dict(tree=trees.chain(8), coupling="rmc", draft="learned", seed=5)
    seen: list = []
    got = fn(den, x, sig, **extra, callback=seen.append, disable=True, **run)
    out = kdiffusion.sample(den, x, sig, **extra, chain=chain, disable=True, **run)
    assert torch.equal(got, out.samples) and seen
    assert out.config["draft"] == "learned" and out.stats.draft_calls > 0 and out.stats.calls < 30
    lib = specforest.sample(
        digits.load_velocity(), x / (1.0 + float(sig[0])), sigmas=linear_grid(sig),
        cond={"class_labels": labels}, chain=chain, **run,
    )  # fmt: skip
    assert torch.equal(lib.samples, out.samples)


def test_a_learned_draft_from_a_denoiser_gets_the_models_extra_args_in_the_drop_ins(den):
    """``LearnedDraft.from_denoiser(net)``: in the drop-ins ``net`` is called as the model is, with its
    shared ``extra_args``; with the target itself as the network every draft is accepted (an
    unconditional draft of a class-conditional target would not be)."""
    sig = _karras(20)
    x, _ = _digits_start(4, sig)
    run = dict(tree=trees.chain(6), coupling="rmc", seed=0, disable=True)
    out = kdiffusion.sample(
        den, x, sig, {"class_labels": 7}, chain="euler_ancestral", draft=LearnedDraft.from_denoiser(den), **run
    )
    assert out.stats.accepts.sum() == out.stats.attempts.sum() > 0
    # the same object in the library: the network through EDM's adapter, the same draft
    lib = specforest.sample(
        EDMDenoiserVelocity(den),
        x / (1.0 + float(sig[0])),
        sigmas=linear_grid(sig),
        model_kwargs={"class_labels": 7},
        chain="euler_ancestral",
        draft=LearnedDraft.from_denoiser(den),
        tree=trees.chain(6),
        coupling="rmc",
        seed=0,
    )
    assert lib.stats.accepts.sum() == lib.stats.attempts.sum() > 0


def test_a_learned_draft_from_a_denoiser_refuses_what_is_not_one():
    with pytest.raises(TypeError, match=r"denoiser must be callable"):
        LearnedDraft.from_denoiser(3)


class DeclaresItsDraft(GaussianDenoiser):
    """A target of another family and shape that declares its draft network (``learned_draft``): here
    the target itself, so every draft is accepted."""

    def learned_draft(self) -> GaussianDenoiser:
        return GaussianDenoiser()


def test_draft_learned_is_the_network_a_model_declares_through_every_entry_point():
    """``draft="learned"`` reads the draft network the model declares (``declared_draft``), not only the
    digits model's: a Gaussian target of shape (16,) that declares itself as its draft is served by the
    name in ``specforest.sample``, the drop-ins and the tuner's filter, every draft accepted; one that
    declares none is still refused naming the digits draft's shape."""
    from specforest.drafts import declared_draft, drafts_serving

    model = DeclaresItsDraft()
    assert callable(declared_draft(model)) and declared_draft(GaussianDenoiser()) is None
    assert callable(declared_draft(EDMDenoiserVelocity(model)))
    assert drafts_serving(["learned"], (D,), EDMDenoiserVelocity(model)) == ["learned"]
    assert drafts_serving(["learned"], (D,), EDMDenoiserVelocity(GaussianDenoiser())) == []
    sig = kdiffusion.get_sigmas_karras(20, 0.03, 80.0).double()
    x = torch.randn(4, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * (1 + sig[0])
    run = dict(tree=trees.chain(6), coupling="rmc", draft="learned", seed=0)
    drop = kdiffusion.sample(model, x, sig, chain="euler_ancestral", disable=True, **run)
    lib = specforest.sample(
        EDMDenoiserVelocity(model), x / (1 + sig[0]), sigmas=linear_grid(sig), chain="euler_ancestral", **run
    )
    for out in (drop, lib):
        assert out.stats.draft_calls > 0 and out.stats.accepts.sum() == out.stats.attempts.sum() > 0
    with pytest.raises(ValueError, match=r"draft='learned' is the digits model's distilled U-Net: .*\(1, 8, 8\)"):
        kdiffusion.sample(GaussianDenoiser(), x, sig, chain="euler_ancestral", disable=True, **run)


def test_the_shipped_digits_denoiser_declares_its_distilled_draft_on_its_device_and_dtype():
    den = digits.load_denoiser(dtype=torch.float64)
    draft = den.learned_draft()
    assert next(draft.parameters()).dtype == torch.float64
    ref = digits.load_draft_denoiser(dtype=torch.float64)
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(draft(x, torch.full((2,), 0.7)), ref(x, torch.full((2,), 0.7)))
    # a denoiser of other weights declares none: draft="learned" falls back to the shipped draft
    assert not hasattr(digits.load_denoiser(digits.WEIGHTS_DIR / digits.UNET_FILE), "learned_draft")


@pytest.mark.parametrize("kind", ["learned", "model"])
def test_a_velocity_draft_network_given_as_a_proposal_runs_through_a_drop_in_with_a_callback(kind):
    """A draft network in the library's convention (a velocity, in a ``LearnedDraft`` or a
    ``DraftModel``) gets the rows' conditioning in the drop-ins and never the callback's bookkeeping;
    the proposal given is left as it was."""
    from specforest.drafts import DraftModel

    target = EDMDenoiserVelocity(GaussianDenoiser())

    def velocity(x, sigma, **cond):
        assert set(cond) <= {"class_labels"}, sorted(cond)
        return target(x, sigma)

    draft = LearnedDraft(velocity) if kind == "learned" else DraftModel(velocity)
    sig = kdiffusion.get_sigmas_karras(10, 0.03, 80.0).double()
    x = torch.randn(3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * (1 + sig[0])
    seen: list = []

    def model(y, s, class_labels=None):
        return GaussianDenoiser()(y, s)

    out = kdiffusion.sample_euler_ancestral(
        model, x, sig, {"class_labels": torch.arange(3)}, seen.append, True,
        row_args=("class_labels",), tree=trees.chain(4), coupling="rmc", draft=draft, seed=0,
    )  # fmt: skip
    assert seen and torch.isfinite(out).all() and draft.fn is velocity


@pytest.mark.parametrize("draft", ["cached", "learned"])
def test_every_entry_point_reaches_the_network_drafts_on_digits(den, draft):
    """``specforest.sample``, ``specforest.generate``, the tuner's filter of the drafts a model serves
    and a k-diffusion drop-in all run ``draft`` on the digits model, with draft-network calls of its
    own; ``generate``'s sample 0 is ``sample``'s with the same seed and index."""
    from specforest import streams
    from specforest.drafts import drafts_serving

    velocity = digits.load_velocity()
    assert drafts_serving([draft], (1, 8, 8), velocity) == [draft]
    labels = torch.tensor([3, 5])
    run = dict(steps=12, churn=0.3, tree=trees.chain(4), coupling="rmc", draft=draft)
    x = streams.randn(7, torch.arange(2), (1, 8, 8))
    one = specforest.sample(velocity, x, seed=7, sample_index=torch.arange(2), cond={"class_labels": labels}, **run)
    assert one.stats.draft_calls > 0
    gen = specforest.generate(
        velocity,
        count=2,
        make_x=lambda i: streams.randn(7, i, (1, 8, 8)),
        make_cond=lambda i: {"class_labels": labels[i]},
        seed=7,
        batch=2,
        **run,
    )
    done = {int(i): s for f in gen for i, s in zip(f.index, f.samples, strict=True)}
    assert torch.equal(done[0], one.samples[0]) and torch.equal(done[1], one.samples[1])
    sig = _karras(12)
    out = kdiffusion.sample(den, x * (1 + sig[0]), sig, {"class_labels": labels}, None, True,
                            row_args=("class_labels",), chain="euler_ancestral", tree=trees.chain(4), draft=draft,
                            seed=7)  # fmt: skip
    assert out.stats.draft_calls > 0 and out.config["draft"] == draft


class LinearGaussianDenoiser(GaussianDenoiser):
    """The CONST (``path="linear"``) denoiser of the same data law, ``x = (1 - s) x_0 + s xi``, with the
    same protocol (features: the denoised estimate)."""

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        s = sigma.reshape(-1, *[1] * (x.ndim - 1)).to(torch.float64)
        gain = (1 - s) * S0**2 / ((1 - s) ** 2 * S0**2 + s**2)
        return (MU + gain * (x.to(torch.float64) - (1 - s) * MU)).to(x.dtype)


@pytest.mark.parametrize("path", ["ve", "linear"])
def test_the_cached_draft_with_prediction_features_drafts_as_the_memory_draft_on_both_paths(path):
    """Closed form for the features' path through the drop-in's adapter: features that are the denoised
    estimate, read back by ``shallow``, make the cached draft the memory draft (same NFE, the same
    samples to rounding), with ``path="ve"`` and ``path="linear"``."""
    if path == "ve":
        model, sig = GaussianDenoiser(), kdiffusion.get_sigmas_karras(20, 0.03, 80.0).double()
    else:
        model = LinearGaussianDenoiser()
        sig = torch.cat([torch.linspace(0.98, 0.02, 20, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)])
    x = torch.randn(16, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * (1 + sig[0])
    run = dict(churn=0.5, tree=trees.chain(6), coupling="rmc", seed=1, disable=True, path=path)
    ref = kdiffusion.sample(model, x, sig, draft="memory", **run)
    got = kdiffusion.sample(model, x, sig, draft="cached", **run)
    assert got.stats.draft_calls > 0 and torch.equal(got.stats.nfe, ref.stats.nfe)
    torch.testing.assert_close(got.samples, ref.samples, rtol=0, atol=1e-9)
