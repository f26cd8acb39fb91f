"""The light core install: sampling needs only the core dependencies, extras say what they need."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import tomllib
import torch

ROOT = Path(__file__).resolve().parents[1]
META = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    """The normalized distribution name of a requirement ("scikit-learn>=1.3" -> "scikit-learn")."""
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def _imports() -> "dict[str, bool]":
    """Every third-party top-level module ``src/specforest`` imports -> whether some import of it is
    unguarded (not inside a ``try`` that catches ``ImportError``: an optional import with a fallback)."""
    found: "dict[str, bool]" = {}

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.Try):
            caught = {
                n.id
                for h in node.handlers
                for n in ast.walk(h.type or ast.Name("BaseException"))
                if isinstance(n, ast.Name)
            }
            inner = guarded or bool(caught & {"ImportError", "ModuleNotFoundError", "BaseException", "Exception"})
            for child in node.body:
                visit(child, inner)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, guarded)
            return
        mods = []
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            mods = [node.module]
        for m in mods:
            top = m.split(".")[0]
            if top != "specforest" and top not in sys.stdlib_module_names:
                found[top] = found.get(top, False) or not guarded
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    for path in sorted((ROOT / "src" / "specforest").rglob("*.py")):
        visit(ast.parse(path.read_text()), False)
    return found


IMPORTS = _imports()
CORE = {_name(r) for r in META["dependencies"]}
DISTRIBUTIONS = importlib.metadata.packages_distributions()
# the modules of the extras: what a core-only install lacks
EXTRAS_ONLY = sorted(m for m in IMPORTS if not {_name(d) for d in DISTRIBUTIONS.get(m, [m])} & CORE)

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


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK + textwrap.dedent(code), *args], capture_output=True, text=True, timeout=300
    )


def test_every_import_is_declared_and_every_core_dependency_is_used():
    extras = {name: {_name(r) for r in reqs} for name, reqs in META["optional-dependencies"].items()}
    declared = CORE.union(*extras.values())
    undeclared = {
        m: DISTRIBUTIONS.get(m)
        for m, unguarded in IMPORTS.items()
        if unguarded and not {_name(d) for d in DISTRIBUTIONS.get(m, [m])} & declared
    }
    assert not undeclared, f"imported without a fallback but declared nowhere in pyproject.toml: {undeclared}"
    imported = {_name(d) for m, unguarded in IMPORTS.items() if unguarded for d in DISTRIBUTIONS.get(m, [m])}
    assert CORE <= imported, f"core dependencies nothing imports: {CORE - imported}"
    # `all` is every extra a user installs (the test tools aside)
    (everything,) = META["optional-dependencies"]["all"]
    assert set(re.fullmatch(r"specforest\[(.*)\]", everything).group(1).split(",")) == set(extras) - {"test", "all"}
    assert EXTRAS_ONLY and "click" in EXTRAS_ONLY  # the block below has something to block


# a mixture and a digits run on one thread (so that the samples do not depend on the thread count),
# saved to OUT
SAMPLE = """
import torch, specforest
from specforest.models import GaussianMixture
from specforest.models.digits import load_velocity
threads = torch.get_num_threads()
torch.set_num_threads(1)
try:
    gmm = GaussianMixture.paper(dim=4, components=2, seed=0)
    x = specforest.streams.randn(0, torch.arange(8), (4,))
    out = specforest.sample(gmm, x, steps=8, churn=0.3, seed=0, tree=specforest.trees.uniform(2, 2))
    y = specforest.sample(load_velocity(), specforest.streams.randn(1, torch.arange(2), (1, 8, 8)), steps=5,
                          churn=0.3, seed=0, cond={"class_labels": torch.tensor([1, 2])}, tree=specforest.trees.chain(3))
    torch.save([out.samples, y.samples], OUT)
finally:
    torch.set_num_threads(threads)
"""


def test_sampling_and_the_checker_work_without_any_extra(tmp_path):
    """The core install samples exactly as the full one (the same samples, bitwise) and runs the checker."""
    core, full = tmp_path / "core.pt", tmp_path / "full.pt"
    checker = (
        'import specforest.testing\nspecforest.testing.check_coupling("grs", draws=20_000, deltas=[1.0]).assert_exact()'
    )
    # the last line imports an extra: it must fail
    code = f"import sys\nOUT = sys.argv[1]\n{SAMPLE}\n{checker}\nprint('sampled')\nimport click\n"
    res = _run(code, str(core))
    # everything ran; only the last line, an extra's import, failed: the block is in force
    assert res.stdout.strip() == "sampled", res.stderr
    assert "ModuleNotFoundError: No module named 'click'" in res.stderr, res.stderr
    exec(SAMPLE, {"OUT": str(full)})
    for a, b in zip(torch.load(core), torch.load(full), strict=True):
        assert torch.equal(a, b)


def test_the_command_and_the_figures_name_the_extra_that_provides_what_they_miss():
    res = _run(
        """
        from specforest.plots import pyplot
        try:
            pyplot()
        except ImportError as e:
            print(e)
        import sys; sys.argv = ['specforest', '--help']; from specforest.__main__ import main; main()
        """
    )
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    extras = META["optional-dependencies"]
    for message, package in ((res.stdout, "matplotlib"), (res.stderr, "click")):
        extra = re.search(r"pip install 'specforest\[(\w+)\]'", message)
        assert extra and package in message, message
        assert package in {_name(r) for r in extras[extra.group(1)]}, (message, extras[extra.group(1)])
