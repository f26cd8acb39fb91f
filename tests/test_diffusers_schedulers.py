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

from dataclasses import replace

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import specforest  # noqa: E402
from specforest import chains, testing, trees  # noqa: E402,F401
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
    # the Parallel schedulers' step is DDPM's and DDIM's
    "ddpm_parallel_large": ("DDPMParallelScheduler", dict(variance_type="fixed_large", clip_sample=False), 0.0, 20),
    "ddim_parallel_trailing": ("DDIMParallelScheduler", dict(timestep_spacing="trailing", clip_sample=False), 0.8, 20),
    # third order reads two past predictions; below 15 steps lower_order_final makes the last but one second order
    "dpm_sde_3": ("DPMSolverMultistepScheduler", dict(algorithm_type="sde-dpmsolver++", solver_order=3), 0.0, 20),
    "dpm_sde_3_short": ("DPMSolverMultistepScheduler", dict(algorithm_type="sde-dpmsolver++", solver_order=3), 0.0, 9),
    "dpm_sde_3_no_lower_final": (
        "DPMSolverMultistepScheduler",
        dict(algorithm_type="sde-dpmsolver++", solver_order=3, lower_order_final=False),
        0.0,
        9,
    ),
    "dpm_sde_3_heun_karras": (
        "DPMSolverMultistepScheduler",
        dict(algorithm_type="sde-dpmsolver++", solver_order=3, solver_type="heun", use_karras_sigmas=True),
        0.0,
        12,
    ),
    "dpm_sde_2_lu": (
        "DPMSolverMultistepScheduler",
        dict(algorithm_type="sde-dpmsolver++", use_lu_lambdas=True),
        0.0,
        12,
    ),
    "dpm_sde_2_euler_at_final": (
        "DPMSolverMultistepScheduler",
        dict(algorithm_type="sde-dpmsolver++", euler_at_final=True),
        0.0,
        12,
    ),
    "dpm_sde_3_exponential": (
        "DPMSolverMultistepScheduler",
        dict(algorithm_type="sde-dpmsolver++", solver_order=3, use_exponential_sigmas=True),
        0.0,
        12,
    ),
}


def pipeline_loop(sch, steps, eta, x, gen, net):
    """What a pipeline does: ``set_timesteps``, then per timestep the network and ``step``."""
    sch.set_timesteps(steps)
    acp = sch.alphas_cumprod.to(torch.float64)
    kw = {"eta": eta} if type(sch).__name__ in ("DDIMScheduler", "DDIMParallelScheduler", "TCDScheduler") else {}
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


@pytest.mark.parametrize("cfg", [{}, dict(eta=0.6, s_noise=1.02), dict(eta=0.0)], ids=["eta1", "eta0.6", "eta0"])
def test_ltx_euler_ancestral_rf_equals_the_schedulers_own_loop(cfg):
    """``LTXEulerAncestralRFScheduler`` (Euler ancestral on the flow path, LTX-Video's), its own loop, the same draws."""
    mk = lambda: diffusers.LTXEulerAncestralRFScheduler(**cfg)  # noqa: E731
    steps = 10
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sch, gen = mk(), torch.Generator().manual_seed(3)
    sch.set_timesteps(steps)
    ref = x.clone()
    for i, t in enumerate(sch.timesteps):
        ref = sch.step(flow_net(ref, sch.sigmas[i]), t, ref, generator=gen).prev_sample
    chain = scheduler_chain(mk(), steps)

    def v(y, t, **_):
        return torch.stack([flow_net(y[j : j + 1], t[j])[0] for j in range(y.shape[0])])

    out = specforest.sample(
        v, x, sigmas=chain.grid, chain=chain, noise=replay(chain, torch.Generator().manual_seed(3), x.shape, x.dtype)
    ).samples
    assert float((out.double() - ref.double()).abs().max()) <= 1e-5 * float(ref.double().abs().max())


@pytest.mark.parametrize("cfg", [{}, dict(shift=3.0), dict(use_karras_sigmas=True)], ids=["plain", "shift3", "karras"])
def test_flow_match_lcm_equals_the_schedulers_own_loop(cfg):
    mk = lambda: diffusers.FlowMatchLCMScheduler(**cfg)  # noqa: E731
    steps = 6
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sch, gen = mk(), torch.Generator().manual_seed(3)
    sch.set_timesteps(steps)
    ref = x.clone()
    for i, t in enumerate(sch.timesteps):
        ref = sch.step(flow_net(ref, sch.sigmas[i]), t, ref, generator=gen).prev_sample
    chain = scheduler_chain(mk(), steps)

    def v(y, t, **_):
        return torch.stack([flow_net(y[j : j + 1], t[j])[0] for j in range(y.shape[0])])

    out = specforest.sample(
        v, x, sigmas=chain.grid, chain=chain, noise=replay(chain, torch.Generator().manual_seed(3), x.shape, x.dtype)
    ).samples
    assert float((out.double() - ref.double()).abs().max()) <= 1e-5 * float(ref.double().abs().max())


@pytest.mark.parametrize("name", ["LTXEulerAncestralRFScheduler", "FlowMatchLCMScheduler"])
def test_flow_path_schedulers_keep_their_law_with_a_tree(name):
    chain = scheduler_chain(getattr(diffusers, name)(), 10)

    def v(y, t, **_):
        ab = [testing._gaussian_velocity(float(tj), MU, S0) for tj in t]
        return torch.stack([a * y[j] + b for j, (a, b) in enumerate(ab)])

    y0 = torch.randn(4000, D, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    run = specforest.sample(v, y0, sigmas=chain.grid, chain=chain, tree=trees.uniform(2, 2), coupling="grs", seed=4)
    testing.check_law(run.samples, chain.grid, None, MU, S0, chain=chain).assert_exact()
    assert float(run.stats.nfe.double().mean()) < 10


# -- the law with trees ---------------------------------------------------------------------------

LAW = {
    "ddpm": ("DDPMScheduler", dict(clip_sample=False), 0.0, 25, trees.uniform(2, 3), "grs"),
    "ddim": ("DDIMScheduler", dict(clip_sample=False, timestep_spacing="trailing"), 1.0, 30, trees.chain(5), "rmc"),
    "euler_a": ("EulerAncestralDiscreteScheduler", dict(), 0.0, 20, trees.uniform(2, 2), "grs"),
    "dpm_sde": ("DPMSolverMultistepScheduler", dict(algorithm_type="sde-dpmsolver++"), 0.0, 20, trees.chain(4), "rmc"),
    "dpm_sde_3": (
        "DPMSolverMultistepScheduler",
        dict(algorithm_type="sde-dpmsolver++", solver_order=3),
        0.0,
        20,
        trees.uniform(2, 2),
        "grs",
    ),
    "lcm": ("LCMScheduler", dict(), 0.0, 6, trees.uniform(2, 2), "grs"),
    "ddim_parallel": ("DDIMParallelScheduler", dict(clip_sample=False), 1.0, 20, trees.chain(4), "rmc"),
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
    "dpm-3-thresholding": (
        "DPMSolverMultistepScheduler", dict(DPM, solver_order=3, thresholding=True, sample_max_value=1.5), 0.0, 20, big, True,
    ),
    "dpm-3-beta-sigmas": ("DPMSolverMultistepScheduler", dict(DPM, solver_order=3, use_beta_sigmas=True), 0.0, 12, bent, True),
    "dpm-lambda-min-clipped": (
        "DPMSolverMultistepScheduler", dict(DPM, solver_order=3, lambda_min_clipped=-2.0), 0.0, 12, bent, True,
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


# -- EDM schedulers: VE latents, the network preconditioned by the scheduler -----------------------------


def edm_denoiser(x_ve: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """A clean prediction at VE level ``s``: the exact one for data ``N(MU, S0^2 I)``, bent."""
    s = s.reshape(-1, *[1] * (x_ve.ndim - 1)).double()
    exact = (S0**2 * x_ve.double() + s * s * MU) / (S0**2 + s * s)
    return (exact + 0.2 * torch.tanh(x_ve.double())).to(x_ve.dtype)


def edm_loop(sch, steps, x, gen, **step_kw):
    """An EDM pipeline's loop: the network's output is what the scheduler's ``precondition_outputs`` turns into
    :func:`edm_denoiser`'s prediction at the step's sigma."""
    sch.set_timesteps(steps)
    sd = sch.config.sigma_data
    for i, t in enumerate(sch.timesteps):
        s = sch.sigmas[i].double()
        d = edm_denoiser(x, s.expand(x.shape[0])).double()
        sign = -1.0 if sch.config.prediction_type == "v_prediction" else 1.0
        c_skip, c_out = sd**2 / (s * s + sd**2), sign * s * sd / (s * s + sd**2).sqrt()
        out = ((d - c_skip * x.double()) / c_out).to(x.dtype)
        # (a trailing axis: _threshold_sample wants channels and at least one more dimension)
        x = sch.step(out[..., None], t, x[..., None], generator=gen, **step_kw).prev_sample[..., 0]
    return x


def edm_velocity_of(chain):
    """The library's velocity for an EDM scheduler's chain: the denoiser at the VE latents, then the step's
    threshold where its config has one."""
    grid = chain.grid

    def v(y, t, **_):
        s = t.double() / (1 - t.double())
        d = edm_denoiser(y.double() * (1 + s[:, None]), s).double()
        if chain.prediction is not None:
            d = chain.prediction(d, torch.searchsorted(-grid[:-1], -t.double()))
        return ((y.double() - d) / t.double()[:, None]).to(y.dtype)

    return v


EDM_DPM = dict(algorithm_type="sde-dpmsolver++")
EDM_CASES = {
    "edm_dpm_1": dict(EDM_DPM, solver_order=1),
    "edm_dpm_2": dict(EDM_DPM),
    "edm_dpm_2_heun": dict(EDM_DPM, solver_type="heun"),
    "edm_dpm_2_exponential": dict(EDM_DPM, sigma_schedule="exponential"),
    "edm_dpm_2_thresholding": dict(EDM_DPM, thresholding=True, sample_max_value=1.5),
}


@pytest.mark.parametrize("case", list(EDM_CASES))
@pytest.mark.parametrize("steps", [9, 16])
def test_edm_dpm_solver_equals_the_schedulers_own_loop(case, steps):
    """``EDMDPMSolverMultistepScheduler`` (sde-dpmsolver++) at every order, with and without ``lower_order_final``
    (it binds below 15 steps), against its own loop with the same draws."""
    mk = lambda: diffusers.EDMDPMSolverMultistepScheduler(**EDM_CASES[case])  # noqa: E731
    sch = mk()
    sch.set_timesteps(steps)
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * float(sch.init_noise_sigma)
    ref = edm_loop(mk(), steps, x.clone(), torch.Generator().manual_seed(3))
    chain = scheduler_chain(mk(), steps)
    assert chain.history == EDM_CASES[case].get("solver_order", 2) - 1
    s0 = chain.grid[0] / (1 - chain.grid[0])
    out = specforest.sample(
        edm_velocity_of(chain), x / (1 + s0), sigmas=chain.grid, chain=chain,
        noise=replay(chain, torch.Generator().manual_seed(3), x.shape, x.dtype),
    ).samples  # fmt: skip
    assert float((out - ref.double()).abs().max()) <= 1e-5 * float(ref.abs().max()), case


def test_edm_dpm_solver_keeps_its_law_with_a_tree():
    chain = scheduler_chain(diffusers.EDMDPMSolverMultistepScheduler(**EDM_DPM), 16)
    run = law_run(chain, trees.chain(4), "rmc")
    testing.check_law(run.samples, chain.grid, None, MU, S0, chain=chain).assert_exact()
    assert float(run.stats.nfe.double().mean()) < 16


def test_edm_dpm_solver_third_order_is_refused_as_its_step_raises():
    """diffusers' EDM DPM-Solver has no third-order ``sde-dpmsolver++`` update: its step raises, so the chain is
    refused by name rather than made up."""
    sch = diffusers.EDMDPMSolverMultistepScheduler(**EDM_DPM, solver_order=3)
    with pytest.raises(UnboundLocalError):
        edm_loop(sch, 9, torch.randn(2, D, dtype=torch.float64), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="solver_order=3: its step raises"):
        scheduler_chain(diffusers.EDMDPMSolverMultistepScheduler(**EDM_DPM, solver_order=3), 9)


CHURN = {
    # gamma = s_churn / T = 5 / 12 is past sqrt(2) - 1: the min binds
    "churn5": ({}, dict(s_churn=5.0), 12),
    "churn2-window": ({}, dict(s_churn=2.0, s_tmin=0.5, s_tmax=20.0, s_noise=1.003), 12),
    "churn1-exponential-v": (dict(sigma_schedule="exponential", prediction_type="v_prediction"), dict(s_churn=1.0), 10),
}


@pytest.mark.parametrize("case", list(CHURN))
def test_edm_euler_with_churn_equals_the_schedulers_own_loop(case):
    """``EDMEulerScheduler.step(..., s_churn, s_tmin, s_tmax, s_noise)`` against its own loop, the same draws (it
    draws only where it churns)."""
    cfg, opts, steps = CHURN[case]
    mk = lambda: diffusers.EDMEulerScheduler(**cfg)  # noqa: E731
    sch = mk()
    sch.set_timesteps(steps)
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * float(sch.init_noise_sigma)
    ref = edm_loop(mk(), steps, x.clone(), torch.Generator().manual_seed(3), **opts)
    chain = scheduler_chain(mk(), steps, step_options=opts)
    assert bool((chain.R > 0).any()) and chain.params["s_churn"] == opts["s_churn"]
    s0 = chain.grid[0] / (1 - chain.grid[0])
    out = specforest.sample(
        edm_velocity_of(chain), x / (1 + s0), sigmas=chain.grid, chain=chain,
        noise=replay(chain, torch.Generator().manual_seed(3), x.shape, x.dtype),
    ).samples  # fmt: skip
    assert float((out - ref.double()).abs().max()) <= 1e-5 * float(ref.abs().max()), case
    # the churn changes the samples (so the case tests it)
    plain = edm_loop(mk(), steps, x.clone(), torch.Generator().manual_seed(3))
    assert float((plain - ref).abs().max()) > 1e-2 * float(ref.abs().max())


def test_edm_euler_with_churn_keeps_its_law_with_a_tree_and_the_test_rejects_another_churn():
    chain = scheduler_chain(diffusers.EDMEulerScheduler(), 12, step_options=dict(s_churn=5.0))
    run = law_run(chain, trees.uniform(2, 2), "grs")
    testing.check_law(run.samples, chain.grid, None, MU, S0, chain=chain).assert_exact()
    assert float(run.stats.nfe.double().mean()) < 12
    wrong = scheduler_chain(diffusers.EDMEulerScheduler(), 12, step_options=dict(s_churn=1.0))
    assert not testing.check_law(
        law_run(wrong, trees.uniform(2, 2), "grs").samples, chain.grid, None, MU, S0, chain=chain
    ).passed


def test_step_options_a_schedulers_step_does_not_read_are_refused_by_name():
    with pytest.raises(ValueError, match="s_churn: DDPMScheduler's step does not read them"):
        scheduler_chain(diffusers.DDPMScheduler(), 4, step_options=dict(s_churn=1.0))
    with pytest.raises(ValueError, match="s_noise must be a finite number >= 0"):
        scheduler_chain(diffusers.EDMEulerScheduler(), 4, step_options=dict(s_noise=-1.0))
    # s_churn 0 (what every pipeline passes) is deterministic Euler: no tree can speculate it
    assert not bool((scheduler_chain(diffusers.EDMEulerScheduler(), 4).R > 0).any())


def cm_loop(sch, steps, x, gen):
    """A consistency model pipeline's loop: the network's output is what the scheduler's boundary-condition
    scalings turn into :func:`edm_denoiser`'s prediction at the step's sigma."""
    sch.set_timesteps(steps)
    for i, t in enumerate(sch.timesteps):
        s = sch.sigmas[i].double()
        c_skip, c_out = (float(c) for c in sch.get_scalings_for_boundary_condition(s))
        out = (edm_denoiser(x, s.expand(x.shape[0])).double() - c_skip * x.double()) / c_out
        x = sch.step(out.to(x.dtype), t, x, generator=gen).prev_sample
    return x


@pytest.mark.parametrize("cfg", [{}, dict(clip_denoised=False, s_noise=1.01)], ids=["clip", "no-clip"])
@pytest.mark.parametrize("steps", [1, 3, 6])
def test_consistency_model_sampling_equals_the_schedulers_own_loop(cfg, steps):
    mk = lambda: diffusers.CMStochasticIterativeScheduler(**cfg)  # noqa: E731
    sch = mk()
    sch.set_timesteps(steps)
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * float(sch.init_noise_sigma)
    ref = cm_loop(mk(), steps, x.clone(), torch.Generator().manual_seed(3))
    chain = scheduler_chain(mk(), steps)
    s0 = chain.grid[0] / (1 - chain.grid[0])
    out = specforest.sample(
        edm_velocity_of(chain), x / (1 + s0), sigmas=chain.grid, chain=chain,
        noise=replay(chain, torch.Generator().manual_seed(3), x.shape, x.dtype),
    ).samples  # fmt: skip
    assert float((out - ref.double()).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_consistency_model_sampling_keeps_its_law_with_a_tree():
    chain = scheduler_chain(diffusers.CMStochasticIterativeScheduler(clip_denoised=False), 6)
    run = law_run(chain, trees.chain(3), "rmc")
    testing.check_law(run.samples, chain.grid, None, MU, S0, chain=chain).assert_exact()


# -- the registry: every scheduler of the installed diffusers followed or refused with its reason ---------


def test_every_diffusers_scheduler_is_followed_or_refused_with_its_reason():
    from specforest.diffusers.schedulers import FOLLOWED, REFUSED_SCHEDULERS

    names = {n for n in dir(diffusers) if n.endswith("Scheduler") and not n.startswith("_")}
    assert names <= set(FOLLOWED) | set(REFUSED_SCHEDULERS), sorted(names - set(FOLLOWED) - set(REFUSED_SCHEDULERS))
    assert not set(FOLLOWED) & set(REFUSED_SCHEDULERS)
    assert all(len(reason) > 20 for reason in REFUSED_SCHEDULERS.values())


@pytest.mark.parametrize(
    "name, reason",
    [
        ("KarrasVeScheduler", "two model calls a step: needs stages"),
        ("HeunDiscreteScheduler", "deterministic"),
        ("DDIMInverseScheduler", "an inversion"),
    ],
)
def test_a_refused_scheduler_is_refused_with_its_reason_and_the_swap(name, reason):
    with pytest.raises(ValueError, match=rf"{name} is .*{reason}.*Swap it in one line"):
        scheduler_chain(getattr(diffusers, name)(), 8)


def test_flow_match_lcm_draws_in_float32_promoted_with_the_outputs_dtype():
    """Its step upcasts the state to float32 and draws like ``x - s F``: a bfloat16 network's run draws in
    float32 (as the pipeline's step does), a float64 one's in float64."""
    from diffusers.utils.torch_utils import randn_tensor

    from specforest.diffusers.schedulers import PipelinePlan

    plan = PipelinePlan(chain=scheduler_chain(diffusers.FlowMatchLCMScheduler(), 4), velocity=None)
    for dtype, drawn in ((torch.bfloat16, torch.float32), (torch.float64, torch.float64)):
        noise = plan.noise_from(torch.Generator().manual_seed(1), (2, D), torch.device("cpu"), dtype)
        ref = randn_tensor((2, D), generator=torch.Generator().manual_seed(1), dtype=drawn)
        assert torch.equal(noise(0), ref.float()), dtype


def test_wuerstchen_ddpm_equals_the_schedulers_own_loop():
    """``DDPMWuerstchenScheduler``: the posterior step on its cosine schedule at continuous timesteps."""
    mk = lambda: diffusers.DDPMWuerstchenScheduler()  # noqa: E731
    steps = 12
    sch, gen = mk(), torch.Generator().manual_seed(3)
    sch.set_timesteps(steps)
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ref = x.clone()
    for t in sch.timesteps[:-1]:
        tt = t.expand(x.shape[0])
        e = bent(ref, sch._alpha_cumprod(tt, "cpu").double())
        ref = sch.step(e, tt, ref, generator=gen).prev_sample
    chain = scheduler_chain(mk(), steps)
    out = specforest.sample(
        velocity_of(chain, bent), to_y(chain, x, sch), sigmas=chain.grid, chain=chain,
        noise=replay(chain, torch.Generator().manual_seed(3), x.shape, x.dtype),
    ).samples  # fmt: skip
    assert float((out - ref.double()).abs().max()) <= 1e-5 * float(ref.abs().max())
    run = law_run(chain, trees.chain(4), "rmc")
    testing.check_law(run.samples, chain.grid, None, MU, S0, chain=chain).assert_exact()


def test_a_users_scheduler_is_followed_once_registered():
    """``register_scheduler``: a user's scheduler (here a DDPM subclass) is refused by name until a class that
    follows it is registered, then it is that class's chain."""
    from specforest.diffusers import schedulers as S

    class MyDDPMScheduler(diffusers.DDPMScheduler):
        pass

    with pytest.raises(ValueError, match="MyDDPMScheduler is not one chain='scheduler' follows"):
        scheduler_chain(MyDDPMScheduler(clip_sample=False), 5)

    class FollowsMine(S.FOLLOWED["DDPMScheduler"]):
        name = "MyDDPMScheduler"

    try:
        S.register_scheduler(FollowsMine)
        mine = scheduler_chain(MyDDPMScheduler(clip_sample=False), 5)
        ref = scheduler_chain(diffusers.DDPMScheduler(clip_sample=False), 5)
        assert mine.scheduler == "MyDDPMScheduler" and all(
            torch.equal(getattr(mine, f), getattr(ref, f)) for f in ("grid", "P", "Q", "R", "draws")
        )
    finally:
        S.FOLLOWED.pop("MyDDPMScheduler")


# -- KDPM2 ancestral: two model calls a step (a two-stage scheduler chain) -------------------------------


def kdpm2a_loop(sch, steps, x, gen, net):
    """The pipeline's loop over ``KDPM2AncestralDiscreteScheduler``'s interleaved timesteps (about two a step):
    the network at the level ``scale_model_input`` reads (the step's sigma on a first-order call, its
    interpolated sigma on a second-order one). Returns ``(latents, calls)``."""
    sch.set_timesteps(steps)
    calls = 0
    for t in sch.timesteps:
        first = sch.state_in_first_order
        inp = sch.scale_model_input(x, t)
        k = sch.step_index if first else sch.step_index - 1
        s = float((sch.sigmas if first else sch.sigmas_interpol)[k])
        e = net(inp, torch.full((x.shape[0],), 1 / (1 + s * s), dtype=torch.float64))
        x = sch.step(e, t, x, generator=gen).prev_sample
        calls += 1
    return x, calls


def as_v(net):
    """``net``'s noise prediction as a v-prediction network's output, ``v = sqrt(abar) eps - sqrt(1 - abar) x_0``:
    the same clean prediction for a scheduler with ``prediction_type="v_prediction"``."""

    def v(x_vp, ab):
        e = net(x_vp, ab).double()
        a, b = ab.double().sqrt()[:, None], (1 - ab.double()).sqrt()[:, None]
        return (a * e - b * (x_vp.double() - b * e) / a).to(x_vp.dtype)

    return v


KDPM2A = {
    "default": (dict(), 12),
    "v-prediction": (dict(prediction_type="v_prediction"), 9),
    "karras": (dict(use_karras_sigmas=True), 10),
    "trailing-scaled": (dict(timestep_spacing="trailing", beta_schedule="scaled_linear"), 9),
    "leading-offset": (dict(timestep_spacing="leading", steps_offset=1), 8),
    "exponential": (dict(use_exponential_sigmas=True), 7),
    "beta-sigmas": (dict(use_beta_sigmas=True), 6),
    "one-step": (dict(), 1),
}


@pytest.mark.parametrize("case", list(KDPM2A))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_kdpm2_ancestral_equals_the_schedulers_own_loop_call_for_call(case, dtype):
    """Its own loop and the two-stage chain at ``tree=None``, the same draws (one after each second-order
    call, none at the last step, which makes one call): the same latents and as many model calls."""
    cfg, steps = KDPM2A[case]
    mk = lambda: diffusers.KDPM2AncestralDiscreteScheduler(**cfg)  # noqa: E731
    sch = mk()
    x = initial(sch, steps, 8, dtype=dtype)
    net = as_v(bent) if cfg.get("prediction_type") == "v_prediction" else bent
    ref, calls = kdpm2a_loop(mk(), steps, x.clone(), torch.Generator().manual_seed(3), net)
    chain = scheduler_chain(sch, steps)
    assert chain.stages == 2 and chain.params == {"scheduler": "KDPM2AncestralDiscreteScheduler", "eta": None}
    s0 = chain.grid[0] / (1 - chain.grid[0])
    run = specforest.sample(
        velocity_of(chain, bent), (x.double() / (1 + s0)).to(dtype), sigmas=chain.grid, chain=chain,
        noise=replay(chain, torch.Generator().manual_seed(3), x.shape, dtype),
    )  # fmt: skip
    # (its step takes dt = sigma_next - sigma between its float32 sigmas in float32, even on float64 latents)
    tol = 1e-6 if dtype == torch.float64 else 1e-4
    assert float((run.samples.double() - ref.double()).abs().max()) <= tol * float(ref.double().abs().max()), case
    assert calls == 2 * steps - 1
    assert int(run.stats.nfe.max()) == calls


def test_kdpm2_ancestral_keeps_its_law_with_a_tree_and_the_test_rejects_half_its_noise():
    mk = diffusers.KDPM2AncestralDiscreteScheduler
    chain = scheduler_chain(mk(), 12)
    for tree, coupling in ((trees.uniform(2, 2), "grs"), (trees.chain(4), "rmc")):
        run = law_run(chain, tree, coupling)
        testing.check_law(run.samples, chain.grid, None, MU, S0, chain=chain).assert_exact()
        assert float(run.stats.nfe.double().mean()) < 2 * 12 - 1
    # the same tables with half its noise (s_noise 0.5): rejected
    quiet = replace(chain, R=0.5 * chain.R, remake=None)
    assert not testing.check_law(
        law_run(quiet, trees.uniform(2, 2), "grs").samples, chain.grid, None, MU, S0, chain=chain
    ).passed


def test_kdpm2_ancestral_configs_it_cannot_follow_are_refused_by_name():
    with pytest.raises(ValueError, match="prediction_type='sample'"):
        scheduler_chain(diffusers.KDPM2AncestralDiscreteScheduler(prediction_type="sample"), 8)
    with pytest.raises(ValueError, match="eta=0.5: KDPM2AncestralDiscreteScheduler's step takes no eta"):
        scheduler_chain(diffusers.KDPM2AncestralDiscreteScheduler(), 8, eta=0.5)


# -- DPMSolverSDEScheduler: two calls a step with correlated noises (a chain of half-steps) ---------------


def dpm_sde_loop(sch, steps, x, net, noise_sampler=None):
    """The pipeline's loop over ``DPMSolverSDEScheduler``'s interleaved timesteps (two a step, one into 0): the
    network at the level ``scale_model_input`` reads (the step's sigma, then its ``mid_point_sigma``), and its
    noise from ``noise_sampler`` where given (else its own Brownian tree). Returns ``(latents, calls)``."""
    sch.set_timesteps(steps)
    if noise_sampler is not None:
        sch.noise_sampler = noise_sampler
    calls = 0
    for t in sch.timesteps:
        first = sch.state_in_first_order
        inp = sch.scale_model_input(x, t)
        s = float(sch.sigmas[sch.step_index]) if first else float(sch.mid_point_sigma)
        e = net(inp, torch.full((x.shape[0],), 1 / (1 + s * s), dtype=torch.float64))
        x = sch.step(e, t, x).prev_sample
        calls += 1
    return x, calls


class BrownianPair:
    """The scheduler's noise sampler built from the chain's own draws ``z`` (one a half-step): a step's first call
    ``(sigma, sigma_mid)`` returns ``z[2 i]``, its second ``(sigma, sigma')`` ``rho z[2 i] + sqrt(1 - rho^2) z[2 i + 1]``
    with ``rho = sqrt((sigma - sigma_mid) / (sigma - sigma'))``, its Brownian tree's correlation, computed here from
    the levels the scheduler passes."""

    def __init__(self, z: list) -> None:
        self.z, self.calls, self.mid = z, 0, None

    def __call__(self, sigma, sigma_to):
        i, second = divmod(self.calls, 2)
        self.calls += 1
        if not second:
            self.mid = float(sigma_to)
            return self.z[2 * i]
        s, nxt = float(sigma), float(sigma_to)
        rho = (s - self.mid) ** 0.5 / (s - nxt) ** 0.5
        return rho * self.z[2 * i] + (1.0 - rho * rho) ** 0.5 * self.z[2 * i + 1]


DPM_SDE = {
    "default": (dict(), 12),
    "karras": (dict(use_karras_sigmas=True), 10),
    "v-prediction": (dict(prediction_type="v_prediction"), 9),
    "trailing-scaled": (dict(timestep_spacing="trailing", beta_schedule="scaled_linear"), 9),
    "exponential": (dict(use_exponential_sigmas=True), 7),
    "one-step": (dict(), 1),
}


@pytest.mark.parametrize("case", list(DPM_SDE))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_dpm_solver_sde_equals_the_schedulers_own_loop_call_for_call(case, dtype):
    """Its own loop fed the Brownian pair the chain's draws make (:class:`BrownianPair`) and the chain of half-steps
    at ``tree=None`` fed those draws: the same latents (to its float32 levels' rounding) and as many model calls,
    ``2 T - 1``."""
    cfg, steps = DPM_SDE[case]
    mk = lambda: diffusers.DPMSolverSDEScheduler(**cfg)  # noqa: E731
    sch = mk()
    x = initial(sch, steps, 8, dtype=dtype)
    z = [torch.randn(8, D, generator=torch.Generator().manual_seed(100 + k), dtype=dtype) for k in range(2 * steps)]
    net = as_v(bent) if cfg.get("prediction_type") == "v_prediction" else bent
    ref, calls = dpm_sde_loop(mk(), steps, x.clone(), net, BrownianPair(z))
    chain = scheduler_chain(sch, steps)
    assert chain.history == 1 and chain.params == {"scheduler": "DPMSolverSDEScheduler", "eta": None, "s_noise": 1.0}
    s0 = chain.grid[0] / (1 - chain.grid[0])
    run = specforest.sample(
        velocity_of(chain, bent), (x.double() / (1 + s0)).to(dtype), sigmas=chain.grid, chain=chain,
        noise=lambda n: z[n],
    )  # fmt: skip
    tol = 1e-6 if dtype == torch.float64 else 1e-4
    assert float((run.samples.double() - ref.double()).abs().max()) <= tol * float(ref.double().abs().max()), case
    assert calls == 2 * steps - 1 == int(run.stats.nfe.max()) == chain.timesteps.numel()


class _Independent(chains.DPMPPSDE):
    """The wrong DPM++ SDE: a step's two noises independent (``rho = 0``)."""

    def noise_correlation(self, s, s_mid, s_next):
        return torch.zeros_like(s)


@pytest.mark.filterwarnings("ignore:Should have")
def test_dpm_solver_sde_keeps_its_law_with_a_tree_and_the_test_rejects_independent_noises():
    """With a GRS tree and an RMC chain (lazy): the chain's closed form, and a two-sample comparison with the
    scheduler's own loop and its own Brownian-tree noise (torchsde); the same tables with independent noises for the
    two halves fail both."""
    pytest.importorskip("torchsde")
    from scipy import stats

    steps, n = 10, 4000
    chain = scheduler_chain(diffusers.DPMSolverSDEScheduler(noise_sampler_seed=5), steps)
    sch = diffusers.DPMSolverSDEScheduler(noise_sampler_seed=5)
    x = initial(sch, steps, n, seed=6)
    own, _ = dpm_sde_loop(sch, steps, x.clone(), eps_gauss)
    s0 = chain.grid[0] / (1 - chain.grid[0])

    def two_sample(ours):  # KS p of a projection and of the squared norm about MU, ours in VE latents at 0
        u = torch.ones(D, dtype=torch.float64) / D**0.5
        proj = stats.ks_2samp((ours @ u).numpy(), (own.double() @ u).numpy()).pvalue
        sq = lambda a: ((a.double() - MU) ** 2).sum(1).numpy()  # noqa: E731
        return min(float(proj), float(stats.ks_2samp(sq(ours), sq(own)).pvalue))

    y0 = x.double() / (1 + s0)
    for tree, coupling, lazy in ((trees.uniform(2, 2), "grs", False), (trees.chain(4), "rmc", True)):
        run = specforest.sample(
            velocity_of(chain, eps_gauss), y0, sigmas=chain.grid, chain=chain, tree=tree, coupling=coupling,
            draft="x0", seed=4, lazy=lazy,
        )  # fmt: skip
        law = testing.check_law(run.samples, chain.grid, None, MU, S0, chain=chain, init_scale=chain.noise_scale)
        law.assert_exact()
        assert two_sample(run.samples) > 1e-4
        assert float(run.stats.nfe.double().mean()) < 2 * steps - 1
    wrong_ch = _Independent(eta=1.0, r=0.5)
    a, b = chain.grid[:-1], chain.grid[1:]
    P, Q, R = wrong_ch.step(a, b)
    wrong = replace(chain, P=P, Q=Q, R=R, B=wrong_ch.past(a, b), K=wrong_ch.carries(a, b), remake=None)
    run = specforest.sample(
        velocity_of(wrong, eps_gauss), y0, sigmas=chain.grid, chain=wrong, tree=trees.uniform(2, 2), draft="x0", seed=4
    )
    assert two_sample(run.samples) < 1e-6


def test_dpm_solver_sde_configs_it_cannot_follow_are_refused_by_name():
    with pytest.raises(ValueError, match="prediction_type='sample'"):
        scheduler_chain(diffusers.DPMSolverSDEScheduler(prediction_type="sample"), 8)
    with pytest.raises(ValueError, match="eta=0.5: DPMSolverSDEScheduler's step takes no eta"):
        scheduler_chain(diffusers.DPMSolverSDEScheduler(), 8, eta=0.5)
    with pytest.raises(ValueError, match="s_noise"):
        scheduler_chain(diffusers.DPMSolverSDEScheduler(), 8, step_options={"s_noise": -1.0})
