"""Per-sample random streams: a sample is a function of (seed, index) only.

Same seed, same sample, whatever the batch size, the order of the samples, the
chunking (``max_rows``) and the execution mode (lazy or full): bitwise for the
Gaussian mixture in float64 (its velocity is batch-invariant), within 1e-5 for
the digits network (whose own results change in the last bits with its batch).
"""

import gc
import warnings

import pytest
import torch
from scipy import stats as sps

import specforest
from specforest import chains, lockstep, records, streams, trees
from specforest.couplings import GRS, available_couplings, get_coupling, register_coupling, unregister_coupling
from specforest.models import GaussianMixture
from specforest.proposals import (
    FrozenPrediction,
    LearnedDraft,
    available_drafts,
    get_proposal,
    register_draft,
    unregister_draft,
)

GMM = GaussianMixture.paper(dim=12, components=3, seed=0)
BATCH = 12
X = torch.randn(BATCH, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

CONFIGS = {
    "standard": dict(tree=None),
    "rmc_chain": dict(tree=trees.chain(5), coupling="rmc"),
    "grs_chain_x0": dict(tree=trees.chain(4), draft="x0"),
    "grs_tree": dict(tree=trees.uniform(2, 3)),
    "grs_drafted_parent": dict(tree=trees.uniform(3, 2), verify="drafted", prefetch="parent"),
    "grs_irregular_x0": dict(tree=trees.from_parents([-1, 0, 0, 0, 1, 1, 4, 2]), draft="x0"),
    "rank_tree": dict(tree=trees.uniform(3, 2), coupling="rank"),
    "antithetic": dict(tree=trees.uniform(2, 3), coupling="antithetic"),
    "antithetic_pruned": dict(tree=trees.from_parents([-1, 0, 0, 1, 1, 3, 3]), coupling="antithetic"),
    "x0_extrap_drift": dict(tree=trees.widths([3, 2, 1]), draft="x0_extrap"),
    "memory_chain": dict(tree=trees.chain(6), coupling="rmc", draft="memory"),
    "memory_chain_drafted": dict(tree=trees.chain(4), draft="memory", verify="drafted", prefetch="parent"),
    "memory_tree": dict(tree=trees.uniform(2, 2), draft="memory"),
    "secant_chain": dict(tree=trees.chain(6), coupling="rmc", draft="secant"),
    "secant_chain_drafted": dict(tree=trees.chain(4), draft="secant", verify="drafted", prefetch="parent"),
    "secant_tree": dict(tree=trees.uniform(2, 2), draft="secant"),
    "draft_model": dict(tree=trees.uniform(2, 2), draft=lambda x, s: 0.9 * GMM(x, s)),
    "picard_chain": dict(tree=trees.chain(6), coupling="rmc", draft="picard"),
    "picard2_chain_drafted": dict(tree=trees.chain(4), draft="picard2", verify="drafted", prefetch="parent"),
    "learned_chain": dict(tree=trees.chain(6), coupling="rmc", draft=LearnedDraft(lambda x, s: 0.9 * GMM(x, s))),
    "learned_tree_drafted": dict(
        tree=trees.uniform(2, 2), verify="drafted", draft=LearnedDraft(lambda x, s: 0.9 * GMM(x, s))
    ),
    # the mixture's responsibilities kept by the verification call, per node
    "cached_chain": dict(tree=trees.chain(6), coupling="rmc", draft="cached"),
    "cached_chain_drafted": dict(tree=trees.chain(4), draft="cached", verify="drafted", prefetch="parent"),
    # the same plus the secant correction from each node's pair of the round before
    "corrected_chain": dict(tree=trees.chain(6), coupling="rmc", draft="corrected"),
    "corrected_chain_drafted": dict(tree=trees.chain(4), draft="corrected", verify="drafted", prefetch="parent"),
}


def _run(x, idx=None, **kw):
    base = dict(steps=20, churn=0.4, seed=123)
    if "sigmas" in kw:
        del base["steps"]
    base.update(kw)
    return specforest.sample(GMM, x, sample_index=idx, **base)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sample_is_the_same_in_any_batch_order_chunking_and_mode(name):
    cfg = CONFIGS[name]
    ref = _run(X, **cfg)
    perm = torch.tensor([7, 2, 11, 0, 5])
    sub = _run(X[perm], perm, **cfg)
    assert torch.equal(sub.samples, ref.samples[perm])
    assert torch.equal(sub.stats.nfe, ref.stats.nfe[perm])
    one = _run(X[4:5], torch.tensor([4]), **cfg)
    assert torch.equal(one.samples[0], ref.samples[4])
    assert torch.equal(_run(X, max_rows=5, **cfg).samples, ref.samples)
    if cfg["tree"] is not None:
        lazy = _run(X, lazy=True, **cfg)
        assert torch.equal(lazy.samples, ref.samples)
        assert torch.equal(lazy.stats.nfe, ref.stats.nfe)
        assert torch.equal(lazy.stats.accepts, ref.stats.accepts)


def test_the_same_test_sees_a_shared_stream():
    """A deliberately batch-dependent source (one stream for the whole batch) fails the comparison above."""

    class SharedStreamGRS(GRS):
        # the acceptance uniforms of every problem keyed by its row number in the batch
        def select(self, s_hat, delta, valid, rng):
            shared = streams.Stream(streams.sample_keys(0, torch.arange(s_hat.shape[0])))
            return super().select(s_hat, delta, valid, shared)

    cfg = dict(tree=trees.uniform(2, 3), coupling=SharedStreamGRS())
    ref = _run(X, **cfg)
    perm = torch.tensor([7, 2, 11, 0, 5])
    assert not torch.equal(_run(X[perm], perm, **cfg).samples, ref.samples[perm])


def test_seed_generator_and_generator_lists():
    a = _run(X, tree=trees.uniform(2, 2))
    assert torch.equal(a.samples, _run(X, tree=trees.uniform(2, 2)).samples)
    assert not torch.equal(a.samples, _run(X, tree=trees.uniform(2, 2), seed=124).samples)
    g = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    kw = dict(steps=20, churn=0.4, tree=trees.uniform(2, 2))
    b = specforest.sample(GMM, X, generator=g(5), **kw)
    assert torch.equal(b.samples, specforest.sample(GMM, X, generator=g(5), **kw).samples)
    # one generator per sample (diffusers' convention): sample i depends on generator i only
    gens = [g(100 + i) for i in range(BATCH)]
    c = specforest.sample(GMM, X, generator=gens, **kw)
    d = specforest.sample(GMM, X[[3, 1]], generator=[g(103), g(101)], **kw)
    assert torch.equal(d.samples, c.samples[[3, 1]])
    with pytest.raises(ValueError, match="one torch.Generator per sample"):
        specforest.sample(GMM, X, generator=gens[:3], **kw)
    with pytest.raises(ValueError, match="not both"):
        specforest.sample(GMM, X, generator=g(1), seed=1, **kw)
    with pytest.raises(ValueError, match="sample_index"):
        specforest.sample(GMM, X, seed=1, sample_index=torch.arange(3), **kw)


def test_initial_noise_per_sample():
    a = streams.randn(7, torch.arange(10), (2, 3), dtype=torch.float64)
    b = streams.randn(7, [8, 2], (2, 3), dtype=torch.float64)
    assert a.shape == (10, 2, 3) and torch.equal(b, a[[8, 2]])
    assert not torch.equal(streams.randn(8, [2], (2, 3), dtype=torch.float64)[0], a[2])


def test_streams_are_standard_and_slots_independent():
    keys = streams.sample_keys(3, torch.arange(4000))
    z = streams.normal(keys, 25)
    assert sps.kstest(z.flatten().numpy(), "norm").pvalue > 1e-4
    u = streams.uniform(keys, 5, slot=1)
    assert sps.kstest(u.flatten().numpy(), "uniform").pvalue > 1e-4
    assert float(u.min()) > 0 and float(u.max()) < 1
    # neighbouring keys, elements and slots are uncorrelated (|r| < 4.5 standard errors)
    v = streams.uniform(keys, 5, slot=2)
    tol = 4.5 / 4000**0.5
    for a, b in [(u[:, 0], v[:, 0]), (u[:, 0], u[:, 1]), (z[:-1, 0], z[1:, 0])]:
        assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < tol
    # a badly keyed stream (the same key for every row) is caught by the same check
    same = streams.uniform(keys[:1].expand(4000), 2, slot=1)
    assert sps.kstest(same.flatten().numpy(), "uniform").pvalue < 1e-4


def test_draws_made_in_one_pass_are_the_numbers_of_each_draw():
    """The round mixes its noise and its coupling's uniforms together (``streams.uniforms``): the
    numbers must be those each draw gives alone, and a stream holding them must hand out the same."""
    keys = streams.sample_keys(5, torch.arange(12)).reshape(3, 4)
    layout = ((streams.SLOT_COUPLE, 3), (streams.SLOT_COUPLE + 1, 1))
    noise, coup = streams.uniforms((keys[:, 1:], ((streams.TAG_DRAFT, 7),)), (keys, layout))
    assert torch.equal(noise, streams.uniform(keys[:, 1:], 7, streams.TAG_DRAFT))
    assert torch.equal(coup[..., :3], streams.uniform(keys, 3, streams.SLOT_COUPLE))
    assert torch.equal(coup[..., 3:], streams.uniform(keys, 1, streams.SLOT_COUPLE + 1))
    flat = keys.reshape(-1)
    plain = streams.Stream(flat, streams.SLOT_COUPLE)
    held = streams.Stream(flat, streams.SLOT_COUPLE, coup.reshape(-1, 4), ((0, 3), (1, 1)))
    rows = torch.tensor([5, 0, 11])
    for rng in (held, held.take(rows)):
        ref = plain if rng is held else plain.take(rows)
        assert torch.equal(rng.uniform(0, 3), ref.uniform(0, 3))
        assert torch.equal(rng.uniform(1, 1), ref.uniform(1, 1))
        assert torch.equal(rng.uniform(2, 2), ref.uniform(2, 2))  # not held: drawn when asked
    # a stream holding numbers that are not its own would be caught
    wrong = streams.Stream(flat, streams.SLOT_COUPLE, coup.reshape(-1, 4).flip(0), ((0, 3), (1, 1)))
    assert not torch.equal(wrong.uniform(0, 3), plain.uniform(0, 3))


@pytest.mark.parametrize("steps_per_block", [2, 3, 16])
def test_the_standard_sampler_s_noise_drawn_in_blocks_of_steps_is_each_step_s_draw(monkeypatch, steps_per_block):
    """The standard sampler draws the noise of several steps in one pass (``lockstep._exact_noise``):
    its samples must be those of one draw per step, with blocks that do not divide the steps; a
    block read one step off is caught."""
    gmm = GaussianMixture.paper(dim=6, components=3, seed=0)
    x = streams.randn(2, torch.arange(5), (6,), dtype=torch.float64)

    def run(elements):
        monkeypatch.setattr(lockstep, "NOISE_BLOCK_ELEMENTS", elements)
        return specforest.sample(gmm, x, steps=11, churn=0.4, seed=9).samples

    per_step = run(1)  # blocks of one step
    assert torch.equal(run(steps_per_block * 5 * 6), per_step)
    real = lockstep._exact_noise

    def off_by_one(ctx, state):
        noise, block = real(ctx, state)
        return block.noise[min(state.rounds - block.first + 1, block.noise.shape[0] - 1)], block

    monkeypatch.setattr(lockstep, "_exact_noise", off_by_one)
    assert not torch.equal(run(steps_per_block * 5 * 6), per_step)


def test_digits_network_is_batch_invariant_within_1e_5():
    from specforest.experiments import pixel as pixel_exp
    from specforest.models.digits import load_velocity

    vel = load_velocity()
    x, labels = pixel_exp.initial_states(6, 3)
    kw = dict(steps=12, churn=0.3, seed=5, tree=trees.uniform(2, 2))
    ref = specforest.sample(vel, x, cond={"class_labels": labels}, **kw)
    idx = torch.tensor([4, 1])
    sub = specforest.sample(vel, x[idx], cond={"class_labels": labels[idx]}, sample_index=idx, **kw)
    assert (sub.samples - ref.samples[idx]).abs().max() < 1e-5
    lazy = specforest.sample(vel, x, cond={"class_labels": labels}, lazy=True, **kw)
    assert (lazy.samples - ref.samples).abs().max() < 1e-5


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(12, 12)

    def forward(self, x, sigma):
        return self.lin(x) * sigma[:, None]


def _tensor_count() -> int:
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sum(type(o) is torch.Tensor or type(o) is torch.nn.Parameter for o in gc.get_objects())


@pytest.mark.slow
def test_no_autograd_graph_and_flat_memory():
    net = _Net()
    assert net.lin.weight.requires_grad
    counts = []
    out = specforest.sample(
        net,
        X.float(),
        steps=160,
        churn=0.4,
        tree=trees.uniform(2, 2),
        seed=0,
        callback=lambda info: counts.append(_tensor_count()),
    )
    assert out.samples.grad_fn is None and not out.samples.requires_grad
    # live tensors do not grow with the rounds (a kept graph would hold every round's tensors): the
    # counters hold at most FLUSH_ROUNDS rounds' outcomes, so the count cycles: its peak over the last
    # cycle is that of the second one (the first builds the run's caches)
    cycle = records.FLUSH_ROUNDS + 2
    assert len(counts) > 4 * cycle
    assert max(counts[-cycle:]) <= max(counts[cycle : 2 * cycle]) + 5
    # the check can fail: outside the sampler the same target builds a graph, and a loop that keeps
    # its outputs grows the live tensors every step
    assert net(X.float(), torch.ones(BATCH)).grad_fn is not None
    kept, grown = [], []
    x = X.float()
    for _ in range(10):
        x = x + 0.01 * net(x, torch.ones(BATCH))
        kept.append(x)
        grown.append(_tensor_count())
    assert grown[-1] > grown[2] + 5


def test_user_code_runs_in_normal_mode_and_gets_normal_tensors():
    """The sampler's arithmetic runs under inference mode; the model, a draft model and the callback do not,
    and everything handed out is a normal tensor: it can be changed in place and used in a graph later."""
    seen, cache = [], {}

    def model(x, sigma):
        seen.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        cache.setdefault("table", torch.ones(x.shape[1]))  # a model that caches a tensor on its first call
        return GMM(x, sigma) * cache["table"]

    def draft(x, sigma):
        seen.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        return GMM(x, sigma)

    got = []
    kw = dict(steps=8, churn=0.4, tree=trees.uniform(2, 2), seed=0)
    out = specforest.sample(model, X, callback=lambda info: got.append(info), **kw)
    specforest.sample(model, X, draft=draft, **kw)
    assert seen and set(seen) == {(False, False)}
    tensors = [out.samples, out.stats.nfe, out.stats.attempts, got[0]["x"], got[0]["step"], cache["table"]]
    assert not any(t.is_inference() for t in tensors)
    out.samples.add_(1.0)  # an inference tensor would refuse this outside inference mode
    w = torch.ones(1, dtype=X.dtype, requires_grad=True)
    (out.samples * w * cache["table"]).sum().backward()
    assert w.grad is not None
    # the check can fail: a tensor made in inference mode is refused
    with torch.inference_mode():
        made = torch.ones(3)
    assert made.is_inference()
    with pytest.raises(RuntimeError, match="[Ii]nference"):
        made.add_(1.0)
    gen = specforest.generate(GMM, count=3, make_x=lambda i: X[i], seed=0, batch=2, steps=8, churn=0.4)
    assert not any(f.samples.is_inference() or f.stats.nfe.is_inference() for f in gen)


def test_cond_is_explicit_and_validated():
    def model(x, sigma, label, scale):
        assert label.shape == (x.shape[0],) and scale == 2.0
        return GMM(x, sigma)

    label = torch.arange(BATCH)
    specforest.sample(
        model,
        X,
        steps=6,
        churn=0.4,
        tree=trees.uniform(2, 2),
        seed=0,
        cond={"label": label},
        model_kwargs={"scale": 2.0},
    )
    with pytest.raises(ValueError, match=r"cond\['label'\] must be a tensor with one row per trajectory"):
        specforest.sample(model, X, steps=6, churn=0.4, seed=0, cond={"label": label[:3]})


@pytest.fixture
def scratch_plugins():
    """Registers nothing; after the test, unregisters the coupling ``mine-test`` and the draft
    ``velocity-test`` if it left them: a name left behind is drawn by later tests that draw from
    the registries (``tests/test_fuzz.py``), which then depend on the order the tests ran in."""
    yield
    if "mine-test" in available_couplings():
        unregister_coupling("mine-test")
    if "velocity-test" in available_drafts():
        unregister_draft("velocity-test")


def test_registries_extend_couplings_and_drafts(scratch_plugins):
    class Mine(GRS):
        name = "mine"

    register_coupling("mine-test", Mine, replace=True)
    assert "mine-test" in available_couplings() and isinstance(get_coupling("mine-test"), Mine)
    with pytest.raises(ValueError, match="already registered"):
        register_coupling("grs", Mine)
    register_draft("velocity-test", lambda: FrozenPrediction("velocity"), replace=True)
    assert "velocity-test" in available_drafts()
    assert isinstance(get_proposal("velocity-test"), FrozenPrediction)
    out = specforest.sample(
        GMM, X, steps=8, churn=0.4, tree=trees.uniform(2, 2), coupling="mine-test", draft="velocity-test", seed=0
    )
    assert out.config["coupling"] == "mine"


def test_unregistered_plugins_are_refused_and_the_built_ins_stay(scratch_plugins):
    register_coupling("mine-test", GRS)
    register_draft("velocity-test", lambda: FrozenPrediction("velocity"))
    unregister_coupling("MINE-TEST")  # coupling names are case-insensitive
    unregister_draft("velocity-test")
    assert "mine-test" not in available_couplings() and "velocity-test" not in available_drafts()
    with pytest.raises(ValueError, match="coupling must be one of"):
        get_coupling("mine-test")
    with pytest.raises(ValueError, match="draft must be one of"):
        get_proposal("velocity-test")
    with pytest.raises(ValueError, match="draft 'velocity-test' is not registered"):
        unregister_draft("velocity-test")
    with pytest.raises(ValueError, match="coupling 'mine-test' is not registered"):
        unregister_coupling("mine-test")
    assert "grs" in available_couplings() and "velocity" in available_drafts()


@pytest.mark.parametrize("outer", [False, True])
def test_outside_inference_restores_the_modes_it_found(outer):
    """User code runs in normal mode without grad; the modes around it come back, also after an error."""
    from specforest.target import outside_inference

    with torch.inference_mode(outer):
        before = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        with pytest.raises(KeyError):
            with outside_inference():
                assert (torch.is_inference_mode_enabled(), torch.is_grad_enabled()) == (False, False)
                raise KeyError("user code failed")
        assert (torch.is_inference_mode_enabled(), torch.is_grad_enabled()) == before


def test_the_target_reuses_conditioning_rows_only_for_the_same_index_tensor():
    """Target.cond_rows keeps the rows of the last index tensor (the standard sampler passes the same
    one every round); another tensor, even with the same values, and new conditioning are re-read."""
    from specforest.target import Target

    seen = []

    def model(x, sigma, label):
        seen.append(label.tolist())
        return x

    target = Target(model, (1,), torch.float64, None, {"label": torch.tensor([10, 11, 12])}, {})
    x, sig = torch.zeros(2, 1, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    a, b = torch.tensor([0, 2]), torch.tensor([1, 1])
    for traj in (a, b, a, a, torch.tensor([0, 2])):
        target(x, sig, traj)
    target.set_rows(torch.tensor([2]), {"label": torch.tensor([42])})
    target(x, sig, a)
    assert seen == [[10, 12], [11, 11], [10, 12], [10, 12], [10, 12], [10, 42]]


def test_a_model_that_takes_timesteps_gets_each_rows_own_chunked_padded_and_split():
    """A chain's declared time input (``timestep``) reaches a model that declares ``takes_timestep`` row for row
    with its state, through chunks (``max_rows``), padding (``pad_rows``) and a process group's split (one process
    here); a model that does not declare it is called without it."""
    import tempfile

    import torch.distributed as dist

    from specforest.target import Target

    class Timed:
        takes_timestep = True

        def __init__(self):
            self.seen = []

        def __call__(self, x, sigma, timestep):
            self.seen.append(timestep.clone())
            assert torch.equal(timestep, 1000.0 * x[:, 0])  # each row's own
            return x

    x = torch.arange(7, dtype=torch.float64)[:, None] / 8
    sig, traj, k = torch.full((7,), 0.5, dtype=torch.float64), torch.arange(7), 1000.0 * x[:, 0]
    for kw in ({}, {"max_rows": 3}, {"max_rows": 3, "pad_rows": (2, 4)}):
        model = Timed()
        target = Target(model, (1,), torch.float64, kw.get("max_rows"), {}, {}, pad_rows=kw.get("pad_rows"))
        assert torch.equal(target(x, sig, traj, timestep=k), x)
        # (padding repeats a chunk's last row)
        assert torch.equal(torch.cat(model.seen).unique(), k), kw
    with tempfile.NamedTemporaryFile() as f:
        own = not dist.is_initialized()
        if own:
            dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
        try:
            model = Timed()
            split = Target(model, (1,), torch.float64, None, {}, {}, group=dist.group.WORLD)
            assert torch.equal(split(x, sig, traj, timestep=k), x) and torch.equal(model.seen[0], k)
        finally:
            if own:
                dist.destroy_process_group()
    plain = Target(lambda x, sigma: x, (1,), torch.float64, None, {}, {})  # (a keyword it does not take would raise)
    assert torch.equal(plain(x, sig, traj, timestep=k), x)


class _Labelled(chains.DPM2Ancestral):
    """``dpm_2_ancestral`` declaring each call's time input ``1000 n + k`` (stage ``k`` of step ``n``)."""

    def call_times(self, sigmas):
        T = sigmas.numel() - 1
        return 1000.0 * torch.arange(T, dtype=torch.float64)[:, None] + torch.arange(2, dtype=torch.float64)


@pytest.mark.parametrize(
    "mode",
    [
        dict(tree=None),
        dict(tree=trees.uniform(2, 2)),
        dict(tree=trees.chain(4), coupling="rmc", lazy=True),
        dict(tree=trees.chain(3), coupling="rmc", draft="picard"),
    ],
    ids=["standard", "full", "lazy", "picard"],
)
def test_each_call_gets_the_time_input_its_chain_declares_for_its_step_and_stage(mode):
    """A chain's declared time inputs (:meth:`~specforest.chains.Chain.call_times`) reach a model that takes them
    with every call, in every mode: each call's level is its declared (step, stage)'s tableau level; and the
    declaration changes nothing else (the same samples and calls as the chain without it)."""
    grid = chains.karras_linear_grid(10, 0.03, 20.0)
    chain = _Labelled()
    level = chain.build(grid).stage_tables.level
    seen = []

    class Timed:
        takes_timestep = True

        def __call__(self, x, sigma, timestep):
            seen.append((sigma.clone(), timestep.clone()))
            return GMM(x, sigma)

    kw = dict(sigmas=grid, churn=None, seed=3, **mode)
    run = specforest.sample(Timed(), X, chain=chain, **kw)
    plain = specforest.sample(GMM, X, chain=chains.DPM2Ancestral(), **kw)
    assert torch.equal(run.samples, plain.samples) and torch.equal(run.stats.nfe, plain.stats.nfe)
    sigma, k = (torch.cat(c) for c in zip(*seen, strict=True))
    n, stage = (k // 1000).long(), (k % 1000).long()
    assert torch.equal(sigma, level[n, stage]) and set(stage.tolist()) == {0, 1}


# -- every registered chain -----------------------------------------------------------------------

CHAIN_GRID = chains.karras_linear_grid(16, 0.03, 20.0)  # VE chains need a first level below t = 1
CHAIN_CONFIGS = {
    "standard": dict(tree=None),
    "rmc_chain_secant": dict(tree=trees.chain(5), coupling="rmc", draft="secant"),
    "grs_tree_x0": dict(tree=trees.uniform(2, 2), draft="x0"),
    "rank_tree_drafted": dict(tree=trees.uniform(3, 2), coupling="rank", verify="drafted", prefetch="parent"),
}


@pytest.mark.parametrize("chain", chains.available_chains())
@pytest.mark.parametrize("name", list(CHAIN_CONFIGS))
def test_every_chain_is_the_same_in_any_batch_order_chunking_and_mode(chain, name):
    cfg = dict(CHAIN_CONFIGS[name], chain=chains.get_chain(chain).example(), sigmas=CHAIN_GRID, churn=None)
    ref = _run(X, **cfg)
    perm = torch.tensor([7, 2, 11, 0, 5])
    sub = _run(X[perm], perm, **cfg)
    assert torch.equal(sub.samples, ref.samples[perm])
    assert torch.equal(sub.stats.nfe, ref.stats.nfe[perm])
    assert torch.equal(_run(X, max_rows=5, **cfg).samples, ref.samples)
    if cfg["tree"] is not None:
        lazy = _run(X, lazy=True, **cfg)
        assert torch.equal(lazy.samples, ref.samples)
        assert torch.equal(lazy.stats.nfe, ref.stats.nfe)


@pytest.mark.parametrize("chain", chains.available_chains())
def test_every_chain_generates_what_sample_samples(chain):
    """Continuous batching refills finished slots mid-run: a chain's start (EDM's churned x-hat_0)
    must be applied to refilled samples as to the first ones."""
    kw = dict(sigmas=CHAIN_GRID, chain=chains.get_chain(chain).example(), tree=trees.chain(4), coupling="rmc")
    g = specforest.generate(GMM, count=7, make_x=lambda idx: X[idx], seed=3, batch=3, draft="secant", **kw)
    got = {}
    for fin in g:
        for j, i in enumerate(fin.index.tolist()):
            got[i] = fin.samples[j]
    ref = specforest.sample(GMM, X[:7], seed=3, draft="secant", **kw).samples
    assert torch.equal(torch.stack([got[i] for i in range(7)]), ref)
