"""The shipped natural-image denoisers (``natural32``, ``natural64``) and their training command.

Loads the committed weights (never trains them): the loader checks the manifest's digest and
refuses a wrong name, the denoisers keep the contract the k-diffusion drop-ins and
:func:`specforest.sample` call them by, and each is a real denoiser on held-out crops (its loss
well below the best trivial denoiser's at every level tried). A tiny training run (a few steps of a
narrow network) checks the command: it writes the weights and their manifest entry, and a run
interrupted after a checkpoint resumes to the same weights, bit for bit, as one never interrupted.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import specforest
from specforest.cli.train import train
from specforest.experiments import train_natural
from specforest.experiments.train_natural import NaturalTrainConfig, denoising_losses, evaluation_crops
from specforest.kdiffusion import get_sigmas_karras, sample_euler_ancestral
from specforest.models import digits, natural
from specforest.models.unet import EDMPrecond, UNet, UNetConfig

NAMES = tuple(natural.MODELS)


@pytest.fixture(scope="module", params=NAMES)
def name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def denoiser(name):
    return natural.load_denoiser(name)


# -- the loader ---------------------------------------------------------------------------------


def test_the_manifest_records_each_shipped_file_and_its_digest(name):
    entry = digits.manifest()[natural.MODELS[name].file]
    path = digits.WEIGHTS_DIR / natural.MODELS[name].file
    assert digits.sha256_file(path) == entry["sha256"] and path.stat().st_size == entry["bytes"]
    # a few MB at most: the package ships them
    assert entry["bytes"] < 5 * 2**20


def test_a_wrong_name_is_refused_listing_the_accepted_ones():
    for bad in ("natural16", "digits", ""):
        for load in (natural.load_denoiser, natural.load_velocity):
            with pytest.raises(ValueError, match="name must be one of natural32, natural64, got"):
                load(bad)
    with pytest.raises(TypeError, match="name must be one of natural32, natural64"):
        natural.load_denoiser(32)


def test_the_loader_checks_the_digest_before_reading(tmp_path, name):
    """A copy whose manifest records another digest, or a copy with one byte changed, is refused."""
    file = natural.MODELS[name].file
    shutil.copy(digits.WEIGHTS_DIR / file, tmp_path / file)
    entry = dict(digits.manifest()[file])
    (tmp_path / "manifest.json").write_text(json.dumps({file: entry}))
    natural.load_denoiser(name, path=tmp_path / file)  # the faithful copy loads
    (tmp_path / "manifest.json").write_text(json.dumps({file: {**entry, "sha256": "0" * 64}}))
    with pytest.raises(digits.ChecksumError, match="does not match the recorded"):
        natural.load_denoiser(name, path=tmp_path / file)
    data = bytearray((digits.WEIGHTS_DIR / file).read_bytes())
    data[-1] ^= 1
    (tmp_path / file).write_bytes(bytes(data))
    (tmp_path / "manifest.json").write_text(json.dumps({file: entry}))
    with pytest.raises(digits.ChecksumError, match="does not match the recorded"):
        natural.load_velocity(name, path=tmp_path / file)


def test_missing_weights_name_the_command_that_makes_them(tmp_path, monkeypatch):
    monkeypatch.setattr(natural, "WEIGHTS_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="run `specforest train natural64`"):
        natural.load_denoiser("natural64")


def test_one_models_weights_are_refused_as_the_others(tmp_path):
    """natural64's file, recorded under natural32's name, serves another shape: refused, not loaded."""
    f32, f64 = natural.MODELS["natural32"].file, natural.MODELS["natural64"].file
    shutil.copy(digits.WEIGHTS_DIR / f64, tmp_path / f32)
    (tmp_path / "manifest.json").write_text(json.dumps({f32: digits.manifest()[f64]}))
    with pytest.raises(digits.WeightsFileError, match="3 x 64 x 64 images, natural32 serves 3 x 32 x 32"):
        natural.load_denoiser("natural32", path=tmp_path / f32)


def test_the_digits_weights_are_refused_by_what_they_are():
    clf, unet = digits.WEIGHTS_DIR / digits.CLASSIFIER_FILE, digits.WEIGHTS_DIR / digits.UNET_FILE
    with pytest.raises(
        digits.WeightsFileError, match="is not a natural-image U-Net's weights .* no U-Net architecture"
    ):
        natural.load_denoiser("natural32", path=clf)
    with pytest.raises(digits.WeightsFileError, match="1 x 8 x 8 images, natural64 serves 3 x 64 x 64"):
        natural.load_velocity("natural64", path=unet)


# -- the contract -------------------------------------------------------------------------------


def test_the_denoiser_contract(name, denoiser):
    """``D(x: (M, 3, H, W), sigma: (M,)) -> (M, 3, H, W)`` on the input's dtype and device, a scalar
    sigma as a per-row one, another shape refused naming the one served."""
    shape = natural.MODELS[name].state_shape
    x = torch.randn((3, *shape), generator=torch.Generator().manual_seed(0))
    s = torch.tensor([0.1, 1.0, 10.0])
    d = denoiser(x, s)
    assert d.shape == x.shape and d.dtype == torch.float32 and d.device == x.device
    assert torch.isfinite(d).all() and not denoiser.training
    assert not any(p.requires_grad for p in denoiser.parameters())
    torch.testing.assert_close(denoiser(x, 1.0)[1], d[1], rtol=1e-5, atol=1e-5)
    assert denoiser(x.double(), s).dtype == torch.float64
    other = (3, 3, shape[1] // 2, shape[2] // 2)
    with pytest.raises(ValueError, match=rf"x must have shape \(M, 3, {shape[1]}, {shape[2]}\)"):
        denoiser(torch.zeros(other), s)


def test_the_velocity_for_sample_and_its_declared_memory(name):
    state = torch.random.get_rng_state()
    v = natural.load_velocity(name)
    assert torch.equal(torch.random.get_rng_state(), state)  # loading draws nothing from the global stream
    shape = natural.MODELS[name].state_shape
    x = torch.randn((2, *shape), generator=torch.Generator().manual_seed(1))
    out = v(x, torch.tensor([0.3, 0.9]))
    assert out.shape == x.shape and torch.isfinite(out).all()
    # larger activations than the digits U-Net's, declared so (memory.estimate sizes chunks by it)
    assert isinstance(v.row_bytes, int) and v.row_bytes > digits.ROW_BYTES_FLOAT32
    # the engine runs it: two steps of the standard sampler through specforest.sample
    res = specforest.sample(v, x, steps=2, churn=0.3, seed=0)
    assert res.samples.shape == x.shape and torch.isfinite(res.samples).all()


def test_the_kdiffusion_drop_in_takes_the_denoiser_as_it_is(name, denoiser):
    shape = natural.MODELS[name].state_shape
    sigmas = get_sigmas_karras(3, 0.002, 80.0)
    x = torch.randn((2, *shape), generator=torch.Generator().manual_seed(2)) * sigmas[0]
    out = sample_euler_ancestral(denoiser, x, sigmas, disable=True, seed=0)
    assert out.shape == x.shape and torch.isfinite(out).all()


# -- the data -----------------------------------------------------------------------------------


def test_the_held_out_photographs_never_train_and_crops_are_seeded():
    assert set(natural.HELD_OUT) <= set(natural.COLOUR_IMAGES + natural.GREY_IMAGES)
    train, held = natural.load_images(32, "train"), natural.load_images(32, "held_out")
    assert len(train) + len(held) == len(natural.COLOUR_IMAGES + natural.GREY_IMAGES) and len(held) == 2
    for levels in train + held:
        # a pyramid of several scales, each with room for crops at many positions
        assert len(levels) >= 3 and all(min(lev.shape[1:]) >= 48 for lev in levels)
        assert all(lev.shape[0] == 3 and -1 <= lev.min() and lev.max() <= 1 for lev in levels)
    a = natural.random_crops(train, 64, 32, torch.Generator().manual_seed(0))
    b = natural.random_crops(train, 64, 32, torch.Generator().manual_seed(0))
    assert a.shape == (64, 3, 32, 32) and torch.equal(a, b)
    assert not torch.equal(a, natural.random_crops(train, 64, 32, torch.Generator().manual_seed(1)))
    with pytest.raises(ValueError, match="split must be 'train' or 'held_out'"):
        natural.load_images(32, "test")


# -- a real denoiser ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def held_out(name) -> torch.Tensor:
    return evaluation_crops(name, "held_out", 8, seed=5)


SIGMAS = (0.02, 0.2, 1.0, 5.0)
RATIO_BOUND = (0.6, 0.25, 0.45, 0.85)
"""At each level of SIGMAS, the most the held-out loss may be over the best trivial denoiser's (identity, zero,
training mean): the shipped networks measure 0.44-0.46, 0.14, 0.26-0.27 and 0.61-0.68 on these 8 crops, an
untrained one 0.99, 0.79, 1.06-1.09 and 1.09 (docs/natural.md has the table on 256 crops; above sigma = 5 the
posterior mean of a crop nears the mean colour and no denoiser is well below that baseline)."""


def test_the_shipped_network_is_a_real_denoiser_on_held_out_crops(name, denoiser, held_out):
    """On crops of photographs it never trained on, its loss at every level is well below that of the
    best denoiser that knows nothing of the images' structure; the untrained network of the same
    architecture is not (the check has power)."""
    mean = torch.tensor(digits.manifest()[natural.MODELS[name].file]["evaluation"]["mean"])
    res = denoising_losses(denoiser, held_out, SIGMAS, mean=mean, seed=3)
    ratios = [r["ratio"] for r in res]
    assert all(r < b for r, b in zip(ratios, RATIO_BOUND, strict=True)), ratios
    untrained = EDMPrecond(UNet(natural.MODELS[name].unet)).eval()  # its output layer starts at zero: D = c_skip x
    base = denoising_losses(untrained, held_out, SIGMAS, mean=mean, seed=3)
    assert all(r["ratio"] > b for r, b in zip(base, RATIO_BOUND, strict=True)), [r["ratio"] for r in base]


def test_the_docs_tables_are_the_shipped_networks_evaluation():
    """docs/natural.md shows, per model, the loss table its training run recorded in the manifest."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "natural.md").read_text()
    for spec in natural.MODELS.values():
        assert train_natural.loss_table(digits.manifest()[spec.file]["evaluation"]) in text, spec.name


# -- the training command -----------------------------------------------------------------------

TINY = UNetConfig(img_channels=3, img_resolution=32, channels=(8, 8, 8), emb_dim=16, num_classes=0)
TINY_CFG = NaturalTrainConfig(steps=6, batch=2, checkpoint_every=2, eval_crops=2, figure_samples=0)


def _weights(weights_dir) -> dict[str, torch.Tensor]:
    return load_file(weights_dir / natural.MODELS["natural32"].file)


def test_training_writes_the_weights_and_resumes_bitwise_after_an_interruption(tmp_path, monkeypatch):
    """A tiny run writes weights the loader accepts (their digest in the manifest, beside the other
    entries); a run killed after its step-4 checkpoint, started again, ends with the same weights and
    the same losses, bit for bit, as the run never interrupted."""
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "manifest.json").write_text(json.dumps({"other.safetensors": {"sha256": "1" * 64}}))
    kw = {"config": TINY_CFG, "unet_config": TINY, "progress": False, "log": lambda line: None}
    whole = train_natural.main_train_natural("natural32", tmp_path / "a", weights_dir=tmp_path / "w", **kw)
    assert whole["training"]["steps_done"] == 6 and not whole["training"]["stopped_early"]
    entries = json.loads((tmp_path / "w" / "manifest.json").read_text())
    assert set(entries) == {"other.safetensors", "natural32_unet.safetensors"}
    den = natural.load_denoiser("natural32", path=tmp_path / "w" / "natural32_unet.safetensors")
    assert den.net.config == TINY and (tmp_path / "a" / train_natural.CHECKPOINT).is_file()

    crops = train_natural.random_crops
    calls = []

    def killed_at_step_4(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # the fifth batch: steps 0-3 ran and the step-4 checkpoint was written
            raise KeyboardInterrupt
        return crops(*args, **kwargs)

    monkeypatch.setattr(train_natural, "random_crops", killed_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        train_natural.main_train_natural("natural32", tmp_path / "b", weights_dir=tmp_path / "v", **kw)
    assert not (tmp_path / "v").exists()  # nothing shipped by a run that did not end
    monkeypatch.setattr(train_natural, "random_crops", crops)
    logs = []
    resumed = train_natural.main_train_natural(
        "natural32", tmp_path / "b", weights_dir=tmp_path / "v", **{**kw, "log": logs.append}
    )
    assert any("resuming natural32" in line and "at step 4 of 6" in line for line in logs), logs
    a, b = _weights(tmp_path / "w"), _weights(tmp_path / "v")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log_a = json.loads((tmp_path / "a" / "train_log.json").read_text())
    assert resumed["training"]["final_loss"] == whole["training"]["final_loss"]
    assert log_a["evaluation"] == resumed["evaluation"]


def test_a_checkpoint_of_another_configuration_is_refused_before_anything_is_written(tmp_path):
    kw = {"unet_config": TINY, "progress": False, "log": lambda line: None}
    train_natural.main_train_natural("natural32", tmp_path / "a", weights_dir=tmp_path / "w", config=TINY_CFG, **kw)
    before = (tmp_path / "w" / "manifest.json").read_bytes()
    ckpt = (tmp_path / "a" / train_natural.CHECKPOINT).read_bytes()
    other = dataclasses.replace(TINY_CFG, steps=8)
    with pytest.raises(ValueError, match="remove it to start afresh, or give another --out"):
        train_natural.main_train_natural("natural32", tmp_path / "a", weights_dir=tmp_path / "w", config=other, **kw)
    assert (tmp_path / "w" / "manifest.json").read_bytes() == before
    assert (tmp_path / "a" / train_natural.CHECKPOINT).read_bytes() == ckpt


def test_the_train_command_hands_its_options_on_and_refuses_bad_ones(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(train_natural, "main_train_natural", lambda name, out, **kw: calls.append((name, out, kw)))
    args = ["--out", str(tmp_path / "o"), "--weights-dir", str(tmp_path / "w"), "--steps", "7", "--batch", "3"]
    res = CliRunner().invoke(
        train, ["natural64", *args, "--channels", "8,16,24", "--max-minutes", "0.5", "--seed", "2", "--no-progress"]
    )
    assert res.exit_code == 0, res.output
    ((name, out, kw),) = calls
    assert name == "natural64" and out == str(tmp_path / "o") and kw["weights_dir"] == tmp_path / "w"
    assert kw["config"] == NaturalTrainConfig(steps=7, batch=3, seed=2, max_minutes=0.5)
    assert kw["unet_config"].channels == (8, 16, 24) and kw["unet_config"].img_resolution == 64
    res = CliRunner().invoke(train, ["natural32"])
    assert res.exit_code == 0, res.output
    spec = natural.MODELS["natural32"]
    assert calls[1][2]["config"] == NaturalTrainConfig(steps=spec.steps, batch=spec.batch)
    assert calls[1][2]["unet_config"] == spec.unet and calls[1][2]["weights_dir"] == digits.WEIGHTS_DIR
    bad_options = (
        ["--channels", "8,16"],
        ["--channels", "8,a,8"],
        ["--channels", "8,6,8"],
        ["--channels", "8,16,36"],
        ["--steps", "0"],
        ["--batch", "0"],
        ["--max-minutes", "0"],
    )
    for bad in bad_options:
        res = CliRunner().invoke(train, ["natural32", "--out", str(tmp_path / "x"), *bad])
        assert res.exit_code == 2 and bad[0] in res.output and "Traceback" not in res.output, res.output
    assert len(calls) == 2 and not (tmp_path / "x").exists()
