"""The light core install: sampling needs only the core dependencies, extras say what they need."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
EXTRAS_ONLY = ("click", "matplotlib", "sklearn", "diffusers", "transformers", "accelerate")

# A meta-path finder that makes the extras' packages unimportable, as in a core-only install.
BLOCK = textwrap.dedent(
    f"""
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {EXTRAS_ONLY!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None
    sys.meta_path.insert(0, Block())
    """
)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK + textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )


def test_core_dependencies_are_what_sampling_needs():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in meta["dependencies"]}
    assert core == {"torch", "numpy", "scipy", "safetensors", "tqdm"}
    extras = meta["optional-dependencies"]
    assert {"cli", "digits", "diffusers", "test", "all"} <= set(extras)
    assert extras["all"] == ["specforest[cli,digits,diffusers]"]


def test_sampling_and_the_checker_work_without_any_extra():
    res = _run(
        """
        import torch, specforest, specforest.testing
        from specforest.models import GaussianMixture
        from specforest.models.digits import load_velocity
        gmm = GaussianMixture.paper(dim=4, components=2, seed=0)
        x = specforest.streams.randn(0, torch.arange(8), (4,))
        out = specforest.sample(gmm, x, steps=8, churn=0.3, seed=0, tree=specforest.trees.uniform(2, 2))
        assert torch.isfinite(out.samples).all()
        v = load_velocity()
        y = specforest.sample(v, torch.randn(2, 1, 8, 8), steps=5, churn=0.3, seed=0,
                              cond={"class_labels": torch.tensor([1, 2])}, tree=specforest.trees.chain(3))
        assert torch.isfinite(y.samples).all()
        print("sampled")
        import click
        """
    )
    # everything ran; only the last line, an extra's import, failed: the block is in force
    assert res.stdout.strip() == "sampled", res.stderr
    assert "ModuleNotFoundError: No module named 'click'" in res.stderr, res.stderr


def test_the_command_says_which_extra_it_needs():
    res = _run("import sys; sys.argv = ['specforest', '--help']; from specforest.__main__ import main; main()")
    assert res.returncode != 0
    assert "pip install 'specforest[cli]'" in res.stderr and "Traceback" not in res.stderr


def test_figures_say_which_extra_they_need():
    res = _run(
        """
        from specforest.plots import pyplot
        try:
            pyplot()
        except ImportError as e:
            print(e)
        """
    )
    assert "pip install 'specforest[cli]'" in res.stdout, res.stderr
