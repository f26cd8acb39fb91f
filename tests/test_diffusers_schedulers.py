"""``chain="scheduler"``: each stochastic diffusers scheduler as a chain, against the scheduler's own ``step``.

A smooth fake network (``eps(x, t)``) stands in for the UNet. The reference is the pipeline's loop
(``scale_model_input``, the network, ``step`` with the generator); specforest runs the chain that
:func:`specforest.diffusers.scheduler_chain` reads off the scheduler, with the network behind a
velocity that feeds it the same latents at the same timestep, and the same generator's draws at
the steps where ``step`` draws. With no tree the outputs agree to float tolerance; with trees the law
is the same (closed form on a Gaussian data law, the squared norm included), and the same test
rejects the EM chain and a wrong ``eta``.
"""

from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import specforest  # noqa: E402
from specforest import testing, trees  # noqa: E402,F401
from specforest.diffusers.schedulers import scheduler_chain  # noqa: E402

D = 16
MU = torch.linspace(-0.8, 0.8, D, dtype=torch.float64)
S0 = 0.5  # data N(MU, S0^2 I), inside the clip range mostly


def eps_gauss(x_vp: torch.Tensor, ab: torch.Tensor) -> torch.Tensor:
    """The exact noise prediction for data ``N(MU, S0^2 I)`` at ``abar``: ``E[xi | x_vp]``."""
    ab = ab.reshape(-1, *[1] * (x_vp.ndim - 1)).to(torch.float64)
    a, b = ab.sqrt(), (1 - ab).sqrt()
    var = a * a * S0**2 + b * b
    return (b * (x_vp.double() - a * MU) / var).to(x_vp.dtype)


def bent(x_vp, ab):
    """A network that is not affine: the scheduler's multistep terms and clipping then show."""
    return eps_gauss(x_vp, ab) + 0.2 * torch.tanh(x_vp)


def make(name: str, **cfg):
    cls = getattr(diffusers, name)
    return cls(**cfg)


CASES = {
    "ddpm_small": ("DDPMScheduler", dict(clip_sample=False), 0.0, 25),
    "ddpm_large_clip": ("DDPMScheduler", dict(variance_type="fixed_large", clip_sample=True), 0.0, 25),
    "ddpm_offset": ("DDPMScheduler", dict(steps_offset=1, clip_sample=False, timestep_spacing="leading"), 0.0, 20),
    "ddim_eta1": ("DDIMScheduler", dict(clip_sample=False), 1.0, 20),
    "ddim_trailing_clip": ("DDIMScheduler", dict(timestep_spacing="trailing", clip_sample=True), 0.7, 30),
    "euler_a": ("EulerAncestralDiscreteScheduler", dict(), 0.0, 20),
    "dpm_sde_2": ("DPMSolverMultistepScheduler", dict(algorithm_type="sde-dpmsolver++"), 0.0, 20),
    "dpm_sde_2_heun": (
        "DPMSolverMultistepScheduler",
        dict(algorithm_type="sde-dpmsolver++", solver_type="heun"),
        0.0,
        20,
    ),
    "dpm_sde_1": ("DPMSolverMultistepScheduler", dict(algorithm_type="sde-dpmsolver++", solver_order=1), 0.0, 20),
    "lcm": ("LCMScheduler", dict(), 0.0, 6),
    "tcd": ("TCDScheduler", dict(), 0.3, 6),
}


def pipeline_loop(sch, steps, eta, x, gen, net):
    """What a pipeline does: ``set_timesteps``, then per timestep the network and ``step``."""
    sch.set_timesteps(steps)
    acp = sch.alphas_cumprod.to(torch.float64)
    kw = {"eta": eta} if type(sch).__name__ in ("DDIMScheduler", "TCDScheduler") else {}
    sigma_based = type(sch).__name__ in ("EulerAncestralDiscreteScheduler", "DPMSolverMultistepScheduler")
    for i, t in enumerate(sch.timesteps):
        inp = sch.scale_model_input(x, t)
        # the level the network is trained at for this input: the scheduler's sigma (fractional timesteps)
        ab = 1 / (1 + float(sch.sigmas[i]) ** 2) if sigma_based else float(acp[int(t)])
        e = net(inp, torch.full((x.shape[0],), ab, dtype=torch.float64))
        x = sch.step(e, t, x, generator=gen, **kw).prev_sample
    return x


def velocity_of(chain, net):
    """The library's velocity for ``chain``: the network at the scheduler's latents and timestep."""
    grid = chain.grid

    def v(y, t, **_):
        step = torch.searchsorted(-grid[:-1].to(t.device, torch.float64), -t.double())
        s = t.double() / (1 - t.double())
        ab = 1 / (1 + s * s)
        n = (1 + s) / (1 + s * s).sqrt()  # x_vp = n y
        x_vp = (y.double() * n[:, None]).to(y.dtype)
        e = net(x_vp, ab).double()
        d = y.double() * (1 + s[:, None]) - s[:, None] * e  # x_ve - s eps
        if chain.prediction is not None:
            d = chain.prediction(d, step)
        return ((y.double() - d) / t.double()[:, None]).to(y.dtype)

    return v


def initial(sch, steps, n, seed=0, dtype=torch.float64):
    fresh = type(sch).from_config(sch.config)
    fresh.set_timesteps(steps)
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed), dtype=dtype) * float(fresh.init_noise_sigma)


def to_y(chain, x, sch):
    """The pipeline's initial latents on the linear path (VE latents for Euler ancestral, VP else)."""
    s = chain.grid[0] / (1 - chain.grid[0])
    if type(sch).__name__ == "EulerAncestralDiscreteScheduler":
        return x / (1 + s)
    return x * (1 + s * s).sqrt() / (1 + s)


def replay(chain, gen, shape, dtype):
    """The generator's draws at the steps where the scheduler draws."""

    def noise(step):
        if step < 0 or not bool(chain.draws[step]):
            return torch.zeros(shape, dtype=dtype)
        return torch.randn(shape, generator=gen, dtype=chain.noise_dtype or dtype).to(dtype)

    return noise


CLIPPED = [c for c, (_, cfg, _, _) in CASES.items() if cfg.get("clip_sample")]
END_TO_END = [
    (c, dt) for c in CASES for dt in (torch.float64, torch.float32) if not (c in CLIPPED and dt == torch.float32)
]


@pytest.mark.parametrize(
    "case, dtype", END_TO_END, ids=[f"{c}-{'f64' if dt == torch.float64 else 'f32'}" for c, dt in END_TO_END]
)
def test_no_tree_equals_the_schedulers_own_loop(case, dtype):
    """End to end, the pipeline's loop and the chain with the same draws. (With ``clip_sample`` the
    scheduler's own float32 and float64 runs part by O(1): a clipped coordinate leaves the raw
    prediction's large coefficient uncancelled. Float32 is checked step by step there, below.)"""
    name, cfg, eta, steps = CASES[case]
    sch = make(name, **cfg)
    x = initial(sch, steps, 8, dtype=dtype)
    ref = pipeline_loop(make(name, **cfg), steps, eta, x.clone(), torch.Generator().manual_seed(3), bent)
    chain = scheduler_chain(sch, steps, eta=eta)
    out = specforest.sample(
        velocity_of(chain, bent), to_y(chain, x, sch), sigmas=chain.grid, chain=chain,
        noise=replay(chain, torch.Generator().manual_seed(3), x.shape, dtype),
    ).samples  # fmt: skip
    tol = 1e-5 if dtype == torch.float64 else 1e-3
    scale = float(ref.double().abs().max())
    assert float((out.double() - ref.double()).abs().max()) <= tol * scale, case


@pytest.mark.parametrize("case", CLIPPED)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_each_clipped_step_equals_the_schedulers_step(case, dtype):
    """From the scheduler's own states, each step of the chain is the scheduler's step (same draws)."""
    name, cfg, eta, steps = CASES[case]
    sch = make(name, **cfg)
    chain = scheduler_chain(sch, steps, eta=eta)
    tr = chain.build(chain.grid)
    vel = velocity_of(chain, bent)
    sch.set_timesteps(steps)
    x = initial(sch, steps, 8, dtype=dtype)
    acp = sch.alphas_cumprod.to(torch.float64)
    kw = {"eta": eta} if name == "DDIMScheduler" else {}
    for i, t in enumerate(sch.timesteps):
        gen_state = torch.Generator().manual_seed(100 + i)
        e = bent(x, acp[int(t)].expand(x.shape[0]))
        ref = sch.step(e, t, x, generator=gen_state, **kw).prev_sample
        z = torch.randn(x.shape, generator=torch.Generator().manual_seed(100 + i), dtype=dtype).double()
        s = chain.grid[i] / (1 - chain.grid[i])
        y = x.double() * (1 + s * s).sqrt() / (1 + s)
        v = vel(y, chain.grid[i].expand(x.shape[0])).double()
        y2 = tr.a[i] * y + tr.c[i] * v + tr.scale[i] * (z if bool(chain.draws[i]) else 0)
        s2 = chain.grid[i + 1] / (1 - chain.grid[i + 1])
        ours = y2 * (1 + s2) / (1 + s2 * s2).sqrt()
        tol = 1e-6 if dtype == torch.float64 else 1e-5  # (the scheduler keeps its alphas in float32)
        assert float((ours - ref.double()).abs().max()) <= tol * max(1.0, float(ref.abs().max())), (case, i)
        x = ref


def flow_net(x, sigma):
    """A flow-matching velocity ``E[xi - x_0 | x]`` for data ``N(MU, S0^2 I)``, bent."""
    alpha, beta = testing._gaussian_velocity(float(sigma), MU, S0)
    return (alpha * x.double() + beta + 0.2 * torch.tanh(x.double())).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_stochastic_flow_matching_equals_the_schedulers_own_loop(dtype):
    """``FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)``, SD3's and Flux's stochastic scheduler."""
    mk = lambda: diffusers.FlowMatchEulerDiscreteScheduler(stochastic_sampling=True, shift=3.0)  # noqa: E731
    steps = 12
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(0), dtype=dtype)
    sch, gen = mk(), torch.Generator().manual_seed(3)
    sch.set_timesteps(steps)
    ref = x.clone()
    for i, t in enumerate(sch.timesteps):
        ref = sch.step(flow_net(ref, sch.sigmas[i]), t, ref, generator=gen).prev_sample
    chain = scheduler_chain(mk(), steps)

    def v(y, t, **_):
        return torch.stack([flow_net(y[j : j + 1], t[j])[0] for j in range(y.shape[0])])

    out = specforest.sample(
        v, x, sigmas=chain.grid, chain=chain, noise=replay(chain, torch.Generator().manual_seed(3), x.shape, dtype)
    ).samples
    tol = 1e-5 if dtype == torch.float64 else 1e-3
    assert float((out.double() - ref.double()).abs().max()) <= tol * float(ref.double().abs().max())


# -- the law with trees ---------------------------------------------------------------------------

LAW = {
    "ddpm": ("DDPMScheduler", dict(clip_sample=False), 0.0, 25, trees.uniform(2, 3), "grs"),
    "ddim": ("DDIMScheduler", dict(clip_sample=False, timestep_spacing="trailing"), 1.0, 30, trees.chain(5), "rmc"),
    "euler_a": ("EulerAncestralDiscreteScheduler", dict(), 0.0, 20, trees.uniform(2, 2), "grs"),
    "dpm_sde": ("DPMSolverMultistepScheduler", dict(algorithm_type="sde-dpmsolver++"), 0.0, 20, trees.chain(4), "rmc"),
    "lcm": ("LCMScheduler", dict(), 0.0, 6, trees.uniform(2, 2), "grs"),
    "tcd": ("TCDScheduler", dict(), 0.3, 8, trees.chain(3), "rmc"),
}


def law_run(chain, tree, coupling, n=4000, seed=4):
    y0 = torch.randn(n, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return specforest.sample(
        velocity_of(chain, eps_gauss), y0, sigmas=chain.grid, chain=chain, tree=tree, coupling=coupling,
        draft="x0", seed=seed,
    )  # fmt: skip


@pytest.mark.parametrize("case", list(LAW))
def test_speculated_scheduler_chains_keep_the_schedulers_law(case):
    name, cfg, eta, steps, tree, coupling = LAW[case]
    chain = scheduler_chain(make(name, **cfg), steps, eta=eta)
    run = law_run(chain, tree, coupling)
    testing.check_law(run.samples, chain.grid, None, MU, S0, chain=chain).assert_exact()
    assert float(run.stats.nfe.double().mean()) < steps


def test_the_law_test_rejects_a_wrong_eta_and_the_em_chain():
    """The same check, on DDIM at eta 1: samples of eta 0.6, and of the paper's EM chain on the same grid."""
    name, cfg, eta, steps, tree, coupling = LAW["ddim"]
    chain = scheduler_chain(make(name, **cfg), steps, eta=eta)
    wrong = scheduler_chain(make(name, **cfg), steps, eta=0.6)
    rep = testing.check_law(law_run(wrong, tree, coupling).samples, chain.grid, None, MU, S0, chain=chain)
    assert not rep.passed
    em = specforest.sample(
        velocity_of(chain, eps_gauss), torch.randn(4000, D, generator=torch.Generator().manual_seed(4), dtype=torch.float64),
        sigmas=chain.grid, churn=1.0, tree=tree, coupling=coupling, draft="x0", seed=4,
    )  # fmt: skip
    assert not testing.check_law(em.samples, chain.grid, None, MU, S0, chain=chain).passed


# -- options a scheduler's step does not read, and eta where DDIM's step is undefined ------------------

NO_ETA = {
    "DDPMScheduler": dict(clip_sample=False),
    "EulerAncestralDiscreteScheduler": dict(),
    "DPMSolverMultistepScheduler": dict(algorithm_type="sde-dpmsolver++"),
    "LCMScheduler": dict(),
    "FlowMatchEulerDiscreteScheduler": dict(stochastic_sampling=True),
}


@pytest.mark.parametrize("name", list(NO_ETA))
def test_an_eta_the_schedulers_step_does_not_read_is_refused_and_recorded_as_null(name):
    """Only DDIM's and TCD's ``step`` take ``eta``: with any other scheduler it would be dropped (the same
    samples as without it), so it is refused by name; run without it, the chain records ``eta`` as null."""
    import inspect

    sch = make(name, **NO_ETA[name])
    assert "eta" not in inspect.signature(type(sch).step).parameters  # (what makes eta a dropped option)
    with pytest.raises(ValueError, match=rf"eta=0\.5: {name}'s step takes no eta"):
        scheduler_chain(sch, 6, eta=0.5)
    assert scheduler_chain(sch, 6).params == {"scheduler": name, "eta": None}
    assert scheduler_chain(make("DDIMScheduler", clip_sample=False), 6, eta=0.7).params["eta"] == 0.7


def _ddim_eta_max(sch, steps):
    """The largest eta at which every DDIM step's ``1 - abar' - s_t^2`` is >= 0, from diffusers' own variance."""
    sch.set_timesteps(steps)
    top = float("inf")
    for t in sch.timesteps.tolist():
        prev_t = t - sch.config.num_train_timesteps // steps
        var = float(sch._get_variance(t, prev_t))
        prev = float(sch.alphas_cumprod[prev_t]) if prev_t >= 0 else float(sch.final_alpha_cumprod)
        if var > 0:
            top = min(top, ((1 - prev) / var) ** 0.5)
    return top


@pytest.mark.parametrize("spacing", ["leading", "trailing"])
def test_ddim_refuses_an_eta_whose_step_variance_is_negative_naming_the_step(spacing):
    """Above ``eta_max`` DDIM's own step takes the square root of a negative number (diffusers returns NaN):
    refused, naming the step; just below it the chain runs and its step is diffusers' (no clamp binds)."""
    cfg = dict(clip_sample=False, timestep_spacing=spacing)
    steps = 8
    top = _ddim_eta_max(make("DDIMScheduler", **cfg), steps)
    assert 1.0 < top < 3.0  # (eta 1 always runs; the bound is a property of the grid)
    with pytest.raises(ValueError, match=r"eta=.* gives a negative variance at step \d+ \(timestep \d+.*at most"):
        scheduler_chain(make("DDIMScheduler", **cfg), steps, eta=1.01 * top)
    # diffusers' own pipeline loop at that eta gives NaN: the refusal is where its step is undefined
    x = initial(make("DDIMScheduler", **cfg), steps, 4)
    nan = pipeline_loop(make("DDIMScheduler", **cfg), steps, 1.01 * top, x.clone(), torch.Generator(), bent)
    assert bool(torch.isnan(nan).any())
    eta = 0.99 * top
    chain = scheduler_chain(make("DDIMScheduler", **cfg), steps, eta=eta)
    ref = pipeline_loop(make("DDIMScheduler", **cfg), steps, eta, x.clone(), torch.Generator().manual_seed(3), bent)
    out = specforest.sample(
        velocity_of(chain, bent), to_y(chain, x, make("DDIMScheduler", **cfg)), sigmas=chain.grid, chain=chain,
        noise=replay(chain, torch.Generator().manual_seed(3), x.shape, x.dtype),
    ).samples  # fmt: skip
    assert float((out - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_the_ddim_chain_refuses_an_eta_whose_step_variance_is_negative():
    """The registered ``ddim`` chain: the same bound on its own grid, computed here from alpha-bar."""
    from specforest import chains

    grid = chains.ddpm_linear_grid(1000)[::100].contiguous()
    grid = torch.cat([grid, grid.new_zeros(1)]) if float(grid[-1]) != 0 else grid
    t, t_next = grid[:-1], grid[1:]
    ab, ab_next = (1 - t) ** 2 / ((1 - t) ** 2 + t**2), (1 - t_next) ** 2 / ((1 - t_next) ** 2 + t_next**2)
    var = (1 - ab_next) / (1 - ab) * (1 - ab / ab_next)
    top = float(((1 - ab_next[var > 0]) / var[var > 0]).sqrt().min())
    with pytest.raises(ValueError, match=r"eta=.* gives a negative variance at step \d+"):
        chains.DDIM(eta=1.01 * top).build(grid)
    tab = chains.DDIM(eta=0.99 * top).build(grid)
    assert bool(torch.isfinite(tab.scale).all()) and bool((tab.scale > 0)[:-1].all())


# -- every config flag of every scheduler, in parity with its own step --------------------------------


def big(x_vp, ab):
    """A network whose clean prediction leaves [-1, 1] by far: a clip or threshold binds at every step."""
    return bent(x_vp, ab) - 0.8 * torch.sin(3 * x_vp)


def as_prediction(kind, eps, x_vp, ab):
    """The network's output in the scheduler's ``prediction_type``, for the same clean prediction as ``eps``."""
    ab = ab.reshape(-1, *[1] * (x_vp.ndim - 1)).to(x_vp.dtype)
    x0 = (x_vp - (1 - ab).sqrt() * eps) / ab.sqrt()
    return {"epsilon": eps, "sample": x0, "v_prediction": ab.sqrt() * eps - (1 - ab).sqrt() * x0}[kind]


def flagged_loop(sch, steps, eta, x, gen, net):
    """:func:`pipeline_loop` with the network's output in the scheduler's ``prediction_type``, on latents with a
    trailing axis (``_threshold_sample`` wants channels and at least one more dimension)."""
    sch.set_timesteps(steps)
    acp = sch.alphas_cumprod.to(torch.float64)
    name = type(sch).__name__
    kw = {"eta": eta} if name in ("DDIMScheduler", "TCDScheduler") else {}
    sigma_based = name in ("EulerAncestralDiscreteScheduler", "DPMSolverMultistepScheduler")
    for i, t in enumerate(sch.timesteps):
        inp = sch.scale_model_input(x, t)
        ab = torch.full((x.shape[0],), 1 / (1 + float(sch.sigmas[i]) ** 2) if sigma_based else float(acp[int(t)]))
        out = as_prediction(sch.config.prediction_type, net(inp, ab.double()), inp, ab.double())
        x = sch.step(out[..., None], t, x[..., None], generator=gen, **kw).prev_sample[..., 0]
    return x


DPM = dict(algorithm_type="sde-dpmsolver++")
# (scheduler, its config, eta, steps, network, whether the flag changes the scheduler's samples)
FLAGS = {
    "ddpm-thresholding": ("DDPMScheduler", dict(thresholding=True, sample_max_value=1.5), 0.0, 12, big, True),
    "ddpm-clip-range": ("DDPMScheduler", dict(clip_sample=True, clip_sample_range=0.7), 0.0, 12, big, True),
    "ddpm-trailing": ("DDPMScheduler", dict(clip_sample=False, timestep_spacing="trailing"), 0.0, 12, bent, True),
    "ddpm-linspace": ("DDPMScheduler", dict(clip_sample=False, timestep_spacing="linspace"), 0.0, 12, bent, True),
    "ddpm-offset": ("DDPMScheduler", dict(clip_sample=False, steps_offset=1), 0.0, 12, bent, True),
    "ddpm-v": ("DDPMScheduler", dict(clip_sample=False, prediction_type="v_prediction"), 0.0, 12, bent, False),
    "ddpm-sample": ("DDPMScheduler", dict(clip_sample=False, prediction_type="sample"), 0.0, 12, bent, False),
    "ddim-thresholding": ("DDIMScheduler", dict(thresholding=True, sample_max_value=1.5), 0.8, 12, big, True),
    "ddim-clip-range": ("DDIMScheduler", dict(clip_sample=True, clip_sample_range=0.7), 0.8, 12, big, True),
    "ddim-alpha-not-one": ("DDIMScheduler", dict(clip_sample=False, set_alpha_to_one=False), 0.8, 12, bent, True),
    "ddim-linspace": ("DDIMScheduler", dict(clip_sample=False, timestep_spacing="linspace"), 0.8, 12, bent, True),
    "ddim-offset": ("DDIMScheduler", dict(clip_sample=False, steps_offset=1), 0.8, 12, bent, True),
    "ddim-v": ("DDIMScheduler", dict(clip_sample=False, prediction_type="v_prediction"), 0.8, 12, bent, False),
    "ddim-sample": ("DDIMScheduler", dict(clip_sample=False, prediction_type="sample"), 0.8, 12, bent, False),
    "euler_a-leading-offset": (
        "EulerAncestralDiscreteScheduler", dict(timestep_spacing="leading", steps_offset=1), 0.0, 12, bent, True,
    ),
    "euler_a-trailing": ("EulerAncestralDiscreteScheduler", dict(timestep_spacing="trailing"), 0.0, 12, bent, True),
    "euler_a-v": ("EulerAncestralDiscreteScheduler", dict(prediction_type="v_prediction"), 0.0, 12, bent, False),
    "dpm-thresholding": ("DPMSolverMultistepScheduler", dict(DPM, thresholding=True, sample_max_value=1.5), 0.0, 20, big, True),
    "dpm-1-thresholding": (
        "DPMSolverMultistepScheduler", dict(DPM, solver_order=1, thresholding=True, sample_max_value=1.5), 0.0, 20, big, True,
    ),
    "dpm-leading-offset": (
        "DPMSolverMultistepScheduler", dict(DPM, timestep_spacing="leading", steps_offset=1), 0.0, 20, bent, True,
    ),
    "dpm-trailing": ("DPMSolverMultistepScheduler", dict(DPM, timestep_spacing="trailing"), 0.0, 20, bent, True),
    "dpm-v": ("DPMSolverMultistepScheduler", dict(DPM, prediction_type="v_prediction"), 0.0, 20, bent, False),
    "dpm-sample": ("DPMSolverMultistepScheduler", dict(DPM, prediction_type="sample"), 0.0, 20, bent, False),
    "lcm-thresholding": ("LCMScheduler", dict(thresholding=True, sample_max_value=1.5), 0.0, 6, big, True),
    "lcm-clip": ("LCMScheduler", dict(clip_sample=True, clip_sample_range=0.7), 0.0, 6, big, True),
    "lcm-original-steps": ("LCMScheduler", dict(original_inference_steps=20), 0.0, 6, bent, True),
    "lcm-v": ("LCMScheduler", dict(prediction_type="v_prediction"), 0.0, 6, bent, False),
    "lcm-sample": ("LCMScheduler", dict(prediction_type="sample"), 0.0, 6, bent, False),
    # TCD's step neither clips nor thresholds: the flags must change nothing
    "tcd-clip": ("TCDScheduler", dict(clip_sample=True, clip_sample_range=0.7), 0.3, 6, big, False),
    "tcd-thresholding": ("TCDScheduler", dict(thresholding=True, sample_max_value=1.5), 0.3, 6, big, False),
    "tcd-trailing": ("TCDScheduler", dict(timestep_spacing="trailing"), 0.3, 6, bent, False),
    "tcd-v": ("TCDScheduler", dict(prediction_type="v_prediction"), 0.3, 6, bent, False),
    "tcd-sample": ("TCDScheduler", dict(prediction_type="sample"), 0.3, 6, bent, False),
}  # fmt: skip
DEFAULTS = {
    "DDPMScheduler": dict(clip_sample=False),
    "DDIMScheduler": dict(clip_sample=False),
    "DPMSolverMultistepScheduler": DPM,
}


@pytest.mark.parametrize("case", list(FLAGS))
def test_each_config_flag_follows_the_schedulers_own_step(case):
    """Each flag of each scheduler's config, where it binds (a clip or threshold with a network that leaves
    the range), against the scheduler's own loop with the same draws; and the flag changes the scheduler's
    samples where it should (so the case tests it), or changes nothing where the step ignores it (TCD's clip)."""
    name, cfg, eta, steps, net, changes = FLAGS[case]
    sch = make(name, **cfg)
    x = initial(sch, steps, 8)
    ref = flagged_loop(make(name, **cfg), steps, eta, x.clone(), torch.Generator().manual_seed(3), net)
    chain = scheduler_chain(sch, steps, eta=eta)
    out = specforest.sample(
        velocity_of(chain, net), to_y(chain, x, sch), sigmas=chain.grid, chain=chain,
        noise=replay(chain, torch.Generator().manual_seed(3), x.shape, x.dtype),
    ).samples  # fmt: skip
    scale = float(ref.abs().max())
    assert float((out - ref).abs().max()) <= 1e-5 * scale, case
    plain = make(name, **DEFAULTS.get(name, {}))
    x_plain = initial(plain, steps, 8)
    other = flagged_loop(plain, steps, eta, x_plain, torch.Generator().manual_seed(3), net)
    assert (float((other - ref).abs().max()) > 1e-3 * scale) == changes, case


def test_a_prediction_type_the_schedulers_step_does_not_implement_is_refused():
    """Euler ancestral's step raises on ``prediction_type="sample"``: the chain refuses it by name rather than
    sampling a chain diffusers does not define."""
    sch = make("EulerAncestralDiscreteScheduler", prediction_type="sample")
    with pytest.raises(NotImplementedError):
        sch.set_timesteps(4)
        sch.step(torch.zeros(1, D, 1), sch.timesteps[0], torch.zeros(1, D, 1))
    with pytest.raises(ValueError, match="prediction_type='sample'"):
        scheduler_chain(make("EulerAncestralDiscreteScheduler", prediction_type="sample"), 4)
