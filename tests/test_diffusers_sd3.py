"""Stable Diffusion 3 through diffusers, offline: a tiny pipeline built in code.

Two CLIP text encoders, a T5 encoder, an SD3 transformer and a VAE of a few
thousand parameters each, with tokenizers built from in-memory vocabularies, so
nothing is downloaded. They check the plumbing (grid, guidance, text encoding,
latents, decoding, memory sizing, the CLI) against diffusers' own code, and the
law of the speculative samplers against the standard one on a 64-dimensional
latent; they say nothing about image quality, which needs real weights.
"""

from __future__ import annotations

import copy
import json
import math

import diffusers
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from scipy import stats as sps

import specforest
from specforest import diffusers as sd
from specforest import trees
from specforest.cli import main
from specforest.cli.sd3 import sd3 as sd3_command
from specforest.couplings import GRS
from specforest.experiments import sd3 as sd3_exp

WORDS = [
    "a",
    "photo",
    "of",
    "cat",
    "dog",
    "red",
    "blue",
    "car",
    "on",
    "the",
    "street",
    "tree",
    "green",
    "house",
]
PROMPT = "a photo of a cat"
SEQ = 8  # T5 tokens; CLIP tokenizers have model_max_length 8 as well
BASE = dict(height=8, width=8, progress=False, max_sequence_length=SEQ, output_type="latent")


def _clip_tokenizer(tmp):
    """A byte-pair CLIP tokenizer whose merges spell WORDS (files written to ``tmp``)."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in sorted(set("".join(WORDS))):
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    merges = []
    for w in WORDS:
        cur = w[0]
        for i, ch in enumerate(w[1:]):
            nxt = ch + ("</w>" if i == len(w) - 2 else "")
            if (cur, nxt) not in merges:
                merges.append((cur, nxt))
            cur += nxt
            vocab.setdefault(cur, len(vocab))
    (tmp / "vocab.json").write_text(json.dumps(vocab))
    (tmp / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return CLIPTokenizer(str(tmp / "vocab.json"), str(tmp / "merges.txt"), model_max_length=SEQ), len(vocab)


def _t5_tokenizer(tmp):
    """A unigram T5 tokenizer over WORDS, built with the tokenizers library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)] + [("\u2581" + w, -1.0) for w in WORDS]
    tok = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok.save(str(tmp / "tokenizer.json"))
    t5 = T5TokenizerFast(
        tokenizer_file=str(tmp / "tokenizer.json"),
        extra_ids=0,
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    return t5, len(pieces)


def build_tiny_pipeline(tmp):
    """A complete ``StableDiffusion3Pipeline`` with tiny random models, built in code.

    Latents are ``(4, h, w)`` with a VAE scale factor 2 and transformer patches of 2,
    so 8 x 8 images give 4 x 4 x 4 latents and 4 image tokens.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    clip_tok, clip_vocab = _clip_tokenizer(tmp)
    t5_tok, t5_vocab = _t5_tokenizer(tmp)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        cc = CLIPTextConfig(
            vocab_size=clip_vocab,
            hidden_size=8,
            intermediate_size=16,
            num_attention_heads=2,
            num_hidden_layers=2,
            projection_dim=8,
            max_position_embeddings=SEQ,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
        te1, te2 = CLIPTextModelWithProjection(cc), CLIPTextModelWithProjection(cc)
        te3 = T5EncoderModel(
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
        transformer = SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            caption_projection_dim=16,
            pooled_projection_dim=16,
            out_channels=4,
            pos_embed_max_size=8,
        )
        vae = AutoencoderKL(
            block_out_channels=(4, 8),
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            latent_channels=4,
            norm_num_groups=2,
            layers_per_block=1,
            sample_size=16,
            shift_factor=0.0609,
            scaling_factor=1.5035,
        )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=te1,
        tokenizer=clip_tok,
        text_encoder_2=te2,
        tokenizer_2=clip_tok,
        text_encoder_3=te3,
        tokenizer_3=t5_tok,
    )
    for m in pipe.components.values():
        if isinstance(m, torch.nn.Module):
            m.eval()  # built, not loaded: T5's dropout would be on
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    # tiny matmuls on shared cores: one thread is many times faster than two contended ones
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield build_tiny_pipeline(tmp_path_factory.mktemp("tiny_sd3"))
    finally:
        torch.set_num_threads(threads)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- (a) the grid -------------------------------------------------------------------------------


def _diffusers_sigmas(steps, mu=None, **config):
    from diffusers import FlowMatchEulerDiscreteScheduler

    s = FlowMatchEulerDiscreteScheduler(**config)
    s.set_timesteps(steps, mu=mu)
    return s.sigmas.double()


@pytest.mark.parametrize("steps", [1, 2, 7, 50])
@pytest.mark.parametrize(
    "config",
    [
        {"shift": 3.0},
        {"shift": 1.0},
        {"shift": 3.0, "shift_terminal": 0.05},
        {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15},
        {"use_dynamic_shifting": True, "time_shift_type": "linear", "base_shift": 0.5, "max_shift": 1.15},
    ],
)
def test_grid_equals_the_schedulers(config, steps):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

    if config.get("shift_terminal") and steps == 1:
        with pytest.raises(ValueError, match="shift_terminal"):
            sd.scheduler_sigmas(FlowMatchEulerDiscreteScheduler(**config).config, steps)
        return
    seq = 1024
    mu = None
    if config.get("use_dynamic_shifting"):
        mu = calculate_shift(seq, 256, 4096, config["base_shift"], config["max_shift"])
    ref = _diffusers_sigmas(steps, mu=mu, **config)
    ours = sd.scheduler_sigmas(FlowMatchEulerDiscreteScheduler(**config).config, steps, image_seq_len=seq)
    assert ours.dtype == torch.float64 and ours.shape == (steps + 1,)
    torch.testing.assert_close(ours, ref, atol=2e-7, rtol=0)


def test_grid_override_and_the_pipelines_config(pipe):
    cfg1 = diffusers.FlowMatchEulerDiscreteScheduler(shift=1.0).config
    torch.testing.assert_close(
        sd.scheduler_sigmas(cfg1, 50, shift=3.0), _diffusers_sigmas(50, shift=3.0), atol=2e-7, rtol=0
    )
    # the pipeline's own scheduler, on a copy so that the fixture stays untouched
    sched = copy.deepcopy(pipe.scheduler)
    sched.set_timesteps(50)
    torch.testing.assert_close(sd.scheduler_sigmas(pipe.scheduler.config, 50), sched.sigmas.double(), atol=2e-7, rtol=0)
    # diffusers shifts the smallest level twice: not specforest.flow_match_grid(T, shift)
    gap = (sd.scheduler_sigmas(pipe.scheduler.config, 50) - specforest.flow_match_grid(50, shift=3.0)).abs().max()
    assert gap > 1e-3


def test_grid_rejects_other_families():
    cfg = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_karras_sigmas=True).config
    with pytest.raises(ValueError, match="use_karras_sigmas"):
        sd.scheduler_sigmas(cfg, 10)
    dyn = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True).config
    with pytest.raises(ValueError, match="image_seq_len"):
        sd.scheduler_sigmas(dyn, 10)


# -- (b) the velocity and guidance ----------------------------------------------------------------


def _embeds(pipe, n=3):
    with torch.no_grad():
        return pipe.encode_prompt(["a photo of a cat", "a red car", "a tree"][:n], None, None, max_sequence_length=SEQ)


def _count_calls(module):
    rows = []
    handle = module.register_forward_pre_hook(
        lambda m, a, kw: rows.append(kw["hidden_states"].shape[0]), with_kwargs=True
    )
    return rows, handle


def test_guidance_is_one_batched_call_with_diffusers_formula(pipe):
    pe, npe, ppe, nppe = _embeds(pipe)
    x = torch.randn(3, 4, 4, 4, generator=gen(1))
    sigma = torch.tensor([0.9, 0.5, 0.1])
    g = 4.5
    v = sd.FlowMatchVelocity(pipe.transformer, guidance_scale=g)
    rows, handle = _count_calls(pipe.transformer)
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
    assert rows == [6]  # one call, [uncond; cond]
    assert ours.dtype == torch.float32 and ours.shape == x.shape
    with torch.no_grad():
        t = 1000 * sigma
        both = pipe.transformer(
            hidden_states=torch.cat([x, x]),
            timestep=torch.cat([t, t]),
            encoder_hidden_states=torch.cat([npe, pe]),
            pooled_projections=torch.cat([nppe, ppe]),
            return_dict=False,
        )[0]
        u, c = both.chunk(2)
        torch.testing.assert_close(ours, u + g * (c - u), atol=1e-6, rtol=1e-5)
        # the same as two separate branch calls, up to batching round-off
        u1 = pipe.transformer(
            hidden_states=x, timestep=t, encoder_hidden_states=npe, pooled_projections=nppe, return_dict=False
        )[0]
        c1 = pipe.transformer(
            hidden_states=x, timestep=t, encoder_hidden_states=pe, pooled_projections=ppe, return_dict=False
        )[0]
    torch.testing.assert_close(ours, u1 + g * (c1 - u1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("g", [0.0, 1.0])
def test_no_guidance_is_the_conditional_branch_alone(pipe, g):
    pe, _, ppe, _ = _embeds(pipe)
    x = torch.randn(3, 4, 4, 4, generator=gen(2))
    sigma = torch.tensor([0.7, 0.3, 0.05])
    v = sd.FlowMatchVelocity(pipe.transformer, guidance_scale=g)
    rows, handle = _count_calls(pipe.transformer)
    try:
        ours = v(x, sigma, encoder_hidden_states=pe, pooled_projections=ppe)
    finally:
        handle.remove()
    assert rows == [3]
    with torch.no_grad():
        ref = pipe.transformer(
            hidden_states=x,
            timestep=1000 * sigma,
            encoder_hidden_states=pe,
            pooled_projections=ppe,
            return_dict=False,
        )[0]
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)


def test_guidance_needs_negative_embeddings(pipe):
    pe, _, ppe, _ = _embeds(pipe, 1)
    v = sd.FlowMatchVelocity(pipe.transformer, guidance_scale=7.0)
    with pytest.raises(ValueError, match="negative_encoder_hidden_states"):
        v(torch.zeros(1, 4, 4, 4), torch.tensor([0.5]), encoder_hidden_states=pe, pooled_projections=ppe)


@pytest.mark.parametrize("output_type", ["latent", "np"])
def test_two_steps_reproduce_the_diffusers_pipeline(pipe, output_type):
    # T = 2: both steps are deterministic Euler steps, so the chain is diffusers' own sampler
    images, g = 2, 7.0
    ours = sd.sample(
        pipe,
        ["a photo of a cat", "a blue house"],
        num_inference_steps=2,
        guidance_scale=g,
        generator=gen(3),
        **{**BASE, "output_type": output_type},
    )
    x_T = torch.randn(images, 4, 4, 4, generator=gen(3))
    ref = copy.deepcopy(pipe)(
        ["a photo of a cat", "a blue house"],
        num_inference_steps=2,
        guidance_scale=g,
        latents=x_T,
        height=8,
        width=8,
        max_sequence_length=SEQ,
        output_type=output_type,
    ).images
    torch.testing.assert_close(torch.as_tensor(ours.images), torch.as_tensor(ref), atol=2e-5, rtol=1e-5)
    assert ours.stats.nfe.tolist() == [2, 2]


# -- (c) the standard and speculative paths ---------------------------------------------------------


def test_standard_path_is_the_engines_standard_sampler(pipe):
    T, n_img, churn = 6, 3, 0.8
    res = sd.sample(
        pipe,
        PROMPT,
        num_inference_steps=T,
        num_images_per_prompt=n_img,
        churn=churn,
        generator=gen(4),
        **BASE,
    )
    # by hand: latents first, then the engine's standard sampler on the same generator
    g = gen(4)
    x_T = torch.randn(n_img, 4, 4, 4, generator=g)
    with torch.no_grad():  # as in the pipeline: autograd mode can change kernels in the last bit
        pe, npe, ppe, nppe = pipe.encode_prompt(PROMPT, None, None, max_sequence_length=SEQ)
    kw = {
        "encoder_hidden_states": pe.repeat(n_img, 1, 1),
        "pooled_projections": ppe.repeat(n_img, 1),
        "negative_encoder_hidden_states": npe.repeat(n_img, 1, 1),
        "negative_pooled_projections": nppe.repeat(n_img, 1),
    }
    ref = specforest.sample(
        sd.FlowMatchVelocity(pipe.transformer, guidance_scale=7.0),
        x_T,
        sigmas=sd.scheduler_sigmas(pipe.scheduler.config, T),
        churn=churn,
        tree=None,
        generator=g,
        cond=kw,
    )
    assert torch.equal(res.latents, ref.samples)
    assert res.stats.nfe.tolist() == [T] * n_img


@pytest.mark.parametrize(
    "kw",
    [
        dict(K=2, L=2),
        dict(coupling="rmc", L=6),
        dict(K=3, L=2, verify="drafted"),
        dict(K=2, L=2, lazy=True),
        dict(tree=trees.widths([3, 1])),
        dict(coupling="rmc", L=6, draft="secant"),
    ],
    ids=["dgrs-2-2", "rmc-6", "dgrs-3-2-drafted", "lazy", "widths", "rmc-6-secant"],
)
def test_speculative_runs_give_finite_images_and_save_calls(pipe, kw):
    T, images = 10, 12
    res = sd.sample(
        pipe,
        ["a photo of a cat", "a red car"],
        num_inference_steps=T,
        num_images_per_prompt=images // 2,
        generator=gen(5),
        **{**BASE, "height": 16, "width": 16, "output_type": "np"},
        **kw,
    )
    assert res.images.shape == (images, 16, 16, 3)
    assert res.images.min() >= 0 and res.images.max() <= 1 and torch.isfinite(res.latents).all()
    assert res.stats.nfe.shape == (images,)
    assert res.stats.nfe.double().mean() < T
    assert (res.stats.speedup > 1).any()


# -- (d) exactness in law ----------------------------------------------------------------------------


class _AlwaysAccept(GRS):
    """A deliberately wrong rule: takes the first drafted child without verification."""

    name = "always-accept"

    def select(self, s_hat, delta, valid, rng):
        P = s_hat.shape[0]
        return torch.ones(P, dtype=torch.bool), torch.zeros(P, dtype=torch.long)


def _features(x: torch.Tensor) -> torch.Tensor:
    """Six fixed random projections, the squared norm and the mean of flattened latents."""
    P = torch.randn(x.shape[1], 6, generator=gen(123), dtype=torch.float64)
    P /= P.norm(dim=0)
    x = x.double()
    return torch.cat([x @ P, x.square().sum(1, keepdim=True), x.mean(1, keepdim=True)], 1)


def test_speculative_samplers_agree_in_law_with_the_standard_one(pipe):
    # a sharper velocity than the random init's (output layer x 2): drafts that freeze it
    # drift further from the target, so the check below has power against wrong rules
    sharp = copy.deepcopy(pipe)
    with torch.no_grad():
        sharp.transformer.proj_out.weight.mul_(2.0)
    N, T = 2000, 8

    def features(seed, **kw):
        r = sd.sample(sharp, PROMPT, num_inference_steps=T, num_images_per_prompt=N, generator=gen(seed), **BASE, **kw)
        return _features(r.latents.reshape(N, -1)), r.stats

    ref, _ = features(10)

    def min_p(f):
        return min(sps.ks_2samp(ref[:, j].numpy(), f[:, j].numpy()).pvalue for j in range(f.shape[1]))

    for kw in (dict(K=2, L=2), dict(coupling="rmc", L=6), dict(coupling="rmc", L=6, draft="secant")):
        f, st = features(11, **kw)
        assert st.nfe.double().mean() < T - 0.5  # speculation did save calls
        assert min_p(f) > 1e-4, kw
    # the same test catches a sampler that is not exact (here p ~ 1e-27)
    f, _ = features(11, K=2, L=2, coupling=_AlwaysAccept())
    assert min_p(f) < 1e-8


# -- (e) outputs, reproducibility, no side effects ---------------------------------------------------


def test_output_types(pipe):
    common = dict(num_inference_steps=4, num_images_per_prompt=2, K=2, L=2, **{**BASE, "height": 16, "width": 16})
    outs = {ot: sd.sample(pipe, PROMPT, generator=gen(6), **{**common, "output_type": ot}) for ot in sd.OUTPUT_TYPES}
    from PIL import Image

    assert isinstance(outs["pil"].images, list) and len(outs["pil"].images) == 2
    assert all(isinstance(im, Image.Image) and im.size == (16, 16) for im in outs["pil"].images)
    assert outs["np"].images.shape == (2, 16, 16, 3) and outs["np"].images.dtype.name == "float32"
    assert isinstance(outs["pt"].images, torch.Tensor) and outs["pt"].images.shape == (2, 3, 16, 16)
    assert outs["latent"].images.shape == (2, 4, 8, 8) and outs["latent"].images.dtype == pipe.transformer.dtype
    for r in outs.values():
        assert r.latents.dtype == torch.float32 and r.latents.shape == (2, 4, 8, 8)
        assert torch.equal(r.latents, outs["latent"].latents)  # decoding draws nothing
    torch.testing.assert_close(outs["pt"].images.permute(0, 2, 3, 1), torch.from_numpy(outs["np"].images))
    assert isinstance(outs["np"].stats, specforest.SampleStats)
    assert outs["np"].config["K"] == 2 and outs["np"].memory.rows_per_call > 0


def test_generator_is_honoured(pipe):
    kw = dict(num_inference_steps=6, num_images_per_prompt=3, K=2, L=2, **BASE)
    a = sd.sample(pipe, PROMPT, generator=gen(7), **kw)
    b = sd.sample(pipe, PROMPT, generator=gen(7), **kw)
    c = sd.sample(pipe, PROMPT, generator=gen(8), **kw)
    assert torch.equal(a.latents, b.latents) and torch.equal(a.stats.nfe, b.stats.nfe)
    assert not torch.equal(a.latents, c.latents)


def test_a_list_of_generators_makes_each_image_its_own(pipe):
    """diffusers' convention: image i is a function of generator[i] alone, whatever the batch."""
    kw = dict(num_inference_steps=6, K=2, L=2, **BASE)
    three = sd.sample(pipe, PROMPT, generator=[gen(20), gen(21), gen(22)], num_images_per_prompt=3, **kw)
    one = sd.sample(pipe, PROMPT, generator=[gen(21)], num_images_per_prompt=1, **kw)
    # a float32 transformer's results change in the last bits with its batch, and six steps
    # of a tree compound them (here up to 1.4e-5 on latents of order 1)
    torch.testing.assert_close(one.latents[0], three.latents[1], rtol=1e-4, atol=1e-4)
    assert torch.equal(one.stats.nfe[0], three.stats.nfe[1])


def _snapshot(pipe):
    s = pipe.scheduler
    return {
        "scheduler_config": dict(s.config),
        "sigmas": s.sigmas.clone(),
        "timesteps": s.timesteps.clone(),
        "step_index": s.step_index,
        "begin_index": s.begin_index,
        "shift": s.shift,
        "num_inference_steps": getattr(s, "num_inference_steps", None),
        "state": {
            name: {k: v.clone() for k, v in getattr(pipe, name).state_dict().items()}
            for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
        },
        "configs": {name: dict(getattr(pipe, name).config) for name in ("transformer", "vae")},
        "training": [m.training for m in pipe.components.values() if isinstance(m, torch.nn.Module)],
        "dtype": pipe.transformer.dtype,
    }


def test_pipeline_and_scheduler_are_left_as_they_were(pipe):
    before = _snapshot(pipe)
    sd.sample(
        pipe,
        PROMPT,
        num_inference_steps=7,
        generator=gen(9),
        K=2,
        L=2,
        **{**BASE, "output_type": "np"},
        shift=2.0,
    )
    after = _snapshot(pipe)
    for key in before:
        if key == "state":
            for name in before[key]:
                for k in before[key][name]:
                    assert torch.equal(before[key][name][k], after[key][name][k]), (name, k)
        elif isinstance(before[key], torch.Tensor):
            assert torch.equal(before[key], after[key]), key
        else:
            assert before[key] == after[key], key


def test_memory_sizing_chunks_transformer_calls_without_changing_results(pipe, monkeypatch):
    # the process's own memory taken out of the arithmetic: it drifts from call to call
    monkeypatch.setattr(specforest.memory, "held_bytes", lambda device="cpu": 0)
    kw = dict(num_inference_steps=6, num_images_per_prompt=6, K=2, L=2, **BASE)
    whole = sd.sample(pipe, PROMPT, generator=gen(12), **kw)
    assert whole.memory.max_rows is None
    m = whole.memory
    dyn = m.sampler_bytes + int(4.5 * m.row_bytes)
    limit = (m.fixed_bytes + dyn + specforest.memory.allocator_slack(dyn)) / 1e9
    rows, handle = _count_calls(pipe.transformer)
    try:
        split = sd.sample(pipe, PROMPT, generator=gen(12), max_memory_gb=limit, **kw)
    finally:
        handle.remove()
    assert split.memory.max_rows == 4
    assert max(rows) <= 8  # 4 states, 2 guidance branches each
    torch.testing.assert_close(split.latents, whole.latents, atol=1e-5, rtol=1e-5)
    assert torch.equal(split.stats.nfe, whole.stats.nfe)


# -- (f) errors --------------------------------------------------------------------------------------


def test_memory_refusal_is_a_clear_error(pipe):
    with pytest.raises(MemoryError, match=r"does not fit the memory limit.*states x 64 elements.*lazy=True"):
        sd.sample(pipe, PROMPT, num_inference_steps=5, K=3, L=2, max_memory_gb=1e-6, **BASE)


def test_argument_errors_name_the_parameter(pipe):
    pe, npe, ppe, nppe = _embeds(pipe, 2)
    cases = [
        (
            dict(
                prompt_embeds=pe,
                pooled_prompt_embeds=ppe,
                negative_prompt_embeds=npe[:, :-1],
                negative_pooled_prompt_embeds=nppe,
            ),
            "negative_prompt_embeds has shape",
        ),
        (dict(prompt_embeds=pe, pooled_prompt_embeds=ppe[:1]), "pooled_prompt_embeds has 1 rows"),
        (dict(prompt_embeds=pe[..., :8], pooled_prompt_embeds=ppe), "joint_attention_dim"),
        (dict(prompt_embeds=pe), "pooled_prompt_embeds"),
        (dict(prompt=PROMPT, prompt_embeds=pe, pooled_prompt_embeds=ppe), "exactly one of prompt"),
        (dict(prompt=[PROMPT, "a dog"], negative_prompt=["x", "y", "z"]), "negative_prompt has 3"),
        (dict(prompt=PROMPT, churn=0.0), "churn"),
        (dict(prompt=PROMPT, churn=1.5), "churn"),
        (dict(prompt=PROMPT, K=0, L=2), "K must be None or an int >= 1"),
        (dict(prompt=PROMPT, K=2, L=0), "L must be None or an int >= 1"),
        (dict(prompt=PROMPT, K=2), "both K and L"),
        (dict(prompt=PROMPT, K=3, L=2, coupling="rmc"), "coupling='rmc'"),
        (dict(prompt=PROMPT, tree=trees.chain(2), L=2), "either tree or K/L"),
        (dict(prompt=PROMPT, height=10), r"height must be divisible by .* = 4, got 10 \(nearest below: 8\)"),
        (dict(prompt=PROMPT, width=6), "width must be divisible"),
        (dict(prompt=PROMPT, height=64, width=64), "positional embedding"),
        (dict(prompt=PROMPT, output_type="jpg"), "output_type"),
        (dict(prompt=PROMPT, num_images_per_prompt=0), "num_images_per_prompt"),
        (dict(prompt=PROMPT, guidance_scale=-1.0), "guidance_scale"),
        (dict(prompt=PROMPT, max_memory_gb=0.0), "max_memory_gb"),
        (dict(prompt=PROMPT, verify="all"), "verify"),
    ]
    base = {**BASE, "num_inference_steps": 4}
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            sd.sample(pipe, **{**base, **kw})
            pytest.fail(f"no error for {sorted(kw)}, expected {match!r}")
    with pytest.raises(TypeError, match="generator"):
        sd.sample(pipe, PROMPT, generator="seed", **base)
    with pytest.raises(ValueError, match="one per image"):
        sd.sample(pipe, PROMPT, generator=[gen(0), gen(1)], **base)
    with pytest.raises(TypeError, match="StableDiffusion3Pipeline"):
        sd.sample(object(), PROMPT, **base)


# -- the experiment and its CLI ----------------------------------------------------------------------


def test_sd3_command_runs_the_study_on_a_saved_pipeline(pipe, tmp_path):
    model = tmp_path / "tiny-sd3"
    pipe.save_pretrained(str(model))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\n\na red car on the street\na green tree\n")
    out = tmp_path / "out"
    args = [
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "--num-prompts",
        "2",
        "--K-values",
        "3,2",
        "--steps",
        "6",
        "--height",
        "16",
        "--width",
        "16",
        "--max-sequence-length",
        str(SEQ),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--no-progress",
        "--save-images",
    ]
    res = CliRunner().invoke(sd3_command, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "ran 5 configuration(s)" in res.output
    recs = json.loads((out / "results.json").read_text())
    assert [(r["method"], r["K"], r["L"], r["budget"]) for r in recs] == [
        ("standard", 0, 0, 0),
        ("dgrs", 2, 2, 6),
        ("rmc", 1, 6, 6),
        ("dgrs", 3, 2, 12),
        ("rmc", 1, 12, 12),
    ]
    for r in recs:
        assert r["images"] == 2 and len(r["nfe_per_image"]) == 2
        assert r["steps"] == 6 and r["churn"] == 0.8 and r["shift"] == 3.0 and r["guidance_scale"] == 7.0
        assert r["verify"] == "drafted" and r["clip_mean"] is None and math.isfinite(r["speedup_mean"])
    assert recs[0]["nfe_mean"] == 6 and recs[0]["speedup_mean"] == 1.0
    assert (out / "results.csv").read_text().startswith("method,")
    assert (out / "speedup_vs_K.png").stat().st_size > 0
    assert (out / "images" / "dgrs_K2_L2" / "0001.png").exists()
    again = CliRunner().invoke(sd3_command, args, catch_exceptions=False)
    assert again.exit_code == 0 and "ran 0 configuration(s), skipped 5" in again.output
    other = CliRunner().invoke(sd3_command, [*args, "--churn", "0.5"])
    assert other.exit_code != 0 and "another setting" in other.output


def test_sd3_help_documents_every_option():
    res = CliRunner().invoke(sd3_command, ["--help"])
    assert res.exit_code == 0
    for opt in sd3_command.params:
        for name in opt.opts:
            assert name in res.output
    for text in (
        "x>=1",
        "0.0<x<=1.0",
        "[default: 2,3,4,5,6,7]",
        "[default: 512; x>=1]",
        "float16|bfloat16|float32",
    ):
        assert text in res.output, text
    assert isinstance(sd3_command, __import__("click").Command) and sd3_command.name == "sd3"


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A local CLIP directory (model and processor) of a few thousand parameters."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tmp = tmp_path_factory.mktemp("tiny_clip")
    tok, vocab = _clip_tokenizer(tmp)
    text = {
        "vocab_size": vocab,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "max_position_embeddings": SEQ,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 1,
    }
    vision = {
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "image_size": 8,
        "patch_size": 4,
    }
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))
    proc = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 8}, crop_size=8), tokenizer=tok)
    model.save_pretrained(str(tmp / "clip"))
    proc.save_pretrained(str(tmp / "clip"))
    return tmp / "clip"


def test_clip_score_of_a_tiny_local_clip(tiny_clip):
    from PIL import Image

    imgs = [Image.new("RGB", (16, 16), c) for c in ("red", "blue")]
    s = sd3_exp.clip_scores(tiny_clip, imgs, ["a red car", "a blue house"])
    assert s.shape == (2,) and s.dtype == torch.float64 and (s >= 0).all() and (s <= 100).all()


def test_run_config_scores_images_with_clip(pipe, tiny_clip):
    setting = sd3_exp.SD3Setting(height=16, width=16, steps=4, K_values=(2,), max_sequence_length=SEQ)
    rec = sd3_exp.run_config(pipe, ["a photo of a cat", "a red car"], setting, "dgrs", 2, 2, clip=str(tiny_clip))
    assert 0 <= rec["clip_mean"] <= 100 and rec["clip_sem"] is not None
    assert rec["budget"] == 6 and len(rec["nfe_per_image"]) == 2
    assert rec["memory_peak_gb"] > 0 and rec["rows_per_call"] == 2 * 7  # two images x the (2, 2) tree, drafted


def test_generate_sd3_writes_one_png_per_index_whatever_the_batch(pipe, tmp_path):
    from PIL import Image

    model = tmp_path / "tiny-sd3"
    pipe.save_pretrained(str(model))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\na red car on the street\n")
    common = [
        "generate",
        "sd3",
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "--steps",
        "6",
        "--K",
        "2",
        "--L",
        "2",
        "--height",
        "16",
        "--width",
        "16",
        "--max-sequence-length",
        str(SEQ),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--no-progress",
        "--count",
        "3",
        "--seed",
        "4",
    ]
    outs = []
    for batch in ("1", "3"):
        out = tmp_path / f"images{batch}"
        res = CliRunner().invoke(main, [*common, "--batch", batch, "--out", str(out)])
        assert res.exit_code == 0, res.output
        assert sorted(p.name for p in out.iterdir()) == ["000000.png", "000001.png", "000002.png"]
        meta = json.loads((tmp_path / f"images{batch}.json").read_text())
        assert len(meta["nfe"]) == 3 and meta["options"]["model_options"]["prompts_sha256"]
        outs.append((out, meta))
    for i in range(3):
        a, b = (np.asarray(Image.open(o / f"{i:06d}.png"), dtype=np.int16) for o, _ in outs)
        assert a.shape == (16, 16, 3) and np.abs(a - b).max() <= 1  # the same image from (seed, i)
    assert outs[0][1]["nfe"] == outs[1][1]["nfe"]
    # changed captions are refused on resume
    prompts.write_text("a green tree\n")
    res = CliRunner().invoke(main, [*common, "--batch", "3", "--out", str(outs[1][0]), "--resume"])
    assert res.exit_code != 0 and "options that differ" in res.output


# -- tuning --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tune_measures_the_pipeline_and_its_choice_runs(pipe, monkeypatch):
    # max_memory_gb bounds the whole process: take the test session's own memory out of it
    monkeypatch.setattr(specforest.memory, "held_bytes", lambda device="cpu": 0)
    from specforest.latency import Tuned

    tuned = sd.tune(
        pipe,
        ["a photo of a cat", "a red car"],
        num_inference_steps=8,
        height=8,
        width=8,
        max_sequence_length=SEQ,
        budget_max=4,
        drafts=("velocity",),
        calibration_images=2,
        max_memory_gb=1.0,
    )
    assert isinstance(tuned, Tuned) and tuned.steps == 8 and tuned.batch == 1
    assert tuned.predicted_seconds_per_image > 0 and tuned.standard_seconds_per_image > 0
    assert {c["label"] for c in tuned.candidates} >= {"standard"}
    res = sd.sample(pipe, PROMPT, num_inference_steps=8, generator=gen(0), **BASE, **tuned)
    assert res.latents.shape == (1, 4, 4, 4) and torch.isfinite(res.latents).all()


def test_tune_forwards_the_samplers_options_and_its_choice_checks_the_run(pipe, monkeypatch):
    # max_memory_gb bounds the whole process: take the test session's own memory out of it
    monkeypatch.setattr(specforest.memory, "held_bytes", lambda device="cpu": 0)
    kw = dict(num_inference_steps=6, height=8, width=8, max_sequence_length=SEQ, budget_max=3)
    kw.update(drafts=("velocity",), calibration_images=1, max_memory_gb=1.0)
    for name, value in (("grid", "uniform"), ("max_rows", 4), ("steps", 6)):
        with pytest.raises(ValueError, match=f"{name} is set by this function"):
            sd.tune(pipe, PROMPT, **kw, **{name: value})
    tuned = sd.tune(pipe, PROMPT, verify="drafted", prefetch="parent", **kw)
    assert tuned.verify == "drafted" and tuned.prefetch == "parent" and tuned.churn == 0.8
    with pytest.raises(ValueError, match=r"steps 8 \(tuned for 6\)"):
        sd.sample(pipe, PROMPT, num_inference_steps=8, generator=gen(0), **BASE, **tuned)
    res = sd.sample(pipe, PROMPT, num_inference_steps=6, generator=gen(0), **BASE, **tuned)
    assert res.config["prefetch"] == "parent" and torch.isfinite(res.latents).all()


@pytest.mark.slow
def test_tune_measures_no_call_larger_than_the_memory_limit(pipe, monkeypatch):
    """A tiny memory limit caps the cost curve's sizes (the sampler splits calls above it)."""
    from specforest.latency import measure as latency  # where tune measures the curve

    monkeypatch.setattr(specforest.memory, "held_bytes", lambda device="cpu": 0)
    seen = []
    real = latency.measure_cost_curve
    monkeypatch.setattr(latency, "measure_cost_curve", lambda *a, **k: seen.append(k["sizes"]) or real(*a, **k))
    with pytest.raises(ValueError, match="batch"):
        sd.tune(pipe, PROMPT, num_inference_steps=4, height=8, width=8, batch=0)
    sd.tune(
        pipe,
        PROMPT,
        num_inference_steps=4,
        height=8,
        width=8,
        max_sequence_length=SEQ,
        budget_max=2,
        drafts=("velocity",),
        calibration_images=1,
        max_memory_gb=1.2e-4,
    )
    assert seen and max(seen[0]) == 1
    with pytest.raises(MemoryError, match="max_memory_gb=1e-09"):
        sd.tune(pipe, PROMPT, num_inference_steps=4, height=8, width=8, max_sequence_length=SEQ, max_memory_gb=1e-9)


@pytest.mark.slow
def test_tune_and_sd3_commands_choose_then_run_the_tuned_configuration(pipe, tmp_path):
    model = tmp_path / "tiny-sd3"
    pipe.save_pretrained(str(model))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\na red car on the street\n")
    tuned = tmp_path / "tuned.json"
    common = ["--steps", "6", "--height", "16", "--width", "16", "--max-sequence-length", str(SEQ), "--dtype"]
    res = CliRunner().invoke(
        main,
        ["tune", "--model", "sd3", "--pipeline", str(model), "--prompts", str(prompts), *common, "float32"]
        + ["--churn", "0.8", "--budget-max", "4", "--drafts", "velocity", "--out", str(tuned), "--no-progress"],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    data = json.loads(tuned.read_text())
    assert data["tuned_for"]["model"] == "sd3" and data["predicted_seconds_per_image"] > 0
    assert "chosen:" in res.output
    missing = CliRunner().invoke(main, ["tune", "--model", "sd3", "--out", str(tmp_path / "x.json")])
    assert missing.exit_code != 0 and "--pipeline" in missing.output and not (tmp_path / "x.json").exists()
    out = tmp_path / "out"
    args = ["--model", str(model), "--prompts", str(prompts), "--K-values", "2", *common, "float32"]
    args += ["--out", str(out), "--device", "cpu", "--no-progress", "--tune", str(tuned)]
    run = CliRunner().invoke(sd3_command, args, catch_exceptions=False)
    assert run.exit_code == 0, run.output
    recs = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in recs] == ["standard", "dgrs", "rmc", "tuned"]
    t = recs[-1]
    assert t["tuned_label"] == data["label"] and t["coupling"] == data["coupling"] and t["images"] == 2
    assert "tuned: " in run.output
    gmm_file = tmp_path / "gmm.json"
    gmm_file.write_text(json.dumps({**data, "tuned_for": {"model": "gmm"}}))
    wrong = CliRunner().invoke(sd3_command, [*args[:-1], str(gmm_file)])
    assert wrong.exit_code != 0 and "--model sd3 here, gmm in the file" in wrong.output


# -- every option of the sampler (issue 39) ---------------------------------------------------------------


def test_chain_reaches_the_sampler(pipe):
    """chain= is the sampler's: another law than the em chain's, recorded with its parameters; churn is
    left out at its default; a tuned configuration of another chain runs it (``**tuned`` carries it)."""
    kw = dict(num_inference_steps=6, K=2, L=2, **BASE)
    em = sd.sample(pipe, PROMPT, generator=gen(3), **kw)
    anc = sd.sample(pipe, PROMPT, generator=gen(3), chain="euler_ancestral", **kw)
    assert em.config["chain"] == "em" and anc.config["chain"] == "euler_ancestral" and anc.config["eta"] == 1.0
    assert anc.config["family"] == "sd3" and not torch.allclose(anc.latents, em.latents)
    deltas = sd.sample(pipe, PROMPT, generator=gen(3), chain="euler_ancestral", record_deltas=True, **kw)
    assert torch.equal(deltas.latents, anc.latents) and deltas.stats.deltas is not None
    with pytest.raises(ValueError, match="chain 'dpmpp_2m_sde' is not defined on this grid"):
        sd.sample(pipe, PROMPT, chain="dpmpp_2m_sde", **kw)
