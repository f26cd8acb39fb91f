"""Property-based tests of the public boundary (hypothesis): valid inputs.

Valid inputs drawn at random (tree specs, couplings, drafts and the options of
``sample``, ``generate`` and ``specforest gmm``) run and keep the law of the
chain on the linear-Gaussian case: data ``N(mu0, s0^2 I)``, for which the
Euler-Maruyama chain is linear-Gaussian and its final law has a closed form
(:func:`specforest.testing.chain_law`). Each drawn configuration runs enough
trajectories for :func:`specforest.testing.check_law` to mean something (means
and variances within 4.5 standard errors, KS p >= 1e-4 per coordinate); a
deliberately wrong coupling fails the same check. Invalid inputs:
``test_fuzz_refusals.py``.

Every example is derandomized and the seeds are fixed, so CI sees the same
cases each run.
"""

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import KeepFirst
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specforest
from specforest import streams, testing, trees
from specforest.cli import main as cli_main
from specforest.couplings import available_couplings, get_coupling
from specforest.experiments import gmm as gmm_exp
from specforest.models import GaussianMixture
from specforest.planning import AdaptiveTree
from specforest.proposals import FrozenPrediction, available_drafts, drafts_serving, register_draft, unregister_draft
from specforest.sampler import GRIDS, PREFETCH_POLICIES
from specforest.sde import flow_match_grid, shift_sigmas, uniform_grid
from specforest.trees import VERIFY_MODES

MU0, S0 = torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64), 0.3
GAUSS = GaussianMixture(MU0[None], torch.tensor([S0]))
LAW_N = 1500  # trajectories per drawn configuration: the mean z-score sees a shift of 0.12 final sds

LAW = settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
FAST = settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


class Counting:
    """The linear-Gaussian velocity, counting its calls (an invalid input must be refused before any)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x, sigma, **kw):
        self.calls += 1
        return GAUSS(x, sigma, **kw)


# -- valid inputs ---------------------------------------------------------------------------


@st.composite
def random_parents(draw, max_nodes: int = 9) -> list:
    """A parent list of a random rooted tree, its nodes in a random order (what from_parents renumbers)."""
    n = draw(st.integers(2, max_nodes).map(lambda k: max_nodes + 2 - k))  # the largest first
    par = [-1] + [draw(st.integers(0, v - 1)) for v in range(1, n)]
    perm = draw(st.permutations(range(n)))
    out = [0] * n
    for v, p in enumerate(par):
        out[perm[v]] = -1 if p < 0 else perm[p]
    return out


@st.composite
def tree_for(draw, coupling: str):
    """A tree spec the coupling takes: a chain for rmc, a uniform tree of even width for antithetic
    (or widths with one even K), anything (an adaptive policy too) for the others."""
    cp = get_coupling(coupling)
    if cp.max_children == 1:
        return trees.chain(draw(st.integers(1, 5)))
    if cp.structured_siblings:
        K, L = draw(st.sampled_from([2, 4])), draw(st.integers(1, 2))
        return draw(st.sampled_from([trees.uniform(K, L), trees.widths([K] * L)]))
    # (hypothesis starts from the first choice of each draw: the richest trees come first)
    kind = draw(st.sampled_from(["parents", "widths", "adaptive", "uniform", "chain"]))
    if kind == "chain":
        return trees.chain(draw(st.integers(1, 5)))
    if kind == "uniform":
        return trees.uniform(draw(st.integers(1, 3)), draw(st.integers(1, 2)))
    if kind == "widths":
        return trees.widths(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    if kind == "parents":
        return trees.from_parents(draw(random_parents()))
    return AdaptiveTree(draw(st.integers(1, 8)), kmax=draw(st.integers(1, 4)))


@st.composite
def run_options(draw, coupling=None) -> dict:
    """Options of ``sample`` / ``generate``: coupling, tree, draft and the rest, all valid together
    (the standard sampler, ``tree=None``, one time in five)."""
    coupling = coupling or draw(st.sampled_from(available_couplings()))
    tree = None if draw(st.integers(0, 4)) == 4 else draw(tree_for(coupling))
    opts = dict(
        tree=tree,
        coupling=coupling,
        # (the drafts that serve the fuzzed models: not a draft network made for the digits model)
        draft=draw(st.sampled_from(drafts_serving(available_drafts(), None))),
        prefetch=draw(st.sampled_from(PREFETCH_POLICIES)),
        verify=draw(st.sampled_from(VERIFY_MODES)),
        churn=draw(st.floats(0.2, 1.0)),
        # (at least a few dozen rows a call: a call split into single rows is slow, not different)
        max_rows=draw(st.one_of(st.none(), st.integers(40, 4000))),
        pad_rows=draw(
            st.one_of(
                st.none(),
                st.just("pow2"),
                st.lists(st.integers(1, 3000), min_size=1, max_size=3).map(lambda v: v + [256]),
            )
        ),
    )
    if not isinstance(tree, AdaptiveTree):
        opts["lazy"] = draw(st.booleans())
    if draw(st.integers(0, 3)) == 3:
        # an explicit grid: strictly decreasing from <= 1 to exactly 0
        levels = draw(st.lists(st.floats(0.02, 0.98), min_size=1, max_size=8, unique=True))
        top = [1.0] if draw(st.booleans()) else []
        opts["sigmas"] = torch.tensor(top + sorted(levels, reverse=True) + [0.0], dtype=torch.float64)
    else:
        steps = draw(st.sampled_from([8, 5, 10, 3, 1, 2, 4, 6, 7, 9]))
        opts.update(steps=steps, grid=draw(st.sampled_from(GRIDS)), shift=draw(st.floats(0.3, 4.0)))
    return opts


def _grid_of(opts: dict) -> torch.Tensor:
    if "sigmas" in opts:
        return opts["sigmas"]
    make = uniform_grid if opts["grid"] == "uniform" else flow_match_grid
    return make(opts["steps"], shift=opts["shift"])


def _law(samples: torch.Tensor, opts: dict) -> testing.ChainReport:
    assert torch.isfinite(samples).all()
    grid = _grid_of(opts)
    mean, var = testing.chain_law(grid, opts["churn"], MU0, S0)
    if var == 0.0:
        # no stochastic step (T = 1, or T = 2 on a grid from 1): every sample is the chain's one point
        tol = 1e-5 if samples.dtype == torch.float32 else 1e-12
        close = torch.allclose(samples.double(), mean.expand_as(samples), rtol=0.0, atol=tol)
        return testing.ChainReport([], [], [], math.nan, [] if close else ["not the deterministic chain's point"])
    return testing.check_law(samples, grid, opts["churn"], MU0, S0)


@pytest.mark.parametrize("coupling", available_couplings())
@LAW
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_random_valid_sample_options_keep_the_chain_law(coupling, data, dtype):
    opts = data.draw(run_options(coupling), label="options")
    x = streams.randn(3, torch.arange(LAW_N), (3,), dtype=dtype)
    out = specforest.sample(GAUSS, x, seed=11, **opts)
    assert out.samples.dtype == dtype
    rep = _law(out.samples, opts)
    assert rep.passed, (opts, rep.failures)


@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(opts=run_options(), batch=st.sampled_from([256, 2 * LAW_N, 97, 1000]))
def test_random_valid_generate_options_keep_the_chain_law(opts, batch):
    gen = specforest.generate(
        GAUSS,
        count=LAW_N,
        make_x=lambda i: streams.randn(5, i, (3,), dtype=torch.float64),
        seed=5,
        batch=batch,
        **opts,
    )
    out = torch.empty(LAW_N, 3, dtype=torch.float64)
    seen = torch.zeros(LAW_N, dtype=torch.bool)
    for fin in gen:
        out[fin.index] = fin.samples
        seen[fin.index] = True
    assert seen.all()
    rep = _law(out, opts)
    assert rep.passed, (opts, batch, rep.failures)


def test_the_law_check_rejects_a_wrong_coupling():
    """The property's check on a coupling that accepts every draft: the variance is far off."""
    opts = dict(tree=trees.uniform(2, 2), coupling=KeepFirst(), steps=8, grid="uniform", shift=1.0, churn=0.6)
    x = streams.randn(3, torch.arange(LAW_N), (3,), dtype=torch.float64)
    rep = _law(specforest.sample(GAUSS, x, seed=11, **opts).samples, opts)
    assert not rep.passed


def gmm_choices(option: str) -> tuple[str, ...]:
    """The values ``specforest gmm`` accepts for ``option``: its ``click.Choice``, read from the command."""
    param = next(p for p in cli_main.commands["gmm"].params if p.name == option)
    return tuple(param.type.choices)


@st.composite
def cli_options(draw) -> list:
    """Valid ``specforest gmm`` options at a tiny dimension (one component: the linear-Gaussian case)."""
    method = draw(st.sampled_from(gmm_exp.METHODS))
    K = draw(st.sampled_from([2, 4])) if method == "antithetic" else draw(st.integers(1, 3))
    args = ["--method", method, "--K", str(K), "--L", str(draw(st.integers(1, 3)))]
    args += ["--steps", str(draw(st.integers(3, 8))), "--churn", repr(draw(st.floats(0.2, 1.0)))]
    args += ["--dim", str(draw(st.integers(1, 3))), "--mixture-seed", str(draw(st.integers(0, 2**64 - 1)))]
    for opt, choices in (
        ("--grid", gmm_choices("grid")),
        ("--prefetch", gmm_choices("prefetch")),
        ("--verify", gmm_choices("verify")),
        # the drafts the command offers (not the registry, which tests extend) that serve any model
        ("--draft", drafts_serving(gmm_choices("draft"), None)),
    ):
        args += [opt, draw(st.sampled_from(choices))]
    if method in ("dgrs", "rank", "rmc") and draw(st.booleans()):
        args += ["--tree", "adaptive", "--budget", str(draw(st.integers(1, 6)))]
    elif draw(st.booleans()):
        args.append("--lazy")
    return args


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(args=cli_options())
def _parses_as_gmm_options(args):
    # click's own parsing: an option value the command does not offer raises click.BadParameter
    cli_main.commands["gmm"].make_context("gmm", list(args))


def test_the_cli_strategy_draws_only_what_the_cli_accepts():
    """Every drawn argument list parses as ``specforest gmm``'s options, also while a draft that
    the CLI does not offer is registered (as when a test that registers one ran before in the
    same process)."""
    register_draft("velocity-fuzz-test", lambda: FrozenPrediction("velocity"))
    try:
        _parses_as_gmm_options()
    finally:
        unregister_draft("velocity-fuzz-test")


@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(args=cli_options())
def test_random_valid_cli_options_run_and_keep_the_chain_law(args, tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "samples.npz"
    common = ["gmm", "--components", "1", "--trajectories", str(LAW_N), "--no-progress", "--json"]
    res = CliRunner().invoke(cli_main, common + args + ["--dump-samples", str(path)])
    assert res.exit_code == 0, (args, res.output)
    rec = json.loads(res.output)
    assert all(math.isfinite(v) for v in rec.values() if isinstance(v, float)), rec
    o = dict(zip(args[::2], args[1::2], strict=False))
    setting = gmm_exp.GMMSetting(
        dim=int(o["--dim"]),
        components=1,
        steps=int(o["--steps"]),
        churn=float(o["--churn"]),
        grid=o["--grid"],
        mixture_seed=int(o["--mixture-seed"]),
    )
    mix = setting.mixture()
    samples = torch.from_numpy(np.load(path)["samples"]).double()
    assert samples.shape == (LAW_N, setting.dim)
    grid = uniform_grid(setting.steps) if setting.grid == "uniform" else flow_match_grid(setting.steps)
    rep = testing.check_law(samples, grid, setting.churn, mix.means[0], float(mix.stds[0]))
    assert rep.passed, (args, rep.failures)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(parents=random_parents(12))
def test_random_parent_lists_give_the_same_tree_in_breadth_first_order(parents):
    t = trees.from_parents(parents)
    assert t.size == len(parents)
    # the same multiset of numbers of children, and every node below its parent
    kids = sorted(parents.count(v) for v in range(len(parents)))
    assert sorted(t.num_children.tolist()) == kids
    assert bool((t.parent[1:] < torch.arange(1, t.size)).all())
    # a tensor of the same list gives the same tree
    same = trees.from_parents(torch.tensor(parents))
    assert torch.equal(same.parent, t.parent)


def test_regression_an_extreme_shift_keeps_the_grid_endpoints():
    # shift = 1e-10 moved the first level to 1 - 1e-8: a stochastic first step of std ~1e4, samples of
    # std ~3e6 returned without a word; 1e-30 gave "sigmas must be finite", naming what was not given
    for shift in (1e-300, 1e-10, 1e-5, 1e5, 1e15):
        for make in (flow_match_grid, uniform_grid):
            g = make(8, shift=shift)
            assert g[0] == 1.0 and g[-1] == 0.0 and bool((g[:-1] > g[1:]).all()), (shift, g)
    assert torch.equal(shift_sigmas(torch.tensor([0.0, 0.5, 1.0]), 3.0), torch.tensor([0.0, 0.75, 1.0]))
    # the chain's final sd is then 7e-10 around mu0 (7e-5 at 1e-5): float64 resolves it, float32 cannot
    x = streams.randn(3, torch.arange(LAW_N), (3,), dtype=torch.float64)
    for shift in (1e-10, 1e-5):
        opts = dict(steps=8, churn=0.5, grid="flow_match", shift=shift)
        out = specforest.sample(GAUSS, x, seed=1, tree=trees.uniform(2, 2), **opts)
        rep = _law(out.samples, opts)
        assert rep.passed, (shift, rep.failures)
    # a shift that rounds every level to 1 is refused by its name
    with pytest.raises(ValueError, match="shift=1e[+]16 collapses"):
        specforest.sample(GAUSS, x[:2], steps=8, churn=0.5, shift=1e16)
    with pytest.raises(TypeError, match="shift"):
        specforest.sample(GAUSS, x[:2], steps=8, churn=0.5, shift=True)
    assert torch.equal(uniform_grid(4, shift=np.float32(2.0)), uniform_grid(4, shift=2.0))
