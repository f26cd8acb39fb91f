"""The diffusers command line on tiny saved pipelines: ``specforest diffusers``, ``generate diffusers`` and
``tune --model diffusers`` for every family, the family read from ``model_index.json``.

The pipelines are the tiny SD3, Flux, SDXL and SD 1.5 ones of ``test_diffusers_sd3``,
``test_diffusers_flux`` and ``test_diffusers_sdxl``, written with ``save_pretrained`` so the commands load
them from a directory as they would a download.
``specforest sd3`` and ``generate sd3`` keep their own tests there.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from test_diffusers_flux import build_tiny_flux
from test_diffusers_sd3 import SEQ, build_tiny_pipeline
from test_diffusers_sdxl import build_tiny_pipeline as build_tiny_unet_pipeline

import specforest
import specforest.memory
from specforest import streams
from specforest.cli import main
from specforest.diffusers import families

FAMILY_NAMES = ["sd3", "flux", "sdxl", "sd"]
CLASSES = {
    "sd3": "StableDiffusion3Pipeline",
    "flux": "FluxPipeline",
    "sdxl": "StableDiffusionXLPipeline",
    "sd": "StableDiffusionPipeline",
}
# image side in pixels: the transformers' 2 x 2 latent patches need 16, the UNets' native size is 8
SIDE = {"sd3": 16, "flux": 16, "sdxl": 8, "sd": 8}
# the guidance a family's sample defaults to; SDXL and SD default to None there (the pipeline's own)
GUIDANCE = {"sd3": 7.0, "flux": 3.5, "sdxl": 5.0, "sd": 7.5}
DEFAULT_GUIDANCE = {"sd3": 7.0, "flux": 3.5, "sdxl": None, "sd": None}
# the commands set torch's threads themselves (default: every CPU); tiny models on shared cores run
# many times faster, and their timings swing far less, on one thread
CPU = ["--dtype", "float32", "--no-progress", "--threads", "1"]
STEPS = 10


def size(family):
    """The size options of a family: the UNet families have no T5 encoder (no --max-sequence-length)."""
    side = ["--height", SIDE[family], "--width", SIDE[family]]
    return side + (["--max-sequence-length", SEQ] if family in ("sd3", "flux") else [])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``{family: directory}`` of the four tiny pipelines, and a captions file."""
    threads = torch.get_num_threads()
    # tiny matmuls on shared cores: one thread is many times faster than two contended ones
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("pipelines")
    build_tiny_pipeline(tmp).save_pretrained(str(tmp / "sd3"))
    build_tiny_flux().save_pretrained(str(tmp / "flux"))
    for kind in ("sdxl", "sd"):
        build_tiny_unet_pipeline(kind).save_pretrained(str(tmp / kind))
    prompts = tmp / "prompts.txt"
    prompts.write_text("a photo of a cat\n\na red car on the street\n")
    try:
        yield {**{f: tmp / f for f in FAMILY_NAMES}, "prompts": prompts}
    finally:
        torch.set_num_threads(threads)


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def run_diffusers(saved, family, out, *extra):
    args = ["diffusers", "--pipeline", saved[family], "--prompts", saved["prompts"], "--steps", STEPS]
    return invoke(*args, *size(family), *CPU, "--device", "cpu", "--out", out, *extra)


def pngs(folder):
    return sorted(p.name for p in folder.iterdir() if p.suffix == ".png")


def pixels(path):
    return np.asarray(Image.open(path), dtype=np.int16)


# -- specforest diffusers ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_diffusers_command_detects_the_family_and_makes_fewer_calls_than_steps(saved, family, tmp_path):
    out = tmp_path / "images"
    res = run_diffusers(saved, family, out, "--num-images-per-prompt", 2, "--json", "--seed", 3)
    assert res.exit_code == 0, res.output
    rec = json.loads((out / "run.json").read_text())
    assert json.loads(res.stdout.strip().splitlines()[-1]) == rec  # --json prints the record
    assert rec["family"] == family and rec["pipeline_class"] == CLASSES[family]
    assert rec["config"]["num_inference_steps"] == STEPS and rec["steps"] == STEPS
    assert pngs(out) == [f"{i:06d}.png" for i in range(4)]
    side = SIDE[family]
    assert all(pixels(out / f"{i:06d}.png").shape == (side, side, 3) for i in range(4))
    # captions i // 2, each image's NFE, fewer sequential transformer calls than steps
    assert rec["captions"] == ["a photo of a cat", "a red car on the street"]
    assert [im["prompt"] for im in rec["images"]] == ["a photo of a cat"] * 2 + ["a red car on the street"] * 2
    assert len(rec["nfe"]) == 4 and rec["nfe"] == [im["nfe"] for im in rec["images"]]
    assert rec["nfe_mean"] < STEPS and rec["speedup"] == pytest.approx(STEPS / rec["nfe_mean"])
    assert rec["wall_seconds"] > 0 and rec["specforest_version"] == specforest.__version__
    # the family's own defaults, taken from its sample's signature
    opts = rec["options"]
    assert opts["guidance_scale"] == DEFAULT_GUIDANCE[family] and opts["churn"] == 0.8
    assert rec["config"]["guidance_scale"] == GUIDANCE[family]
    assert ("true_cfg_scale" in opts) == (family == "flux")
    assert ("max_sequence_length" in opts) == (family in ("sd3", "flux"))
    assert (opts["method"], opts["K"], opts["L"], opts["seed"], opts["dtype"]) == ("dgrs", 2, 2, 3, "float32")
    assert rec["config"]["tree"].startswith("DraftTree(L=2")
    # an existing output is never written into
    again = run_diffusers(saved, family, out)
    assert again.exit_code != 0 and "exists" in again.output


@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_diffusers_command_follows_a_swapped_scheduler(saved, family, tmp_path):
    """--scheduler swaps the pipeline's scheduler from its config; --chain scheduler follows its chain
    (--eta its step's), recorded; a name that is no scheduler is refused, and the pipeline's own
    deterministic scheduler with a tree too."""
    out = tmp_path / "images"
    res = run_diffusers(
        saved, family, out, "--scheduler", "DDIMScheduler", "--chain", "scheduler", "--eta", 1.0, "--method", "rmc",
        "--L", 4,
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    rec = json.loads((out / "run.json").read_text())
    assert rec["options"]["chain"] == "scheduler" and rec["options"]["scheduler"] == "DDIMScheduler"
    assert rec["options"]["eta"] == 1.0 and rec["config"]["scheduler"] == "DDIMScheduler"
    assert rec["nfe_mean"] <= STEPS
    bad = run_diffusers(saved, family, tmp_path / "bad", "--scheduler", "NoSuchScheduler")
    assert bad.exit_code == 2 and "is not a diffusers scheduler" in bad.output
    det = run_diffusers(saved, family, tmp_path / "det", "--chain", "scheduler")  # its own PNDM/Euler: deterministic
    assert det.exit_code != 0 and "from_config" in det.output


def test_diffusers_command_takes_every_chain_option(saved, tmp_path):
    """--chain NAME with the chain's own options (here --s-noise) on 'specforest diffusers', as on every
    command that runs the sampler: recorded with the chain's parameters; one the chain lacks is refused."""
    out = tmp_path / "ea"
    res = run_diffusers(saved, "sdxl", out, "--chain", "euler_ancestral", "--s-noise", 0.5, "--method", "rmc", "--L", 3)
    assert res.exit_code == 0, res.output
    opts = json.loads((out / "run.json").read_text())["options"]
    assert opts["chain"] == "euler_ancestral" and opts["chain_params"]["s_noise"] == 0.5
    bad = run_diffusers(saved, "sdxl", tmp_path / "bad", "--chain", "ddpm", "--s-noise", 0.5)
    assert bad.exit_code == 2 and "--s-noise is not a parameter of chain 'ddpm'" in bad.output, bad.output
    em = run_diffusers(saved, "sdxl", tmp_path / "em", "--eta", 0.5)
    assert em.exit_code == 2 and "--eta is not a parameter of chain 'em'; its parameters: churn" in em.output
    assert not (tmp_path / "bad").exists() and not (tmp_path / "em").exists()


def test_diffusers_speedup_is_over_the_chains_standard_calls(saved, tmp_path):
    """A chain of two calls a step (heun: 2 T - 1 in its standard run): run.json's speedup is over those calls,
    so the standard run's is 1 (not T / NFE); its s_tmax of no bound (inf) is written as null."""
    out = tmp_path / "heun"
    res = run_diffusers(saved, "sdxl", out, "--chain", "heun", "--s-churn", 1.0, "--method", "standard")
    assert res.exit_code == 0, res.output
    rec = json.loads((out / "run.json").read_text())
    assert set(rec["nfe"]) == {2 * STEPS - 1} and rec["standard_calls"] == 2 * STEPS - 1 and rec["speedup"] == 1
    assert rec["config"]["s_tmax"] is None and rec["options"]["chain_params"]["s_tmax"] is None


def test_diffusers_chain_of_half_steps_keeps_the_length_asked_for(saved, tmp_path):
    """dpmpp_sde walks 2 T - 1 half-steps (19 at T = 10): --method rmc --L 15 drafts a chain of 15, not one
    cut to the grid's T = 10."""
    out = tmp_path / "sde"
    res = run_diffusers(saved, "sdxl", out, "--chain", "dpmpp_sde", "--method", "rmc", "--L", 15)
    assert res.exit_code == 0, res.output
    rec = json.loads((out / "run.json").read_text())
    assert rec["config"]["tree"].startswith("DraftTree(L=15, budget=15") and rec["standard_calls"] == 19


def test_images_depend_on_the_seed_and_index_not_on_the_batch_size(saved, tmp_path):
    a, b, c = tmp_path / "all", tmp_path / "one", tmp_path / "other"
    assert run_diffusers(saved, "sd3", a).exit_code == 0
    assert run_diffusers(saved, "sd3", b, "--batch-size", 1).exit_code == 0
    assert run_diffusers(saved, "sd3", c, "--seed", 1).exit_code == 0
    ra, rb = (json.loads((p / "run.json").read_text()) for p in (a, b))
    assert ra["nfe"] == rb["nfe"] and rb["options"]["batch_size"] == 1
    for name in pngs(a):
        assert np.abs(pixels(a / name) - pixels(b / name)).max() <= 1
    assert any(np.abs(pixels(a / n) - pixels(c / n)).max() > 1 for n in pngs(a))


def test_standard_method_takes_one_call_per_step_and_flux_true_cfg_runs(saved, tmp_path):
    res = run_diffusers(saved, "flux", tmp_path / "std", "--method", "standard")
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "std" / "run.json").read_text())["nfe"] == [STEPS, STEPS]
    cfg = ["--true-cfg-scale", 3, "--negative-prompt", "", "--method", "rmc", "--L", 4]
    res = run_diffusers(saved, "flux", tmp_path / "cfg", *cfg)
    assert res.exit_code == 0, res.output
    rec = json.loads((tmp_path / "cfg" / "run.json").read_text())
    assert rec["config"]["true_cfg_scale"] == 3.0 and rec["config"]["coupling"] == "rmc"
    assert rec["options"]["negative_prompt"] == "" and rec["nfe_mean"] < STEPS
    # Flux's true CFG needs a negative prompt: the library's error, as a clean CLI error
    res = run_diffusers(saved, "flux", tmp_path / "no-negative", "--true-cfg-scale", 3)
    assert res.exit_code == 1 and "negative_prompt" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "no-negative").exists() and not list(tmp_path.glob(".no-negative*"))


def test_an_option_the_family_does_not_take_is_refused_naming_the_family(saved, tmp_path):
    res = run_diffusers(saved, "sd3", tmp_path / "x", "--true-cfg-scale", 2)
    assert res.exit_code == 1 and "--true-cfg-scale: not an option of the sd3 family's sample" in res.output
    res = invoke(
        "generate",
        "diffusers",
        "--pipeline",
        saved["sd3"],
        "--prompts",
        saved["prompts"],
        "--count",
        1,
        "--out",
        tmp_path / "g",
        "--true-cfg-scale",
        2,
    )
    assert res.exit_code == 1 and "--true-cfg-scale: not an option of the sd3 family's prepare" in res.output
    assert not (tmp_path / "x").exists() and not (tmp_path / "g").exists()


def _bad_pipelines(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "AudioLDMPipeline"}))
    return empty, other


@pytest.mark.parametrize("command", ["diffusers", "generate", "tune"])
def test_a_directory_without_model_index_or_of_another_class_is_a_clear_error(saved, tmp_path, command):
    empty, other = _bad_pipelines(tmp_path)
    for path, message in ((empty, "has no model_index.json"), (other, "'AudioLDMPipeline' is not supported")):
        args = ["--pipeline", path, "--prompts", saved["prompts"]]
        if command == "diffusers":
            res = invoke("diffusers", *args, "--out", tmp_path / "out")
        elif command == "generate":
            res = invoke("generate", "diffusers", *args, "--count", 1, "--out", tmp_path / "out")
        else:
            res = invoke("tune", "--model", "diffusers", *args, "--out", tmp_path / "t.json")
        assert res.exit_code == 1 and message in res.output and "Traceback" not in res.output, res.output
        if path is other:
            # the supported classes, from FAMILIES
            for f in families.FAMILIES:
                assert f"{f.pipeline_classes[0]} ({f.name})" in res.output
        assert not (tmp_path / "out").exists() and not (tmp_path / "t.json").exists()


# -- specforest generate diffusers -----------------------------------------------------------------------


def _generate(saved, family, out, *extra, model="diffusers"):
    flag = "--pipeline" if model == "diffusers" else "--model"
    args = ["generate", model, flag, saved[family], "--prompts", saved["prompts"], "--steps", STEPS]
    return invoke(*args, *size(family), *CPU, "--device", "cpu", "--count", 3, "--seed", 4, "--out", out, *extra)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_generate_diffusers_records_the_family_and_saves_calls(saved, family, tmp_path):
    out = tmp_path / "job"
    res = _generate(saved, family, out, "--batch", 2)
    assert res.exit_code == 0, res.output
    assert pngs(out) == ["000000.png", "000001.png", "000002.png"]
    meta = json.loads((tmp_path / "job.json").read_text())
    opts = meta["options"]
    assert opts["model"] == "diffusers" and opts["sampler"]["steps"] == STEPS
    m = opts["model_options"]
    assert m["family"] == family and m["pipeline"] == str(saved[family].resolve()) and m["prompts_sha256"]
    assert m["options"]["guidance_scale"] == DEFAULT_GUIDANCE[family] and m["options"]["height"] == SIDE[family]
    assert len(meta["nfe"]) == 3 and meta["nfe_mean"] < STEPS
    again = _generate(saved, family, out, "--batch", 2, "--resume")
    assert again.exit_code == 0 and "nothing to do" in again.output


def test_generate_diffusers_on_sd3_is_generate_sd3(saved, tmp_path):
    """The sd3 job model is the sd3 family's: the same images from the same seed, whichever command."""
    assert _generate(saved, "sd3", tmp_path / "a", "--batch", 3).exit_code == 0
    assert _generate(saved, "sd3", tmp_path / "b", "--batch", 1, model="sd3").exit_code == 0
    ma, mb = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    assert ma["nfe"] == mb["nfe"] and mb["options"]["model"] == "sd3"
    for i in range(3):
        assert np.abs(pixels(tmp_path / "a" / f"{i:06d}.png") - pixels(tmp_path / "b" / f"{i:06d}.png")).max() <= 1


def library_size(family):
    kw = dict(height=SIDE[family], width=SIDE[family])
    return {**kw, "max_sequence_length": SEQ} if family in ("sd3", "flux") else kw


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_prepare_is_the_chain_that_sample_runs(saved, family):
    """A family's prepare (what generate samples) and its sample give the same latents from one generator."""
    from specforest.experiments.pipelines import load_pipeline

    pipe, fam = load_pipeline(saved[family], device="cpu", dtype="float32")
    assert fam.name == family
    kw = dict(num_inference_steps=6, **library_size(family))
    captions = ["a photo of a cat", "a red car"]
    ref = fam.sample(pipe, captions, generator=torch.Generator().manual_seed(2), output_type="latent", **kw)
    parts = fam.prepare(pipe, captions, **kw)

    def chain(scale):
        g = torch.Generator().manual_seed(2)
        x = torch.randn((2, *parts.latent_shape), generator=g) * scale
        return specforest.sample(parts.velocity, x, sigmas=parts.sigmas, cond=parts.cond, generator=g, churn=0.8)

    mine = chain(parts.noise_scale)
    assert torch.equal(mine.samples, ref.latents)
    assert len(parts.decode(mine.samples)) == 2
    assert parts.config["guidance_scale"] == GUIDANCE[family] == ref.config["guidance_scale"]
    if family in ("sdxl", "sd"):
        # the VP grid starts below t = 1, from the scheduler's initial noise on the linear path: started
        # from unit noise, as a flow-matching grid is, it is another chain
        assert float(parts.sigmas[0]) == ref.config["first_sigma"] < 1 and 0 < parts.noise_scale < 1
        assert not torch.allclose(chain(1.0).samples, ref.latents, atol=1e-2)
    if family == "sdxl":
        # the micro-conditioning and pooled embeddings, one row per caption, with their negatives
        for key in ("time_ids", "negative_time_ids", "text_embeds", "negative_text_embeds"):
            assert parts.cond[key].shape[0] == 2, key
        assert parts.cond["time_ids"][0].tolist() == [8.0, 8.0, 0.0, 0.0, 8.0, 8.0]
        assert parts.config["original_size"] == (8, 8)


@pytest.mark.parametrize("family", ["sdxl", "sd"])
def test_generate_diffusers_images_are_the_prepared_chain_from_the_scheduler_noise(saved, family, tmp_path):
    """Image i of ``generate diffusers`` is prepare's standard chain from ``(seed, i)``'s noise scaled by
    ``noise_scale`` (its own seeding: ``specforest diffusers`` draws image i from a generator instead)."""
    from specforest.experiments.pipelines import load_pipeline

    res = _generate(saved, family, tmp_path / "job", "--method", "standard", "--batch", 2)
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "job.json").read_text())
    assert meta["nfe"] == [STEPS] * 3
    pipe, fam = load_pipeline(saved[family], device="cpu", dtype="float32")
    parts = fam.prepare(
        pipe, ["a photo of a cat", "a red car on the street"], num_inference_steps=STEPS, **library_size(family)
    )
    idx = torch.arange(3)
    cond = {k: v[idx % 2] for k, v in parts.cond.items()}  # caption i mod n

    def images(scale):
        x = scale * streams.randn(4, idx, parts.latent_shape)
        churn = meta["options"]["sampler"]["churn"]
        out = specforest.sample(
            parts.velocity, x, sigmas=parts.sigmas, cond=cond, seed=4, sample_index=idx, churn=churn
        )
        return [np.asarray(im, dtype=np.int16) for im in parts.decode(out.samples)]

    written = [pixels(tmp_path / "job" / f"{i:06d}.png") for i in range(3)]
    assert all(np.abs(w - im).max() <= 1 for w, im in zip(written, images(parts.noise_scale), strict=True))
    # a job that ignored noise_scale would start from unit noise: other images
    assert any(np.abs(w - im).max() > 1 for w, im in zip(written, images(1.0), strict=True))


def test_generate_diffusers_runs_another_chain_on_the_pipelines_grid(saved, tmp_path):
    """SDXL's grid starts below t = 1: DDPM's chain (not defined at t = 1) runs there; the job records it,
    its images are another law's, and --churn with it is refused naming the chain."""
    res = _generate(saved, "sdxl", tmp_path / "ddpm", "--batch", 2, "--chain", "ddpm")
    assert res.exit_code == 0, res.output
    sampler = json.loads((tmp_path / "ddpm.json").read_text())["options"]["sampler"]
    assert sampler["chain"] == "ddpm" and sampler["chain_params"] == {"variance": "fixed_small"}
    assert sampler["churn"] is None
    assert _generate(saved, "sdxl", tmp_path / "em", "--batch", 2).exit_code == 0
    em = json.loads((tmp_path / "em.json").read_text())["options"]["sampler"]
    assert em["chain"] == "em" and em["churn"] is not None
    assert any(
        np.abs(pixels(tmp_path / "ddpm" / f"{i:06d}.png") - pixels(tmp_path / "em" / f"{i:06d}.png")).max() > 1
        for i in range(3)
    )
    res = _generate(saved, "sdxl", tmp_path / "x", "--chain", "ddpm", "--churn", 0.5)
    assert res.exit_code == 2 and "--churn is not a parameter of chain 'ddpm'" in res.output, res.output
    assert not (tmp_path / "x").exists()


# -- specforest tune --model diffusers -----------------------------------------------------------------


def _tune(saved, family, path, *extra):
    args = ["tune", "--model", "diffusers", "--pipeline", saved[family], "--prompts", saved["prompts"]]
    # a memory limit of a few rows keeps the measured cost curve short
    args += ["--steps", STEPS, *size(family), *CPU, "--budget-max", 3, "--drafts", "velocity", "--max-memory-gb", 0.001]
    args += ["--out", path]
    # the process's own memory (which the limit bounds, and which drifts from call to call) taken out
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(specforest.memory, "held_bytes", lambda device="cpu": 0)
        return invoke(*args, *extra)


@pytest.fixture(scope="module")
def tuned(saved, tmp_path_factory):
    """``tuned(family)``: the file ``tune --model diffusers`` wrote for the family's pipeline (tuned once)."""
    files = {}

    def get(family):
        if family not in files:
            path = tmp_path_factory.mktemp("tuned") / f"{family}.json"
            res = _tune(saved, family, path)
            assert res.exit_code == 0, res.output
            assert "chosen:" in res.output
            files[family] = path
        return files[family]

    return get


@pytest.mark.parametrize("family", [f if f == "sd3" else pytest.param(f, marks=pytest.mark.slow) for f in FAMILY_NAMES])
def test_tune_diffusers_dispatches_to_the_family_and_its_file_runs(saved, tuned, family, tmp_path):
    path = tuned(family)
    data = json.loads(path.read_text())
    made_for = data["tuned_for"]
    assert made_for["model"] == "diffusers" and made_for["family"] == family and made_for["steps"] == STEPS
    # not given: the family's defaults, not the SD3 paper's --guidance 7 and --shift 3 of 'tune'
    assert made_for["guidance"] == DEFAULT_GUIDANCE[family] and made_for.get("shift") is None
    assert ("true_cfg_scale" in made_for) == (family == "flux")
    assert ("shift" in made_for) == (family in ("sd3", "flux"))
    run = run_diffusers(saved, family, tmp_path / "run", "--tune", path)
    assert run.exit_code == 0, run.output
    opts = json.loads((tmp_path / "run" / "run.json").read_text())["options"]
    assert opts["tuned"] == data["label"] and opts["batch_size"] == 1 and opts["guidance_scale"] == made_for["guidance"]
    gen = _generate(saved, family, tmp_path / "job", "--tune", path)
    assert gen.exit_code == 0, gen.output


def test_a_tune_file_of_another_family_or_run_is_refused(saved, tuned, tmp_path):
    path = tuned("flux")
    res = run_diffusers(saved, "sd3", tmp_path / "x", "--tune", path)
    assert res.exit_code == 2 and "family sd3 here" in res.output and "flux in the file" in res.output
    res = run_diffusers(saved, "flux", tmp_path / "y", "--tune", path, "--guidance", 5)
    assert res.exit_code == 2 and "--guidance 5.0 here, 3.5 in the file" in res.output
    res = run_diffusers(saved, "flux", tmp_path / "z", "--tune", path, "--K", 3)
    assert res.exit_code == 2 and "--K cannot be given with --tune" in res.output
    assert not any((tmp_path / n).exists() for n in "xyz")


def test_a_tune_file_of_another_chain_is_refused_by_the_pipeline_commands(saved, tuned, tmp_path):
    # a file tuned for another chain is not the run of --chain em
    data = json.loads(tuned("sd3").read_text())
    data.update(chain="ddim", chain_params={"eta": 1.0}, churn=None)
    data["tuned_for"].update(chain="ddim", chain_params={"eta": 1.0}, churn=None)
    path = tmp_path / "ddim.json"
    path.write_text(json.dumps(data))
    res = run_diffusers(saved, "sd3", tmp_path / "x", "--tune", path, "--chain", "em")
    assert res.exit_code == 2 and "--chain em here, ddim in the file" in res.output, res.output
    res = _generate(saved, "sd3", tmp_path / "y", "--tune", path, "--chain", "em")
    assert res.exit_code == 2 and "--chain em here, ddim in the file" in res.output, res.output
    assert not any((tmp_path / n).exists() for n in "xy")


def test_tune_diffusers_tunes_the_pipelines_own_scheduler_and_its_file_runs_it(saved, tmp_path):
    """tune --model diffusers --scheduler TCDScheduler --chain scheduler --eta 0.3: the file records the chain
    (the scheduler's class and eta) and the swap; a run with --tune makes the swap and takes the chain and
    its eta, and one with another scheduler or eta is refused naming both, nothing written."""
    path = tmp_path / "tcd.json"
    swap = ["--scheduler", "TCDScheduler", "--chain", "scheduler"]
    res = _tune(saved, "sd", path, *swap, "--eta", 0.3)
    assert res.exit_code == 0, res.output
    data = json.loads(path.read_text())
    assert data["chain"] == "scheduler" and data["chain_params"] == {"scheduler": "TCDScheduler", "eta": 0.3}
    assert data["churn"] is None and data["tuned_for"]["scheduler"] == "TCDScheduler"
    run = run_diffusers(saved, "sd", tmp_path / "run", "--tune", path)
    assert run.exit_code == 0, run.output
    opts = json.loads((tmp_path / "run" / "run.json").read_text())["options"]
    assert opts["chain"] == "scheduler" and opts["scheduler"] == "TCDScheduler" and opts["eta"] == 0.3
    gen = _generate(saved, "sd", tmp_path / "job", "--tune", path)
    assert gen.exit_code == 0, gen.output
    job = json.loads((tmp_path / "job.json").read_text())["options"]
    assert job["sampler"]["chain"] == "scheduler" and job["sampler"]["chain_params"] == {"eta": 0.3}
    assert job["model_options"]["scheduler"] == "TCDScheduler"
    res = run_diffusers(saved, "sd", tmp_path / "x", "--tune", path, "--eta", 0.5)
    assert res.exit_code == 2 and "--eta 0.5 here, 0.3 in the file (chain scheduler)" in res.output, res.output
    res = run_diffusers(saved, "sd", tmp_path / "y", "--tune", path, "--scheduler", "DDPMScheduler")
    assert res.exit_code == 2 and "--scheduler DDPMScheduler here, TCDScheduler in the file" in res.output
    assert not any((tmp_path / n).exists() for n in "xy")


@pytest.mark.parametrize(
    "args,named",
    [
        (["--model", "gmm", "--chain", "scheduler"], "--chain scheduler (a pipeline's own scheduler) applies only"),
        (["--model", "diffusers", "--chain", "scheduler", "--churn", 0.5], "--churn: --chain scheduler takes"),
        (["--model", "diffusers", "--chain", "scheduler", "--s-noise", 2], "--s-noise: --chain scheduler takes"),
        (["--model", "gmm", "--scheduler", "DDPMScheduler"], "--scheduler applies only to --model diffusers"),
        (
            ["--model", "sd3", "--chain", "ddpm"],
            "--chain applies only to --model gmm, digits, natural32, natural64 or diffusers",
        ),
    ],
)
def test_tune_refuses_a_scheduler_chain_where_it_cannot_run(saved, tmp_path, args, named):
    extra = ["--pipeline", saved["sd"], "--prompts", saved["prompts"]] if "diffusers" in args else []
    res = invoke("tune", *args, *extra, "--out", tmp_path / "t.json")
    assert res.exit_code == 2 and named in res.output, res.output
    assert not (tmp_path / "t.json").exists()


def test_a_family_without_a_tuner_or_prepare_says_so(saved, tmp_path, monkeypatch):
    """What a new family (SDXL, before its tuner exists) gets: a clear error naming it, nothing written."""
    untunable = tuple(dataclasses.replace(f, tune=None, prepare=None) for f in families.FAMILIES)
    monkeypatch.setattr(families, "FAMILIES", untunable)
    res = _tune(saved, "flux", tmp_path / "t.json")
    assert res.exit_code == 1 and "the flux family (FluxPipeline) has no tune yet" in res.output
    res = _generate(saved, "flux", tmp_path / "job")
    assert res.exit_code == 1 and "the flux family (FluxPipeline) has no prepare yet" in res.output
    assert not (tmp_path / "t.json").exists() and not (tmp_path / "job").exists()


def test_help_documents_the_family_defaults():
    res = invoke("diffusers", "--help")
    assert res.exit_code == 0
    text = " ".join(res.output.split())
    for part in ("the family's: sd3 7.0, flux 3.5", "the family's: sd3 50, flux 28", "--pipeline", "--tune"):
        assert part in text, part


@pytest.mark.parametrize("family", ["sd"])
def test_generate_diffusers_follows_a_swapped_scheduler_and_resumes(saved, family, tmp_path):
    """generate diffusers --scheduler NAME --chain scheduler: the job records both, runs the scheduler's
    chain, and a resumed job is the same; a name that is no scheduler is refused before any work."""
    out = tmp_path / "job"
    extra = ("--scheduler", "DDPMScheduler", "--chain", "scheduler", "--method", "rmc", "--L", 4)
    res = _generate(saved, family, out, *extra)
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "job.json").read_text())
    assert meta["options"]["sampler"]["chain"] == "scheduler"
    assert meta["options"]["model_options"]["scheduler"] == "DDPMScheduler"
    again = _generate(saved, family, out, *extra, "--resume")
    assert again.exit_code == 0, again.output
    bad = _generate(saved, family, tmp_path / "bad", "--scheduler", "NoSuchScheduler", "--chain", "scheduler")
    assert bad.exit_code != 0 and "is not a diffusers scheduler" in bad.output
    assert not (tmp_path / "bad").exists()


# -- every option checked before the pipeline loads; records that say what ran ---------------------------

REFUSED_BEFORE_LOADING = [
    (["--chain", "ddpm", "--eta", 0.3], ["--eta is not a parameter of chain 'ddpm'"]),
    (["--chain", "euler_ancestral", "--eta", "nan"], ["--eta", "eta"]),
    (["--chain", "euler", "--s-churn", -1], ["--s-churn", "s_churn"]),
    (["--chain", "scheduler", "--s-noise", 0.5], ["--s-noise", "--chain scheduler"]),
    (["--scheduler", "NoSuchScheduler"], ["--scheduler", "is not a diffusers scheduler"]),
    (["--chain", "scheduler"], ["--chain scheduler", "PNDMScheduler", "from_config"]),  # SD 1.5's own: deterministic
    # an eta the scheduler's step does not read (item 2), and one that makes a DDIM step's variance negative (item 3)
    (
        ["--scheduler", "EulerAncestralDiscreteScheduler", "--chain", "scheduler", "--eta", 0.5],
        ["--eta", "EulerAncestralDiscreteScheduler's step takes no eta"],
    ),
    (["--scheduler", "DDIMScheduler", "--chain", "scheduler", "--eta", 3], ["--eta", "negative variance at step"]),
    (["--scheduler", "DDIMScheduler", "--chain", "scheduler", "--eta", "nan"], ["--eta", "nan"]),
]


@pytest.mark.parametrize("command", ["diffusers", "generate"])
@pytest.mark.parametrize("args, named", REFUSED_BEFORE_LOADING, ids=lambda v: " ".join(map(str, v))[:40])
def test_every_chain_option_is_refused_before_the_pipeline_is_loaded(saved, tmp_path, no_work, command, args, named):
    """A wrong chain option, scheduler or eta is a usage error naming the flag, and the pipeline is never
    loaded (``no_work`` makes loading raise), nothing written."""
    from helpers import refused

    out = tmp_path / "out"
    res = run_diffusers(saved, "sd", out, *args) if command == "diffusers" else _generate(saved, "sd", out, *args)
    refused(res, *named)
    assert not out.exists() and not list(tmp_path.iterdir())


def test_generate_diffusers_refuses_grid_it_would_not_run(saved, tmp_path, no_work):
    from helpers import refused

    refused(_generate(saved, "sd", tmp_path / "out", "--grid", "uniform"), "--grid", "scheduler grid")


def test_diffusers_records_say_what_ran(saved, tmp_path):
    """churn is null with a chain other than em (item 7), eta is the chain's (null where the scheduler's step
    takes none), and a generate diffusers job records no named grid (its scheduler's grid ran)."""
    out = tmp_path / "ddim"
    assert run_diffusers(saved, "sd", out, "--chain", "ddim", "--method", "standard").exit_code == 0
    opts = json.loads((out / "run.json").read_text())["options"]
    # (the chain's own eta, 1, ran: not the --eta that was not given)
    assert opts["chain"] == "ddim" and opts["churn"] is None and opts["eta"] == opts["chain_params"]["eta"] == 1.0
    out = tmp_path / "ea"
    extra = ("--scheduler", "EulerAncestralDiscreteScheduler", "--chain", "scheduler", "--method", "standard")
    assert run_diffusers(saved, "sd", out, *extra).exit_code == 0
    rec = json.loads((out / "run.json").read_text())
    assert rec["options"]["churn"] is None and rec["options"]["eta"] is None
    assert rec["options"]["chain_params"] == {"scheduler": "EulerAncestralDiscreteScheduler", "eta": None}
    assert rec["config"]["eta"] is None and rec["config"]["scheduler"] == "EulerAncestralDiscreteScheduler"
    res = _generate(saved, "sd", tmp_path / "job", *extra)
    assert res.exit_code == 0, res.output
    sampler = json.loads((tmp_path / "job.json").read_text())["options"]["sampler"]
    assert sampler["grid"] is None and sampler["churn"] is None and sampler["chain_params"] == {"eta": None}
    # a job written before (grid flow_match, eta 0.0 recorded for a step that takes none) resumes as the same job
    meta = json.loads((tmp_path / "job.json").read_text())
    meta["options"]["sampler"].update(grid="flow_match", chain_params={"eta": 0.0})
    (tmp_path / "job.json").write_text(json.dumps(meta))
    again = _generate(saved, "sd", tmp_path / "job", *extra, "--resume")
    assert again.exit_code == 0 and "nothing to do" in again.output, again.output
