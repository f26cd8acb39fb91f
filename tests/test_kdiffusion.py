"""The k-diffusion sampler signature (specforest.kdiffusion).

k-diffusion itself does not import beside the pinned CPU torch (its package
``__init__`` imports every submodule, and ``utils`` imports torchvision), so these
tests check the contract as k-diffusion's ``sampling.py`` states it, with small
test-side versions written from the formulas: the Karras schedule
(``get_sigmas_karras``), ``to_d``, ``get_ancestral_step`` and an EDM-preconditioned
VE denoiser (``c_skip``, ``c_out``, ``c_in``, ``c_noise``) over an exact inner
network of a Gaussian data law, for which every chain's law has a closed form.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import specforest
from specforest import kdiffusion as kd
from specforest.models import GaussianMixture
from specforest.models.edm import EDMDenoiserVelocity

MU = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
TAU = 0.5  # data std, the denoiser's sigma_data
Z_TOL = 4.5


def karras_sigmas(n: int, sigma_min: float = 0.002, sigma_max: float = 80.0, rho: float = 7.0) -> torch.Tensor:
    """Karras et al. (2022) eq. (5), then a 0 appended: k-diffusion's ``get_sigmas_karras`` contract."""
    ramp = torch.linspace(0, 1, n, dtype=torch.float64)
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    s = (hi + ramp * (lo - hi)) ** rho
    return torch.cat([s, s.new_zeros(1)])


def to_d(x: torch.Tensor, sigma: torch.Tensor, denoised: torch.Tensor) -> torch.Tensor:
    """The Karras ODE derivative ``(x - D) / sigma``."""
    return (x - denoised) / sigma.reshape((-1,) + (1,) * (x.ndim - 1))


def ancestral_step(s: float, s_next: float, eta: float) -> tuple[float, float]:
    """``(sigma_down, sigma_up)`` of an ancestral step from ``s`` to ``s_next`` (k-diffusion's contract)."""
    up = min(s_next, eta * math.sqrt(s_next**2 * (s**2 - s_next**2) / s**2))
    return math.sqrt(s_next**2 - up**2), up


def chain_step(s: float, s_next: float, eps: float) -> tuple[float, float]:
    """``(sigma_down, sigma_up)`` of our chain's step, written in k-diffusion's terms (docs/kdiffusion.md)."""
    if s_next == 0.0:
        return 0.0, 0.0
    return s_next - eps**2 * (s - s_next), eps * math.sqrt(2 * s * (s - s_next) * (1 + s_next) / (1 + s))


class InnerNet:
    """The exact inner network ``F(c_in x, c_noise)`` of a Gaussian law, with optional class shifts."""

    def __call__(self, x_in: torch.Tensor, c_noise: torch.Tensor, labels=None, offset=0.0) -> torch.Tensor:
        s = (4 * c_noise).exp().reshape(-1, 1)
        mu = MU + offset if labels is None else MU + offset + labels.to(x_in.dtype)[:, None]
        x = x_in * (s * s + TAU**2).sqrt()  # undo c_in
        d = mu + TAU**2 / (TAU**2 + s * s) * (x - mu)
        c_skip, c_out = TAU**2 / (s * s + TAU**2), s * TAU / (s * s + TAU**2).sqrt()
        return (d - c_skip * x) / c_out


class KarrasDenoiser:
    """An EDM-preconditioned VE denoiser ``D(x, sigma) = c_skip x + c_out F(c_in x, c_noise)`` (k-diffusion's
    ``layers.Denoiser`` contract), counting its calls and recording the keyword arguments it sees."""

    def __init__(self, inner=None) -> None:
        self.inner = InnerNet() if inner is None else inner
        self.calls: list = []

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **kw) -> torch.Tensor:
        self.calls.append((x.shape[0], sigma.clone(), kw))
        s = sigma.to(x.dtype).reshape(-1, 1)
        c_skip = TAU**2 / (s * s + TAU**2)
        c_out = s * TAU / (s * s + TAU**2).sqrt()
        c_in = 1 / (s * s + TAU**2).sqrt()
        return c_skip * x + c_out * self.inner(c_in * x, s.log().reshape(-1) / 4, **kw)


def exact_denoiser(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    s2 = sigma.to(x.dtype).reshape(-1, 1) ** 2
    return MU + TAU**2 / (TAU**2 + s2) * (x - MU)


def chain_law(sigmas: torch.Tensor, eps: float) -> tuple[torch.Tensor, float]:
    """Mean ``(3,)`` and per-coordinate variance of the chain's final state from ``x = sigmas[0] * N(0, I)``,
    stepped in k-diffusion's terms (``x' = D + d sigma_down + sigma_up z``; ``D`` affine in ``x``)."""
    mean, var = torch.zeros(3, dtype=torch.float64), float(sigmas[0]) ** 2
    for i in range(len(sigmas) - 1):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        k = TAU**2 / (TAU**2 + s * s)  # D - MU = k (x - MU), d = (1 - k)(x - MU) / s
        down, up = chain_step(s, s_next, eps)
        a = k + (1 - k) * down / s
        mean, var = MU + a * (mean - MU), a * a * var + up * up
    return mean, var


def law_z(samples: torch.Tensor, sigmas: torch.Tensor, eps: float) -> float:
    """Largest |z| of the per-coordinate means and variances against :func:`chain_law`."""
    mean, var = chain_law(sigmas, eps)
    n = samples.shape[0]
    zm = (samples.double().mean(0) - mean) / math.sqrt(var / n)
    zv = (samples.double().var(0) - var) / (var * math.sqrt(2.0 / (n - 1)))
    return float(torch.cat([zm, zv]).abs().max())


SIGMAS = karras_sigmas(12)
CHURN = 0.5


def noise(batch: int, sigmas: torch.Tensor = SIGMAS, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(batch, 3, generator=torch.Generator().manual_seed(seed), dtype=dtype) * float(sigmas[0])


def test_signature_is_k_diffusions():
    params = list(inspect.signature(kd.sample_speculative).parameters.values())
    head = [(p.name, p.kind, p.default) for p in params[:6]]
    P = inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert head == [
        ("model", P, inspect.Parameter.empty),
        ("x", P, inspect.Parameter.empty),
        ("sigmas", P, inspect.Parameter.empty),
        ("extra_args", P, None),
        ("callback", P, None),
        ("disable", P, None),
    ]
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[6:-1])


def test_the_grid_is_t_equals_sigma_over_one_plus_sigma():
    t = kd.linear_grid(SIGMAS)
    assert t.dtype == torch.float64 and t.shape == SIGMAS.shape
    torch.testing.assert_close(t, SIGMAS / (1 + SIGMAS), rtol=0, atol=0)
    assert 0.98 < float(t[0]) < 1 and float(t[-1]) == 0.0 and bool((t[:-1] > t[1:]).all())
    # x / (1 + sigma) is the linear path at t: (1 - t) x0 + t xi for x = x0 + sigma xi
    x0, xi = torch.randn(2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    s = SIGMAS[3]
    torch.testing.assert_close((x0 + s * xi) / (1 + s), (1 - t[3]) * x0 + t[3] * xi)
    torch.testing.assert_close(kd.linear_grid(SIGMAS / 80.0, path="linear"), SIGMAS / 80.0, rtol=0, atol=0)


def _library_run(x, tree=None, coupling="grs", seed=3, dtype=torch.float64):
    """The library's sampler on the mapped grid, from the mapped state, over the EDM adapter."""
    t = SIGMAS / (1 + SIGMAS)
    vel = EDMDenoiserVelocity(exact_denoiser, sigma_min=0.5 * float(SIGMAS[-2]), sigma_max=2 * float(SIGMAS[0]))
    x_lin = x.to(dtype) / (1 + float(SIGMAS[0]))
    return specforest.sample(vel, x_lin, sigmas=t, churn=CHURN, seed=seed, tree=tree, coupling=coupling)


@pytest.mark.parametrize("tree", [None, specforest.trees.uniform(2, 2)], ids=["standard", "tree"])
def test_parity_with_the_library_sampler_on_the_mapped_grid(tree):
    x = noise(64)
    ours = kd.sample(exact_denoiser, x, SIGMAS, churn=CHURN, seed=3, tree=tree)
    ref = _library_run(x, tree=tree)
    assert torch.equal(ours.samples, ref.samples)
    assert torch.equal(ours.stats.nfe, ref.stats.nfe)
    assert ours.samples.dtype == torch.float64
    # float32 states: the sampler works in float32 and returns float32, close to the float64 run
    x32 = kd.sample_speculative(exact_denoiser, x.float(), SIGMAS.float(), churn=CHURN, seed=3, tree=tree)
    assert x32.dtype == torch.float32
    torch.testing.assert_close(x32.double(), ours.samples, rtol=0, atol=1e-3)


def test_standard_chain_is_the_ancestral_form_pathwise():
    """The standard chain is x' = D + d sigma_down + sigma_up z with the documented sigma_down, sigma_up.

    The noise of the standard sampler is a function of (seed, sample, step) only, so the run of
    the identity denoiser (D = x: d = 0, x' = x + sigma_up z) exposes each step's sigma_up z, which
    a k-diffusion-style loop with another denoiser then reuses.
    """
    batch, T = 2000, SIGMAS.numel() - 1
    x = noise(batch)
    states = []
    last = kd.sample_speculative(
        lambda y, s: y.clone(), x, SIGMAS, churn=CHURN, seed=5, callback=lambda d: states.append(d["x"])
    )
    states.append(last)
    assert len(states) == T + 1
    incr = [states[i + 1] - states[i] for i in range(T)]
    # each step's noise has the documented scale sigma_up (the last step carries none)
    for i in range(T):
        _, up = chain_step(float(SIGMAS[i]), float(SIGMAS[i + 1]), CHURN)
        if up == 0.0:
            assert float(incr[i].abs().max()) < 1e-9 * float(SIGMAS[i])
            continue
        var = incr[i].var(0)
        z = (var - up * up) / (up * up * math.sqrt(2.0 / (batch - 1)))
        assert float(z.abs().max()) < Z_TOL, (i, var.tolist(), up * up)
    # a k-diffusion-style loop with the Karras denoiser and those increments: the library's chain, pathwise
    model = KarrasDenoiser()
    out = kd.sample_speculative(model, x, SIGMAS, churn=CHURN, seed=5)
    y = x.clone()
    s_in = torch.ones(batch, dtype=torch.float64)
    for i in range(T):
        denoised = model(y, SIGMAS[i] * s_in)
        down, _ = chain_step(float(SIGMAS[i]), float(SIGMAS[i + 1]), CHURN)
        y = denoised + to_d(y, SIGMAS[i] * s_in, denoised) * down + incr[i]
    torch.testing.assert_close(out, y, rtol=1e-9, atol=1e-9)


def test_churn_is_euler_ancestral_eta_to_first_order():
    """The documented correspondence: a step of our chain and k-diffusion's ancestral step with eta = churn
    have means (sigma_down) and noise variances (sigma_up^2) that differ by O(h^2), h = sigma_i - sigma_{i+1}:
    the gap per unit step halves when the steps are halved (and the two are not the same chain)."""

    def worst(n: int) -> float:
        s = karras_sigmas(n, sigma_min=0.1, sigma_max=10.0)
        gaps = []
        for i in range(n - 1):
            a, b = float(s[i]), float(s[i + 1])
            (down, up), (down_a, up_a) = chain_step(a, b, CHURN), ancestral_step(a, b, CHURN)
            gaps.append((abs(down - down_a) + abs(up * up - up_a * up_a) / a) / (a - b))
        return max(gaps)

    g1, g2, g3 = worst(100), worst(200), worst(400)
    assert 0.01 < g1 < 0.2
    assert 1.8 < g1 / g2 < 2.2 and 1.8 < g2 / g3 < 2.2


SPECULATIVE = [
    pytest.param(specforest.trees.uniform(2, 2), "grs", id="grs-uniform(2,2)"),
    pytest.param(specforest.trees.chain(4), "rmc", id="rmc-chain(4)"),
]


@pytest.mark.parametrize("tree, coupling", SPECULATIVE)
def test_speculative_chain_keeps_the_law(tree, coupling):
    """Power at 2000 samples (final std 0.48): |z| <= 4.5 detects a mean shift of 0.05 and a variance
    error of 14 %; the wrong mapping below shifts the variance by far more."""
    batch, T = 2000, SIGMAS.numel() - 1
    out = kd.sample(KarrasDenoiser(), noise(batch), SIGMAS, churn=CHURN, seed=11, tree=tree, coupling=coupling)
    assert law_z(out.samples, SIGMAS, CHURN) < Z_TOL
    assert float(out.stats.nfe.double().mean()) < T
    # the standard chain on the same grid passes the same test
    std = kd.sample_speculative(KarrasDenoiser(), noise(batch), SIGMAS, churn=CHURN, seed=12)
    assert law_z(std, SIGMAS, CHURN) < Z_TOL


def test_a_wrong_mapping_fails_the_law_test(monkeypatch):
    """The VP scale sqrt(1 + sigma^2) in place of 1 + sigma (t = sigma / sqrt(1 + sigma^2), x / sqrt(1 + sigma^2)):
    a plausible mix-up of two changes of variables, rejected by the same test."""
    monkeypatch.setattr(specforest.schedules, "ve_scale", lambda s: (1.0 + s * s) ** 0.5)
    tree, coupling = specforest.trees.uniform(2, 2), "grs"
    out = kd.sample_speculative(
        KarrasDenoiser(), noise(2000), SIGMAS, churn=CHURN, seed=11, tree=tree, coupling=coupling
    )
    assert law_z(out, SIGMAS, CHURN) > Z_TOL


def test_linear_path_denoiser_matches_the_velocity_model():
    """path='linear' (ComfyUI's CONST models): sigma is the linear-path level and v = (x - D) / sigma."""
    gauss = GaussianMixture(MU[None], torch.tensor([TAU], dtype=torch.float64))

    def const_denoiser(x, t):
        a = (1 - t).reshape(-1, 1)
        tt = t.reshape(-1, 1)
        return MU + a * TAU**2 / (a * a * TAU**2 + tt * tt) * (x - a * MU)

    grid = specforest.flow_match_grid(10)
    x = torch.randn(32, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    tree = specforest.trees.uniform(2, 2)
    ours = kd.sample(const_denoiser, x, grid, churn=CHURN, seed=4, tree=tree, path="linear")
    ref = specforest.sample(gauss, x, sigmas=grid, churn=CHURN, seed=4, tree=tree)
    torch.testing.assert_close(ours.samples, ref.samples, rtol=1e-9, atol=1e-9)
    assert torch.equal(ours.stats.nfe, ref.stats.nfe)


@pytest.mark.parametrize("tree", [None, specforest.trees.uniform(2, 2)], ids=["standard", "tree"])
def test_callback_gives_k_diffusions_dict(tree):
    batch, T = 5, SIGMAS.numel() - 1
    seen = []
    x = noise(batch)
    out = kd.sample(exact_denoiser, x, SIGMAS, callback=seen.append, churn=CHURN, seed=7, tree=tree)
    assert seen
    for d in seen:
        assert list(d)[:5] == list(kd.KEYS) == ["x", "i", "sigma", "sigma_hat", "denoised"]
        assert type(d["i"]) is int and d["sigma"].ndim == 0
        assert float(d["sigma"]) == float(SIGMAS[d["i"]]) == float(d["sigma_hat"])
        assert d["x"].shape == d["denoised"].shape == (batch, 3)
        active = d["step"] < T
        assert int(d["step"][active].min()) == d["i"]
        # each active row: its state at its own level and the model's output there
        lvl = SIGMAS[d["step"][active]]
        torch.testing.assert_close(d["row_sigma"][active], lvl, rtol=1e-12, atol=0)
        torch.testing.assert_close(d["denoised"][active], exact_denoiser(d["x"][active], lvl), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(d["x"][~active], d["denoised"][~active], rtol=0, atol=0)
    steps = [d["i"] for d in seen]
    assert all(a < b for a, b in zip(steps, steps[1:], strict=False))
    torch.testing.assert_close(seen[0]["x"], x, rtol=1e-12, atol=1e-9)
    if tree is None:
        # the standard chain: one callback per step, like k-diffusion's loops
        assert steps == list(range(T))
    else:
        # every round but the first (which only evaluates the roots) makes one
        assert len(seen) == out.stats.calls - 1 < T
    # the callbacks account for every committed step (the first round of a tree commits none)
    assert int(sum(int(d["committed"].sum()) for d in seen)) == batch * T


def test_extra_args_per_row_and_shared():
    batch = 4
    labels = torch.tensor([0.0, 1.0, -2.0, 3.0], dtype=torch.float64)
    offset = torch.tensor(0.25, dtype=torch.float64)
    model = KarrasDenoiser()
    x = noise(batch)
    tree = specforest.trees.uniform(2, 2)
    opts = dict(churn=CHURN, seed=9, tree=tree)
    out = kd.sample(model, x, SIGMAS, {"labels": labels, "offset": offset}, row_args=("labels",), **opts)
    assert model.calls
    for rows, _, kw in model.calls:
        assert kw["offset"] is offset  # shared: passed as it is
        assert kw["labels"].shape == (rows,)  # per row: one label per evaluated state
    assert any(rows != batch for rows, _, _ in model.calls)
    # each sample alone (its own index and label) is the same sample: the labels followed its rows
    for b in range(batch):
        alone = kd.sample_speculative(
            KarrasDenoiser(),
            x[b : b + 1],
            SIGMAS,
            {"labels": labels[b : b + 1], "offset": offset},
            row_args=("labels",),
            sample_index=torch.tensor([b]),
            **opts,
        )
        assert torch.equal(alone, out.samples[b : b + 1])
    # the labels moved the samples: sample b's mean is MU + offset + labels[b]
    many = kd.sample_speculative(
        KarrasDenoiser(), noise(400, seed=1), SIGMAS, {"labels": labels.repeat(100)}, row_args=("labels",), **opts
    )
    shift = many.view(100, batch, 3).mean((0, 2)) - MU.mean()
    torch.testing.assert_close(shift, labels, rtol=0, atol=0.15)


def test_undeclared_per_row_tensor_is_refused_or_passed_when_shared():
    batch = 3
    table = torch.zeros(batch, dtype=torch.float64)  # batch rows, meant as a shared table
    model = KarrasDenoiser()
    with pytest.raises(ValueError, match=r"extra_args\['offset'\].*row_args.*shared_args"):
        kd.sample_speculative(model, noise(batch), SIGMAS, {"offset": table}, churn=CHURN, seed=0)
    out = kd.sample_speculative(
        model, noise(batch), SIGMAS, {"offset": table[:1]}, churn=CHURN, seed=0, tree=specforest.trees.chain(2)
    )
    assert out.shape == (batch, 3)
    model.calls.clear()
    kd.sample_speculative(model, noise(batch), SIGMAS, {"offset": table}, shared_args=("offset",), churn=CHURN, seed=0)
    assert all(kw["offset"] is table for _, _, kw in model.calls)
    # a batch of one: nothing is ambiguous
    kd.sample_speculative(model, noise(1), SIGMAS, {"offset": table[:1]}, churn=CHURN, seed=0)


def test_a_draft_denoiser_gets_the_same_extra_args():
    batch, T = 8, SIGMAS.numel() - 1
    labels = torch.arange(batch, dtype=torch.float64)
    target, draft = KarrasDenoiser(), KarrasDenoiser()
    out = kd.sample(
        target,
        noise(batch),
        SIGMAS,
        {"labels": labels, "offset": 0.5},
        row_args=("labels",),
        churn=CHURN,
        seed=1,
        tree=specforest.trees.chain(4),
        coupling="rmc",
        draft=draft,
    )
    assert out.stats.draft_calls > 0 and draft.calls
    assert all(kw["offset"] == 0.5 and kw["labels"].shape == (n,) for n, _, kw in draft.calls)
    # the draft is the target itself: every draft is accepted, (T - 1) stochastic steps in rounds of 4
    assert bool((out.stats.nfe <= math.ceil((T - 1) / 4) + 1).all())


def test_progress_bar_follows_disable(capsys):
    kd.sample_speculative(exact_denoiser, noise(2), SIGMAS, disable=True, churn=CHURN, seed=0)
    assert capsys.readouterr().err == ""
    kd.sample_speculative(exact_denoiser, noise(2), SIGMAS, disable=False, churn=CHURN, seed=0)
    assert "sampling" in capsys.readouterr().err


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(sigmas=torch.tensor([5.0, 6.0, 1.0, 0.0])), ValueError, r"sigmas must decrease strictly.*sigmas\[0\]"),
        (dict(sigmas=torch.tensor([5.0, 2.0, 2.0, 0.0])), ValueError, r"sigmas must decrease strictly"),
        (dict(sigmas=torch.tensor([5.0, 2.0, 1.0])), ValueError, r"sigmas must end in 0"),
        (dict(sigmas=torch.tensor([[5.0, 0.0]])), ValueError, r"sigmas must be a 1-D tensor"),
        (dict(sigmas=[5.0, 1.0, 0.0]), TypeError, r"sigmas must be a 1-D torch.Tensor"),
        (dict(sigmas=torch.tensor([5.0, float("nan"), 0.0])), ValueError, r"sigmas must be finite"),
        (dict(x=torch.zeros(3)), ValueError, r"x must have shape \(batch, \*shape\)"),
        (dict(x=torch.zeros(0, 3)), ValueError, r"x must have shape"),
        (dict(x=torch.zeros(2, 3, dtype=torch.long)), TypeError, r"x must be a floating-point"),
        (dict(x=torch.full((2, 3), float("inf"))), ValueError, r"x contains NaN"),
        (dict(churn=0.0), ValueError, r"churn must be in \(0, 1\]"),
        (dict(churn=1.5), ValueError, r"churn must be in \(0, 1\]"),
        (dict(churn=None), TypeError, r"churn is required"),
        (dict(steps=10), TypeError, r"unexpected options \['steps'\].*schedule is sigmas"),
        (dict(cond={"a": torch.zeros(2)}), TypeError, r"'cond'.*extra_args"),
        (dict(path="vp"), ValueError, r"path must be one of"),
        (dict(path="linear"), ValueError, r"path='linear'.*sigmas\[0\]"),
        (dict(extra_args=[1]), TypeError, r"extra_args must be a dict"),
        (dict(row_args=("labels",)), ValueError, r"row_args names \['labels'\]"),
        (dict(row_args="labels"), TypeError, r"row_args must be a sequence"),
        (dict(extra_args={"c": torch.zeros(5)}, row_args=("c",)), ValueError, r"extra_args\['c'\] is in row_args"),
        (dict(disable="yes"), TypeError, r"disable must be None or a bool"),
        (dict(callback=lambda d: None, process_group=object()), ValueError, r"callback with process_group"),
    ],
)
def test_bad_input_names_the_parameter(change, error, match):
    args = dict(x=noise(2), sigmas=SIGMAS, churn=CHURN, extra_args=None, seed=0)
    args.update(change)
    if args["churn"] is None:
        del args["churn"]
    x, sigmas, extra = args.pop("x"), args.pop("sigmas"), args.pop("extra_args")
    with pytest.raises(error, match=match):
        kd.sample_speculative(exact_denoiser, x, sigmas, extra, **args)


@pytest.mark.parametrize("path", kd.PATHS)
def test_a_bad_model_output_is_refused(path):
    sigmas = SIGMAS if path == "ve" else SIGMAS / 80.0
    with pytest.raises(TypeError, match="the denoiser must return a tensor"):
        kd.sample_speculative(lambda x, s: x.tolist(), noise(2), sigmas, churn=CHURN, seed=0, path=path)
    with pytest.raises(ValueError, match=r"must return shape \(2, 3\)"):
        kd.sample_speculative(lambda x, s: x[:, :2], noise(2), sigmas, churn=CHURN, seed=0, path=path)
    with pytest.raises(FloatingPointError):
        kd.sample_speculative(lambda x, s: x * float("nan"), noise(2), sigmas, churn=CHURN, seed=0, path=path)


class RowsChecked(KarrasDenoiser):
    """A denoiser that needs one row of ``emb`` per row of ``x`` (as a network concatenating it would)."""

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, emb=None, **kw) -> torch.Tensor:
        if emb.shape[0] != x.shape[0]:
            raise RuntimeError(f"emb has {emb.shape[0]} rows for {x.shape[0]} states")
        return super().__call__(x, sigma, offset=emb[:, 0].reshape(-1, 1), **kw)


@pytest.mark.parametrize("fn", ["sample_speculative", "sample_euler_ancestral"])
def test_a_batch_of_one_gives_its_leading_dim_one_tensors_to_every_row(fn):
    """At batch 1 an undeclared ``(1, ...)`` tensor is that sample's: every row of a tree call gets it."""
    emb = torch.full((1, 2), 0.5, dtype=torch.float64)
    model = RowsChecked()
    kw = dict(churn=CHURN) if fn == "sample_speculative" else {}
    out = getattr(kd, fn)(model, noise(1), SIGMAS, {"emb": emb}, tree=specforest.trees.uniform(2, 2), seed=3, **kw)
    assert any(rows > 1 for rows, _, _ in model.calls)
    # the rows are the sample's own: the run equals one with emb declared per row
    ref = getattr(kd, fn)(
        RowsChecked(),
        noise(1),
        SIGMAS,
        {"emb": emb},
        row_args=("emb",),
        tree=specforest.trees.uniform(2, 2),
        seed=3,
        **kw,
    )
    assert torch.equal(out, ref)
    # named in shared_args it is passed as it is
    with pytest.raises(RuntimeError, match="emb has 1 rows"):
        getattr(kd, fn)(
            RowsChecked(),
            noise(1),
            SIGMAS,
            {"emb": emb},
            shared_args=("emb",),
            tree=specforest.trees.uniform(2, 2),
            seed=3,
            **kw,
        )


@pytest.mark.parametrize("path", kd.PATHS)
def test_a_denoiser_output_on_another_device_names_the_denoiser_and_both_devices(path):
    sigmas = SIGMAS if path == "ve" else SIGMAS / 80.0

    def elsewhere(x, s):
        return torch.empty_like(x, device="meta")

    with pytest.raises(ValueError, match=r"the denoiser elsewhere returned its output on meta.*states.*on cpu"):
        kd.sample_speculative(elsewhere, noise(2), sigmas, churn=CHURN, seed=0, path=path)
    with pytest.raises(ValueError, match=r"the denoiser elsewhere returned its output on meta.*on cpu"):
        specforest.sample(EDMDenoiserVelocity(elsewhere), noise(2) / 81.0, sigmas=kd.linear_grid(SIGMAS), churn=CHURN)


def test_the_drop_ins_refuse_numpy_sigmas_naming_sigmas():
    sigmas = SIGMAS.numpy()
    for fn in (kd.sample_euler_ancestral, kd.sample_euler, kd.sample_ddpm, kd.sample_lcm, kd.sample_dpmpp_2m_sde):
        with pytest.raises(TypeError, match=r"sigmas must be a 1-D torch.Tensor .*got ndarray"):
            fn(exact_denoiser, noise(2), sigmas, disable=True)


def test_the_cached_draft_refused_names_the_users_denoiser_and_what_it_needs():
    with pytest.raises(
        ValueError, match=r"draft='cached'.*deep and shallow.*the model given here, exact_denoiser"
    ) as err:
        kd.sample_speculative(
            exact_denoiser, noise(2), SIGMAS, churn=CHURN, seed=0, tree=specforest.trees.chain(2), draft="cached"
        )
    assert "_Denoiser" not in str(err.value) and "EDMDenoiserVelocity does not" not in str(err.value)


def test_a_vp_network_output_on_another_device_names_the_network_and_both_devices():
    from specforest.models.edm import VPDenoiser

    def eps_elsewhere(x, k):
        return torch.empty_like(x, device="meta")

    ac = torch.linspace(0.999, 0.01, 100, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"the network eps_elsewhere returned its output on meta.*on cpu"):
        VPDenoiser(eps_elsewhere, ac)(noise(2), torch.full((2,), 1.0, dtype=torch.float64))
