"""Flux through diffusers, offline: a tiny ``FluxPipeline`` built in code.

A CLIP text encoder, a T5 encoder, a Flux transformer and a VAE of a few
thousand parameters each, with tokenizers built from in-memory vocabularies, so
nothing is downloaded. They check the plumbing (packing, positions, embedded
guidance, true CFG, the dynamic-shift grid, latents, decoding, dispatch)
against diffusers' own code, and the law of the speculative samplers against a
standard chain built from diffusers' own packing on a 64-dimensional latent;
they say nothing about image quality, which needs real weights.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import specforest
from specforest import diffusers as sd
from specforest.diffusers import families, flux_velocity
from specforest.diffusers import pipeline_flux as flux

WORDS = ["a", "photo", "of", "cat", "dog", "red", "blue", "car", "on", "the", "street", "tree", "green", "house"]
PROMPT = "a photo of a cat"
SEQ = 8  # T5 tokens; the CLIP tokenizer has model_max_length 8 as well
BASE = dict(height=8, width=8, progress=False, max_sequence_length=SEQ, output_type="latent")
CHANNELS = 4  # latent channels: the transformer reads 4 x 4 = 16 features per packed token


def _clip_tokenizer():
    """A byte-pair CLIP tokenizer whose merges spell WORDS, built in memory."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in sorted(set("".join(WORDS))):
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    merges = []
    for word in WORDS:
        cur = word[0]
        for i, ch in enumerate(word[1:]):
            nxt = ch + ("</w>" if i == len(word) - 2 else "")
            if (cur, nxt) not in merges:
                merges.append((cur, nxt))
            cur += nxt
            vocab.setdefault(cur, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=SEQ), len(vocab)


def _t5_tokenizer():
    """A unigram T5 tokenizer over WORDS, built in memory."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)] + [("\u2581" + w, -1.0) for w in WORDS]
    return T5TokenizerFast(vocab=pieces, extra_ids=0), len(pieces)


def _transformer(guidance_embeds: bool, in_channels: int = 4 * CHANNELS):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=in_channels,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        pooled_projection_dim=8,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(2, 2, 4),
    )


def build_tiny_flux():
    """A complete ``FluxPipeline`` like FLUX.1-dev (embedded guidance, dynamic shift), tiny and random.

    VAE scale factor 2, so 8 x 8 images give 4 x 4 x 4 latents and 2 x 2 = 4 packed tokens.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_tok, clip_vocab = _clip_tokenizer()
    t5_tok, t5_vocab = _t5_tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        clip = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=clip_vocab,
                hidden_size=8,
                intermediate_size=16,
                num_attention_heads=2,
                num_hidden_layers=1,
                max_position_embeddings=SEQ,
                bos_token_id=0,
                eos_token_id=1,
                pad_token_id=1,
            )
        )
        t5 = T5EncoderModel(
            T5Config(
                vocab_size=t5_vocab,
                d_model=16,
                d_kv=4,
                d_ff=16,
                num_layers=1,
                num_heads=2,
                relative_attention_num_buckets=8,
            )
        )
        transformer = _transformer(guidance_embeds=True)
        vae = AutoencoderKL(
            block_out_channels=(4, 8),
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            latent_channels=CHANNELS,
            norm_num_groups=2,
            layers_per_block=1,
            sample_size=16,
            shift_factor=0.1159,
            scaling_factor=0.3611,
        )
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15),
        vae=vae,
        text_encoder=clip,
        tokenizer=clip_tok,
        text_encoder_2=t5,
        tokenizer_2=t5_tok,
        transformer=transformer,
    )
    for m in pipe.components.values():
        if isinstance(m, torch.nn.Module):
            m.eval()  # built, not loaded: T5's dropout would be on
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _with(pipe, **components):
    """A ``FluxPipeline`` sharing ``pipe``'s components but ``components``."""
    from diffusers import FluxPipeline

    other = FluxPipeline(**{**pipe.components, **components})
    other.set_progress_bar_config(disable=True)
    return other


def schnell_like(pipe):
    """The same encoders and VAE with a transformer without guidance embedding and schnell's static shift 1."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    with torch.random.fork_rng():
        torch.manual_seed(1)
        transformer = _transformer(guidance_embeds=False).eval()
    return _with(pipe, transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0))


@pytest.fixture(scope="module")
def pipe():
    # tiny matmuls on shared cores: one thread is many times faster than two contended ones
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield build_tiny_flux()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def schnell(pipe):
    return schnell_like(pipe)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _record_calls(module):
    """Every transformer call's keyword arguments (a forward pre-hook); remove the handle after use."""
    calls = []
    handle = module.register_forward_pre_hook(lambda m, a, kw: calls.append(kw), with_kwargs=True)
    return calls, handle


def _embeds(pipe, prompts=("a photo of a cat", "a red car", "a tree")):
    with torch.no_grad():
        pe, ppe, _ = pipe.encode_prompt(list(prompts), max_sequence_length=SEQ)
    return pe, ppe


# -- (a) packing, positions, the grid ------------------------------------------------------------------


def test_packing_and_positions_are_diffusers_own():
    from diffusers import FluxPipeline

    x = torch.randn(3, 4, 6, 8, generator=gen(0))
    p = flux.pack_latents(x)
    assert torch.equal(p, FluxPipeline._pack_latents(x, 3, 4, 6, 8)) and p.shape == (3, 12, 16)
    assert torch.equal(flux.unpack_latents(p, 6, 8), x)
    assert torch.equal(FluxPipeline._unpack_latents(p, 12, 16, 2), x)  # 12 x 16 pixels at vae_scale_factor 2
    ids = flux.latent_image_ids(6, 8, device=torch.device("cpu"), dtype=torch.float32)
    assert torch.equal(ids, FluxPipeline._prepare_latent_image_ids(3, 3, 4, "cpu", torch.float32))


@pytest.mark.parametrize("steps", [1, 2, 7, 28])
@pytest.mark.parametrize("seq", [4, 1024, 4096])
@pytest.mark.parametrize(
    "config",
    [
        {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15},  # FLUX.1-dev
        {"shift": 1.0},  # FLUX.1-schnell
        {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15, "shift_terminal": 0.1},
    ],
    ids=["dev", "schnell", "terminal"],
)
def test_grid_equals_the_flux_pipelines(config, seq, steps):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    if config.get("shift_terminal") and steps == 1:
        return  # diffusers gives NaN there; scheduler_sigmas refuses it (test_diffusers_sd3)
    sched = FlowMatchEulerDiscreteScheduler(**config)
    c = sched.config
    mu = calculate_shift(seq, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)  # as FluxPipeline calls it
    ours = flux.flux_sigmas(sched.config, steps, seq)
    assert ours.dtype == torch.float64 and ours.shape == (steps + 1,)
    torch.testing.assert_close(ours, sched.sigmas.double(), atol=2e-7, rtol=0)


def test_flux_grid_is_not_the_sd3_grid():
    from diffusers import FlowMatchEulerDiscreteScheduler

    cfg = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15).config
    # FLUX.1 at 1024 px: 4096 packed tokens, mu = 1.15; the last positive level is far from 0
    ours = flux.flux_sigmas(cfg, 28, 4096)
    assert abs(ours[-2].item() - 0.1047) < 1e-3
    assert sd.scheduler_sigmas(cfg, 28, image_seq_len=4096)[-2] < 0.01  # the scheduler's own levels
    # a static shift overrides the config's dynamic one
    torch.testing.assert_close(flux.flux_sigmas(cfg, 4, 4096, shift=1.0)[:-1], torch.linspace(1, 0.25, 4).double())
    with pytest.raises(ValueError, match="sigmas has 3 levels"):
        sd.scheduler_sigmas(cfg, 4, image_seq_len=16, sigmas=[1.0, 0.5, 0.2])
    with pytest.raises(ValueError, match="decreasing"):
        sd.scheduler_sigmas(cfg, 2, image_seq_len=16, sigmas=[0.5, 1.0])


# -- (b) the velocity: timestep, guidance, positions, true CFG ---------------------------------------


def test_velocity_is_one_call_of_the_transformer_on_packed_latents(pipe):
    from diffusers import FluxPipeline

    pe, ppe = _embeds(pipe)
    x = torch.randn(3, 4, 4, 4, generator=gen(1))
    sigma = torch.tensor([0.9, 0.5, 0.1])
    v = flux.FluxVelocity(pipe.transformer, guidance_scale=4.5)
    calls, handle = _record_calls(pipe.transformer)
    try:
        ours = v(x, sigma, encoder_hidden_states=pe, pooled_projections=ppe)
    finally:
        handle.remove()
    assert len(calls) == 1 and ours.shape == x.shape and ours.dtype == torch.float32
    kw = calls[0]
    assert torch.equal(kw["timestep"], sigma)  # sigma itself: the transformer multiplies by 1000
    assert torch.equal(kw["guidance"], torch.full((3,), 4.5))  # embedded guidance, one row per state
    assert kw["img_ids"].shape == (4, 3) and kw["txt_ids"].shape == (SEQ, 3)  # 2-D: shared by the rows
    with torch.no_grad():
        ref = pipe.transformer(
            hidden_states=FluxPipeline._pack_latents(x, 3, 4, 4, 4),
            timestep=sigma,
            guidance=torch.full((3,), 4.5),
            pooled_projections=ppe,
            encoder_hidden_states=pe,
            txt_ids=torch.zeros(SEQ, 3),
            img_ids=FluxPipeline._prepare_latent_image_ids(3, 2, 2, "cpu", torch.float32),
            return_dict=False,
        )[0]
    torch.testing.assert_close(ours, FluxPipeline._unpack_latents(ref, 8, 8, 2), atol=0, rtol=0)


def test_true_cfg_is_one_call_with_fluxpipelines_formula(pipe):
    pe, ppe = _embeds(pipe)
    npe, nppe = _embeds(pipe, ("a dog", "a dog", "the street"))
    x = torch.randn(3, 4, 4, 4, generator=gen(2))
    sigma = torch.tensor([0.7, 0.3, 0.05])
    s = 4.0
    v = flux.FluxVelocity(pipe.transformer, guidance_scale=3.5, true_cfg_scale=s)
    calls, handle = _record_calls(pipe.transformer)
    try:
        ours = v(
            x,
            sigma,
            encoder_hidden_states=pe,
            pooled_projections=ppe,
            negative_encoder_hidden_states=npe,
            negative_pooled_projections=nppe,
        )
    finally:
        handle.remove()
    assert len(calls) == 1 and calls[0]["hidden_states"].shape[0] == 6  # both branches, one call
    plain = flux.FluxVelocity(pipe.transformer, guidance_scale=3.5)
    pos = plain(x, sigma, encoder_hidden_states=pe, pooled_projections=ppe)
    neg = plain(x, sigma, encoder_hidden_states=npe, pooled_projections=nppe)
    torch.testing.assert_close(ours, neg + s * (pos - neg), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="negative_encoder_hidden_states"):
        v(x, sigma, encoder_hidden_states=pe, pooled_projections=ppe)


def test_schnell_gets_no_guidance_input(schnell):
    pe, ppe = _embeds(schnell, (PROMPT,))
    x = torch.randn(1, 4, 4, 4, generator=gen(3))
    calls, handle = _record_calls(schnell.transformer)
    try:
        a = flux.FluxVelocity(schnell.transformer, guidance_scale=0.0)(
            x, torch.tensor([0.5]), encoder_hidden_states=pe, pooled_projections=ppe
        )
        b = flux.FluxVelocity(schnell.transformer, guidance_scale=7.0)(
            x, torch.tensor([0.5]), encoder_hidden_states=pe, pooled_projections=ppe
        )
    finally:
        handle.remove()
    assert [kw["guidance"] for kw in calls] == [None, None] and torch.equal(a, b)


# -- (c) parity with FluxPipeline --------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        dict(output_type="latent"),
        dict(output_type="np"),
        dict(output_type="latent", true_cfg_scale=4.0, negative_prompt="a dog"),
        dict(output_type="latent", schnell=True),
    ],
    ids=["dev-latent", "dev-np", "true-cfg", "schnell"],
)
def test_two_steps_reproduce_the_flux_pipeline(pipe, schnell, case):
    # T = 2: both steps are deterministic Euler steps, so the chain is FluxPipeline's own sampler; both
    # draw the initial latents from the same generator
    case = dict(case)
    p = schnell if case.pop("schnell", False) else pipe
    prompts = ["a photo of a cat", "a blue house"]
    common = dict(num_inference_steps=2, guidance_scale=4.0, height=8, width=8, max_sequence_length=SEQ, **case)
    ours = flux.sample(p, prompts, generator=gen(3), progress=False, **common)
    ref = copy.deepcopy(p)(prompts, generator=gen(3), **common).images
    if case["output_type"] == "latent":
        assert ref.shape == (2, 4, 16)  # diffusers returns packed latents; ours are unpacked
        ref = flux.unpack_latents(ref, 4, 4)
    torch.testing.assert_close(torch.as_tensor(ours.images), torch.as_tensor(ref), atol=1e-5, rtol=1e-5)
    assert ours.stats.nfe.tolist() == [2, 2]


def test_standard_path_is_the_engines_standard_sampler(pipe):
    T, n_img, churn = 6, 3, 0.8
    res = flux.sample(pipe, PROMPT, num_inference_steps=T, num_images_per_prompt=n_img, generator=gen(4), **BASE)
    g = gen(4)
    x_T = torch.randn(n_img, 4, 4, 4, generator=g)
    pe, ppe = _embeds(pipe, (PROMPT,))
    ref = specforest.sample(
        flux.FluxVelocity(pipe.transformer, guidance_scale=3.5),
        x_T,
        sigmas=flux.flux_sigmas(pipe.scheduler.config, T, 4),
        churn=churn,
        tree=None,
        generator=g,
        cond={"encoder_hidden_states": pe.repeat(n_img, 1, 1), "pooled_projections": ppe.repeat(n_img, 1)},
    )
    assert torch.equal(res.latents, ref.samples)
    assert res.stats.nfe.tolist() == [T] * n_img
    # precomputed embeddings give the same run
    again = flux.sample(
        pipe,
        prompt_embeds=pe,
        pooled_prompt_embeds=ppe,
        num_inference_steps=T,
        num_images_per_prompt=n_img,
        generator=gen(4),
        **BASE,
    )
    assert torch.equal(again.latents, res.latents)


# -- (d) speculation: fewer calls, shared positions ------------------------------------------------


@pytest.mark.parametrize("kw", [dict(K=2, L=2), dict(coupling="rmc", L=6, true_cfg_scale=3.0, negative_prompt="")])
def test_speculative_run_makes_fewer_calls_than_steps(pipe, kw):
    T, images = 10, 8
    calls, handle = _record_calls(pipe.transformer)
    try:
        res = sd.sample(
            pipe,
            ["a photo of a cat", "a red car"],
            num_inference_steps=T,
            num_images_per_prompt=images // 2,
            generator=gen(5),
            **{**BASE, "height": 16, "width": 16, "output_type": "np"},
            **kw,
        )
    finally:
        handle.remove()
    assert isinstance(res, sd.FluxResult) and res.config["family"] == "flux"
    assert res.images.shape == (images, 16, 16, 3) and torch.isfinite(res.latents).all()
    assert res.latents.shape == (images, 4, 8, 8)
    assert len(calls) == res.stats.nfe.max().item() < T  # one batched call per round
    branches = 2 if "true_cfg_scale" in kw else 1
    assert calls[0]["hidden_states"].shape[0] >= images * branches  # every image's states in the first call
    for c in calls:
        rows = c["hidden_states"].shape[0]
        assert rows % branches == 0 and c["hidden_states"].shape[1:] == (16, 16)  # 16 tokens of 2 x 2 x 4
        assert c["img_ids"].shape == (16, 3) and c["txt_ids"].shape == (SEQ, 3)  # shared, not per row
        assert c["guidance"].shape == (rows,) and (c["guidance"] == 3.5).all()
        assert c["encoder_hidden_states"].shape[0] == rows
    assert res.stats.nfe.double().mean() < T


# -- (e) exactness in law ---------------------------------------------------------------------------------


def _features(x: torch.Tensor) -> torch.Tensor:
    """Six fixed random projections and the squared norm of flattened latents."""
    x = x.reshape(x.shape[0], -1).double()
    P = torch.randn(x.shape[1], 6, generator=gen(123), dtype=torch.float64)
    P /= P.norm(dim=0)
    return torch.cat([x @ P, x.square().sum(1, keepdim=True)], 1)


def _z(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest two-sample z statistic of the features' means (standard errors from the samples)."""
    se = (a.var(0) / len(a) + b.var(0) / len(b)).sqrt()
    return ((a.mean(0) - b.mean(0)) / se).abs().max().item()


def _wrong_pack(x):
    # the rows and columns inside each 2 x 2 patch swapped: still a permutation, not the transformer's
    M, C, h, w = x.shape
    return x.view(M, C, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 5, 3).reshape(M, (h // 2) * (w // 2), 4 * C)


def _wrong_unpack(p, h, w):
    M, _, F = p.shape
    return p.view(M, h // 2, w // 2, F // 4, 2, 2).permute(0, 3, 1, 5, 2, 4).reshape(M, F // 4, h, w)


def test_speculative_samplers_have_the_standard_chains_law(pipe, monkeypatch):
    from diffusers import FluxPipeline

    # a velocity that depends on time and guidance more than the random init's (their embeddings x 10,
    # the output layer x 2), so that the check below has power against wrong conventions
    sharp = copy.deepcopy(pipe)
    with torch.no_grad():
        sharp.transformer.proj_out.weight.mul_(2.0)
        emb = sharp.transformer.time_text_embed
        for lin in (emb.timestep_embedder.linear_2, emb.guidance_embedder.linear_2):
            lin.weight.mul_(10.0)
    N, T, g = 2000, 8, 4.0
    pe, ppe = _embeds(sharp, (PROMPT,))
    img_ids = FluxPipeline._prepare_latent_image_ids(1, 2, 2, "cpu", torch.float32)

    def reference_velocity(x, sigma, encoder_hidden_states, pooled_projections):
        """The standard chain's target written with diffusers' own packing, positions and conventions."""
        M = x.shape[0]
        out = sharp.transformer(
            hidden_states=FluxPipeline._pack_latents(x, M, 4, 4, 4),
            timestep=sigma,
            guidance=torch.full((M,), g),
            pooled_projections=pooled_projections,
            encoder_hidden_states=encoder_hidden_states,
            txt_ids=torch.zeros(SEQ, 3),
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return FluxPipeline._unpack_latents(out, 8, 8, 2)

    ref = specforest.sample(
        reference_velocity,
        torch.randn(N, 4, 4, 4, generator=gen(10)),
        sigmas=flux.flux_sigmas(sharp.scheduler.config, T, 4),
        churn=0.8,
        tree=None,
        seed=10,
        cond={"encoder_hidden_states": pe.expand(N, -1, -1), "pooled_projections": ppe.expand(N, -1)},
    )
    ref = _features(ref.samples)

    def features(**kw):
        r = flux.sample(
            sharp,
            PROMPT,
            num_inference_steps=T,
            guidance_scale=g,
            num_images_per_prompt=N,
            generator=gen(11),
            **BASE,
            **kw,
        )
        return _features(r.latents), r.stats

    for kw in (dict(K=2, L=2), dict(coupling="rmc", L=6)):
        f, st = features(**kw)
        assert st.nfe.double().mean() < T - 0.5  # speculation did save calls
        assert _z(f, ref) < 4.5, kw  # 7 features: family-wise level ~5e-5
    # the same test rejects an adapter with the wrong 2 x 2 packing (here z ~ 25) ...
    monkeypatch.setattr(flux_velocity, "pack_latents", _wrong_pack)
    monkeypatch.setattr(flux_velocity, "unpack_latents", _wrong_unpack)
    f, _ = features(K=2, L=2)
    assert _z(f, ref) > 8
    monkeypatch.undo()
    # ... and one that passes 1000 sigma as the timestep (here z ~ 24)
    handle = sharp.transformer.register_forward_pre_hook(
        lambda m, a, kw: (a, {**kw, "timestep": 1000 * kw["timestep"]}), with_kwargs=True
    )
    try:
        f, _ = features(K=2, L=2)
    finally:
        handle.remove()
    assert _z(f, ref) > 8


# -- (f) outputs, reproducibility, no side effects, precision ---------------------------------------------


def test_output_types_and_generator(pipe):
    common = dict(num_inference_steps=4, num_images_per_prompt=2, K=2, L=2, **{**BASE, "height": 16, "width": 16})
    outs = {ot: flux.sample(pipe, PROMPT, generator=gen(6), **{**common, "output_type": ot}) for ot in sd.OUTPUT_TYPES}
    from PIL import Image

    assert all(isinstance(im, Image.Image) and im.size == (16, 16) for im in outs["pil"].images)
    assert outs["np"].images.shape == (2, 16, 16, 3)
    assert outs["pt"].images.shape == (2, 3, 16, 16)
    assert outs["latent"].images.shape == (2, 4, 8, 8)
    for r in outs.values():
        assert isinstance(r, sd.FluxResult) and isinstance(r, sd.SD3Result)
        assert torch.equal(r.latents, outs["latent"].latents)  # decoding draws nothing
    other = flux.sample(pipe, PROMPT, generator=gen(7), **{**common, "output_type": "latent"})
    assert not torch.equal(other.latents, outs["latent"].latents)
    assert outs["np"].config["guidance_embeds"] and outs["np"].config["dynamic_shift"]


def test_pipeline_and_scheduler_are_left_as_they_were(pipe):
    s = pipe.scheduler
    before = (dict(s.config), s.timesteps.clone(), s.sigmas.clone(), s.step_index, s.begin_index)
    state = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    flux.sample(pipe, PROMPT, num_inference_steps=5, K=2, L=2, generator=gen(8), **{**BASE, "output_type": "np"})
    assert dict(s.config) == before[0] and torch.equal(s.timesteps, before[1]) and torch.equal(s.sigmas, before[2])
    assert (s.step_index, s.begin_index) == before[3:]
    assert all(torch.equal(v, pipe.transformer.state_dict()[k]) for k, v in state.items())


def test_a_bfloat16_transformer_is_fed_in_its_dtype(pipe):
    half = copy.deepcopy(pipe)
    half.transformer.to(torch.bfloat16)
    calls, handle = _record_calls(half.transformer)
    try:
        res = flux.sample(half, PROMPT, num_inference_steps=4, K=2, L=2, generator=gen(9), **BASE)
    finally:
        handle.remove()
    assert all(c["hidden_states"].dtype == torch.bfloat16 for c in calls)
    assert res.latents.dtype == torch.float32 and torch.isfinite(res.latents).all()
    assert res.images.dtype == torch.bfloat16


# -- (g) dispatch and errors ------------------------------------------------------------------------------


def test_dispatch_by_family(pipe):
    assert flux.is_flux(pipe) and not families.is_sd3(pipe)
    assert families.family_of(pipe).sample is flux.sample
    assert families.family_of_class_name("FluxPipeline").name == "flux"
    assert families.family_of_class_name("StableDiffusion3Pipeline").name == "sd3"
    with pytest.raises(ValueError, match=r"'FluxFillPipeline' is not supported.*FluxPipeline \(flux\)"):
        families.family_of_class_name("FluxFillPipeline")
    # an SD3 pipeline is recognized by its class name and gets SD3's sample, which takes no true CFG
    fake_sd3 = type("StableDiffusion3Pipeline", (), {})()
    assert families.family_of(fake_sd3).name == "sd3" and not flux.is_flux(fake_sd3)
    with pytest.raises(TypeError, match="true_cfg_scale: not an option of the sd3 family"):
        sd.sample(fake_sd3, PROMPT, true_cfg_scale=2.0)
    with pytest.raises(TypeError, match="prompt_3: not an option of the flux family"):
        sd.sample(pipe, PROMPT, prompt_3="x")
    # other Flux pipelines take other inputs
    assert not flux.is_flux(type("FluxImg2ImgPipeline", (), {"transformer": pipe.transformer})())


def test_argument_errors_name_the_parameter(pipe):
    pe, ppe = _embeds(pipe, ("a photo of a cat", "a dog"))
    cases = [
        (
            dict(prompt=PROMPT, height=10),
            r"height must be divisible by 2 x vae_scale_factor = 4 .*got 10 \(nearest below: 8\)",
        ),
        (dict(prompt=PROMPT, width=6), "width must be divisible"),
        (dict(), "exactly one of prompt"),
        (dict(prompt=PROMPT, prompt_embeds=pe, pooled_prompt_embeds=ppe), "exactly one of prompt"),
        (dict(prompt_embeds=pe), "pooled_prompt_embeds"),
        (dict(prompt_embeds=pe[..., :8], pooled_prompt_embeds=ppe), "joint_attention_dim"),
        (dict(prompt=PROMPT, true_cfg_scale=3.0), "true_cfg_scale=3.0 > 1 needs negative_prompt"),
        (dict(prompt=[PROMPT, "a dog"], negative_prompt=["x"], true_cfg_scale=3.0), "negative_prompt has 1"),
        (dict(prompt=PROMPT, true_cfg_scale=-1.0), "true_cfg_scale"),
        (dict(prompt=PROMPT, guidance_scale=-1.0), "guidance_scale"),
        (dict(prompt=PROMPT, churn=0.0), "churn"),
        (dict(prompt=PROMPT, K=2), "both K and L"),
        (dict(prompt=PROMPT, output_type="jpg"), "output_type"),
        (dict(prompt=PROMPT, max_sequence_length=513), "max_sequence_length"),
        (dict(prompt=PROMPT, verify="all"), "verify"),
        # true CFG's two branches in one call need embeddings of one shape
        (
            dict(
                prompt_embeds=pe,
                pooled_prompt_embeds=ppe,
                negative_prompt=["", ""],
                max_sequence_length=pe.shape[1] + 1,
                true_cfg_scale=2.0,
            ),
            r"negative prompt embeddings have shape .* true CFG puts both in one call",
        ),
    ]
    base = {**BASE, "num_inference_steps": 4}
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            sd.sample(pipe, **{**base, **kw})
            pytest.fail(f"no error for {sorted(kw)}, expected {match!r}")
    with pytest.raises(MemoryError, match="does not fit the memory limit"):
        sd.sample(pipe, PROMPT, K=3, L=2, max_memory_gb=1e-6, **base)
    with pytest.raises(TypeError, match=r"supported family: StableDiffusion3Pipeline \(sd3\), FluxPipeline \(flux\)"):
        sd.sample(object(), PROMPT, **base)
    with pytest.raises(TypeError, match="no transformer or unet"):
        sd.sample(object(), PROMPT, **base)
    with pytest.raises(TypeError, match="pipe must be a FluxPipeline"):
        flux.sample(object(), PROMPT, **base)
    fill = _with(pipe, transformer=_transformer(guidance_embeds=True, in_channels=24))
    with pytest.raises(TypeError, match="in_channels=24"):
        flux.sample(fill, PROMPT, **base)


# -- tuning ------------------------------------------------------------------------------------------------


def test_tune_flux_measures_the_pipeline_and_its_choice_runs(pipe, monkeypatch):
    # max_memory_gb bounds the whole process: take the test session's own memory out of it
    monkeypatch.setattr(specforest.memory, "held_bytes", lambda device="cpu": 0)
    from specforest.latency import Tuned

    tuned = sd.tune_flux(
        pipe,
        ["a photo of a cat", "a red car"],
        num_inference_steps=8,
        true_cfg_scale=2.0,
        height=8,
        width=8,
        max_sequence_length=SEQ,
        budget_max=4,
        drafts=("velocity",),
        calibration_images=2,
        max_memory_gb=1.0,
    )
    assert isinstance(tuned, Tuned) and tuned.steps == 8
    assert tuned.predicted_seconds_per_image > 0 and {c["label"] for c in tuned.candidates} >= {"standard"}
    res = flux.sample(pipe, PROMPT, num_inference_steps=8, true_cfg_scale=2.0, negative_prompt="", **BASE, **tuned)
    assert res.latents.shape == (1, 4, 4, 4) and torch.isfinite(res.latents).all()
    # the tuned run is checked: other steps or churn are refused, listing both
    with pytest.raises(ValueError, match=r"steps 6 \(tuned for 8\).*churn 0.5"):
        flux.sample(
            pipe, PROMPT, num_inference_steps=6, churn=0.5, true_cfg_scale=2.0, negative_prompt="", **BASE, **tuned
        )
    with pytest.raises(TypeError, match="tune_flux"):
        sd.tune(pipe, PROMPT, num_inference_steps=4, height=8, width=8)
    with pytest.raises(ValueError, match="max_sequence_length"):
        sd.tune_flux(pipe, PROMPT, max_sequence_length=513)


# -- every option of the sampler, as SD3's sample takes them (issue 39) -------------------------------------


@pytest.mark.parametrize("tree", [dict(K=2, L=2), dict(coupling="rmc", L=3)], ids=["dgrs", "rmc"])
def test_pad_rows_and_warmup_keep_the_latents(pipe, tree):
    """Flux takes pad_rows and warmup: the warm-up only calls the transformer first (bit-equal latents,
    the same through the dispatching sample); padding rows are dropped, so the latents differ only by
    the rounding of calls with other row counts, with the same calls per image."""
    kw = dict(num_inference_steps=6, num_images_per_prompt=3, **tree, **BASE)
    ref = flux.sample(pipe, PROMPT, generator=gen(1), **kw)
    warm = sd.sample(pipe, PROMPT, generator=gen(1), warmup=True, **kw)
    assert torch.equal(warm.latents, ref.latents) and torch.equal(warm.stats.nfe, ref.stats.nfe)
    assert warm.warmup_seconds > 0 and ref.warmup_seconds == 0.0 and ref.config["pad_rows"] is None
    for pad in ("pow2", [5, 64]):
        for warmup in (False, True):
            padded = flux.sample(pipe, PROMPT, generator=gen(1), pad_rows=pad, warmup=warmup, **kw)
            torch.testing.assert_close(padded.latents, ref.latents, rtol=0, atol=1e-5)
            assert torch.equal(padded.stats.nfe, ref.stats.nfe) and padded.config["pad_rows"] == pad
    with pytest.raises(ValueError, match="pad_rows"):
        flux.sample(pipe, PROMPT, pad_rows=[0], **kw)


def test_chain_reaches_the_sampler(pipe):
    """chain= is the sampler's: another law than the em chain's, recorded with its parameters; churn, the em
    chain's, is left out at its default and refused at another value; a chain that needs a grid below
    sigma = 1 says so on Flux's, which starts at 1."""
    from specforest.chains import get_chain

    kw = dict(num_inference_steps=6, K=2, L=2, **BASE)
    em = flux.sample(pipe, PROMPT, generator=gen(2), **kw)
    anc = flux.sample(pipe, PROMPT, generator=gen(2), chain="euler_ancestral", **kw)
    assert em.config["chain"] == "em" and em.config["churn"] == 0.8
    assert anc.config["chain"] == "euler_ancestral" and anc.config["eta"] == 1.0 and "churn" not in anc.config
    assert not torch.allclose(anc.latents, em.latents)
    # the same chain as an object with its parameters (churn=None alike); another eta, another law
    same = flux.sample(pipe, PROMPT, generator=gen(2), chain=get_chain("euler_ancestral"), churn=None, **kw)
    half = sd.sample(pipe, PROMPT, generator=gen(2), chain=get_chain("euler_ancestral", eta=0.5), **kw)
    assert torch.equal(same.latents, anc.latents) and half.config["eta"] == 0.5
    assert not torch.allclose(half.latents, anc.latents)
    std = flux.sample(pipe, PROMPT, generator=gen(2), chain="ddim", num_inference_steps=6, **BASE)
    assert std.config["chain"] == "ddim" and std.stats.nfe.tolist() == [6]
    with pytest.raises(ValueError, match="churn=0.5 is the em chain's parameter; chain 'euler_ancestral'"):
        flux.sample(pipe, PROMPT, chain="euler_ancestral", churn=0.5, **kw)
    with pytest.raises(ValueError, match="chain 'ddpm' is not defined on this grid"):
        flux.sample(pipe, PROMPT, chain="ddpm", **kw)


def test_tune_flux_takes_the_samplers_options(pipe, monkeypatch):
    """tune_flux forwards the sampler's options as the SD3 tuner does: the chain to tune for among them."""
    monkeypatch.setattr(specforest.memory, "held_bytes", lambda device="cpu": 0)
    kw = dict(num_inference_steps=6, height=8, width=8, max_sequence_length=SEQ, budget_max=3)
    kw.update(drafts=("velocity",), calibration_images=1, max_memory_gb=1.0)
    with pytest.raises(ValueError, match="grid is set by this function"):
        sd.tune_flux(pipe, PROMPT, grid="uniform", **kw)
    tuned = sd.tune_flux(pipe, PROMPT, chain="euler_ancestral", prefetch="parent", **kw)
    assert tuned.chain == "euler_ancestral" and tuned.churn is None and tuned.prefetch == "parent"
    res = flux.sample(pipe, PROMPT, num_inference_steps=6, generator=gen(0), **BASE, **tuned)
    assert res.config["chain"] == "euler_ancestral" and res.config["prefetch"] == "parent"
