"""The natural-image models' learned drafts (``natural32``, ``natural64``): their shipped weights and
digests, the draft the shipped target declares, ``draft="learned"`` through every library entry point
and the k-diffusion drop-ins, the law of ``natural32`` sampled with it, and the training command
(a tiny run that writes its file and resumes bit for bit after an interruption)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import specforest
from specforest import kdiffusion, streams, trees
from specforest.cli.train import train
from specforest.couplings import Coupling
from specforest.drafts import declared_draft, drafts_serving
from specforest.experiments import train_natural_draft
from specforest.experiments.train_natural_draft import NaturalDraftConfig
from specforest.models import digits, natural
from specforest.models.unet import UNetConfig
from specforest.testing import Z_TOL

NAMES = tuple(natural.MODELS)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", params=NAMES)
def name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def den32():
    return natural.load_denoiser("natural32")


# -- the shipped weights ------------------------------------------------------------------------


def test_each_shipped_draft_is_checked_narrower_and_made_from_the_shipped_target(name):
    spec = natural.MODELS[name]
    man = digits.manifest()
    entry = man[spec.draft_file]
    assert digits.sha256_file(digits.WEIGHTS_DIR / spec.draft_file) == entry["sha256"]
    assert entry["target_sha256"] == man[spec.file]["sha256"]  # distilled from the target beside it
    cfg = UNetConfig.from_dict(entry["unet_config"])
    assert cfg == spec.draft_unet and entry["multiply_adds"] == digits.multiply_adds(cfg)
    assert digits.multiply_adds(spec.unet) >= 3.5 * digits.multiply_adds(cfg)
    # its held-out mismatch was measured in every band of the sampler's noise range
    assert [b["lo"] for b in entry["held_out_rms_delta"]] == [lo for lo, _ in train_natural_draft.BANDS]
    draft = natural.load_draft_denoiser(name)
    assert draft.net.config == cfg and not draft.training


def test_a_draft_file_with_one_flipped_byte_is_refused(tmp_path, name):
    spec = natural.MODELS[name]
    data = bytearray((digits.WEIGHTS_DIR / spec.draft_file).read_bytes())
    data[len(data) // 2] ^= 0x01
    (tmp_path / spec.draft_file).write_bytes(bytes(data))
    shutil.copy(digits.WEIGHTS_DIR / digits.MANIFEST, tmp_path / digits.MANIFEST)
    with pytest.raises(digits.ChecksumError, match="does not match"):
        natural.load_draft_denoiser(name, path=tmp_path / spec.draft_file)


def test_a_missing_draft_names_the_command_that_makes_it(monkeypatch):
    spec = dataclasses.replace(natural.MODELS["natural32"], draft_file="absent_draft.safetensors")
    monkeypatch.setitem(natural.MODELS, "natural32", spec)
    with pytest.raises(FileNotFoundError, match="specforest train natural32-draft"):
        natural.load_draft_denoiser("natural32")
    # and the target declares no draft it cannot load
    assert declared_draft(natural.load_denoiser("natural32")) is None


# -- the declared draft -------------------------------------------------------------------------


def test_the_shipped_target_declares_its_distilled_draft_on_its_device_and_dtype(name):
    den = natural.load_denoiser(name, dtype=torch.float64)
    draft = declared_draft(natural.load_velocity(name, dtype=torch.float64))()
    ref = natural.load_draft_denoiser(name, dtype=torch.float64)
    assert next(draft.parameters()).dtype == torch.float64 and draft.net.config == natural.MODELS[name].draft_unet
    x = torch.randn((2, *natural.MODELS[name].state_shape), dtype=torch.float64, generator=torch.Generator())
    assert torch.equal(den.learned_draft()(x, torch.full((2,), 0.7)), ref(x, torch.full((2,), 0.7)))
    assert torch.equal(draft(x, torch.full((2,), 0.7)), ref(x, torch.full((2,), 0.7)))
    # a denoiser of other weights (here the shipped file given by path) declares none
    assert declared_draft(natural.load_denoiser(name, path=natural.weights_path(name))) is None


def test_draft_learned_runs_on_each_model_through_sample_and_a_drop_in_as_the_same_run(name):
    """``draft="learned"`` is the model's own distilled U-Net (the digits draft would be refused for its
    shape): through ``specforest.sample`` and ``sample_euler_ancestral`` with the same seed it is the
    same run, with draft-network calls of its own."""
    shape = natural.MODELS[name].state_shape
    sig = kdiffusion.get_sigmas_karras(6, 0.002, 80.0).double()
    x = streams.randn(3, torch.arange(2), shape) * float(sig[0])
    run = dict(tree=trees.chain(3), coupling="rmc", draft="learned", seed=3)
    den = natural.load_denoiser(name)
    got = kdiffusion.sample_euler_ancestral(den, x, sig, disable=True, **run)
    out = kdiffusion.sample(den, x, sig, chain="euler_ancestral", disable=True, **run)
    assert torch.equal(got, out.samples) and out.config["draft"] == "learned" and out.stats.draft_calls > 0
    lib = specforest.sample(
        natural.load_velocity(name),
        x / (1.0 + float(sig[0])),
        sigmas=kdiffusion.linear_grid(sig),
        chain="euler_ancestral",
        **run,
    )
    assert lib.stats.draft_calls > 0 and torch.equal(lib.stats.nfe, out.stats.nfe)
    torch.testing.assert_close(lib.samples, out.samples, rtol=0, atol=1e-5)


def test_draft_learned_reaches_generate_and_the_tuners_filter_on_natural32():
    """``generate``'s sample 0 is ``sample``'s with the same seed and index, and the tuner's filter of the
    drafts a model serves keeps ``learned`` for natural32 (it would drop a draft of another shape)."""
    velocity = natural.load_velocity("natural32")
    shape = natural.MODELS["natural32"].state_shape
    assert drafts_serving(["learned"], shape, velocity) == ["learned"]
    run = dict(steps=6, chain="euler_ancestral", tree=trees.chain(3), coupling="rmc", draft="learned")
    x = streams.randn(5, torch.arange(2), shape)
    one = specforest.sample(velocity, x, seed=5, sample_index=torch.arange(2), **run)
    assert one.stats.draft_calls > 0
    gen = specforest.generate(velocity, count=2, make_x=lambda i: streams.randn(5, i, shape), seed=5, batch=2, **run)
    done = {int(i): s for f in gen for i, s in zip(f.index, f.samples, strict=True)}
    assert torch.equal(done[0], one.samples[0]) and torch.equal(done[1], one.samples[1])


# -- the law ------------------------------------------------------------------------------------


class AcceptEveryDraft(Coupling):
    """A WRONG rule: accepts the first child always (the draft chain, uncorrected)."""

    name = "accept-all"

    def select(self, s_hat, delta, valid, rng):
        P = s_hat.shape[0]
        return torch.ones(P, dtype=torch.bool), torch.zeros(P, dtype=torch.long)


def _statistics(x: torch.Tensor) -> torch.Tensor:
    """``(n, 6)`` per sample: the three channel means, the mean square, and the horizontal and vertical
    mean absolute differences (the fine texture a wrong low-noise step changes first)."""
    x = x.double()
    return torch.cat(
        [
            x.mean((2, 3)),
            x.square().mean((1, 2, 3))[:, None],
            (x[..., 1:] - x[..., :-1]).abs().mean((1, 2, 3))[:, None],
            (x[..., 1:, :] - x[..., :-1, :]).abs().mean((1, 2, 3))[:, None],
        ],
        1,
    )


def _paired_z(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """z-scores of the mean paired differences of two runs' statistics from the same seeds: under the
    same law each difference has mean 0 whatever the runs' dependence, and its standard error is the
    pairs' own."""
    d = _statistics(a) - _statistics(b)
    return d.mean(0) / (d.std(0) / math.sqrt(d.shape[0]))


@pytest.mark.slow
def test_draft_learned_keeps_natural32s_law_and_the_same_check_rejects_a_wrong_one(den32):
    """``euler_ancestral`` on 6 Karras levels, 64 samples: the RMC chain of 4 with the learned draft
    against the standard drop-in from the same per-sample seeds, paired z-scores of six statistics
    within Z_TOL; the same chain accepting every draft uncorrected fails the same check (|z| of 4 to
    300 seen at 48 samples, against at most 2.6 for the exact chain). About 15 s on one thread."""
    n = 64
    sig = kdiffusion.get_sigmas_karras(6, 0.002, 80.0).double()
    x = streams.randn(11, torch.arange(n), (3, 32, 32)) * float(sig[0])
    ref = kdiffusion.sample_euler_ancestral(den32, x, sig, disable=True, seed=4)
    run = dict(chain="euler_ancestral", tree=trees.chain(4), draft="learned", seed=4, disable=True)
    spec = kdiffusion.sample(den32, x, sig, coupling="rmc", **run)
    assert spec.stats.draft_calls > 0 and spec.stats.accepts.sum() > 0
    z = _paired_z(spec.samples, ref)
    assert z.abs().max() <= Z_TOL, z
    wrong = kdiffusion.sample(den32, x, sig, coupling=AcceptEveryDraft(), **run)
    assert _paired_z(wrong.samples, ref).abs().max() > Z_TOL


# -- the training command -----------------------------------------------------------------------

TINY = UNetConfig(img_channels=3, img_resolution=32, channels=(8, 8, 8), emb_dim=16, num_classes=0)
TINY_CFG = NaturalDraftConfig(steps=6, batch=2, warmup=2, checkpoint_every=2, eval_crops=2)


def test_draft_training_writes_its_weights_and_resumes_bitwise_after_an_interruption(tmp_path, monkeypatch):
    """A tiny run writes a draft the loader accepts (its digest in the manifest, beside the other
    entries, its target's digest recorded); a run killed after its step-4 checkpoint, started again,
    ends with the same weights and losses, bit for bit, as the run never interrupted."""
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "manifest.json").write_text(json.dumps({"other.safetensors": {"sha256": "1" * 64}}))
    kw = {"config": TINY_CFG, "unet_config": TINY, "progress": False, "log": lambda line: None}
    whole = train_natural_draft.main_train_natural_draft("natural32", tmp_path / "a", weights_dir=tmp_path / "w", **kw)
    assert whole["training"]["steps_done"] == 6 and not whole["training"]["stopped_early"]
    entries = json.loads((tmp_path / "w" / "manifest.json").read_text())
    file = natural.MODELS["natural32"].draft_file
    assert set(entries) == {"other.safetensors", file}
    assert entries[file]["target_sha256"] == digits.manifest()["natural32_unet.safetensors"]["sha256"]
    assert natural.load_draft_denoiser("natural32", path=tmp_path / "w" / file).net.config == TINY

    crops = train_natural_draft.random_crops
    calls = []

    def killed_at_step_4(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # the fifth batch: steps 0-3 ran and the step-4 checkpoint was written
            raise KeyboardInterrupt
        return crops(*args, **kwargs)

    monkeypatch.setattr(train_natural_draft, "random_crops", killed_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        train_natural_draft.main_train_natural_draft("natural32", tmp_path / "b", weights_dir=tmp_path / "v", **kw)
    assert not (tmp_path / "v").exists()  # nothing shipped by a run that did not end
    monkeypatch.setattr(train_natural_draft, "random_crops", crops)
    logs: list[str] = []
    resumed = train_natural_draft.main_train_natural_draft(
        "natural32", tmp_path / "b", weights_dir=tmp_path / "v", **{**kw, "log": logs.append}
    )
    assert any("resuming natural32-draft" in line and "at step 4 of 6" in line for line in logs), logs
    a, b = load_file(tmp_path / "w" / file), load_file(tmp_path / "v" / file)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["training"]["final_loss"] == whole["training"]["final_loss"]
    assert resumed["held_out_rms_delta"] == whole["held_out_rms_delta"]


def test_the_draft_train_command_hands_its_options_on_and_refuses_bad_ones(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(
        train_natural_draft, "main_train_natural_draft", lambda name, out, **kw: calls.append((name, out, kw))
    )
    args = ["--out", str(tmp_path / "o"), "--weights-dir", str(tmp_path / "w"), "--steps", "7", "--batch", "3"]
    res = CliRunner().invoke(train, ["natural64-draft", *args, "--max-minutes", "0.5", "--seed", "2", "--no-progress"])
    assert res.exit_code == 0, res.output
    ((name, out, kw),) = calls
    assert name == "natural64" and out == str(tmp_path / "o") and kw["weights_dir"] == tmp_path / "w"
    assert kw["config"] == NaturalDraftConfig(steps=7, batch=3, seed=2, max_minutes=0.5)
    res = CliRunner().invoke(train, ["natural32-draft"])
    assert res.exit_code == 0, res.output
    spec = natural.MODELS["natural32"]
    assert calls[1][2]["config"] == NaturalDraftConfig(steps=spec.draft_steps, batch=spec.draft_batch)
    for bad in (["--steps", "0"], ["--batch", "0"], ["--max-minutes", "0"], ["--eval-crops", "-1"], ["--seed", "-1"]):
        res = CliRunner().invoke(train, ["natural32-draft", "--out", str(tmp_path / "x"), *bad])
        assert res.exit_code == 2 and bad[0] in res.output and "Traceback" not in res.output, res.output
    assert len(calls) == 2 and not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("steps", 0, "steps"),
        ("batch", 0, "batch"),
        ("sampler_steps", 1, "sampler_steps"),
        ("lr", 0.0, "lr"),
        ("ema_decay", 1.5, "ema_decay"),
        ("max_minutes", 0.0, "max_minutes"),
        ("eval_crops", -1, "eval_crops"),
    ],
)
def test_the_draft_configuration_refuses_a_field_out_of_range_naming_it(field, value, match):
    with pytest.raises(ValueError, match=match):
        NaturalDraftConfig(**{field: value})


def test_a_draft_architecture_of_another_image_size_is_refused_before_anything_is_written(tmp_path):
    other = dataclasses.replace(TINY, img_resolution=64)
    with pytest.raises(ValueError, match="unet_config must serve unconditional 3 x 32 x 32 images"):
        train_natural_draft.main_train_natural_draft(
            "natural32", tmp_path / "a", weights_dir=tmp_path / "w", config=TINY_CFG, unet_config=other
        )
    assert not (tmp_path / "a").exists() and not (tmp_path / "w").exists()


def test_the_verified_levels_are_euler_ancestral_50s_and_weigh_each_steps_delta():
    """The 49 stochastic steps of 50 Karras levels on [0.002, 80], each weighted by the squared clean-image
    coefficient of its mean over its noise scale: VE ``(s - s_down) / (s s_up)`` (k-diffusion's step)."""
    sig, w = train_natural_draft.verified_levels(50)
    karras = kdiffusion.get_sigmas_karras(50, 0.002, 80.0).double()
    torch.testing.assert_close(sig.double(), karras[:-2], rtol=1e-5, atol=0)
    s, s1 = karras[:-2], karras[1:-1]
    up = (s1**2 * (s**2 - s1**2) / s**2).sqrt()
    down = (s1**2 - up**2).sqrt()
    torch.testing.assert_close(w.double(), ((s - down) / (s * up)).square(), rtol=1e-4, atol=0)
