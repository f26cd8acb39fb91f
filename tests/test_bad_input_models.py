"""Bad input to the shipped models, the weights loader and the mixture sizes (issue 40, items 6-9).

Each case is refused with an error that names the parameter (or the option) and what it
accepts, before the work it would spoil: mixture sizes the memory limit cannot hold before
anything is allocated (the mixture is never drawn, no state is made); a state of another shape
than the network serves, or a class label outside its range, at the call, before the network
runs; a weights path by what is wrong with it (missing, a folder, not a safetensors file, the
other kind of weights). The property tests (hypothesis, derandomized) draw the new bounds.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

import specforest
from specforest import memory, planning, trees
from specforest.cli import main as cli_main
from specforest.experiments import gmm as gmm_exp
from specforest.experiments.gmm import run as gmm_run
from specforest.models import GaussianMixture, digits, unet

PROPERTY = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
BIG = 10**8  # the sizes: a mixture, states or samples of hundreds of GB


@pytest.fixture(scope="module")
def velocity():
    return digits.load_velocity()


@pytest.fixture(scope="module")
def denoiser():
    return digits.load_denoiser()


@pytest.fixture(scope="module")
def draft_velocity():
    return digits.load_draft_velocity()


@pytest.fixture(scope="module")
def classifier():
    return digits.load_classifier()


def _never(what: str):
    def called(*args, **kwargs):
        raise AssertionError(f"{what} was made: the run was not refused before it")

    return called


@pytest.fixture
def nothing_allocated(monkeypatch):
    """The mixture is never drawn and no initial state made: a refusal comes before both."""
    monkeypatch.setattr(gmm_exp.GMMSetting, "mixture", _never("the mixture"))
    monkeypatch.setattr(gmm_run, "initial_states", _never("the initial states"))
    monkeypatch.setattr(gmm_run, "plan_tree", _never("the calibration"))


# -- item 6: mixture sizes the memory limit cannot hold ------------------------------------------


@pytest.mark.parametrize(
    "args,named",
    [
        (["--trajectories", "2", "--dim", str(BIG)], f"--dim {BIG}"),
        (["--components", str(BIG)], f"--components {BIG}"),
        (["--trajectories", str(BIG)], f"--trajectories {BIG}"),
    ],
)
def test_cli_refuses_huge_mixture_sizes_naming_the_option_and_the_limit(nothing_allocated, args, named):
    # the commands, under the default limit (50% of RAM: none of these fits under a TB)
    res = CliRunner().invoke(cli_main, ["gmm", "--no-progress", *args])
    assert isinstance(res.exception, SystemExit), (res.exception, res.output)
    assert res.exit_code == 1, res.output
    assert "Error: this run does not fit the memory limit of" in res.output
    assert "(50% of physical RAM)" in res.output or "(default of 8 GB" in res.output
    assert named in res.output


def test_cli_names_a_given_limit(nothing_allocated, tmp_path):
    out = tmp_path / "samples.npz"
    args = ["gmm", "--no-progress", "--dim", str(BIG), "--memory-gb", "2", "--dump-samples", str(out)]
    res = CliRunner().invoke(cli_main, args)
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), (res.exception, res.output)
    # (in the command's flags: the library names its keywords memory_gb and dim)
    assert "memory limit of 2 GB (--memory-gb 2)" in res.output and f"--dim {BIG}" in res.output
    assert not out.exists()


@pytest.mark.parametrize(
    "sizes,named",
    [
        (dict(dim=BIG, trajectories=2), "dim"),
        (dict(components=BIG), "components"),
        (dict(trajectories=BIG), "trajectories"),
    ],
)
def test_simulate_refuses_huge_mixture_sizes_before_drawing_anything(nothing_allocated, sizes, named):
    setting = gmm_exp.GMMSetting(**sizes)
    for method in ("standard", "dgrs"):
        with pytest.raises(MemoryError, match=rf"memory limit of 4 GB \(memory_gb=4\).*{named}={BIG}") as e:
            gmm_exp.simulate(setting, method=method, K=2, L=2, memory_gb=4)
        # what the run holds whole comes first, naming the option to lower
        assert f"Lower {named}" in str(e.value)
    with pytest.raises(MemoryError, match=f"{named}={BIG}"):
        gmm_exp.run_config(setting, method="rmc", L=3, lazy=True, memory_gb=4)


def test_a_mixture_that_fits_beside_a_tree_that_does_not_still_names_its_size(nothing_allocated):
    # 8 GB of parameters fit 64 GB; the (6, 6) tree of 1e8-element states does not: the tree is refused,
    # and the message still says what the mixture and the states take
    with pytest.raises(MemoryError, match=rf"does not fit.*55987 states.*components=5 x dim={BIG}"):
        gmm_exp.simulate(gmm_exp.GMMSetting(dim=BIG, trajectories=2), memory_gb=64)


def test_a_planned_trees_calibration_is_sized_before_it_draws_the_mixture(nothing_allocated):
    with pytest.raises(MemoryError, match=rf"calibration's 16 initial states.*dim={BIG}"):
        gmm_exp.simulate(gmm_exp.GMMSetting(dim=BIG, trajectories=2), tree="optimal", budget=4, memory_gb=20)


def test_the_paper_mixture_refuses_parameters_no_machine_holds():
    with pytest.raises(MemoryError, match=rf"components={BIG} x dim={BIG}.*physical memory: lower components or dim"):
        GaussianMixture.paper(dim=BIG, components=BIG)


def test_a_mixture_declares_its_costs_before_it_is_drawn():
    gmm = GaussianMixture.paper(dim=12, components=3)
    x = torch.zeros(1, 12)
    assert gmm.size == gmm_exp.GMMSetting(dim=12, components=3).mixture().size
    assert gmm.row_bytes(x) == gmm.size.row_bytes(x) == (2 * 12 + 7 * 3) * 4
    assert gmm.size.row_bytes(torch.empty(1, 12, device="meta", dtype=torch.float64)) == (2 * 12 + 7 * 3) * 8
    assert gmm.size.feature_numel((12,)) == gmm.feature_numel((12,)) == 3


def test_check_held_counts_the_parts_and_names_the_largest_parts_options():
    parts = (
        memory.Held("a", (("components", 5), ("dim", 100)), 3_000_000_000),
        memory.Held("b", (("trajectories", 7), ("dim", 100)), 1_000_000_000),
    )
    assert memory.check_held(parts, limit_bytes=5 * 10**9, limit_source="x", fixed_bytes=10**9) == 4 * 10**9
    with pytest.raises(
        MemoryError, match=r"limit of 4.5 GB \(x\).*a \(components=5 x dim=100\) 3 GB.*Lower dim or comp"
    ):
        memory.check_held(parts, limit_bytes=45 * 10**8, limit_source="x", fixed_bytes=10**9)
    with pytest.raises(MemoryError, match="Raise the memory limit"):
        memory.check_held((), limit_bytes=1, limit_source="x", fixed_bytes=2)


def test_returned_bytes_count_the_samples_and_statistics_of_every_trajectory():
    D = 10
    assert memory.returned_bytes(3, D, None, steps=20) == 3 * (4 * D + 8 * 5)
    assert memory.returned_bytes(3, D, trees.chain(7), steps=20) == 3 * (4 * D + 8 * (5 + 4 * 7))
    policy = planning.AdaptiveTree(40)  # its rounds at most the grid's 20 steps deep
    assert memory.returned_bytes(1, D, policy, steps=20, work_bytes=8) == 8 * D + 8 * (5 + 4 * 20)


@PROPERTY
@given(
    option=st.sampled_from(["dim", "components", "trajectories"]),
    value=st.integers(2 * 10**8, 10**15),  # more than 2 GB whatever the other sizes
    others=st.fixed_dictionaries(
        {"dim": st.integers(1, 64), "components": st.integers(1, 8), "trajectories": st.integers(1, 64)}
    ),
    memory_gb=st.sampled_from([0.5, 1.0, 2.0]),
    method=st.sampled_from(["standard", "rmc", "dgrs"]),
)
def test_random_huge_mixture_sizes_are_refused_by_name_before_anything_is_drawn(
    option, value, others, memory_gb, method
):
    setting = gmm_exp.GMMSetting(**{**others, option: value})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gmm_exp.GMMSetting, "mixture", _never("the mixture"))
        mp.setattr(gmm_run, "initial_states", _never("the initial states"))
        with pytest.raises(MemoryError) as e:
            gmm_exp.simulate(setting, method=method, K=2, L=2, memory_gb=memory_gb)
    msg = str(e.value)
    assert f"memory limit of {memory_gb:g} GB (memory_gb={memory_gb:g})" in msg
    assert f"{option}={value}" in msg


# -- item 7: the state shape the digits networks serve --------------------------------------------

WRONG_SHAPES = [(8, 3, 8, 8), (8, 1, 9, 9), (8, 1, 16, 16), (8, 64), (8, 1, 8), (8, 1, 8, 8, 1)]


def _refused_shape(shape):
    """The error of a state of ``shape``: the shape served and the one given (its rows aside)."""
    rest = ", ".join(map(str, shape[1:]))
    return pytest.raises(ValueError, match=rf"x must have shape \(M, 1, 8, 8\).*, got \(\d+, {rest}\)")


@pytest.mark.parametrize("shape", WRONG_SHAPES)
def test_digits_networks_refuse_a_state_of_another_shape(velocity, denoiser, draft_velocity, shape):
    x, s = torch.zeros(shape), torch.full((shape[0],), 0.5)
    for call in (
        lambda: velocity(x, s, class_labels=3),
        lambda: draft_velocity(x, s),
        lambda: denoiser(x, s),
        lambda: denoiser.net(x, s),
        lambda: velocity.with_features(x, s),
        lambda: velocity.from_features(x, s, torch.zeros(shape[0], 32 * 64)),
        lambda: velocity.feature_numel(shape[1:]),
    ):
        with _refused_shape(shape):
            call()


@pytest.mark.parametrize("shape", WRONG_SHAPES)
def test_the_classifier_refuses_an_image_of_another_shape(classifier, shape):
    x = torch.zeros(shape)
    for call in (classifier, classifier.predict, classifier.embed):
        with pytest.raises(ValueError, match=r"x must have shape \(M, 1, 8, 8\).*classifier serves"):
            call(x)


def test_sampling_the_digits_model_at_another_shape_is_refused(velocity):
    x = torch.zeros(2, 1, 16, 16)  # ran, and returned 16 x 16 "digits"
    with _refused_shape(x.shape):
        specforest.sample(velocity, x, steps=3, churn=0.5, seed=0)
    with _refused_shape((1, 1, 16, 16)):  # the cached draft counts the features before sampling
        specforest.sample(velocity, x, steps=3, churn=0.5, seed=0, tree=trees.chain(2), draft="cached")


def test_features_of_another_shape_are_refused(velocity):
    x, s = torch.zeros(4, 1, 8, 8), torch.full((4,), 0.5)
    F = velocity.feature_numel((1, 8, 8))
    for feat in (torch.zeros(4, F - 1), torch.zeros(3, F), torch.zeros(4, 16, 8, 8)):
        with pytest.raises(ValueError, match=rf"feat must have shape \(4, 32, 8, 8\) or \(4, {F}\)"):
            velocity.from_features(x, s, feat)
    _, feat = velocity.with_features(x, s)
    assert velocity.from_features(x, s, feat.reshape(4, 32, 8, 8)).shape == x.shape


@PROPERTY
@given(shape=st.lists(st.integers(1, 12), min_size=1, max_size=5).map(tuple))
def test_random_state_shapes_other_than_the_served_one_are_refused(denoiser, classifier, shape):
    x = torch.zeros(shape)
    if shape[1:] == digits.IMAGE_SHAPE:
        assert denoiser(x, torch.full((shape[0],), 0.5)).shape == shape
        assert classifier(x).shape == (shape[0], digits.NUM_CLASSES)
        return
    with pytest.raises(ValueError, match=r"x must have shape \(M, 1, 8, 8\)"):
        denoiser(x, torch.full((shape[0],), 0.5))
    with pytest.raises(ValueError, match=r"x must have shape \(M, 1, 8, 8\)"):
        classifier(x)


# -- item 8: class labels ------------------------------------------------------------------------

LABELS = r"class_labels must be in \[0, 9\], or 10 \(the unconditional label\) or None"


@pytest.mark.parametrize("labels", [11, -1, torch.tensor([0, 11]), torch.tensor([-1, 3]), torch.tensor([3, 100])])
def test_labels_outside_the_models_range_are_refused(velocity, denoiser, draft_velocity, labels):
    x, s = torch.zeros(2, 1, 8, 8), torch.full((2,), 0.5)
    feat = torch.zeros(2, velocity.feature_numel((1, 8, 8)))
    for call in (
        lambda: velocity(x, s, class_labels=labels),
        lambda: draft_velocity(x, s, class_labels=labels),
        lambda: denoiser(x, s, class_labels=labels),
        lambda: velocity.with_features(x, s, class_labels=labels),
        lambda: velocity.from_features(x, s, feat, class_labels=labels),
    ):
        with pytest.raises(ValueError, match=LABELS + r", got (11|-1|100)"):
            call()


def test_sampling_with_an_out_of_range_label_is_refused(velocity):
    x = torch.zeros(2, 1, 8, 8)
    with pytest.raises(ValueError, match=LABELS + ", got 12"):
        specforest.sample(velocity, x, steps=3, churn=0.5, seed=0, cond={"class_labels": torch.tensor([3, 12])})


def test_the_unconditional_label_is_the_models_own(denoiser):
    x, s = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0)), torch.full((3,), 0.4)
    torch.testing.assert_close(denoiser(x, s, class_labels=10), denoiser(x, s, class_labels=None), rtol=0, atol=0)


def test_labels_off_the_cpu_are_not_read_in_the_call():
    # a read there would be a host-device synchronization in every target call: labels on an
    # accelerator are left to where they enter (a meta tensor cannot be read at all)
    unet.check_labels(torch.full((4,), 11, device="meta"), 10)
    with pytest.raises(ValueError, match=LABELS):
        unet.check_labels(torch.full((4,), 11), 10)
    with pytest.raises(ValueError, match=r"class_labels must be in 0 \(the unconditional label\) or None, got 1"):
        unet.check_labels(torch.ones(2, dtype=torch.long), 0)


@PROPERTY
@given(labels=st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=4))
def test_random_labels_are_refused_outside_the_range_and_run_inside(denoiser, labels):
    x, s = torch.zeros(len(labels), 1, 8, 8), torch.full((len(labels),), 0.5)
    t = torch.tensor(labels)
    if all(0 <= v <= digits.NUM_CLASSES for v in labels):
        assert denoiser(x, s, class_labels=t).shape == x.shape
        return
    bad = min(labels) if min(labels) < 0 else max(labels)
    with pytest.raises(ValueError, match=LABELS + f", got {bad}$"):
        denoiser(x, s, class_labels=t)
    with pytest.raises(ValueError, match=LABELS + f", got {bad}$"):
        denoiser(x[:1], s[:1], class_labels=bad)  # one Python integer for every row


# -- item 9: the weights loaders say what is wrong with a path ------------------------------------

LOADERS = [digits.load_velocity, digits.load_denoiser, digits.load_draft_velocity, digits.load_classifier]


@pytest.mark.parametrize("load", LOADERS)
def test_a_missing_file_next_to_a_manifest_is_said_to_be_missing(load):
    path = digits.WEIGHTS_DIR / "missing.safetensors"
    with pytest.raises(FileNotFoundError, match=r"weights file .*missing.safetensors does not exist"):
        load(path)


@pytest.mark.parametrize("load", LOADERS)
def test_a_folder_as_path_is_said_to_be_a_folder(load, tmp_path):
    for folder in (tmp_path, digits.WEIGHTS_DIR):
        with pytest.raises(digits.WeightsFileError, match=r"path must be a safetensors weights file, .* is a folder"):
            load(folder)
        with pytest.raises(digits.WeightsFileError, match="is a folder"):
            load(folder, sha256="0" * 64)


def _corrupt_files(tmp_path: Path) -> list[Path]:
    real = (digits.WEIGHTS_DIR / digits.UNET_FILE).read_bytes()
    n = int.from_bytes(real[:8], "little")
    contents = {
        "random.safetensors": bytes(range(256)) * 40,
        "truncated.safetensors": real[: len(real) // 2],
        "short.safetensors": b"\x01\x02",
        "empty.safetensors": b"",
        "huge_header.safetensors": (2**62).to_bytes(8, "little") + real[8:],
        "list_header.safetensors": (2).to_bytes(8, "little") + b"[]",
        "bad_metadata.safetensors": (24).to_bytes(8, "little") + b'{"__metadata__": [1, 2]}',
        "not_utf8.safetensors": n.to_bytes(8, "little") + b"\xff" * n + real[8 + n :],
    }
    paths = []
    for name, data in contents.items():
        (tmp_path / name).write_bytes(data)
        paths.append(tmp_path / name)
    return paths


@pytest.mark.parametrize("load", LOADERS)
def test_a_corrupt_file_with_its_own_sha256_is_said_to_be_no_safetensors_file(load, tmp_path):
    for path in _corrupt_files(tmp_path):
        with pytest.raises(digits.WeightsFileError, match=r"is not a valid safetensors file"):
            load(path, sha256=digits.sha256_file(path))


def _weights_with_metadata(tmp_path: Path, metadata: dict) -> tuple[Path, str]:
    path = tmp_path / "other.safetensors"
    path.write_bytes(save({"w": torch.zeros(2)}, metadata=metadata))
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_other_kind_of_weights_is_named(tmp_path):
    clf, unet = digits.WEIGHTS_DIR / digits.CLASSIFIER_FILE, digits.WEIGHTS_DIR / digits.UNET_FILE
    for load in (digits.load_velocity, digits.load_denoiser, digits.load_draft_velocity):
        with pytest.raises(
            digits.WeightsFileError, match=r"is not a digits U-Net's weights .*: it holds the digits class"
        ):
            load(clf)  # the manifest next to it records its digest: what was a KeyError: 'config'
    with pytest.raises(
        digits.WeightsFileError, match=r"is not the digits classifier's weights .*: it holds a digits U-Net"
    ):
        digits.load_classifier(unet)
    path, sha = _weights_with_metadata(tmp_path, {"note": "mine"})
    for load in LOADERS:
        with pytest.raises(digits.WeightsFileError, match="its metadata name no specforest weights"):
            load(path, sha256=sha)


def test_a_file_of_the_right_kind_with_other_tensors_is_refused(tmp_path):
    cfg = '{"img_channels": 1, "img_resolution": 8, "channels": [32, 64, 96], "emb_dim": 128, "num_classes": 10}'
    for meta, load in (({"config": cfg}, digits.load_denoiser), ({"width": "32"}, digits.load_classifier)):
        path, sha = _weights_with_metadata(tmp_path, meta)
        with pytest.raises(digits.WeightsFileError, match=r"(?s)is not valid as .*Missing key"):
            load(path, sha256=sha)
    path, sha = _weights_with_metadata(tmp_path, {"config": "{not json"})
    with pytest.raises(digits.WeightsFileError, match="is not valid as a digits U-Net's weights"):
        digits.load_denoiser(path, sha256=sha)


def test_a_file_in_a_folder_without_a_manifest_asks_for_its_sha256(tmp_path):
    path = tmp_path / "copy.safetensors"
    shutil.copy(digits.WEIGHTS_DIR / digits.UNET_FILE, path)
    with pytest.raises(
        digits.ChecksumError, match=r"no SHA-256 recorded for .*: no manifest.json next to it; pass sha256="
    ):
        digits.load_denoiser(path)
    (tmp_path / digits.MANIFEST).write_text("{not json")
    with pytest.raises(digits.WeightsFileError, match="manifest .* is not valid JSON"):
        digits.load_denoiser(path)
    (tmp_path / digits.MANIFEST).write_text('{"copy.safetensors": 3}')
    with pytest.raises(digits.ChecksumError, match="no SHA-256 recorded for .* in .*manifest.json"):
        digits.load_denoiser(path)


@pytest.mark.parametrize(
    "sha256,error", [(5, TypeError), (b"0" * 64, TypeError), ("xyz", ValueError), ("g" * 64, ValueError)]
)
def test_a_malformed_sha256_is_refused_by_name(sha256, error):
    for path in (None, digits.WEIGHTS_DIR / digits.UNET_FILE):
        with pytest.raises(error, match=r"sha256 must be a hex SHA-256 digest \(64 hex digits\) or None"):
            digits.load_denoiser(path, sha256=sha256)


def test_the_denoiser_refuses_noise_levels_of_another_length(denoiser):
    x = torch.zeros(4, 1, 8, 8)
    for sigma in (torch.full((3,), 0.5), torch.full((4, 2), 0.5)):
        with pytest.raises(ValueError, match=r"sigma must be a scalar or have shape \(4,\), got"):
            denoiser(x, sigma)
    assert denoiser(x, 0.5).shape == denoiser(x, torch.full((4,), 0.5)).shape == x.shape


def test_the_mixture_refuses_responsibilities_of_another_shape():
    gmm = GaussianMixture.paper(dim=6, components=3)
    x, s = torch.zeros(4, 6), torch.full((4,), 0.5)
    for r in (torch.zeros(4, 2), torch.zeros(3, 3), torch.zeros(4, 3, 1)):
        with pytest.raises(ValueError, match=r"r must have shape \(4, 3\)"):
            gmm.from_features(x, s, r)
    _, r = gmm.with_features(x, s)
    torch.testing.assert_close(gmm.from_features(x, s, r), gmm(x, s), rtol=0, atol=0)
