"""Bad input at the library's API (issue 40, items 3, 5, 10, 11 and 12): refused by name, or blamed right.

* Tree constructors refuse a tree past the node cap before they build or read a list.
* A model whose own output is NaN or inf is named, with the step and the rows, never the draft.
* ``trees.optimal`` given a model says what to pass.
* Seeds outside ``[0, 2**64)`` and repeated sample indices are refused wherever they enter.
* A model that returns integers is refused (not truncated); churn's errors give the reason of each case.

Property tests (hypothesis, derandomized) cover the new bounds at the end.
"""

import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specforest
from specforest import planning, streams, testing, trees, validation
from specforest.kdiffusion import sample_speculative
from specforest.models import GaussianMixture
from specforest.target import FOLD_CALLS, Target
from specforest.trees import _MAX_NODES

GMM = GaussianMixture.paper(dim=4, components=3, seed=0)
X = streams.randn(0, torch.arange(3), (4,), dtype=torch.float64)
RUN = dict(steps=20, churn=0.3, seed=0)
PROPS = settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


class Counting:
    """The mixture's velocity, counting its calls (a refused input must reach none)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x, sigma, **cond):
        self.calls += 1
        return GMM(x, sigma)


# -- item 3: the node cap, before any list ----------------------------------------------------------


@pytest.fixture
def small_cap(monkeypatch):
    """A cap of 100 nodes, and a ``check_ints`` that fails: a constructor that reads a list element by
    element before it refuses a tree past the cap fails the test (as ``chain(10**9)`` hung)."""
    monkeypatch.setattr(trees, "_MAX_NODES", 100)

    def read(*args, **kw):
        raise AssertionError("a list was built and read before the node cap was checked")

    monkeypatch.setattr(trees, "check_ints", read)


@pytest.mark.parametrize(
    "build, fix",
    [
        (lambda: trees.chain(1000), "reduce L"),
        (lambda: trees.uniform(1, 1000), "reduce K or L"),
        (lambda: trees.uniform(2, 1000), "reduce K or L"),
        (lambda: trees.widths(range(1, 1001)), "give fewer widths"),
        (lambda: trees.from_parents(range(-1, 999)), "give fewer nodes"),
        (lambda: trees.optimal(lambda level, k: 0.5, 1000, 3), "reduce budget"),
        (lambda: planning.AdaptiveTree(1000), "reduce budget"),
        (lambda: planning.make_tree(L=1000, coupling="rmc"), "reduce L"),
        (lambda: planning.make_tree(K=2, L=1000), "reduce K or L"),
    ],
    ids=[
        "chain",
        "uniform-1",
        "uniform",
        "widths",
        "from_parents",
        "optimal",
        "adaptive",
        "make_tree-chain",
        "make_tree",
    ],
)
def test_every_tree_constructor_checks_the_node_cap_before_it_builds_a_list(small_cap, build, fix):
    with pytest.raises(ValueError, match=f"the tree would have more than 100 nodes; {fix}"):
        build()


def test_plan_tree_refuses_a_budget_past_the_cap_before_its_calibration_run(small_cap):
    model = Counting()
    with pytest.raises(ValueError, match="more than 100 nodes; reduce budget"):
        planning.plan_tree(model, X, budget=1000, steps=10, churn=0.3)
    assert model.calls == 0


@pytest.mark.parametrize(
    "build",
    [
        lambda: trees.chain(10**9),
        lambda: trees.uniform(1, 10**9),
        lambda: trees.uniform(10**9, 10**9),
        lambda: trees.widths(range(1, 10**9)),
        lambda: trees.from_parents(range(-1, 10**9)),
        lambda: trees.optimal(lambda level, k: 0.5, 10**9, 5),
        lambda: planning.AdaptiveTree(10**9),
        lambda: planning.make_tree(L=10**9, coupling="rmc"),
    ],
    ids=["chain", "uniform-1", "uniform", "widths", "from_parents", "optimal", "adaptive", "make_tree"],
)
def test_trees_of_a_billion_nodes_are_refused_at_once(build):
    # (each hung, or ate the memory of a list of 10**9 ints, before the cap applied to it)
    with pytest.raises(ValueError, match=f"the tree would have more than {_MAX_NODES} nodes"):
        build()


def test_optimal_never_plans_deeper_than_its_budget():
    """A tree of B drafted states is at most B deep: a deep ``max_depth`` asks nothing more of the
    acceptance model (it asked ``max_depth * kmax`` values: ``max_depth = 10**9`` hung)."""
    asked = []

    def acceptance(level, k):
        asked.append((level, k))
        return 1 - 0.5 ** (k + level)

    tree = trees.optimal(acceptance, 6, 1000)
    assert max(level for level, _ in asked) <= 6
    same = trees.optimal(acceptance, 6, 6)
    assert torch.equal(tree.parent, same.parent) and torch.equal(tree.depth, same.depth)


def test_optimal_refuses_a_table_it_cannot_hold():
    with pytest.raises(ValueError, match="budget=100000 to max_depth=100000 .* reduce budget or max_depth"):
        trees.optimal(lambda level, k: 0.5, 10**5, 10**5)


# -- item 10: trees.optimal given a model -----------------------------------------------------------


def _velocity(x, sigma):
    return x - sigma[:, None]


@pytest.mark.parametrize(
    "model, got",
    [
        (GMM, "acceptance\\(1, 1\\) raised"),
        (_velocity, "acceptance\\(1, 1\\) raised"),
        (torch.nn.Linear(4, 4), "torch.nn.Module"),
        (lambda level, k: torch.ones(3), "returned a tensor of shape \\(3,\\)"),
        ("grs", "got str"),
    ],
)
def test_optimal_given_a_model_says_what_to_pass(model, got):
    with pytest.raises(TypeError, match=r"acceptance must be a function acceptance\(l, k\)") as err:
        trees.optimal(model, 14, 3)
    msg = str(err.value)
    assert "plan_tree(model, x" in msg and "acceptance_model" in msg, msg
    assert re.search(got, msg), msg


# -- item 5: the model's own NaN is the model's -----------------------------------------------------


class NaNAtFourthCall:
    """The mixture's velocity, but the fourth call's row ``row`` comes out NaN; it records the
    trajectory (its ``traj`` conditioning) and the noise level of that row."""

    __name__ = "velocity"

    def __init__(self, row: int = 1) -> None:
        self.calls, self.row, self.at = 0, row, None

    def __call__(self, x, sigma, traj):
        self.calls += 1
        v = GMM(x, sigma)
        if self.calls == 4:
            v = v.clone()
            v[self.row] = math.nan
            self.at = (int(traj[self.row]), float(sigma[self.row]))
        return v


def _grid_step(level: float, sigmas: torch.Tensor) -> int:
    return int((sigmas - level).abs().argmin())


@pytest.mark.parametrize(
    "opts",
    [
        dict(tree=None),
        dict(tree=trees.uniform(2, 2), coupling="grs"),
        dict(tree=trees.chain(4), coupling="rmc"),
        dict(tree=trees.uniform(2, 3), coupling="grs", lazy=True),
        dict(tree=planning.AdaptiveTree(6), coupling="grs"),
    ],
    ids=["standard", "uniform", "chain", "lazy", "adaptive"],
)
def test_a_model_that_returns_nan_is_named_with_its_step_and_rows(opts):
    model = NaNAtFourthCall()
    grid = specforest.sde.flow_match_grid(40).double()
    with pytest.raises(FloatingPointError) as err:
        specforest.sample(model, X, steps=40, churn=0.3, seed=0, cond={"traj": torch.arange(3)}, **opts)
    traj, level = model.at
    msg = str(err.value)
    assert "draft" not in msg.split(":")[0], msg
    expected = rf"model 'velocity' returned NaN or inf at step {_grid_step(level, grid)} \(noise level {level:.6g}\)"
    assert re.match(expected, msg), (expected, msg)
    assert f"for rows [{traj}] of the batch" in msg, msg


def test_kdiffusion_names_the_denoiser_that_returns_nan():
    calls, at = [], []

    def denoiser(x, sigma, traj):
        calls.append(1)
        d = x * 0.5
        if len(calls) == 4:
            d = d.clone()
            d[0] = math.nan
            at.append((int(traj[0]), float(sigma[0])))
        return d

    sigmas = torch.cat([torch.linspace(10.0, 0.1, 20, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)])
    noise = streams.randn(0, torch.arange(3), (4,), dtype=torch.float64)
    with pytest.raises(FloatingPointError) as err:
        sample_speculative(
            denoiser,
            noise * sigmas[0],
            sigmas,
            extra_args={"traj": torch.arange(3)},
            row_args=("traj",),
            churn=0.5,
            tree=trees.uniform(2, 2),
            seed=0,
        )
    traj, sigma = at[0]
    msg = str(err.value)
    assert msg.startswith(f"model 'denoiser' returned NaN or inf at step {_grid_step(sigma, sigmas)} "), msg
    assert f"for rows [{traj}] of the batch" in msg, msg


class NaNCheapBranch(testing.X0Features):
    """A draft's own failure: the cached draft's cheap evaluation comes out NaN below level 0.5, so
    its drafted states are NaN, and the model's output at them is NaN one step later."""

    def from_features(self, x, sigma, f, **cond):
        out = super().from_features(x, sigma, f, **cond)
        return torch.where((sigma < 0.5)[:, None], math.nan, out)


def test_a_draft_that_goes_nan_first_is_still_the_draft_named():
    model = NaNCheapBranch(GMM)
    with pytest.raises(FloatingPointError, match=r"^draft 'cached' gave a NaN or inf mean at step \d+"):
        specforest.sample(model, X, steps=20, churn=0.3, seed=0, tree=trees.chain(3), draft="cached")


def test_the_target_record_of_bad_rows_stays_bounded_and_keeps_the_first():
    """A standard run reads its NaN flag only at its end: the rows' flags of its calls are folded per
    trajectory beyond FOLD_CALLS calls (memory of the batch, not of the run), and the first bad step
    survives the folding."""
    grid = torch.linspace(1.0, 0.0, 101, dtype=torch.float64)
    target = Target(GMM, (4,), torch.float64, None, {}, {}, batch=3, grid=grid)
    traj = torch.arange(3)
    for step in range(100):
        x = X.clone()
        if step >= 7:
            x[2] = math.nan  # from step 7 on, trajectory 2's state (and so the model's output) is NaN
        target(x, grid[step].expand(3), traj)
        assert len(target._unread) <= FOLD_CALLS
    assert target.first_bad() == (7, float(grid[7]), [2])
    with pytest.raises(
        FloatingPointError, match=r"model 'GaussianMixture' returned NaN or inf at step 7 .* rows \[2\]"
    ):
        target.check_finite()


# -- item 12: integer velocities, churn's reasons ---------------------------------------------------


@pytest.mark.parametrize("tree", [None, trees.uniform(2, 2)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_a_model_that_returns_integers_is_refused_not_truncated(tree, dtype):
    def rounded(x, sigma):
        return GMM(x, sigma).round().to(dtype)

    with pytest.raises(TypeError, match=f"model 'rounded' returned a {dtype} tensor: it must return floating-point"):
        specforest.sample(rounded, X, tree=tree, **RUN)


@pytest.mark.parametrize(
    "churn, reason",
    [
        (0.0, "point masses"),
        (-0.5, "below 0 is none"),
        (1.5, "churn 1 is already the standard reverse-time SDE"),
        (math.nan, "must be a finite number"),
        (math.inf, "must be a finite number"),
    ],
)
def test_churn_errors_give_the_range_and_the_reason_of_each_case(churn, reason):
    for check in (
        lambda: validation.check_churn(churn),
        lambda: specforest.sample(Counting(), X, steps=6, churn=churn),
    ):
        with pytest.raises(ValueError, match=r"churn must be in \(0, 1\], got ") as err:
            check()
        msg = str(err.value)
        assert reason in msg, msg
        # the churn-0 explanation only where churn is 0
        assert ("point masses" in msg) == (churn == 0.0), msg


# -- item 11: seeds and sample indices --------------------------------------------------------------

BAD_SEEDS = [-1, 2**64, 2**70, -(2**63)]


@pytest.mark.parametrize("seed", BAD_SEEDS)
def test_a_seed_outside_its_range_is_refused_everywhere_it_enters(seed):
    model = Counting()
    match = r"seed must be an int in \[0, 2\*\*64\)"
    with pytest.raises(ValueError, match=match):
        specforest.sample(model, X, steps=6, churn=0.3, seed=seed)
    with pytest.raises(ValueError, match=match):
        specforest.generate(model, count=3, make_x=lambda i: streams.randn(0, i, (4,)), seed=seed, steps=6, churn=0.3)
    with pytest.raises(ValueError, match=match):
        sample_speculative(model, X, torch.tensor([1.0, 0.5, 0.0]), churn=0.3, seed=seed)
    with pytest.raises(ValueError, match=match):
        streams.randn(seed, torch.arange(3), (4,))
    with pytest.raises(ValueError, match=match):
        streams.sample_keys(seed, torch.arange(3))
    assert model.calls == 0


def test_the_largest_seed_is_its_own_run():
    """``2**64 - 1`` is a seed of its own; ``-1`` ran as it (a seed taken modulo ``2**64``)."""
    top = specforest.sample(GMM, X, steps=6, churn=0.3, seed=2**64 - 1).samples
    assert not torch.equal(top, specforest.sample(GMM, X, steps=6, churn=0.3, seed=0).samples)
    assert torch.equal(streams.randn(2**64 - 1, [0], (4,)), streams.randn(2**64 - 1, [0], (4,)))


@pytest.mark.parametrize("index", [[0, 0, 1], [5, 2, 5], torch.tensor([7, 7, 7])])
def test_repeated_sample_indices_are_refused_everywhere_they_enter(index):
    model = Counting()
    dup = int(torch.as_tensor(index).mode().values)
    match = rf"must not repeat: each index is one sample, but {dup} appears more than once"
    with pytest.raises(ValueError, match="sample_index " + match):
        specforest.sample(model, X, steps=6, churn=0.3, seed=0, sample_index=index)
    with pytest.raises(ValueError, match="sample_index " + match):
        sample_speculative(model, X, torch.tensor([1.0, 0.5, 0.0]), churn=0.3, seed=0, sample_index=index)
    with pytest.raises(ValueError, match="index " + match):
        streams.randn(0, index, (4,))
    with pytest.raises(ValueError, match="indices " + match):
        specforest.generate(
            model, indices=index, make_x=lambda i: streams.randn(0, i, (4,)), seed=0, steps=6, churn=0.3
        )
    assert model.calls == 0


def test_indices_are_checked_with_one_host_read_whatever_their_length():
    """Tensor ops, not a loop over the elements: a valid index of 10,000 samples costs one read."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("_local_scalar_dense", "item", "is_nonzero", "nonzero"):
                Reads.count += 1
            return func(*args, **(kwargs or {}))

    idx = torch.randperm(10_000, generator=torch.Generator().manual_seed(0))
    with Reads():
        assert torch.equal(validation.check_indices("sample_index", idx, length=10_000, unique=True), idx)
    assert Reads.count <= 1


# -- property tests of the new bounds ---------------------------------------------------------------

_OUT_OF_RANGE_SEEDS = st.one_of(st.integers(max_value=-1), st.integers(min_value=2**64))


@PROPS
@given(seed=_OUT_OF_RANGE_SEEDS)
def test_random_seeds_outside_the_range_are_refused_by_name(seed):
    model = Counting()
    for call in (
        lambda: specforest.sample(model, X, steps=6, churn=0.3, seed=seed),
        lambda: streams.randn(seed, torch.arange(2), (4,)),
        lambda: specforest.generate(
            model, count=2, make_x=lambda i: streams.randn(0, i, (4,)), seed=seed, steps=6, churn=0.3
        ),
    ):
        with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\)"):
            call()
    assert model.calls == 0


@st.composite
def _with_a_repeat(draw):
    """Distinct indices in [0, 2**63) with one of them written twice, at a random place."""
    idx = draw(st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=5, unique=True))
    twin = draw(st.sampled_from(idx))
    at = draw(st.integers(0, len(idx)))
    return idx[:at] + [twin] + idx[at:], twin


@PROPS
@given(case=_with_a_repeat())
def test_random_repeated_indices_are_refused_by_name(case):
    index, twin = case
    model = Counting()
    x = streams.randn(0, torch.arange(len(index)), (4,), dtype=torch.float64)
    with pytest.raises(ValueError, match=f"sample_index must not repeat: .* but {twin} appears"):
        specforest.sample(model, x, steps=6, churn=0.3, seed=0, sample_index=index)
    with pytest.raises(ValueError, match=f"index must not repeat: .* but {twin} appears"):
        streams.randn(0, index, (4,))
    assert model.calls == 0


_PAST_THE_CAP = st.integers(_MAX_NODES, 10**15)


@st.composite
def _tree_past_the_cap(draw):
    """A constructor call whose tree would exceed the node cap (every one of them, at random sizes)."""
    n = draw(_PAST_THE_CAP)
    kind = draw(
        st.sampled_from(["chain", "uniform-1", "uniform", "widths", "from_parents", "optimal", "adaptive", "make_tree"])
    )
    if kind == "chain":
        return lambda: trees.chain(n)
    if kind == "uniform-1":
        return lambda: trees.uniform(1, n)
    if kind == "uniform":
        # K >= 2 and L >= 26: at least 2**27 - 1 nodes
        K, L = draw(st.integers(2, 10**9)), draw(st.integers(26, 10**12))
        return lambda: trees.uniform(K, L)
    if kind == "widths":
        return lambda: trees.widths(range(1, n + 1))
    if kind == "from_parents":
        return lambda: trees.from_parents(range(-1, n))
    if kind == "optimal":
        depth = draw(st.integers(1, 10**9))
        return lambda: trees.optimal(lambda level, k: 0.5, n, depth)
    if kind == "adaptive":
        return lambda: planning.AdaptiveTree(n)
    return lambda: planning.make_tree(L=n, coupling="rmc")


@PROPS
@given(build=_tree_past_the_cap())
def test_random_trees_past_the_node_cap_are_refused_at_once(build):
    with pytest.raises(ValueError, match=f"the tree would have more than {_MAX_NODES} nodes"):
        build()
