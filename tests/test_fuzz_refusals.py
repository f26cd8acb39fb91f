"""Property-based tests of the public boundary (hypothesis): invalid inputs.

Invalid inputs drawn at random raise ``ValueError``/``TypeError`` naming the
parameter, before the model is called (the CLI: a click error, exit status 2
for a value click refuses, 1 for one the library refuses, never a traceback).
Valid inputs and the chain's law: ``test_fuzz.py``.

Every example is derandomized and the seeds are fixed, so CI sees the same
cases each run.
"""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import invoke, never_called, refused
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz import FAST, GAUSS, Counting

import specforest
from specforest import streams, trees
from specforest.cli import main as cli_main
from specforest.cli.common import MAX_THREADS
from specforest.couplings import available_couplings, get_coupling
from specforest.experiments import generate as gen_exp
from specforest.experiments import gmm as gmm_exp
from specforest.latency import CostCurve, Tuned
from specforest.models import GaussianMixture
from specforest.planning import AdaptiveTree
from specforest.proposals import available_drafts
from specforest.sampler import GRIDS, PREFETCH_POLICIES
from specforest.sde import MAX_STEPS
from specforest.trees import VERIFY_MODES

# -- invalid inputs: the library --------------------------------------------------------------

_NOT_NUMBERS = st.one_of(st.text(max_size=3), st.none(), st.lists(st.integers(), max_size=2), st.just(torch.ones(2)))
_BAD_FLOAT = st.one_of(st.just(math.nan), st.just(math.inf), st.just(-math.inf))


def _not_in(names) -> st.SearchStrategy:
    low = {n.lower() for n in names}
    return st.one_of(
        st.text(max_size=8).filter(lambda s: s.lower() not in low),
        st.integers(),
        st.none(),
        st.lists(st.text(), max_size=1),
    )


def _bad_sigmas() -> st.SearchStrategy:
    up = st.lists(st.floats(0.01, 0.99), min_size=2, max_size=5, unique=True).map(lambda v: sorted(v) + [0.0])
    return st.one_of(
        up.map(torch.tensor),  # increasing
        st.floats(1.001, 10.0).map(lambda a: torch.tensor([a, 0.5, 0.0])),  # starts above 1
        st.floats(0.01, 0.5).map(lambda a: torch.tensor([1.0, 0.6, a])),  # does not end at 0
        st.just(torch.tensor([1.0, math.nan, 0.0])),
        st.just(torch.tensor([1.0, 0.5, 0.0]) * 1j),
        st.just(torch.ones(2, 2)),
        st.text(max_size=3),
        st.just(torch.tensor([0.0])),
    )


# parameter -> strategy of invalid values (each error must name the parameter)
INVALID_SAMPLE = {
    "steps": st.one_of(
        st.integers(max_value=0), st.integers(MAX_STEPS + 1), st.floats(), st.booleans(), st.text(max_size=2)
    ),
    "churn": st.one_of(
        st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True), _BAD_FLOAT, _NOT_NUMBERS, st.booleans()
    ),
    "shift": st.one_of(st.floats(max_value=0.0), _BAD_FLOAT, _NOT_NUMBERS, st.booleans(), st.floats(1e17, 1e300)),
    "grid": _not_in(GRIDS),
    "tree": st.one_of(st.integers(), st.text(max_size=4), st.lists(st.integers(), max_size=3)),
    "coupling": _not_in(available_couplings()),
    "draft": st.one_of(st.text(max_size=8).filter(lambda s: s not in available_drafts()), st.integers(), st.none()),
    "prefetch": _not_in(PREFETCH_POLICIES),
    "verify": _not_in(VERIFY_MODES),
    "max_rows": st.one_of(st.integers(max_value=0), st.floats(), st.booleans(), st.text(max_size=2)),
    "seed": st.one_of(st.floats(), st.text(max_size=2), st.lists(st.integers(), max_size=2)),
    "generator": st.one_of(st.integers(), st.text(max_size=2), st.lists(st.integers(), min_size=1, max_size=2)),
    "sample_index": st.one_of(
        st.lists(st.integers(0, 10), max_size=3),  # wrong length
        st.lists(st.integers(max_value=-1), min_size=4, max_size=4),
        st.lists(st.floats(0, 9), min_size=4, max_size=4),
        st.lists(st.integers(min_value=2**64), min_size=4, max_size=4),
        st.text(min_size=4, max_size=4),
    ),
    "cond": st.one_of(
        st.integers(),
        st.lists(st.integers(), max_size=2),
        st.integers(0, 3).map(lambda n: {"label": torch.zeros(n)}),
        st.integers().map(lambda k: {k: torch.zeros(4)}),
        st.just({"label": 3}),
    ),
    "model_kwargs": st.one_of(st.integers(), st.lists(st.integers(), max_size=2), st.integers().map(lambda k: {k: 1})),
    "lazy": st.one_of(st.integers(), st.none(), st.text(max_size=2)),
    "record_deltas": st.one_of(st.integers(), st.none(), st.text(max_size=2)),
    "progress": st.one_of(st.integers(), st.none(), st.text(max_size=2)),
    "pad_rows": st.one_of(
        st.integers(),
        st.text(max_size=4).filter(lambda s: s != "pow2"),
        st.just([]),
        st.lists(st.integers(max_value=0), min_size=1, max_size=3),
        st.lists(st.floats(1, 9), min_size=1, max_size=2),
    ),
    "callback": st.one_of(st.integers(), st.text(max_size=2)),
    "sigmas": _bad_sigmas(),
}


def _expect_named(fn, *names: str) -> None:
    with pytest.raises((ValueError, TypeError)) as err:
        fn()
    msg = str(err.value)
    assert any(n in msg for n in names), f"{names} not named in {type(err.value).__name__}: {msg}"


@FAST
@given(data=st.data(), param=st.sampled_from(sorted(INVALID_SAMPLE)))
def test_random_invalid_sample_options_are_refused_by_name(data, param):
    bad = data.draw(INVALID_SAMPLE[param], label=param)
    opts = dict(steps=6, churn=0.5, tree=trees.uniform(2, 2), seed=0)
    if param == "sigmas":
        opts["steps"] = None
    if param == "generator":
        opts["seed"] = None
    opts[param] = bad
    model = Counting()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    names = {"cond": ("cond",), "sigmas": ("sigmas",), "model_kwargs": ("model_kwargs",)}.get(param, (param,))
    _expect_named(lambda: specforest.sample(model, x, **opts), *names)
    assert model.calls == 0, f"{param}={bad!r} reached the model before it was refused"


@st.composite
def incompatible_tree_and_coupling(draw):
    """A tree the coupling cannot take: rmc with a node of 2+ children, antithetic with an odd width,
    widths that differ between layers, or an adaptive policy."""
    case = draw(st.sampled_from(["rmc", "antithetic-odd", "antithetic-mixed", "antithetic-adaptive"]))
    if case == "rmc":
        return "rmc", trees.uniform(draw(st.integers(2, 4)), draw(st.integers(1, 2)))
    if case == "antithetic-odd":
        return "antithetic", trees.uniform(draw(st.sampled_from([1, 3, 5])), draw(st.integers(1, 2)))
    if case == "antithetic-mixed":
        return "antithetic", trees.widths([2, 4] if draw(st.booleans()) else [4, 2])
    return "antithetic", AdaptiveTree(draw(st.integers(2, 6)))


@settings(max_examples=20, deadline=None, derandomize=True)
@given(pair=incompatible_tree_and_coupling())
def test_a_tree_the_coupling_cannot_take_is_refused_by_name(pair):
    coupling, tree = pair
    model = Counting()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    _expect_named(
        lambda: specforest.sample(model, x, steps=6, churn=0.5, tree=tree, coupling=coupling), "tree", coupling
    )
    assert model.calls == 0


_BAD_X = st.one_of(
    st.lists(st.floats(), max_size=3),
    st.just(torch.zeros(3)),
    st.just(torch.zeros(0, 3)),
    st.just(torch.zeros(4, 3, dtype=torch.long)),
    st.sampled_from([math.nan, math.inf, -math.inf]).map(lambda v: torch.tensor([[0.0, v, 0.0]] * 4)),
)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(x=_BAD_X)
def test_random_invalid_initial_states_are_refused_by_name(x):
    model = Counting()
    _expect_named(lambda: specforest.sample(model, x, steps=6, churn=0.5), "x")
    assert model.calls == 0


INVALID_GENERATE = {
    "count": st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63), st.floats(), st.text(max_size=2)),
    "indices": st.one_of(
        st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
        st.lists(st.floats(0, 9), min_size=1, max_size=3),
        st.integers(0, 9).map(lambda i: [i, i]),
        st.lists(st.integers(min_value=2**64), min_size=1, max_size=2),
        st.text(min_size=1, max_size=3),
        st.just([[0, 1]]),
        st.just({1, 2}),
        st.just([None]),
    ),
    "seed": st.one_of(st.floats(), st.none(), st.text(max_size=2)),
    "batch": st.one_of(st.integers(max_value=0), st.floats(), st.text(max_size=2)),
    "make_x": st.one_of(
        st.integers(),
        st.none(),
        st.just(lambda i: torch.zeros(len(i))),  # no state dimension
        st.just(lambda i: torch.zeros(1, 3)),  # wrong rows
        st.just(lambda i: torch.full((len(i), 3), math.nan)),
        st.just(lambda i: torch.zeros(len(i), 3, dtype=torch.long)),
        st.just(lambda i: [[0.0] * 3] * len(i)),
    ),
    "make_cond": st.one_of(
        st.integers(),
        st.just(lambda i: [1]),
        st.just(lambda i: {1: torch.zeros(len(i))}),
        st.just(lambda i: {"label": torch.zeros(1)}),
    ),
}


@FAST
@given(data=st.data(), param=st.sampled_from(sorted(INVALID_GENERATE) + ["steps", "churn", "coupling", "pad_rows"]))
def test_random_invalid_generate_options_are_refused_by_name(data, param):
    strategy = INVALID_GENERATE[param] if param in INVALID_GENERATE else INVALID_SAMPLE[param]
    bad = data.draw(strategy, label=param)
    opts = dict(count=5, make_x=lambda i: streams.randn(0, i, (3,)), seed=0, batch=2, steps=6, churn=0.5)
    opts["tree"] = trees.uniform(2, 2)
    if param == "indices":
        del opts["count"]
    opts[param] = bad
    model = Counting()
    _expect_named(lambda: list(specforest.generate(model, **opts)), param)
    assert model.calls == 0, f"{param}={bad!r} reached the model before it was refused"


INVALID_TREES = {
    "chain": (
        lambda L: trees.chain(L),
        st.one_of(st.integers(max_value=0), st.floats(), st.booleans(), st.text(max_size=2)),
        ("L",),
    ),
    "uniform-K": (
        lambda K: trees.uniform(K, 2),
        st.one_of(st.integers(max_value=0), st.floats(), st.booleans(), st.none()),
        ("K",),
    ),
    "uniform-L": (
        lambda L: trees.uniform(2, L),
        st.one_of(st.integers(max_value=0), st.floats(), st.booleans(), st.none()),
        ("L",),
    ),
    "widths": (
        trees.widths,
        st.one_of(
            st.integers(),
            st.none(),
            st.text(min_size=1, max_size=3),
            st.lists(st.integers(max_value=0), min_size=1, max_size=3),
            st.lists(st.floats(1.01, 3.99), min_size=1, max_size=3),  # 2.5 is not 2
            st.lists(st.sampled_from([math.nan, math.inf, None, "2"]), min_size=1, max_size=2),
            st.just([10**4, 10**4]),
        ),
        ("ks", "K", "nodes"),
    ),
    "from_parents": (
        trees.from_parents,
        st.one_of(
            st.integers(),
            st.none(),
            st.just([]),
            st.lists(st.integers(0, 5), min_size=1, max_size=5),  # no root
            st.integers(2, 5).map(lambda n: [-1] * n),  # several roots
            st.integers(1, 4).map(lambda n: [-1] + [n + 1] * n),  # a parent out of range
            st.just([-1, 2, 1]),  # a cycle
            st.lists(st.sampled_from([0.5, math.nan, math.inf, "0", None]), min_size=1, max_size=2).map(
                lambda v: [-1, *v]
            ),
            st.just(torch.tensor([-1.0, 0.0])),
        ),
        ("parents",),
    ),
    "DraftTree": (
        lambda pd: trees.DraftTree(*pd),
        st.sampled_from(
            [
                (torch.tensor([-1.0, 0.0]), torch.tensor([0.0, 1.0])),
                ([-1, 0], [0, 1]),
                (torch.tensor([-1, 0]), torch.tensor([0, 2])),
                (torch.tensor([0, 0]), torch.tensor([0, 1])),
                (torch.tensor([-1, 0, 0]), torch.tensor([0, 1])),
            ]
        ),
        ("parent", "depth", "root", "breadth-first"),
    ),
    "truncate": (
        lambda m: trees.uniform(2, 2).truncate(m),
        st.one_of(st.integers(max_value=-1), st.floats(), st.none()),
        ("m",),
    ),
}


@FAST
@given(data=st.data(), which=st.sampled_from(sorted(INVALID_TREES)))
def test_random_invalid_tree_specs_are_refused_by_name(data, which):
    build, strategy, names = INVALID_TREES[which]
    bad = data.draw(strategy, label=which)
    _expect_named(lambda: build(bad), *names)


def _coupling_args(name: str, P: int = 5, D: int = 3) -> dict:
    """Valid arguments of a direct call of the named coupling (structured children where it needs them)."""
    cp = get_coupling(name)
    K = 1 if cp.max_children == 1 else 2
    g = torch.Generator().manual_seed(0)
    mu_p = torch.randn(P, D, generator=g)
    z = torch.randn(P, K, D, generator=g)
    z = cp.structure_noise(z) if cp.structured_siblings else z
    scale = torch.full((P,), 0.4, dtype=torch.float64)
    return dict(
        mu_p=mu_p,
        mu_q=mu_p + 0.2,
        scale=scale,
        children=mu_p[:, None] + 0.4 * z,
        valid=torch.ones(P, K, dtype=torch.bool),
    )


# argument -> function of the valid arguments giving an invalid value
INVALID_CALL = {
    "scale": [
        lambda a: torch.zeros_like(a["scale"]),
        lambda a: -a["scale"],
        lambda a: a["scale"] * math.nan,
        lambda a: a["scale"][:-1],
        lambda a: 0.4,
    ],
    "mu_p": [lambda a: a["mu_p"][:-1], lambda a: a["mu_p"] * math.inf, lambda a: a["mu_p"].long(), lambda a: None],
    "mu_q": [lambda a: a["mu_q"][:, :-1], lambda a: a["mu_q"] * math.nan],
    "children": [
        lambda a: a["children"][:, 0],
        lambda a: a["children"] * math.nan,
        lambda a: a["children"][:, :0],
        lambda a: [],
    ],
    "valid": [
        lambda a: torch.zeros_like(a["valid"]),
        lambda a: a["valid"].float(),
        lambda a: a["valid"][:, :0],
        lambda a: None,
    ],
    "generator": [lambda a: 3, lambda a: "seed"],
}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    name=st.sampled_from(available_couplings()),
    arg=st.sampled_from(sorted(INVALID_CALL)),
    which=st.integers(0, 4),
)
def test_random_invalid_arguments_of_a_direct_coupling_call_are_refused_by_name(name, arg, which):
    args = _coupling_args(name)
    makers = INVALID_CALL[arg]
    args[arg] = makers[which % len(makers)](args)
    _expect_named(lambda: get_coupling(name)(**args), arg)


# -- invalid inputs: the CLI ----------------------------------------------------------------

# option -> strategy of values click or the library refuses; the error must name the option
INVALID_CLI = {
    "--K": st.one_of(st.integers(max_value=0).map(str), st.just("x"), st.just("2.5")),
    "--L": st.one_of(st.integers(max_value=0).map(str), st.just("x")),
    "--steps": st.one_of(st.integers(max_value=2).map(str), st.integers(MAX_STEPS + 1).map(str), st.just("many")),
    "--churn": st.one_of(
        st.floats(max_value=0.0).map(repr),
        st.floats(1.0, 1e9, exclude_min=True).map(repr),
        st.sampled_from(["nan", "inf", "x"]),
    ),
    "--trajectories": st.integers(max_value=0).map(str),
    "--dim": st.integers(max_value=0).map(str),
    "--components": st.integers(max_value=0).map(str),
    "--seed": st.integers(max_value=-1).map(str),
    "--mixture-seed": st.one_of(st.integers(max_value=-1), st.integers(min_value=2**64)).map(str),
    "--memory-gb": st.one_of(st.floats(max_value=0.0).map(repr), st.sampled_from(["nan", "inf", "x"])),
    "--threads": st.one_of(st.integers(max_value=0), st.integers(MAX_THREADS + 1)).map(str),
    "--budget": st.integers(max_value=0).map(str),
    "--method": st.text(min_size=1, max_size=8).filter(lambda s: s not in gmm_exp.METHODS and not s.startswith("-")),
    "--tree": st.sampled_from(["x", "chain", "UNIFORM2"]),
    "--draft": st.sampled_from(["x", "noise", "velocity2"]),
    "--verify": st.sampled_from(["x", "all"]),
    "--prefetch": st.sampled_from(["x", "child"]),
    "--grid": st.sampled_from(["x", "karras"]),
}
# combinations the library refuses (exit status 1, the message naming what is wrong)
INVALID_CLI_COMBOS = [
    (["--method", "antithetic", "--K", "3"], "K"),
    (["--tree", "optimal"], "budget"),
    (["--tree", "adaptive", "--budget", "4", "--method", "antithetic"], "adaptive"),
    (["--memory-gb", "1e-12"], "memory"),
]


def _expect_cli_error(args: list, *names: str) -> None:
    base = ["gmm", "--dim", "2", "--steps", "4", "--trajectories", "2", "--K", "2", "--L", "2", "--no-progress"]
    res = CliRunner().invoke(cli_main, base + args)
    # a click error ends in SystemExit; any other exception is a traceback from inside
    assert isinstance(res.exception, SystemExit), (args, res.exception, res.output)
    assert res.exit_code in (1, 2) and "Error" in res.output, (args, res.exit_code, res.output)
    assert any(n in res.output for n in names), (args, res.output)


@FAST
@given(data=st.data(), opt=st.sampled_from(sorted(INVALID_CLI)))
def test_random_invalid_cli_options_are_click_errors_naming_the_option(data, opt):
    bad = data.draw(INVALID_CLI[opt], label=opt)
    name = opt.lstrip("-")
    _expect_cli_error([opt, bad], opt, name.replace("-", "_"))


@pytest.mark.parametrize("args,name", INVALID_CLI_COMBOS)
def test_cli_combinations_the_library_refuses_are_click_errors(args, name):
    _expect_cli_error(args, name)


# -- the bounds of issue 40: a job's count, a tuned file's fields, every output path ------------------

# (the fixtures patch a function once for all the examples; tmp_path is shared by them, and each
# example checks that nothing is written to it)
BOUNDS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture
def job_unread(monkeypatch):
    """Reading a job's shards (after its options are written) raises: a count the job cannot hold
    must be refused before, not listed in memory."""
    monkeypatch.setattr(gen_exp, "done_indices", never_called)


@BOUNDS
@given(count=st.one_of(st.integers(10**13, 2**63 - 1), st.integers(2**63, 2**200)))
def test_random_counts_a_job_cannot_hold_are_refused_before_anything_is_written(count, tmp_path, job_unread):
    out = tmp_path / "g.npz"
    args = ["generate", "gmm", "--dim", "2", "--steps", "4", "--count", str(count), "--out", str(out), "--no-progress"]
    refused(invoke(*args), "--count", "[1, ", codes=(1, 2))
    assert not any(tmp_path.iterdir())


@FAST
@given(count=st.integers(2**63, 2**200))
def test_random_counts_beyond_a_sample_index_are_refused_by_generate(count):
    model = Counting()
    opts = dict(make_x=lambda i: streams.randn(0, i, (3,)), seed=0, steps=4, churn=0.5)
    _expect_named(lambda: specforest.generate(model, count=count, **opts), "count must be an int >= 0 and <= 2**63 - 1")
    assert model.calls == 0


def _tuned_json() -> dict:
    return Tuned(
        label="fuzz",
        tree=trees.uniform(2, 2),
        coupling="grs",
        verify="internal",
        draft="x0",
        batch=2,
        steps=8,
        predicted_seconds_per_image=1.0,
        predicted_speedup=1.5,
        standard_seconds_per_image=1.5,
        predicted_calls=5.0,
        curve=CostCurve((1, 4), (1.0, 2.0)),
        churn=0.3,
        prefetch="nearest",
        measured_speedup=1.4,
    ).to_json()


_NEGATIVE = st.floats(max_value=0.0, exclude_max=True)
_NOT_A_TIME = st.one_of(_NEGATIVE, _BAD_FLOAT, st.text(max_size=2), st.none(), st.booleans())
_NOT_A_RATIO = st.one_of(_NEGATIVE, st.just(math.nan), st.text(max_size=2), st.booleans())

# field of a tuned file -> strategy of invalid values (each error must name the field)
INVALID_TUNED = {
    "label": st.one_of(st.integers(), st.none(), st.lists(st.text(), max_size=1)),
    "tree": st.one_of(
        st.integers(),
        st.text(max_size=3),
        st.just([]),
        st.lists(st.integers(0, 4), min_size=1, max_size=4),  # no root
        st.just([-1]),  # a root alone: depth 0
        st.just([-1, 0.5]),
    ),
    "coupling": _not_in(available_couplings()),
    "draft": _not_in(available_drafts()),
    "verify": _not_in(VERIFY_MODES),
    "prefetch": _not_in(PREFETCH_POLICIES),
    "batch": st.one_of(st.integers(max_value=0), st.floats(), st.booleans(), st.text(max_size=2), st.none()),
    "steps": st.one_of(
        st.integers(max_value=0), st.integers(MAX_STEPS + 1), st.floats(), st.booleans(), st.text(max_size=2)
    ),
    "churn": st.one_of(
        st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True), _BAD_FLOAT, st.text(max_size=2)
    ),
    "predicted_seconds_per_image": _NOT_A_TIME,
    "standard_seconds_per_image": _NOT_A_TIME,
    "predicted_calls": _NOT_A_TIME,
    "predicted_speedup": st.one_of(_NOT_A_RATIO, st.none()),
    "measured_speedup": _NOT_A_RATIO,
    "cost_curve": st.one_of(
        st.integers(),
        st.just({}),
        st.lists(st.integers(1, 64), min_size=2, max_size=4, unique=True).map(
            lambda s: {"sizes": sorted(s, reverse=True), "seconds": [1.0] * len(s)}
        ),
        st.integers(1, 4).map(lambda n: {"sizes": list(range(1, n + 1)), "seconds": [1.0] * (n + 1)}),
        st.sampled_from([math.nan, -1.0, "1"]).map(lambda t: {"sizes": [1], "seconds": [t]}),
        st.just({"sizes": [0], "seconds": [1.0]}),
    ),
    "candidates": st.one_of(st.integers(), st.text(max_size=2), st.just([1]), st.just([{"seconds": 1.0}])),
}


@FAST
@given(data=st.data(), field=st.sampled_from(sorted(INVALID_TUNED)))
def test_random_invalid_fields_of_a_tuned_file_are_refused_by_name(data, field):
    bad = data.draw(INVALID_TUNED[field], label=field)
    tuned = _tuned_json()
    tuned[field] = bad
    _expect_named(lambda: Tuned.from_json(tuned), field)


@FAST
@given(name=st.text(min_size=1, max_size=12).filter(lambda k: k not in _tuned_json() and k != "tuned_for"))
def test_random_unknown_or_missing_fields_of_a_tuned_file_are_refused_by_name(name):
    tuned = _tuned_json()
    tuned[name] = 1
    _expect_named(lambda: Tuned.from_json(tuned), name)
    missing = _tuned_json()
    field = sorted(missing)[len(name) % len(missing)]
    if field not in ("churn", "prefetch", "candidates", "measured_speedup"):  # a file may predate these
        del missing[field]
        _expect_named(lambda: Tuned.from_json(missing), field)


# output option -> (the arguments before its path, the suffix written, whether it is a folder)
OUTPUTS = {
    "pixel --dump-samples": (["pixel", "--dump-samples"], ".npz", False),
    "gmm --dump-samples": (["gmm", "--dim", "2", "--dump-samples"], ".npz", False),
    "tune --out": (["tune", "--model", "gmm", "--out"], ".json", False),
    "generate gmm --out": (["generate", "gmm", "--count", "1", "--out"], ".npz", False),
    "couplings plot --out": (["couplings", "plot", "--out"], ".png", False),
    "gmm drafts --out": (["gmm", "drafts", "--out"], ".png", False),
    "gmm sweep --out": (["gmm", "sweep", "--out"], "", True),
    "pixel sweep --out": (["pixel", "sweep", "--out"], "", True),
    "train digits --out": (["train", "digits", "--out"], "", True),
    "train digits-draft --weights-dir": (["train", "digits-draft", "--weights-dir"], "", True),
    "train natural32 --out": (["train", "natural32", "--out"], "", True),
    "train natural64 --weights-dir": (["train", "natural64", "--weights-dir"], "", True),
    "train natural32-draft --out": (["train", "natural32-draft", "--out"], "", True),
    "train natural64-draft --weights-dir": (["train", "natural64-draft", "--weights-dir"], "", True),
}
UNWRITABLE = ("under-a-file", "a-folder-for-a-file") + (("proc",) if Path("/proc/self").is_dir() else ())


@BOUNDS
@given(
    option=st.sampled_from(sorted(OUTPUTS)),
    kind=st.sampled_from(UNWRITABLE),
    parts=st.lists(st.text("abcxyz_-", min_size=1, max_size=6), min_size=1, max_size=3),
)
def test_random_unwritable_output_paths_are_refused_naming_the_option(option, kind, parts, tmp_path, no_work):
    args, suffix, folder = OUTPUTS[option]
    regular = tmp_path / "file"
    regular.write_text("x")
    if kind == "under-a-file":
        path = Path(regular, *parts[:-1], parts[-1] + suffix)
    elif kind == "proc":
        path = Path("/proc", "specforest-fuzz", *parts[:-1], parts[-1] + suffix)
    elif folder:
        path = regular  # a folder's path that is a file
    else:
        path = tmp_path / (parts[-1] + suffix)  # a file's path that is a folder
        path.mkdir(exist_ok=True)
    before = sorted(tmp_path.rglob("*"))
    res = invoke(*args, path)
    refused(res, args[-1], codes=(1, 2))
    assert sorted(tmp_path.rglob("*")) == before, (option, kind, path)  # nothing written, not even the probe


# -- regression tests: what the fuzzer found --------------------------------------------------


def test_regression_tree_specs_do_not_truncate_or_crash():
    # widths([2.5]) built a K = 2 tree and from_parents([-1, 0.5]) a parent 0: both silently
    with pytest.raises(TypeError, match=r"ks\[0\] must be an int"):
        trees.widths([2.5])
    with pytest.raises(TypeError, match=r"parents\[1\] must be an int"):
        trees.from_parents([-1, 0.5])
    # OverflowError / IndexError / AttributeError from inside before
    with pytest.raises(TypeError, match=r"parents\[1\]"):
        trees.from_parents([-1, math.inf])
    with pytest.raises(TypeError, match="parent must be an integer tensor"):
        trees.DraftTree(torch.tensor([-1.0, 0.0]), torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="parent must be an integer tensor"):
        trees.DraftTree([-1, 0], [0, 1])
    with pytest.raises(TypeError, match="ks must be a sequence"):
        trees.widths(3)
    # numpy and torch integers still work
    assert trees.widths([np.int64(2), 3]).budget == 2 + 6
    assert trees.from_parents(torch.tensor([-1, 0, 0])).budget == 2


def test_regression_sample_options_refused_at_the_boundary():
    model = Counting()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    run = dict(steps=4, churn=0.5, seed=0)
    cases = [
        # (option, value, match): each failed inside the run before, or named nothing
        ("callback", 3, "callback must be None or callable"),  # "'int' object is not callable" after round 1
        ("progress", "no", "progress must be a bool"),  # drew a progress bar
        ("cond", {1: torch.zeros(4)}, "cond's keys must be str"),  # "keywords must be strings" from the call
        ("model_kwargs", {1: 1}, "model_kwargs' keys must be str"),
        ("sample_index", [2**64, 0, 1, 2], "sample_index must be 4 integers"),  # "Overflow when unpacking long long"
        ("sample_index", "abcd", "sample_index must be 4 integers"),  # "new(): invalid data type 'str'"
        ("steps", 10**10, r"steps must be in \[1, 1000000\]"),  # a RuntimeError of the allocator
    ]
    for name, value, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            specforest.sample(model, x, **{**run, name: value})
    with pytest.raises(TypeError, match="sigmas must be a real tensor"):
        specforest.sample(model, x, churn=0.5, sigmas=torch.tensor([1.0, 0.5, 0.0]) * 1j)  # imaginary part dropped
    with pytest.raises(TypeError, match="sigmas must be a"):
        specforest.sample(model, x, churn=0.5, sigmas="abc")
    with pytest.raises(ValueError, match="cond and model_kwargs both give"):
        specforest.sample(model, x, cond={"label": torch.zeros(4)}, model_kwargs={"label": 1}, **run)
    assert model.calls == 0


def test_regression_generate_names_its_bad_indices_and_make_x():
    model = Counting()
    opts = dict(make_x=lambda i: streams.randn(0, i, (3,), dtype=torch.float64), seed=0, steps=6, churn=0.5)
    for bad in ({1, 2}, [None], [2**64], "ab"):  # RuntimeError / unnamed errors from torch before
        with pytest.raises(ValueError, match="indices must be a 1-D sequence of integers"):
            specforest.generate(model, indices=bad, **opts)
    with pytest.raises(ValueError, match="make_cond must return a dict of tensors .* keyed by str"):
        list(specforest.generate(model, count=2, make_cond=lambda i: {1: torch.zeros(len(i))}, **opts))
    assert model.calls == 0

    # a refill whose make_x gives NaN was reported as "model returned NaN or inf"
    def make_x(i):
        x = streams.randn(0, i, (3,), dtype=torch.float64)
        return x if int(i.max()) < 2 else x * math.nan

    gen = specforest.generate(GAUSS, count=8, batch=2, tree=trees.uniform(2, 2), **{**opts, "make_x": make_x})
    with pytest.raises(ValueError, match="make_x must return finite floating-point states"):
        list(gen)


def test_regression_a_direct_coupling_call_checks_its_arguments():
    # a zero scale made the rank and antithetic residuals loop forever on a NaN delta; GRS returned NaN
    for name in ("rank", "antithetic", "grs"):
        args = _coupling_args(name)
        args["scale"] = torch.zeros_like(args["scale"])
        with pytest.raises(ValueError, match="scale must be finite and > 0"):
            get_coupling(name)(**args)
    args = _coupling_args("grs")
    args["valid"] = torch.zeros_like(args["valid"])  # NaN states before
    with pytest.raises(ValueError, match="valid must be a prefix of True"):
        get_coupling("grs")(**args)
    args = _coupling_args("grs")
    res = get_coupling("grs")(**args)  # the valid call still runs
    assert torch.isfinite(res.state).all()


def test_regression_cli_refuses_what_crashed_it():
    # --threads 1000000000 aborted the process inside OpenMP; --mixture-seed 2**64 said only
    # "Overflow when unpacking long long"; --memory-gb inf said "must be in (0.0, inf], got inf"
    _expect_cli_error(["--threads", str(10**9)], "--threads")
    _expect_cli_error(["--mixture-seed", str(2**64)], "--mixture-seed")
    _expect_cli_error(["--memory-gb", "inf"], "memory_gb must be a finite number > 0")
    with pytest.raises(ValueError, match="mixture_seed"):
        gmm_exp.GMMSetting(dim=2, mixture_seed=2**64)
    with pytest.raises(ValueError, match="seed"):
        GaussianMixture.paper(dim=2, seed=2**64)
