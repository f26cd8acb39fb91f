"""``specforest.diffusers.sample(pipe, ..., chain="scheduler")`` on tiny SD 1.5 and SDXL pipelines.

With no tree, the latents are the pipeline's own ``pipe(...)`` for the same generator, for each
stochastic scheduler swapped in from the pipeline's config; the pipeline and its scheduler are left
as they were. With a tree, the law is the scheduler's: a "UNet" returning the exact noise of a
Gaussian data law (``GaussianUNet``) gives the closed form, which the same test rejects for a wrong
``eta`` and for the EM chain. A deterministic scheduler is refused with a tree, naming the swap.
"""

from __future__ import annotations

from dataclasses import replace

import diffusers
import pytest
import torch
from test_diffusers_sdxl import (
    BETAS,
    MU,
    PROMPTS,
    TAU,
    GaussianUNet,
    build_tiny_pipeline,
    gen,
    text_shift,
    with_scheduler,
)

import specforest.diffusers as px
from specforest import testing, trees

KW = dict(num_inference_steps=8, guidance_scale=4.0, height=8, width=8, output_type="latent")

SCHEDULERS = {
    "ddpm": ("DDPMScheduler", {}, 0.0),
    "ddim": ("DDIMScheduler", {"clip_sample": False}, 1.0),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}, 0.0),
    "dpm_sde": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}, 0.0),
    # third order: two past predictions carried (history 2); at 8 steps lower_order_final binds at the 7th
    "dpm_sde_3": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++", "solver_order": 3}, 0.0),
    "lcm": ("LCMScheduler", {}, 0.0),
    "tcd": ("TCDScheduler", {}, 0.3),
    # two UNet calls a step, the second at the scheduler's interpolated timestep (2 T - 1 calls); its default
    # linspace spacing gives fractional first-call timesteps, whose sigmas it interpolates linearly
    "kdpm2_a": ("KDPM2AncestralDiscreteScheduler", {}, 0.0),
    "kdpm2_a_leading": ("KDPM2AncestralDiscreteScheduler", {"timestep_spacing": "leading"}, 0.0),
    # two UNet calls a step with correlated noises from its Brownian tree (a chain of half-steps, 2 T - 1 calls)
    "dpm_solver_sde": ("DPMSolverSDEScheduler", {}, 0.0),
    # EDM's preconditioning (Playground v2.5's SDXL pipeline): the UNet takes c_in x at c_noise = log(sigma) / 4
    "edm_dpm_sde": ("EDMDPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}, 0.0),
    "edm_euler": ("EDMEulerScheduler", {}, 0.0),
}
CALLS = {"kdpm2_a": 15, "kdpm2_a_leading": 15, "dpm_solver_sde": 15}
"""The UNet calls of a standard run of 8 steps where a step makes more than one (else 8)."""
BROWNIAN = ("dpm_solver_sde",)
"""The schedulers whose noise is their Brownian tree's, not the generator's (their own no-tree test)."""


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pipes():
    return {"sd": build_tiny_pipeline("sd"), "sdxl": build_tiny_pipeline("sdxl")}


def swapped(pipe, name, cfg):
    """``pipe`` with ``name`` swapped in as users do: ``Scheduler.from_config(pipe.scheduler.config)``."""
    return with_scheduler(pipe, getattr(diffusers, name).from_config(pipe.scheduler.config, **cfg))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("family", ["sd", "sdxl"])
@pytest.mark.parametrize("case", [c for c in SCHEDULERS if c not in BROWNIAN])
def test_no_tree_gives_the_pipelines_own_latents(pipes, family, case):
    name, cfg, eta = SCHEDULERS[case]
    pipe = swapped(pipes[family], name, cfg)
    extra = {"eta": eta} if eta else {}
    ref = pipe(PROMPTS, generator=gen(1), **extra, **KW).images
    before = (pipe.scheduler.timesteps.clone(), getattr(pipe.scheduler, "_step_index", None))
    ours = px.sample(pipe, PROMPTS, chain="scheduler", generator=gen(1), progress=False, **extra, **KW)
    torch.testing.assert_close(ours.latents, ref, atol=1e-5 * float(ref.abs().max()), rtol=0)
    assert ours.stats.nfe.tolist() == [CALLS.get(case, 8)] * 2
    # the pipeline is left as it was: its scheduler did not move, and pipe(...) gives its own latents again
    assert (
        torch.equal(pipe.scheduler.timesteps, before[0]) and getattr(pipe.scheduler, "_step_index", None) == before[1]
    )
    assert torch.equal(pipe(PROMPTS, generator=gen(1), **extra, **KW).images, ref)
    assert ours.config["chain"] == "scheduler" and ours.config["scheduler"] == name


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("family", ["sd", "sdxl"])
@pytest.mark.parametrize("seed", [5, None], ids=["noise_sampler_seed", "global"])
def test_dpm_solver_sde_with_no_tree_gives_the_pipelines_own_latents_from_its_brownian_tree(pipes, family, seed):
    """``DPMSolverSDEScheduler`` through ``pipe(...)`` with no tree: its noise is its own Brownian tree's, queried as
    its step queries it (seeded by ``noise_sampler_seed``, else by torch's global generator), never the pipeline's
    generator; the pipeline's own latents, in ``2 T - 1`` UNet calls. Another tree seed gives other latents."""
    name, cfg, _ = SCHEDULERS[BROWNIAN[0]]
    pipe = swapped(pipes[family], name, {**cfg, "noise_sampler_seed": seed})
    torch.manual_seed(7)
    ref = pipe(PROMPTS, generator=gen(1), **KW).images
    torch.manual_seed(7)
    ours = px.sample(pipe, PROMPTS, chain="scheduler", generator=gen(1), progress=False, **KW)
    torch.testing.assert_close(ours.latents, ref, atol=1e-5 * float(ref.abs().max()), rtol=0)
    assert ours.stats.nfe.tolist() == [CALLS[BROWNIAN[0]]] * 2
    assert ours.config["scheduler"] == name and ours.config["chain"] == "scheduler"
    torch.manual_seed(8)
    other = swapped(pipes[family], name, {**cfg, "noise_sampler_seed": None if seed else 6})
    moved = px.sample(other, PROMPTS, chain="scheduler", generator=gen(1), progress=False, **KW).latents
    assert float((moved - ref).abs().max()) > 1e-2 * float(ref.abs().max())


def test_refusals_name_the_scheduler_and_the_swap(pipes):
    pipe = pipes["sd"]  # PNDM: deterministic
    with pytest.raises(ValueError, match="EulerAncestralDiscreteScheduler.from_config"):
        px.sample(pipe, PROMPTS, chain="scheduler", K=2, L=2, generator=gen(0), progress=False, **KW)
    learned = swapped(pipe, "DDPMScheduler", {"variance_type": "learned_range"})
    with pytest.raises(ValueError, match="comes from the network"):
        px.sample(learned, PROMPTS, chain="scheduler", generator=gen(0), progress=False, **KW)
    with pytest.raises(ValueError, match="eta=0.5 is the scheduler's step argument"):
        px.sample(pipe, PROMPTS, eta=0.5, generator=gen(0), progress=False, **KW)
    # a deterministic scheduler with no tree is its own chain's standard sampler: not refused here,
    # but with PNDM there is no chain to follow at all
    with pytest.raises(ValueError, match="PNDMScheduler is deterministic"):
        px.sample(pipe, PROMPTS, chain="scheduler", generator=gen(0), progress=False, **KW)


# -- the law with trees ---------------------------------------------------------------------------


class GaussianEDMUNet(torch.nn.Module):
    """The exact "UNet" of data ``N(MU + text_shift, TAU^2 I)`` behind EDM's preconditioning (an EDM scheduler's):
    from ``c_in x`` at ``c_noise = log(s) / 4`` it returns the epsilon output ``F`` with ``D = c_skip x + c_out F``."""

    def __init__(self, config, sigma_data=0.5):
        super().__init__()
        self.config, self.sigma_data = config, sigma_data
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # gives the module a dtype and a device

    def forward(self, sample, timestep, encoder_hidden_states=None, return_dict=True, **_):
        s = (4 * timestep.double()).exp().reshape(-1, 1, 1, 1)
        sd2 = self.sigma_data**2
        x = sample.double() * (s * s + sd2).sqrt()
        mu = MU + text_shift(encoder_hidden_states).reshape(-1, 1, 1, 1)
        d = mu + TAU**2 / (TAU**2 + s * s) * (x - mu)
        out = (d - sd2 / (s * s + sd2) * x) / (s * self.sigma_data / (s * s + sd2).sqrt())
        return (out.to(sample.dtype),)


@pytest.fixture(scope="module")
def gaussian(pipes):
    """The SD pipeline with the exact Gaussian "UNet" of data ``N(MU + shift(caption), TAU^2 I)`` (EDM's
    preconditioned one for an EDM scheduler)."""
    sd = pipes["sd"]

    def make(name, cfg):
        pipe = swapped(sd, name, {**BETAS, **cfg})
        if name.startswith("EDM"):
            unet = GaussianEDMUNet(sd.unet.config, pipe.scheduler.config.sigma_data)
        else:
            unet = GaussianUNet(sd.unet.config, pipe.scheduler.alphas_cumprod)
        object.__setattr__(pipe, "unet", unet)
        return pipe

    return make


def law(gaussian, case, N=1500, tree=None, coupling="grs", eta=None, chain="scheduler", seed=3, followed=None):
    """The closed-form law test of ``case``'s scheduler through ``sample(pipe, ...)``; ``followed``: a wrong
    :class:`~specforest.diffusers.schedulers.Followed` the run follows the scheduler with instead of its own."""
    from specforest.diffusers import schedulers

    name, cfg, eta0 = SCHEDULERS[case]
    pipe = gaussian(name, {**cfg, "clip_sample": False})  # (clipping: a law without a closed form)
    plan = schedulers.for_pipeline(pipe, 8, eta0, None, None)
    eta = eta0 if eta is None else eta
    extra = {"eta": eta} if chain == "scheduler" and eta else {}
    with pytest.MonkeyPatch.context() as mp:
        if followed is not None:
            mp.setitem(schedulers.FOLLOWED, name, followed)
        out = px.sample(
            pipe, PROMPTS[:1], num_images_per_prompt=N, num_inference_steps=8, guidance_scale=1.0, height=8,
            width=8, output_type="latent", chain=chain, tree=tree, coupling=coupling, generator=gen(seed),
            progress=False, **extra,
        )  # fmt: skip
    with torch.no_grad():
        pe, _ = pipe.encode_prompt(PROMPTS[:1], "cpu", 1, False)
    mu = (MU + text_shift(pe)[0]).reshape(-1)
    rep = testing.check_law(
        out.latents.reshape(N, -1).double(), plan.chain.grid, None, mu, TAU, chain=plan.chain,
        init_scale=plan.noise_scale,
    )  # fmt: skip
    return rep, out.stats


@pytest.mark.parametrize(
    "case, tree, coupling",
    [
        ("ddpm", trees.uniform(2, 2), "grs"),
        ("ddim", trees.chain(4), "rmc"),
        ("euler_a", trees.uniform(2, 2), "grs"),
        ("dpm_sde", trees.chain(4), "rmc"),
        ("dpm_sde_3", trees.uniform(2, 2), "grs"),
        ("tcd", trees.chain(3), "rmc"),
        ("kdpm2_a", trees.uniform(2, 2), "grs"),
        ("kdpm2_a_leading", trees.chain(4), "rmc"),
        ("dpm_solver_sde", trees.chain(4), "rmc"),
        ("edm_dpm_sde", trees.uniform(2, 2), "grs"),
    ],
)
def test_speculated_pipelines_have_the_schedulers_law(gaussian, case, tree, coupling):
    rep, stats = law(gaussian, case, tree=tree, coupling=coupling)
    rep.assert_exact()
    assert float(stats.nfe.double().mean()) < CALLS.get(case, 8)


def test_the_pipeline_law_test_rejects_dpm_solver_sde_with_independent_noises(gaussian):
    """DPM-Solver SDE's two noises a step are correlated (one Brownian motion): the same tables with independent
    noises, run through ``sample(pipe, ...)`` on the same RMC chain, fail the law test its own chain passes."""
    from specforest.chains import DPMPPSDE
    from specforest.diffusers.schedulers import FOLLOWED

    own = FOLLOWED["DPMSolverSDEScheduler"]

    class Independent(DPMPPSDE):
        def noise_correlation(self, s, s_mid, s_next):
            return torch.zeros_like(s)

    class IndependentNoises(own):
        @classmethod
        def tables(cls, sch, eta, **options):
            right = own.tables(sch, eta, **options)
            wrong, a, b = Independent(eta=1.0, r=0.5), right.grid[:-1], right.grid[1:]
            P, Q, R = wrong.step(a, b)
            return replace(right, P=P, Q=Q, R=R, B=wrong.past(a, b), K=wrong.carries(a, b))

    rep, _ = law(gaussian, "dpm_solver_sde", tree=trees.chain(4), coupling="rmc", followed=IndependentNoises)
    assert not rep.passed


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("family", ["sd", "sdxl"])
@pytest.mark.parametrize("case", ["kdpm2_a", "kdpm2_a_leading", "dpm_solver_sde"])
def test_the_unet_gets_the_two_call_schedulers_own_timesteps_exactly(pipes, family, case):
    """KDPM2 ancestral and DPM-Solver SDE through ``pipe(...)``: with no tree the UNet is called ``2 T - 1`` times, at
    the very timesteps the pipeline's own loop passes it (each step's first call and its second, in that order), as
    its time embedding reads them (float32). (KDPM2 ancestral's second call is at the next step's first call's
    level, ``sigma_interpol = sigma'`` at its ``eta = 1``, with another timestep: the chain declares each call's.)"""
    from test_diffusers_sdxl import _Calls

    pipe = swapped(pipes[family], *SCHEDULERS[case][:2])
    with _Calls(pipe.unet) as calls:
        pipe(PROMPTS, generator=gen(1), **KW)
    own = [c["timestep"].reshape(-1)[0].float() for c in calls]
    with _Calls(pipe.unet) as calls:
        px.sample(pipe, PROMPTS, chain="scheduler", generator=gen(1), progress=False, **KW)
    ours = [c["timestep"].reshape(-1).float() for c in calls]
    assert len(own) == len(ours) == CALLS[case]
    for i, (k, t) in enumerate(zip(ours, own, strict=True)):
        assert torch.equal(k, t.expand_as(k)), (i, t.item(), k.tolist())


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("lazy", [False, True], ids=["full", "lazy"])
@pytest.mark.parametrize("case", ["kdpm2_a", "dpm_solver_sde"])
def test_with_a_tree_every_unet_call_is_at_one_of_the_schedulers_own_timesteps(pipes, case, lazy):
    """With a tree (drafted nodes verified in full, or on demand), each UNet call is at one of the timesteps the
    pipeline's own loop passes, exactly: each call's declared one, never a map of its level."""
    from test_diffusers_sdxl import _Calls

    pipe = swapped(pipes["sd"], *SCHEDULERS[case][:2])
    with _Calls(pipe.unet) as calls:
        pipe(PROMPTS, generator=gen(1), **KW)
    own = {c["timestep"].reshape(-1)[0].float().item() for c in calls}
    with _Calls(pipe.unet) as calls:
        px.sample(
            pipe, PROMPTS, chain="scheduler", tree=trees.uniform(2, 2), lazy=lazy, generator=gen(1), progress=False,
            **KW,
        )  # fmt: skip
    seen = {v for c in calls for v in c["timestep"].reshape(-1).float().tolist()}
    assert seen <= own and len(seen) > 1, sorted(seen - own)


def test_the_vp_grid_of_kdpm2_ancestral_is_its_first_calls():
    """The UNet families' grid (``vp_schedule``) of KDPM2 ancestral: its first calls' timesteps (every other
    one of its interleaved list); the deterministic KDPM2, which ``chain="scheduler"`` does not follow, is
    still refused."""
    from test_diffusers_sdxl import BETAS as betas

    from specforest.diffusers.unet import vp_schedule

    for spacing in ("linspace", "leading", "trailing"):
        sch = diffusers.KDPM2AncestralDiscreteScheduler(**betas, timestep_spacing=spacing, steps_offset=1)
        grid = vp_schedule(sch, 8)
        sch.set_timesteps(8)
        assert grid.timesteps.tolist() == sch.timesteps[0::2].double().tolist() and grid.steps == 8
    with pytest.raises(ValueError, match="distinct decreasing levels"):
        vp_schedule(diffusers.KDPM2DiscreteScheduler(**betas), 8)


def test_the_pipeline_law_test_rejects_a_wrong_eta_and_the_em_chain(gaussian):
    rep, _ = law(gaussian, "ddim", tree=trees.chain(4), coupling="rmc", eta=0.5)
    assert not rep.passed
    rep, _ = law(gaussian, "ddim", tree=trees.chain(4), coupling="rmc", chain="em")
    assert not rep.passed
    rep, _ = law(gaussian, "edm_dpm_sde", tree=trees.uniform(2, 2), coupling="grs", chain="em")
    assert not rep.passed


@pytest.mark.filterwarnings("ignore")
def test_an_edm_scheduler_drives_the_unet_with_its_own_preconditioning(pipes):
    """An EDM scheduler swapped into the SD pipeline: the UNet gets the pipeline's own time input
    ``c_noise = log(sigma) / 4`` (float32 rounding) at each of its 8 calls; ``prediction_type="sample"``, which
    EDM's preconditioning has not, is refused naming it."""
    from test_diffusers_sdxl import _Calls

    pipe = swapped(pipes["sd"], "EDMDPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"})
    with _Calls(pipe.unet) as calls:
        pipe(PROMPTS, generator=gen(1), **KW)
    own = torch.stack([c["timestep"].reshape(-1)[0] for c in calls]).double()
    with _Calls(pipe.unet) as calls:
        px.sample(pipe, PROMPTS, chain="scheduler", generator=gen(1), progress=False, **KW)
    ours = torch.stack([c["timestep"].reshape(-1)[0] for c in calls]).double()
    assert own.numel() == ours.numel() == 8
    torch.testing.assert_close(ours, own, rtol=0, atol=1e-5)
    bad = swapped(pipes["sd"], "EDMEulerScheduler", {"prediction_type": "sample"})
    with pytest.raises(ValueError, match="prediction_type"):
        px.sample(bad, PROMPTS, progress=False, **KW)


# -- flow matching: SD3 and Flux with stochastic_sampling=True --------------------------------------


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_stochastic_flow_matching_gives_the_pipelines_own_latents(family, tmp_path):
    """FlowMatchEulerDiscreteScheduler(stochastic_sampling=True), the one stochastic scheduler for SD3
    and Flux: with no tree the pipeline's latents, with a tree fewer calls; off, it is refused with a tree."""
    if family == "sd3":
        from test_diffusers_sd3 import BASE, PROMPT
        from test_diffusers_sd3 import build_tiny_pipeline as build

        base = build(tmp_path)
    else:
        from test_diffusers_flux import BASE, PROMPT, build_tiny_flux

        base = build_tiny_flux()
    for m in base.components.values():
        if isinstance(m, torch.nn.Module):
            m.eval()  # (no dropout drawing from the global generator the scheduler's noise comes from)
    sch = diffusers.FlowMatchEulerDiscreteScheduler.from_config(base.scheduler.config, stochastic_sampling=True)
    pipe = with_scheduler(base, sch)
    kw = {k: v for k, v in BASE.items() if k != "progress"}
    # (these pipelines call step without their generator: its noise is torch's global generator's)
    torch.manual_seed(5)
    ref = pipe(PROMPT, num_inference_steps=6, generator=gen(2), **kw).images
    torch.manual_seed(5)
    ours = px.sample(pipe, PROMPT, chain="scheduler", num_inference_steps=6, generator=gen(2), progress=False, **kw)
    if family == "flux":
        ref = pipe._unpack_latents(ref, 8, 8, pipe.vae_scale_factor)
    torch.testing.assert_close(ours.latents, ref.float(), atol=1e-5 * float(ref.abs().max()), rtol=0)
    tree = px.sample(
        pipe, PROMPT, chain="scheduler", num_inference_steps=6, coupling="rmc", L=4, generator=gen(2),
        progress=False, **kw,
    )  # fmt: skip
    assert float(tree.stats.nfe.double().mean()) <= 6
    with pytest.raises(ValueError, match="stochastic_sampling=False is deterministic"):
        px.sample(base, PROMPT, chain="scheduler", num_inference_steps=6, L=4, coupling="rmc", progress=False, **kw)


@pytest.mark.filterwarnings("ignore")
def test_the_memory_plan_counts_the_prediction_dpm_solver_carries(pipes):
    """sde-dpmsolver++ (order 2) reads the previous prediction: the plan holds one more state an image."""
    pipe = pipes["sd"]
    runs = {
        case: px.sample(swapped(pipe, *SCHEDULERS[case][:2]), PROMPTS, chain="scheduler", progress=False, **KW)
        for case in ("euler_a", "dpm_sde")
    }
    state = 4 * 4 * 4 * 4  # one (4, 4, 4) latent in float32
    assert runs["dpm_sde"].memory.trajectory_bytes - runs["euler_a"].memory.trajectory_bytes == state


@pytest.mark.filterwarnings("ignore")
def test_tune_with_the_schedulers_chain_records_it_and_its_choice_runs_checked(pipes, monkeypatch):
    """tune_sdxl(chain="scheduler", eta=...) tunes the pipeline's own scheduler: the choice records the
    scheduler's class and eta (through JSON too), unpacks as chain="scheduler" with that eta, and a run
    with another scheduler or eta is refused naming both. Ten steps: the timing runs (six-step warm-ups)
    take the scheduler's chain at their own step count (SchedulerChain.for_steps)."""
    import specforest.memory
    from specforest.diffusers import tune_sdxl
    from specforest.latency import Tuned

    monkeypatch.setattr(specforest.memory, "held_bytes", lambda device="cpu": 0)
    tcd = swapped(pipes["sd"], "TCDScheduler", {})
    kw = dict(num_inference_steps=10, height=8, width=8, budget_max=3, drafts=("velocity",), calibration_images=1)
    tuned = tune_sdxl(tcd, PROMPTS[0], chain="scheduler", eta=0.3, max_memory_gb=1.0, **kw)
    assert tuned.chain == "scheduler" and tuned.churn is None
    assert tuned.chain_params == {"scheduler": "TCDScheduler", "eta": 0.3}
    assert dict(tuned)["chain"] == "scheduler" and dict(tuned)["eta"] == 0.3
    back = Tuned.from_json(tuned.to_json())
    assert (back.chain, back.chain_params, back.tuned_for) == (tuned.chain, tuned.chain_params, tuned.tuned_for)
    run = dict(num_inference_steps=10, height=8, width=8, progress=False, output_type="latent")
    res = px.sample(tcd, PROMPTS[0], generator=gen(0), **run, **tuned)
    assert res.config["chain"] == "scheduler" and res.config["scheduler"] == "TCDScheduler"
    euler_a = swapped(pipes["sd"], "EulerAncestralDiscreteScheduler", {})
    with pytest.raises(ValueError, match=r"scheduler 'EulerAncestralDiscreteScheduler' \(tuned for 'TCDScheduler'\)"):
        px.sample(euler_a, PROMPTS[0], **run, **{**tuned, "eta": 0.0})
    with pytest.raises(ValueError, match=r"eta 0.5 \(tuned for 0.3\)"):
        px.sample(tcd, PROMPTS[0], **run, **{**tuned, "eta": 0.5})
    with pytest.raises(ValueError, match=r"chain euler_ancestral \(tuned for scheduler\)"):
        px.sample(tcd, PROMPTS[0], **run, **{**tuned, "chain": "euler_ancestral", "eta": 0.0})
    bad = {**tuned.to_json(), "chain_params": {"scheduler": "TCDScheduler", "eta": -1}}
    with pytest.raises(ValueError, match="chain_params.eta"):
        Tuned.from_json(bad)


@pytest.mark.filterwarnings("ignore")
def test_tune_with_a_scheduler_that_reads_no_eta_records_eta_null_and_its_choice_runs(pipes, monkeypatch):
    """A scheduler whose step takes no ``eta`` (Euler ancestral): the run records ``eta: null``
    (``chain="scheduler"`` refuses an eta it would drop), and so does tune_sdxl's choice, through JSON too;
    its choice runs. Before, the tuner stopped building its record (``chain_params.eta`` must be a number)."""
    import specforest.memory
    from specforest.diffusers import tune_sdxl
    from specforest.latency import Tuned

    monkeypatch.setattr(specforest.memory, "held_bytes", lambda device="cpu": 0)
    euler_a = swapped(pipes["sd"], "EulerAncestralDiscreteScheduler", {})
    kw = dict(num_inference_steps=10, height=8, width=8, budget_max=3, drafts=("velocity",), calibration_images=1)
    tuned = tune_sdxl(euler_a, PROMPTS[0], chain="scheduler", max_memory_gb=1.0, **kw)
    assert tuned.chain_params == {"scheduler": "EulerAncestralDiscreteScheduler", "eta": None}
    assert "eta" not in dict(tuned)
    back = Tuned.from_json(tuned.to_json())
    assert (back.chain_params, back.tuned_for) == (tuned.chain_params, tuned.tuned_for)
    run = dict(num_inference_steps=10, height=8, width=8, progress=False, output_type="latent")
    res = px.sample(euler_a, PROMPTS[0], generator=gen(0), **run, **tuned)
    assert res.config["scheduler"] == "EulerAncestralDiscreteScheduler"


def test_a_schedulers_chain_at_another_step_count_is_its_own_there():
    """SchedulerChain.for_steps(n) is scheduler_chain(scheduler, n): the same tables, and the chain of T
    steps built on that grid takes them (what a tuner's shorter timing runs do); one made for an
    explicit grid has that length only."""
    from specforest.diffusers.schedulers import scheduler_chain

    for name, cfg, eta in SCHEDULERS.values():
        # (from_config: an EDM scheduler takes no betas)
        sch = getattr(diffusers, name).from_config({**BETAS, **cfg})
        chain = scheduler_chain(sch, 12, eta=eta)
        short = chain.for_steps(5)
        ref = scheduler_chain(sch, 5, eta=eta)
        torch.testing.assert_close(short.grid, ref.grid, rtol=0, atol=0)
        built, own = chain.build(ref.grid), ref.build(ref.grid)
        for field in ("a", "c", "scale"):
            assert torch.equal(getattr(built, field), getattr(own, field)), (name, field)
        assert torch.equal(built.past, own.past), name
        assert short.for_steps(12) is chain
    fixed = scheduler_chain(
        diffusers.FlowMatchEulerDiscreteScheduler(stochastic_sampling=True), 4, sigmas=[1.0, 0.6, 0.3, 0.1]
    )
    with pytest.raises(ValueError, match="made for 4 steps only"):
        fixed.for_steps(6)


@pytest.mark.filterwarnings("ignore")
def test_an_eta_the_step_does_not_read_or_cannot_take_is_refused_before_any_work(pipes, monkeypatch):
    """``sample(..., chain="scheduler", eta=...)``: with Euler ancestral (whose step takes no eta, so the images
    would be those without it) and with DDIM above the largest eta its steps allow (diffusers' pipe gives
    NaN there), refused naming eta before the text is encoded."""
    from helpers import never_called

    euler_a = swapped(pipes["sd"], "EulerAncestralDiscreteScheduler", {})
    ddim = swapped(pipes["sd"], "DDIMScheduler", {"clip_sample": False})
    nan = ddim(PROMPTS, generator=gen(0), eta=3.0, **KW).images
    assert bool(torch.isnan(nan).any())
    for pipe in (euler_a, ddim):
        monkeypatch.setattr(pipe.text_encoder, "forward", never_called)
    with pytest.raises(ValueError, match="eta=0.5: EulerAncestralDiscreteScheduler's step takes no eta"):
        px.sample(euler_a, PROMPTS, chain="scheduler", eta=0.5, generator=gen(0), progress=False, **KW)
    with pytest.raises(ValueError, match=r"eta=3 gives a negative variance at step \d+ \(timestep \d+"):
        px.sample(ddim, PROMPTS, chain="scheduler", eta=3.0, generator=gen(0), progress=False, **KW)
